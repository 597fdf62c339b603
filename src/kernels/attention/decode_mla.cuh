// The MLA absorbed-decode kernel (DeepSeek-V2/V3): q [T, H, 64] (rope), q_v [T, H, 512]
// (absorbed nope query), one KV head whose k [.., 64] and v [.., 512] are (usually) two views of
// one latent cache [.., 576]; scores = scale * (q.k + q_v.v), out [T, H, 512] = P v. Tensor cores
// (mma.sync m16n8k16, sm80+, f16/bf16), the decode kernel's token location, masks and epilogue
// (decode_fwd.cuh, masks.cuh, epilogue.cuh), split-KV partials merged by combine.cu.
//
// CTA = (sequence b, row slice y, split); grid (B, head_slices, num_splits). Its rows are the
// sequence's q_len x H packed (query row, head) pairs, kM (16 or 64) per row group, row groups
// y, y + gridDim.y, ... (so a varlen max_seqlen_q below the truth still computes every row).
// Per row group:
//   Q [kM, 576] = [q | q_v] staged once into shared memory (cp.async, zero rows past nrows);
//   keys in tiles of 32 (aligned to the split's start, as the CPU reference) over the union of
//   the rows' visible keys; each tile [32 keys, 576] = [k | v] is loaded ONCE per CTA into a
//   2-stage cp.async ring (16-byte chunks, rows padded by 16 B so ldmatrix rows hit distinct
//   banks; out-of-range keys become zero rows and their bits in the tile's bad mask, so the
//   rows that see them come out NaN, nothing out of bounds is read). Warp 0 reads the block
//   table for the tile two ahead before S and locates its keys after the softmax.
//   1. S [kM, 32] = Q [k|v]^T: warp w takes m-block w / (W / (kM/16)) and a slice of 8 (kM=16)
//      or 16 (kM=64) keys, over the full 576 contraction; Q and K fragments by ldmatrix from
//      shared memory; S (fp32) to shared memory. Barrier.
//   2. softmax: kTPR (8 or 4) consecutive lanes per row, online, exp2 with log2(e) folded, the
//      masks and modifiers of masks.cuh (causal/window/chunk, soft-cap, ALiBi), NaN for bad
//      keys; P rounded to q's 16-bit type written over the row's S in place; the row's rescale
//      factor alpha to shared memory; m and the lane-partial l stay in registers. Barrier.
//   3. O [kM, 512] += P V: warp w owns output columns [w 512/W, (w+1) 512/W) for all kM rows
//      (accumulators kM/16 x 512/W/8 x 4 fp32: 64 registers at kM=16, 128 at kM=64), rescaled
//      by alpha; P fragments by ldmatrix, V by ldmatrix.trans from the same latent tile.
//   The next tile's copies are issued right after the barrier that ends the previous P V, before
//   waiting for the current tile (two tiles in flight per CTA while it waits; four barriers per
//   tile). Epilogue: l reduced over the row's lanes, out = O / l with the
//   sink merged once (or the split partial and its LSE), LSE = m + log l.
//
// Per 32-key tile (1152 B per key: 36,864 B of KV):
//   kM = 64 (H = 128, 8 warps, 1 CTA per SM, two CTAs per sequence share the tile through L2):
//     4.46 MFLOP = 1088 mma (S 576, P V 512); shared-memory reads ~360 KB (S: per warp 36 Q and
//     36 K ldmatrix.x4 = 36 KB; P V: per warp 8 P and 8 V ldmatrix.x4 = 8 KB; S/P 20 KB) plus
//     36 KB of cp.async writes; 4 barriers. At ~128 B/clk of shared memory the tile needs
//     ~3100 clk against ~1750 clk of mma.sync issue (~0.6 m16n8k16 per clk per SM): shared
//     memory bound, ~4.46 MFLOP / 3100 clk x 1.83 GHz x 132 SMs = ~350 TFLOP/s ideal, ~200-250
//     expected with the barriers (30-35% of a ~700 TFLOP/s bf16 GEMM; the 60% target needs the
//     Q re-reads gone: wgmma with Q from shared-memory descriptors, or Q held in registers
//     over a split contraction).
//   kM = 16 (H = 16, 4 warps, 2 CTAs per SM): 1.11 MFLOP = 272 mma; shared-memory reads ~150 KB
//     (S: per warp 36 Q + 18 K ldmatrix.x4; P V: per warp 2 P + 16 V) + 36 KB of writes. At
//     85% of the copy ceiling (3.64 TB/s = ~15 B/clk per SM) an SM must retire a tile every
//     ~2450 clk: ~1450 clk of shared memory (60%), mma ~450 clk; 72 KB in flight per SM (one
//     tile per CTA while the other is consumed) against ~41 KB of bandwidth x latency. Bound
//     by HBM when the grid fills >= 2 CTAs per SM: predicted 3.3-3.7 TB/s at B=64 L=4k; B=1
//     L=32k is bounded by the planner's split count (stream_splits: 32 splits of 1024 keys =
//     32 CTAs on 132 SMs) to ~25% until the planner splits MLA finer.
//     Measured (H200, B=64 L=4k block 64, waiting for tile k before issuing k + 1): 0.124 ms,
//     2.43 TB/s (57%): per SM 18.4 B/ns, i.e. each CTA retired a 37 KB tile every ~4 us,
//     about twice the tile's compute plus a loaded HBM latency; with that order a CTA had
//     ONE tile in flight while it waited (the next stage was free but not yet issued), so an
//     SM had <= 74 KB in flight only while both CTAs computed and ~37-74 KB while they waited.
//     Issuing k + 1 first (above; one barrier more) keeps two tiles per CTA in flight during
//     the wait: predicted 3.0-3.5 TB/s (70-80%) if the stream was latency-bound as these
//     numbers say; if it was bound by the per-tile compute instead, ~1-3% slower (the barrier).
//
// fp8 latent cache (e4m3 / e5m2; k_descale / v_descale [B, H_kv] or broadcasts, as the engines
// pass them for fp8 caches; q and q_v 16-bit): the mma operands are f16. Every fp8 value is exact
// in f16 (cvt.rn.f16x2.{e4m3,e5m2}x2 in registers, decode_mma.cuh's fp8x2_to_f16x2); q is staged
// once per row group as f16 (convert_q_fp8, in place after the 16-bit copies): bf16 rows scaled by 2^shift (max |x| into
// [2^15, 2^16); exact for every value within 2^-32 of the row's max), f16 rows as they are; the
// scores are k_descale q.k + v_descale q_v.v (each descale on its own operand's part of the
// contraction, as the CPU reference dequantizes k and v: S's k-steps of k and of v accumulate
// apart), times the row's qk_scale = 2^-shift before the modifiers; v_descale also goes into the
// epilogue's 1 / l. P is rounded to f16 (finer than bf16).
//   Load tiles of 64 keys (64 x 592 B = 37.9 KB per stage, as a 32-key 16-bit tile), computed
//   as two 32-key tiles (the steps above; one more barrier between them, so the barriers per
//   byte are unchanged).
//   S: the channels of each 16-channel k-step are permuted (fp8_q_column, applied to Q's
//   staging) so that ldmatrix on fp8 key rows (a 16-byte row = one k-step of a key) hands lane
//   (g, t) exactly its B fragment: one ldmatrix.x4 = four k-steps of 8 keys, two cvt per k-step.
//   P V: the output channels are permuted instead (n-tile n's column g is channel
//   w kCols + g kNTiles + n): lane (g, t) reads kNTiles contiguous bytes (LDS.128 at kM = 16,
//   LDS.64 at kM = 64) of keys 16 kk + (2t, 2t+1, 2t+8, 2t+9) and pairs them with PRMT; the
//   epilogue writes the channels back in order. KV rows are 592 B (= 80 mod 128): the
//   ldmatrix rows and the V loads of a quarter- (half-) warp hit distinct banks.
//   Per 32-key compute tile, kM = 16 (per warp): 36 Q + 9 K ldmatrix.x4, 36 + 32 mma, 72 + 64
//   cvt, 16 PRMT, 8 LDS.128, 2 P ldmatrix. The conversions are the tightest pipe: the latent's
//   v channels are converted twice (S's contraction and P V's B operand): 544 f16x2
//   conversions per key; at 16 per clk per SM (the F2FP rate decode_mma.cuh assumes) ~34 clk
//   per 576-byte key, ~17 B/clk per SM = ~4.1 TB/s on 132 SMs at 1.83 GHz before any overlap
//   loss. Shared memory per 37.9 KB load tile: Q re-reads 147 KB (twice bf16's per byte), K
//   37 KB, V 32 KB, cp.async 38 KB: ~250 KB, ~2000 clk at 128 B/clk against ~2450 clk for 85%
//   of the copy ceiling. Predicted (B=64 L=4k H=16): 2.9-3.4 TB/s of fp8 bytes (time 0.55-0.65x
//   bf16's); B=1 L=32k bounded by the split count as bf16. kM = 64 (H = 128): the 4 m-blocks'
//   warps each convert the same K (4x): ~2800 clk of conversions per 32-key tile, about bf16's
//   ~3100 clk of shared memory: about bf16's time per key (0.9-1.2x). Next: K converted once per
//   tile at kM = 64 (an f16 copy in shared memory), or integer unpacking (PRMT + LOP3, exact but
//   for NaN) for part of the conversions to take load off the F2FP pipe.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/attention/decode_fwd.cuh"
#include "flashserve/status.hpp"
#include "kernels/attention/decode_mla_config.hpp"
#include "kernels/common/tma.cuh"

