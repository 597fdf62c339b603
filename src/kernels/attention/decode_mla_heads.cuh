// The sm_90a MLA absorbed-decode kernel for 16 packed rows (H = 16 decode, q_len x H <= 16) with a
// 16-bit or fp8 latent cache: the rows are wgmma's N dimension and the keys its M ("heads as
// columns"), so that a 64-key tile is one m64n16 MMA chain with no padded rows. decode_mla.cuh's
// scheme otherwise (row groups, token location, masks and modifiers, sinks, split partials).
//
// fp8 (e4m3 / e5m2; the 2 x 2 shape): the tile's bytes go to registers (load_tile_fp8, two tiles
// ahead) and, converted to f16 (exact), into the next tile's stage while the tensor cores run S
// of this one (store_tile_fp8); q is staged as f16 scaled per row by a power of two
// (convert_q_fp8: RowMeta::qk_scale), the k and v descales go on S's two accumulators (k's
// column block apart from the latent's) and v's into the epilogue, as decode_mla's fp8 path.
// fp8, the RS shape (1 warpgroup x 2 raw stages, two CTAs per SM; larger grids): the stages
// hold the raw fp8 rows (kRawRow bytes: ldmatrix conflict-free) and both MMAs take A from
// registers, converted after ldmatrix (S^T: key rows, q in fp8_q_column's order; O^T: V^T by
// ldmatrix.trans + prmt, O^T's rows a channel permutation undone by finish_cols), on
// wgmma_rs_kb in double-buffered groups (issue_s_rs, issue_pv_rs).
//
// CTA = (sequence, row slice, split) as decode_mla; kWgs warpgroups, kStages KV stages, in two
// shapes (decode_mla_config.hpp; the launcher picks by the grid): 2 warpgroups x 2 stages, one
// CTA per SM, or 1 x 1, two CTAs per SM. Shared memory (1024-byte aligned): Q [16, 576]
// SwizzledTile<16> | kStages KV stages [64 keys, 576] SwizzledTile<64> ([k | v]: column block 0
// is k, blocks 1-8 the latent) | P^T [16, 64] SwizzledTile<16> | partial S^T [2, 8, 128] fp32 (2
// warpgroups) | column partials [kWgs, 5, 16] | RowMeta [16] | row scale [16] | TokenLoc 2 x [64]
// | bad masks. Per 64-key tile k:
//   1. S^T [64 keys, 16] = [k | v] Q^T: warpgroup w issues the k16 steps kWgs j + w (wgmma
//      m64n16k16, A = the tile K-major, B = Q K-major) into its partial; waited; with two
//      warpgroups the partials are exchanged through shared memory (barrier), so both hold S^T.
//   2. softmax down the columns, in every warpgroup alike: each thread holds 2 keys x 4
//      columns; column maxima over the warp's 16 keys by shuffles, over the warpgroup's 4 warps
//      through shared memory (barrier); alpha stays in registers (a thread's O^T columns are the
//      same 4); warpgroup 0 stores P^T (16-bit, stmatrix.trans). Barrier (P^T complete).
//   3. O^T [512, 16] = O^T alpha + V^T P^T: warpgroup w takes 8 / kWgs latent blocks, 4 wgmma
//      m64n16k16 each (A = the block M-major: wgmma_ss_ta; B = P^T K-major); waited, barrier
//      (the stage is free), then the copies of tile k + kStages into it (2 stages: two tiles in
//      flight while the CTA waits for tile k + 1; 1 stage: the SM's other CTA computes).
//
// Per 64-key tile (73.7 KB of KV): S 64 x 16 x 576 + P V 512 x 16 x 64 = 1.11 M MAC, 68 wgmma
// m64n16k16 reading 68 x 2.5 KB of shared memory. 85% of the copy ceiling needs a tile every
// ~4900 clk per SM (3.64 TB/s = ~15 B/clk per SM at 1.83 GHz).
// Measured (H200, bench/RESULTS.md 2026-11-25 11:40-12:45): per-tile timeline of the 2 x 2 shape
// (clock64, thread 0): S issue 1170 + wait 650 clk (36 wgmma: ~50 clk each, not the ~20 of their
// shared-memory reads), partial exchange 155, softmax 980, P barrier 345, P V 1100 (32 wgmma),
// copy issue 750 (18 cp.async per thread), landing 80-200: ~5200 clk = 2.9 us per tile, about
// the same with 8 CTAs on the GPU as with 128 (the CTA's serial chain binds, not HBM). Two CTAs
// per SM (1 x 1) overlap two chains: H=16 B=64 L=4k 120.2 us (decode_mla) -> 107.1 (planner's 4
// splits: 256 CTAs), B=128 L=8k 388.8 -> 324.4, B=1 L=32k 49.6 -> 39.0 (2 x 2: 64 CTAs), 66% of
// the copy ceiling at B=64. The copies on TMA (decode_mla_heads_tma.cuh) shorten a CTA's chain
// (B=64 L=4k one split, 64 CTAs: 152.5 -> 110.6 us) but stream HBM slower where 128 CTAs run
// long splits (B=128 L=8k 299.1 -> 311.2): the launcher takes them where the chain binds. ncu
// (2026-11-25; B=1 L=32k, 4 tiles per CTA): 24% of the warps' samples at the tiles' full
// barriers, 22% in the epilogue's stores (instruction fetch: store_out per element, now one
// dispatch per thread: B=1 L=32k 28.0 -> 26.3 us); B=64 L=4k: 17% at the landed barrier, 11% at
// the partial-S exchange, 8% at start_rows' barrier (the rows' metadata).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/attention/cluster_merge.cuh"
#include "kernels/attention/decode_mla.cuh"
#include "kernels/common/wgmma.cuh"

