// The sm_90a fp8 prefill kernel (FlashAttention-3's fp8 forward, our way): q, k and v in fp8
// e4m3 with their descales ([B, H_kv], what vLLM and SGLang pass with an fp8 KV cache), both
// GEMMs on fp8 wgmma (m64nNk32: twice the 16-bit rate), out in f16/bf16 (or the fp32 partials
// of cascade and split-KV). The CTA is prefill_tma's: a producer warpgroup loading Q, K and V
// tiles with TMA (or copy_tail for tails and bad metadata) through mbarrier pipelines, two
// consumer warpgroups of 64 query rows in ping-pong, the same CTA schedule, masks, modifiers
// (causal, window, chunked local, soft-cap, sinks, context parallelism) and epilogue.
//
// What fp8 changes:
// - 8-bit wgmma reads both shared-memory operands K-major only. Q and K are (rows of D bytes);
//   V is [keys, Dv] in memory, but P V needs it as [Dv, keys]. So V lands raw (TMA) and the
//   four producer warps transpose each tile into a second buffer (transpose_v: ldmatrix.trans
//   of 16-bit pairs, a byte permute, stmatrix) before the consumers read it: ~50 instructions
//   per warp per 128 x 128 tile.
// - P is the A operand from registers as e4m3: the k32 fragment wants 4 consecutive keys per
//   register where the S accumulator holds pairs 8 apart. Instead of moving registers, the
//   transpose stores V's keys in the fragment's order (logical key 4t + i of a 16-key group is
//   key 2t + (i & 1) + 8 (i >> 1)): P V is a sum over keys, any order both operands share.
// - The softmax shifts P by 2^8 (the row's max weighs 256 < 448, e4m3's largest), so weights
//   down to 2^-17 of the max keep a value; l carries the same shift, which store_rows takes out
//   of the LSE. P then rounds to e4m3 (3 mantissa bits, as FlashAttention-3's fp8 forward).
// - Scores are scale x q_descale x k_descale x q.k (ScoreLog2's scale), out gets v_descale.
//
// Per 128-key tile at D = Dv = 128 (H200 SM: 8192 dense fp8 FLOP/clk): 2 GEMMs x 64 x 128 x 128
// x 2 per warpgroup = 4.2 MFLOP = 512 clk of the tensor pipe per warpgroup; its softmax is
// 64 x 128 exp2 on 16 MUFU/clk = 512 clk plus ~3 FP32 ops per score (~200 clk). The ping-pong
// hides one warpgroup's softmax under the other's GEMMs: ~1100-1200 clk per tile for both, so
// MUFU and the tensor pipe bind together (bf16: ~2048 clk): ~1.7x the bf16 kernel at best.
// TMA: Q 16 KB once, K + V 32 KB per tile.
// Measured (H200, B = 2 S = 8k H = 16, not causal; bench/RESULTS.md): 638 TFLOP/s first, 671
// with the transpose in closed-form addresses (1.21x the bf16 prefill_tma in the same run; the
// target is 1.5x). ncu on the first version (clocks at 1.36 GHz): ~2900 clk per 128 x 128 tile,
// issue slots 48% busy at 2 IPC, ~6000 warp instructions per tile: the consumer loop 475 per
// warp (softmax 340: FMNMX 70, FFMA 68, FADD 66, MUFU 66, F2FP 32, PRMT 16) plus O's rescale 64,
// the transpose 36 per unit (now ~8), spinning mbarrier waits; stalls: wait 25%, long
// scoreboard 17% (spilled registers: the consumers use 232), named barrier 10%. Each SMSP issues
// ~1500 instructions per tile against MUFU's 1024 clk and the tensor pipe's 1024: the CUDA-core
// instruction count, not the tensor cores, sets the pace.
#pragma once

#include "kernels/attention/prefill_tma.cuh"
#include "kernels/common/wgmma_mma_fp8.cuh"

