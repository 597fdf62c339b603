// The parts the two tensor-core prefill kernels share: the mma.sync kernel (prefill_fwd.cuh,
// sm80+) and the wgmma kernel (prefill_wgmma.cuh, sm_90a). Both own 128 query rows of one
// sequence x one query head x one KV split per CTA, stream KV tiles through double-buffered
// shared memory with cp.async (every KV row located on its own: any paged block size), and keep
// the softmax state of a thread's two rows (g and g + 8 of a 16-row block) in registers, in the
// m16n8 accumulator layout that mma.sync and wgmma share:
//   s[n8 tile][4]: [0], [1] row g, cols 8 nt + 2 t, + 1; [2], [3] row g + 8 (g = lane / 4,
//   t = lane % 4).
// What differs is the tile shape (TileShape) and the shared-memory layout of a tile (a `Layout`
// type with `static uint32_t at(int row, int chunk)`, the byte offset of 16-byte chunk `chunk`
// of tile row `row`): the CTA schedule, the copies, the score mapping, the online softmax,
// the key ranges and the epilogue below take both as parameters.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "flashserve/plan.hpp"
#include "kernels/attention/generic_fwd.cuh"
#include "kernels/common/mma.cuh"

namespace flashserve::kernels::prefill {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// M query rows per CTA over N-key tiles with `Warps` warps; a warp owns M / Warps rows (whole
// m16 blocks); `GroupRows` rows (a warp, or a wgmma warpgroup) decide together whether a tile
// is skipped (no row sees it) or masked (some row sees only part of it).
template <int M, int N, int Warps, int GroupRows>
struct TileShape {
  static constexpr int kM = M, kN = N, kWarps = Warps, kThreads = 32 * Warps;
  static constexpr int kWarpRows = M / Warps, kMB = kWarpRows / 16, kGroupRows = GroupRows;
  static_assert(kWarpRows % 16 == 0 && GroupRows % kWarpRows == 0 && M % GroupRows == 0, "whole m16 blocks");
  static_assert(N % 16 == 0, "whole k16 steps over a tile's keys");
};

// The query rows of one CTA: tile rows [0, rows) are sequence rows i0 .. i0 + rows - 1.
struct CtaWork {
  bool active = false;
  int64_t b = 0, qb = 0;  // sequence; index into the normalized q's dim 0
  int64_t row0 = 0;       // flat row of tile row 0
  int64_t q_row0 = 0;     // its index into the normalized view's dim 1
  int64_t i0 = 0, sq = 0;
  int rows = 0;
};

template <int kM>
FS_DEV int64_t tile_base(const AttnParams& p, int64_t b) {
  return floor_div(load_index(p.cu_seqlens_q, b), kM) + b;
}

// The varlen row tile t's sequence: the last b in [0, B) with tile_base(b) <= t (b = -1: none),
// and its rows [begin, end) of cu_seqlens_q. base(b) is non-decreasing, so the b with
// base(b) <= t are a prefix [0, c); the warp's lanes test 32 candidates per round (one
// coalesced load round for B <= 32, two for B <= 1056) where a binary search made log2(B) + 1
// dependent loads (H200, prefill_tma B = 32 S = 512: 192.8 -> 178.3 us, B = 128 S = 128: 153.6
// -> 135.1; the lookup had been ~1.2 us of a CTA's ~11 us). Warp-collective: every lane calls
// it with the same t.
struct TileSeq {
  int64_t b = -1, begin = 0, end = 0;
};
template <int kM>
FS_DEV TileSeq tile_sequence(const AttnParams& p, int64_t t) {
  const int lane = int(threadIdx.x % 32);
  int64_t lo = 0, n = p.batch;  // c lies in [lo, lo + n]
  while (n > 32) {              // lane i tests b = lo + (i + 1) step - 1
    const int64_t step = (n + 31) / 32, b = lo + (lane + 1) * step - 1;
    const int c = __popc(__ballot_sync(kFullMask, b < lo + n && tile_base<kM>(p, b) <= t));
    const int64_t left = n - c * step;
    lo += c * step;
    n = imin(step - 1, left);
  }
  // Last round: lane i reads cu_seqlens_q[lo + i] (i <= n, < 32) and tests b = lo + i (i < n).
  // Sequence b's start is lane c - 1's entry, its end lane c's (read apart when that lane did not:
  // c = 0 after a round, or c = 32).
  const int64_t at = lo + lane;
  const int64_t q = lane <= n ? load_index(p.cu_seqlens_q, at) : 0;
  const int c = __popc(__ballot_sync(kFullMask, lane < n && floor_div(q, kM) + at <= t));
  const int64_t q0 = __shfl_sync(kFullMask, q, imax(c - 1, 0)), q1 = __shfl_sync(kFullMask, q, imin(c, 31));
  TileSeq s;
  s.b = lo + c - 1;
  if (s.b < 0) return s;
  s.begin = c >= 1 ? q0 : load_index(p.cu_seqlens_q, s.b);
  s.end = c <= imin(n, 31) ? q1 : load_index(p.cu_seqlens_q, s.b + 1);
  return s;
}

// Row tile t: batched, tile t / B of sequence t % B (so descending t walks the latest tiles of
// every sequence first); varlen, tile_sequence over base(b) = cu_seqlens_q[b] / kM + b
// (non-decreasing; sequence b's tiles are base(b) .. base(b) + ceil(sq_b / kM) - 1), so
// correctness never depends on max_seqlen_q. Rows outside their sequence are never written.
// Warp-collective (varlen).
template <int kM>
FS_DEV CtaWork cta_work(const AttnParams& p, int64_t t) {
  CtaWork w;
  if (p.batched) {
    w.b = w.qb = t % p.batch;
    w.i0 = t / p.batch * kM;
    if (w.i0 >= p.q_rows) return w;
    w.sq = p.q_rows;
    w.row0 = w.b * p.q_rows + w.i0;
    w.q_row0 = w.i0;
  } else {
    const TileSeq s = tile_sequence<kM>(p, t);
    if (s.b < 0) return w;
    w.b = s.b;
    w.sq = s.end - s.begin;
    w.i0 = (t - (floor_div(s.begin, kM) + s.b)) * kM;
    w.row0 = w.q_row0 = s.begin + w.i0;
  }
  const int64_t rows = imin(imin(kM, w.sq - w.i0), p.total_rows() - w.row0);
  if (rows <= 0 || w.row0 < 0) return w;
  w.rows = int(rows);
  w.active = true;
  return w;
}

// The CTA of a (row tiles, heads, splits) grid: heads fastest, row tiles descending, so the
// longest causal tiles of every head start first. Sets h. Warp-collective (cta_work).
template <int kM>
FS_DEV CtaWork cta_of_block(const AttnParams& p, int64_t& h) {
  const int64_t linear = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  h = linear % gridDim.y;
  return cta_work<kM>(p, int64_t(gridDim.x) - 1 - linear / gridDim.y);
}

// Element offsets of KV token t (0 <= t < 2^31) of sequence kv.b in k and v; false when the
// metadata places it outside the cache.
FS_DEV bool token_offsets(const AttnParams& p, const SeqKv& kv, int64_t t, int64_t& k_off, int64_t& v_off) {
  int64_t d0, d1;
  if (p.paged) {
    const uint32_t bs = uint32_t(p.kv_dim1), col = uint32_t(t) / bs;
    if (col >= p.max_blocks) return false;
    d0 = load_index2(p.block_table, kv.b, col);
    d1 = uint32_t(t) - col * bs;
  } else {
    d0 = kv.kb;
    d1 = kv.k_begin + t;
  }
  if (d0 < 0 || d0 >= p.kv_dim0 || d1 < 0 || d1 >= p.kv_dim1) return false;
  k_off = d0 * p.k.stride[0] + d1 * p.k.stride[1] + kv.g * p.k.stride[2];
  v_off = d0 * p.v.stride[0] + d1 * p.v.stride[1] + kv.g * p.v.stride[2];
  return true;
}

// Item idx = kLanes step + lane of a walk over rows of kC 16-byte chunks: row idx / kC, chunk
// idx % kC. When kC divides kLanes the chunk is the lane's own in every step (lane % kC) and the
// row a constant stride on (kept so: the compiler does not know lane < kLanes).
template <int kC, int kLanes>
FS_DEV void walk_chunk(int step, int lane, int& row, int& c) {
  if constexpr (kLanes % kC == 0) {
    row = step * (kLanes / kC) + lane / kC;
    c = lane % kC;
  } else {
    const int idx = step * kLanes + lane;
    row = idx / kC;
    c = idx % kC;
  }
}

// Q [kM, D] of head h into shared memory (layout L); rows past the CTA's rows are zero-filled.
template <class S, class L, class T, int kD>
FS_DEV void load_q(const AttnParams& p, const CtaWork& w, int64_t h, uint32_t q_s) {
  constexpr int kChunks = kD / 8;
  static_assert(S::kM * kChunks % S::kThreads == 0, "whole passes");
  const T* q = static_cast<const T*>(p.q.data);
#pragma unroll
  for (int it = 0; it < S::kM * kChunks / S::kThreads; ++it) {
    int row, c;
    walk_chunk<kChunks, S::kThreads>(it, int(threadIdx.x), row, c);
    const bool valid = row < w.rows;
    const T* src = q + (valid ? w.qb * p.q.stride[0] + (w.q_row0 + row) * p.q.stride[1] + h * p.q.stride[2] + c * 8 : 0);
    cp_async_16(q_s + L::at(row, c), src, valid);
  }
}

// A 32-bit word of NaN keys of type T (f16, bf16, or fp8: 0x7f is NaN in e4m3 and e5m2).
template <class T>
FS_DEV constexpr uint32_t nan_word() {
  if constexpr (sizeof(T) == 1) return 0x7f7f7f7fu;
  else return std::is_same_v<T, __half> ? 0x7e007e00u : 0x7fc07fc0u;
}

// The copies of load_kv: rows of kC 16-byte chunks of K (kK) and/or V (kV) at the offsets the
// lanes located (k_off, v_off): step i of lane l copies chunk (32 i + l) % kC of warp row
// (32 i + l) / kC, whose offsets the lane locating it (src) gives by shuffle.
template <class S, class L, class T, int kC, bool kK, bool kV>
FS_DEV void copy_kv_rows(const AttnParams& p, int64_t k_off, int64_t v_off, uint32_t in_mask, uint32_t bad_mask,
                         uint32_t k_s, uint32_t v_s, int warp, int lane) {
  constexpr int kR = S::kN / S::kWarps;
  static_assert(kR * kC % 32 == 0, "whole copy steps per warp");
  const T* k = static_cast<const T*>(p.k.data);
  const T* v = static_cast<const T*>(p.v.data);
#pragma unroll
  for (int i = 0; i < kR * kC / 32; ++i) {
    int src, c;
    walk_chunk<kC, 32>(i, lane, src, c);
    const uint32_t at = L::at(kR * warp + src, c);
    const int64_t ko = kK ? __shfl_sync(kFullMask, k_off, src) : 0, vo = kV ? __shfl_sync(kFullMask, v_off, src) : 0;
    if ((bad_mask >> src) & 1u) {  // outside the cache: NaN keys, zero values
      if (kK) st_shared_v4(k_s + at, nan_word<T>(), nan_word<T>(), nan_word<T>(), nan_word<T>());
      if (kV) st_shared_v4(v_s + at, 0u, 0u, 0u, 0u);
      continue;
    }
    const bool in_range = (in_mask >> src) & 1u;  // offsets 0 when not: an in-bounds address, nothing read
    if (kK) cp_async_16(k_s + at, k + ko + c * 8, in_range);
    if (kV) cp_async_16(v_s + at, v + vo + c * 8, in_range);
  }
}

// KV tokens [n0, n0 + kN) into one stage (layout L; K rows kD wide, V rows kDv): tokens >=
// kv_end zero-filled; tokens outside the cache NaN keys and zero values (plain stores; visible
// after the same barrier). Warp w copies rows [R w, R w + R), R = kN / kWarps: lane l locates row
// R w + l % R once (token_offsets: 64-bit products, a block-table load), and each copy step
// takes its rows' offsets by shuffle, so a row is located once per tile instead of once per
// 16-byte chunk.
template <class S, class L, class T, int kD, int kDv = kD>
FS_DEV void load_kv(const AttnParams& p, const SeqKv& kv, int64_t n0, int64_t kv_end, uint32_t k_s, uint32_t v_s) {
  constexpr int kR = S::kN / S::kWarps;
  static_assert(S::kN % S::kWarps == 0 && kR <= 32, "a warp copies whole rows, located by its lanes");
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  int64_t k_off = 0, v_off = 0;
  const int my_row = kR * warp + lane % kR;
  const bool my_in = n0 + my_row < kv_end;
  const bool my_bad = my_in && !token_offsets(p, kv, n0 + my_row, k_off, v_off);
  const uint32_t in_mask = __ballot_sync(kFullMask, my_in), bad_mask = __ballot_sync(kFullMask, my_bad);
  if constexpr (kD == kDv) {  // K and V rows together
    copy_kv_rows<S, L, T, kD / 8, true, true>(p, k_off, v_off, in_mask, bad_mask, k_s, v_s, warp, lane);
  } else {
    copy_kv_rows<S, L, T, kD / 8, true, false>(p, k_off, v_off, in_mask, bad_mask, k_s, v_s, warp, lane);
    copy_kv_rows<S, L, T, kDv / 8, false, true>(p, k_off, v_off, in_mask, bad_mask, k_s, v_s, warp, lane);
  }
}

// tanh on the MUFU pipe (MUFU.TANH, sm_75+; what FlashAttention's soft-cap uses): one op where
// tanhf takes two (ex2, rcp) and a polynomial branch. PTX ISA: relative error at most 2^-11 over
// the whole range, subnormals pass through, +-inf -> +-1, NaN stays NaN.
FS_DEV float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

FS_DEV float sqrt_approx(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The units of a score tile s before the online softmax, chosen so that a plain or soft-capped
// score costs as little as possible: `exp_mul` turns s into log2 units inside the exponent's FFMA,
// exp2(s exp_mul - m exp_mul), and m holds the running max in s's units (the max commutes with a
// positive multiplier):
//   scale > 0, no soft-cap:   s = dot                            exp_mul = scale log2(e)
//   soft-cap (any scale):     s = tanh(dot scale / softcap)      exp_mul = softcap log2(e)
//   scale <= 0 or NaN, no cap: s = dot scale log2(e)             exp_mul = 1
// so a soft-capped score costs one FMUL and one MUFU.TANH more than a plain one (the last case,
// whose max would not commute with the scale, is mapped to log2 units first: `prescale`). `unit`
// is one unit of s in natural-log units, what the ALiBi bias (added after the cap, SPEC.md §2) is
// divided by.
struct ScoreLog2 {
  float exp_mul = 1.0f;
  float unit = 1.0f;
  float mul = 1.0f;  // prescaled: s = dot mul, or tanh(dot mul) with the soft-cap
  bool prescale = false, softcap = false;
  // qk_descale: the fp8 operands' q_descale x k_descale, a factor of the scale.
  FS_DEV explicit ScoreLog2(const AttnParams& p, float qk_descale = 1.0f) {
    const float scale = p.softmax_scale * qk_descale;
    softcap = p.softcap > 0.0f;
    prescale = softcap || !(scale > 0.0f);
    if (softcap) {
      mul = scale / p.softcap;
      unit = p.softcap;
      exp_mul = p.softcap * kLog2e;
    } else if (prescale) {
      mul = scale * kLog2e;
      unit = kLn2;
    } else {
      unit = scale;
      exp_mul = scale * kLog2e;
    }
  }
};

// The score modifiers of the tensor-core prefill kernels, applied to a thread's part of a score
// tile in s's units (ScoreLog2) before the mask and the online softmax. A kernel takes one as a
// compile-time choice (its instantiation), so the plain kernel carries none of the modifiers'
// code: NoBias is empty.
struct NoBias {
  template <int kN>
  FS_DEV void operator()(float (&)[kN / 8][4], float) const {}
};

// ALiBi (SPEC.md §2 step 3): s -= slope_h |i' - j| (slopes [H] or [B, H]), or slope_h
// sqrt(|i' - j|) with alibi_sqrt (a uniform whole-tile branch). The thread's distance at
// element (nt, e) is d0 + 8 (e >> 1) - 8 nt - (e & 1), d0 = i' of its row g minus the key of its
// column 2t in the tile (exact in fp32 below 2^24 positions), so the linear bias is one FADD and
// one FFMA per score; row g + 8 at column block nt has row g's distance at nt - 1, so the sqrt
// variant takes kN / 4 + 2 square roots (MUFU) for the thread's kN / 2 scores.
struct AlibiBias {
  float mul = 0.0f;  // -slope in s's units (ScoreLog2::unit)
  bool sqrt_dist = false;
  FS_DEV AlibiBias(const AttnParams& p, int64_t b, int64_t h, const ScoreLog2& score) {
    const float slope = load_f32_2d(p.alibi, b, h, 0.0f);
    mul = -slope / score.unit;
    sqrt_dist = p.alibi_sqrt;
  }
  template <int kN>
  FS_DEV void operator()(float (&s)[kN / 8][4], float d0) const {
    if (sqrt_dist) {
      float prev0 = sqrt_approx(fabsf(d0 + 8.0f)), prev1 = sqrt_approx(fabsf(d0 + 7.0f));
#pragma unroll
      for (int nt = 0; nt < kN / 8; ++nt) {
        const float c0 = sqrt_approx(fabsf(d0 - float(8 * nt))), c1 = sqrt_approx(fabsf(d0 - float(8 * nt + 1)));
        s[nt][0] = fmaf(c0, mul, s[nt][0]);
        s[nt][1] = fmaf(c1, mul, s[nt][1]);
        s[nt][2] = fmaf(prev0, mul, s[nt][2]);
        s[nt][3] = fmaf(prev1, mul, s[nt][3]);
        prev0 = c0;
        prev1 = c1;
      }
      return;
    }
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = fmaf(fabsf(d0 - float(8 * nt - 8 * (e >> 1) + (e & 1))), mul, s[nt][e]);
  }
};

// The bias functor of a kernel instantiation.
template <bool kAlibi>
using ScoreBias = std::conditional_t<kAlibi, AlibiBias, NoBias>;

template <bool kAlibi>
FS_DEV ScoreBias<kAlibi> make_score_bias(const AttnParams& p, int64_t b, int64_t h, const ScoreLog2& score) {
  if constexpr (kAlibi) return AlibiBias(p, b, h, score);
  else return NoBias{};
}

// Online softmax over one kN-key tile for one 16-row block, the thread's rows r = 0 (s[.][0..1])
// and 1 (s[.][2..3]) with visible keys [lo[r], hi[r]) relative to the tile start (applied when
// `masked`), after the score bias (ALiBi; d0 as AlibiBias takes it): s becomes exp2(score - max), m and l (per-thread partial sums) move on, and
// alpha[r] receives the factor the row's output accumulator must be scaled by (rescale_o)
// before this tile's P V is added. Soft-cap and masking are whole-tile branches, so the plain
// tile is straight-line code. p_shift (log2 units) scales every p and l by 2^p_shift (fp8 P:
// the row's max at 2^8 uses e4m3's range; store_rows takes it back out of the lse).
// lazy (log2 units, FlashAttention-4's lazy rescaling): a row keeps its running max m as the
// reference while the tile's max exceeds it by at most 2^lazy, so its alpha is exactly 1 and
// rescale_o skips the warp's O multiplies once no row of it moved (with exact maxima, a row's
// max still grows on a good share of the tiles of a long row: at tile j about 1 / (j + 1) per
// row, 16 rows per warp). p is then at most 2^(p_shift + lazy) and l sums against the same
// reference, so out = O / l and the LSE (from m and l) are unchanged in value; -inf and NaN
// maxima always update, as before.
template <int kN, class Bias = NoBias>
FS_DEV void softmax_scores(float (&s)[kN / 8][4], float (&m)[2], float (&l)[2],
                           float (&alpha)[2], const ScoreLog2& score, const int (&lo)[2], const int (&hi)[2],
                           bool masked, int t, const Bias& bias = {}, float bias_d0 = 0.0f, float p_shift = 0.0f,
                           float lazy = 0.0f) {
  if (score.softcap) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = tanh_approx(s[nt][e] * score.mul);
  } else if (score.prescale) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= score.mul;
  }
  bias.template operator()<kN>(s, bias_d0);
  if (masked) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rel = 8 * nt + 2 * t + (e & 1), r = e >> 1;
        if (rel < lo[r] || rel >= hi[r]) s[nt][e] = kNegInf;
      }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // A tree, not a chain: log2(kN / 8) dependent steps instead of kN / 8 (the max sits on the
    // warpgroup's critical path between its S and its exponentials).
    float t[kN / 8];
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) t[nt] = fmaxf(s[nt][2 * r], s[nt][2 * r + 1]);
#pragma unroll
    for (int w = kN / 16; w >= 1; w /= 2)  // (the loop's bound is kN >= 16 x 2^k: fully unrolled)
