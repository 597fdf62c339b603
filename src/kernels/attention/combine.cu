// Split-KV combine: per covered (flat row, head) item, merges the num_splits partial states
// into out and lse (the sink merged once), in two parallel phases instead of a sequential chain
// of pairwise merges: each warp reduces its item's partial LSEs to the merged one (max, then the
// sum of exp(lse_s - max)) and keeps each split's weight exp(lse_s - lse) in shared memory, then
// the threads sum the channels over the splits with independent float4 loads, those of the first
// 16-32 splits issued before the LSEs' (the kernel is a chain of dependent memory round trips:
// 3.8-6.0 us per call on the H200, 8-20% of a B = 1 L = 32k decode step, bench/RESULTS.md
// 2026-11-26). The same merge as
// merge_lse (common/softmax_state.hpp) up to fp32 rounding: a NaN partial LSE makes the row NaN,
// empty splits (-inf) weigh 0, all empty gives out 0 and lse -inf.
//
// Shape (chosen on the host, launch_split_combine): an item's Dv / 4 float4 vectors in chunks
// of vc, each chunk's splits over G split groups (G in 1, 4, 16: thread (g, v) sums the splits
// s = g mod G), an item spanning vc x G >= 32 threads, 128 / (vc x G) items per CTA. Many
// splits over few items (B = 1 decode) take G = 16 (MLA B = 1 L = 32k, 128 splits: 256 CTAs, 8
// loads per thread; 31.6 -> 29.2 us per call), 9-63 splits G = 4 (G = 16 at 32 splits, MLA fp8
// B = 4 L = 8k: 30.5 -> 32.4); few splits over many items take G = 1 and whole items (MLA B =
// 64, 2 splits: 1024 CTAs in one wave, two float4 loads per thread, where one float per thread
// over 4096 CTAs took ~15 us under ncu: 100.7 -> 92.8 us per call). Whatever the shape, split s
// accumulates into class sum s mod 16 in increasing s and out is the classes' fixed pairwise
// tree: the bits depend on the sequence's own splits only (batch-invariant mode).
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
// w [num_splits]. Every lane returns the same value. Each LSE is read once (a lane's at most
// kPer, for up to 32 kPer splits, in registers).
template <int kPer>
__device__ __forceinline__ float merge_split_lses(const float* lse_s, int64_t stride, int splits, int lane, float* w) {
  float l[kPer];
  float mx = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int s = lane + 32 * i;
    l[i] = s < splits ? normalize_lse(lse_s[s * stride]) : -INFINITY;
    nan |= l[i] != l[i];
    mx = fmaxf(mx, l[i]);
  }
  nan = __any_sync(kFullMask, nan);
  mx = warp_max_nan(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int s = lane + 32 * i;
    const float e = mx == -INFINITY || s >= splits ? 0.0f : expf(l[i] - mx);
    if (s < splits) w[s] = e;
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

// The float4 at c (a multiple of 4) of a partial row, times w, into acc.
__device__ __forceinline__ void fma4(float4& acc, float w, const float4& x) {
  acc.x = fmaf(w, x.x, acc.x), acc.y = fmaf(w, x.y, acc.y), acc.z = fmaf(w, x.z, acc.z), acc.w = fmaf(w, x.w, acc.w);
}

// Split s accumulates into class sum s mod kClasses (in increasing s) and out is their fixed
// pairwise tree (softmax.cuh: class_tree, which cluster_merge.cuh sums with too).
constexpr int kClasses = kCombineClasses;

// The split groups G of a call of `splits` splits (launch_split_combine's choice), and the most
// splits each G serves: the kernel sizes its registers by the latter (kSlots at G = 1, the LSEs a
// lane holds), so both read one rule.
constexpr int combine_groups(int splits) { return splits >= 64 ? 16 : splits > kClasses / 2 ? 4 : 1; }
constexpr int combine_max_splits(int g) { return g == 1 ? kClasses / 2 : g == 4 ? 63 : kMaxSplits; }
static_assert(combine_groups(combine_max_splits(1)) == 1 && combine_groups(combine_max_splits(1) + 1) == 4 &&
                  combine_groups(combine_max_splits(4)) == 4 && combine_groups(combine_max_splits(4) + 1) == 16,
              "each G's bound is where the next G starts");

// kG split groups (1, 4 or 16); vc float4 vectors per chunk (launch_split_combine); dynamic
// shared memory: the class sums [kClasses][128 / kG] float4 when kG > 1. kG == 1 serves calls
// of at most kClasses / 2 splits (the host's choice), so its classes 8-15 are zeros, not held.
template <int kG>
__global__ void __launch_bounds__(kCombineThreads, 8) split_combine(const __grid_constant__ AttnParams p, int vc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A dependent launch (launch_split_combine) starts before the forward kernel ends: its
  // partials are complete and visible only after this.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  constexpr int kSlots = kG == 1 ? combine_max_splits(1) : kClasses / kG;  // sums per thread: classes g + kG j
  constexpr int kLanes = kCombineThreads / kG;  // (item slot, vector) pairs per CTA
  __shared__ float weights[kCombineWarps][kMaxSplits];
  extern __shared__ float4 sums[];  // [kClasses][kLanes]
  const int span = vc * kG, t = int(threadIdx.x), lane = t % 32;
  const int64_t dv = p.head_dim_v, nvec = dv / 4, chunks = (nvec + vc - 1) / vc;
  const int64_t item = (blockIdx.x / chunks) * (kCombineThreads / span) + t / span;
  const int g = (t % span) / vc, lv = (t / span) * vc + t % vc;
  const int64_t v = (blockIdx.x % chunks) * vc + t % vc;
  int splits = 0;
  int64_t r = 0, h = 0;
  SeqRows seq;
  if (item < p.total_rows() * p.num_heads) {
    r = item / p.num_heads, h = item % p.num_heads;
    seq = find_sequence(p, r);
    // Fixed-size splits (batch-invariant): the sequence's own splits, in order; one split was
    // written directly by the forward kernel, none when the sequence does not cover r.
    // (The KV length is read only for those: another dependent load before the LSEs' otherwise.)
    if (seq.covers(r)) splits = p.split_size > 0 ? seq_num_splits(kv_len(p, seq.b), p.num_splits, p.split_size)
                                                 : p.num_splits;
  }
  const bool active = splits > 1;  // the same for the item's threads: whole warps
  const int64_t split_stride = p.total_rows() * p.num_heads;
  float* w = weights[t / 32];
  float lse = 0.0f;
  float4 acc[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (active) {
    const float4* o_s = reinterpret_cast<const float4*>(p.o_partial + partial_index(p, 0, r, h) * dv) + v;
    const int64_t step = split_stride * nvec;
    // The first two class blocks' partials (splits s < 2 kClasses; one block when kG == 1) are
    // read before the weights are known, so those reads overlap the LSEs' (one dependent round
    // trip fewer): block 0 into acc itself, then scaled in place (fmaf(w, x, 0): the bits of the
    // accumulation from zero), block 1 into x1. Split s = s0 + g + kG j (s0 a multiple of
    // kClasses) goes to class g + kG j, each class in increasing s.
    constexpr int kPre = kG == 1 ? 1 : 2;
    float4 x1[kPre - 1 > 0 ? kSlots : 1];
    constexpr int kEarly = kG == 1 ? 4 : kSlots;  // kG 1: splits 5-8 (rare) read after the LSEs (registers)
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      const int s = g + kG * j;
      if (j < kEarly && v < nvec && s < splits) acc[j] = o_s[s * step];
      if constexpr (kPre > 1) {
        x1[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (v < nvec && s + kClasses < splits) x1[j] = o_s[(s + kClasses) * step];
      }
    }
    constexpr int kPer = (combine_max_splits(kG) + 31) / 32;  // LSEs per lane
    lse = merge_split_lses<kPer>(p.lse_partial + partial_index(p, 0, r, h), split_stride, splits, lane, w);
    if (v < nvec) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int s = g + kG * j;
        if (s < splits) {
          const float4 x = j < kEarly ? acc[j] : o_s[s * step];
          acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          fma4(acc[j], w[s], x);
        }
        if constexpr (kPre > 1)
          if (s + kClasses < splits) fma4(acc[j], w[s + kClasses], x1[j]);
      }
      for (int s0 = kPre * kClasses; s0 < splits; s0 += kClasses) {
#pragma unroll
        for (int j = 0; j < kSlots; ++j) {
          const int s = s0 + g + kG * j;
          if (s < splits) fma4(acc[j], w[s], o_s[s * step]);
        }
      }
    }
  }
  if constexpr (kG > 1) {  // the classes to the group-0 thread of the (item, vector)
#pragma unroll
    for (int j = 0; j < kSlots; ++j) sums[(g + kG * j) * kLanes + lv] = acc[j];
    __syncthreads();
  }
  if (!active || g != 0) return;
  const float ws = apply_sink(p, h, lse);  // lse: the sink merged in
  const int64_t q_row = seq.q_row(r, p.batched);
  if (v < nvec) {
    const float4 c = class_tree<0, kClasses>([&](int k) {
      return kG > 1 ? sums[k * kLanes + lv] : k < kSlots ? acc[k % kSlots] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    });
    const float x[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) store_out(p, seq.qb, q_row, h, 4 * v + e, lse != lse ? NAN : x[e] * ws);
  }
  if (v == 0) store_lse(p, seq.qb, q_row, h, lse);
}

}  // namespace

