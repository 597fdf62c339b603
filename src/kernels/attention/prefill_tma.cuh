// The sm_90a warp-specialized prefill kernel (FlashAttention-3's design, our way): a producer
// warp loads Q, K and V tiles with TMA into 128-byte-swizzled shared memory through mbarrier
// pipelines, while two consumer warpgroups run prefill_wgmma's mainloop (S = Q K^T and O += P V
// on wgmma, the softmax of tile j overlapping P V of tile j - 1) in ping-pong: named barriers
// hand the tensor cores from one warpgroup to the other, so one warpgroup's softmax runs while
// the other's GEMMs do. Serves prefill_wgmma's scope for contiguous K/V (select.cu:
// try_prefill_tma); paged caches stay on prefill_wgmma.
//
// CTA: 384 threads = consumer warpgroups 0, 1 (threads 0-255: rows 64 wg .. 64 wg + 63, the
// TileShape and epilogue of prefill_wgmma) + the producer warpgroup 2 (one warp works, 24
// registers; the consumers take 240 with setmaxnreg). The CTA schedule (prefill_common.cuh:
// 128 query rows of one sequence x head x split) and the epilogue (store_rows, through the
// warp's own Q rows) are prefill_wgmma's.
//
// Pipelines (mbarriers, 2 stages each): K full / empty, V full / empty, and Q full. A full
// barrier completes on the producer's arrival plus the TMA bytes; an empty one on one arrival
// per consumer warp after its wgmma reading the stage completed. A tile whose keys leave the
// sequence or the cache (the last of a CTA, or bad metadata) is copied by the producer warp with
// cp.async instead (keys outside the cache NaN, values zero; tokens past the sequence zero), as
// prefill_common.cuh's copies do, so garbage past a sequence never meets P = 0 in P V.
//
// Per 128-key tile at D = 128 (H200 SM: 4096 dense bf16 FLOP/clk): 2 GEMMs x 64 x 128 x 128 x 2
// per warpgroup = 4.2 MFLOP = 1024 clk of the tensor pipe per warpgroup; the softmax of one
// warpgroup (64 x 128 exp2 on 16 MUFU/clk = 512 clk, ~256 clk of FP32) hides under the other's
// GEMMs, so the tensor pipe is the bound: ~2048 clk per tile for both, ~90% of peak predicted
// if TMA keeps up (64 KB per tile per 2048 clk = 32 B/clk per SM, 4.2 TB/s over 132 SMs at
// 1.98 GHz... served mostly from L2: heads of one KV head share it).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/attention/prefill_wgmma.cuh"
#include "kernels/common/tma.cuh"