#pragma unroll
      for (int i = 0; i < kN / 16; ++i)
        if (i < w) t[i] = fmaxf(t[i], t[i + w]);
    float mx = t[0];
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    // m = -inf or a NaN max: false; lazy = 0 (a constant): the exact max, no comparison left.
    const bool keep = lazy > 0.0f && (mx - m[r]) * score.exp_mul <= lazy;
    const float m_new = keep ? m[r] : fmaxf(m[r], mx);
    const float m_use = m_new == kNegInf ? 0.0f : m_new * score.exp_mul;  // all -inf so far: p = 0, no NaN
    alpha[r] = fast_exp2(m[r] * score.exp_mul - m_use);
    m[r] = m_new;
    const float m_p = m_use - p_shift;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
      s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], score.exp_mul, -m_p));
      s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], score.exp_mul, -m_p));
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    l[r] = l[r] * alpha[r] + sum;
  }
}

// o (the thread's rows r = 0, 1 of a 16-row block) *= alpha[r]. Once the running maxima settle
// (most tiles of a long row), no row of the warp moves: the 2 x D / 4 multiplies are skipped
// (alpha is exactly 1 when m is unchanged).
template <int kD>
FS_DEV void rescale_o(float (&o)[kD / 8][4], const float (&alpha)[2]) {
  if (!__any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) return;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      o[dt][2 * r] *= alpha[r];
      o[dt][2 * r + 1] *= alpha[r];
    }
}

