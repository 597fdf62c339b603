// Decode-context-parallel test scaffolding shared by the CPU (simulated ranks) and NCCL tests:
// a batch of requests with every global K/V position, and rank r's shard of the paged cache.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "flashserve/backend.hpp"
#include "support/host_tensor.hpp"

namespace fstest {

// A batch of decode / verify requests: global KV lengths, q_len new tokens each (the last
// positions).
struct DcpBatch {
  int64_t q_len = 1, H_kv = 2;
  std::vector<int32_t> seq_lens, qsl{0};
  std::vector<HostTensor> k, v;  // per request, every global position [seq_len, H_kv, D]
  int64_t B() const { return int64_t(seq_lens.size()); }
  int64_t T() const { return qsl.back(); }
};

// One cache (the whole one, or rank r's shard) and its metadata inputs.
struct DcpShard {
  std::vector<std::vector<int32_t>> blocks;  // per request
  HostTensor kc, vc, table, slots;           // slots: the new tokens' (-1: not on this shard)
  flashserve::backend::KvCache cache() const { return {.key_cache = kc.ref, .value_cache = vc.ref}; }
};

// The step's new K/V [T, H_kv, head_dim] in `dtype`: each request's last q_len positions.
struct DcpNewKv {
  HostTensor key, value;
};
DcpNewKv dcp_new_kv(const DcpBatch& bt, int64_t head_dim, flashserve::DType dtype);

struct DcpShardShape {
  int64_t block_size = 16, head_dim = 64;
  flashserve::DType dtype = flashserve::DType::f32;  // the caches'
  bool poison = true;                                // unwritten cache slots hold NaN
};

// A MetadataBuilder config for rank r of W with interleave il, sized for the DCP tests' batches
// (256 tokens, 16 requests of at most max_blocks_per_req blocks); device, stream and splits
// stay the defaults.
flashserve::backend::BuilderConfig dcp_builder_config(const flashserve::backend::LayerSpec& spec, int W, int r,
                                                      int64_t il, int64_t block_size, int64_t max_blocks_per_req,
                                                      int threshold);

// The shard of rank r of W (W = 1: the whole cache) with interleave il, filled through
// reshape_and_cache with slot -1 for the positions another rank owns: every position, or
// (context_only) those before the step's new tokens, which the layer writes. Blocks are
// shuffled over the pool.
DcpShard make_dcp_shard(const DcpBatch& bt, int W, int r, int64_t il, bool context_only, std::mt19937_64& rng,
                        const DcpShardShape& shape);

}  // namespace fstest