namespace flashserve::kernels::mla {

template <DType kDt, DType kKv, int kWgs_, int kStages_, bool kTma_ = false>
struct HeadsShape {
  static constexpr int kVb = kv_bytes(kKv);  // KV bytes per element (2, or 1: fp8)
  static constexpr bool kFp8 = kVb == 1;
  static constexpr DType kKvDt = kKv;
  // mma operand type: q's for 16-bit KV; f16 for fp8 KV (the tile converted, q staged as f16
  // scaled per row: convert_q_fp8)
  using T = std::conditional_t<!kFp8 && kDt == DType::bf16, __nv_bfloat16, __half>;
  using QT = std::conditional_t<kDt == DType::bf16, __nv_bfloat16, __half>;  // q, q_v in memory
  static constexpr int kM = kMlaHeadsRows;  // packed rows: the wgmma N
  static constexpr int kN = kMlaHeadsTileKeys;  // keys per tile: the wgmma M
  static constexpr int kWgs = kWgs_;  // warpgroups: parts of S's contraction, of P V's channels
  static constexpr int kThreads = 128 * kWgs;  // the warpgroups' (kTma: a producer warp after them)
  static constexpr int kWarps = kThreads / 32;
  // A producer warp loads the stages by TMA (decode_mla_heads_tma.cuh: 16-bit, 2 x 2)
  static constexpr bool kTma = kTma_;
  static constexpr int kCtaThreads = kThreads + (kTma ? 32 : 0);
  static constexpr int kStages = kStages_;
  // fp8 with one warpgroup (the RS shape): raw fp8 stages of kRawRow-byte rows, the MMAs' A
  // operands converted to f16 in registers (issue_s_rs, issue_pv_rs); q in fp8_q_column's order.
  static constexpr bool kRs = kFp8 && kWgs_ == 1;
  // fp8 with two warpgroups: each tile converted to f16 into its stage (load_tile_fp8, store_tile_fp8)
  static constexpr bool kConvert = kFp8 && !kRs;
  static constexpr bool kQPermuted = kRs;
  static constexpr int kRawRow = kMlaHeadsRawRow;
  static constexpr int kMb = 8 / kWgs;  // P V: 64-channel latent blocks per warpgroup
  static constexpr int kKSteps = kMlaWidth / 16;  // 36
  static constexpr int kSub = kN / 32;            // 32-key bad masks per stage (set_bad_masks)
  // fp8: the tile's 16-byte chunks (36 per key: 4 of k, 32 of v) per thread, in registers
  static constexpr int kChunks = kMlaWidth * kVb / 16;
  static constexpr int kRawPerThread = kN * kChunks / kThreads;
  static constexpr int kRawTpr = kThreads / kN;  // threads per key (load_tile_fp8, store_tile_fp8)
  using QL = SwizzledTile<kM>;
  using KvL = SwizzledTile<kN>;
  using PL = SwizzledTile<kM>;
  // the producer's view of a stage (decode_mla_pp.cuh's pp_produce): 9 column blocks of 64 keys
  using L = KvL;
  static constexpr int kKeys = kN;
  static constexpr int kBlocks = kMlaWidth / 64;
  static constexpr uint32_t kBlock = KvL::kBlockBytes;
  static constexpr size_t kStageBytes = mla_heads_stage_bytes(kRs);
  static constexpr size_t kQOff = 0;
  static constexpr size_t kKvOff = size_t(kM) * kMlaWidth * 2;
  static constexpr size_t kPOff = kKvOff + kStages * kStageBytes;
  // the warpgroups' partial S^T [kWgs, 8, 128] fp32 (two warpgroups)
  static constexpr size_t kSOff = kPOff + PL::kBlockBytes;
  static constexpr size_t kRedOff = kSOff + (kWgs > 1 ? size_t(kWgs) * kN * kM * sizeof(float) : 0);
  // per warpgroup: its 4 warps' column partials + the maxima [5, kM] fp32
  static constexpr size_t kMetaOff = kRedOff + size_t(kWgs) * 5 * kM * sizeof(float);
  static constexpr size_t kScaleOff = kMetaOff + kM * sizeof(RowMeta);
  static constexpr size_t kLocOff = kScaleOff + kM * sizeof(float);
  static constexpr size_t kBadOff = kLocOff + 2 * kN * sizeof(TokenLoc);
  // kTma: full barriers [kStages, kBlocks] and empty ones [kStages] (the bad masks unused)
  static constexpr size_t kBarOff = kBadOff + 4 * kSub * sizeof(uint32_t);  // tile k's masks in slot k % 4
  static constexpr size_t kBytes = kBarOff + (kTma ? size_t(kStages) * (kBlocks + 1) * 8 : 0);
  static_assert(kBytes + 1024 == mla_heads_smem_bytes(kWgs, kStages, kRs, kTma), "decode_mla_config.hpp sizes shared memory");
  static_assert(kBarOff % 8 == 0 && (!kTma || (!kFp8 && kWgs == 2 && kStages == 2)), "TMA: the 16-bit 2 x 2 shape");
  static_assert(!kFp8 || (kStages == 2 && (kN * kChunks) % kThreads == 0), "fp8: two stages, whole chunk rounds");
  static_assert(!kRs || kStageBytes == size_t(kN) * kRawRow, "RS: raw rows");
  static_assert(kKvOff % 1024 == 0 && kStageBytes % 1024 == 0 && kPOff % 1024 == 0, "swizzle atoms 1024-aligned");
  static_assert(kM == 16 && kN == 64 && (kWgs == 1 || kWgs == 2) && (kStages == 1 || kStages == 2),
                "the fragment layout below: 4 warps x 16 keys, n16; the pipeline's shapes");
  static FS_DEV uint32_t q_at(int j, int c) { return QL::at(j, c); }
};

// fp8: the raw 16-byte chunks of a located tile into registers, and warp 0 the tile's bad
// masks. Thread t takes key t / kTpr and its chunks c = t % kTpr + kTpr i (36 per key: bytes
// [16 c, 16 c + 16) of its k for c < 4, of its v from c = 4; skipped and bad keys as zeros): one
// location per thread, constant offsets per chunk. Read-only loads that land while the CTA
// computes the tile before.
template <class S>
FS_DEV void load_tile_fp8(const AttnParams& p, const TokenLoc* loc, uint32_t* bad, uint4 (&raw)[S::kRawPerThread]) {
  set_bad_masks<S>(loc, bad);
  constexpr int kTpr = S::kRawTpr, kK = kMlaD * S::kVb / 16;  // k's chunks per key
  const int t = int(threadIdx.x);
  const TokenLoc& L = loc[t / kTpr];
  const bool ok = L.state == kTokenValid;
  const uint4* kp = reinterpret_cast<const uint4*>(static_cast<const char*>(p.k.data) + (ok ? L.k_off : 0)) + t % kTpr;
  const uint4* vp = reinterpret_cast<const uint4*>(static_cast<const char*>(p.v.data) + (ok ? L.v_off : 0)) + t % kTpr;
#pragma unroll
  for (int i = 0; i < S::kRawPerThread; ++i) {
    const int c = kTpr * i;  // + t % kTpr
    raw[i] = ok ? __ldg(c < kK ? kp + c : vp + (c - kK)) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// fp8: the registers of load_tile_fp8 converted to f16 (exact) into the stage's swizzled tile:
// raw chunk c of a key becomes its 16-bit chunks 2 c and 2 c + 1, at 2 (t % kTpr) + 2 kTpr i,
// whose swizzled positions differ from the thread's first by constants (the bits of 2 (t % kTpr)
// and 2 kTpr i are disjoint). A quarter warp's stores cover the eight positions of a block row.
template <class S>
FS_DEV void store_tile_fp8(const uint4 (&raw)[S::kRawPerThread], uint32_t stage) {
  constexpr int kTpr = S::kRawTpr;
  static_assert(kTpr == 2 || kTpr == 4, "2 (t % kTpr) below 2 kTpr");
  const int t = int(threadIdx.x), r = t / kTpr;
  const uint32_t row = stage + uint32_t(r) * 128u;
  const uint32_t sw = uint32_t((2 * (t % kTpr)) ^ (r & 7));
#pragma unroll
  for (int i = 0; i < S::kRawPerThread; ++i) {
    const int col = 2 * kTpr * i;  // the 16-bit chunk of the thread's first, less 2 (t % kTpr)
    const uint32_t at = row + uint32_t(col / 8) * S::KvL::kBlockBytes;
    uint32_t h[8];
    decode::fp8x4_to_f16x2x2<S::kKvDt>(raw[i].x, h[0], h[1]);
    decode::fp8x4_to_f16x2x2<S::kKvDt>(raw[i].y, h[2], h[3]);
    decode::fp8x4_to_f16x2x2<S::kKvDt>(raw[i].z, h[4], h[5]);
    decode::fp8x4_to_f16x2x2<S::kKvDt>(raw[i].w, h[6], h[7]);
    st_shared_v4(at + ((sw ^ uint32_t(col % 8)) << 4), h[0], h[1], h[2], h[3]);
    st_shared_v4(at + ((sw ^ uint32_t(col % 8 + 1)) << 4), h[4], h[5], h[6], h[7]);
  }
}

// RS shape: the copies of a located tile (64 keys) into a raw stage ([k | v] fp8 rows of kRawRow
// bytes), warp 0 its bad masks. Thread t takes the 16-byte chunks t % 4 + 4 j (j = 0: k; 1-8: v)
// of keys t / 4 and t / 4 + 32: a warp's copy covers 64 contiguous bytes of each of 8 keys.
template <class S>
FS_DEV void issue_raw_fp8(const AttnParams& p, const TokenLoc* loc, uint32_t* bad, uint32_t stage) {
  static_assert(S::kThreads == 128 && S::kN == 64 && kMlaD == 64 && kMlaDv == 512, "2 keys x 9 chunks per thread");
  set_bad_masks<S>(loc, bad);
  const int t = int(threadIdx.x), c = t % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = t / 4 + 32 * i;
    const TokenLoc& L = loc[r];
    const bool ok = L.state == kTokenValid;
    const char* kg = static_cast<const char*>(p.k.data) + (ok ? L.k_off : 0) + 16 * c;
    const char* vg = static_cast<const char*>(p.v.data) + (ok ? L.v_off : 0) + 16 * c;
    const uint32_t dst = stage + uint32_t(r * S::kRawRow + 16 * c);
    cp_async_16(dst, kg, ok);
#pragma unroll
    for (int j = 1; j <= 8; ++j) cp_async_16(dst + uint32_t(64 * j), vg + 64 * (j - 1), ok);
  }
}

// O^T's columns times their alpha (skipped when every alpha of the warp is 1).
template <class S>
FS_DEV void rescale_o(const float (&al)[4], float (&o)[S::kMb][2][4]) {
  if (!__any_sync(kFullMask, al[0] != 1.0f || al[1] != 1.0f || al[2] != 1.0f || al[3] != 1.0f)) return;
#pragma unroll
  for (int mb = 0; mb < S::kMb; ++mb)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mb][n][e] *= al[2 * n + e % 2];
}

// RS shape, S^T = [k | v] Q^T with A from the raw stage: ldmatrix on the fp8 key rows hands lane
// (g, t) bytes 4t..4t+3 of a k16 step, converted to f16 as k indices 2t, 2t+1 | 2t+8, 2t+9 (Q is
// stored in that order: fp8_q_column). Nine groups of four k16 steps, A double-buffered (a group's
// registers are rewritten once the group two before it is retired); the k steps (0-3) into acck.
template <class S>
FS_DEV void issue_s_rs(uint32_t q, uint32_t stage, float (&acc)[2][4], float (&acck)[2][4], int ww, int lane) {
  constexpr int kG = 4;  // k16 steps per group
  static_assert(S::kKSteps % kG == 0 && kG % 2 == 0 && kG >= 4, "whole groups; the k steps in group 0");
  const uint64_t db = desc_k_major<S::kM>(q, 0, 0);
  const uint32_t blo = warp_uniform(uint32_t(db)), bhi = warp_uniform(uint32_t(db >> 32));
  // matrices: keys 16 ww + 0..7 | 8..15 at k16 step 2 i, then the same at 2 i + 1
  const uint32_t a0 = stage + uint32_t((16 * ww + lane % 8 + 8 * ((lane / 8) % 2)) * S::kRawRow + 16 * (lane / 16));
  uint32_t af[2][kG][4];
  fence_operands(acc);
  fence_operands(acck);
#pragma unroll
  for (int g = 0; g < S::kKSteps / kG; ++g) {
    uint32_t(&a)[kG][4] = af[g % 2];
    if (g >= 2) {
      wgmma_wait<1>();  // group g - 2 retired: its fragments are free
      fence_fragments(a);
    }
#pragma unroll
    for (int i = 0; i < kG / 2; ++i) {
      uint32_t r[4];
      ldmatrix_x4(r, a0 + uint32_t(32 * (g * kG / 2 + i)));
      decode::fp8x4_to_f16x2x2<S::kKvDt>(r[0], a[2 * i][0], a[2 * i][2]);
      decode::fp8x4_to_f16x2x2<S::kKvDt>(r[1], a[2 * i][1], a[2 * i][3]);
      decode::fp8x4_to_f16x2x2<S::kKvDt>(r[2], a[2 * i + 1][0], a[2 * i + 1][2]);
      decode::fp8x4_to_f16x2x2<S::kKvDt>(r[3], a[2 * i + 1][1], a[2 * i + 1][3]);
    }
    fence_fragments(a);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < kG; ++j) {
      const int ks = g * kG + j;
      const uint64_t b = (uint64_t(bhi) << 32) | (blo + (k_step_bytes<S::kM>(ks) >> 4));
      if (ks < 4) wgmma_rs_kb<__half, S::kM>(acck, a[j], b, ks > 0);
      else wgmma_rs_kb<__half, S::kM>(acc, a[j], b, ks > 4);
    }
    wgmma_commit();
  }
  fence_fragments(af[0]);
  fence_fragments(af[1]);
}

