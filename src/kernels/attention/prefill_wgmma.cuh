// The sm_90a tensor-core prefill kernel: the FlashAttention-2 loop of prefill_fwd.cuh with both
// GEMMs on warpgroup MMA (wgmma.mma_async), operands read by the tensor cores straight from
// 128-byte-swizzled shared memory (no ldmatrix). Serves what prefill_mma serves (select.cu:
// f16/bf16, causal / window / chunked local attention / soft-cap / ALiBi (linear, sqrt) / sinks,
// contiguous or paged KV of any block size, GQA, any split count) and more head sizes ((D, Dv)
// in kPrefillWgmmaConfigs: 64, 96, 128, 192, 256 and MLA's 192/128) on compute capability 9.0
// when the build has sm_90a.
//
// CTA: 128 query rows of one sequence x one query head x one KV split (the schedule of
// prefill_common.cuh); 2 warpgroups of 64 rows, 256 threads, one CTA per SM. KV tiles of N keys
// (128; 64 when D or Dv > 128), K double- and V triple-buffered, copied by all 256 threads with
// cp.async (each KV row located on its own, as prefill_mma), one barrier per tile after the
// async-proxy fence. Per tile each warpgroup:
//   S [64, N] = Q K^T:  D / 16 wgmma m64nNk16, A = Q and B = K from shared memory (K-major);
//   the online softmax of prefill_common.cuh on S (the accumulator layout of wgmma per warp is
//   mma.sync's), masks only on tiles some row of the warpgroup sees partly;
//   O [64, D] += P V: N / 16 wgmma m64nDk16, A = P from registers (rounded to the operand
//   dtype), B = V from shared memory N-major (the transpose is the descriptor's);
// software-pipelined so that the softmax of tile j overlaps P V of tile j - 1 (the mainloop
// below). The epilogue is prefill_mma's (prefill_common.cuh: out through the warp's own Q
// rows, or the fp32 partials).
//
// Arithmetic per 128-key tile (D = 128; H200 SM: 4096 dense bf16 FLOP/clk = 990 TFLOP/s at the
// boost clock; cuBLAS reaches ~700 under load):
//   2 GEMMs x 128 x 128 x 128 x 2 = 8.4 MFLOP = 2048 clk; the softmax does 128 x 128 exp2 on
//   16 MUFU/clk = 1024 clk, plus ~4 FP32 ops per score on 128/clk = 512 clk. With S of both
//   warpgroups waited for together and the softmax overlapping only P V, ~1024 (QK) + 1100
//   (softmax || PV) + ~200 (barrier, copies) = ~2300 clk per tile: ~90% of the GEMM rate
//   predicted; measured 388 TFLOP/s at S = 8k (56% of cuBLAS's 692 in the same run): the
//   shared per-tile barrier keeps the two warpgroups in lockstep, and one CTA per SM exposes
//   every CTA's prologue. ncu (S = 8k, clocks locked at 1.36 GHz): tensor pipe 40% busy, 2
//   warps per scheduler with 0.5 eligible, top stalls the wgmma waits (19%), MUFU (15%) and
//   wgmma issue (13%).
//   Tried and dropped (session 3): a producer warpgroup doing the same cp.async copies on
//   mbarriers (K full/empty x 2, V x 3) with the two consumer warpgroups in ping-pong on named
//   barriers ran at 294-325 TFLOP/s: consumers capped at 224-232 registers (spills), the
//   producer's 16-byte copies and in-order wait_group gate every stage. Warp specialization
//   wants TMA (one thread per tile for contiguous caches and large pages) first.
//   Shared memory per tile: wgmma reads Q 16 KB + K 32 KB + V 32 KB per warpgroup (160 KB)
//   and the copies write 64 KB: 224 KB / 2048 clk = 110 B/clk of the 128 B/clk.
//   Registers per thread: S N / 2 + O D / 2 fp32 (128 at D = 128), P N / 4, masks, state
//   (237 at D = 128, no spills).
#pragma once

#include <cstdint>

#include "kernels/attention/prefill_common.cuh"
#include "kernels/common/wgmma.cuh"