// Tile row of the thread's row r of row block mb (warp `warp`, g = lane / 4).
template <class S>
FS_DEV int thread_row(int warp, int mb, int r, int g) {
  return S::kWarpRows * warp + 16 * mb + 8 * r + g;
}

// out = o / l and lse (natural log; m in units of exp_mul / ln 2) of the thread's valid rows
// (o kDo channels wide, the first kDv of them stored),
// the sink (SPEC.md §2.5) merged into both; with splits the fp32 partials, without the sink
// (combine.cu applies it once). An out of q's dtype T (rows 16-byte aligned: select.cu) is
// staged in the warp's own Q rows of shared memory (layout L; the caller makes sure no MMA
// still reads them) and written in 16-byte chunks; an fp32 out (TOut = float) is written from
// registers in 8-byte pairs, and so is a 16-bit one in 4-byte pairs when kDirect (the persistent
// kernel: its next item's Q may be landing in those rows). o_mul (fp8 V's descale) multiplies
// out; p_shift is softmax_scores' (l holds 2^p_shift times the weights' sum).
template <class S, class L, class T, int kDo, int kDv = kDo, class TOut = T, bool kDirect = false>
FS_DEV void store_rows(const AttnParams& p, const CtaWork& w, int64_t h, int split, const float (&o)[S::kMB][kDo / 8][4],
                       const float (&m)[S::kMB][2], float (&l)[S::kMB][2], float exp_mul, uint32_t q_s, int warp,
                       int lane, float o_mul = 1.0f, float p_shift = 0.0f) {
  constexpr int kChunks = kDv / 8;
  static_assert(kDv <= kDo && S::kWarpRows * kChunks % 32 == 0, "whole 16-byte chunks of the stored channels");
  const int g = lane >> 2, t = lane & 3;
  float inv[S::kMB][2];
#pragma unroll
  for (int mb = 0; mb < S::kMB; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mb][r] += __shfl_xor_sync(kFullMask, l[mb][r], 1);
      l[mb][r] += __shfl_xor_sync(kFullMask, l[mb][r], 2);
      const bool empty = l[mb][r] == 0.0f;
      inv[mb][r] = empty ? 0.0f : o_mul / l[mb][r];
      const int i = thread_row<S>(warp, mb, r, g);
      if (i >= w.rows) continue;
      float lse = empty ? kNegInf : (m[mb][r] * exp_mul - p_shift) * kLn2 + logf(l[mb][r]);
      if (p.num_splits > 1) {  // the partial without the sink: the combine merges it once
        const int64_t at = partial_index(p, split, w.row0 + i, h);
#pragma unroll
        for (int dt = 0; dt < kDv / 8; ++dt) {  // 4-byte stores: the workspace may be only 4-byte aligned
          p.o_partial[at * kDv + 8 * dt + 2 * t] = o[mb][dt][2 * r] * inv[mb][r];
          p.o_partial[at * kDv + 8 * dt + 2 * t + 1] = o[mb][dt][2 * r + 1] * inv[mb][r];
        }
        if (t == 0) p.lse_partial[at] = lse;
        continue;
      }
      inv[mb][r] *= apply_sink(p, h, lse);  // the sink's logit joins the denominator (and lse)
      if (t == 0) store_lse(p, w.qb, w.q_row0 + i, h, lse);
      if constexpr (std::is_same_v<TOut, float>) {
        float* out = static_cast<float*>(const_cast<void*>(p.out.data)) + w.qb * p.out.stride[0] +
                     (w.q_row0 + i) * p.out.stride[1] + h * p.out.stride[2];
#pragma unroll
        for (int dt = 0; dt < kDv / 8; ++dt)
          *reinterpret_cast<float2*>(out + 8 * dt + 2 * t) =
              make_float2(o[mb][dt][2 * r] * inv[mb][r], o[mb][dt][2 * r + 1] * inv[mb][r]);
      } else if constexpr (kDirect) {
        T* out = static_cast<T*>(const_cast<void*>(p.out.data)) + w.qb * p.out.stride[0] +
                 (w.q_row0 + i) * p.out.stride[1] + h * p.out.stride[2];
#pragma unroll
        for (int dt = 0; dt < kDv / 8; ++dt)
          *reinterpret_cast<uint32_t*>(out + 8 * dt + 2 * t) =
              pack2<T>(o[mb][dt][2 * r] * inv[mb][r], o[mb][dt][2 * r + 1] * inv[mb][r]);
      }
    }
  if (p.num_splits > 1 || std::is_same_v<TOut, float> || kDirect) return;
  __syncwarp();  // the warp's last reads of its Q rows precede the overwrite
