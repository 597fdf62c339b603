// Split-KV combine: per covered (flat row, head), merges the num_splits partial states into
// out and lse (the sink merged once), in two parallel phases instead of a sequential chain of
// pairwise merges (a B = 1 decode has 64+ splits over few rows): the lanes reduce the partial
// LSEs to the merged one (max, then the sum of exp(lse_s - max)), keep each split's weight
// exp(lse_s - lse) in shared memory, then each thread sums its channels over the
// splits with independent loads. The same merge as merge_lse (common/softmax_state.hpp) up to
// fp32 rounding: a NaN partial LSE makes the row NaN, empty splits (-inf) weigh 0, all empty
// gives out 0 and lse -inf. One CTA of 4 warps per (row, head, 128 channels): each warp
// merges the LSEs (the same value; num_splits loads), each thread sums its channel over the
// splits in four independent accumulators, 32 loads in flight (B = 1, 32 splits, D = 128: one
// CTA per (row, head), one round; where one warp per item took 16 rounds, the combine of a
// B = 1 L = 32k decode went from 48 to 8.6 us under ncu on the H200. MLA's Dv = 512 with 64
// splits and 16 heads: 64 CTAs instead of 16 whose threads each chained 4 channels x 64
// splits, 86 us under ncu for a 50 us decode_mla kernel).
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A dependent launch (launch_split_combine) starts before the forward kernel ends: its
  // partials are complete and visible only after this.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  __shared__ float weights[kCombineWarps][kMaxSplits];
  const int64_t chunks = (p.head_dim_v + kCombineThreads - 1) / kCombineThreads;
  const int64_t item = blockIdx.x / chunks, c = (blockIdx.x % chunks) * kCombineThreads + threadIdx.x;
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
  float* w = weights[threadIdx.x / 32];
  float lse = merge_split_lses(p.lse_partial + partial_index(p, 0, r, h), split_stride, splits, lane, w);
  const float ws = apply_sink(p, h, lse);
  if (c < dv) {
    // Four independent sums (split s into acc[s % 4]) so that 32 loads are in flight per thread.
    // The tail keeps that assignment, so trailing empty splits (weight 0, partial 0) change no
    // bit: a CUDA graph captured with more splits than an eager plan of the same keys (the
    // granule cap) combines the same non-empty splits in the same order.
    const float* o_s = p.o_partial + partial_index(p, 0, r, h) * dv + c;
    const int64_t step = split_stride * dv;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int s = 0;
#pragma unroll 4
    for (; s + 4 <= splits; s += 4) {
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[k] = fmaf(w[s + k], o_s[(s + k) * step], acc[k]);
    }
    for (; s < splits; ++s) acc[s & 3] = fmaf(w[s], o_s[s * step], acc[s & 3]);
    float o = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    if (lse != lse) o = NAN;
    store_out(p, seq.qb, seq.q_row(r, p.batched), h, c, o * ws);
  }
  if (threadIdx.x == 0 && c == 0) store_lse(p, seq.qb, seq.q_row(r, p.batched), h, lse);
}

}  // namespace

// dependent: launched with programmatic stream serialization, so that the launch is staged
// while the forward kernel runs and its CTAs start as the forward kernel's CTAs exit, instead of
// after the kernel boundary (split_combine waits for the forward grid with griddepcontrol.wait).
// CUDA graphs capture it as a programmatic edge.
void launch_split_combine(const AttnParams& p, void* stream, bool dependent) {
  const int64_t items = p.total_rows() * p.num_heads;
  const int64_t chunks = (p.head_dim_v + kCombineThreads - 1) / kCombineThreads;
  if (items == 0 || chunks == 0) return;
  if (items * chunks > 0x7fffffff)
    throw RuntimeError(detail::cat("split combine: ", items, " (row, head) items x ", chunks, " channel chunks exceed the grid"));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(items * chunks));
  cfg.blockDim = dim3(kCombineThreads);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = dependent ? 1 : 0;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  FS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, split_combine, p));
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