// RS shape, O^T = O^T alpha + V^T P^T with A = V^T from the raw stage: ldmatrix.trans on the fp8
// key rows hands lane (g, t) keys 2t, 2t+1 x channels 2g, 2g+1 of a 16-channel chunk; bytes
// regrouped per channel (prmt) and converted, channel 2g is the fragment's row g and 2g + 1 its
// row g + 8 (finish_cols writes O^T's rows back in channel order). Groups of two k16 steps of a
// 64-channel block, double-buffered as issue_s_rs.
template <class S>
FS_DEV void issue_pv_rs(uint32_t pbuf, uint32_t stage, const float (&al)[4], float (&o)[S::kMb][2][4], int ww,
                        int lane) {
  rescale_o<S>(al, o);
  const uint64_t db = desc_k_major<S::kM>(pbuf, 0, 0);
  const uint32_t blo = warp_uniform(uint32_t(db)), bhi = warp_uniform(uint32_t(db >> 32));
  // matrices: keys 0..7 | 8..15 | 16..23 | 24..31 (+ 32 for k16 steps 2, 3) x the warp's 16
  // channels of block mb (v starts 64 bytes into the row)
  const uint32_t a0 = stage + uint32_t((lane % 8 + 8 * (lane / 8)) * S::kRawRow + kMlaD + 16 * ww);
  uint32_t af[2][2][4];
#pragma unroll
  for (int mb = 0; mb < S::kMb; ++mb) fence_operands(o[mb]);
#pragma unroll
  for (int g = 0; g < 2 * S::kMb; ++g) {  // block mb = g / 2, k16 steps 2 h, 2 h + 1 (h = g % 2)
    const int mb = g / 2, h = g % 2;
    uint32_t(&a)[2][4] = af[g % 2];
    if (g >= 2) {
      wgmma_wait<1>();
      fence_fragments(a);
    }
    uint32_t r[4];
    ldmatrix_x4_trans(r, a0 + uint32_t(h * 32 * S::kRawRow + 64 * mb));
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // matrix m: k16 step 2 h + m / 2, keys + 8 (m % 2)
      const uint32_t w = decode::prmt(r[m], 0u, 0x3120u);  // channel 2g's two keys, then 2g + 1's
      decode::fp8x4_to_f16x2x2<S::kKvDt>(w, a[m / 2][2 * (m % 2)], a[m / 2][2 * (m % 2) + 1]);
    }
    fence_fragments(a);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wgmma_rs_kb<__half, S::kM>(o[mb], a[j], (uint64_t(bhi) << 32) | (blo + (((2 * h + j) * 32) >> 4)), 1);
    wgmma_commit();
  }
  fence_fragments(af[0]);
  fence_fragments(af[1]);
}

