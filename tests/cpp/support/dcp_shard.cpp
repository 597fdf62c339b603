#include "support/dcp_shard.hpp"

#include <algorithm>
#include <numeric>

#include "flashserve/backend_variants.hpp"
#include "flashserve/cache.hpp"
#include "support/checks.hpp"

namespace fstest {

namespace be = flashserve::backend;
namespace fs = flashserve;

DcpNewKv dcp_new_kv(const DcpBatch& bt, int64_t head_dim, fs::DType dtype) {
  const int64_t T = bt.T(), D = head_dim;
  DcpNewKv n{HostTensor::zeros(dtype, {T, bt.H_kv, D}), HostTensor::zeros(dtype, {T, bt.H_kv, D})};
  for (int64_t b = 0; b < bt.B(); ++b)
    for (int64_t i = 0; i < bt.q_len; ++i)
      for (int64_t h = 0; h < bt.H_kv; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t pos = bt.seq_lens[size_t(b)] - bt.q_len + i, t = bt.qsl[size_t(b)] + i;
          n.key.set({t, h, d}, bt.k[size_t(b)].get({pos, h, d}));
          n.value.set({t, h, d}, bt.v[size_t(b)].get({pos, h, d}));
        }
  return n;
}

be::BuilderConfig dcp_builder_config(const be::LayerSpec& spec, int W, int r, int64_t il, int64_t block_size,
                                     int64_t max_blocks_per_req, int threshold) {
  be::BuilderConfig c;
  c.layer = spec;
  c.block_size = block_size;
  c.max_num_tokens = 256;
  c.max_num_reqs = 16;
  c.max_blocks_per_req = max_blocks_per_req;
  c.reorder_batch_threshold = threshold;
  c.dcp_world_size = W;
  c.dcp_rank = r;
  c.dcp_interleave = il;
  return c;
}

DcpShard make_dcp_shard(const DcpBatch& bt, int W, int r, int64_t il, bool context_only, std::mt19937_64& rng,
                        const DcpShardShape& shape) {
  const int64_t bs = shape.block_size, D = shape.head_dim;
  DcpShard s;
  int64_t nb = 2, width = 1;
  for (int32_t len : bt.seq_lens) nb += (be::DcpAttentionLayer::local_len(len, W, r, il) + bs - 1) / bs;
  std::vector<int32_t> ids(static_cast<size_t>(nb));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  for (int32_t len : bt.seq_lens) {
    const int64_t n = (be::DcpAttentionLayer::local_len(len, W, r, il) + bs - 1) / bs;
    s.blocks.emplace_back(ids.begin() + int64_t(next), ids.begin() + int64_t(next) + n);
    next += size_t(n);
    width = std::max(width, n + 1);
  }
  s.kc = HostTensor::zeros(shape.dtype, {nb, bs, bt.H_kv, D});
  s.vc = HostTensor::zeros(shape.dtype, {nb, bs, bt.H_kv, D});
  if (shape.poison) {
    poison_storage(s.kc);
    poison_storage(s.vc);
  }
  s.table = HostTensor::zeros(flashserve::DType::i32, {bt.B(), width});
  for (int64_t q = 0; q < bt.B(); ++q)
    for (size_t j = 0; j < s.blocks[size_t(q)].size(); ++j) s.table.set({q, int64_t(j)}, float(s.blocks[size_t(q)][j]));
  const auto slot = [&](int64_t q, int64_t pos) -> int64_t {
    if (be::DcpAttentionLayer::owner(pos, W, il) != r) return -1;
    const int64_t local = be::DcpAttentionLayer::local_index(pos, W, il);
    return int64_t(s.blocks[size_t(q)][size_t(local / bs)]) * bs + local % bs;
  };
  for (int64_t q = 0; q < bt.B(); ++q) {
    const int64_t len = bt.seq_lens[size_t(q)];
    HostTensor sm = HostTensor::zeros(flashserve::DType::i64, {len});
    for (int64_t p = 0; p < len; ++p)
      *static_cast<int64_t*>(sm.ref.at(p)) = context_only && p >= len - bt.q_len ? -1 : slot(q, p);
    fs::CacheWriteParams w;
    w.key = bt.k[size_t(q)];
    w.value = bt.v[size_t(q)];
    w.key_cache = s.kc;
    w.value_cache = s.vc;
    w.slot_mapping = sm;
    fs::reshape_and_cache(w);
  }
  s.slots = HostTensor::zeros(flashserve::DType::i64, {bt.T()});
  for (int64_t q = 0; q < bt.B(); ++q)
    for (int64_t i = 0; i < bt.q_len; ++i)
      *static_cast<int64_t*>(s.slots.ref.at(bt.qsl[size_t(q)] + i)) = slot(q, bt.seq_lens[size_t(q)] - bt.q_len + i);
  return s;
}

}  // namespace fstest