#pragma unroll
  for (int mb = 0; mb < S::kMB; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = thread_row<S>(warp, mb, r, g);
#pragma unroll
      for (int dt = 0; dt < kDv / 8; ++dt) {
        const uint32_t x = pack2<T>(o[mb][dt][2 * r] * inv[mb][r], o[mb][dt][2 * r + 1] * inv[mb][r]);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(q_s + L::at(row, dt) + 4u * t), "r"(x) : "memory");
      }
    }
  __syncwarp();
  T* out = static_cast<T*>(const_cast<void*>(p.out.data)) + w.qb * p.out.stride[0] + h * p.out.stride[2];
#pragma unroll
  for (int it = 0; it < S::kWarpRows * kChunks / 32; ++it) {
    const int idx = 32 * it + lane, i = S::kWarpRows * warp + idx / kChunks, c = idx % kChunks;
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(q_s + L::at(i, c))
                 : "memory");
    if (i < w.rows) *reinterpret_cast<uint4*>(out + (w.q_row0 + i) * p.out.stride[1] + 8 * c) = x;
  }
}

// Visible local keys of tile row i: visibility (masks.cuh) within the split's range, bounded
// to the tokens the metadata can place in the cache (generic_fwd.cuh). lo and hi are
// non-decreasing in i, so a group's first and last rows bound the group's keys. Under context
// parallelism positions are global (the sequence's global KV length aligns them) and the
// visible global keys map to this rank's local ones (Visibility).
struct RowKeys {
  Visibility vis;
  KvRange range;
  KeyRange cache;
  int64_t pos0;       // aligned global position of tile row 0: i0 + sk_global - sq
  int64_t sk_global;  // the sequence's global KV length (= the local one without CP)
  FS_DEV KeyRange operator()(int64_t i) const {
    const KeyRange k = vis(pos0 + i, sk_global);
    return generic::bound_to_cache({imax(k.lo, range.begin), imin(k.hi, range.end)}, cache);
  }
};

