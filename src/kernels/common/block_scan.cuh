// An inclusive prefix sum over one block, for the single-block offset kernels (gather_cache's
// cu_seqlens_dst, the tree-speculation metadata's cu_seqlens_k).
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace flashserve::kernels {

// Inclusive prefix sum of x over the block (blockDim.x == Threads; CCCL's BlockScan);
// `total` gets the block's sum. Every thread of the block must call it (it synchronizes, and
// again after, so the next call may reuse the scan's shared storage).
template <int Threads>
__device__ int64_t block_scan(int64_t x, int64_t& total) {
  using Scan = cub::BlockScan<int64_t, Threads>;
  __shared__ typename Scan::TempStorage storage;
  int64_t inclusive;
  Scan(storage).InclusiveSum(x, inclusive, total);
  __syncthreads();
  return inclusive;
}

}  // namespace flashserve::kernels
