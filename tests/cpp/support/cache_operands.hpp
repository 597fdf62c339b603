// Test support for the KV-cache operations (cache.hpp), shared by the CPU and GPU cache tests:
// reshape_and_cache cases and their (padded, dense or interleaved) caches, fp8 scales, random
// slot mappings, and the (src, dst) block mappings of copy_blocks / swap_blocks.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flashserve/cache.hpp"
#include "support/host_tensor.hpp"

namespace fstest {

struct WriteCase {
  flashserve::KvLayout layout;
  bool interleaved;  // K and V halves of one [nb, 2, ...] buffer
  bool dense;        // contiguous caches (the kernels' vector path)
  int64_t block_size;
  flashserve::KvCacheDType mode;
  flashserve::DType dtype;    // key/value
  flashserve::DType fp8_tag;  // fp8 caches: u8 or the f8 format
  int scale_rank;             // fp8 scales: 0 -> [], 1 -> [1], 2 -> [H_kv]
  std::string str() const;
  bool fp8() const;
  bool int8() const;
  flashserve::DType fp8_format() const;
  flashserve::DType key_cache_dtype() const;
  flashserve::DType value_cache_dtype() const;
};

// The K and V cache buffers (one when interleaved) and their views.
struct Caches {
  HostTensor kb, vb;
  flashserve::TensorRef k, v;
  bool shared = false;
};

// [nb, bs, H, D] (NHD) or [nb, H, bs, D] (HND) caches of the case's dtypes: interleaved, dense,
// or with padded rows (K by 2, V by 1 element) and blocks (7 elements).
Caches make_caches(const WriteCase& wc, int64_t nb, int64_t H, int64_t D, int64_t Dv);

// fp8 scale of rank 0 ([]), 1 ([1]) or 2 ([H]), uniform in [lo, hi).
HostTensor fp8_scale(std::mt19937_64& rng, int rank, int64_t H, float lo, float hi);

// Slots of T tokens among num_slots: distinct and shuffled; from token 1 on, about a quarter
// skipped (-1, -2 or -3).
std::vector<int64_t> random_slots(std::mt19937_64& rng, int64_t num_slots, int64_t T);
// An int64 [n] tensor holding `slots`.
HostTensor slot_tensor(const std::vector<int64_t>& slots);

// n (src, dst) block pairs; destinations distinct, and with same_space never a source (drawn
// from one space of dst_blocks), so the order of the pairs does not matter.
std::vector<std::pair<int64_t, int64_t>> block_pairs(std::mt19937_64& rng, int64_t src_blocks, int64_t dst_blocks,
                                                     int64_t n, bool same_space);
// An int64 [n, 2] block mapping with padded rows.
HostTensor mapping_tensor(const std::vector<std::pair<int64_t, int64_t>>& rows);

// advance_step buffers: [R] rows (input_positions strided), sampled_token_ids
// [num_queries + 1, 1] and block_tables [R, max_blocks] with padded rows.
struct StepBuffers {
  HostTensor tokens, positions, slots, lens, sampled, tables;
  std::vector<const HostTensor*> all() const { return {&tokens, &positions, &slots, &lens, &sampled, &tables}; }
  StepBuffers clone() const;
};

// Outputs (tokens, positions, slots) poisoned; sampled ids, table entries and seq_lens random,
// seq_lens below max_blocks * bs.
StepBuffers step_buffers(std::mt19937_64& rng, int64_t R, int64_t num_queries, int64_t bs, int64_t max_blocks);
flashserve::AdvanceStepParams step_params(const StepBuffers& s, int64_t num_seqs, int64_t num_queries, int64_t bs);

}  // namespace fstest
