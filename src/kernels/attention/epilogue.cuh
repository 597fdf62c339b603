// Epilogue of the attention kernels: the sink (SPEC.md §2.5, merged once, after every split),
// and the stores of out [Bq, rows, H, Dv], lse [Bq, H, rows] and the split partials
// o_partial [splits, Bq * rows, H, Dv], lse_partial [splits, Bq * rows, H].
#pragma once

#include <cstdint>

#include "common/softmax_state.hpp"
#include "kernels/attention/load.cuh"

namespace flashserve::kernels {

// Merges the sink of head h into a row's final state: returns the factor for o and updates
// lse (a state with lse = sink and o = 0). Without sinks: 1 and lse unchanged.
FS_DEV float apply_sink(const AttnParams& p, int64_t h, float& lse) {
  if (!p.s_aux.data) return 1.0f;
  const float sink = load_as_float(p.s_aux.data, h * p.s_aux.stride[0], p.s_aux.dtype);
  const MergeWeights w = merge_lse(lse, sink);
  lse = w.lse;
  return w.w_a;
}

FS_DEV void store_out(const AttnParams& p, int64_t qb, int64_t q_row, int64_t h, int64_t c, float x) {
  const int64_t off = qb * p.out.stride[0] + q_row * p.out.stride[1] + h * p.out.stride[2] + c;
  store_from_float(const_cast<void*>(p.out.data), off, p.out.dtype, x);
}

FS_DEV void store_lse(const AttnParams& p, int64_t qb, int64_t q_row, int64_t h, float lse) {
  if (!p.lse.data) return;
  float* l = static_cast<float*>(const_cast<void*>(p.lse.data));
  l[qb * p.lse.stride[0] + h * p.lse.stride[1] + q_row * p.lse.stride[2]] = lse;
}

// Index of (split, flat row r, head h) in lse_partial; times Dv: the row of o_partial.
FS_DEV int64_t partial_index(const AttnParams& p, int split, int64_t r, int64_t h) {
  return (int64_t(split) * p.total_rows() + r) * p.num_heads + h;
}

}  // namespace flashserve::kernels