namespace flashserve::kernels::prefill {

// kM rows: 64 per warpgroup (prefill_tma: 128 or 192).
template <int kD, int kDv, int kM = kWgmmaRowsPerCta>
using Wgmma90 = TileShape<kM, wgmma_tile_keys(kD, kDv), kM / 16, 64>;

// Shared memory: [Q | K stage 0, 1 | V stage 0, 1, 2 | rows' key ranges], the tiles
// SwizzledTile (wgmma.cuh) from a 1024-byte-aligned base. V has a third stage: P V of tile j - 1
// still reads V j-1 while the copies of tile j + 1 fill the stages of tile j - 1 (K) and
// j - 2 (V). Q and K span wgmma_tile_width(D) channels, V wgmma_tile_width(Dv) (whole
// 64-channel column blocks: D = 96 takes 128, of which QK^T reads 96).
template <int kD, int kDv>
struct WgmmaSmem {
  static constexpr int kN = wgmma_tile_keys(kD, kDv);
  using QL = SwizzledTile<kWgmmaRowsPerCta>;
  using KvL = SwizzledTile<kN>;
  static constexpr uint32_t kQBytes = kWgmmaRowsPerCta * wgmma_tile_width(kD) * 2;
  static constexpr uint32_t kKBytes = kN * wgmma_tile_width(kD) * 2, kVBytes = kN * wgmma_tile_width(kDv) * 2;
  static constexpr uint32_t kBytes = kQBytes + 2 * kKBytes + 3 * kVBytes;
  uint32_t q;
  unsigned char* ranges;  // int2 [128]
  FS_DEV explicit WgmmaSmem(unsigned char* raw) {
    const uint32_t base = smem_u32(raw), aligned = warp_uniform((base + 1023u) & ~1023u);
    q = aligned;
    ranges = raw + (aligned - base) + kBytes;
  }
  FS_DEV uint32_t k(int j) const { return q + kQBytes + uint32_t(j & 1) * kKBytes; }
  // V stage of tile j, given vs = j % 3.
  FS_DEV uint32_t v(int vs) const { return q + kQBytes + 2 * kKBytes + uint32_t(vs) * kVBytes; }
};

FS_DEV int mod3_next(int vs) { return vs == 2 ? 0 : vs + 1; }

// Issues S = Q K^T of the warpgroup's 64 rows (wg) over the K tile at k_s (one commit group);
// Q a swizzled tile of kM rows.
template <class T, int kD, int kN, int kM = kWgmmaRowsPerCta>
FS_DEV void issue_qk(uint32_t q_s, uint32_t k_s, int wg, float (&s)[kN / 8][4]) {
  fence_operands(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
    wgmma_ss<T, kN>(s, desc_k_major<kM>(q_s, 64 * wg, kk), desc_k_major<kN>(k_s, 0, kk), kk > 0);
  wgmma_commit();
}

// Issues O += P V over the V tile at v_s, P the packed probabilities, plus P_lo V with the
// rounding residues when kSplitP (one commit group).
template <class T, int kD, int kN, bool kSplitP, int kLo>
FS_DEV void issue_pv(const uint32_t (&pa)[kN / 16][4], const uint32_t (&lo)[kLo][4], uint32_t v_s,
                     float (&o)[kD / 8][4]) {
  fence_operands(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) wgmma_rs<T, kD>(o, pa[kk], desc_n_major<kN>(v_s, kk), 1);
  if constexpr (kSplitP) {
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) wgmma_rs<T, kD>(o, lo[kk], desc_n_major<kN>(v_s, kk), 1);
  }
  wgmma_commit();
}

// Lazy rescaling's bound for 16-bit P (softmax_scores): p <= 2^8, far inside f16/bf16's range.
inline constexpr float kLazyMax = 8.0f;

// The softmax of tile j on one warpgroup's S (completed), masked where some row of the
// warpgroup sees only part of it; alpha receives the rescale of O (the wgmma kernels).
template <class S, int kN, class Bias>
FS_DEV void softmax_tile(const WarpKeys<S>& wk, const ScoreLog2& score, const Bias& bias,
                         int64_t d0, int j, int warp, int lane, float (&s)[kN / 8][4], float (&m)[2], float (&l)[2],
                         float (&alpha)[2], float p_shift = 0.0f, float lazy = kLazyMax) {
  const int off = j * kN;
  const bool masked = wk.masks(off);
  int lo[2] = {0, 0}, hi[2] = {kN, kN};
  if (masked) wk.tile_rows(0, off, warp, lane, lo, hi);
  softmax_scores<kN>(s, m, l, alpha, score, lo, hi, masked, lane & 3, bias, float(d0 - off), p_shift, lazy);
}

// P = S rounded to T as wgmma A fragments, plus the rounding residues when kF32Out.
template <class T, int kN, bool kF32Out, int kLo>
FS_DEV void pack_p(const float (&s)[kN / 8][4], uint32_t (&pa)[kN / 16][4], uint32_t (&pl)[kLo][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    p_fragment<T, kN>(s, kk, pa[kk]);
    if constexpr (kF32Out) p_residue<T, kN>(s, kk, pa[kk], pl[kk]);
  }
}

// The mainloop, software-pipelined within each warpgroup so that the softmax of tile j runs on
// the CUDA cores while the tensor cores add P V of tile j - 1:
//   barrier j (tile j complete; every warpgroup done with K j-1 and V j-2)
//   copies of tile j+1 (K into the stage of j-1, V into that of j-2)
//   issue S = Q K j; issue O += P(j-1) V(j-1)
//   wait S; softmax of S (m, l, alpha)
//   wait O; O *= alpha; P(j) = S rounded to T
// with the first tile's P V peeled off (nothing pending) and the last tile's after the loop.
// Every wgmma sits on straight-line code (no branch between issue and wait: ptxas serializes
// wgmma otherwise), so a warpgroup also walks tiles none of its rows sees, fully masked (p = 0;
// at most one such tile per CTA, on the causal diagonal).
// kF32Out: out is fp32 (partial states merged later: cascade, MLA chunks); P V then adds the
// residues of P's rounding too (issue_pv), so P is not rounded. kAlibi: the ALiBi score bias
// (prefill_common.cuh: AlibiBias, linear or sqrt) on every tile.
// kD, kDv: the head sizes of q/k and v/out (MLA prefill: 192/128); P V accumulates kDo =
// wgmma_tile_width(kDv) channels, the first kDv stored.
template <class T, int kD, int kDv, bool kF32Out, bool kAlibi>
__global__ void __launch_bounds__(kWgmmaThreads, 1) prefill_wgmma(const __grid_constant__ AttnParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Wgmma90<kD, kDv>;
  using Sm = WgmmaSmem<kD, kDv>;
  using QL = typename Sm::QL;
  using KvL = typename Sm::KvL;
  constexpr int kN = S::kN, kDo = wgmma_tile_width(kDv);
  static_assert(kD % 16 == 0 && kDv % 8 == 0 && kDv <= wgmma_tile_width(kD), "k16 steps; out staged in Q's rows");
  static_assert(Sm::kBytes + 1024 + S::kM * sizeof(int2) == prefill_wgmma_smem_bytes(kD, kDv), "select.hpp sizes it");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  int64_t h;
  const CtaWork w = cta_of_block<S::kM>(p, h);
  if (!w.active) return;
  const Sm sm(smem_raw);
  const int warp = int(warp_uniform(threadIdx.x / 32)), lane = int(threadIdx.x) % 32, wg = warp / 4;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);

