// The tensor-core prefill kernel: FlashAttention-2 structure on mma.sync m16n8k16 (sm80+).
// Serves f16/bf16 q/k/v (one dtype), D == Dv in kPrefillConfigs, causal / window / soft-cap,
// contiguous or paged KV (any block size: every KV row is located on its own), GQA and any
// split count; select.cu declines everything else (the generic kernel serves it).
//
// CTA: 128 query rows of one sequence x one query head x one KV split; 4 warps, 32 rows (two
// m16 row blocks) each; 2 CTAs per SM. grid = (total_q / 128 + B + 1 (varlen) |
// B * ceil(sq / 128) (batched), H, num_splits), walked heads-fastest and heaviest (latest,
// longest causal) row tiles first. A varlen CTA finds its sequence by a binary search over
// base(b) = cu_seqlens_q[b] / 128 + b (non-decreasing; sequence b's tiles are base(b) ..
// base(b) + ceil(sq_b / 128) - 1), so correctness never depends on max_seqlen_q. Rows outside
// their sequence are never written.
//
// Per CTA: Q [128, D] -> shared (cp.async), read per tile into A fragments (ldmatrix); KV
// tiles of 64 keys, K and V double-buffered in shared memory with cp.async, one barrier per
// tile: it publishes tile j and frees the stage of tile j - 1, which then receives tile j + 1
// while tile j is computed. Per tile each warp computes S = Q K^T (fp32), applies scale (log2
// units), soft-cap and the mask (only on tiles that are not fully visible to the warp's rows;
// tiles no row of the warp sees are skipped), the online softmax in registers, and O += P V
// with P rounded to the operand dtype. The output goes through the warp's own Q rows in shared
// memory for 16-byte stores. KV rows past the CTA's last visible key are zero-filled; rows
// whose metadata points outside the cache get NaN keys and zero values, so exactly the query
// rows that see them come out NaN (load.cuh), never an out-of-bounds read.
//
// Arithmetic per 64-key tile (D = 128; H100/H200 SM: 4096 dense bf16 FLOP/clk (990 TFLOP/s),
// mma.sync about 2/3 of it; shared memory 128 B/clk):
//   one m16n8k16 = 4096 FLOP. Per warp of 16 rows: QK^T 16x64x128 = 1*8*8 = 64 mma, PV
//   16x128x64 = 1*16*4 = 64 mma. A CTA of 128 rows: 4.19 MFLOP = 1024 clk at the dense rate,
//   ~1536 clk on mma.sync.
//   ldmatrix bytes: every warp reads the whole K and V tile (2 x 16 KB), whatever its rows.
//     8 warps x 16 rows, Q in registers: 8 x 32 KB = 256 KB = 2048 clk > 1536 clk of mma:
//       bound by shared memory at 2048 FLOP/clk/SM (~50% of dense peak); with one 8-warp CTA
//       per SM and two barriers per tile the softmax phases of all warps align and the
//       tensor pipe idles (measured 164 TFLOP/s at S = 8k).
//     4 warps x 32 rows (this kernel), Q re-read from shared per tile (8 KB per warp): 4 x
//       (8 + 32) KB = 160 KB = 1280 clk < 1536 clk: mma-bound; two CTAs per SM overlap one's
//       softmax and barrier with the other's mma (FA2's shape on sm80/sm90).
//   Registers per thread: O 2 x 64 + S 2 x 32 fp32 = 192, fragments 12, masks, state.
#pragma once

#include <climits>
#include <cstdint>

#include "flashserve/plan.hpp"
#include "kernels/attention/generic_fwd.cuh"
#include "kernels/common/mma.cuh"

