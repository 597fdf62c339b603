// The sm_90a MLA absorbed-decode kernel for 64 packed rows of a 16-bit latent cache in
// FlashMLA's shape (our way): 64-key tiles, S and P in registers, the two consumer warpgroups
// taking turns as the tile's owner, a producer warp loading the tiles by TMA.
//
// CTA = (sequence, row slice, split) as decode_mla; 384 threads: consumer warpgroups 0 and 1
// (232 registers each by setmaxnreg) and a producer warpgroup whose first warp loads (40).
// Shared memory (1024-byte aligned, 226 KB): Q [64, 576] | 2 stages of [64 keys, 576] ([k | v]:
// column block 0 is k, 1-8 the latent) | P [64, 64] | m, alpha [64] | l [2, 64] | mbarriers.
// All of them are SwizzledTile<64> (wgmma.cuh).
//
// Tile t (keys base + 64 t ..) lives in stage t % 2 (counted over the CTA's row groups) and is
// owned by warpgroup t % 2. The owner: S = Q [k | v]^T on wgmma m64n64k16 (36, both operands
// from shared memory: the n64 rate is the tensor pipe's full rate, where n32 was shared-memory
// bound), the online softmax in registers (the row's 4 lanes), P (16-bit) to shared memory with
// the rows' new max and alpha, a hand-over mbarrier to the other warpgroup, then O [64, 256 w ..
// +256] = O alpha + P V with P from registers (4 wgmma m64n256k16). The other warpgroup, at
// that mbarrier, rescales its O by alpha and adds P V with P from shared memory (wgmma_ss_tb),
// before issuing its own tile's S; it waits for that P V before it overwrites P with its own
// tile's. The running max goes from owner to owner with P; each warpgroup keeps l over its own
// tiles (rescaled by every tile's alpha), summed at the end. A stage is released in three parts
// (empty barriers, one arrival per reading warp): k once the owner's S retired, each latent
// half once its warpgroup's P V did; the producer refills part by part with tile t + 2, so the
// next tile's k and first half load while the second half is still read.
//
// Loads: a tile is one TMA box per 64-channel column block and page segment, each column block
// on its own full barrier so that S starts on block 0 while the others land (FlashMLA's
// pipelined Q K^T), at its page's block id (pages of >= 64 keys, or segments of 16-32 keys);
// tiles that leave the sequence or the cache, or whose block ids are bad, go through prefill's
// copy_tail (cp.async: keys outside the cache NaN, values zero, tokens past the sequence zero),
// so garbage never meets P = 0 in P V. Tiles start pages when splits start at multiples of 64
// keys (the GPU plan's 128-key granule); others take copy_tail (correct, slower).
//
// Arithmetic per 64-key tile (64 rows): S 64 x 64 x 576 + P V 64 x 512 x 64 = 4.46 M MAC =
// 2176 clk of the tensor pipe at 2048 dense bf16 MAC/clk/SM (S 1152, the two P V 512 each;
// bench/wgmma_rate: m64n64k16 SS at the full rate, 32.4 clk, where decode_mla_wgmma's m64n32k16
// took 24.4 clk for half the work). The running max makes the tiles a chain: per tile the
// other tile's P V, S, the softmax and the hand-over run one after the other; predicted ~2700
// clk per tile (~80% of the pipe).
// Measured (H200, H = 128, B = 64, L = 4k, block 64; bench/RESULTS.md): 167.6 us (decode_mla_wgmma
// 250.6), 436 TFLOP/s = 61% of cuBLAS's bf16 GEMM; ncu: the tensor pipe 41% active, 30% of the
// warp samples at the hand-over wait (the chain). (Out through shared memory with 16-byte row
// stores was tried: 1% faster without splits, 3-7% slower with them from the added registers.)
// The release in parts: 1-2% on every 64-row shape (169.6 -> 167.2 us at H = 128 B = 64).
// Next: the other warpgroup's share of S (FlashMLA's phases; a partial S needs shared memory
// that a Q block kept in registers would free) to shorten the chain.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/attention/decode_mla_wgmma.cuh"
#include "kernels/attention/tma_tiles.cuh"
#include "kernels/common/tma.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels::mla {

