// decode_mla_heads' 16-row 2 x 2 shape (16-bit latent) with its stages loaded by TMA from a
// producer warp (decode_mla_pp.cuh's pp_produce: one box per 64-channel column block and page
// segment, a full mbarrier per stage and column block; tails and bad block ids by prefill's
// copy_tail: keys outside the cache NaN, values zero), so that the copies leave the
// warpgroups' chain: in the cp.async shape every thread issued 18 copies (~750 clk of a ~5200
// clk tile) after P V, and the CTA waited for a whole tile before S. Here S's k16 steps of
// column block c wait for block c only, and each consumer warp releases the stage (empty
// mbarrier, 8 arrivals) once its P V retired; the producer refills it with tile k + 2.
//
// 288 threads: warpgroups 0 and 1 run decode_mla_heads' loop (S^T split over the warpgroups'
// k16 steps, the partials exchanged, softmax down the columns, P^T by warpgroup 0, P V by
// latent halves) on named barrier 1 over their 256 threads (rows_sync); warp 8 produces. Bad
// keys arrive as NaN rows (copy_tail), so the softmax needs no bad masks: a tile is plain when
// every row sees all of it.
#pragma once

#include "kernels/attention/decode_mla_heads.cuh"
#include "kernels/attention/decode_mla_pp.cuh"

namespace flashserve::kernels::mla {

template <DType kDt>
using HeadsTmaShape = HeadsShape<kDt, kDt, 2, 2, true>;

// The shape's stages and barriers at S's offsets (base 1024-byte aligned): pp_produce's view.
template <class S>
struct HeadsTmaSmem {
  uint32_t base;
  FS_DEV explicit HeadsTmaSmem(unsigned char* b) : base(warp_uniform(smem_u32(b))) {}
  FS_DEV uint32_t stage(int st) const { return base + uint32_t(S::kKvOff) + uint32_t(st) * uint32_t(S::kStageBytes); }
  FS_DEV uint32_t full(int st, int c) const { return base + uint32_t(S::kBarOff) + 8u * uint32_t(st * S::kBlocks + c); }
  // stage st released (every part of it at once: both warpgroups read the whole stage in S)
  FS_DEV uint32_t empty(int st, int = 0) const {
    return base + uint32_t(S::kBarOff) + 8u * uint32_t(S::kStages * S::kBlocks + st);
  }
};

// One row group of the consumers: tiles j0 + k (k < tl.n) of the CTA in stage (j0 + k) % 2.
template <class S>
FS_DEV void run_rows_heads_tma(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split,
                               const PpTiles& tl, int64_t j0, unsigned char* sm, const HeadsTmaSmem<S>& bars) {
  constexpr int kN = S::kN;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, ww = warp % 4;
  const int wg = int(warp_uniform(uint32_t(tid / 128)));
  const uint32_t q = smem_u32(sm + S::kQOff), pbuf = smem_u32(sm + S::kPOff);
  float* spart = reinterpret_cast<float*>(sm + S::kSOff);
  float* red = reinterpret_cast<float*>(sm + S::kRedOff) + wg * 5 * S::kM;
  RowMeta* meta = reinterpret_cast<RowMeta*>(sm + S::kMetaOff);
  float* rscale = reinterpret_cast<float*>(sm + S::kScaleOff);
  start_rows<S>(p, s, g0, nrows, q, meta);
  ColState cs;
  float o[S::kMb][2][4];
  start_cols<S>(cs, o);
  const bool plain_rows = make_score_transform(p).plain();
  int64_t all_lo = tl.u.lo, all_hi = tl.u.hi;  // the keys every row sees: plain tiles
  for (int j = 0; j < nrows; ++j) all_lo = imax(all_lo, meta[j].lo), all_hi = imin(all_hi, meta[j].hi);
  float acc[2][4], acck[2][4];
  cp_async_wait<0>();  // start_rows' Q copies
  fence_proxy_async_shared();
  rows_sync<S>();
#pragma unroll 1
  for (int64_t k = 0; k < tl.n; ++k) {
    const int64_t jg = j0 + k;
    const int st = int(jg & 1);
    const uint32_t par = uint32_t((jg >> 1) & 1), stage = bars.stage(st);
    issue_s_heads<S>(q, stage, wg, acc, acck, [&](int c) {
      mbar_wait(bars.full(st, c), par);
      wgmma_fence();  // after each wait: ptxas serializes the chain otherwise (C7520)
    });
    wgmma_wait<0>();
    fence_operands(acc);
    float x[4][2];
    sum_partial_s<S>(acc, spart, wg, x);
    const int64_t t0 = tl.base + k * kN;
    const bool plain = plain_rows && t0 >= all_lo && t0 + kN <= all_hi;
    float al[4];
    softmax_cols<S>(p, x, meta, red, pbuf, 0u, 0u, t0, plain, cs, al, wg, ww, lane);  // P^T complete
    issue_pv_heads<S>(pbuf, stage, wg, al, o);
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < S::kMb; ++mb) fence_operands(o[mb]);
    // The warp's reads of the stage retired (S waited above). P^T and the shared partials are
    // rewritten only after the next tile's exchange barrier, which every warp reaches after this.
    if (lane == 0) mbar_arrive(bars.empty(st));
  }
  finish_cols<S>(p, s, g0, nrows, split, red - wg * 5 * S::kM, rscale, cs, o, wg, ww, lane);
}

template <DType kDt>
__global__ void __launch_bounds__(HeadsTmaShape<kDt>::kCtaThreads, 1)
    decode_mla_heads_tma(const __grid_constant__ PpParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = HeadsTmaShape<kDt>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = align_1024(smem_raw);
  const HeadsTmaSmem<S> bars(sm);
  const AttnParams& p = tp.p;
  if (threadIdx.x == 0) {
    tma_prefetch_desc(&tp.k);
    tma_prefetch_desc(&tp.v);
    for (int st = 0; st < S::kStages; ++st) {
      for (int c = 0; c < S::kBlocks; ++c) mbar_init(bars.full(st, c), prefill::kFullArrivals);
      mbar_init(bars.empty(st), S::kWarps);  // one arrival per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int split = int(blockIdx.z);
  const DecodeSeq s = decode::decode_sequence(p, blockIdx.x, 0, split);
  const int64_t packed = s.rows.sq() * p.group;
  const auto groups = [&](auto&& run) {  // the row groups, j0: the CTA's tiles before each
    int64_t j0 = 0;
    for (int64_t g0 = int64_t(blockIdx.y) * S::kM; g0 < packed; g0 += int64_t(gridDim.y) * S::kM) {
      const int nrows = int(imin(S::kM, packed - g0));
      const PpTiles tl = pp_tiles<S>(p, s, g0, nrows);
      run(g0, nrows, tl, j0);
      j0 += tl.n;
    }
  };
  if (warp_uniform(threadIdx.x / 32) == uint32_t(S::kWarps)) {  // the producer (the roles apart: C7520)
    groups([&](int64_t, int, const PpTiles& tl, int64_t j0) {
      pp_produce<S>(tp, s, tl, j0, bars, int(threadIdx.x) % 32);
    });
    return;
  }
  groups([&](int64_t g0, int nrows, const PpTiles& tl, int64_t j0) {
    rows_sync<S>();  // the previous row group's shared state read
    run_rows_heads_tma<S>(p, s, g0, nrows, split, tl, j0, sm, bars);
  });
#endif
}

}  // namespace flashserve::kernels::mla