namespace flashserve::kernels::prefill {

inline constexpr int kTmaThreads = 384;
inline constexpr int kTmaConsumerRegs = 232, kTmaProducerRegs = 40;

// The kernel's parameters: the operands' tensor maps next to AttnParams.
struct TmaAttnParams {
  CUtensorMap q, k, v;  // make_tma_map: boxes of 128 query rows / kN keys x 64 channels
  AttnParams p;
};

// Shared memory: prefill_wgmma's [Q | K 0, 1 | V 0, 1] (two V stages: the empty barriers order
// the reuse), then the rows' key ranges (int2 [128]) and the mbarriers.
template <int kD, int kDv>
struct TmaSmem {
  static constexpr int kN = wgmma_tile_keys(kD, kDv);
  using QL = SwizzledTile<kWgmmaRowsPerCta>;
  using KvL = SwizzledTile<kN>;
  static constexpr uint32_t kQBytes = kWgmmaRowsPerCta * wgmma_tile_width(kD) * 2;
  static constexpr uint32_t kKBytes = kN * wgmma_tile_width(kD) * 2, kVBytes = kN * wgmma_tile_width(kDv) * 2;
  static constexpr uint32_t kTiles = kQBytes + 2 * kKBytes + 2 * kVBytes;
  static constexpr uint32_t kBytes = 1024 + kTiles + kWgmmaRowsPerCta * 8 + 9 * 8;
  uint32_t q, bars;
  unsigned char* ranges;
  FS_DEV explicit TmaSmem(unsigned char* raw) {
    const uint32_t base = smem_u32(raw), aligned = (base + 1023u) & ~1023u;
    q = aligned;
    ranges = raw + (aligned - base) + kTiles;
    bars = aligned + kTiles + kWgmmaRowsPerCta * 8;
  }
  FS_DEV uint32_t k(int st) const { return q + kQBytes + uint32_t(st) * kKBytes; }
  FS_DEV uint32_t v(int st) const { return q + kQBytes + 2 * kKBytes + uint32_t(st) * kVBytes; }
  FS_DEV uint32_t q_full() const { return bars; }
  FS_DEV uint32_t k_full(int st) const { return bars + 8 + 8 * st; }
  FS_DEV uint32_t k_empty(int st) const { return bars + 24 + 8 * st; }
  FS_DEV uint32_t v_full(int st) const { return bars + 40 + 8 * st; }
  FS_DEV uint32_t v_empty(int st) const { return bars + 56 + 8 * st; }
};

template <int kD, int kDv>
constexpr size_t prefill_tma_smem_bytes_of() {
  return TmaSmem<kD, kDv>::kBytes;
}

// The producer's cp.async copy of one tile (kC 16-byte chunks per row, rows of `src`) for keys
// [n0, n0 + kN): tokens outside the cache NaN keys (kNanOutside) or zero values, tokens past
// the sequence zero; then the stage is published on `full`.
template <class T, class L, int kN, int kC, bool kNanOutside>
FS_DEV void copy_tail(const AttnParams& p, const StridedRef& src, const SeqKv& kv, const KeyRange& cache, int64_t sk,
                      int64_t n0, uint32_t dst, uint32_t full, int lane) {
  const T* base = static_cast<const T*>(src.data);
#pragma unroll 1  // the producer runs on 32 registers
  for (int idx = lane; idx < kN * kC; idx += 32) {
    const int row = idx / kC, c = idx % kC;
    const int64_t t = n0 + row;
    const uint32_t at = dst + L::at(row, c);
    if (t < cache.lo || t >= cache.hi) {
      const uint32_t x = kNanOutside ? (std::is_same_v<T, __half> ? 0x7e007e00u : 0x7fc07fc0u) : 0u;
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(x) : "memory");
      continue;
    }
    const bool in = t < sk;
    const T* from = base + (in ? kv.kb * src.stride[0] + (kv.k_begin + t) * src.stride[1] + kv.g * src.stride[2] + c * 8 : 0);
    cp_async_16(at, from, in);
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_shared();  // the generic-proxy writes, visible to wgmma
  __syncwarp();
  if (lane == 0) mbar_arrive(full);
}

// The producer warp: Q once, then K and V of every tile into the stage (j % 2) its consumers
// released, by TMA where the whole tile lies in the sequence and the cache, else copy_tail.
template <class T, int kD, int kDv>
FS_DEV void produce(const TmaAttnParams& tp, const CtaWork& w, int64_t h, const SeqKv& kv, const CtaKeys& ck,
                    const TmaSmem<kD, kDv>& sm, int lane) {
  using Sm = TmaSmem<kD, kDv>;
  constexpr int kN = Sm::kN;
  const AttnParams& p = tp.p;
  if (lane == 0) {
    mbar_arrive_expect_tx(sm.q_full(), Sm::kQBytes);
#pragma unroll
    for (int c = 0; c < wgmma_tile_width(kD) / 64; ++c)
      tma_load_4d(sm.q + uint32_t(c) * Sm::QL::kBlockBytes, &tp.q, sm.q_full(), 64 * c, int(h), int(w.q_row0),
                  int(w.qb));
  }
  const int64_t sk = kv_len(p, w.b);
  const KeyRange cache = generic::cache_tokens(p, kv);
  for (int j = 0; j < ck.tiles; ++j) {
    const int st = j & 1;
    const uint32_t parity = uint32_t((j >> 1) & 1) ^ 1u;
    const int64_t n0 = ck.n_begin + int64_t(j) * kN;
    const bool whole = n0 >= cache.lo && n0 + kN <= imin(sk, cache.hi);
    const int row = int(kv.k_begin + n0);
    if (j >= 2) mbar_wait(sm.k_empty(st), parity);
    if (whole) {
      if (lane == 0) {
        mbar_arrive_expect_tx(sm.k_full(st), Sm::kKBytes);
#pragma unroll
        for (int c = 0; c < wgmma_tile_width(kD) / 64; ++c)
          tma_load_4d(sm.k(st) + uint32_t(c) * Sm::KvL::kBlockBytes, &tp.k, sm.k_full(st), 64 * c, int(kv.g), row,
                      int(kv.kb));
      }
    } else {
      copy_tail<T, typename Sm::KvL, kN, kD / 8, true>(p, p.k, kv, cache, sk, n0, sm.k(st), sm.k_full(st), lane);
    }
    if (j >= 2) mbar_wait(sm.v_empty(st), parity);
    if (whole) {
      if (lane == 0) {
        mbar_arrive_expect_tx(sm.v_full(st), Sm::kVBytes);
#pragma unroll
        for (int c = 0; c < wgmma_tile_width(kDv) / 64; ++c)
          tma_load_4d(sm.v(st) + uint32_t(c) * Sm::KvL::kBlockBytes, &tp.v, sm.v_full(st), 64 * c, int(kv.g), row,
                      int(kv.kb));
      }
    } else {
      copy_tail<T, typename Sm::KvL, kN, kDv / 8, false>(p, p.v, kv, cache, sk, n0, sm.v(st), sm.v_full(st), lane);
    }
  }
}

// Ping-pong: warpgroup wg waits for its turn (named barrier 1 + wg) before issuing its GEMMs
// and hands the turn over after (the other warpgroup's barrier). Both walk the same tiles, so
// with warpgroup 1 opening warpgroup 0's first turn and skipping its last hand-over, every
// barrier sees as many arrivals as waits.
struct PingPong {
  int wg;
  FS_DEV void my_turn() const { named_sync(1 + wg, 2 * 128); }
  FS_DEV void hand_over(bool last) const {
    if (!(wg == 1 && last)) named_arrive(2 - wg, 2 * 128);
  }
};

// One consumer warp's release of a stage: its lane 0 arrives once its wgmma reading it is done.
FS_DEV void release(uint32_t empty, int lane) {
  if (lane == 0) mbar_arrive(empty);
}

template <class T, int kD, int kDv, bool kF32Out, bool kAlibi>
__global__ void __launch_bounds__(kTmaThreads, 1) prefill_tma(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Wgmma90<kD, kDv>;
  using Sm = TmaSmem<kD, kDv>;
  using QL = typename Sm::QL;
  constexpr int kN = S::kN, kDo = wgmma_tile_width(kDv);
  // D = 96: the second box's channels past D load as zeros (tma_map.cuh); copy_tail leaves them
  // stale, which QK^T (D in k16 steps) never reads and P V only adds into unstored channels.
  static_assert(kD % 16 == 0 && kDv % 8 == 0 && kDv <= wgmma_tile_width(kD), "k16 steps; out staged in Q's rows");
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  int64_t h;
  const CtaWork w = cta_of_block<S::kM>(p, h);
  if (!w.active) return;
  const Sm sm(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, wg = warp / 4;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);
  if (threadIdx.x == 0) {
    mbar_init(sm.q_full(), 1);
    for (int st = 0; st < 2; ++st) {
      mbar_init(sm.k_full(st), 1);
      mbar_init(sm.v_full(st), 1);
      mbar_init(sm.k_empty(st), S::kWarps);
      mbar_init(sm.v_empty(st), S::kWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (wg == 2) {  // the producer warpgroup
    regs_dealloc<kTmaProducerRegs>();
    if (warp == 8) produce<T, kD, kDv>(tp, w, h, kv, ck, sm, lane);
    return;
  }
  regs_alloc<kTmaConsumerRegs>();
  const WarpKeys<S> wk(ck.rows, ck.n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
  const ScoreLog2 score(p);
  const ScoreBias<kAlibi> bias = make_score_bias<kAlibi>(p, w.b, h, score);
  const int64_t d0 = kAlibi ? bias_d0<S>(ck, warp, 0, lane) : 0;
  const PingPong turn{wg};
  float o[1][kDo / 8][4] = {};
  float s[kN / 8][4] = {};
  uint32_t pa[kN / 16][4];
  uint32_t pl[kF32Out ? kN / 16 : 1][4];
  float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {};
  const auto softmax_tile = [&](int j, float (&alpha)[2]) {
    prefill::softmax_tile<S, kN>(p, wk, score, bias, d0, j, warp, lane, s, m[0], l[0], alpha);
  };
  const auto pack_p = [&] { prefill::pack_p<T, kN, kF32Out>(s, pa, pl); };
  const auto parity = [](int j) { return uint32_t((j >> 1) & 1); };
  mbar_wait(sm.q_full(), 0);
  if (ck.tiles > 0) {
    float alpha[2];
    if (wg == 1) named_arrive(1, 2 * 128);  // opens warpgroup 0's first turn
    mbar_wait(sm.k_full(0), 0);
    turn.my_turn();
    issue_qk<T, kD, kN>(sm.q, sm.k(0), wg, s);
    turn.hand_over(false);
    wgmma_wait<0>();
    fence_operands(s);
    release(sm.k_empty(0), lane);
    softmax_tile(0, alpha);
    pack_p();
    for (int j = 1; j < ck.tiles; ++j) {
      const int st = j & 1, prev = st ^ 1;
      mbar_wait(sm.k_full(st), parity(j));
      mbar_wait(sm.v_full(prev), parity(j - 1));
      turn.my_turn();
      issue_qk<T, kD, kN>(sm.q, sm.k(st), wg, s);
      issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(prev), o[0]);
      turn.hand_over(false);
      wgmma_wait<1>();
      fence_operands(s);
      release(sm.k_empty(st), lane);
      softmax_tile(j, alpha);
      wgmma_wait<0>();
      fence_operands(o[0]);
      release(sm.v_empty(prev), lane);
      rescale_o<kDo>(o[0], alpha);
      pack_p();
    }
    const int last = (ck.tiles - 1) & 1;
    mbar_wait(sm.v_full(last), parity(ck.tiles - 1));
    turn.my_turn();
    issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(last), o[0]);
    turn.hand_over(true);
    wgmma_wait<0>();
    fence_operands(o[0]);
  }
  store_rows<S, QL, T, kDo, kDv, std::conditional_t<kF32Out, float, T>>(p, w, h, split, o, m, l, score.exp_mul, sm.q,
                                                                        warp, lane);
#endif
}

}  // namespace flashserve::kernels::prefill