// The kernel's parameters: the tensor maps of k and v (boxes of prefill_tma_box_rows(64, ..) keys
// x 64 channels: a tile, or a page of fewer keys) next to AttnParams.
struct PpParams {
  CUtensorMap k, v;
  AttnParams p;
};

template <DType kDt>
struct PpShape : WgShape<kDt> {
  using L = SwizzledTile<kMlaPpKeys>;
  static constexpr int kKeys = kMlaPpKeys;
  static constexpr int kBlocks = kMlaWidth / 64;       // column blocks of Q or a stage: k, then 8 of the latent
  static constexpr uint32_t kBlock = L::kBlockBytes;  // one 64-channel column block
  static constexpr uint32_t kTileBytes = uint32_t(kBlocks) * kBlock;
  static constexpr uint32_t kStageOff = kTileBytes;
  static constexpr uint32_t kPOff = kStageOff + 2 * kTileBytes;
  static constexpr uint32_t kMOff = kPOff + kBlock;
  static constexpr uint32_t kAlphaOff = kMOff + 64 * 4;
  static constexpr uint32_t kLOff = kAlphaOff + 64 * 4;
  static constexpr uint32_t kBarOff = kLOff + 2 * 64 * 4;
  static constexpr uint32_t kBytes = kBarOff + (2 * kBlocks + 8) * 8;
  static_assert(kBytes + 1024 == mla_pp_smem_bytes(), "decode_mla_config.hpp sizes shared memory with it");
  static_assert(kKeys == 64 && WgShape<kDt>::kM == 64, "64 rows x 64 keys");
};

// The kernel's shared memory at S's offsets (base 1024-byte aligned).
template <class S>
struct PpSmem {
  unsigned char* base;
  uint32_t q;
  FS_DEV explicit PpSmem(unsigned char* b) : base(b), q(warp_uniform(smem_u32(b))) {}
  FS_DEV uint32_t stage(int st) const { return q + S::kStageOff + uint32_t(st) * S::kTileBytes; }
  FS_DEV uint32_t pbuf() const { return q + S::kPOff; }
  FS_DEV float* m() const { return reinterpret_cast<float*>(base + S::kMOff); }
  FS_DEV float* alpha() const { return reinterpret_cast<float*>(base + S::kAlphaOff); }
  FS_DEV float* l() const { return reinterpret_cast<float*>(base + S::kLOff); }
  // column block c of stage st landed (one barrier per block: S starts on the first)
  FS_DEV uint32_t full(int st, int c) const { return q + S::kBarOff + 8 * uint32_t(st * S::kBlocks + c); }
  // part of stage st released: 0 k (column block 0; S read it), 1 + w warpgroup w's latent half
  // (blocks 1 + 4 w .. 4 + 4 w; S and w's P V read it): the producer refills each part as soon
  // as its readers are done
  FS_DEV uint32_t empty(int st, int part) const {
    return q + S::kBarOff + 8 * uint32_t(2 * S::kBlocks + 3 * st + part);
  }
  // warpgroup w's next foreign tile published (P, m, alpha): the other warpgroup's 128 threads
  // arrive, each after its own writes (a release per writer, which racecheck follows; a named
  // barrier's arrive measured the same and racecheck reported the P stores as races)
  FS_DEV uint32_t ready(int w) const { return q + S::kBarOff + 8 * uint32_t(2 * S::kBlocks + 6 + w); }
};