// dependent: launched with programmatic stream serialization, so that the launch is staged
// while the forward kernel runs and its CTAs start as the forward kernel's CTAs exit, instead of
// after the kernel boundary (split_combine waits for the forward grid with griddepcontrol.wait).
// CUDA graphs capture it as a programmatic edge.
void launch_split_combine(const AttnParams& p, void* stream, bool dependent) {
  const int64_t items = p.total_rows() * p.num_heads, nvec = p.head_dim_v / 4;
  if (items == 0 || nvec == 0) return;
  if (p.head_dim_v % 4 != 0)
    throw RuntimeError(detail::cat("split combine: head_dim_v a multiple of 4, got ", p.head_dim_v));
  // The shape (see the top): G by the splits, vc the item's vectors up to 128 / G threads.
  const int groups = combine_groups(p.num_splits);
  int vc = 32 / groups;
  while (vc < nvec && vc * groups < kCombineThreads) vc *= 2;
  const int64_t per_cta = kCombineThreads / (vc * groups), chunks = (nvec + vc - 1) / vc;
  const int64_t ctas = (items + per_cta - 1) / per_cta * chunks;
  if (ctas > 0x7fffffff)
    throw RuntimeError(detail::cat("split combine: ", items, " (row, head) items exceed the grid"));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(ctas));
  cfg.blockDim = dim3(kCombineThreads);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = dependent ? 1 : 0;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  const auto kernel = groups == 16 ? &split_combine<16> : groups == 4 ? &split_combine<4> : &split_combine<1>;
  cfg.dynamicSmemBytes = groups > 1 ? size_t(kClasses) * (kCombineThreads / groups) * sizeof(float4) : 0;
  FS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, vc));
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