// The thread's 4 columns (packed rows) 8 n + 2 (lane % 4) + b, n, b in {0, 1}: index 2 n + b.
FS_DEV int heads_col(int lane, int i) { return 8 * (i / 2) + 2 * (lane % 4) + i % 2; }

// The per-column online-softmax state of the thread's 4 columns (the same in both warpgroups).
struct ColState {
  float m[4];  // running max (natural units), the same in every thread holding the column
  float l[4];  // this thread's partial sum
};

// P^T [column][key] (K-major B operand of O^T += V^T P^T) by warpgroup 0: matrix (n, h) =
// columns 8 n .. +8 x keys 16 ww + 8 h .. +8, stored transposed (a memory row per column).
template <class S>
FS_DEV void store_pt(uint32_t pbuf, const float (&x)[4][2], int wg, int ww, int lane) {
  using T = typename S::T;
  if (wg != 0) return;
  const int m = lane / 8, n = m / 2, h = m % 2;
  stmatrix_x4_trans(pbuf + S::PL::at(8 * n + lane % 8, 2 * ww + h), pack2<T>(x[0][0], x[1][0]),
                    pack2<T>(x[0][1], x[1][1]), pack2<T>(x[2][0], x[3][0]), pack2<T>(x[2][1], x[3][1]));
}