// A row group's tiles: keys [base, base + 64 n) over the union u of its rows' visible keys
// (aligned to the split's start, as decode_mla).
struct PpTiles {
  KeyRange u;
  int64_t base, n;
};
template <class S>
FS_DEV PpTiles pp_tiles(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows) {
  PpTiles t;
  t.u = decode::group_key_union(p, s, g0, nrows);
  t.base = s.range.begin + (t.u.lo - s.range.begin) / S::kKeys * S::kKeys;
  t.n = t.u.lo < t.u.hi ? (t.u.hi - t.base + S::kKeys - 1) / S::kKeys : 0;
  return t;
}

// The producer warp: tile j of the row group (the CTA's tile j0 + j) into stage (j0 + j) % 2 once
// its consumers released it, by TMA where prefill's tma_tile allows (its block ids read a tile
// ahead), else by copy_tail. Sm: the kernel's shared memory (stage(st), full(st, c), empty(st, part);
// PpSmem, decode_mla_heads_tma.cuh's HeadsTmaSmem).
template <class S, class Sm>
FS_DEV void pp_produce(const PpParams& tp, const DecodeSeq& s, const PpTiles& tl, int64_t j0, const Sm& sm, int lane) {
  using T = typename S::T;
  using L = typename S::L;
  constexpr int kN = S::kKeys;
  const AttnParams& p = tp.p;
  const int seg = prefill_tma_box_rows(kN, p.paged, p.kv_dim1);
  const auto id_of = [&](int64_t j) {
    return j < tl.n ? prefill::tma_tile_id<kN>(p, s.kv, s.cache, s.sk, tl.base + j * kN, seg, lane) : int64_t(0);
  };
  int64_t id = id_of(0);
#pragma unroll 1
  for (int64_t j = 0; j < tl.n; ++j) {
    const int64_t next = id_of(j + 1);  // in flight during the wait
    const int64_t jg = j0 + j, n0 = tl.base + j * kN;
    const int st = int(jg & 1);
    const uint32_t epar = uint32_t((jg >> 1) & 1) ^ 1u;
    int row = 0, blk = 0;
    if (prefill::tma_tile_from<kN>(p, s.kv, s.cache, s.sk, n0, seg, lane, id, row, blk)) {
      // part by part as released: k, then the latent halves; every lane arrives on each block's
      // barrier (lane 0 with its bytes) before the block's boxes are issued
#pragma unroll
      for (int part = 0; part < 3; ++part) {
        if (jg >= 2) mbar_wait(sm.empty(st, part), epar);
        const int c0 = part == 0 ? 0 : 1 + 4 * (part - 1), c1 = part == 0 ? 1 : c0 + 4;
        for (int c = c0; c < c1; ++c) {
          if (lane == 0) mbar_arrive_expect_tx(sm.full(st, c), S::kBlock);
          else mbar_arrive(sm.full(st, c));
        }
        __syncwarp();
        if (lane < kN / seg) {  // page segment `lane`: seg rows of each column block
          const uint32_t at = sm.stage(st) + uint32_t(lane * seg) * 128u;
          for (int c = c0; c < c1; ++c) {
            if (c == 0) tma_load_4d(at, &tp.k, sm.full(st, 0), 0, 0, row, blk);
            else tma_load_4d(at + uint32_t(c) * S::kBlock, &tp.v, sm.full(st, c), (c - 1) * 64, 0, row, blk);
          }
        }
      }
    } else {
      if (jg >= 2)
        for (int part = 0; part < 3; ++part) mbar_wait(sm.empty(st, part), epar);
      prefill::copy_tail<T, L, kN, kMlaD / 8, true>(p, s.kv, s.sk, n0, sm.stage(st), sm.full(st, 0), lane);
      prefill::copy_tail<T, L, kN, kMlaDv / 8, false>(p, s.kv, s.sk, n0, sm.stage(st) + S::kBlock, sm.full(st, 1), lane);
#pragma unroll
      for (int c = 2; c < S::kBlocks; ++c) mbar_arrive(sm.full(st, c));  // copy_tail waited for its copies
    }
    id = next;
  }
}