namespace flashserve::kernels::prefill {

inline constexpr float kFp8PShift = 8.0f;            // P's scale, log2 units (softmax_scores' p_shift)
inline constexpr float kFp8Lazy = 0.75f;             // lazy rescaling's bound: p <= 2^8.75 = 430 < 448
static_assert(kFp8PShift + kFp8Lazy < 8.807f, "P within e4m3's largest finite value, 448 = 2^8.807");
inline constexpr uint32_t kTransposeArrivals = 128;  // V^T full / raw V empty: the producer warpgroup's lanes

// Shared memory: [Q | K 0, 1 | V raw 0, 1 | V transposed 0, 1], SwizzledTile rows of 128 bytes
// (one column block at D = 128), then the rows' key ranges (int2 [128]) and 13 mbarriers. The
// raw V stages also stage the 16-bit out (store_rows) once every tile is transposed.
template <int kD, int kDv>
struct Fp8Smem {
  static constexpr int kN = wgmma_tile_keys(kD, kDv);
  using QL = SwizzledTile<kWgmmaRowsPerCta>;
  using KvL = SwizzledTile<kN>;
  using VtL = SwizzledTile<kDv>;
  static constexpr uint32_t kQBytes = kWgmmaRowsPerCta * kD, kKBytes = kN * kD, kVBytes = kN * kDv;
  static constexpr uint32_t kTiles = kQBytes + 2 * kKBytes + 4 * kVBytes;
  static constexpr uint32_t kBars = 13;
  static constexpr uint32_t kBytes = 1024 + kTiles + kWgmmaRowsPerCta * 8 + kBars * 8;
  static_assert(kD == 128 && kDv == 128, "rows of one 128-byte column block; V^T rows of kN = 128 keys");
  static_assert(kBytes == prefill_fp8_smem_bytes(kD, kDv), "select.hpp sizes it");
  static_assert(2 * kVBytes >= kWgmmaRowsPerCta * kDv * 2, "the raw V stages hold the 16-bit out");
  uint32_t q, bars;
  unsigned char* ranges;
  FS_DEV explicit Fp8Smem(unsigned char* raw) {
    const uint32_t base = smem_u32(raw), aligned = warp_uniform((base + 1023u) & ~1023u);
    q = aligned;
    ranges = raw + (aligned - base) + kTiles;
    bars = aligned + kTiles + kWgmmaRowsPerCta * 8;
  }
  FS_DEV uint32_t k(int st) const { return q + kQBytes + uint32_t(st) * kKBytes; }
  FS_DEV uint32_t v(int st) const { return q + kQBytes + 2 * kKBytes + uint32_t(st) * kVBytes; }
  FS_DEV uint32_t vt(int st) const { return q + kQBytes + 2 * kKBytes + uint32_t(2 + st) * kVBytes; }
  FS_DEV uint32_t q_full() const { return bars; }
  FS_DEV uint32_t k_full(int st) const { return bars + 8 + 8 * st; }
  FS_DEV uint32_t k_empty(int st) const { return bars + 24 + 8 * st; }
  FS_DEV uint32_t v_full(int st) const { return bars + 40 + 8 * st; }    // raw V landed
  FS_DEV uint32_t v_empty(int st) const { return bars + 56 + 8 * st; }   // raw V transposed (128 lanes)
  FS_DEV uint32_t vt_full(int st) const { return bars + 72 + 8 * st; }   // V^T written (128 lanes)
  FS_DEV uint32_t vt_empty(int st) const { return bars + 88 + 8 * st; }  // V^T read (8 consumer warps)
  // The pipelines' mbarriers (one thread; consumer_warps: the consumers' warps).
  FS_DEV void init_bars(uint32_t consumer_warps) const {
    mbar_init(q_full(), 1);
    for (int st = 0; st < 2; ++st) {
      mbar_init(k_full(st), kFullArrivals);
      mbar_init(v_full(st), kFullArrivals);
      mbar_init(k_empty(st), consumer_warps);
      mbar_init(v_empty(st), kTransposeArrivals);
      mbar_init(vt_full(st), kTransposeArrivals);
      mbar_init(vt_empty(st), consumer_warps);
    }
  }
};

// 4 fp32 values to 4 e4m3 bytes (the first lowest), rounded to nearest, saturated to +-448.
FS_DEV uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// P (the thread's rows g, g + 8 of S) as the k32 A fragments of P V, keys in transpose_v's
// order: fragment kk's register 0 holds row g's keys 32 kk + {2t, 2t + 1, 8 + 2t, 9 + 2t}
// (logical 4t .. 4t + 3), register 2 the same 16 keys further; registers 1, 3 row g + 8.
template <int kN>
FS_DEV void pack_p_e4m3(const float (&s)[kN / 8][4], uint32_t (&pa)[kN / 32][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float(&a)[4] = s[4 * kk + 2 * h];
      const float(&b)[4] = s[4 * kk + 2 * h + 1];
      pa[kk][2 * h] = pack_e4m3x4(a[0], a[1], b[0], b[1]);
      pa[kk][2 * h + 1] = pack_e4m3x4(a[2], a[3], b[2], b[3]);
    }
}

// V^T of one tile: raw V [kN keys, kDv] (TMA's 128-byte swizzle, KvL) into [kDv, kN] (VtL), the
// keys of each 16-key group in the P fragments' order. Unit u (warp w of the 4 takes u = w,
// w + 4, ...) is 16 keys x 32 channels: ldmatrix.x4.trans reads four 8-key x 16-channel blocks
// as 16-bit pairs, which gives lane (g, t) keys 2t, 2t + 1 (and 8 further) of channels 2g,
// 2g + 1; two byte permutes per pair make one register per channel of keys {2t, 2t + 1, 8 + 2t,
// 9 + 2t}, which stmatrix.x4 writes at logical keys 4t .. 4t + 3 of channel rows 2g, 2g + 1
// (and 16 further).
// Warp w takes the key groups kg = w and w + 4 of every 32-channel group cg; the addresses are
// KvL::at(16 kg + 8 lo + i, 2 cg + hi) and VtL::at(32 cg + 16 hi + 2 i + lo, kg) for lane
// (m = 2 hi + lo, i) in closed form (rows of one 128-byte block: chunk c of row r at
// (c ^ (r & 7)) x 16, and (2 cg + hi) ^ i = (hi ^ i) ^ 2 cg), a few instructions per unit.
// The lane comes from a volatile read so that the addresses are computed per call: hoisted out
// of the producer's tile loop they spill its 40 registers.
template <int kN, int kDv, class KvL, class VtL>
FS_DEV void transpose_v(uint32_t raw, uint32_t vt, int w) {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  static_assert(kN == 128 && kDv % 32 == 0 && KvL::kBlockBytes == kN * 128u && VtL::kBlockBytes == kDv * 128u,
                "8 key groups, 4 warps; rows of one 128-byte block");
  const int m = lane >> 3, i = lane & 7, hi = m >> 1, lo = m & 1;
  const uint32_t raw_row = raw + uint32_t(16 * w + 8 * lo + i) * 128u, raw_chunk = uint32_t(hi ^ i) * 16u;
  const uint32_t vt_row = vt + uint32_t(16 * hi + 2 * i + lo) * 128u;
  const int r7 = (2 * i + lo) & 7;
  const uint32_t vt_chunk[2] = {uint32_t(w ^ r7) * 16u, uint32_t((w + 4) ^ r7) * 16u};
#pragma unroll
  for (int cg = 0; cg < kDv / 32; ++cg)
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // kg = w + 4 half: 64 key rows further
      uint32_t r[4];
      ldmatrix_x4_trans(r, raw_row + uint32_t(half) * 64u * 128u + (raw_chunk ^ uint32_t(32 * cg)));
      const uint32_t e0 = __byte_perm(r[0], r[1], 0x6420), o0 = __byte_perm(r[0], r[1], 0x7531);
      const uint32_t e1 = __byte_perm(r[2], r[3], 0x6420), o1 = __byte_perm(r[2], r[3], 0x7531);
      stmatrix_x4(vt_row + uint32_t(cg) * 32u * 128u + vt_chunk[half], e0, o0, e1, o1);
    }
}

