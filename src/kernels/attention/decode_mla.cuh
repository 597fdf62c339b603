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
// fp8 latent cache (e4m3 / e5m2; k_descale / v_descale [B, H_kv] or broadcasts, as the engines
// pass them for fp8 caches; q and q_v 16-bit): the mma operands are f16. Every fp8 value is exact
// in f16 (cvt.rn.f16x2.{e4m3,e5m2}x2 in registers, decode_mma.cuh's fp8x2_to_f16x2); q is staged
// once per row group as f16 (convert_q_fp8, in place after the 16-bit copies): bf16 rows scaled by 2^shift (max |x| into
// [2^15, 2^16); exact for every value within 2^-32 of the row's max), f16 rows as they are; the
// scores are k_descale q.k + v_descale q_v.v (each descale on its own operand's part of the
// contraction, as the CPU reference dequantizes k and v: S's k-steps of k and of v accumulate
// apart), times the row's qk_scale = 2^-shift before the modifiers; v_descale also goes into the
// epilogue's 1 / l. P is rounded to f16 (finer than bf16).
//
// This file: what the MLA decode kernels share (the problem check, the shape, Q staging and the
// fp8 q conversion, token location and the tiles' copies, the softmax of step 2, the epilogue,
// the row-group loop); the mma.sync kernel's steps 1 and 3, its tile loop, entry point and cost
// model: decode_mla_mma.cuh; the sm_90a kernels: decode_mla_wgmma.cuh, decode_mla_heads.cuh,
// decode_mla_pp.cuh.
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

// The sm_90a kernels' copies of a located tile (kN keys, 16-bit) into a swizzled stage (S::KvL),
// one key row per 8 threads per round: thread t takes rows t / 8 + kThreads / 8 i and their
// 16-byte chunks t % 8 + 8 j (j = 0: k; 1-8: the latent), so each thread reads a row's location
// once and every copy is a constant offset from its first (column block j of the swizzled tile;
// 128 bytes further in v). Skipped and bad keys as zero rows; warp 0 sets the stage's bad masks
// (set_bad_masks: kSub of 32 keys). (decode_mla_mma.cuh's issue_kv keeps consecutive threads on consecutive
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

// Packed row j's output scale, num / l times the sink's weight (0 when l = 0), with its LSE
// m + log l stored (or the split's partial LSE: into the workspace, or cluster_lse [j] for
// cluster_combine) when j < nrows (MLA kernels' epilogues).
FS_DEV float finish_row(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, int j, float m,
                        float l, float num, float* cluster_lse = nullptr) {
  float lse = l == 0.0f ? kNegInf : m + logf(l);  // apply_sink may move it
  float scale = l == 0.0f ? 0.0f : num / l;
  if (j < nrows) {
    const PackedIdx pi = decode::packed_idx(p, 0, g0, j);
    const int64_t r = s.rows.row_begin + pi.i;
    if (cluster_lse) {  // the split's partial LSE for cluster_combine
      cluster_lse[j] = lse;
    } else if (p.num_splits > 1) {
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

// A row group's start: the rows' meta, Q's copies issued (committed as their own group where the
// caller waits for Q alone: fp8, to convert it once it lands; a TMA-fed shape, whose tiles take
// no cp.async group to share: cp.async.wait_group waits for committed groups only), barrier;
// returns the union of the rows' visible keys.
template <class S>
FS_DEV KeyRange start_rows(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, uint32_t q, RowMeta* meta) {
  if (int(threadIdx.x) < S::kM) meta[threadIdx.x] = decode::row_meta(p, s, 0, g0, nrows, int(threadIdx.x));
  issue_q<S>(p, s, g0, nrows, q);
  if constexpr (S::kFp8 || requires { requires S::kTma; }) cp_async_commit();
  rows_sync<S>();
  return decode::rows_key_union(meta, nrows, s.range);
}

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

}  // namespace flashserve::kernels::mla