namespace flashserve::kernels::mla {

// The launchers' check that p is an MLA absorbed-decode problem (kernel: the name in the error).
inline void require_mla_problem(const AttnParams& p, const char* kernel) {
  if (p.head_dim != kMlaD || p.head_dim_v != kMlaDv || p.num_kv_heads != 1 || !p.q_v.data)
    throw RuntimeError(detail::cat(kernel, " attention: D ", p.head_dim, ", Dv ", p.head_dim_v, ", H_kv ",
                                   p.num_kv_heads, " and q_v are not an MLA decode problem"));
}

using decode::DecodeSeq;
using decode::PackedIdx;
using decode::RowMeta;

template <DType kDt, DType kKv, int kM_>
struct Shape {
  static constexpr int kVb = kv_bytes(kKv);                  // KV bytes per element (2 or 1)
  static constexpr bool kFp8 = kVb == 1;
  static constexpr DType kKvDt = kKv;
  // mma operand type: q's for 16-bit KV; f16 for fp8 KV (q staged as f16, scaled per row)
  using T = std::conditional_t<!kFp8 && kDt == DType::bf16, __nv_bfloat16, __half>;
  using QT = std::conditional_t<kDt == DType::bf16, __nv_bfloat16, __half>;  // q, q_v in memory
  static constexpr int kM = kM_;
  static constexpr int kWarps = mla_warps(kM);
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kN = kMlaTileKeys;                    // keys per compute tile
  static constexpr int kL = mla_load_keys(kVb);              // keys per load tile (stage)
  static constexpr int kSub = kL / kN;                       // compute tiles per load tile
  static constexpr int kMBlocks = kM / 16;
  static constexpr int kWarpsPerMBlock = kWarps / kMBlocks;  // S: warps sharing an m-block
  static constexpr int kKeysPerWarp = kN / kWarpsPerMBlock;  // S: 8 or 16
  static constexpr int kCols = kMlaDv / kWarps;              // P V: output columns per warp
  static constexpr int kNTiles = kCols / 8;
  static constexpr int kTpr = kThreads / kM;                 // softmax: lanes per row
  static constexpr int kKpt = kN / kTpr;                     // softmax: keys per lane
  static constexpr int kKSteps = kMlaWidth / 16;             // 36
  static constexpr int kRowBytes = int(kMlaRowBytes);        // Q rows in shared memory
  static constexpr int kKvRow = int(mla_kv_row_bytes(kVb));  // KV rows in shared memory
  static constexpr int kSStride = int(kMlaSStride);          // S / P rows
  static constexpr int kKBytes = kMlaD * kVb;                // k's bytes at the start of a KV row
  static constexpr int kKChunks = kKBytes / 16, kVChunks = kMlaDv * kVb / 16;
  static constexpr size_t kStageBytes = size_t(kL) * kKvRow;
  static constexpr int kSParts = 1;  // partial S sums the softmax adds (decode_mla_wgmma.cuh: 2)
  // Shared-memory byte offsets of 16-byte chunk c of Q row j and of KV row r ([k | v] chunks).
  static FS_DEV uint32_t q_at(int j, int c) { return uint32_t(j * kRowBytes + c * 16); }
  static FS_DEV uint32_t kv_at(int r, int c) { return uint32_t(r * kKvRow + c * 16); }
  static constexpr bool kQPermuted = true;  // fp8: f16 Q in fp8_q_column's order (ldmatrix on fp8 rows)
  static constexpr size_t kQOff = 0;
  static constexpr size_t kKvOff = size_t(kM) * kRowBytes;
  static constexpr size_t kSOff = kKvOff + kMlaStages * kStageBytes;
  static constexpr size_t kMetaOff = kSOff + size_t(kM) * kSStride;
  static constexpr size_t kScaleOff = kMetaOff + size_t(kM) * sizeof(RowMeta);
  static constexpr size_t kLocOff = kScaleOff + size_t(kM) * sizeof(float);
  static constexpr size_t kBadOff = kLocOff + size_t(kL) * sizeof(TokenLoc);
  static constexpr size_t kBytes = kBadOff + 16;
  static_assert(kBytes == mla_smem_bytes(kM, kVb), "decode_mla_config.hpp sizes shared memory with it");
  static_assert(sizeof(RowMeta) == kMlaRowMetaBytes && kLocOff % 8 == 0 && kMetaOff % 16 == 0);
  static_assert(kKeysPerWarp == 8 || kKeysPerWarp == 16, "S: one or two n8 blocks per warp");
  static_assert(kTpr * kM == kThreads && kKpt % 4 == 0 && 32 % kTpr == 0, "softmax: whole rows per warp");
  static_assert(kNTiles % 2 == 0 && kN == 32 && kMlaStages == 2 && kMlaStages * kSub <= 4, "the pipeline below");
  static_assert((kL * kKChunks) % kThreads == 0 && (kL * kVChunks) % kThreads == 0, "issue_kv: whole copy rounds");
  static_assert(!kFp8 || kNTiles == 8 || kNTiles == 16, "fp8 P V: 8 or 16 bytes per lane per key");
};

// Rows [0, kM) of the group: q then q_v of packed row g0 + j into Q row j (zeros past nrows).
// Issues cp.async copies (the caller commits them).
template <class S>
FS_DEV void issue_q(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, uint32_t q) {
  constexpr int kChunks = kMlaWidth * 2 / 16;  // 72: 8 of q, 64 of q_v
  for (int i = int(threadIdx.x); i < S::kM * kChunks; i += S::kThreads) {
    const int j = i / kChunks, c = i % kChunks;
    const char* src = static_cast<const char*>(p.q.data);
    const bool ok = j < nrows;
    if (ok) {
      const PackedIdx pi = decode::packed_idx(p, 0, g0, j);
      const int64_t q_row = s.rows.q_row(s.rows.row_begin + pi.i, p.batched);
      const StridedRef& r = c < 8 ? p.q : p.q_v;
      src = static_cast<const char*>(r.data) + (s.rows.qb * r.stride[0] + q_row * r.stride[1] + pi.h * r.stride[2]) * 2 +
            (c < 8 ? c : c - 8) * 16;
    }
    cp_async_16(q + S::q_at(j, c), src, ok);
  }
}

// fp8 KV: the Q column (k index) of physical channel d of [q | q_v]. Within each 16-channel k-step
// the channels are permuted so that ldmatrix on fp8 key rows hands lane (g, t) the word of
// physical channels 4t..4t+3, i.e. k indices 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1) of the step.
FS_DEV int fp8_q_column(int d) {
  const int b = d % 16, t = b / 4, i = b % 4;
  return d - b + 2 * t + (i < 2 ? i : i + 6);
}

// fp8 KV: the row group's q (16-bit, landed in Q by issue_q's copies) rewritten in place as f16
// (in fp8_q_column's order where S::kQPermuted), each row scaled by a power of two 2^shift (bf16 q: the row's max |x|
// into [2^15, 2^16); f16 q: 1), so that every bf16 value within 2^-32 of the row's max is exact
// in f16 (smaller ones weigh < 2^-32 of a score); meta[j].qk_scale = 2^-shift (the descales are
// applied by compute_s_fp8). One
// warp per row (reads, then writes after __syncwarp); rows past nrows are zeros. The caller syncs.
template <class S>
FS_DEV void convert_q_fp8(unsigned char* q, RowMeta* meta) {
  using QT = typename S::QT;
  constexpr int kPer = kMlaWidth / 32;  // 18 channels per lane
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  for (int j = warp; j < S::kM; j += S::kWarps) {
    const auto at = [&](int ch) { return q + S::q_at(j, ch / 8) + (ch % 8) * 2; };  // channel ch of row j
    float x[kPer];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      x[k] = float(*reinterpret_cast<const QT*>(at(lane + 32 * k)));
      amax = fmaxf(amax, fabsf(x[k]));
    }
    int shift = 0;
    if constexpr (std::is_same_v<QT, __nv_bfloat16>) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
      if (amax > 0.0f && amax < INFINITY) {
        const int e = int((__float_as_uint(amax) >> 23) & 0xffu) - 127;  // subnormal: -127 (clamped below)
        shift = int(imin(imax(15 - e, -126), 126));
      }
    }
    __syncwarp();  // the row is read before it is rewritten
    const float up = ldexpf(1.0f, shift);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int ch = lane + 32 * k;
      *reinterpret_cast<__half*>(at(S::kQPermuted ? fp8_q_column(ch) : ch)) = __float2half_rn(x[k] * up);
    }
    if (lane == 0) meta[j].qk_scale = ldexpf(1.0f, -shift);
  }
}