// Step 2 on S^T (x: [column][key half] of the m64n16 fragment, keys 16 ww + lane / 4 (+ 8) of the
// tile at t0; both warpgroups hold the same S^T and compute the same softmax): P^T (16-bit) to
// pbuf by warpgroup 0, complete on return (barrier), the columns' alpha to al. `plain`: every key
// of the tile visible and good for every row, no modifier (CTA-uniform). red: the warpgroup's
// [5, kM].
// Lazy maxima (as FlashAttention-4): P is first computed against the running maxima and stored,
// and the CTA votes at the barrier that completes P^T whether any column's tile maximum exceeds
// its running one by more than 2^kLazy (in exp2 units), or is NaN, or the column has none yet;
// only then (the first tiles, mostly) are the warps' maxima exchanged and P recomputed and
// stored again (a second barrier), as the exact online softmax does every tile. Otherwise m
// stays and P <= 2^kLazy: O and l keep one reference, so out = O / l is unchanged in value.
template <class S>
FS_DEV void softmax_cols(const AttnParams& p, float (&x)[4][2], const RowMeta* meta, float* red, uint32_t pbuf,
                         uint32_t bad0, uint32_t bad1, int64_t t0, bool plain, ColState& cs, float (&al)[4], int wg,
                         int ww, int lane) {
  constexpr float kLog2e = 1.4426950408889634f;
  const ScoreTransform score = make_score_transform(p);
  const int kr = 16 * ww + lane / 4;  // tile keys kr, kr + 8
  if constexpr (S::kFp8) {  // the column's q scale (RowMeta::qk_scale: 2^-shift, convert_q_fp8)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float qk = meta[heads_col(lane, i)].qk_scale;
      x[i][0] *= qk, x[i][1] *= qk;
    }
  }
  if (plain) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) x[i][h] *= score.scale;
  } else {
    const uint32_t bad = ww < 2 ? bad0 : bad1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const RowMeta& m = meta[heads_col(lane, i)];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kt = kr + 8 * h;
        const int64_t key = t0 + kt;
        x[i][h] = key < m.lo || key >= m.hi ? kNegInf
                  : (bad >> (kt % 32)) & 1u ? nan_value()
                                            : score(x[i][h], m.pos, key, m.slope);
      }
    }
  }
  // Column maxima over the warp's 16 keys (lanes of one lane % 4), to red for an exchange.
  constexpr float kLazy = 8.0f;
  float mx[4], pr[4][2];
  bool need = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mx[i] = nan_max(x[i][0], x[i][1]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) mx[i] = nan_max(mx[i], __shfl_xor_sync(kFullMask, mx[i], o));
    if (lane < 4) red[ww * S::kM + heads_col(lane, i)] = mx[i];
    const float mb = cs.m[i] * kLog2e;
    need |= !(fmaf(mx[i], kLog2e, -mb) <= kLazy);  // m = -inf, NaN: true
    pr[i][0] = fast_exp2(fmaf(x[i][0], kLog2e, -mb));
    pr[i][1] = fast_exp2(fmaf(x[i][1], kLog2e, -mb));
  }
  store_pt<S>(pbuf, pr, wg, ww, lane);
  fence_proxy_async_shared();  // P^T, written by stmatrix, read by wgmma
  if (!rows_sync_or<S>(need)) {  // P^T complete against the running maxima
#pragma unroll
    for (int i = 0; i < 4; ++i) al[i] = 1.0f, cs.l[i] += pr[i][0] + pr[i][1];
    return;
  }
  // The exact step: the warpgroup's 4 warps' maxima.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = heads_col(lane, i);
    mx[i] = nan_max(nan_max(red[c], red[S::kM + c]), nan_max(red[2 * S::kM + c], red[3 * S::kM + c]));
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float new_m = nan_max(cs.m[i], mx[i]);
    al[i] = 1.0f;
    if (new_m == kNegInf) {  // nothing visible yet: p = 0, state unchanged
      x[i][0] = x[i][1] = 0.0f;
      continue;
    }
    const float mb = new_m * kLog2e;
    x[i][0] = fast_exp2(fmaf(x[i][0], kLog2e, -mb));  // -inf -> 0, NaN stays
    x[i][1] = fast_exp2(fmaf(x[i][1], kLog2e, -mb));
    al[i] = cs.m[i] == new_m ? 1.0f : fast_exp2(fmaf(cs.m[i], kLog2e, -mb));  // m = -inf -> 0; NaN -> NaN
    cs.l[i] = cs.l[i] * al[i] + (x[i][0] + x[i][1]);
    cs.m[i] = new_m;
  }
  store_pt<S>(pbuf, x, wg, ww, lane);
  fence_proxy_async_shared();
  rows_sync<S>();  // P^T complete
}

