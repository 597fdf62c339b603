// The online-softmax state of one (query row, head) and the warp reductions it needs. Partial
// states over disjoint key ranges merge exactly with merge_lse (common/softmax_state.hpp),
// which the split combine and the sink share with the CPU reference.
#pragma once

#include "common/softmax_state.hpp"
#include "kernels/attention/load.cuh"
#include "kernels/common/warp_reduce.cuh"

namespace flashserve::kernels {


// max that lets a NaN win from either side (a NaN score must poison its row, as on the CPU).
FS_DEV float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));  // sm80+: NaN when either is
  return r;
}

FS_DEV float warp_max_nan(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = nan_max(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// The split-KV merges' channel sums (combine.cu, cluster_merge.cuh): split s's weighted partial
// goes into class sum s mod kCombineClasses (in increasing s), and the output is the classes'
// fixed pairwise tree, so the bits depend on the splits alone, not on which merge or launch shape.
inline constexpr int kCombineClasses = 16;
FS_DEV float4 add4(const float4& a, const float4& b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
// The tree of kW class sums from class kK: its halves' sums added (((c0 + c1) + (c2 + c3)) + ...);
// cls(k) is class k's (k a compile-time constant in each call).
template <int kK, int kW, class Cls>
FS_DEV float4 class_tree(Cls&& cls) {
  if constexpr (kW == 1) return cls(kK);
  else return add4(class_tree<kK, kW / 2>(cls), class_tree<kK + kW / 2, kW / 2>(cls));
}

// Running max m and sum l of exp(s - m) over the keys absorbed so far (empty: m = -inf, l = 0).
struct RowState {
  float m = kNegInf;
  float l = 0.0f;

  // Absorbs a tile whose largest score is tile_max: returns the factor by which earlier
  // contributions (the output accumulator) must be rescaled, and the new max in new_m; the
  // caller adds exp(s - new_m) for the tile's keys to l via add_sum. Returns false when every
  // score so far is -inf (nothing to add).
  FS_DEV bool rescale(float tile_max, float& new_m, float& alpha) const {
    new_m = nan_max(m, tile_max);
    if (new_m == kNegInf) return false;
    alpha = expf(m - new_m);
    return true;
  }
  FS_DEV void update(float new_m, float alpha, float tile_sum) {
    l = l * alpha + tile_sum;
    m = new_m;
  }
  FS_DEV bool empty() const { return l == 0.0f; }
  FS_DEV float lse() const { return empty() ? kNegInf : m + logf(l); }
};

}  // namespace flashserve::kernels
