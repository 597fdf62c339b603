// Split-KV merge inside a thread-block cluster: the splits of one (sequence, row group) run as
// the CTAs of one cluster (the launch's cluster dimension (1, 1, num_splits), grid z the
// splits), each leaves its split's partial rows in its own shared memory, and after a cluster
// barrier the CTAs merge them through distributed shared memory and write out and LSE. No split
// partials go through the workspace and no combine kernel runs (combine.cu: 3.8-6 us per call on
// the H200, a chain of dependent round trips after the forward grid's end, bench/RESULTS.md
// 2026-11-26). The merge is combine.cu's (the partial LSEs' log-sum-exp, each split weighted by
// exp(lse_s - lse), the sink merged once) in rank order, up to fp32 rounding: a NaN partial makes
// the row NaN, empty splits (-inf) weigh 0, all empty gives out 0 and LSE -inf. It is not
// combine.cu's fixed class-sum tree, so batch-invariant calls (fixed-size splits) never take it.
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

// Shared memory of cluster_combine's scratch for kRows rows: each rank's weight per row and the
// row's sink weight.
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
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c = 0; c < n; ++c) {
      const float wc = w[c * kRows + j];
      if (wc == 0.0f) continue;  // an empty split adds nothing
      const float4 x = reinterpret_cast<const float4*>(cl.map_shared_rank(xo, c) + j * kDv)[v];
      acc.x = fmaf(wc, x.x, acc.x), acc.y = fmaf(wc, x.y, acc.y), acc.z = fmaf(wc, x.z, acc.z),
      acc.w = fmaf(wc, x.w, acc.w);
    }
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