// Issues the warpgroup's partial S^T = [k | v] Q^T over its part of the contraction (k16 steps
// kWgs j + wg; one commit group), each column block's steps after full(c) (kTma: the block's
// full barrier waited; else a no-op). fp8: the k steps (column block 0) accumulate into acck,
// apart from the latent's (their descales differ: S = k_desc q.k + v_desc q_v.v).
template <class S, class Full>
FS_DEV void issue_s_heads(uint32_t q, uint32_t stage, int wg, float (&acc)[2][4], float (&acck)[2][4], Full&& full) {
  using T = typename S::T;
  const uint64_t da = desc_k_major<S::kN>(stage, 0, wg), db = desc_k_major<S::kM>(q, 0, wg);
  const uint32_t alo = warp_uniform(uint32_t(da)), ahi = warp_uniform(uint32_t(da >> 32));
  const uint32_t blo = warp_uniform(uint32_t(db)), bhi = warp_uniform(uint32_t(db >> 32));
  fence_operands(acc);
  if constexpr (S::kFp8) fence_operands(acck);
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < S::kKSteps / S::kWgs; ++j) {
    // k16 step kWgs j (+ wg, in the base): column block kWgs j / 4, 32 bytes per step into it
    const int ks = S::kWgs * j;
    if (ks % 4 == 0) full(ks / 4);  // the warpgroup's first step in column block ks / 4
    const uint64_t a = (uint64_t(ahi) << 32) | (alo + (k_step_bytes<S::kN>(ks) >> 4));
    const uint64_t b = (uint64_t(bhi) << 32) | (blo + (k_step_bytes<S::kM>(ks) >> 4));
    constexpr int kRope = 4 / S::kWgs;  // the warpgroup's k16 steps in column block 0 (k)
    if (S::kFp8 && j < kRope) wgmma_ss<T, S::kM>(acck, a, b, j > 0);
    else wgmma_ss<T, S::kM>(acc, a, b, j > (S::kFp8 ? kRope : 0));
  }
  wgmma_commit();
}

// O^T = O^T alpha, then issues O^T += V^T P^T over the warpgroup's kMb latent blocks (one commit
// group).
template <class S>
FS_DEV void issue_pv_heads(uint32_t pbuf, uint32_t stage, int wg, const float (&al)[4], float (&o)[S::kMb][2][4]) {
  using T = typename S::T;
  rescale_o<S>(al, o);
  const uint64_t da = desc_n_major<S::kN>(stage + uint32_t(1 + S::kMb * wg) * S::KvL::kBlockBytes, 0);
  const uint64_t db = desc_k_major<S::kM>(pbuf, 0, 0);
  const uint32_t alo = warp_uniform(uint32_t(da)), ahi = warp_uniform(uint32_t(da >> 32));
  const uint32_t blo = warp_uniform(uint32_t(db)), bhi = warp_uniform(uint32_t(db >> 32));
#pragma unroll
  for (int mb = 0; mb < S::kMb; ++mb) fence_operands(o[mb]);
  wgmma_fence();
#pragma unroll
  for (int mb = 0; mb < S::kMb; ++mb)
#pragma unroll
    for (int kk = 0; kk < S::kN / 16; ++kk) {
      const uint32_t oa = (mb * S::KvL::kBlockBytes + kk * 16 * 128) >> 4;  // block 1 + kMb wg + mb, keys 16 kk
      const uint32_t ob = (kk * 32) >> 4;
      wgmma_ss_ta<T, S::kM>(o[mb], (uint64_t(ahi) << 32) | (alo + oa), (uint64_t(bhi) << 32) | (blo + ob), 1);
    }
  wgmma_commit();
}

// decode::packed_idx (KV head 0) by decode::div_mod's 32-bit division where the index fits (the
// 64-bit one is ~70 instructions; kept to this epilogue: the GQA decode kernels measured slower
// with the branch).
FS_DEV PackedIdx packed_idx32(const AttnParams& p, int64_t g0, int j) {
  PackedIdx pi;
  decode::div_mod(g0 + j, p.group, pi.i, pi.h);
  return pi;
}

// Shared memory of a split's partial rows when the splits run as one cluster (cluster_merge.cuh):
// [kM, kMlaDv] rows, their LSEs [kM] and cluster_combine's scratch, in the KV stages (free after
// the last tile).
inline constexpr size_t kMlaClusterBytes =
    (size_t(kMlaHeadsRows) * (kMlaDv + 1) + size_t(kClusterScratchFloats<kMlaHeadsRows>)) * sizeof(float);

// Epilogue: per column, 1 / l (times the sink's weight) and the LSE (or the split's partial
// LSE) from warpgroup 0's state, then out (or the split's fp32 partial) = O^T's column x that
// scale, each warpgroup its kMb latent blocks. xo: kMlaClusterBytes of shared memory free for
// the partials when the launch put the splits in one cluster (nullptr: a shape never launched
// so), where cluster_combine then merges them.
template <class S>
FS_DEV void finish_cols(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, float* red,
                        float* rscale, ColState& cs, const float (&o)[S::kMb][2][4], int wg, int ww, int lane,
                        float* xo = nullptr) {
  const int tid = int(threadIdx.x);
  const bool clustered = xo && p.num_splits > 1 && cluster_ctas() > 1;  // the same in the cluster's CTAs
  float* xl = clustered ? xo + S::kM * kMlaDv : nullptr;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) cs.l[i] += __shfl_xor_sync(kFullMask, cs.l[i], off);
    if (wg == 0 && lane < 4) {
      red[ww * S::kM + heads_col(lane, i)] = cs.l[i];
      if (ww == 0) red[4 * S::kM + heads_col(lane, i)] = cs.m[i];
    }
  }
  rows_sync<S>();
  if (tid < S::kM) {
    const int c = tid;
    const float l = red[c] + red[S::kM + c] + red[2 * S::kM + c] + red[3 * S::kM + c];
    rscale[c] = finish_row(p, s, g0, nrows, split, c, red[4 * S::kM + c], l, S::kFp8 ? s.kv.v_desc : 1.0f,
                           xl);
  }
  rows_sync<S>();
  // O^T's rows lane / 4 + 8 h of the warp's 16 in latent block mb; RS shape: channels
  // 2 (lane / 4) + h (issue_pv_rs)
  const auto ch = [&](int mb, int h) {
    return 64 * (S::kMb * wg + mb) + 16 * ww + (S::kRs ? 2 * (lane / 4) + h : lane / 4 + 8 * h);
  };
  // The stores by destination type, one dispatch per thread (store_out per element made the
  // epilogue large and cold: 22% of the warps' samples at B = 1 L = 32k were instruction fetch).
  const auto store_cols = [&](auto* out, auto cvt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = heads_col(lane, i);
      if (c >= nrows) continue;
      const float sc = rscale[c];
      const PackedIdx pi = packed_idx32(p, g0, c);
      const int64_t r = s.rows.row_begin + pi.i;
      const auto row = p.num_splits > 1 ? out + (clustered ? int64_t(c) : partial_index(p, split, r, pi.h)) * kMlaDv
                                        : out + s.rows.qb * p.out.stride[0] +
                                              s.rows.q_row(r, p.batched) * p.out.stride[1] + pi.h * p.out.stride[2];
#pragma unroll
      for (int mb = 0; mb < S::kMb; ++mb)
#pragma unroll
        for (int h = 0; h < 2; ++h) row[ch(mb, h)] = cvt(o[mb][i / 2][2 * h + i % 2] * sc);
    }
  };
  void* out = const_cast<void*>(p.out.data);
  const auto f32 = [](float x) { return x; };
  if (p.num_splits > 1) store_cols(clustered ? xo : p.o_partial, f32);
  else if (p.out.dtype == DType::bf16)
    store_cols(static_cast<__nv_bfloat16*>(out), [](float x) { return __float2bfloat16_rn(x); });
  else if (p.out.dtype == DType::f16) store_cols(static_cast<__half*>(out), [](float x) { return __float2half_rn(x); });
  else store_cols(static_cast<float*>(out), f32);
  if (clustered)
    cluster_combine<S::kM, kMlaDv, S::kThreads>(p, xo, xl, xl + S::kM, nrows, [&](int j) {
      const PackedIdx pi = packed_idx32(p, g0, j);
      return RowDest{s.rows.qb, s.rows.q_row(s.rows.row_begin + pi.i, p.batched), pi.h};
    });
}