// S = Q [k | v]^T of a stage (36 wgmma m64n64k16, one commit group), each column block's four
// k16 steps issued once it landed (full(c) at parity par); descriptors warp-uniform.
template <class S, class Full>
FS_DEV void pp_issue_s(uint32_t q, uint32_t stage, Full&& full, uint32_t par, float (&acc)[S::kKeys / 8][4]) {
  using T = typename S::T;
  const uint64_t da = desc_k_major<S::kKeys>(q, 0, 0), db = desc_k_major<S::kKeys>(stage, 0, 0);
  const uint32_t alo = warp_uniform(uint32_t(da)), ahi = warp_uniform(uint32_t(da >> 32));
  const uint32_t blo = warp_uniform(uint32_t(db)), bhi = warp_uniform(uint32_t(db >> 32));
  fence_operands(acc);
#pragma unroll
  for (int ks = 0; ks < kMlaWidth / 16; ++ks) {
    if (ks % 4 == 0) {  // the fence after each wait: ptxas serializes the chain otherwise (C7520)
      mbar_wait(full(ks / 4), par);
      wgmma_fence();
    }
    const uint32_t off = k_step_bytes<S::kKeys>(ks) >> 4;
    wgmma_ss<T, S::kKeys>(acc, (uint64_t(ahi) << 32) | (alo + off), (uint64_t(bhi) << 32) | (blo + off), ks > 0);
  }
  wgmma_commit();
}

// O += P V over the warpgroup's 256 latent channels `v` of a stage: P from registers (the owner)
// or from shared memory (the other warpgroup). One commit group each.
template <class S>
FS_DEV void pp_issue_pv_rs(const uint32_t (&pa)[4][4], uint32_t v, float (&o)[1][kMlaDv / 16][4]) {
  using T = typename S::T;
  fence_operands(o[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, kMlaDv / 2>(o[0], pa[kk], desc_n_major<S::kKeys>(v, kk), 1);
  wgmma_commit();
}
template <class S>
FS_DEV void pp_issue_pv_ss(uint32_t pbuf, uint32_t v, float (&o)[1][kMlaDv / 16][4]) {
  using T = typename S::T;
  fence_operands(o[0]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_ss_tb<T, kMlaDv / 2>(o[0], desc_k_major<S::kKeys>(pbuf, 0, kk), desc_n_major<S::kKeys>(v, kk), 1);
  wgmma_commit();
}

// O (rows r0, r0 + 8 of the thread) times alpha, skipped when no row of the warp moved.
FS_DEV void pp_rescale(float (&o)[1][kMlaDv / 16][4], const float (&alpha)[2]) {
  if (!__any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) return;
#pragma unroll
  for (int n = 0; n < kMlaDv / 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][n][e] *= alpha[e / 2];
}

// A softmax thread's row: its visibility (decode::row_meta's pos, lo, hi, slope).
struct PpRow {
  int64_t pos, lo, hi;
  float slope;
};

// The online softmax of the owner's S [64, 64] in registers (m64n64 accumulators: rows r0 and
// r0 + 8, keys 8 n + 2 (lane % 4) + {0, 1}), keys t0 + column; decode_mla's softmax_rows per
// element (natural units, exp2 with log2(e) folded). m, l, alpha: the thread's two rows (l the
// lane's partial sum). S becomes P (fp32).
FS_DEV void pp_softmax(const ScoreTransform& score, float (&acc)[8][4], const PpRow (&rows)[2], int64_t t0, int lane,
                       float (&m)[2], float (&l)[2], float (&alpha)[2]) {
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const PpRow& r = rows[h];
    float mx = kNegInf;
    if (score.plain() && t0 >= r.lo && t0 + 64 <= r.hi) {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = acc[n][2 * h + e];
          x *= score.scale;
          mx = nan_max(mx, x);
        }
    } else {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = acc[n][2 * h + e];
          const int64_t key = t0 + 8 * n + 2 * (lane % 4) + e;
          x = key < r.lo || key >= r.hi ? kNegInf : score(x, r.pos, key, r.slope);
          mx = nan_max(mx, x);
        }
    }
    mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, 2));
    const float new_m = nan_max(m[h], mx);
    alpha[h] = 1.0f;
    if (new_m == kNegInf) {  // nothing visible yet: p = 0, state unchanged
#pragma unroll
      for (int n = 0; n < 8; ++n) acc[n][2 * h] = acc[n][2 * h + 1] = 0.0f;
      continue;
    }
    const float mb = new_m * kLog2e;
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = acc[n][2 * h + e];
        x = fast_exp2(fmaf(x, kLog2e, -mb));  // -inf -> 0, NaN stays
        sum += x;
      }
    alpha[h] = m[h] == new_m ? 1.0f : fast_exp2(fmaf(m[h], kLog2e, -mb));  // m = -inf -> 0; NaN -> NaN
    l[h] = l[h] * alpha[h] + sum;
    m[h] = new_m;
  }
}

