// The sm_90a warp-specialized prefill kernel (FlashAttention-3's design, our way): a producer
// warp loads Q, K and V tiles with TMA into 128-byte-swizzled shared memory through mbarrier
// pipelines, while two consumer warpgroups run prefill_wgmma's mainloop (S = Q K^T and O += P V
// on wgmma, the softmax of tile j overlapping P V of tile j - 1) in ping-pong: named barriers
// hand the tensor cores from one warpgroup to the other, so one warpgroup's softmax runs while
// the other's GEMMs do. Serves prefill_wgmma's scope for contiguous K/V (select.cu:
// try_prefill_tma); paged caches stay on prefill_wgmma.
//
// CTA: 384 threads = consumer warpgroups 0, 1 (threads 0-255: rows 64 wg .. 64 wg + 63, the
// TileShape of prefill_wgmma) + the producer warpgroup 2 (one warp works, 40 registers; the
// consumers take 232 with setmaxnreg). Persistent: one CTA per SM walks work items (128 query
// rows of one sequence x head x split, prefill_common.cuh's cta_work) in cta_of_block's order,
// longest causal rows first, so the producer loads the next item's K and V (and, with a separate
// O tile, its Q) while the consumers finish the last one: what a short item (S = 512, chunked
// and sliding-window rows of a few tiles) used to pay per CTA launch. The epilogue is
// store_rows, staged through the O tile (D = 256: the warp's own Q rows).
//
// Pipelines (mbarriers, 2 stages each): K full / empty, V full / empty; Q full / empty, one
// stage. Their stage and parity run on across items (TmaPipe). A full
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
  int64_t row_tiles = 0;  // 128-row tiles of the schedule (prefill_launch.cuh: row_tile_count)
  int64_t items = 0;      // work items: row_tiles x heads x splits
  uint32_t sched_slot = 0;  // the launch's counters in g_tma_sched (prefill_tma.cu)
  bool persistent = false;  // CTAs claim items (tma_claim); else one item per CTA, blockIdx.x
};

// The dynamic persistent schedule: items in cta_of_block's order (heads fastest, row tiles
// descending: the longest causal tiles first; splits slowest). CTA c starts with item c and then
// claims gridDim.x + the next count of a global counter, so the items in flight stay a
// contiguous window (the L2 locality and the load balance of the hardware's own CTA dispatch; a
// static c, c + gridDim.x, ... walk measured 15% slower at S = 2k causal: SMs 83% busy, L2 hits
// 60% vs 78%). Counters: claims and CTAs done; the last CTA done zeroes both, so the next
// launch on the slot (stream-ordered, or a graph replay) starts from zero. The mailbox holds
// each CTA's next item for its consumers (publish_item).
inline constexpr uint32_t kTmaSchedSlots = 64, kTmaMaxPersistentCtas = 256;
struct TmaSchedCounters {
  unsigned long long next, done;
  long long mailbox[kTmaMaxPersistentCtas];
};
// Zero at module load; each launch leaves its slot zero. Defined here: prefill_tma.cu, the one
// includer, holds every instantiation.
__device__ TmaSchedCounters g_tma_sched[kTmaSchedSlots];

FS_DEV int64_t tma_claim(const TmaAttnParams& tp) {
  return int64_t(atomicAdd(&g_tma_sched[tp.sched_slot].next, 1ull)) + gridDim.x;
}
FS_DEV void tma_sched_done(const TmaAttnParams& tp) {
  TmaSchedCounters& c = g_tma_sched[tp.sched_slot];
  if (atomicAdd(&c.done, 1ull) == gridDim.x - 1) {
    atomicExch(&c.next, 0ull);
    atomicExch(&c.done, 0ull);
  }
}

FS_DEV CtaWork tma_item(const TmaAttnParams& tp, int64_t u, int64_t& h, int& split) {
  const AttnParams& p = tp.p;
  const int64_t per_split = tp.row_tiles * p.num_heads, linear = u % per_split;
  split = int(u / per_split);
  h = linear % p.num_heads;
  return cta_work<kWgmmaRowsPerCta>(p, tp.row_tiles - 1 - linear / p.num_heads);
}

