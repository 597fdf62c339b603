// prefill_tma as a persistent kernel (sm_90a): one CTA per SM walks the (row tile, head, split)
// items of prefill_tma's grid in its order (longest causal tiles first, heads fastest): CTA c of
// G its item c first, then the next untaken one, G + a ticket from a global counter (as the
// hardware hands one-CTA-per-item grids to whichever SM frees first: taking items c, c + G, ...
// instead, the forms ran 1.03-1.70x the time of one CTA per item on an H100, the more where items
// differ, causal D = 256 S = 2k 1.70x, non-causal D = 128 S = 2k 1.05x; a CTA's share of causal
// items varies by ~+-14% and the GPCs' SMs run ~12% apart), so that what one-CTA-per-item leaves
// serialized on an SM overlaps the previous item's work:
// - the producer warp computes item i + 1's work (the row-tile lookup, the KV lengths and key
//   range: a chain of dependent metadata loads) while the consumers run item i's last tiles, and
//   hands it to them through shared memory (two item slots, mbarriers item_full / item_empty);
// - item i + 1's Q loads as soon as item i's last S = Q K^T is complete (q_empty), during the
//   last softmax, P V and the epilogue, and its first K / V tiles as soon as stages free: the
//   K / V pipelines run on across items (their stages and phases count the CTA's tiles);
// - the ping-pong runs on across items (PingPong's kChain), so warpgroup 0 starts item i + 1's
//   first S while warpgroup 1 finishes item i;
// - the epilogue writes out from registers (store_rows' kDirect), not through Q's rows.
// What it is for: short sequences, where a CTA's few tiles do not amortize its start (CTA launch,
// the metadata chain, Q's and the first tiles' latency: ~3-5 us against ~1.5 us per 128-key
// tile at D = 128) and its epilogue. The launchers take it where a CTA's keys are few
// (select.hpp: prefill_tma_persistent_ctas); the mainloop, producer, masks, modifiers and
// epilogue are prefill_tma's (prefill_tma_persistent) or prefill_fp8's (prefill_fp8_persistent,
// the item carrying its descales).
#pragma once

#include "kernels/attention/prefill_fp8.cuh"

