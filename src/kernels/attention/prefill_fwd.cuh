// The tensor-core prefill kernel: FlashAttention-2 structure on mma.sync m16n8k16 (sm80+).
// Serves f16/bf16 q/k/v (one dtype), D == Dv in kPrefillConfigs, causal / window / chunked local
// attention / soft-cap / ALiBi (linear, sqrt) / sinks, contiguous or paged KV (any block size: every KV row is located on its own), GQA and any
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

#include <cstdint>

#include "kernels/attention/prefill_common.cuh"

namespace flashserve::kernels::prefill {

// 128 rows, 64-key tiles, 4 warps of 32 rows; a warp decides on its own rows.
using Mma80 = TileShape<kPrefillRowsPerCta, kPrefillTileKeys, kPrefillWarps, kPrefillRowsPerCta / kPrefillWarps>;
constexpr int kM = Mma80::kM, kN = Mma80::kN, kThreads = Mma80::kThreads;
constexpr int kWarpRows = Mma80::kWarpRows, kMB = Mma80::kMB;
static_assert(kN == 64 && kThreads == kPrefillThreads, "the softmax and PV loops assume 8 n8 tiles per KV tile");

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
};

// The tile layout of Smem for the shared copies and epilogue (prefill_common.cuh).
template <int kD>
struct RowMajor {
  static FS_DEV uint32_t at(int row, int chunk) { return uint32_t(row * (kD / 8) + (chunk ^ (row & 7))) * 16u; }
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
    for (int mb = 0; mb < kMB; ++mb) p_fragment<T, kN>(s[mb], kk, a[mb]);
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

// kAlibi: the ALiBi score bias (prefill_common.cuh: AlibiBias, linear or sqrt) on every tile.
template <class T, int kD, bool kAlibi>
__global__ void __launch_bounds__(kThreads, kPrefillCtasPerSm) prefill_fwd(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // no static shared memory: at the window start (LaneAddr)
  static_assert(Smem<kD>::kBytes + kM * sizeof(int2) == prefill_smem_bytes(kD), "select.hpp sizes shared memory");
  using L = RowMajor<kD>;
  int64_t h;
  const CtaWork w = cta_of_block<kM>(p, h);
  if (!w.active) return;
  const Smem<kD> sm(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);

  load_q<Mma80, L, T, kD>(p, w, h, sm.q);
  cp_async_commit();
  if (ck.tiles > 0) load_kv<Mma80, L, T, kD>(p, kv, ck.n_begin, ck.end, sm.k(0), sm.v(0));
  cp_async_commit();

  const LaneAddr<kD> la(sm.q, warp, lane);
  const WarpKeys<Mma80> wk(ck.rows, ck.n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(smem_raw + Smem<kD>::kBytes));
  const ScoreLog2 score(p);
  const ScoreBias<kAlibi> bias = make_score_bias<kAlibi>(p, w.b, h, score);
  float o[kMB][kD / 8][4] = {};
  float m[kMB][2], l[kMB][2] = {};
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb) m[mb][0] = m[mb][1] = kNegInf;
  for (int j = 0; j < ck.tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // tile j (and Q) in shared memory; every warp is done with tile j - 1
    if (j + 1 < ck.tiles) load_kv<Mma80, L, T, kD>(p, kv, ck.n_begin + int64_t(j + 1) * kN, ck.end, sm.k(j + 1), sm.v(j + 1));
    cp_async_commit();
    const int off = j * kN;
    if (wk.skips(off)) continue;  // no row of the warp sees the tile
    const bool masked = wk.masks(off);
    float s[kMB][kN / 8][4];
    qk_tile<T, kD>(sm.k(j), la, s);
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) {
      int lo[2] = {0, 0}, hi[2] = {kN, kN};
      if (masked) wk.tile_rows(mb, off, warp, lane, lo, hi);
      float alpha[2];
      const float d0 = kAlibi ? float(bias_d0<Mma80>(ck, warp, mb, lane) - off) : 0.0f;
      softmax_scores<kN>(s[mb], m[mb], l[mb], alpha, score, lo, hi, masked, lane & 3, bias, d0);
      rescale_o<kD>(o[mb], alpha);
    }
    pv_tile<T, kD>(s, sm.v(j), la, o);
  }
  if (ck.tiles == 0) {  // Q's copies (by every thread) land before a warp reuses its rows
    cp_async_wait<0>();
    __syncthreads();
  }
  store_rows<Mma80, L, T, kD>(p, w, h, split, o, m, l, score.exp_mul, sm.q, warp, lane);
}

}  // namespace flashserve::kernels::prefill
