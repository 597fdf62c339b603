// Operand loading for the CPU attention reference: dtype dispatch hoisted out of the inner
// loops. A query row or a tile of K/V rows is decoded once into a float buffer (dequantized,
// SPEC.md §5), and the math runs on floats. Every decoder gives exactly numeric::load_float's
// value times the scales.
#pragma once

#include <cstdint>

#include "problem/attention.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::reference {

// dst[k * stride] = x[k] * scale (* chan[k] when chan is not null), k < n.
using RowDecoder = void (*)(const void* src, int64_t n, float scale, const float* chan, float* dst,
                            int64_t stride);

// The decoder of a dtype: f32, f16, bf16, fp8 (e4m3, e5m2) or i8; throws NotImplemented
// naming any other dtype.
RowDecoder row_decoder(DType t);

// Where sequence b's KV tokens live in the normalized k/v views (api/problem.hpp).
struct SeqKv {
  const int32_t* block_row = nullptr;  // paged: block_table[b, :], may be null
  int64_t block_size = 0;              // paged only
  int64_t kb = 0, k_begin = 0;         // contiguous: k[kb, k_begin + t]
  // Indices (dim 0, dim 1) of token t in k, v and k_scale_cache.
  void locate(int64_t t, int64_t& d0, int64_t& d1) const {
    if (block_row) {
      d0 = block_row[t / block_size];
      d1 = t % block_size;
    } else {
      d0 = kb;
      d1 = k_begin + t;
    }
  }
};

SeqKv seq_kv(const detail::AttnProblem& pr, int64_t b);

// Per-call operand decoders and dequantization rules.
class OperandLoader {
 public:
  explicit OperandLoader(const detail::AttnProblem& pr);

  int64_t qk_width() const { return d_ + dqv_; }  // D (+ Dv with q_v)

  // Packed query row: dst[0, D) = q, dst[D, D + Dv) = q_v (when present), dequantized.
  // qb, row: indices into the normalized q; b: sequence; h: query head; g: its KV head.
  void load_q(int64_t qb, int64_t row, int64_t b, int64_t h, int64_t g, float* dst) const;

  // Tokens [t0, t0 + n) of sequence b, KV head g, n <= tile:
  //   kt [qk_width, tile]: column t = k row (then v row when q_v is present), transposed;
  //   vt [tile, Dv]: v rows.
  // Columns n..tile of kt are zeroed.
  void load_kv_tile(const SeqKv& s, int64_t b, int64_t g, int64_t t0, int64_t n, int64_t tile,
                    float* kt, float* vt) const;

 private:
  float descale(const OptTensor& t, int64_t b, int64_t g) const;

  const detail::AttnProblem& pr_;
  int64_t d_ = 0, dv_ = 0, dqv_ = 0;
  RowDecoder dec_q_, dec_qv_ = nullptr, dec_k_, dec_v_;
};

}  // namespace flashserve::reference