// S^T from the two warpgroups' partials: each stores its 8 fragment values ([value][thread]
// fp32, conflict-free), barrier, then adds the other's (a + b == b + a: both hold the same sum).
template <class S>
FS_DEV void sum_partial_s(const float (&acc)[2][4], float* spart, int wg, float (&x)[4][2]) {
  if constexpr (S::kWgs == 1) {  // S^T is the warpgroup's
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) x[i][h] = acc[i / 2][2 * h + i % 2];
    return;
  }
  const int t = int(threadIdx.x) % 128;
  float* mine = spart + wg * 8 * 128;
  const float* other = spart + (1 - wg) * 8 * 128;
#pragma unroll
  for (int v = 0; v < 8; ++v) mine[v * 128 + t] = acc[v / 4][v % 4];
  rows_sync<S>();
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = 4 * (i / 2) + 2 * h + i % 2;  // acc[i / 2][2 h + i % 2]
      x[i][h] = acc[v / 4][v % 4] + other[v * 128 + t];
    }
}

// A row group's state at its start: the columns' softmax state and O^T zero.
template <class S>
FS_DEV void start_cols(ColState& cs, float (&o)[S::kMb][2][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) cs.m[i] = kNegInf, cs.l[i] = 0.0f;
#pragma unroll
  for (int mb = 0; mb < S::kMb; ++mb)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mb][n][e] = 0.0f;
}

