// Whole-warp reductions shared by the attention kernels and the row-wise kernels.
#pragma once

namespace flashserve::kernels {

inline constexpr unsigned kFullMask = 0xffffffffu;

// The sum over the warp's 32 lanes (butterfly: every lane gets it; the same order everywhere).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

}  // namespace flashserve::kernels