// P (16-bit) as the RS wgmma's A fragments (k16 step kk: keys 16 kk ..) and into shared memory
// (SwizzledTile<64>, K-major: the other warpgroup's A operand).
template <class S>
FS_DEV void pp_publish_p(const float (&acc)[8][4], uint32_t (&pa)[4][4], unsigned char* pbuf, int r0, int lane) {
  using T = typename S::T;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
    pa[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
    pa[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    pa[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
  const uint32_t c = 4u * uint32_t(lane % 4);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // (row r0 | r0 + 8) x (chunk 2 kk | 2 kk + 1)
      const int row = r0 + 8 * (e % 2), chunk = 2 * kk + e / 2;
      *reinterpret_cast<uint32_t*>(pbuf + S::L::at(row, chunk) + c) = pa[kk][e];
    }
}

// The row group's epilogue, once both warpgroups' P V retired: l over the row's lanes and both
// warpgroups, the scale 1 / l (with the sink) and the LSE by warpgroup 0, out (or the split's
// partial) by both; ends synchronized (the scales are read before the next row group's).
template <class S>
FS_DEV void pp_epilogue(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, const PpSmem<S>& sm,
                        const float (&o)[1][kMlaDv / 16][4], const float (&m)[2], float (&l)[2], int wg, int ww,
                        int r0, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
  }
  if (lane % 4 == 0) sm.l()[wg * 64 + r0] = l[0], sm.l()[wg * 64 + r0 + 8] = l[1];
  named_sync(1, 256);  // both loops done (alpha free), both l written
  if (wg == 0 && lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = r0 + 8 * h;
      sm.alpha()[j] = finish_row(p, s, g0, nrows, split, j, m[h], sm.l()[j] + sm.l()[64 + j], 1.0f);
    }
  }
  named_sync(1, 256);
  store_o<S, 1, kMlaDv / 16, false>(p, s, g0, nrows, split, sm.alpha(), o, 16 * ww, wg * (kMlaDv / 2), lane);
  named_sync(1, 256);
}

