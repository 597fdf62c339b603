// An inclusive prefix sum over one block, for the single-block offset kernels (gather_cache's
// cu_seqlens_dst, the tree-speculation metadata's cu_seqlens_k).
#pragma once

#include <cstdint>

#include "kernels/common/token_rows.cuh"
#include "kernels/common/warp_reduce.cuh"

namespace flashserve::kernels {

// Inclusive prefix sum of x over the block (blockDim.x == Threads, a multiple of 32, at most
// 1024); `total` gets the block's sum. Every thread of the block must call it (it synchronizes).
template <int Threads>
__device__ int64_t block_scan(int64_t x, int64_t& total) {
  static_assert(Threads % kWarp == 0 && Threads <= kWarp * kWarp, "one warp scans the warp sums");
  __shared__ int64_t warp_sums[Threads / kWarp];
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const int64_t y = __shfl_up_sync(kFullMask, x, o);
    if (lane >= o) x += y;
  }
  if (lane == kWarp - 1) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t s = lane < Threads / kWarp ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const int64_t y = __shfl_up_sync(kFullMask, s, o);
      if (lane >= o) s += y;
    }
    if (lane < Threads / kWarp) warp_sums[lane] = s;
  }
  __syncthreads();
  const int64_t before = warp > 0 ? warp_sums[warp - 1] : 0;
  total = warp_sums[Threads / kWarp - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + x;
}

}  // namespace flashserve::kernels
