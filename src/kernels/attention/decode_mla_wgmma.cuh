// The sm_90a MLA absorbed-decode kernel for 64 packed rows (H = 128, or q_len x H > 16) with a
// 16-bit latent cache: decode_mla.cuh's scheme (row groups, token location, masks, softmax,
// epilogue and split partials are that kernel's functions) with both GEMMs on warpgroup MMA,
// operands read by the tensor cores from 128-byte-swizzled shared memory (wgmma.cuh), so that
// Q is no longer re-read through ldmatrix by every warp (the mma.sync kernel's shared-memory
// bound at 64 rows: ~360 KB per 32-key tile).
//
// CTA = (sequence, row slice, split) as decode_mla; 2 warpgroups, 256 threads, one CTA per SM.
// Shared memory (1024-byte aligned): Q [64, 576] SwizzledTile<64> | 3 KV stages [32 keys, 576]
// SwizzledTile<32> ([k | v]: column block 0 is k, blocks 1-8 the latent) | S partials 2 x
// [64, 32 + 4] fp32 | RowMeta [64] | alpha [64] | TokenLoc 2 x [32] | bad masks [3]. Per 32-key
// tile:
//   1. S: warpgroup w adds Q [k|v]^T over its half of the contraction (the k16 steps 2 s + w: 18
//      wgmma m64n32k16, A = Q and B = the tile, both K-major) into its partial S, stored to
//      shared memory; barrier (both partials complete, every P V of the previous tile done).
//   2. the copies of tile k + 2 into the stage of tile k - 1; the softmax of decode_mla
//      (softmax_rows, 4 lanes per row) on the sum of the two partials, P (16-bit) over partial
//      0 in place, alpha to shared memory; warp 0 locates tile k + 3 (its block-table read
//      issued before the S wait; TokenLoc double buffer); barrier.
//   3. warpgroup w: O [64, 256 w .. +256] = O alpha + P V: 2 wgmma m64n256k16, A = P from
//      registers (ldmatrix: the mma.sync A fragment), B = the tile's latent channels N-major
//      (the transpose is the descriptor's); issued, not waited: it runs while the CTA waits for
//      tile k + 1 (cp.async wait, async-proxy fence, barrier) and issues S of tile k + 1.
//   Three barriers per tile; two tiles in flight while one is computed.
//
// Arithmetic per 32-key tile (64 rows): S 64 x 32 x 576 + P V 64 x 512 x 32 = 2.23 M MAC = 4.46
// MFLOP, ~1090 clk of the tensor pipe at 2048 dense bf16 MAC/clk/SM. Shared memory read by
// wgmma: S 2 x (Q half 36 KB + K half 18 KB) = 108 KB (m64n32k16: 3 KB per 16 clk, above the
// 128 B/clk of shared memory), P V 2 x 16 KB of V + P 8 KB by ldmatrix; the copies write 36 KB:
// ~185 KB = ~1450 clk per tile at 128 B/clk. Predicted ~1750 clk per tile with the softmax and
// barriers outside the tensor work (~350-450 TFLOP/s under load).
// Measured (H200, B=64 H=128 L=4k, block 64; bench/RESULTS.md): the first version ran 0.430 ms
// = ~6000 clk per tile, 169 TFLOP/s; ncu: issue slots 33% busy, 2 warps per scheduler with 0.46
// eligible, ~920 instructions per warp per tile (S issue 286: 13 per wgmma forming descriptors
// in regular registers; the copies 217: a location read and 64-bit address math per 16 bytes;
// the softmax 288: per-key modifier branches and 64-bit range checks). With warp-uniform
// descriptors (4 uniform instructions per wgmma), one key row per 8 threads in the copies and
// the softmax's modifier-free path: 0.265 ms, 275 TFLOP/s (39% of cuBLAS's 709). What is left:
// the CUDA cores and the tensor cores still take turns (the softmax does not overlap any
// wgmma: overlapping S(k + 1) with it needs O's rescale outside the in-flight window, see the
// loop), and 32-key tiles pay a barrier pair and an S wait per 4.46 MFLOP. FlashMLA's shape
// (64-key tiles, S and P in registers, P shared through 8 KB of shared memory, the two
// warpgroups alternating tiles) is decode_mla_pp.cuh, which the launcher picks where TMA can
// load the tiles; this kernel serves the rest (pages of other sizes, views TMA cannot map).
#pragma once

#include <cstdint>

#include "kernels/attention/decode_mla.cuh"
#include "kernels/common/wgmma.cuh"