// Warp 0: the locations of tile keys [t0, t0 + 32) (one per lane) into loc; keys outside [lo, hi)
// are skipped (zero rows), keys outside the cache bad.
template <class S>
FS_DEV void locate(const AttnParams& p, const DecodeSeq& s, int64_t t0, KeyRange u, TokenLoc* loc, int lane) {
  const decode::TileKey key = decode::tile_key<S::kN>(p, s.kv, t0, u.lo, u.hi, lane);
  loc[lane] = decode::tile_loc(p, s.kv, key);
}

// Warp 0: the bad-key masks of a located load tile (one per 32-key compute tile).
template <class S>
FS_DEV void set_bad_masks(const TokenLoc* loc, uint32_t* bad) {
  const int tid = int(threadIdx.x);
  if (tid >= 32) return;
#pragma unroll
  for (int h = 0; h < S::kSub; ++h) {
    const uint32_t m = __ballot_sync(kFullMask, loc[h * 32 + tid].state == kTokenBad);
    if (tid == 0) bad[h] = m;
  }
}

// The copies of a located load tile (kL keys) into a stage: K (kKChunks chunks per key) at the
// row's start, V (kVChunks) after it; skipped and bad keys as zero rows; warp 0 sets the stage's
// bad masks.
template <class S>
FS_DEV void issue_kv(const AttnParams& p, const TokenLoc* loc, uint32_t* bad, uint32_t stage) {
  const int tid = int(threadIdx.x);
  set_bad_masks<S>(loc, bad);
  const char* kg = static_cast<const char*>(p.k.data);
  const char* vg = static_cast<const char*>(p.v.data);
#pragma unroll
  for (int it = 0; it < S::kL * S::kKChunks / S::kThreads; ++it) {
    const int i = tid + it * S::kThreads, r = i / S::kKChunks, c = i % S::kKChunks;
    const TokenLoc& L = loc[r];
    cp_async_16(stage + S::kv_at(r, c), kg + L.k_off * S::kVb + c * 16, L.state == kTokenValid);
  }
#pragma unroll
  for (int it = 0; it < S::kL * S::kVChunks / S::kThreads; ++it) {
    const int i = tid + it * S::kThreads, r = i / S::kVChunks, c = i % S::kVChunks;
    const TokenLoc& L = loc[r];
    cp_async_16(stage + S::kv_at(r, S::kKChunks + c), vg + L.v_off * S::kVb + c * 16, L.state == kTokenValid);
  }
}

