// Split-KV combine: per covered (flat row, head), merges the num_splits partial states in
// split order with merge_lse (exactly as the CPU reference merges its splits), merges the sink
// once, and stores out and lse. A NaN partial LSE stays NaN. One warp per (row, head); lane c handles channels c, c+32, ...
#include <cuda_runtime.h>

#include "kernels/attention/epilogue.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/schedule.cuh"
#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kCombineWarps = 4;

// merge_lse's fmaxf drops a NaN LSE next to -inf; a NaN partial (a row that saw a bad KV
// token, load.cuh) must keep the merged LSE NaN, as its output already is (0 * NaN).
__device__ __forceinline__ float nan_sticky(float a, float b, float merged) {
  return (a != a) ? a : (b != b) ? b : merged;
}

__global__ void __launch_bounds__(32 * kCombineWarps) split_combine(const __grid_constant__ AttnParams p) {
  const int64_t item = int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  const int lane = int(threadIdx.x % 32);
  if (item >= p.total_rows() * p.num_heads) return;
  const int64_t r = item / p.num_heads, h = item % p.num_heads;
  const SeqRows seq = find_sequence(p, r);
  if (!seq.covers(r)) return;  // the forward kernel wrote no partial for it
  const int64_t dv = p.head_dim_v, split_stride = p.total_rows() * p.num_heads;
  const float* lse_s = p.lse_partial + partial_index(p, 0, r, h);
  const float* o_s = p.o_partial + partial_index(p, 0, r, h) * dv;
  for (int64_t c = lane; c < dv; c += 32) {
    float o = o_s[c], lse = lse_s[0];
    for (int s = 1; s < p.num_splits; ++s) {
      const float part = lse_s[s * split_stride];
      const MergeWeights w = merge_lse(lse, part);
      o = w.w_a * o + w.w_b * o_s[s * split_stride * dv + c];
      lse = nan_sticky(lse, part, w.lse);
    }
    const float ws = apply_sink(p, h, lse);
    store_out(p, seq.qb, seq.q_row(r, p.batched), h, c, o * ws);
    if (c == 0) store_lse(p, seq.qb, seq.q_row(r, p.batched), h, lse);
  }
}

}  // namespace

void launch_split_combine(const AttnParams& p, void* stream) {
  const int64_t items = p.total_rows() * p.num_heads;
  if (items == 0) return;
  const int64_t blocks = (items + kCombineWarps - 1) / kCombineWarps;
  if (blocks > 0x7fffffff) throw RuntimeError(detail::cat("split combine: ", items, " (row, head) items exceed the grid"));
  split_combine<<<unsigned(blocks), 32 * kCombineWarps, 0, static_cast<cudaStream_t>(stream)>>>(p);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