namespace flashserve::kernels::prefill {

constexpr int kM = kPrefillRowsPerCta;  // query rows per CTA
constexpr int kN = kPrefillTileKeys;    // keys per KV tile
constexpr int kWarps = kPrefillWarps;
constexpr int kThreads = kPrefillThreads;
constexpr int kWarpRows = kM / kWarps;   // query rows per warp
constexpr int kMB = kWarpRows / 16;      // m16 row blocks per warp
static_assert(kWarpRows % 16 == 0 && kThreads == 32 * kWarps, "whole m16 row blocks per warp");
static_assert(kN == 64, "the softmax and PV loops assume 8 n8 tiles per KV tile");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared memory [Q | K stage 0 | K stage 1 | V stage 0 | V stage 1], each tile row-major in
// 16-byte chunks; chunk c of row r is stored at chunk c ^ (r % 8), so the 8 rows an ldmatrix
// reads (and cp.async writes) hit 8 distinct bank groups. Byte offsets.
template <int kD>
struct Smem {
  static constexpr int kChunks = kD / 8;
  static_assert(kChunks >= 8, "the swizzle needs D >= 64");
  static constexpr uint32_t kRowBytes = kD * 2, kQBytes = kM * kRowBytes, kTileBytes = kN * kRowBytes;
  static constexpr uint32_t kBytes = kQBytes + 4 * kTileBytes;  // then the rows' key ranges
  uint32_t q;
  FS_DEV explicit Smem(const void* base) : q(smem_u32(base)) {}
  // Stage j % 2 (arithmetic, not an indexed array: that would live in local memory).
  FS_DEV uint32_t k(int j) const { return q + kQBytes + uint32_t(j & 1) * kTileBytes; }
  FS_DEV uint32_t v(int j) const { return q + kQBytes + uint32_t(2 + (j & 1)) * kTileBytes; }
  static FS_DEV uint32_t at(int row, int chunk) { return uint32_t(row * kChunks + (chunk ^ (row & 7))) * 16u; }
};

// ldmatrix addressing of one lane: lane l gives row l % 8 of 8x8 matrix l / 8. Every row a
// lane addresses has row % 8 == l % 8, so chunk c of it lies at row * kRowBytes + (16 c ^ x)
// with the lane's x = 16 (chunk parity ^ l % 8). A fragments of Q and the transposed B
// fragments of V take rows (l / 8 % 2) * 8 + l % 8, parity l / 16 (Q: of the warp's rows);
// B fragments of K (two n8 tiles) keys (l / 16) * 8 + l % 8, parity l / 8 % 2.
// Rows are kRowBytes-aligned (a power of two; the shared window starts aligned) and the
// in-row offset 16 c ^ x stays below kRowBytes, so row + (16 c ^ x) == (row + x) ^ 16 c: the
// lane keeps row + x, and each k-step's address is one XOR with a constant, the row block or
// tile row added as an immediate.
template <int kD>
struct LaneAddr {
  uint32_t q;   // shared address of the lane's row in the warp's Q rows, plus its x
  uint32_t k;   // byte offset of the lane's K row in a stage, plus its x
  uint32_t v;   // byte offset of the lane's V row in a stage, plus its x
  FS_DEV LaneAddr(uint32_t q_s, int warp, int lane) {
    constexpr uint32_t rb = Smem<kD>::kRowBytes;
    static_assert((rb & (rb - 1)) == 0 && 16 * (kD / 8) == int(rb), "rows of a power-of-two size");
    const uint32_t r8 = uint32_t(lane & 7), hi = uint32_t(lane >> 4), mid = uint32_t(lane >> 3) & 1u;
    v = (r8 + 8 * mid) * rb + ((hi ^ r8) << 4);
    k = (r8 + 8 * hi) * rb + ((mid ^ r8) << 4);
    q = q_s + uint32_t(kWarpRows * warp) * rb + v;
  }
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

FS_DEV int64_t tile_base(const AttnParams& p, int64_t b) { return floor_div(load_index(p.cu_seqlens_q, b), kM) + b; }

// Row tile t: batched, tile t / B of sequence t % B (so descending t walks the latest tiles of
// every sequence first); varlen, by the search over base(b).
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
    int64_t lo = 0, hi = p.batch;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (tile_base(p, mid) <= t) lo = mid + 1;
      else hi = mid;
    }
    if (lo == 0) return w;
    w.b = lo - 1;
    const int64_t begin = load_index(p.cu_seqlens_q, w.b);
    w.sq = load_index(p.cu_seqlens_q, w.b + 1) - begin;
    w.i0 = (t - tile_base(p, w.b)) * kM;
    w.row0 = w.q_row0 = begin + w.i0;
  }
  const int64_t rows = imin(imin(kM, w.sq - w.i0), p.total_rows() - w.row0);
  if (rows <= 0 || w.row0 < 0) return w;
  w.rows = int(rows);
  w.active = true;
  return w;
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