namespace flashserve::kernels::prefill {

// One item as the producer hands it to the consumers (fp8: its descales too).
struct TmaItem {
  bool end = false;  // past the last item: the consumers stop
  CtaWork w;
  CtaKeys ck;
  int64_t h = 0;
  int split = 0;
  float qk_desc = 1.0f, v_desc = 1.0f;  // prefill_fp8: q_descale x k_descale, v_descale of (b, h / group)
};

// A kernel's shared memory (Base: TmaSmem or Fp8Smem), then 5 mbarriers (item_full and
// item_empty per slot, q_empty), the two item slots and two ticket slots (the producer warps'
// next item, shared_item).
template <class Base>
struct PersistSmem : Base {
  static constexpr uint32_t kBytes = Base::kBytes + uint32_t(kPersistentSmemBytes);
  static_assert(sizeof(TmaItem) <= kTmaItemSlotBytes && kTmaItemSlotBytes % 8 == 0, "item slots (select.hpp)");
  uint32_t xbars;
  unsigned char* slots;
  FS_DEV explicit PersistSmem(unsigned char* raw) : Base(raw) {
    xbars = Base::bars + Base::kBars * 8;  // past the base's mbarriers (8-byte aligned)
    slots = raw + (xbars - smem_u32(raw)) + 5 * 8;
  }
  FS_DEV TmaItem& item(int slot) const { return *reinterpret_cast<TmaItem*>(slots + slot * kTmaItemSlotBytes); }
  FS_DEV int64_t& ticket(int slot) const {
    return *reinterpret_cast<int64_t*>(slots + 2 * kTmaItemSlotBytes + 8 * slot);
  }
  FS_DEV uint32_t item_full(int slot) const { return xbars + 8 * slot; }
  FS_DEV uint32_t item_empty(int slot) const { return xbars + 16 + 8 * slot; }
  FS_DEV uint32_t q_empty() const { return xbars + 32; }
  // The walk's mbarriers (one thread; consumer_warps: the consumers' warps).
  FS_DEV void init_walk_bars(uint32_t consumer_warps) const {
    mbar_init(q_empty(), consumer_warps);
    for (int slot = 0; slot < 2; ++slot) {
      mbar_init(item_full(slot), 1);
      mbar_init(item_empty(slot), consumer_warps);
    }
  }
};

template <int kD, int kDv, int kM = kWgmmaRowsPerCta>
constexpr size_t prefill_persistent_smem_bytes_of() {
  return PersistSmem<TmaSmem<kD, kDv, kM>>::kBytes;
}

// Item L of prefill_tma's (row tiles, heads, splits) grid in cta_of_block's order. Sets h and
// split. Warp-collective (cta_work).
template <int kM>
FS_DEV CtaWork item_work(const AttnParams& p, int64_t L, int64_t row_tiles, int64_t& h, int& split) {
  const int64_t per_split = row_tiles * p.num_heads, linear = L % per_split;
  split = int(L / per_split);
  h = linear % p.num_heads;
  return cta_work<kM>(p, row_tiles - 1 - linear / p.num_heads);
}

// The walk's counters (this translation unit's persistent launches): [0] tickets taken past the
// CTAs' first items, [1] CTAs done taking them; the last CTA done resets both, so every launch
// finds them zero (a kernel boundary orders one launch's reset before the next launch's reads).
// Two launches of this unit's forms running at once, on two streams, would share them: the forms
// are an A/B switch (select.hpp: kPrefillPersistentMaxKeys 0), and the counters move into the
// call's workspace before any default takes them.
static __device__ unsigned g_walk_tickets[2];

// The item after those the CTA took: G + the next ticket (one atomic of lane 0, its value in
// lane 0).
FS_DEV unsigned take_ticket(int lane) { return lane == 0 ? gridDim.x + atomicAdd(&g_walk_tickets[0], 1u) : 0u; }

// After the CTA's last ticket (lane 0 of the warp that took them): the last CTA resets the
// counters.
FS_DEV void walk_done(int lane) {
  if (lane != 0) return;
  __threadfence();
  if (atomicAdd(&g_walk_tickets[1], 1u) == gridDim.x - 1) {
    atomicExch(&g_walk_tickets[0], 0u);
    atomicExch(&g_walk_tickets[1], 0u);
  }
}

// The named barrier of the producer warps that walk the items together (ids 1-3: the ping-pong).
inline constexpr int kWalkBar = 8;

// The producers' side of a walk: each item's work (every producer warp computes it: cta_work is
// warp-collective), which warp 0 hands to the consumers; Q of the active ones, once the previous
// item's S no longer reads Q.
template <int kM, int kN>
struct ItemProducer {
  const TmaAttnParams& tp;
  int lane;
  bool hands_over;  // the leader: takes the tickets and hands the items over
  int walkers = 1;  // producer warps walking the items (the leader among them)
  int nq = 0;       // Q loads so far
  // Item L's work (kFp8: with the descales); kv its sequence's KV (active items).
  template <bool kFp8>
  FS_DEV TmaItem make(int64_t L, SeqKv& kv) const {
    const AttnParams& p = tp.p;
    TmaItem it;
    it.w = item_work<kM>(p, L, p.row_tiles(kM), it.h, it.split);
    if (!it.w.active) return it;
    kv = seq_kv(p, it.w.b, it.h / p.group);
    it.ck = cta_keys<kN>(p, it.w, kv, it.split);
    if constexpr (kFp8) {
      it.qk_desc = load_f32_2d(p.q_descale, it.w.b, kv.g, 1.0f) * load_f32_2d(p.k_descale, it.w.b, kv.g, 1.0f);
      it.v_desc = load_f32_2d(p.v_descale, it.w.b, kv.g, 1.0f);
    }
    return it;
  }
  // The leader's value v (lane 0) in every walking warp's lanes, for item i.
  template <class Sm>
  FS_DEV int64_t shared_item(const Sm& sm, unsigned v, int i) const {
    if (walkers == 1) return __shfl_sync(kFullMask, v, 0);
    if (hands_over && lane == 0) sm.ticket(i & 1) = v;
    named_sync(kWalkBar, 32 * walkers);  // warps read slot i & 1 before the leader rewrites it at i + 2
    return sm.ticket(i & 1);
  }
  // The walk: items blockIdx.x, then the tickets' (the leader takes the next one while the
  // current item loads), each handed over; for the active ones load(it, kv, j0), j0 counting
  // the CTA's tiles before the item's; then the end, handed over too.
  template <bool kFp8, class T, int kW, class Sm, class Load>
  FS_DEV void walk(const Sm& sm, Load&& load) {
    const int64_t items = tp.p.row_tile_items(kM);
    int64_t L = blockIdx.x;
    unsigned next = hands_over ? take_ticket(lane) : 0u;
    int j0 = 0;
#pragma unroll 1
    for (int i = 0;; ++i) {
      SeqKv kv;
      TmaItem it;
      it.end = L >= items;
      if (!it.end) it = make<kFp8>(L, kv);
      hand_over<T, kW>(sm, it, i);
      if (it.end) break;
      if (it.w.active) {
        load(it, kv, j0);
        j0 += it.ck.tiles;
      }
      L = shared_item(sm, next, i);
      if (hands_over && L < items) next = take_ticket(lane);
    }
    if (hands_over) walk_done(lane);
  }
  // Item i into slot i % 2 once the consumers took item i - 2 from it; then, active, its Q.
  template <class T, int kW, class Sm>
  FS_DEV void hand_over(const Sm& sm, const TmaItem& it, int i) {
    if (!hands_over) return;
    const int slot = i & 1;
    if (i >= 2) mbar_wait(sm.item_empty(slot), uint32_t(((i >> 1) & 1) ^ 1));
    if (lane == 0) {
      sm.item(slot) = it;
      mbar_arrive(sm.item_full(slot));
    }
    if (!it.w.active) return;
    if (nq >= 1) mbar_wait(sm.q_empty(), uint32_t((nq - 1) & 1));
    if (lane == 0) load_q<T, kW>(tp, sm, it.w, it.h);
    ++nq;
  }
};

// The consumers' side: item i from its slot (released at once: the producer may refill it).
template <class Sm>
FS_DEV TmaItem take_item(const Sm& sm, int i, int lane) {
  const int slot = i & 1;
  mbar_wait(sm.item_full(slot), uint32_t((i >> 1) & 1));
  const TmaItem it = sm.item(slot);
  __syncwarp();  // every lane's reads of the slot precede the release
  release(sm.item_empty(slot), lane);
  return it;
}

// The consumers' walk: f(it, j0, q_ready) for every active item, j0 counting the CTA's tiles
// before it; q_ready() waits for the item's Q (and releases it at once when the item has no
// tiles: consume_tiles releases it after the last S otherwise).
template <class Sm, class F>
FS_DEV void consume_items(const Sm& sm, int lane, F&& f) {
  int nq = 0, j0 = 0;
#pragma unroll 1
  for (int i = 0;; ++i) {
    const TmaItem it = take_item(sm, i, lane);
    if (it.end) return;
    if (!it.w.active) continue;
    f(it, j0, [&] {
      mbar_wait(sm.q_full(), uint32_t(nq & 1));
      if (it.ck.tiles <= 0) release(sm.q_empty(), lane);  // Q not read
    });
    ++nq;
    j0 += it.ck.tiles;
  }
}

template <class T, int kD, int kDv, bool kF32Out, bool kAlibi, int kWgs = 2>
__global__ void __launch_bounds__(tma_threads(kWgs), 1)
    prefill_tma_persistent(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kWgs == 2 || (kWgs == 3 && prefill_tma_max_consumer_wgs(kD, kDv, kF32Out) == 3), "built shapes");
  using S = Wgmma90<kD, kDv, 64 * kWgs>;
  using Sm = PersistSmem<TmaSmem<kD, kDv, S::kM>>;
  using QL = typename Sm::QL;
  constexpr int kN = S::kN, kDo = wgmma_tile_width(kDv);
  static_assert(kD % 16 == 0 && kDv % 8 == 0 && kDv <= wgmma_tile_width(kD), "k16 steps");
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm sm(smem_raw);
  const bool split_load = Producer<T, kD, kDv, Sm>::split(p);
  if (threadIdx.x == 0) {
    tma_prefetch_desc(&tp.q);
    sm.init_bars(split_load ? kTmaParts : 1, S::kWarps);
    sm.init_walk_bars(S::kWarps);
    mbar_init_fence();
  }
  __syncthreads();
  const int warp = int(warp_uniform(threadIdx.x / 32)), lane = int(threadIdx.x) % 32, wg = warp / 4;
  if (wg == kWgs) {  // the producer warpgroup: warp 0, or 2 x kTmaParts warps where pages split a tile
    regs_dealloc<tma_producer_regs(kWgs)>();
    const int pw = warp - 4 * kWgs;
    if (pw >= (split_load ? 2 * kTmaParts : 1)) return;
    ItemProducer<S::kM, kN> ip{tp, lane, pw == 0, split_load ? 2 * kTmaParts : 1};
    ip.template walk<false, T, wgmma_tile_width(kD)>(sm, [&](const TmaItem& it, const SeqKv& kv, int j0) {
      const Producer<T, kD, kDv, Sm> pr(tp, it.w, kv, it.ck, sm, lane);
      if (!split_load) pr.run_both(j0);
      else if (pw < kTmaParts) pr.template run_operand<true>(pw, j0);
      else pr.template run_operand<false>(pw - kTmaParts, j0);
    });
    return;
  }
  regs_alloc<tma_consumer_regs(kWgs)>();
  const ScoreLog2 score(p);
  const StageBars bars{sm.k_full(0), sm.k_empty(0), sm.v_full(0), sm.v_empty(0), sm.pins + 4 * threadIdx.x};
  chain_open<kWgs>(wg);
  consume_items(sm, lane, [&](const TmaItem& it, int j0, const auto& q_ready) {
    const WarpKeys<S> wk(it.ck.rows, it.ck.n_begin, it.w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
    const ScoreBias<kAlibi> bias = make_score_bias<kAlibi>(p, it.w.b, it.h, score);
    const int64_t d0 = kAlibi ? bias_d0<S>(it.ck, warp, 0, lane) : 0;
    float o[1][kDo / 8][4] = {};
    float s[kN / 8][4] = {};
    uint32_t pa[kN / 16][4];
    uint32_t pl[kF32Out ? kN / 16 : 1][4];
    float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {}, alpha[2];
    q_ready();
    consume_tiles<kN == 128, kN / 8, kDo / 8, kWgs, true>(
        it.ck.tiles, wg, lane, bars, s, o[0], [&](int st) { issue_qk<T, kD, kN, S::kM>(sm.q, sm.k(st), wg, s); },
        [&](int st) { issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(st), o[0]); },
        [&](int j) {
          prefill::softmax_tile<S, kN>(wk, score, bias, d0, j, warp, lane, s, m[0], l[0], alpha, 0.0f,
                                       kDo >= 128 ? kLazyMax : 0.0f);
          return l[0][0] + l[0][1];
        },
        [&] { rescale_o<kDo>(o[0], alpha); }, [&] { prefill::pack_p<T, kN, kF32Out>(s, pa, pl); }, j0,
        sm.q_empty());
    store_rows<S, QL, T, kDo, kDv, std::conditional_t<kF32Out, float, T>, true>(p, it.w, it.h, it.split, o, m, l,
                                                                                score.exp_mul, sm.q, warp, lane);
  });
  chain_close(wg);
#endif
}