namespace flashserve::kernels::mla {

// The wgmma kernel's shape: decode_mla's 64-row, 16-bit shape (softmax lanes, tile keys) with
// its own shared-memory carve-up and swizzled operand layouts.
template <DType kDt>
struct WgShape : Shape<kDt, kDt, 64> {
  using QL = SwizzledTile<64>;
  using KvL = SwizzledTile<kMlaTileKeys>;
  static constexpr int kSParts = 2;
  static constexpr int kStages = kMlaWgStages;
  static constexpr int kHalfSteps = kMlaWidth / 32;  // 18 k16 steps of S per warpgroup
  static constexpr int kCols = kMlaDv / 2;           // P V: output channels per warpgroup
  static constexpr size_t kStageBytes = size_t(kMlaTileKeys) * kMlaWidth * 2;
  static constexpr size_t kQOff = 0;
  static constexpr size_t kKvOff = size_t(64) * kMlaWidth * 2;
  static constexpr size_t kSOff = kKvOff + kStages * kStageBytes;
  static constexpr size_t kMetaOff = kSOff + 2 * 64 * kMlaSStride;
  static constexpr size_t kScaleOff = kMetaOff + 64 * sizeof(RowMeta);
  static constexpr size_t kLocOff = kScaleOff + 64 * sizeof(float);
  static constexpr size_t kBadOff = kLocOff + 2 * kMlaTileKeys * sizeof(TokenLoc);
  static constexpr size_t kBytes = kBadOff + 16;
  static_assert(kBytes + 1024 == mla_wgmma_smem_bytes(), "decode_mla_config.hpp sizes shared memory with it");
  static_assert(kKvOff % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms 1024-byte aligned");
  static_assert(kStages <= 4, "bad masks");
  static FS_DEV uint32_t q_at(int j, int c) { return QL::at(j, c); }
  static FS_DEV uint32_t kv_at(int r, int c) { return KvL::at(r, c); }
};

// The warpgroup's partial S (accumulators of wgmma m64n32) to its half of the S buffer.
template <class S>
FS_DEV void store_partial_s(const float (&acc)[S::kN / 8][4], unsigned char* sbuf, int wg, int ww, int lane) {
  unsigned char* part = sbuf + size_t(wg) * S::kM * S::kSStride;
  const int row = 16 * ww + lane / 4;
#pragma unroll
  for (int n = 0; n < S::kN / 8; ++n) {
    const int col = 8 * n + 2 * (lane % 4);
    *reinterpret_cast<float2*>(part + row * S::kSStride + col * 4) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(part + (row + 8) * S::kSStride + col * 4) = make_float2(acc[n][2], acc[n][3]);
  }
}

// Issues S partial = Q K^T over the warpgroup's half of the contraction (one commit group):
// k16 steps 2 ks + wg (interleaved halves, so that every step's descriptors are the warpgroup's
// base descriptor plus a compile-time offset).
template <class S>
FS_DEV void issue_s(uint32_t q, uint32_t stage, int wg, float (&acc)[S::kN / 8][4]) {
  using T = typename S::T;
  // The base descriptors' words, warp-uniform through a shuffle (shared-memory addresses come
  // from inline asm, which the compiler takes as divergent): the uniform datapath then forms each
  // step's descriptor with one add to the low word (the address field; no carry out of it).
  const uint64_t da = desc_k_major<S::kM>(q, 0, wg), db = desc_k_major<S::kN>(stage, 0, wg);
  const uint32_t alo = __shfl_sync(kFullMask, uint32_t(da), 0), ahi = __shfl_sync(kFullMask, uint32_t(da >> 32), 0);
  const uint32_t blo = __shfl_sync(kFullMask, uint32_t(db), 0), bhi = __shfl_sync(kFullMask, uint32_t(db >> 32), 0);
  fence_operands(acc);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < S::kHalfSteps; ++ks) {
    // k16 step 2 ks: column block ks / 2, 64 bytes into it for odd ks (16-byte descriptor units)
    const uint32_t oa = ((ks >> 1) * S::QL::kBlockBytes + (ks & 1) * 64) >> 4;
    const uint32_t ob = ((ks >> 1) * S::KvL::kBlockBytes + (ks & 1) * 64) >> 4;
    wgmma_ss<T, S::kN>(acc, (uint64_t(ahi) << 32) | (alo + oa), (uint64_t(bhi) << 32) | (blo + ob), ks > 0);
  }
  wgmma_commit();
}

// O = O alpha (rows whose max moved), then issues O += P V over the warpgroup's channels (one
// commit group; the caller waits before O is touched again).
template <class S>
FS_DEV void issue_pv(const unsigned char* sbuf, const float* rscale, uint32_t stage, int wg, int ww, int lane,
                     float (&o)[S::kCols / 8][4]) {
  using T = typename S::T;
  const float al[2] = {rscale[16 * ww + lane / 4], rscale[16 * ww + lane / 4 + 8]};
  if (__any_sync(kFullMask, al[0] != 1.0f || al[1] != 1.0f)) {
#pragma unroll
    for (int n = 0; n < S::kCols / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= al[e / 2];
  }
  const uint32_t pbase = smem_u32(sbuf) + uint32_t((16 * ww + lane % 8 + 8 * ((lane / 8) % 2)) * S::kSStride +
                                                   16 * (lane / 16));
  uint32_t pa[S::kN / 16][4];
#pragma unroll
  for (int kk = 0; kk < S::kN / 16; ++kk) ldmatrix_x4(pa[kk], pbase + uint32_t(kk * 32));
  const uint32_t v = stage + uint32_t(1 + 4 * wg) * S::KvL::kBlockBytes;  // the latent's column blocks
  fence_operands(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < S::kN / 16; ++kk) wgmma_rs<T, S::kCols>(o, pa[kk], desc_n_major<S::kN>(v, kk), 1);
  wgmma_commit();
}

// One row group: packed rows [g0, g0 + nrows) of the CTA's sequence (decode_mla's run_rows).
template <class S>
FS_DEV void run_rows_wgmma(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split,
                           unsigned char* sm) {
  constexpr int kN = S::kN, kStages = S::kStages;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, ww = warp % 4;
  const int wg = __shfl_sync(kFullMask, tid / 128, 0);  // warp-uniform: descriptors on the uniform datapath
  const auto [q, kv, sbuf, meta, rscale, loc, bad] = RowSmem<S>(sm);
  const KeyRange u = start_rows<S>(p, s, g0, nrows, q, meta);
  const int row = tid / S::kTpr, part = tid % S::kTpr;
  RowRegs rr = row_regs(meta[row]);
  float o[1][S::kCols / 8][4];
#pragma unroll
  for (int n = 0; n < S::kCols / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][n][e] = 0.0f;
  float acc[kN / 8][4];

  // Tiles of kN keys from base (aligned to the split's start, as decode_mla); tile k in stage
  // k % kStages, its locations in loc[k % 2].
  const int64_t base = s.range.begin + (u.lo - s.range.begin) / kN * kN;
  const int64_t n = u.lo < u.hi ? (u.hi - base + kN - 1) / kN : 0;
  const auto stage = [&](int64_t k) { return kv + uint32_t(k % kStages) * uint32_t(S::kStageBytes); };
  const auto locate_tile = [&](int64_t k) { locate<S>(p, s, base + k * kN, u, loc + (k & 1) * kN, lane); };
  const auto issue_tile = [&](int64_t k) { issue_kv_rows<S>(p, loc + (k & 1) * kN, bad + k % kStages, stage(k)); };
  if (warp == 0) {
    if (n > 0) locate_tile(0);
    if (n > 1) locate_tile(1);
  }
  __syncthreads();
  if (n > 0) issue_tile(0);
  cp_async_commit();  // Q + tile 0
  if (n > 1) issue_tile(1);
  cp_async_commit();
  if (n > 2) {
    __syncthreads();  // tile 0's locations are read
    if (warp == 0) locate_tile(2);
  }
  landed_barrier<1>();  // Q and tile 0
  // Per tile: S(k) issued and waited; the softmax; P V(k) issued and left running while the CTA
  // waits for tile k + 1 and issues S(k + 1) behind it. No accumulator is touched by other
  // instructions while a wgmma is in flight (ptxas would serialize every wgmma otherwise), so the
  // softmax does not overlap the tensor cores: the two stay in lockstep.
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t st = stage(k);
    issue_s<S>(q, st, wg, acc);
    // warp 0: the block-table read of tile k + 3 in flight during the S wait and the softmax
    decode::TileKey next{};
    if (warp == 0 && k + 3 < n) next = decode::tile_key<kN>(p, s.kv, base + (k + 3) * kN, u.lo, u.hi, lane);
    wgmma_wait<0>();  // S of tile k, and P V of tile k - 1
    fence_operands(acc);
    store_partial_s<S>(acc, sbuf, wg, ww, lane);
    __syncthreads();  // both partials complete; tile k - 1's stage, P and alpha are free
    if (k + 2 < n) issue_tile(k + 2);
    cp_async_commit();
    softmax_rows<S>(p, sbuf, rscale, bad[k % kStages], base + k * kN, rr, row, part);
    if (warp == 0 && k + 3 < n) loc[((k + 3) & 1) * kN + lane] = decode::tile_loc(p, s.kv, next);
    __syncthreads();  // P and alpha complete; tile k + 3's locations written, k + 2's read
    fence_operands(o[0]);
    issue_pv<S>(sbuf, rscale, st, wg, ww, lane, o[0]);
    landed_barrier<1>();  // tile k + 1 (tile k + 2 may still be in flight)
  }
  wgmma_wait<0>();
  fence_operands(o[0]);
  cp_async_wait<0>();
  finish_rows<S>(p, s, g0, nrows, split, rscale, rr, row, part);
  store_o<S, 1, S::kCols / 8, false>(p, s, g0, nrows, split, rscale, o, 16 * ww, wg * S::kCols, lane);
}

template <DType kDt>
__global__ void __launch_bounds__(256, 1) decode_mla_wgmma(const __grid_constant__ AttnParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = WgShape<kDt>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = align_1024(smem_raw);
  for_row_groups<S::kM>(p, [&](const DecodeSeq& s, int64_t g0, int nrows, int split) {
    run_rows_wgmma<S>(p, s, g0, nrows, split, sm);
  });
#endif
}

}  // namespace flashserve::kernels::mla