// The sm_90a kernels' copies of a located tile (kN keys, 16-bit) into a swizzled stage (S::KvL),
// one key row per 8 threads per round: thread t takes rows t / 8 + kThreads / 8 i and their
// 16-byte chunks t % 8 + 8 j (j = 0: k; 1-8: the latent), so each thread reads a row's location
// once and every copy is a constant offset from its first (column block j of the swizzled tile;
// 128 bytes further in v). Skipped and bad keys as zero rows; warp 0 sets the stage's bad masks
// (set_bad_masks: kSub of 32 keys). (issue_kv above keeps consecutive threads on consecutive
// chunks: this mapping measured slower there.)
template <class S>
FS_DEV void issue_kv_rows(const AttnParams& p, const TokenLoc* loc, uint32_t* bad, uint32_t stage) {
  static_assert((S::kN * 8) % S::kThreads == 0 && S::kN == 32 * S::kSub && kMlaD == 64 && kMlaDv == 512,
                "whole rounds of rows; k one column block, v eight");
  const int tid = int(threadIdx.x), c = tid % 8;
  set_bad_masks<S>(loc, bad);
#pragma unroll
  for (int i = 0; i < S::kN * 8 / S::kThreads; ++i) {
    const int r = tid / 8 + S::kThreads / 8 * i;
    const TokenLoc& L = loc[r];
    const bool ok = L.state == kTokenValid;
    const char* kg = static_cast<const char*>(p.k.data) + (ok ? L.k_off * 2 : 0) + c * 16;
    const char* vg = static_cast<const char*>(p.v.data) + (ok ? L.v_off * 2 : 0) + c * 16;
    const uint32_t dst = stage + S::KvL::at(r, c);
    cp_async_16(dst, kg, ok);
#pragma unroll
    for (int j = 1; j <= 8; ++j) cp_async_16(dst + uint32_t(j) * S::KvL::kBlockBytes, vg + (j - 1) * 128, ok);
  }
}

// fp8 KV: S = k_desc q.k + v_desc q_v.v from the latent's part (acc, in place) and k's (ak), each
// descale on its own operand's part (the k and v of a latent cache may carry different scales).
FS_DEV void descale_s(float (&acc)[2][4], const float (&ak)[2][4], float k_desc, float v_desc) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = fmaf(acc[n][e], v_desc, ak[n][e] * k_desc);
}

// Step 1: S [kM, 32] (fp32, rows kSStride bytes apart) = Q [k | v]^T, the warp's m-block and key slice.
template <class S>
FS_DEV void compute_s(uint32_t q, uint32_t kv, unsigned char* sbuf, int warp, int lane) {
  using T = typename S::T;
  const int mb = warp / S::kWarpsPerMBlock, k0 = (warp % S::kWarpsPerMBlock) * S::kKeysPerWarp;
  const uint32_t qa = q + uint32_t((16 * mb + lane % 8 + 8 * ((lane / 8) % 2)) * S::kRowBytes + 16 * (lane / 16));
  float acc[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  if constexpr (S::kKeysPerWarp == 16) {
    // matrices: keys 0-7 (channels lo | hi), keys 8-15 (lo | hi) of k-step ks
    const uint32_t kb = kv + uint32_t((k0 + lane % 8 + 8 * (lane / 16)) * S::kKvRow + 16 * ((lane / 8) % 2));
#pragma unroll 6
    for (int ks = 0; ks < S::kKSteps; ++ks) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, qa + uint32_t(ks * 32));
      ldmatrix_x4(b, kb + uint32_t(ks * 32));
      mma_16816<T>(acc[0], a, b[0], b[1]);
      mma_16816<T>(acc[1], a, b[2], b[3]);
    }
  } else {
    // matrices: keys 0-7 x channels (lo | hi) of k-steps 2 ks2 and 2 ks2 + 1; two chains
    const uint32_t kb = kv + uint32_t((k0 + lane % 8) * S::kKvRow + 16 * (lane / 8));
#pragma unroll 6
    for (int ks2 = 0; ks2 < S::kKSteps / 2; ++ks2) {
      uint32_t a0[4], a1[4], b[4];
      ldmatrix_x4(b, kb + uint32_t(ks2 * 64));
      ldmatrix_x4(a0, qa + uint32_t(ks2 * 64));
      ldmatrix_x4(a1, qa + uint32_t(ks2 * 64 + 32));
      mma_16816<T>(acc[0], a0, b[0], b[1]);
      mma_16816<T>(acc[1], a1, b[2], b[3]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][e] += acc[1][e];
  }
  const int row = 16 * mb + lane / 4;
#pragma unroll
  for (int n = 0; n < S::kKeysPerWarp / 8; ++n) {
    const int col = k0 + 8 * n + 2 * (lane % 4);
    *reinterpret_cast<float2*>(sbuf + row * S::kSStride + col * 4) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(sbuf + (row + 8) * S::kSStride + col * 4) = make_float2(acc[n][2], acc[n][3]);
  }
}