// Q [128, D] of head h into shared memory; rows past the CTA's rows are zero-filled.
template <class T, int kD>
FS_DEV void load_q(const AttnParams& p, const CtaWork& w, int64_t h, uint32_t q_s) {
  constexpr int kChunks = kD / 8, kRowsPerPass = kThreads / kChunks;
  const int c = int(threadIdx.x) % kChunks;
  const T* q = static_cast<const T*>(p.q.data);
#pragma unroll
  for (int row = int(threadIdx.x) / kChunks; row < kM; row += kRowsPerPass) {
    const bool valid = row < w.rows;
    const T* src = q + (valid ? w.qb * p.q.stride[0] + (w.q_row0 + row) * p.q.stride[1] + h * p.q.stride[2] + c * 8 : 0);
    cp_async_16(q_s + Smem<kD>::at(row, c), src, valid);
  }
}

// KV tokens [n0, n0 + 64) into one stage: tokens >= kv_end zero-filled; tokens outside the
// cache NaN keys and zero values (plain stores; visible after the same barrier). Warp w copies
// rows [16 w, 16 w + 16): lane l locates row 16 w + l % 16 once (token_offsets: 64-bit
// products, a block-table load), and each copy step takes its rows' offsets by shuffle, so
// a row is located once per tile instead of once per 16-byte chunk.
template <class T, int kD>
FS_DEV void load_kv(const AttnParams& p, const SeqKv& kv, int64_t n0, int64_t kv_end, uint32_t k_s, uint32_t v_s) {
  constexpr int kChunks = kD / 8, kRowsPerStep = 32 / kChunks;
  static_assert(kN == 16 * kWarps && kChunks <= 32, "a warp copies 16 whole rows");
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, c = lane % kChunks;
  const T* k = static_cast<const T*>(p.k.data);
  const T* v = static_cast<const T*>(p.v.data);
  int64_t k_off = 0, v_off = 0;
  const int my_row = 16 * warp + lane % 16;
  const bool my_in = n0 + my_row < kv_end;
  const bool my_bad = my_in && !token_offsets(p, kv, n0 + my_row, k_off, v_off);
  const uint32_t in_mask = __ballot_sync(kFullMask, my_in), bad_mask = __ballot_sync(kFullMask, my_bad);
#pragma unroll
  for (int i = 0; i < 16 / kRowsPerStep; ++i) {
    const int src = i * kRowsPerStep + lane / kChunks, row = 16 * warp + src;
    const uint32_t at = Smem<kD>::at(row, c);
    const int64_t ko = __shfl_sync(kFullMask, k_off, src), vo = __shfl_sync(kFullMask, v_off, src);
    if ((bad_mask >> src) & 1u) {
      const uint32_t nan2 = std::is_same_v<T, __half> ? 0x7e007e00u : 0x7fc07fc0u;
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(k_s + at), "r"(nan2) : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(v_s + at), "r"(0u) : "memory");
      continue;
    }
    const bool in_range = (in_mask >> src) & 1u;  // offsets 0 when not: an in-bounds address, nothing read
    cp_async_16(k_s + at, k + ko + c * 8, in_range);
    cp_async_16(v_s + at, v + vo + c * 8, in_range);
  }
}

// S [32, 64] of this warp = Q K^T over D: per 16 channels, A fragments of both row blocks
// (ldmatrix of the warp's Q rows) and B fragments of two n8 tiles per ldmatrix of K rows, each
// B fragment feeding both row blocks.
template <class T, int kD>
FS_DEV void qk_tile(uint32_t k_s, const LaneAddr<kD>& la, float (&s)[kMB][kN / 8][4]) {
  constexpr uint32_t rb = Smem<kD>::kRowBytes;
  const uint32_t k_row = k_s + la.k;
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) s[mb][nt][0] = s[mb][nt][1] = s[mb][nt][2] = s[mb][nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[kMB][4];
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) ldmatrix_x4(a[mb], (la.q ^ (32u * kk)) + 16 * mb * rb);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, (k_row ^ (32u * kk)) + 16 * np * rb);
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb) {
        mma_16816<T>(s[mb][2 * np], a[mb], b[0], b[1]);
        mma_16816<T>(s[mb][2 * np + 1], a[mb], b[2], b[3]);
      }
    }
  }
}