// Shared memory: prefill_wgmma's [Q | K 0, 1 | V 0, 1] (two V stages: the empty barriers order
// the reuse), the epilogue's own [128, Dv] O tile where it fits (kSeparateO: then Q is free for
// the next item's load once the last Q K^T is done; else the epilogue stages O in Q's rows and Q
// is released after it), the rows' key ranges (int2 [128]) and 10 mbarriers. The layout rule is
// select.hpp's prefill_tma_smem_bytes (asserted equal).
template <int kD, int kDv>
struct TmaSmem {
  static constexpr int kN = wgmma_tile_keys(kD, kDv);
  using QL = SwizzledTile<kWgmmaRowsPerCta>;
  using KvL = SwizzledTile<kN>;
  static constexpr bool kSeparateO = prefill_tma_separate_o(kD, kDv);
  static constexpr uint32_t kQBytes = kWgmmaRowsPerCta * wgmma_tile_width(kD) * 2;
  static constexpr uint32_t kKBytes = kN * wgmma_tile_width(kD) * 2, kVBytes = kN * wgmma_tile_width(kDv) * 2;
  static constexpr uint32_t kOBytes = kSeparateO ? kWgmmaRowsPerCta * wgmma_tile_width(kDv) * 2 : 0;
  static constexpr uint32_t kTiles = kQBytes + 2 * kKBytes + 2 * kVBytes + kOBytes;
  static constexpr uint32_t kBytes = 1024 + kTiles + kWgmmaRowsPerCta * 8 + kTmaSyncWords * 8;
  static_assert(kBytes == prefill_tma_smem_bytes(kD, kDv), "select.hpp's rule");
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
  FS_DEV uint32_t o() const { return kSeparateO ? q + kQBytes + 2 * kKBytes + 2 * kVBytes : q; }
  FS_DEV uint32_t q_full() const { return bars; }
  FS_DEV uint32_t q_empty() const { return bars + 8; }
  FS_DEV uint32_t k_full(int st) const { return bars + 16 + 8 * st; }
  FS_DEV uint32_t k_empty(int st) const { return bars + 32 + 8 * st; }
  FS_DEV uint32_t v_full(int st) const { return bars + 48 + 8 * st; }
  FS_DEV uint32_t v_empty(int st) const { return bars + 64 + 8 * st; }
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

// The pipelines' position, shared by producer and consumers: KV tiles walked so far (tile `it`
// uses stage it & 1 in pass it >> 1) and work items begun (Q's pass).
struct TmaPipe {
  uint32_t it = 0, items = 0;
  FS_DEV int stage() const { return int(it & 1); }
  FS_DEV uint32_t pass() const { return (it >> 1) & 1; }
};

// The item handed from the producer warp to the consumer warpgroups through the CTA's global
// mailbox (racecheck cannot follow a shared slot ordered by bar.arrive), ordered by two named
// barriers of 256 + 32 threads: kItemFull (the producer arrives after writing, the consumers
// wait before reading) and kItemEmpty (the consumers arrive after reading, the producer waits
// before the next write). u < 0: no item left.
inline constexpr int kItemFull = 3, kItemEmpty = 4, kItemThreads = 256 + 32;

FS_DEV volatile long long& mailbox(const TmaAttnParams& tp) {
  return const_cast<volatile long long&>(g_tma_sched[tp.sched_slot].mailbox[blockIdx.x]);
}

FS_DEV void publish_item(const TmaAttnParams& tp, int64_t u, uint32_t n, int lane) {
  if (n > 0) named_sync(kItemEmpty, kItemThreads);
  if (lane == 0) mailbox(tp) = static_cast<long long>(u);
  named_arrive(kItemFull, kItemThreads);
}

FS_DEV int64_t receive_item(const TmaAttnParams& tp) {
  named_sync(kItemFull, kItemThreads);
  const int64_t u = mailbox(tp);
  if (u >= 0) named_arrive(kItemEmpty, kItemThreads);  // the end is the last read
  return u;
}

// Q of the next item once the consumers released the last one (q_empty), on q_full.
template <int kD, int kDv>
FS_DEV void load_q(const TmaAttnParams& tp, const CtaWork& w, int64_t h, const TmaSmem<kD, kDv>& sm, TmaPipe& pipe,
                   int lane) {
  using Sm = TmaSmem<kD, kDv>;
  if (pipe.items > 0) mbar_wait(sm.q_empty(), (pipe.items - 1) & 1);
  ++pipe.items;
  if (lane != 0) return;
  mbar_arrive_expect_tx(sm.q_full(), Sm::kQBytes);
#pragma unroll
  for (int c = 0; c < wgmma_tile_width(kD) / 64; ++c)
    tma_load_4d(sm.q + uint32_t(c) * Sm::QL::kBlockBytes, &tp.q, sm.q_full(), 64 * c, int(h), int(w.q_row0),
                int(w.qb));
}

// The producer warp's K and V of an item: every tile into the stage its consumers released, by
// TMA where the whole tile lies in the sequence and the cache, else copy_tail. The next item's
// K and V start while the consumers still finish this one.
template <class T, int kD, int kDv>
FS_DEV void produce_kv(const TmaAttnParams& tp, const CtaWork& w, int64_t h, int split, const TmaSmem<kD, kDv>& sm,
                       TmaPipe& pipe, int lane) {
  using Sm = TmaSmem<kD, kDv>;
  constexpr int kN = Sm::kN;
  const AttnParams& p = tp.p;
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);
  const int64_t sk = kv_len(p, w.b);
  const KeyRange cache = generic::cache_tokens(p, kv);
  for (int j = 0; j < ck.tiles; ++j, ++pipe.it) {
    const int st = pipe.stage();
    const uint32_t parity = pipe.pass() ^ 1u;
    const int64_t n0 = ck.n_begin + int64_t(j) * kN;
    const bool whole = n0 >= cache.lo && n0 + kN <= imin(sk, cache.hi);
    const int row = int(kv.k_begin + n0);
    if (pipe.it >= 2) mbar_wait(sm.k_empty(st), parity);
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
    if (pipe.it >= 2) mbar_wait(sm.v_empty(st), parity);
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

// The producer warp: the CTA's items (its first, then its claims; padding tiles of a varlen
// batch skipped), each published (publish_item), then its Q and its K and V; the next claim is
// in flight meanwhile. Then the end, and the counters' done count.
template <class T, int kD, int kDv>
FS_DEV void produce(const TmaAttnParams& tp, const TmaSmem<kD, kDv>& sm, int lane) {
  TmaPipe pipe;
  int64_t u = blockIdx.x;
  while (u < tp.items) {
    int64_t h, next = tp.items;
    int split;
    const CtaWork w = tma_item(tp, u, h, split);
    if (lane == 0 && tp.persistent) next = tma_claim(tp);
    if (w.active) {
      if (tp.persistent) publish_item(tp, u, pipe.items, lane);
      load_q(tp, w, h, sm, pipe, lane);
      produce_kv<T, kD, kDv>(tp, w, h, split, sm, pipe, lane);
    }
    u = __shfl_sync(kFullMask, next, 0);
  }
  if (!tp.persistent) return;
  publish_item(tp, -1, pipe.items, lane);
  if (lane == 0) tma_sched_done(tp);
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

// One consumer warpgroup's item: the rows' keys, Q, then S = Q K^T and O += P V over the tiles
// in ping-pong with the other warpgroup (the softmax of tile j between the GEMMs of j + 1 and
// P V of j), Q released once its last reader is done, and the epilogue.
template <class T, int kD, int kDv, bool kF32Out, bool kAlibi>
FS_DEV void consume_item(const AttnParams& p, const CtaWork& w, int64_t h, int split, const TmaSmem<kD, kDv>& sm,
                         TmaPipe& pipe, int warp, int lane) {
  using S = Wgmma90<kD, kDv>;
  using Sm = TmaSmem<kD, kDv>;
  constexpr int kN = S::kN, kDo = wgmma_tile_width(kDv);
  const int wg = warp / 4;
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);
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
  if (ck.tiles > 0) {
    float alpha[2];
    if (wg == 1) named_arrive(1, 2 * 128);  // opens warpgroup 0's first turn
    mbar_wait(sm.k_full(pipe.stage()), pipe.pass());
    turn.my_turn();
    issue_qk<T, kD, kN>(sm.q, sm.k(pipe.stage()), wg, s);
    turn.hand_over(false);
    wgmma_wait<0>();
    fence_operands(s);
    release(sm.k_empty(pipe.stage()), lane);
    softmax_tile(0, alpha);
    pack_p();
    for (int j = 1; j < ck.tiles; ++j) {
      const TmaPipe prev = pipe;
      ++pipe.it;
      mbar_wait(sm.k_full(pipe.stage()), pipe.pass());
      mbar_wait(sm.v_full(prev.stage()), prev.pass());
      turn.my_turn();
      issue_qk<T, kD, kN>(sm.q, sm.k(pipe.stage()), wg, s);
      issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(prev.stage()), o[0]);
      turn.hand_over(false);
      wgmma_wait<1>();
      fence_operands(s);
      release(sm.k_empty(pipe.stage()), lane);
      softmax_tile(j, alpha);
      wgmma_wait<0>();
      fence_operands(o[0]);
      release(sm.v_empty(prev.stage()), lane);
      rescale_o<kDo>(o[0], alpha);
      pack_p();
    }
    if (Sm::kSeparateO) release(sm.q_empty(), lane);  // the last Q K^T is done
    mbar_wait(sm.v_full(pipe.stage()), pipe.pass());
    turn.my_turn();
    issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(pipe.stage()), o[0]);
    turn.hand_over(true);
    wgmma_wait<0>();
    fence_operands(o[0]);
    release(sm.v_empty(pipe.stage()), lane);
    ++pipe.it;
  } else if (Sm::kSeparateO) {
    release(sm.q_empty(), lane);
  }
  store_rows<S, typename Sm::QL, T, kDo, kDv, std::conditional_t<kF32Out, float, T>>(p, w, h, split, o, m, l,
                                                                                     score.exp_mul, sm.o(), warp, lane);
  if (!Sm::kSeparateO) {  // O was staged in Q's rows: the next Q (async proxy) after these writes
    fence_proxy_async_shared();
    __syncwarp();
    release(sm.q_empty(), lane);
  }
}

