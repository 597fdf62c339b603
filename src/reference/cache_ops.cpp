// CPU reference of reshape_and_cache, copy/swap blocks and advance_step.
#include "reference/cache_ops.hpp"

#include <array>
#include <cstring>

#include "flashserve/numeric.hpp"

namespace flashserve::reference {

namespace {

using detail::CacheWriteProblem;
using detail::StoreKind;

float scale_at(const TensorRef& s, int64_t i) { return *static_cast<const float*>(s.at(i)); }

// One row (token `tok`, head h) of key or value into cache slot (block, off).
void write_row(const CacheWriteProblem& pr, bool is_key, int64_t tok, int64_t h, int64_t block, int64_t off) {
  const TensorRef& src = is_key ? pr.key : pr.value;
  const TensorRef& cache = is_key ? pr.key_cache : pr.value_cache;
  const DType fmt = is_key ? pr.k_format : pr.v_format;
  const int64_t n = src.size(2);
  const char* x = static_cast<const char*>(src.at(tok, h, 0));
  void* y = cache.at(block, off, h, 0);
  const size_t xs = dtype_size(src.dtype);
  switch (is_key ? pr.k_kind : pr.v_kind) {
    case StoreKind::plain:  // cache dtype == source dtype
      std::memcpy(y, x, size_t(n) * xs);
      return;
    case StoreKind::fp8: {
      const float s = scale_at(is_key ? *pr.k_scale : *pr.v_scale, h);
      for (int64_t c = 0; c < n; ++c)
        static_cast<uint8_t*>(y)[c] = numeric::float_to_fp8(numeric::load_float(x + c * xs, src.dtype) / s, fmt);
      return;
    }
    case StoreKind::int8_dynamic:
      *static_cast<float*>(pr.k_scale_cache->at(block, off, h)) =
          quantize_row_int8(x, src.dtype, n, static_cast<int8_t*>(y));
      return;
    case StoreKind::int8_given:  // int8 key as given, its scale from key_scale
      std::memcpy(y, x, size_t(n));
      *static_cast<float*>(pr.k_scale_cache->at(block, off, h)) = *static_cast<const float*>(pr.key_scale->at(tok, h));
      return;
    case StoreKind::int8_static: {
      const TensorRef& vs = *pr.v_scale;  // [H_kv, Dv]
      for (int64_t c = 0; c < n; ++c)
        static_cast<int8_t*>(y)[c] =
            round_to_int8(numeric::load_float(x + c * xs, src.dtype) / *static_cast<const float*>(vs.at(h, c)));
      return;
    }
  }
}

// dst = src elementwise; same shape and dtype, any strides.
void copy_view(const TensorRef& dst, const TensorRef& src) {
  if (src.numel() == 0) return;
  const int64_t es = int64_t(dtype_size(src.dtype));
  const int nd = src.ndim;
  if (nd == 0) {
    std::memmove(dst.data, src.data, size_t(es));
    return;
  }
  const int64_t inner = src.shape[nd - 1];
  const int64_t ss = src.stride[nd - 1], ds = dst.stride[nd - 1];
  std::array<int64_t, kMaxDims> idx{};
  while (true) {
    int64_t so = 0, doff = 0;
    for (int d = 0; d + 1 < nd; ++d) {
      so += idx[d] * src.stride[d];
      doff += idx[d] * dst.stride[d];
    }
    char* dp = static_cast<char*>(dst.data) + doff * es;
    const char* sp = static_cast<const char*>(src.data) + so * es;
    if (ss == 1 && ds == 1) {
      std::memmove(dp, sp, size_t(inner * es));
    } else {
      for (int64_t c = 0; c < inner; ++c) std::memmove(dp + c * ds * es, sp + c * ss * es, size_t(es));
    }
    int d = nd - 2;
    for (; d >= 0; --d) {
      if (++idx[d] < src.shape[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

int64_t mapping_at(const TensorRef& m, int64_t row, int col) { return *static_cast<const int64_t*>(m.at(row, col)); }

}  // namespace

void reshape_and_cache(const CacheWriteProblem& pr) {
  for (int64_t i = 0; i < pr.num_tokens; ++i) {
    const int64_t slot = *static_cast<const int64_t*>(pr.slot_mapping.at(i));
    if (slot < 0) continue;
    const int64_t block = slot / pr.block_size, off = slot % pr.block_size;
    for (int64_t h = 0; h < pr.num_kv_heads; ++h) {
      write_row(pr, true, i, h, block, off);
      write_row(pr, false, i, h, block, off);
    }
  }
}

void copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping) {
  for (int64_t r = 0; r < block_mapping.size(0); ++r) {
    const int64_t s = mapping_at(block_mapping, r, 0), d = mapping_at(block_mapping, r, 1);
    for (const TensorRef& c : caches) copy_view(c.select(0, d), c.select(0, s));
  }
}

void swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping) {
  for (int64_t r = 0; r < block_mapping.size(0); ++r)
    copy_view(dst.select(0, mapping_at(block_mapping, r, 1)), src.select(0, mapping_at(block_mapping, r, 0)));
}

void advance_step(const AdvanceStepParams& p) {
  auto i64 = [](const TensorRef& t, int64_t i) { return static_cast<int64_t*>(t.at(i)); };
  for (int64_t i = 0; i < p.num_queries; ++i) {
    *i64(p.input_tokens, i) = *static_cast<const int64_t*>(p.sampled_token_ids.at(i, 0));
    int32_t* len = static_cast<int32_t*>(p.seq_lens.at(i));
    const int64_t pos = *len;  // the new token's position: old length
    *len += 1;
    *i64(p.input_positions, i) = pos;
    const int64_t block = *static_cast<const int32_t*>(p.block_tables.at(i, pos / p.block_size));
    *i64(p.slot_mapping, i) = block * p.block_size + pos % p.block_size;
  }
  for (int64_t i = p.num_queries; i < p.num_seqs; ++i) {
    *i64(p.input_tokens, i) = 0;
    *i64(p.input_positions, i) = 0;
    *i64(p.slot_mapping, i) = -1;
  }
}

}  // namespace flashserve::reference