// O [32, D] += P V with P = s (probabilities) as A fragments; V B fragments by ldmatrix.trans,
// each feeding both row blocks.
template <class T, int kD>
FS_DEV void pv_tile(const float (&s)[kMB][kN / 8][4], uint32_t v_s, const LaneAddr<kD>& la,
                    float (&o)[kMB][kD / 8][4]) {
  constexpr uint32_t rb = Smem<kD>::kRowBytes;
  const uint32_t v_row = v_s + la.v;
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    uint32_t a[kMB][4];
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      a[mb][0] = pack2<T>(s[mb][2 * kk][0], s[mb][2 * kk][1]);
      a[mb][1] = pack2<T>(s[mb][2 * kk][2], s[mb][2 * kk][3]);
      a[mb][2] = pack2<T>(s[mb][2 * kk + 1][0], s[mb][2 * kk + 1][1]);
      a[mb][3] = pack2<T>(s[mb][2 * kk + 1][2], s[mb][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, (v_row ^ (32u * dp)) + 16 * kk * rb);
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb) {
        mma_16816<T>(o[mb][2 * dp], a[mb], b[0], b[1]);
        mma_16816<T>(o[mb][2 * dp + 1], a[mb], b[2], b[3]);
      }
    }
  }
}

// Scores in log2 units: dot * scale * log2(e), or softcap * tanh(dot * scale / softcap) * log2(e).
// With a positive scale and no soft-cap, s stays the raw dot (the tile max commutes with the
// scale) and `exp_mul` folds the scale into the exponent's FFMA; otherwise the tile is mapped
// to log2 units first and exp_mul = 1. m holds the running max in s's units.
struct ScoreLog2 {
  float exp_mul = 1.0f;
  bool prescale = false;
  FS_DEV explicit ScoreLog2(const AttnParams& p) {
    prescale = p.softcap > 0.0f || !(p.softmax_scale > 0.0f);
    exp_mul = prescale ? 1.0f : p.softmax_scale * kLog2e;
  }
  // s in log2 units (the prescale branch; reads the scale from the parameters).
  static FS_DEV float log2_units(const AttnParams& p, float dot) {
    if (p.softcap > 0.0f) return tanhf(dot * (p.softmax_scale / p.softcap)) * (p.softcap * kLog2e);
    return dot * (p.softmax_scale * kLog2e);
  }
};

// Online softmax over one tile for one row block, the thread's rows r = 0 (s[.][0..1]) and
// 1 (s[.][2..3]) with visible keys [lo[r], hi[r]) relative to the tile start (applied when
// `masked`): s becomes exp2(score - max), l (per-thread partial sums) and o are rescaled.
// Soft-cap and masking are whole-tile branches, so the plain tile is straight-line code.
template <int kD>
FS_DEV void softmax_block(const AttnParams& p, float (&s)[kN / 8][4], float (&o)[kD / 8][4], float (&m)[2],
                          float (&l)[2], const ScoreLog2& score, const int (&lo)[2], const int (&hi)[2], bool masked, int t) {
  if (score.prescale) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = ScoreLog2::log2_units(p, s[nt][e]);
  }
  if (masked) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rel = 8 * nt + 2 * t + (e & 1), r = e >> 1;
        if (rel < lo[r] || rel >= hi[r]) s[nt][e] = kNegInf;
      }
  }
  float alphas[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = kNegInf;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    const float m_new = fmaxf(m[r], mx);
    const float m_use = m_new == kNegInf ? 0.0f : m_new * score.exp_mul;  // all -inf so far: p = 0, no NaN
    const float alpha = fast_exp2(m[r] * score.exp_mul - m_use);
    m[r] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
      s[nt][2 * r] = fast_exp2(fmaf(s[nt][2 * r], score.exp_mul, -m_use));
      s[nt][2 * r + 1] = fast_exp2(fmaf(s[nt][2 * r + 1], score.exp_mul, -m_use));
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    l[r] = l[r] * alpha + sum;
    alphas[r] = alpha;
  }
  // Once the running maxima settle (most tiles of a long row), no row of the warp moves: skip
  // the 2 x D / 4 rescaling multiplies (alpha is exactly 1 when m is unchanged).
  if (!__any_sync(kFullMask, alphas[0] != 1.0f || alphas[1] != 1.0f)) return;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      o[dt][2 * r] *= alphas[r];
      o[dt][2 * r + 1] *= alphas[r];
    }
}