// Step 1 for fp8 KV: S [kM, 32] = Q [k | v]^T with K's B fragments by ldmatrix on the fp8 rows
// (one x4 = four k-steps of 8 keys; fp8_q_column's order) converted in registers to f16x2 (exact).
// Each operand's descale on its own part: S = k_desc q.k + v_desc q_v.v (the k and v of a latent
// row are two tensors with their own descales, as the CPU reference dequantizes them); the row's
// 2^-shift (RowMeta::qk_scale) is applied by the softmax.
template <class S, DType kKv>
FS_DEV void compute_s_fp8(uint32_t q, uint32_t kv, unsigned char* sbuf, int warp, int lane, float k_desc,
                          float v_desc) {
  constexpr int kNb = S::kKeysPerWarp / 8;  // n8 key blocks per warp
  const int mb = warp / S::kWarpsPerMBlock, k0 = (warp % S::kWarpsPerMBlock) * S::kKeysPerWarp;
  const uint32_t qa = q + uint32_t((16 * mb + lane % 8 + 8 * ((lane / 8) % 2)) * S::kRowBytes + 16 * (lane / 16));
  const uint32_t kb = kv + uint32_t((k0 + lane % 8) * S::kKvRow + 16 * (lane / 8));
  // Chunk c = k-steps 4c..4c+3 (64 channels): chunk 0 is k (rope) against q, chunks 1-8 are v
  // (latent) against q_v.
  auto chunk = [&](int c, float (&acc)[2][4]) {
    uint32_t w[kNb][4];
#pragma unroll
    for (int n = 0; n < kNb; ++n) ldmatrix_x4(w[n], kb + uint32_t(n * 8 * S::kKvRow + c * 64));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      ldmatrix_x4(a, qa + uint32_t((4 * c + j) * 32));
#pragma unroll
      for (int n = 0; n < kNb; ++n) {
        uint32_t b0, b1;
        decode::fp8x4_to_f16x2x2<kKv>(w[n][j], b0, b1);
        mma_16816<__half>(acc[kNb == 2 ? n : j % 2], a, b0, b1);
      }
    }
  };
  static_assert(kMlaD == 64, "chunk 0 is k");
  float acc[2][4], ak[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = ak[n][e] = 0.0f;
#pragma unroll 3
  for (int c = 1; c < S::kKSteps / 4; ++c) chunk(c, acc);
  chunk(0, ak);
  descale_s(acc, ak, k_desc, v_desc);
  if constexpr (kNb == 1) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][e] += acc[1][e];
  }
  const int row = 16 * mb + lane / 4;
#pragma unroll
  for (int n = 0; n < kNb; ++n) {
    const int col = k0 + 8 * n + 2 * (lane % 4);
    *reinterpret_cast<float2*>(sbuf + row * S::kSStride + col * 4) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(sbuf + (row + 8) * S::kSStride + col * 4) = make_float2(acc[n][2], acc[n][3]);
  }
}

// The softmax lanes' row state (row = tid / kTpr; keys [part * kKpt, +kKpt) of each tile).
struct RowRegs {
  int64_t pos, lo, hi;
  float slope;
  float qk = 1.0f;    // fp8 KV: the row's score factor (RowMeta::qk_scale: 2^-shift), set once q is converted
  float m = kNegInf;  // running max (natural units), the same in the row's lanes
  float l = 0.0f;     // this lane's partial sum
};

// A softmax lane's row state from its row's meta, before the first tile (qk: 1).
FS_DEV RowRegs row_regs(const RowMeta& m) {
  RowRegs r;
  r.pos = m.pos, r.lo = m.lo, r.hi = m.hi, r.slope = m.slope;
  return r;
}

// Step 2: online softmax of the lane's row over tile keys [t0, t0 + 32); P (16-bit) over the
// row's S in place; alpha (the factor for O) to rscale[row]. S is the sum of kSParts partial
// sums kM rows apart (the wgmma kernel's two warpgroups each take half of the contraction).
template <class S>
FS_DEV void softmax_rows(const AttnParams& p, unsigned char* sbuf, float* rscale, uint32_t bad, int64_t t0,
                         RowRegs& rr, int row, int part) {
  using T = typename S::T;
  constexpr float kLog2e = 1.4426950408889634f;
  const int c0 = part * S::kKpt;
  float x[S::kKpt];
  const float* srow = reinterpret_cast<const float*>(sbuf + row * S::kSStride) + c0;
#pragma unroll
  for (int i = 0; i < S::kKpt; i += 4) {
    float4 v = *reinterpret_cast<const float4*>(srow + i);
#pragma unroll
    for (int h = 1; h < S::kSParts; ++h) {
      const float4 w = *reinterpret_cast<const float4*>(srow + h * S::kM * S::kSStride / 4 + i);
      v.x += w.x, v.y += w.y, v.z += w.z, v.w += w.w;
    }
    x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
  }
  __syncwarp();  // the row's lanes have read S before P overwrites it
  const ScoreTransform score = make_score_transform(p);
  float mx = kNegInf;
  const int64_t k0 = t0 + c0;
  constexpr uint32_t kLaneKeys = (1u << S::kKpt) - 1u;
  if (score.plain() && ((bad >> c0) & kLaneKeys) == 0u && k0 >= rr.lo && k0 + S::kKpt <= rr.hi) {
    // every key of the lane visible and good, no modifier: the logit is dot x scale
    const float sc = S::kFp8 ? score.scale * rr.qk : score.scale;
#pragma unroll
    for (int i = 0; i < S::kKpt; ++i) {
      x[i] *= sc;
      mx = nan_max(mx, x[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < S::kKpt; ++i) {
      const int64_t key = k0 + i;
      x[i] = key < rr.lo || key >= rr.hi   ? kNegInf
             : (bad >> (c0 + i)) & 1u      ? nan_value()
                                             : score(S::kFp8 ? x[i] * rr.qk : x[i], rr.pos, key, rr.slope);
      mx = nan_max(mx, x[i]);
    }
  }
#pragma unroll
  for (int o = 1; o < S::kTpr; o <<= 1) mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, o));
  const float new_m = nan_max(rr.m, mx);
  float alpha = 1.0f;
  if (new_m == kNegInf) {  // nothing visible yet: p = 0, state unchanged
#pragma unroll
    for (int i = 0; i < S::kKpt; ++i) x[i] = 0.0f;
  } else {
    const float mb = new_m * kLog2e;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < S::kKpt; ++i) {
      x[i] = fast_exp2(fmaf(x[i], kLog2e, -mb));  // -inf -> 0, NaN stays
      sum += x[i];
    }
    alpha = rr.m == new_m ? 1.0f : fast_exp2(fmaf(rr.m, kLog2e, -mb));  // m = -inf -> 0; NaN -> NaN
    rr.l = rr.l * alpha + sum;
    rr.m = new_m;
  }
  uint32_t* prow = reinterpret_cast<uint32_t*>(sbuf + row * S::kSStride + c0 * 2);