// CTA: persistent over the items the producer publishes (launch: one CTA per SM, at most one per
// item).
template <class T, int kD, int kDv, bool kF32Out, bool kAlibi>
__global__ void __launch_bounds__(kTmaThreads, 1) prefill_tma(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Wgmma90<kD, kDv>;
  using Sm = TmaSmem<kD, kDv>;
  // D = 96: the second box's channels past D load as zeros (tma_map.cuh); copy_tail leaves them
  // stale, which QK^T (D in k16 steps) never reads and P V only adds into unstored channels.
  static_assert(kD % 16 == 0 && kDv % 8 == 0 && kDv <= wgmma_tile_width(kD), "k16 steps; out staged in Q's rows");
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm sm(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    mbar_init(sm.q_full(), 1);
    mbar_init(sm.q_empty(), S::kWarps);
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
    if (warp == 8) produce<T, kD, kDv>(tp, sm, lane);
    return;
  }
  regs_alloc<kTmaConsumerRegs>();
  TmaPipe pipe;
  for (bool first = true;; first = false) {
    const int64_t u = tp.persistent ? receive_item(tp) : first ? int64_t(blockIdx.x) : -1;
    if (u < 0) break;
    int64_t h;
    int split;
    const CtaWork w = tma_item(tp, u, h, split);
    if (!w.active) continue;  // a varlen batch's padding tile (never published when persistent)
    mbar_wait(sm.q_full(), pipe.items & 1);
    ++pipe.items;
    consume_item<T, kD, kDv, kF32Out, kAlibi>(p, w, h, split, sm, pipe, warp, lane);
  }
#endif
}

}  // namespace flashserve::kernels::prefill