// out = o / l and lse (natural log; m in units of exp_mul / ln 2) of the thread's valid rows;
// with splits the fp32 partials. out (of q's dtype T, rows 16-byte aligned: select.cu) is
// staged in the warp's own Q rows of shared memory (no other warp reads them) and written in
// 16-byte chunks.
template <class T, int kD>
FS_DEV void store_rows(const AttnParams& p, const CtaWork& w, int64_t h, int split, const float (&o)[kMB][kD / 8][4],
                       const float (&m)[kMB][2], float (&l)[kMB][2], float exp_mul, uint32_t q_s, int warp, int lane) {
  constexpr int kChunks = kD / 8;
  constexpr uint32_t rb = Smem<kD>::kRowBytes;
  const int g = lane >> 2, t = lane & 3;
  float inv[kMB][2];
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mb][r] += __shfl_xor_sync(kFullMask, l[mb][r], 1);
      l[mb][r] += __shfl_xor_sync(kFullMask, l[mb][r], 2);
      const bool empty = l[mb][r] == 0.0f;
      inv[mb][r] = empty ? 0.0f : 1.0f / l[mb][r];
      const int i = kWarpRows * warp + 16 * mb + 8 * r + g;
      if (i >= w.rows) continue;
      const float lse = empty ? kNegInf : m[mb][r] * exp_mul * kLn2 + logf(l[mb][r]);
      if (p.num_splits > 1) {
        const int64_t at = partial_index(p, split, w.row0 + i, h);
#pragma unroll
        for (int dt = 0; dt < kD / 8; ++dt) {  // 4-byte stores: the workspace may be only 4-byte aligned
          p.o_partial[at * kD + 8 * dt + 2 * t] = o[mb][dt][2 * r] * inv[mb][r];
          p.o_partial[at * kD + 8 * dt + 2 * t + 1] = o[mb][dt][2 * r + 1] * inv[mb][r];
        }
        if (t == 0) p.lse_partial[at] = lse;
      } else if (t == 0) {
        store_lse(p, w.qb, w.q_row0 + i, h, lse);
      }
    }
  if (p.num_splits > 1) return;
  __syncwarp();  // the warp's last ldmatrix of its Q rows precedes the overwrite
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t row = q_s + uint32_t(kWarpRows * warp + 16 * mb + 8 * r + g) * rb + 4u * t;  // row % 8 == g
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        const uint32_t x = pack2<T>(o[mb][dt][2 * r] * inv[mb][r], o[mb][dt][2 * r + 1] * inv[mb][r]);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(row + ((16u * dt) ^ (uint32_t(g) << 4))), "r"(x) : "memory");
      }
    }
  __syncwarp();
  T* out = static_cast<T*>(const_cast<void*>(p.out.data)) + w.qb * p.out.stride[0] + h * p.out.stride[2];
#pragma unroll
  for (int it = 0; it < kWarpRows * kChunks / 32; ++it) {
    const int idx = 32 * it + lane, i = kWarpRows * warp + idx / kChunks, c = idx % kChunks;
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(q_s + Smem<kD>::at(i, c))
                 : "memory");
    if (i < w.rows) *reinterpret_cast<uint4*>(out + (w.q_row0 + i) * p.out.stride[1] + 8 * c) = x;
  }
}

// Visible local keys of tile row i: visibility (masks.cuh) within the split's range, bounded
// to the tokens the metadata can place in the cache (generic_fwd.cuh). lo and hi are
// non-decreasing in i, so a group's first and last rows bound the group's keys.
struct RowKeys {
  Visibility vis;
  KvRange range;
  KeyRange cache;
  int64_t pos0;  // aligned position of tile row 0: i0 + sk - sq
  int64_t sk;
  FS_DEV KeyRange operator()(int64_t i) const {
    const KeyRange k = vis(pos0 + i, sk);
    return generic::bound_to_cache({imax(k.lo, range.begin), imin(k.hi, range.end)}, cache);
  }
};

// A key offset relative to the CTA's first tile, clamped to [0, INT_MAX]. A CTA's keys lie
// within its sequence's cache span plus one tile (generic::bound_to_cache), which select.cu
// keeps under 2^31 - 4 * kN keys: offsets, tile starts j * kN and j * kN + kN fit in int.
FS_DEV int rel32(int64_t x) { return int(imin(imax(x, 0), INT_MAX)); }
FS_DEV int clamp_tile(int x) { return x < 0 ? 0 : (x > kN ? kN : x); }