#pragma unroll
  for (int i = 0; i < S::kKpt; i += 2) prow[i / 2] = pack2<T>(x[i], x[i + 1]);
  if (part == 0) rscale[row] = alpha;
}

// Step 3: O = O * alpha + P V over the tile, the warp's output columns for all rows.
template <class S, DType kKv>
FS_DEV void accumulate_pv(const unsigned char* kvp, const unsigned char* sbuf, const float* rscale, int warp, int lane,
                          float (&o)[S::kMBlocks][S::kNTiles][4]) {
  using T = typename S::T;
  float al[S::kMBlocks][2];
  bool moved = false;
#pragma unroll
  for (int mb = 0; mb < S::kMBlocks; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      al[mb][r] = rscale[16 * mb + lane / 4 + 8 * r];
      moved |= al[mb][r] != 1.0f;
    }
  if (__any_sync(kFullMask, moved)) {
#pragma unroll
    for (int mb = 0; mb < S::kMBlocks; ++mb)
#pragma unroll
      for (int n = 0; n < S::kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mb][n][e] *= al[mb][e / 2];
  }
  const uint32_t pbase = smem_u32(sbuf) + uint32_t((lane % 8 + 8 * ((lane / 8) % 2)) * S::kSStride + 16 * (lane / 16));
  if constexpr (S::kFp8) {
    // V's output channels permuted: n-tile n's column g is channel warp kCols + g kNTiles + n, so
    // lane (g, t) reads kNTiles contiguous bytes of keys 16 kk + (2t, 2t+1, 2t+8, 2t+9) and pairs
    // the keys' bytes with PRMT (the epilogue writes the channels back in order).
    constexpr int kB = S::kNTiles, kW = kB / 4;
    const int g = lane / 4, t = lane % 4;
    const unsigned char* vrow = kvp + S::kKBytes + warp * S::kCols + g * kB;
#pragma unroll
    for (int kk = 0; kk < S::kN / 16; ++kk) {
      uint32_t a[S::kMBlocks][4];
#pragma unroll
      for (int mb = 0; mb < S::kMBlocks; ++mb) ldmatrix_x4(a[mb], pbase + uint32_t(16 * mb * S::kSStride + kk * 32));
      uint32_t w[4][kW];
#pragma unroll
      for (int r = 0; r < 4; ++r) decode::load_words<kB>(vrow + (16 * kk + 2 * t + (r % 2) + 8 * (r / 2)) * S::kKvRow, w[r]);
#pragma unroll
      for (int i = 0; i < kW; ++i) {
        const uint32_t ab[2] = {decode::prmt(w[0][i], w[1][i], 0x5140u), decode::prmt(w[0][i], w[1][i], 0x7362u)};
        const uint32_t cd[2] = {decode::prmt(w[2][i], w[3][i], 0x5140u), decode::prmt(w[2][i], w[3][i], 0x7362u)};
        uint32_t fab[4], fcd[4];  // j -> the f16x2 of ab / cd's key pair j
        decode::fp8x4_to_f16x2x2<kKv>(ab[0], fab[0], fab[1]);
        decode::fp8x4_to_f16x2x2<kKv>(ab[1], fab[2], fab[3]);
        decode::fp8x4_to_f16x2x2<kKv>(cd[0], fcd[0], fcd[1]);
        decode::fp8x4_to_f16x2x2<kKv>(cd[1], fcd[2], fcd[3]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t b0 = fab[j], b1 = fcd[j];
#pragma unroll
          for (int mb = 0; mb < S::kMBlocks; ++mb) mma_16816<__half>(o[mb][4 * i + j], a[mb], b0, b1);
        }
      }
    }
  } else {
    const uint32_t kv = smem_u32(kvp);
    const uint32_t vbase =
        kv + uint32_t((lane % 8 + 8 * ((lane / 8) % 2)) * S::kKvRow + S::kKBytes + warp * S::kCols * 2 + 16 * (lane / 16));
#pragma unroll
    for (int kk = 0; kk < S::kN / 16; ++kk) {
      uint32_t a[S::kMBlocks][4];
#pragma unroll
      for (int mb = 0; mb < S::kMBlocks; ++mb) ldmatrix_x4(a[mb], pbase + uint32_t(16 * mb * S::kSStride + kk * 32));
#pragma unroll
      for (int n2 = 0; n2 < S::kNTiles / 2; ++n2) {
        uint32_t b[4];  // channels 16 n2 + (0-7 | 8-15) x keys 16 kk + (0-7 | 8-15)
        ldmatrix_x4_trans(b, vbase + uint32_t(16 * kk * S::kKvRow + n2 * 32));
#pragma unroll
        for (int mb = 0; mb < S::kMBlocks; ++mb) {
          mma_16816<T>(o[mb][2 * n2], a[mb], b[0], b[1]);
          mma_16816<T>(o[mb][2 * n2 + 1], a[mb], b[2], b[3]);
        }
      }
    }
  }
}