// The keys a CTA walks: tiles of kN from n_begin (aligned to the split's range start) up to the
// last row's last visible key.
struct CtaKeys {
  RowKeys rows;
  int64_t n_begin = 0, end = 0;
  int tiles = 0;
};

template <int kN>
FS_DEV CtaKeys cta_keys(const AttnParams& p, const CtaWork& w, const SeqKv& kv, int split) {
  const int64_t sk = kv_len(p, w.b), sk_global = kv_len_global(p, w.b, sk);
  CtaKeys c{{make_visibility(p), split_kv_range(sk, p.num_splits, split, p.split_granularity),
             generic::cache_tokens(p, kv), w.i0 + sk_global - w.sq, sk_global}};
  const KeyRange first = c.rows(0), last = c.rows(w.rows - 1);
  c.n_begin = c.rows.range.begin + floor_div(first.lo - c.rows.range.begin, kN) * kN;
  c.end = last.hi;
  c.tiles = first.lo < last.hi ? int((last.hi - c.n_begin + kN - 1) / kN) : 0;
  return c;
}

// A key offset relative to the CTA's first tile, clamped to [0, INT_MAX]. A CTA's keys lie
// within its sequence's cache span plus one tile (generic::bound_to_cache), which select.cu
// keeps under 2^31 - 4 * kN keys: offsets, tile starts j * kN and j * kN + kN fit in int.
FS_DEV int rel32(int64_t x) { return int(imin(imax(x, 0), INT_MAX)); }
template <int kN>
FS_DEV int clamp_tile(int x) { return x < 0 ? 0 : (x > kN ? kN : x); }