// The producer warpgroup (the kernel's thread 0 loads Q: load_q): warp 8 loads K and raw V of
// every tile (prefill_tma's loads: TMA where tma_tile allows, else copy_tail), or K only, warp 9
// raw V, where a paged tile is several page segments (prefill_tma's Producer::split: one warp
// issuing every box of a tile bound its paged loads at block 16); all four warps transpose tile
// j - 1 after tile j's loads were issued, so loads run about two tiles ahead of the consumers.
// j0: the CTA's tiles before this item's (the persistent kernel: stages and phases run on).
template <class T, int kD, int kDv, class Sm>
FS_DEV void produce_fp8(const TmaAttnParams& tp, const CtaWork& w, const SeqKv& kv, const CtaKeys& ck, const Sm& sm,
                        int warp, int lane, int j0 = 0) {
  using L = typename Sm::KvL;
  constexpr int kN = Sm::kN;
  const AttnParams& p = tp.p;
  const int64_t sk = kv_len(p, w.b);
  const KeyRange cache = generic::cache_tokens(p, kv);
  const int seg = prefill_tma_box_rows(kN, p.paged, p.kv_dim1), g = int(kv.g);
  const auto transpose = [&](int jj) {
    const int j = j0 + jj, st = j & 1;
    const uint32_t parity = uint32_t((j >> 1) & 1);
    mbar_wait(sm.v_full(st), parity);
    if (j >= 2) mbar_wait(sm.vt_empty(st), parity ^ 1u);  // j counts the CTA's tiles
    transpose_v<kN, kDv, L, typename Sm::VtL>(sm.v(st), sm.vt(st), warp);
    fence_proxy_async_shared();  // the stmatrix writes, visible to wgmma
    mbar_arrive(sm.vt_full(st));  // every lane: its own reads and writes done (kTransposeArrivals)
    mbar_arrive(sm.v_empty(st));
  };
  const auto tile_n0 = [&](int j) { return ck.n_begin + int64_t(j) * kN; };
  const bool loads_k = warp == 0, loads_v = warp == (seg < kN ? 1 : 0);
  int64_t next_id =
      (loads_k || loads_v) && ck.tiles > 0 ? tma_tile_id<kN>(p, kv, cache, sk, tile_n0(0), seg, lane) : 0;
#pragma unroll 1
  for (int j = 0; j < ck.tiles; ++j) {
    if (loads_k || loads_v) {
      const int st = (j0 + j) & 1;
      const uint32_t parity = uint32_t(((j0 + j) >> 1) & 1) ^ 1u;
      const int64_t n0 = tile_n0(j), id = next_id;
      // the next tile's block ids, loaded while this tile's loads and tile j - 1's transpose run
      if (j + 1 < ck.tiles) next_id = tma_tile_id<kN>(p, kv, cache, sk, tile_n0(j + 1), seg, lane);
      int row = 0, blk = 0;
      const bool whole = tma_tile_from<kN>(p, kv, cache, sk, n0, seg, lane, id, row, blk);
      if (loads_k) {
        if (j0 + j >= 2) mbar_wait(sm.k_empty(st), parity);
        if (whole) tma_stage<T, L, kN, kD>(&tp.k, sm.k(st), sm.k_full(st), Sm::kKBytes, seg, g, row, blk, 0, 1, lane);
        else copy_tail<T, L, kN, kD / 16, true>(p, kv, sk, n0, sm.k(st), sm.k_full(st), lane);
      }
      if (loads_v) {
        if (j0 + j >= 2) mbar_wait(sm.v_empty(st), parity);
        if (whole)
          tma_stage<T, L, kN, kDv>(&tp.v, sm.v(st), sm.v_full(st), Sm::kVBytes, seg, g, row, blk, 0, 1, lane);
        else copy_tail<T, L, kN, kDv / 16, false>(p, kv, sk, n0, sm.v(st), sm.v_full(st), lane);
      }
    }
    if (j >= 1) transpose(j - 1);
  }
  if (ck.tiles > 0) transpose(ck.tiles - 1);
}