  load_q<S, QL, T, kD>(p, w, h, sm.q);
  if (ck.tiles > 0) load_kv<S, KvL, T, kD, kDv>(p, kv, ck.n_begin, ck.end, sm.k(0), sm.v(0));
  cp_async_commit();

  const WarpKeys<S> wk(ck.rows, ck.n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
  const ScoreLog2 score(p);
  const ScoreBias<kAlibi> bias = make_score_bias<kAlibi>(p, w.b, h, score);
  const int64_t d0 = kAlibi ? bias_d0<S>(ck, warp, 0, lane) : 0;
  float o[1][kDo / 8][4] = {};
  float s[kN / 8][4] = {};
  uint32_t pa[kN / 16][4];
  uint32_t pl[kF32Out ? kN / 16 : 1][4];  // P's rounding residues (kF32Out)
  float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {};
  // Barrier j, then the copies of tile j + 1 into K stage (j + 1) % 2 and V stage vs_next.
  const auto next_tile = [&](int j, int vs_next) {
    landed_barrier<0>();  // K and V j, Q: complete and visible to wgmma
    if (j + 1 < ck.tiles)
      load_kv<S, KvL, T, kD, kDv>(p, kv, ck.n_begin + int64_t(j + 1) * kN, ck.end, sm.k(j + 1), sm.v(vs_next));
    cp_async_commit();
  };
  const auto softmax_tile = [&](int j, float (&alpha)[2]) {
    prefill::softmax_tile<S, kN>(wk, score, bias, d0, j, warp, lane, s, m[0], l[0], alpha);
  };
  const auto pack_p = [&] { prefill::pack_p<T, kN, kF32Out>(s, pa, pl); };
  if (ck.tiles > 0) {
    float alpha[2];
    int vs = 0;  // V stage of tile j - 1 in the loop, of the last tile after it
    next_tile(0, 1);
    issue_qk<T, kD, kN>(sm.q, sm.k(0), wg, s);
    wgmma_wait<0>();
    fence_operands(s);
    softmax_tile(0, alpha);  // o is still 0: no rescale
    pack_p();
    for (int j = 1; j < ck.tiles; ++j) {
      const int vs_j = mod3_next(vs);
      next_tile(j, mod3_next(vs_j));
      issue_qk<T, kD, kN>(sm.q, sm.k(j), wg, s);
      issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(vs), o[0]);
      wgmma_wait<1>();
      fence_operands(s);
      softmax_tile(j, alpha);
      wgmma_wait<0>();  // P(j-1) V(j-1) added: pa free, o final for it
      fence_operands(o[0]);
      rescale_o<kDo>(o[0], alpha);
      pack_p();
      vs = vs_j;
    }
    issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(vs), o[0]);
    wgmma_wait<0>();
    fence_operands(o[0]);
  }
  cp_async_wait<0>();
  __syncthreads();  // Q landed (no tiles); no warpgroup's MMA still reads Q rows
  store_rows<S, QL, T, kDo, kDv, std::conditional_t<kF32Out, float, T>>(p, w, h, split, o, m, l, score.exp_mul, sm.q,
                                                                        warp, lane);
#endif
}

}  // namespace flashserve::kernels::prefill