// A consumer warpgroup's row group: tiles of the other warpgroup by P from shared memory, its
// own (t = wg, wg + 2, ..) by S, the softmax and P from registers; then the epilogue. ready_par:
// the phase of ready(wg) the next foreign tile completes (counted over the CTA's row groups).
template <class S, bool kEarlyRelease>
FS_DEV void pp_consume(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, const PpTiles& tl,
                       int64_t j0, const PpSmem<S>& sm, int wg, uint32_t& ready_par) {
  const int tid = int(threadIdx.x) % 128, ww = tid / 32, lane = tid % 32, r0 = 16 * ww + lane / 4;
  issue_q<S>(p, s, g0, nrows, sm.q);
  cp_async_commit();
  PpRow rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowMeta mt = decode::row_meta(p, s, 0, g0, nrows, r0 + 8 * h);
    rows[h] = {mt.pos, mt.lo, mt.hi, mt.slope};
  }
  const ScoreTransform score = make_score_transform(p);
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  float o[1][kMlaDv / 16][4];
#pragma unroll
  for (int n = 0; n < kMlaDv / 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][n][e] = 0.0f;
  float acc[8][4];
  uint32_t pa[4][4];
  cp_async_wait<0>();
  fence_proxy_async_shared();
  named_sync(1, 256);  // Q landed (every consumer's copies)

  const uint32_t vcol = S::kBlock * uint32_t(1 + 4 * wg);  // the warpgroup's latent channels in a stage
  const auto st_of = [&](int64_t t) { return int((j0 + t) & 1); };
  const auto par_of = [&](int64_t t) { return uint32_t(((j0 + t) >> 1) & 1); };
  // The other warpgroup's tile: this warpgroup's latent half landed (its owner saw it; waited
  // here for the async proxy's view; k and the other half may already hold tile t + 2's blocks)
  const auto wait_half = [&](int64_t t) {
    for (int c = 1 + 4 * wg; c < 5 + 4 * wg; ++c) mbar_wait(sm.full(st_of(t), c), par_of(t));
  };
  const auto release = [&](int64_t t) {  // this warp's P V of tile t retired: its latent half
    if (lane == 0) mbar_arrive(sm.empty(st_of(t), 1 + wg));
  };
  const auto release_k = [&](int64_t t) {  // the owner's S of tile t retired: k
    if (lane == 0) mbar_arrive(sm.empty(st_of(t), 0));
  };
  int64_t rs_tile = -1;  // the own tile whose P V (P from registers) is in flight
#pragma unroll 1
  for (int64_t t = wg; t <= tl.n; t += 2) {
    // The waits stay outside branches: ptxas serializes every wgmma (C7518) when it cannot
    // prove the accumulators settled on every path that touches them.
    wgmma_wait<0>();
    fence_operands(o[0]);
    fence_fragments(pa);
    if (rs_tile >= 0) release(rs_tile);
    rs_tile = -1;
    const int64_t f = t - 1;  // the other warpgroup's tile
    if (f >= 0) {
      mbar_wait(sm.ready(wg), ready_par);  // its P, m and alpha published
      ready_par ^= 1u;
      wait_half(f);
      const float al[2] = {sm.alpha()[r0], sm.alpha()[r0 + 8]};
      m[0] = sm.m()[r0], m[1] = sm.m()[r0 + 8];
      l[0] *= al[0], l[1] *= al[1];
      pp_rescale(o, al);
      pp_issue_pv_ss<S>(sm.pbuf(), sm.stage(st_of(f)) + vcol, o);
    }
    if (kEarlyRelease || t == tl.n) {
      // The other tile's P V retired (P free, O settled) and its stage released before S waits
      // for this tile's blocks, so the producer loads tile t + 1 while tile t lands: pages of
      // fewer than 64 keys (a tile of 4-36 boxes) measured 9% faster so, pages of 64 7% slower.
      wgmma_wait<0>();
      fence_operands(o[0]);
      if (f >= 0) release(f);
      if (t == tl.n) break;  // no own tile left
      pp_issue_s<S>(sm.q, sm.stage(st_of(t)), [&](int c) { return sm.full(st_of(t), c); }, par_of(t), acc);
    } else {
      // S issued under the other tile's P V, which is waited for (and its stage released) once
      // S's blocks landed.
      pp_issue_s<S>(sm.q, sm.stage(st_of(t)), [&](int c) { return sm.full(st_of(t), c); }, par_of(t), acc);
      wgmma_wait<1>();
      fence_operands(o[0]);
      if (f >= 0) release(f);
    }
    wgmma_wait<0>();
    fence_operands(acc);
    release_k(t);
    float alpha[2];
    pp_softmax(score, acc, rows, tl.base + t * S::kKeys, lane, m, l, alpha);
    pp_publish_p<S>(acc, pa, sm.base + S::kPOff, r0, lane);
    if (lane % 4 == 0) {
      sm.m()[r0] = m[0], sm.m()[r0 + 8] = m[1];
      sm.alpha()[r0] = alpha[0], sm.alpha()[r0 + 8] = alpha[1];
    }
    fence_proxy_async_shared();  // P visible to the other warpgroup's wgmma
    mbar_arrive(sm.ready(1 - wg));
    pp_rescale(o, alpha);
    pp_issue_pv_rs<S>(pa, sm.stage(st_of(t)) + vcol, o);
    rs_tile = t;
  }
  wgmma_wait<0>();
  fence_operands(o[0]);
  fence_fragments(pa);
  if (rs_tile >= 0) release(rs_tile);
  pp_epilogue<S>(p, s, g0, nrows, split, sm, o, m, l, wg, ww, r0, lane);
}

