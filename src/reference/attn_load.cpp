#include "reference/attn_load.hpp"

#include "flashserve/numeric.hpp"
#include "flashserve/status.hpp"

namespace flashserve::reference {

namespace {

// float16 -> float by bit assembly; exact, and independent of the denormal mode.
inline float f16_value(uint16_t h) {
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float mag;
  if (e == 0) mag = float(int(m)) * 0x1p-24f;  // zero and subnormals: m * 2^-24
  else if (e == 0x1f) mag = numeric::float_of(0x7f800000u | (m << 13));  // inf, NaN
  else mag = numeric::float_of(((e + 112u) << 23) | (m << 13));           // rebias 15 -> 127
  return (h & 0x8000u) ? -mag : mag;
}

struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = numeric::fp8_to_float(uint8_t(c), DType::f8e4m3);
      e5m2[c] = numeric::fp8_to_float(uint8_t(c), DType::f8e5m2);
    }
  }
};
const Fp8Tables& fp8_tables() {
  static const Fp8Tables t;
  return t;
}

template <class Get>
inline void decode_with(Get get, int64_t n, float scale, const float* chan, float* dst, int64_t stride) {
  if (chan) {
    for (int64_t k = 0; k < n; ++k) dst[k * stride] = get(k) * scale * chan[k];
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k * stride] = get(k) * scale;
  }
}

template <DType T>
void decode(const void* src, int64_t n, float scale, const float* chan, float* dst, int64_t stride) {
  if constexpr (T == DType::f32) {
    const float* x = static_cast<const float*>(src);
    decode_with([x](int64_t k) { return x[k]; }, n, scale, chan, dst, stride);
  } else if constexpr (T == DType::f16) {
    const uint16_t* x = static_cast<const uint16_t*>(src);
    decode_with([x](int64_t k) { return f16_value(x[k]); }, n, scale, chan, dst, stride);
  } else if constexpr (T == DType::bf16) {
    const uint16_t* x = static_cast<const uint16_t*>(src);
    decode_with([x](int64_t k) { return numeric::bf16_to_float(x[k]); }, n, scale, chan, dst, stride);
  } else if constexpr (T == DType::i8) {
    const int8_t* x = static_cast<const int8_t*>(src);
    decode_with([x](int64_t k) { return float(x[k]); }, n, scale, chan, dst, stride);
  } else {
    const uint8_t* x = static_cast<const uint8_t*>(src);
    const float* tab = T == DType::f8e4m3 ? fp8_tables().e4m3 : fp8_tables().e5m2;
    decode_with([x, tab](int64_t k) { return tab[x[k]]; }, n, scale, chan, dst, stride);
  }
}

}  // namespace

RowDecoder row_decoder(DType t) {
  switch (t) {
    case DType::f32: return decode<DType::f32>;
    case DType::f16: return decode<DType::f16>;
    case DType::bf16: return decode<DType::bf16>;
    case DType::f8e4m3: return decode<DType::f8e4m3>;
    case DType::f8e5m2: return decode<DType::f8e5m2>;
    case DType::i8: return decode<DType::i8>;
    default: fail_not_implemented("attention operands of dtype ", dtype_name(t));
  }
}

SeqKv seq_kv(const detail::AttnProblem& pr, int64_t b) {
  SeqKv s;
  if (pr.paged) {
    s.block_row = static_cast<const int32_t*>(pr.block_table->at(b, 0));
    s.block_size = pr.block_size;
  } else if (pr.batched) {
    s.kb = pr.cache_batch_idx ? *static_cast<const int32_t*>(pr.cache_batch_idx->at(b)) : b;
  } else {
    s.k_begin = *static_cast<const int32_t*>(pr.cu_seqlens_k->at(b));
  }
  return s;
}

OperandLoader::OperandLoader(const detail::AttnProblem& pr)
    : pr_(pr),
      d_(pr.head_dim),
      dv_(pr.head_dim_v),
      dqv_(pr.q_v ? pr.head_dim_v : 0),
      dec_q_(row_decoder(pr.q.dtype)),
      dec_k_(row_decoder(pr.k.dtype)),
      dec_v_(row_decoder(pr.v.dtype)) {
  if (pr.q_v) dec_qv_ = row_decoder(pr.q_v->dtype);
}

float OperandLoader::descale(const OptTensor& t, int64_t b, int64_t g) const {
  return t ? *static_cast<const float*>(t->at(b, g)) : 1.0f;
}

void OperandLoader::load_q(int64_t qb, int64_t row, int64_t b, int64_t h, int64_t g, float* dst) const {
  float scale = 1.0f;
  if (is_fp8(pr_.q.dtype)) scale = descale(pr_.q_descale, b, g);
  else if (pr_.q.dtype == DType::i8) scale = *static_cast<const float*>(pr_.q_scale->at(qb, row, h));
  dec_q_(pr_.q.at(qb, row, h, 0), d_, scale, nullptr, dst, 1);
  if (dqv_) dec_qv_(pr_.q_v->at(qb, row, h, 0), dqv_, scale, nullptr, dst + d_, 1);
}

void OperandLoader::load_kv_tile(const SeqKv& s, int64_t b, int64_t g, int64_t t0, int64_t n,
                                 int64_t tile, float* kt, float* vt) const {
  const float k_desc = descale(pr_.k_descale, b, g), v_desc = descale(pr_.v_descale, b, g);
  const bool k_int8 = pr_.k.dtype == DType::i8;
  const float* v_chan = pr_.v_scale ? static_cast<const float*>(pr_.v_scale->at(g, 0)) : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    int64_t d0, d1;
    s.locate(t0 + j, d0, d1);
    const float k_s = k_int8 ? *static_cast<const float*>(pr_.k_scale_cache->at(d0, d1, g)) : k_desc;
    dec_k_(pr_.k.at(d0, d1, g, 0), d_, k_s, nullptr, kt + j, tile);
    float* vrow = vt + j * dv_;
    dec_v_(pr_.v.at(d0, d1, g, 0), dv_, v_desc, v_chan, vrow, 1);
    for (int64_t c = 0; c < dqv_; ++c) kt[(d_ + c) * tile + j] = vrow[c];
  }
  const int64_t width = d_ + dqv_;
  for (int64_t j = n; j < tile; ++j)
    for (int64_t r = 0; r < width; ++r) kt[r * tile + j] = 0.0f;
}

}  // namespace flashserve::reference