// One row group: packed rows [g0, g0 + nrows) of the CTA's sequence.
template <class S>
FS_DEV void run_rows_heads(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split,
                           unsigned char* sm) {
  constexpr int kN = S::kN, kStages = S::kStages;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, ww = warp % 4;
  const int wg = int(warp_uniform(uint32_t(tid / 128)));  // descriptors on the uniform datapath
  const uint32_t q = smem_u32(sm + S::kQOff), kv = smem_u32(sm + S::kKvOff), pbuf = smem_u32(sm + S::kPOff);
  float* spart = reinterpret_cast<float*>(sm + S::kSOff);
  float* red = reinterpret_cast<float*>(sm + S::kRedOff) + wg * 5 * S::kM;
  RowMeta* meta = reinterpret_cast<RowMeta*>(sm + S::kMetaOff);
  float* rscale = reinterpret_cast<float*>(sm + S::kScaleOff);
  TokenLoc* loc = reinterpret_cast<TokenLoc*>(sm + S::kLocOff);
  uint32_t* bad = reinterpret_cast<uint32_t*>(sm + S::kBadOff);
  const KeyRange u = start_rows<S>(p, s, g0, nrows, q, meta);
  // The keys every row sees (tiles inside it take the softmax's plain path).
  int64_t all_lo = u.lo, all_hi = u.hi;
  for (int j = 0; j < nrows; ++j) all_lo = imax(all_lo, meta[j].lo), all_hi = imin(all_hi, meta[j].hi);
  const bool plain_rows = make_score_transform(p).plain();
  ColState cs;
  float o[S::kMb][2][4];
  start_cols<S>(cs, o);
  float acc[2][4], acck[2][4];
  uint4 raw[S::kConvert ? S::kRawPerThread : 1];  // the next tile, in flight

  // Tiles of kN keys from base (aligned to the split's start, as decode_mla); tile k in stage
  // k % kStages, its locations in loc[k % 2] (two 32-key halves per lane of warp 0), located
  // kAhead tiles before it is computed; the copies of tile k + kStages issued once tile k is done.
  // fp8 (two stages): tile k + 2 loaded into registers (load_tile_fp8) once tile k is in its
  // stage; tile k + 1 stored from them, converted, while the tensor cores run S of tile k (its
  // stage freed by P V of tile k - 1).
  constexpr int kAhead = kStages + 1;
  const int64_t base = s.range.begin + (u.lo - s.range.begin) / kN * kN;
  const int64_t n = u.lo < u.hi ? (u.hi - base + kN - 1) / kN : 0;
  const auto stage = [&](int64_t k) { return kv + uint32_t(k % kStages) * uint32_t(S::kStageBytes); };
  const auto key_of = [&](int64_t k, int h) {
    return decode::tile_key<32>(p, s.kv, base + k * kN + 32 * h, u.lo, u.hi, lane);
  };
  const auto locate_tile = [&](int64_t k) {
#pragma unroll
    for (int h = 0; h < kN / 32; ++h) loc[(k & 1) * kN + 32 * h + lane] = decode::tile_loc(p, s.kv, key_of(k, h));
  };
  const auto issue_tile = [&](int64_t k) {
    if constexpr (S::kRs) {
      if (k < n) issue_raw_fp8<S>(p, loc + (k & 1) * kN, bad + (k & 3) * S::kSub, stage(k));
      cp_async_commit();
    } else if constexpr (S::kConvert) {
      if (k < n) load_tile_fp8<S>(p, loc + (k & 1) * kN, bad + (k & 3) * S::kSub, raw);
    } else {
      if (k < n) issue_kv_rows<S>(p, loc + (k & 1) * kN, bad + (k & 3) * S::kSub, stage(k));
      cp_async_commit();
    }
  };
  if (warp == 0) {
    if (n > 0) locate_tile(0);
    if (n > 1) locate_tile(1);
  }
  __syncthreads();
  issue_tile(0);  // 16-bit: one cp.async group with Q
  if constexpr (S::kConvert) {
    cp_async_wait<0>();  // Q (its own group: start_rows)
    __syncthreads();
    convert_q_fp8<S>(sm + S::kQOff, meta);  // f16, scaled per row: meta[j].qk_scale
  }
  if constexpr (kStages == 2) {
    if constexpr (S::kConvert) {
      if (n > 0) store_tile_fp8<S>(raw, stage(0));  // raw takes tile 1 next
    }
    issue_tile(1);
    if constexpr (S::kRs) {
      cp_async_wait<2>();  // Q (its own group: start_rows); tiles 0 and 1 may be in flight
      __syncthreads();
      convert_q_fp8<S>(sm + S::kQOff, meta);  // f16 in fp8_q_column's order, scaled per row
      fence_proxy_async_shared();             // read by wgmma (the loop's first barrier)
    }
    if (n > 2) {
      __syncthreads();  // tile 0's locations are read
      if (warp == 0) locate_tile(2);
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t st = stage(k);
    const uint32_t* b = bad + (k & 3) * S::kSub;
    if constexpr (S::kConvert) {
      fence_proxy_async_shared();  // the tile (and Q), written by st.shared, read by wgmma
      __syncthreads();             // tile k in its stage, Q converted; tile k + 2 located
    } else {
      landed_barrier<kStages - 1>();  // tile k (and Q), tile k + 1 may be in flight; k + kStages located
    }
    const uint32_t bad0 = b[0], bad1 = b[1];
    if constexpr (S::kRs) issue_s_rs<S>(q, st, acc, acck, ww, lane);
    else issue_s_heads<S>(q, st, wg, acc, acck, [](int) {});
    if constexpr (S::kConvert) {  // under S: tile k + 1 into its stage, k + 2 loaded
      if (k + 1 < n) store_tile_fp8<S>(raw, stage(k + 1));
      issue_tile(k + 2);
    }
    // warp 0: the block-table reads of tile k + kAhead in flight during S and the softmax
    decode::TileKey next[kN / 32];
    if (warp == 0 && k + kAhead < n) {
#pragma unroll
      for (int h = 0; h < kN / 32; ++h) next[h] = key_of(k + kAhead, h);
    }
    wgmma_wait<0>();
    fence_operands(acc);
    if constexpr (S::kFp8) {
      fence_operands(acck);
      descale_s(acc, acck, s.kv.k_desc, s.kv.v_desc);
    }
    float x[4][2];
    sum_partial_s<S>(acc, spart, wg, x);
    const int64_t t0 = base + k * kN;
    const bool plain = plain_rows && t0 >= all_lo && t0 + kN <= all_hi && (bad0 | bad1) == 0u;
    float al[4];
    if (warp == 0 && k + kAhead < n) {
#pragma unroll
      for (int h = 0; h < kN / 32; ++h)
        loc[((k + kAhead) & 1) * kN + 32 * h + lane] = decode::tile_loc(p, s.kv, next[h]);
    }
    softmax_cols<S>(p, x, meta, red, pbuf, bad0, bad1, t0, plain, cs, al, wg, ww, lane);  // P^T complete
    if constexpr (S::kRs) issue_pv_rs<S>(pbuf, st, al, o, ww, lane);
    else issue_pv_heads<S>(pbuf, st, wg, al, o);
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < S::kMb; ++mb) fence_operands(o[mb]);
    __syncthreads();  // every warp's P V of tile k done: its stage and P^T are free
    if constexpr (!S::kConvert) issue_tile(k + kStages);
  }
  cp_async_wait<0>();
  static_assert(S::kStages * S::kStageBytes >= kMlaClusterBytes, "the stages hold a split's partial rows");
  finish_cols<S>(p, s, g0, nrows, split, red - wg * 5 * S::kM, rscale, cs, o, wg, ww, lane,
                 reinterpret_cast<float*>(sm + S::kKvOff));
}

// kWgs warpgroups, kStages KV stages (decode_mla_config.hpp: the shapes); kKv the latent's dtype
// (kDt, or fp8).
template <DType kDt, DType kKv, int kWgs, int kStages>
__global__ void __launch_bounds__(128 * kWgs, mla_heads_ctas_per_sm(kWgs, kStages, is_fp8(kKv) && kWgs == 1))
    decode_mla_heads(const __grid_constant__ AttnParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = HeadsShape<kDt, kKv, kWgs, kStages>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = align_1024(smem_raw);
  for_row_groups<S::kM>(p, [&](const DecodeSeq& s, int64_t g0, int nrows, int split) {
    run_rows_heads<S>(p, s, g0, nrows, split, sm);
  });
#endif
}

}  // namespace flashserve::kernels::mla