// Key ranges relative to the CTA's first tile: each of the thread's rows (kept in shared memory,
// `rows_s` [128] int2, read only on masked tiles: registers are the kernel's limit), and the
// warp's union (any) and intersection (all) of its rows' keys, which decide per tile whether
// the warp skips it, masks it, or takes it whole.
struct WarpKeys {
  int2* rows_s;
  int any_lo, any_hi, all_lo, all_hi;
  FS_DEV WarpKeys(const RowKeys& keys, int64_t n_begin, int rows, int warp, int lane, int2* rows_smem)
      : rows_s(rows_smem) {
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // the lanes of one row write the same pair; each reads its own
        const int i = kWarpRows * warp + 16 * mb + 8 * r + (lane >> 2);
        const KeyRange k = keys(i);
        rows_s[i] = make_int2(rel32(k.lo - n_begin), rel32(k.hi - n_begin));
      }
    const int first = kWarpRows * warp, last = int(imin(first + kWarpRows, rows)) - 1;
    any_lo = any_hi = all_lo = all_hi = 0;  // no valid row: the warp skips every tile
    if (last < first) return;
    const KeyRange a = keys(first), b = keys(last);
    any_lo = rel32(a.lo - n_begin), any_hi = rel32(b.hi - n_begin);
    all_lo = rel32(b.lo - n_begin), all_hi = rel32(a.hi - n_begin);
  }
  // Visible keys [lo, hi) of the thread's rows of row block mb, relative to the tile at `off`.
  FS_DEV void tile_rows(int mb, int off, int warp, int lane, int (&lo)[2], int (&hi)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int2 k = rows_s[kWarpRows * warp + 16 * mb + 8 * r + (lane >> 2)];
      lo[r] = clamp_tile(k.x - off);
      hi[r] = clamp_tile(k.y - off);
    }
  }
};

template <class T, int kD>
__global__ void __launch_bounds__(kThreads, kPrefillCtasPerSm) prefill_fwd(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // no static shared memory: at the window start (LaneAddr)
  static_assert(Smem<kD>::kBytes + kM * sizeof(int2) == prefill_smem_bytes(kD), "select.hpp sizes shared memory");
  // Heads fastest, row tiles descending: the longest causal tiles of every head start first.
  const int64_t linear = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t h = linear % gridDim.y;
  const CtaWork w = cta_work(p, int64_t(gridDim.x) - 1 - linear / gridDim.y);
  if (!w.active) return;
  const Smem<kD> sm(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const int64_t sk = kv_len(p, w.b);
  const RowKeys keys{make_visibility(p), split_kv_range(sk, p.num_splits, split, p.split_granularity),
                     generic::cache_tokens(p, kv), w.i0 + sk - w.sq, sk};
  const KeyRange first = keys(0), last = keys(w.rows - 1);
  const int64_t n_begin = keys.range.begin + floor_div(first.lo - keys.range.begin, kN) * kN;
  const int tiles = first.lo < last.hi ? int((last.hi - n_begin + kN - 1) / kN) : 0;

  load_q<T, kD>(p, w, h, sm.q);
  cp_async_commit();
  if (tiles > 0) load_kv<T, kD>(p, kv, n_begin, last.hi, sm.k(0), sm.v(0));
  cp_async_commit();

  const LaneAddr<kD> la(sm.q, warp, lane);
  const WarpKeys wk(keys, n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(smem_raw + Smem<kD>::kBytes));
  const ScoreLog2 score(p);
  float o[kMB][kD / 8][4] = {};
  float m[kMB][2], l[kMB][2] = {};
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb) m[mb][0] = m[mb][1] = kNegInf;
  for (int j = 0; j < tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j (and Q) in shared memory; every warp is done with tile j - 1
    if (j + 1 < tiles) load_kv<T, kD>(p, kv, n_begin + int64_t(j + 1) * kN, last.hi, sm.k(j + 1), sm.v(j + 1));
    cp_async_commit();
    const int off = j * kN;
    if (off >= wk.any_hi || off + kN <= wk.any_lo) continue;  // no row of the warp sees the tile
    const bool masked = off < wk.all_lo || off + kN > wk.all_hi;
    float s[kMB][kN / 8][4];
    qk_tile<T, kD>(sm.k(j), la, s);
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      int lo[2] = {0, 0}, hi[2] = {kN, kN};
      if (masked) wk.tile_rows(mb, off, warp, lane, lo, hi);
      softmax_block<kD>(p, s[mb], o[mb], m[mb], l[mb], score, lo, hi, masked, lane & 3);
    }
    pv_tile<T, kD>(s, sm.v(j), la, o);
  }
  if (tiles == 0) {  // Q's copies (by every thread) land before a warp reuses its rows
    cp_async_wait<0>();
    __syncthreads();
  }
  store_rows<T, kD>(p, w, h, split, o, m, l, score.exp_mul, sm.q, warp, lane);
}

}  // namespace flashserve::kernels::prefill
