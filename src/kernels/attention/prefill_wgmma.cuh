// The sm_90a tensor-core prefill kernel: the FlashAttention-2 loop of prefill_fwd.cuh with both
// GEMMs on warpgroup MMA (wgmma.mma_async), operands read by the tensor cores straight from
// 128-byte-swizzled shared memory (no ldmatrix). Serves what prefill_mma serves (select.cu:
// f16/bf16, D == Dv in kPrefillWgmmaConfigs, causal / window / soft-cap, contiguous or paged KV
// of any block size, GQA, any split count) on compute capability 9.0 when the build has sm_90a.
//
// CTA: 128 query rows of one sequence x one query head x one KV split (the schedule of
// prefill_common.cuh); 2 warpgroups of 64 rows, 256 threads, one CTA per SM. KV tiles of N keys
// (128; 64 for D > 128), K and V double-buffered, copied by all 256 threads with cp.async (each
// KV row located on its own, as prefill_mma), one barrier per tile after the async-proxy fence.
// Per tile each warpgroup:
//   S [64, N] = Q K^T:  D / 16 wgmma m64nNk16, A = Q and B = K from shared memory (K-major);
//   the online softmax of prefill_common.cuh on S (the accumulator layout of wgmma per warp is
//   mma.sync's), masks only on tiles some row of the warpgroup sees partly, tiles no row of it
//   sees skipped;
//   O [64, D] += P V: N / 16 wgmma m64nDk16, A = P from registers (rounded to the operand
//   dtype), B = V from shared memory N-major (the transpose is the descriptor's).
// The epilogue is prefill_mma's (prefill_common.cuh: out through the warp's own Q rows, or the
// fp32 partials).
//
// Arithmetic per 128-key tile (D = 128; H200 SM: 4096 dense bf16 FLOP/clk = 990 TFLOP/s):
//   2 GEMMs x 128 x 128 x 128 x 2 = 8.4 MFLOP = 2048 clk at the dense rate; the softmax does
//   128 x 128 exp2 on 16 MUFU/clk = 1024 clk, plus ~4 FP32 ops per score on 128/clk = 512 clk.
//   With the barrier aligning the two warpgroups' softmax phases and no overlap of softmax with
//   MMA: ~2048 / (2048 + 1100) = 65% of peak at best, ~640 TFLOP/s; overlap (FlashAttention-3's
//   ping-pong and intra-warpgroup pipelining) is the next step.
//   Shared memory: wgmma reads each operand once per warpgroup: (Q 16 KB + K 32 KB + V 32 KB)
//   x 2 = 160 KB per tile = 1250 clk at 128 B/clk, under the MMA time.
//   Registers per thread: S N / 2 + O D / 2 fp32 (128 at D = 128), P N / 4, masks, state.
#pragma once

#include <cstdint>

#include "kernels/attention/prefill_common.cuh"
#include "kernels/common/wgmma.cuh"