// kEarlyRelease: pp_consume's order for paged caches of fewer than 64 keys per page.
template <DType kDt, bool kEarlyRelease>
__global__ void __launch_bounds__(384, 1) decode_mla_pp(const __grid_constant__ PpParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = PpShape<kDt>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const PpSmem<S> sm(align_1024(smem_raw));
  const AttnParams& p = tp.p;
  if (threadIdx.x == 0) {
    tma_prefetch_desc(&tp.k);
    tma_prefetch_desc(&tp.v);
    for (int st = 0; st < 2; ++st) {
      for (int c = 0; c < S::kBlocks; ++c) mbar_init(sm.full(st, c), prefill::kFullArrivals);
      for (int part = 0; part < 3; ++part) mbar_init(sm.empty(st, part), 4);  // one per reading warp
      mbar_init(sm.ready(st), 128);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int wg = int(warp_uniform(threadIdx.x / 128));
  const int split = int(blockIdx.z);
  const DecodeSeq s = decode::decode_sequence(p, blockIdx.x, 0, split);
  const int64_t packed = s.rows.sq() * p.group;
  if (wg == 2) {
    regs_dealloc<40>();
    if (threadIdx.x / 32 != 8) return;
    int64_t j0 = 0;  // the CTA's tiles before this row group (stage and phase counters)
    for (int64_t g0 = int64_t(blockIdx.y) * 64; g0 < packed; g0 += int64_t(gridDim.y) * 64) {
      const PpTiles tl = pp_tiles<S>(p, s, g0, int(imin(64, packed - g0)));
      pp_produce<S>(tp, s, tl, j0, sm, int(threadIdx.x) % 32);
      j0 += tl.n;
    }
    return;
  }
  regs_alloc<232>();
  int64_t j0 = 0;
  uint32_t ready_par = 0;
  for (int64_t g0 = int64_t(blockIdx.y) * 64; g0 < packed; g0 += int64_t(gridDim.y) * 64) {
    const int nrows = int(imin(64, packed - g0));
    const PpTiles tl = pp_tiles<S>(p, s, g0, nrows);
    pp_consume<S, kEarlyRelease>(p, s, g0, nrows, split, tl, j0, sm, wg, ready_par);
    j0 += tl.n;
  }
#endif
}

// The kernel's parameters (host side, per call): the maps of k [dim0, dim1, 1, 64] and v [.., 512]
// with boxes of one tile or one page of fewer keys.
inline PpParams pp_params(const AttnParams& p) {
  const int box = prefill_tma_box_rows(kMlaPpKeys, p.paged, p.kv_dim1);
  PpParams tp;
  tp.p = p;
  tp.k = make_tma_map(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kMlaD, box, "k");
  tp.v = make_tma_map(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kMlaDv, box, "v");
  return tp;
}

}  // namespace flashserve::kernels::mla