// Packed row j's output scale, num / l times the sink's weight (0 when l = 0), with its LSE
// m + log l stored (or the split's partial LSE) when j < nrows (MLA kernels' epilogues).
FS_DEV float finish_row(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, int j, float m,
                        float l, float num) {
  float lse = l == 0.0f ? kNegInf : m + logf(l);  // apply_sink may move it
  float scale = l == 0.0f ? 0.0f : num / l;
  if (j < nrows) {
    const PackedIdx pi = decode::packed_idx(p, 0, g0, j);
    const int64_t r = s.rows.row_begin + pi.i;
    if (p.num_splits > 1) {
      p.lse_partial[partial_index(p, split, r, pi.h)] = lse;
    } else {
      scale *= apply_sink(p, pi.h, lse);
      store_lse(p, s.rows.qb, s.rows.q_row(r, p.batched), pi.h, lse);
    }
  }
  return scale;
}

// Epilogue, part 1: per row, v_descale / l (times the sink's weight) into rscale and the LSE
// out (or the split's partial LSE). Every warp is past its last P V when it returns.
template <class S>
FS_DEV void finish_rows(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, float* rscale,
                        RowRegs& rr, int row, int part) {
#pragma unroll
  for (int o2 = 1; o2 < S::kTpr; o2 <<= 1) rr.l += __shfl_xor_sync(kFullMask, rr.l, o2);
  __syncthreads();  // every warp is done reading alpha
  if (part == 0) rscale[row] = finish_row(p, s, g0, nrows, split, row, rr.m, rr.l, S::kFp8 ? s.kv.v_desc : 1.0f);
  __syncthreads();
}

// Epilogue, part 2: out (or the split's fp32 partial) = O x rscale[row] for the thread's
// accumulators o[kMb][kNt][4] in the m16n8 layout: m-block mb holds rows row0 + 16 mb + lane / 4
// (+ 8), n-tile n the columns c0 + chan(n, 2 (lane % 4) (+ 1)): 8n + c, or, kPermuted (fp8
// P V's order), c kNt + n.
template <class S, int kMb, int kNt, bool kPermuted>
FS_DEV void store_o(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, const float* rscale,
                    const float (&o)[kMb][kNt][4], int row0, int c0, int lane) {
  auto chan = [](int n, int c) { return kPermuted ? c * kNt + n : 8 * n + c; };
#pragma unroll
  for (int mb = 0; mb < kMb; ++mb)
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int j = row0 + 16 * mb + lane / 4 + 8 * r2;
      if (j >= nrows) continue;
      const float sc = rscale[j];
      const PackedIdx pi = decode::packed_idx(p, 0, g0, j);
      const int64_t r = s.rows.row_begin + pi.i;
      const int c = 2 * (lane % 4);
      if (p.num_splits > 1) {
        float* dst = p.o_partial + partial_index(p, split, r, pi.h) * kMlaDv + c0;
#pragma unroll
        for (int n = 0; n < kNt; ++n) {
          if constexpr (kPermuted) {
            dst[chan(n, c)] = o[mb][n][2 * r2] * sc;
            dst[chan(n, c + 1)] = o[mb][n][2 * r2 + 1] * sc;
          } else {
            *reinterpret_cast<float2*>(dst + chan(n, c)) = make_float2(o[mb][n][2 * r2] * sc, o[mb][n][2 * r2 + 1] * sc);
          }
        }
      } else {
        // the row's offset once; adjacent channel pairs as one 4-byte store where 16-bit out allows
        const int64_t q_row = s.rows.q_row(r, p.batched);
        const int64_t at = s.rows.qb * p.out.stride[0] + q_row * p.out.stride[1] + pi.h * p.out.stride[2] + c0;
#pragma unroll
        for (int n = 0; n < kNt; ++n) {
          if constexpr (kPermuted) {
            store_from_float(const_cast<void*>(p.out.data), at + chan(n, c), p.out.dtype, o[mb][n][2 * r2] * sc);
            store_from_float(const_cast<void*>(p.out.data), at + chan(n, c + 1), p.out.dtype, o[mb][n][2 * r2 + 1] * sc);
          } else {
            store2_from_float(const_cast<void*>(p.out.data), at + chan(n, c), p.out.dtype, o[mb][n][2 * r2] * sc,
                              o[mb][n][2 * r2 + 1] * sc);
          }
        }
      }
    }
}

// A row group's shared memory, carved at S's offsets (both MLA kernels).
template <class S>
struct RowSmem {
  uint32_t q, kv;  // Q, the KV stages (shared-memory addresses)
  unsigned char* sbuf;
  RowMeta* meta;
  float* rscale;
  TokenLoc* loc;
  uint32_t* bad;
  FS_DEV explicit RowSmem(unsigned char* sm)
      : q(smem_u32(sm + S::kQOff)), kv(smem_u32(sm + S::kKvOff)), sbuf(sm + S::kSOff),
        meta(reinterpret_cast<RowMeta*>(sm + S::kMetaOff)), rscale(reinterpret_cast<float*>(sm + S::kScaleOff)),
        loc(reinterpret_cast<TokenLoc*>(sm + S::kLocOff)), bad(reinterpret_cast<uint32_t*>(sm + S::kBadOff)) {}
};

// The barrier of the threads that run a row group: the CTA's, or, in a shape whose producer
// warp loads the stages (S::kTma), the S::kThreads consumers' (named barrier 1).
template <class S>
FS_DEV void rows_sync() {
  if constexpr (requires { requires S::kTma; }) named_sync(1, S::kThreads);
  else __syncthreads();
}
template <class S>
FS_DEV bool rows_sync_or(bool pred) {
  if constexpr (requires { requires S::kTma; }) return named_sync_or(1, S::kThreads, pred);
  else return __syncthreads_or(pred);
}

// A row group's start: the rows' meta, Q's copies issued (fp8: committed as their own group, to
// be converted once they land), barrier; returns the union of the rows' visible keys.
template <class S>
FS_DEV KeyRange start_rows(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, uint32_t q, RowMeta* meta) {
  if (int(threadIdx.x) < S::kM) meta[threadIdx.x] = decode::row_meta(p, s, 0, g0, nrows, int(threadIdx.x));
  issue_q<S>(p, s, g0, nrows, q);
  if constexpr (S::kFp8) cp_async_commit();
  rows_sync<S>();
  return decode::rows_key_union(meta, nrows, s.range);
}