namespace flashserve::kernels::prefill {

template <int kD>
using Wgmma90 = TileShape<kWgmmaRowsPerCta, wgmma_tile_keys(kD), kWgmmaWarps, 64>;

// Shared memory: [Q | K stage 0 | K stage 1 | V stage 0 | V stage 1 | rows' key ranges], the
// tiles SwizzledTile (wgmma.cuh) from a 1024-byte-aligned base.
template <int kD>
struct WgmmaSmem {
  static constexpr int kN = wgmma_tile_keys(kD);
  using QL = SwizzledTile<kWgmmaRowsPerCta>;
  using KvL = SwizzledTile<kN>;
  static constexpr uint32_t kQBytes = kWgmmaRowsPerCta * kD * 2, kTileBytes = kN * kD * 2;
  static constexpr uint32_t kBytes = kQBytes + 4 * kTileBytes;
  uint32_t q;
  unsigned char* ranges;  // int2 [128]
  FS_DEV explicit WgmmaSmem(unsigned char* raw) {
    const uint32_t base = smem_u32(raw), aligned = (base + 1023u) & ~1023u;
    q = aligned;
    ranges = raw + (aligned - base) + kBytes;
  }
  FS_DEV uint32_t k(int j) const { return q + kQBytes + uint32_t(j & 1) * kTileBytes; }
  FS_DEV uint32_t v(int j) const { return q + kQBytes + uint32_t(2 + (j & 1)) * kTileBytes; }
};

// S = Q K^T of the warpgroup's 64 rows (wg) over the tile at k_s.
template <class T, int kD, int kN>
FS_DEV void qk_wgmma(uint32_t q_s, uint32_t k_s, int wg, float (&s)[kN / 8][4]) {
  fence_operands(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
    wgmma_ss<T, kN>(s, desc_k_major<kWgmmaRowsPerCta>(q_s, 64 * wg, kk), desc_k_major<kN>(k_s, 0, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(s);
}

// O += P V over the tile at v_s, P = s (probabilities) rounded to T.
template <class T, int kD, int kN>
FS_DEV void pv_wgmma(const float (&s)[kN / 8][4], uint32_t v_s, float (&o)[kD / 8][4]) {
  uint32_t a[kN / 16][4];
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) p_fragment<T, kN>(s, kk, a[kk]);
  fence_operands(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) wgmma_rs<T, kD>(o, a[kk], desc_n_major<kN>(v_s, kk), 1);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(o);
}

template <class T, int kD>
__global__ void __launch_bounds__(kWgmmaThreads, 1) prefill_wgmma(const __grid_constant__ AttnParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Wgmma90<kD>;
  using Sm = WgmmaSmem<kD>;
  constexpr int kN = S::kN;
  static_assert(Sm::kBytes + 1024 + S::kM * sizeof(int2) == prefill_wgmma_smem_bytes(kD), "select.hpp sizes it");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  int64_t h;
  const CtaWork w = cta_of_block<S::kM>(p, h);
  if (!w.active) return;
  const Sm sm(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, wg = warp / 4;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);

  load_q<S, typename Sm::QL, T, kD>(p, w, h, sm.q);
  cp_async_commit();
  if (ck.tiles > 0) load_kv<S, typename Sm::KvL, T, kD>(p, kv, ck.n_begin, ck.end, sm.k(0), sm.v(0));
  cp_async_commit();

  const WarpKeys<S> wk(ck.rows, ck.n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
  const ScoreLog2 score(p);
  float o[1][kD / 8][4] = {};
  float s[kN / 8][4] = {};
  float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {};
  for (int j = 0; j < ck.tiles; ++j) {
    cp_async_wait<0>();
    fence_proxy_async_shared();  // this thread's copies and stores of tile j (and Q), to wgmma
    __syncthreads();             // tile j complete; every warpgroup is done with tile j - 1
    if (j + 1 < ck.tiles)
      load_kv<S, typename Sm::KvL, T, kD>(p, kv, ck.n_begin + int64_t(j + 1) * kN, ck.end, sm.k(j + 1), sm.v(j + 1));
    cp_async_commit();
    const int off = j * kN;
    if (wk.skips(off)) continue;  // no row of the warpgroup sees the tile (uniform in it)
    const bool masked = wk.masks(off);
    qk_wgmma<T, kD, kN>(sm.q, sm.k(j), wg, s);
    int lo[2] = {0, 0}, hi[2] = {kN, kN};
    if (masked) wk.tile_rows(0, off, warp, lane, lo, hi);
    softmax_block<kN, kD>(p, s, o[0], m[0], l[0], score, lo, hi, masked, lane & 3);
    pv_wgmma<T, kD, kN>(s, sm.v(j), o[0]);
  }
  cp_async_wait<0>();
  __syncthreads();  // Q landed (no tiles) and no warpgroup's MMA still reads Q rows
  store_rows<S, typename Sm::QL, T, kD>(p, w, h, split, o, m, l, score.exp_mul, sm.q, warp, lane);
#endif
}

}  // namespace flashserve::kernels::prefill