// S = Q K^T of the warpgroup's rows (kD / 32 k32 steps), one commit group.
template <class T, int kD, int kN>
FS_DEV void issue_qk_fp8(uint32_t q_s, uint32_t k_s, int wg, float (&s)[kN / 8][4]) {
  fence_operands(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 32; ++kk)
    wgmma_ss<T, kN>(s, desc_k_major<kWgmmaRowsPerCta>(q_s, 64 * wg, kk), desc_k_major<kN>(k_s, 0, kk), kk > 0);
  wgmma_commit();
}

// O += P V^T-tile (kN / 32 k32 steps, B = V^T K-major), one commit group.
template <class T, int kDv, int kN>
FS_DEV void issue_pv_fp8(const uint32_t (&pa)[kN / 32][4], uint32_t vt_s, float (&o)[kDv / 8][4]) {
  fence_operands(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk) wgmma_rs<T, kDv>(o, pa[kk], desc_k_major<kDv>(vt_s, 0, kk), 1);
  wgmma_commit();
}


// T: the fp8 type of q, k and v; TOut: out's (f16, bf16, or float for the fp32 partials).
template <class T, class TOut, int kD, int kDv>
__global__ void __launch_bounds__(kTmaThreads, 1) prefill_fp8(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Wgmma90<kD, kDv>;
  using Sm = Fp8Smem<kD, kDv>;
  constexpr int kN = S::kN;
  using T16 = std::conditional_t<std::is_same_v<TOut, float>, __nv_bfloat16, TOut>;  // store_rows' staging type
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm sm(smem_raw);
  if (threadIdx.x == 0) {  // before the CTA's work lookup, which waits for device metadata
    tma_prefetch_desc(&tp.q);
    sm.init_bars(S::kWarps);
    mbar_init_fence();
  }
  int64_t h;
  const CtaWork w = cta_of_block<S::kM>(p, h);
  if (!w.active) return;
  if (threadIdx.x == 0) load_q<T, kD>(tp, sm, w, h);  // overlaps the KV metadata reads below
  const int warp = int(warp_uniform(threadIdx.x / 32)), lane = int(threadIdx.x) % 32, wg = warp / 4;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);
  __syncthreads();
  if (wg == 2) {
    regs_dealloc<kTmaProducerRegs>();
    produce_fp8<T, kD, kDv>(tp, w, kv, ck, sm, warp - 8, lane);
    return;
  }
  regs_alloc<kTmaConsumerRegs>();
  const WarpKeys<S> wk(ck.rows, ck.n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
  const float qd = load_f32_2d(p.q_descale, w.b, kv.g, 1.0f), kd = load_f32_2d(p.k_descale, w.b, kv.g, 1.0f);
  const ScoreLog2 score(p, qd * kd);
  const NoBias bias;
  float o[1][kDv / 8][4] = {};
  float s[kN / 8][4] = {};
  uint32_t pa[kN / 32][4];
  float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {}, alpha[2];
  mbar_wait(sm.q_full(), 0);
  consume_tiles<false>(  // P V reads the transposed stages; no pin (pin_wait)
      ck.tiles, wg, lane,
      StageBars{sm.k_full(0), sm.k_empty(0), sm.vt_full(0), sm.vt_empty(0), 0u}, s, o[0],
      [&](int st) { issue_qk_fp8<T, kD, kN>(sm.q, sm.k(st), wg, s); },
      [&](int st) { issue_pv_fp8<T, kDv, kN>(pa, sm.vt(st), o[0]); },
      [&](int j) {
        prefill::softmax_tile<S, kN>(wk, score, bias, 0, j, warp, lane, s, m[0], l[0], alpha, kFp8PShift, kFp8Lazy);
        return l[0][0] + l[0][1];
      },
      [&] { rescale_o<kDv>(o[0], alpha); }, [&] { pack_p_e4m3<kN>(s, pa); });
  // Out staged in the raw V stages: every tile was transposed (vt_full) before the last P V.
  const float vd = load_f32_2d(p.v_descale, w.b, kv.g, 1.0f);
  store_rows<S, SwizzledTile<kWgmmaRowsPerCta>, T16, kDv, kDv, TOut>(p, w, h, split, o, m, l, score.exp_mul, sm.v(0),
                                                                     warp, lane, vd, kFp8PShift);
#endif
}

}  // namespace flashserve::kernels::prefill
