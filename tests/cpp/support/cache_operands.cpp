#include "support/cache_operands.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "support/checks.hpp"

namespace fstest {

namespace fs = flashserve;
using fs::DType;
using fs::KvCacheDType;
using fs::KvLayout;

std::string WriteCase::str() const {
  std::ostringstream os;
  os << (layout == KvLayout::nhd ? "nhd" : "hnd") << (interleaved ? " interleaved" : "") << (dense ? " dense" : " padded")
     << " bs " << block_size << " " << fs::kv_cache_dtype_name(mode) << " " << fs::dtype_name(dtype) << " tag "
     << fs::dtype_name(fp8_tag) << " scale_rank " << scale_rank;
  return os.str();
}

bool WriteCase::fp8() const { return mode == KvCacheDType::fp8_e4m3 || mode == KvCacheDType::fp8_e5m2; }
bool WriteCase::int8() const { return mode == KvCacheDType::int8_k8v8 || mode == KvCacheDType::int8_k8v16; }
DType WriteCase::fp8_format() const { return mode == KvCacheDType::fp8_e5m2 ? DType::f8e5m2 : DType::f8e4m3; }
DType WriteCase::key_cache_dtype() const { return fp8() ? fp8_tag : int8() ? DType::i8 : dtype; }
DType WriteCase::value_cache_dtype() const {
  return fp8() ? fp8_tag : mode == KvCacheDType::int8_k8v8 ? DType::i8 : dtype;
}

Caches make_caches(const WriteCase& wc, int64_t nb, int64_t H, int64_t D, int64_t Dv) {
  const bool nhd = wc.layout == KvLayout::nhd;
  const int64_t bs = wc.block_size;
  const DType kd = wc.key_cache_dtype(), vd = wc.value_cache_dtype();
  if (wc.interleaved) {
    HostTensor b = nhd ? HostTensor::zeros(kd, {nb, 2, bs, H, D}) : HostTensor::zeros(kd, {nb, 2, H, bs, D});
    return {b, b, b.ref.select(1, 0), b.ref.select(1, 1), true};
  }
  auto one = [&](DType t, int64_t w, int64_t pad, int64_t block_pad) {
    const int64_t row = w + pad;
    return nhd ? HostTensor::strided(t, {nb, bs, H, w}, {bs * H * row + block_pad, H * row, row, 1})
               : HostTensor::strided(t, {nb, H, bs, w}, {H * bs * row + block_pad, bs * row, row, 1});
  };
  HostTensor k = wc.dense ? one(kd, D, 0, 0) : one(kd, D, 2, 7);
  HostTensor v = wc.dense ? one(vd, Dv, 0, 0) : one(vd, Dv, 1, 7);
  return {k, v, k.ref, v.ref, false};
}

HostTensor fp8_scale(std::mt19937_64& rng, int rank, int64_t H, float lo, float hi) {
  HostTensor s = rank == 0 ? HostTensor::zeros(DType::f32, {}) : HostTensor::zeros(DType::f32, {rank == 1 ? 1 : H});
  fill_uniform(s, rng, lo, hi);
  return s;
}

std::vector<int64_t> random_slots(std::mt19937_64& rng, int64_t num_slots, int64_t T) {
  std::vector<int64_t> slots(static_cast<size_t>(num_slots));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(size_t(T));
  for (size_t i = 1; i < slots.size(); ++i)
    if (rng() % 4 == 0) slots[i] = -1 - int64_t(rng() % 3);
  return slots;
}

HostTensor slot_tensor(const std::vector<int64_t>& slots) {
  HostTensor t = HostTensor::zeros(DType::i64, {int64_t(slots.size())});
  for (size_t i = 0; i < slots.size(); ++i) *static_cast<int64_t*>(t.ref.at(int64_t(i))) = slots[i];
  return t;
}

std::vector<std::pair<int64_t, int64_t>> block_pairs(std::mt19937_64& rng, int64_t src_blocks, int64_t dst_blocks,
                                                     int64_t n, bool same_space) {
  std::vector<int64_t> order(static_cast<size_t>(dst_blocks));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = same_space ? order[size_t(n + uniform_int(rng, 0, dst_blocks - n - 1))]
                                 : uniform_int(rng, 0, src_blocks - 1);
    rows.emplace_back(s, order[size_t(i)]);
  }
  return rows;
}

HostTensor mapping_tensor(const std::vector<std::pair<int64_t, int64_t>>& rows) {
  HostTensor m = HostTensor::strided(DType::i64, {int64_t(rows.size()), 2}, {3, 1});
  for (size_t i = 0; i < rows.size(); ++i) {
    *static_cast<int64_t*>(m.ref.at(int64_t(i), 0)) = rows[i].first;
    *static_cast<int64_t*>(m.ref.at(int64_t(i), 1)) = rows[i].second;
  }
  return m;
}

StepBuffers StepBuffers::clone() const {
  return {tokens.clone(), positions.clone(), slots.clone(), lens.clone(), sampled.clone(), tables.clone()};
}

StepBuffers step_buffers(std::mt19937_64& rng, int64_t R, int64_t num_queries, int64_t bs, int64_t max_blocks) {
  StepBuffers s{HostTensor::zeros(DType::i64, {R}), HostTensor::strided(DType::i64, {R}, {2}),
                HostTensor::zeros(DType::i64, {R}), HostTensor::zeros(DType::i32, {R}),
                HostTensor::strided(DType::i64, {num_queries + 1, 1}, {2, 1}),
                HostTensor::strided(DType::i32, {R, max_blocks}, {max_blocks + 3, 1})};
  for (const HostTensor* t : {&s.tokens, &s.positions, &s.slots}) poison_storage(*t);
  fill_uniform(s.sampled, rng, 0, 50000);
  fill_uniform(s.tables, rng, 0, 100000);
  fill_uniform(s.lens, rng, 0, float(max_blocks * bs - 1));
  return s;
}

fs::AdvanceStepParams step_params(const StepBuffers& s, int64_t num_seqs, int64_t num_queries, int64_t bs) {
  fs::AdvanceStepParams p;
  p.num_seqs = num_seqs;
  p.num_queries = num_queries;
  p.block_size = bs;
  p.input_tokens = s.tokens;
  p.sampled_token_ids = s.sampled;
  p.input_positions = s.positions;
  p.seq_lens = s.lens;
  p.slot_mapping = s.slots;
  p.block_tables = s.tables;
  return p;
}

}  // namespace fstest
