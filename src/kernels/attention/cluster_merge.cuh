// Split-KV merge inside a thread-block cluster: the splits of one (sequence, row group) run as
// the CTAs of one cluster (the launch's cluster dimension (1, 1, num_splits), grid z the
// splits), each leaves its split's partial rows in its own shared memory, and after a cluster
// barrier the CTAs merge them through distributed shared memory and write out and LSE. No split
// partials go through the workspace and no combine kernel runs (combine.cu: 3.8-6 us per call on
// the H200, a chain of dependent round trips after the forward grid's end, bench/RESULTS.md
// 2026-11-26). The merge is combine.cu's bit for bit (the partial LSEs' log-sum-exp in its
// summation order, each split weighted by exp(lse_s - lse), split s's product in class s and the
// classes' fixed pairwise tree, the sink merged once), so a call gives the same bits clustered
// or not: a CUDA-graph replay of a fixed split count (empty splits past the keys, the combine)
// equals the eager call whose keys cap its count at 2 (clustered). A NaN partial makes the row
// NaN, empty splits (-inf) weigh 0, all empty gives out 0 and LSE -inf. Batch-invariant calls
// (fixed-size splits, a count per sequence) never take it.
//
// Used by the decode kernel (decode_mainloop.cuh) and decode_mla_heads; sm_90+ only (clusters).
#pragma once

#include <cooperative_groups.h>

#include "common/softmax_state.hpp"
#include "kernels/attention/epilogue.cuh"
#include "kernels/attention/softmax.cuh"
#include "kernels/common/sm_fit.hpp"

namespace flashserve::kernels {

// Where packed row j of the CTA's row group goes: out[qb, q_row, h] and its LSE.
struct RowDest {
  int64_t qb, q_row, h;
};

// The CTAs of this CTA's cluster: 1 unless the launch put the splits in one cluster.
FS_DEV int cluster_ctas() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return int(cooperative_groups::this_cluster().num_blocks());
#else
  return 1;
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Class c of row j's float4 v: split c's product w_c x_c (from zero; zeros past n), x_c read
// from rank c's partial rows xo through distributed shared memory, w [c * kRows + j].
template <int kRows, int kDv>
FS_DEV auto cluster_class(const float* xo, const float* w, int j, int v, int n) {
  return [=](int c) {
    if (c >= n) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float wc = w[c * kRows + j];
    const float4 x = reinterpret_cast<const float4*>(cooperative_groups::this_cluster().map_shared_rank(xo, c) +
                                                     j * kDv)[v];
    return make_float4(fmaf(wc, x.x, 0.0f), fmaf(wc, x.y, 0.0f), fmaf(wc, x.z, 0.0f), fmaf(wc, x.w, 0.0f));
  };
}
// The tree of all kClusterMaxCtas classes, out of line: inline, its loads raised the decode
// kernels' spills (bf16 short tiling 52 -> 88 bytes) for the clusters of 3-16 splits that only
// FLASHSERVE_DECODE_CLUSTER=1 forms.
template <int kRows, int kDv>
__device__ __noinline__ float4 cluster_classes16(const float* xo, const float* w, int j, int v, int n) {
  return class_tree<0, kClusterMaxCtas>(cluster_class<kRows, kDv>(xo, w, j, v, n));
}
#endif

// Shared memory of cluster_combine's scratch for kRows rows: each rank's weight per row and the
// row's sink weight.
static_assert(kClusterMaxCtas == kCombineClasses, "a cluster's split c is combine.cu's class c");
template <int kRows>
inline constexpr int kClusterScratchFloats = (kClusterMaxCtas + 1) * kRows;

// Rows [0, nrows) of kDv channels (a multiple of 4): this CTA's split partials are xo [kRows,
// kDv] (normalized, as combine.cu's o_partial rows) and xl [kRows] (partial LSEs), in shared
// memory, as in each CTA of the cluster; scratch holds kClusterScratchFloats<kRows> floats of
// this CTA's shared memory. dest(j) names row j's destination. Every thread of every CTA of the
// cluster calls it; on return the CTA's xo, xl and scratch may be reused.
template <int kRows, int kDv, int kThreads, class Dest>
FS_DEV void cluster_combine(const AttnParams& p, const float* xo, const float* xl, float* scratch, int nrows,
                            Dest&& dest) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kDv % 4 == 0, "float4 channels");
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  const int n = int(cl.num_blocks()), rank = int(cl.block_rank()), t = int(threadIdx.x);
  float* w = scratch;                             // [kClusterMaxCtas][kRows]: rank c's weight of row j
  float* ws = scratch + kClusterMaxCtas * kRows;  // [kRows]: the sink's weight of row j (NaN: the row is NaN)
  cl.sync();  // every CTA's partials are in its shared memory
  // The rows' merged LSEs and the ranks' weights (this CTA's rows: j = rank, rank + n, ...).
  for (int j = rank + n * t; j < nrows; j += n * kThreads) {
    float lse = merge_lses(
        n, [&](int c) { return cl.map_shared_rank(xl, c)[j]; }, [&](int c, float wc) { w[c * kRows + j] = wc; });
    const RowDest d = dest(j);
    const float sink_w = apply_sink(p, d.h, lse);  // lse: the sink merged in
    ws[j] = lse != lse ? NAN : sink_w;
    store_lse(p, d.qb, d.q_row, d.h, lse);
  }
  __syncthreads();
  // The channels: (row, float4) items of this CTA's rows over its threads.
  constexpr int kVec = kDv / 4;
  const int mine = (nrows - rank + n - 1) / n;  // rows rank, rank + n, ...
  for (int i = t; i < mine * kVec; i += kThreads) {
    const int j = rank + n * (i / kVec), v = i % kVec;
    // combine.cu's classes: split c's product (from zero) in class c, then their pairwise tree
    // (classes past n are zeros, which leave the sums as they are: 2 classes' tree for n <= 2).
    const float4 acc = n <= 2 ? class_tree<0, 2>(cluster_class<kRows, kDv>(xo, w, j, v, n))
                              : cluster_classes16<kRows, kDv>(xo, w, j, v, n);
    const float s = ws[j];
    const RowDest d = dest(j);
    const float x[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) store_out(p, d.qb, d.q_row, d.h, 4 * v + e, s != s ? NAN : x[e] * s);
  }
  cl.sync();  // the peers are done with this CTA's partials
#endif
}

}  // namespace flashserve::kernels