// Key ranges relative to the CTA's first tile: each of the thread's rows (kept in shared memory,
// `rows_s` [kM] int2, read only on masked tiles: registers are the kernels' limit), and the
// union (any) and intersection (all) of the keys of the thread's row group (S::kGroupRows
// rows), which decide per tile whether the group skips it, masks it, or takes it whole.
template <class S>
struct WarpKeys {
  int2* rows_s;
  int any_lo, any_hi, all_lo, all_hi;
  FS_DEV WarpKeys(const RowKeys& keys, int64_t n_begin, int rows, int warp, int lane, int2* rows_smem)
      : rows_s(rows_smem) {
#pragma unroll
    for (int mb = 0; mb < S::kMB; ++mb)
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // the lanes of one row write the same pair; each reads its own
        const int i = thread_row<S>(warp, mb, r, lane >> 2);
        const KeyRange k = keys(i);
        rows_s[i] = make_int2(rel32(k.lo - n_begin), rel32(k.hi - n_begin));
      }
    const int first = S::kGroupRows * (S::kWarpRows * warp / S::kGroupRows);
    const int last = int(imin(first + S::kGroupRows, rows)) - 1;
    any_lo = any_hi = all_lo = all_hi = 0;  // no valid row: the group skips every tile
    if (last < first) return;
    const KeyRange a = keys(first), b = keys(last);
    any_lo = rel32(a.lo - n_begin), any_hi = rel32(b.hi - n_begin);
    all_lo = rel32(b.lo - n_begin), all_hi = rel32(a.hi - n_begin);
  }
  // Whether no row of the group sees the tile at `off`, and whether some row sees only part.
  FS_DEV bool skips(int off) const { return off >= any_hi || off + S::kN <= any_lo; }
  FS_DEV bool masks(int off) const { return off < all_lo || off + S::kN > all_hi; }
  // Visible keys [lo, hi) of the thread's rows of row block mb, relative to the tile at `off`.
  FS_DEV void tile_rows(int mb, int off, int warp, int lane, int (&lo)[2], int (&hi)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int2 k = rows_s[thread_row<S>(warp, mb, r, lane >> 2)];
      lo[r] = clamp_tile<S::kN>(k.x - off);
      hi[r] = clamp_tile<S::kN>(k.y - off);
    }
  }
};

// d0 of the score bias (AlibiBias) for the thread's row g of row block mb at the CTA's first
// tile: i' of the row minus the key of its column 2t; the tile at offset `off` takes d0 - off.
// Keys one apart are one position apart: no context parallelism (select.cu keeps ALiBi with it
// on the generic kernel).
template <class S>
FS_DEV int64_t bias_d0(const CtaKeys& ck, int warp, int mb, int lane) {
  return ck.rows.pos0 + thread_row<S>(warp, mb, 0, lane >> 2) - ck.n_begin - 2 * (lane & 3);
}

}  // namespace flashserve::kernels::prefill
