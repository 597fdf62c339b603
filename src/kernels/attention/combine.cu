// Split-KV combine: per covered (flat row, head), merges the num_splits partial states into
// out and lse (the sink merged once), in two parallel phases instead of a sequential chain of
// pairwise merges (a B = 1 decode has 64+ splits over few rows): the lanes reduce the partial
// LSEs to the merged one (max, then the sum of exp(lse_s - max)), keep each split's weight
// exp(lse_s - lse) in shared memory, then each thread sums its channels over the
// splits with independent loads. The same merge as merge_lse (common/softmax_state.hpp) up to
// fp32 rounding: a NaN partial LSE makes the row NaN, empty splits (-inf) weigh 0, all empty
// gives out 0 and lse -inf. One CTA of 4 warps per (row, head): each warp merges the LSEs
// (the same value; num_splits loads) and takes every fourth 32-channel slice, so a thread's
// chain is num_splits / 8 rounds of 8 loads per Dv / 128 channels (B = 1, 32 splits, D = 128:
// 4 rounds, where one warp per item took 16: on the H200 the combine of a B = 1 L = 32k decode
// went from 48 to 8.6 us under ncu, and the step from 1833 to 2447 GB/s of KV).
#include <cuda_runtime.h>

#include "kernels/attention/epilogue.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/softmax.cuh"
#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kCombineWarps = 4;
constexpr int kCombineThreads = 32 * kCombineWarps;

// The merged LSE of the splits' partial LSEs (stride `stride` apart); each split's weight into
// w [num_splits]. Every lane returns the same value.
__device__ __forceinline__ float merge_split_lses(const float* lse_s, int64_t stride, int splits, int lane, float* w) {
  float mx = -INFINITY;
  bool nan = false;
  for (int s = lane; s < splits; s += 32) {
    const float l = normalize_lse(lse_s[s * stride]);
    nan |= l != l;
    mx = fmaxf(mx, l);
  }
  nan = __any_sync(kFullMask, nan);
  mx = warp_max_nan(mx);
  float sum = 0.0f;
  for (int s = lane; s < splits; s += 32) {
    const float e = mx == -INFINITY ? 0.0f : expf(normalize_lse(lse_s[s * stride]) - mx);
    w[s] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  __syncwarp();
  if (nan) return NAN;
  if (mx == -INFINITY) return -INFINITY;
  const float inv = 1.0f / sum;
  for (int s = lane; s < splits; s += 32) w[s] *= inv;
  __syncwarp();
  return mx + logf(sum);
}

__global__ void __launch_bounds__(kCombineThreads) split_combine(const __grid_constant__ AttnParams p) {
  __shared__ float weights[kCombineWarps][kMaxSplits];
  const int64_t item = blockIdx.x;
  const int lane = int(threadIdx.x % 32);
  if (item >= p.total_rows() * p.num_heads) return;
  const int64_t r = item / p.num_heads, h = item % p.num_heads;
  const SeqRows seq = find_sequence(p, r);
  if (!seq.covers(r)) return;  // the forward kernel wrote no partial for it
  // Fixed-size splits (batch-invariant): the sequence's own splits, in order; one split was
  // written directly by the forward kernel.
  const int splits = seq_num_splits(kv_len(p, seq.b), p.num_splits, p.split_size);
  if (splits <= 1) return;
  const int64_t dv = p.head_dim_v, split_stride = p.total_rows() * p.num_heads;
  const float* o_s = p.o_partial + partial_index(p, 0, r, h) * dv;
  float* w = weights[threadIdx.x / 32];
  float lse = merge_split_lses(p.lse_partial + partial_index(p, 0, r, h), split_stride, splits, lane, w);
  const float ws = apply_sink(p, h, lse);
  for (int64_t c = threadIdx.x; c < dv; c += kCombineThreads) {
    float o = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) o = fmaf(w[s], o_s[s * split_stride * dv + c], o);
    if (lse != lse) o = NAN;
    store_out(p, seq.qb, seq.q_row(r, p.batched), h, c, o * ws);
  }
  if (threadIdx.x == 0) store_lse(p, seq.qb, seq.q_row(r, p.batched), h, lse);
}

}  // namespace

void launch_split_combine(const AttnParams& p, void* stream) {
  const int64_t items = p.total_rows() * p.num_heads;
  if (items == 0) return;
  if (items > 0x7fffffff) throw RuntimeError(detail::cat("split combine: ", items, " (row, head) items exceed the grid"));
  split_combine<<<unsigned(items), kCombineThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