// One row group: packed rows [g0, g0 + nrows) of the CTA's sequence.
template <class S>
FS_DEV void run_rows(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, unsigned char* sm) {
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const auto [q, kv, sbuf, meta, rscale, loc, bad] = RowSmem<S>(sm);
  unsigned char* kvp = sm + S::kKvOff;
  const KeyRange u = start_rows<S>(p, s, g0, nrows, q, meta);
  const int row = tid / S::kTpr, part = tid % S::kTpr;
  RowRegs rr = row_regs(meta[row]);
  float o[S::kMBlocks][S::kNTiles][4];
#pragma unroll
  for (int mb = 0; mb < S::kMBlocks; ++mb)
#pragma unroll
    for (int n = 0; n < S::kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mb][n][e] = 0.0f;

  // Compute tiles of kN keys from base (aligned to the split's start); load tiles of kL = kSub
  // compute tiles (the last one's trailing compute tiles past u.hi are skipped zero rows).
  constexpr int kN = S::kN, kL = S::kL;
  const int64_t base = s.range.begin + (u.lo - s.range.begin) / kN * kN;
  const int64_t nsub = u.lo < u.hi ? (u.hi - base + kN - 1) / kN : 0;
  const int64_t nload = (nsub + S::kSub - 1) / S::kSub;
  auto locate_load = [&](int64_t t0) {
#pragma unroll
    for (int h = 0; h < S::kSub; ++h) locate<S>(p, s, t0 + h * kN, u, loc + h * 32, lane);
  };
  if (nload > 0) {
    if (warp == 0) locate_load(base);
    __syncthreads();
    issue_kv<S>(p, loc, bad, kv);
  }
  cp_async_commit();  // Q (16-bit KV) + load tile 0
  if constexpr (S::kFp8) {
    cp_async_wait<1>();  // q landed (load tile 0 may still be in flight)
    __syncthreads();
    convert_q_fp8<S>(sm + S::kQOff, meta);
    __syncthreads();
  }
  rr.qk = meta[row].qk_scale;
  if (nload > 1) {
    __syncthreads();  // load tile 0's locations are read
    if (warp == 0) locate_load(base + kL);
  }
  for (int64_t k = 0; k < nload; ++k) {
    const int st = int(k & 1);
    // Load tile k + 1 is issued as soon as its stage is free, before waiting for tile k: two
    // tiles in flight per CTA while it waits (one barrier more per load tile than waiting first).
    __syncthreads();  // every warp is done with tile k - 1 (its stage is free); k + 1's locations are written
    if (k + 1 < nload) issue_kv<S>(p, loc, bad + (st ^ 1) * S::kSub, kv + uint32_t((st ^ 1) * S::kStageBytes));
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // load tile k landed (every thread's copies)
#pragma unroll
    for (int h = 0; h < S::kSub; ++h) {
      const int64_t sub = k * S::kSub + h;
      if (sub >= nsub) break;  // CTA-uniform
      const size_t off = size_t(st) * S::kStageBytes + size_t(h) * kN * S::kKvRow;
      if (h > 0) __syncthreads();  // every warp is done with the previous compute tile's P and alpha
      // warp 0: the block-table reads of load tile k + 2 in flight during S and the softmax
      // (located after the softmax: the entries stay int32 until then, so nothing waits on
      // them); kM = 64 (8 warps at 255 registers) reads and locates after the softmax.
      constexpr bool kEarly = S::kM == 16;
      decode::TileKey next[S::kSub];
      if (kEarly && h == 0 && warp == 0 && k + 2 < nload) {
#pragma unroll
        for (int hh = 0; hh < S::kSub; ++hh)
          next[hh] = decode::tile_key<kN>(p, s.kv, base + (k + 2) * kL + hh * kN, u.lo, u.hi, lane);
      }
      if constexpr (S::kFp8) compute_s_fp8<S, S::kKvDt>(q, kv + uint32_t(off), sbuf, warp, lane, s.kv.k_desc, s.kv.v_desc);
      else compute_s<S>(q, kv + uint32_t(off), sbuf, warp, lane);
      __syncthreads();  // S complete; load tile k + 1's locations are read
      softmax_rows<S>(p, sbuf, rscale, bad[st * S::kSub + h], base + sub * kN, rr, row, part);
      if (h == 0 && warp == 0 && k + 2 < nload) {
        if constexpr (kEarly) {
#pragma unroll
          for (int hh = 0; hh < S::kSub; ++hh) loc[hh * 32 + lane] = decode::tile_loc(p, s.kv, next[hh]);
        } else {
          locate_load(base + (k + 2) * kL);
        }
      }
      __syncthreads();  // P and alpha complete
      accumulate_pv<S, S::kKvDt>(kvp + off, sbuf, rscale, warp, lane, o);
    }
  }
  cp_async_wait<0>();
  finish_rows<S>(p, s, g0, nrows, split, rscale, rr, row, part);
  store_o<S, S::kMBlocks, S::kNTiles, S::kFp8>(p, s, g0, nrows, split, rscale, o, 0, warp * S::kCols, lane);
}

// kM = 16: two CTAs per SM (shared memory); kM = 64: one, 8 warps (<= 255 registers).
// The CTA's row groups of kM packed rows (y, y + gridDim.y, ...) of its sequence and split:
// run(s, g0, nrows, split) for each, after a barrier (the previous group is done with shared
// memory). Every MLA kernel's body.
template <int kM, class Run>
FS_DEV void for_row_groups(const AttnParams& p, Run&& run) {
  const int split = int(blockIdx.z);
  const DecodeSeq s = decode::decode_sequence(p, blockIdx.x, 0, split);
  const int64_t packed = s.rows.sq() * p.group;
  for (int64_t g0 = int64_t(blockIdx.y) * kM; g0 < packed; g0 += int64_t(gridDim.y) * kM) {
    const int nrows = int(imin(kM, packed - g0));
    __syncthreads();
    run(s, g0, nrows, split);
  }
}

template <DType kDt, DType kKv, int kM>
__global__ void __launch_bounds__(32 * mla_warps(kM), kM == 16 ? 2 : 1)
    decode_mla_fwd(const __grid_constant__ AttnParams p) {
  using S = Shape<kDt, kKv, kM>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  for_row_groups<kM>(p, [&](const DecodeSeq& s, int64_t g0, int nrows, int split) {
    run_rows<S>(p, s, g0, nrows, split, smem_raw);
  });
}

}  // namespace flashserve::kernels::mla