template <int kD, int kDv>
constexpr size_t prefill_fp8_persistent_smem_bytes_of() {
  return PersistSmem<Fp8Smem<kD, kDv>>::kBytes;
}

// prefill_fp8 as a persistent kernel: the same walk; its producer warpgroup loads and
// transposes every item's tiles (produce_fp8 with j0), the consumers take the descales from the
// item and write out from registers (the raw V stages, prefill_fp8's staging, hold the next
// item's V).
template <class T, class TOut, int kD, int kDv>
__global__ void __launch_bounds__(kTmaThreads, 1) prefill_fp8_persistent(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Wgmma90<kD, kDv>;
  using Sm = PersistSmem<Fp8Smem<kD, kDv>>;
  constexpr int kN = S::kN;
  using T16 = std::conditional_t<std::is_same_v<TOut, float>, __nv_bfloat16, TOut>;
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm sm(smem_raw);
  if (threadIdx.x == 0) {
    tma_prefetch_desc(&tp.q);
    sm.init_bars(S::kWarps);
    sm.init_walk_bars(S::kWarps);
    mbar_init_fence();
  }
  __syncthreads();
  const int warp = int(warp_uniform(threadIdx.x / 32)), lane = int(threadIdx.x) % 32, wg = warp / 4;
  if (wg == 2) {  // the producer warpgroup: every warp walks the items (produce_fp8's roles)
    regs_dealloc<kTmaProducerRegs>();
    ItemProducer<S::kM, kN> ip{tp, lane, warp == 8, 4};
    ip.template walk<true, T, kD>(sm, [&](const TmaItem& it, const SeqKv& kv, int j0) {
      produce_fp8<T, kD, kDv>(tp, it.w, kv, it.ck, sm, warp - 8, lane, j0);
    });
    return;
  }
  regs_alloc<kTmaConsumerRegs>();
  const StageBars bars{sm.k_full(0), sm.k_empty(0), sm.vt_full(0), sm.vt_empty(0), 0u};
  chain_open<2>(wg);
  consume_items(sm, lane, [&](const TmaItem& it, int j0, const auto& q_ready) {
    const WarpKeys<S> wk(it.ck.rows, it.ck.n_begin, it.w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
    const ScoreLog2 score(p, it.qk_desc);
    const NoBias bias;
    float o[1][kDv / 8][4] = {};
    float s[kN / 8][4] = {};
    uint32_t pa[kN / 32][4];
    float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {}, alpha[2];
    q_ready();
    consume_tiles<false, kN / 8, kDv / 8, 2, true>(
        it.ck.tiles, wg, lane, bars, s, o[0], [&](int st) { issue_qk_fp8<T, kD, kN>(sm.q, sm.k(st), wg, s); },
        [&](int st) { issue_pv_fp8<T, kDv, kN>(pa, sm.vt(st), o[0]); },
        [&](int j) {
          prefill::softmax_tile<S, kN>(wk, score, bias, 0, j, warp, lane, s, m[0], l[0], alpha, kFp8PShift, kFp8Lazy);
          return l[0][0] + l[0][1];
        },
        [&] { rescale_o<kDv>(o[0], alpha); }, [&] { pack_p_e4m3<kN>(s, pa); }, j0, sm.q_empty());
    store_rows<S, SwizzledTile<kWgmmaRowsPerCta>, T16, kDv, kDv, TOut, true>(
        p, it.w, it.h, it.split, o, m, l, score.exp_mul, sm.v(0), warp, lane, it.v_desc, kFp8PShift);
  });
  chain_close(wg);
#endif
}

}  // namespace flashserve::kernels::prefill
