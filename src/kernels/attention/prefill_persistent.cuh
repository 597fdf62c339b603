// prefill_tma as a persistent kernel (sm_90a): one CTA per SM walks the (row tile, head, split)
// items of prefill_tma's grid in its order (longest causal tiles first, heads fastest), items
// c, c + G, c + 2G, ... for CTA c of G, so that what one-CTA-per-item leaves serialized on an SM
// overlaps the previous item's work:
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
// tile at D = 128) and its epilogue. The launcher takes it where a CTA's keys are few
// (select.hpp: prefill_tma_persistent_ctas); the mainloop, producer, masks, modifiers and
// epilogue are prefill_tma's.
#pragma once

#include "kernels/attention/prefill_tma.cuh"

namespace flashserve::kernels::prefill {

// One item as the producer hands it to the consumers.
struct TmaItem {
  CtaWork w;
  CtaKeys ck;
  int64_t h = 0;
  int split = 0;
};

// prefill_tma's shared memory, then 5 mbarriers (item_full, item_empty per slot, q_empty) and the
// two item slots.
template <int kD, int kDv, int kM>
struct PersistSmem : TmaSmem<kD, kDv, kM> {
  using Base = TmaSmem<kD, kDv, kM>;
  static constexpr uint32_t kBytes = Base::kBytes + 5 * 8 + 2 * uint32_t(kTmaItemSlotBytes);
  static_assert(sizeof(TmaItem) <= kTmaItemSlotBytes && kTmaItemSlotBytes % 8 == 0, "item slots (select.hpp)");
  uint32_t xbars;
  unsigned char* slots;
  FS_DEV explicit PersistSmem(unsigned char* raw) : Base(raw) {
    xbars = Base::bars + 9 * 8;  // past TmaSmem's 9 mbarriers (8-byte aligned)
    slots = raw + (xbars - smem_u32(raw)) + 5 * 8;
  }
  FS_DEV TmaItem& item(int slot) const { return *reinterpret_cast<TmaItem*>(slots + slot * kTmaItemSlotBytes); }
  FS_DEV uint32_t item_full(int slot) const { return xbars + 8 * slot; }
  FS_DEV uint32_t item_empty(int slot) const { return xbars + 16 + 8 * slot; }
  FS_DEV uint32_t q_empty() const { return xbars + 32; }
};

template <int kD, int kDv, int kM = kWgmmaRowsPerCta>
constexpr size_t prefill_persistent_smem_bytes_of() {
  return PersistSmem<kD, kDv, kM>::kBytes;
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

// The producer warps' walk: every item's work (warp 0 hands it to the consumers and loads Q),
// then its K and V tiles as prefill_tma's Producer loads them, j0 counting the CTA's tiles.
template <class T, int kD, int kDv, int kM, class Sm>
FS_DEV void produce_items(const TmaAttnParams& tp, const Sm& sm, int pw, int lane, bool split_load) {
  const AttnParams& p = tp.p;
  const int64_t row_tiles = p.row_tiles(kM), items = row_tiles * p.num_heads * p.num_splits;
  int i = 0, nq = 0, j0 = 0;
#pragma unroll 1
  for (int64_t L = blockIdx.x; L < items; L += gridDim.x, ++i) {
    TmaItem it;
    it.w = item_work<kM>(p, L, row_tiles, it.h, it.split);
    SeqKv kv;
    if (it.w.active) {
      kv = seq_kv(p, it.w.b, it.h / p.group);
      it.ck = cta_keys<Sm::kN>(p, it.w, kv, it.split);
    }
    if (pw == 0) {
      const int slot = i & 1;
      if (i >= 2) mbar_wait(sm.item_empty(slot), uint32_t(((i >> 1) & 1) ^ 1));
      if (lane == 0) {
        sm.item(slot) = it;
        mbar_arrive(sm.item_full(slot));
      }
    }
    if (!it.w.active) continue;
    if (pw == 0) {
      if (nq >= 1) mbar_wait(sm.q_empty(), uint32_t((nq - 1) & 1));
      if (lane == 0) load_q<T, wgmma_tile_width(kD)>(tp, sm, it.w, it.h);
    }
    ++nq;
    const Producer<T, kD, kDv, Sm> pr(tp, it.w, kv, it.ck, sm, lane);
    if (!split_load) pr.run_both(j0);
    else if (pw < kTmaParts) pr.template run_operand<true>(pw, j0);
    else pr.template run_operand<false>(pw - kTmaParts, j0);
    j0 += it.ck.tiles;
  }
}

template <class T, int kD, int kDv, bool kF32Out, bool kAlibi, int kWgs = 2>
__global__ void __launch_bounds__(tma_threads(kWgs), 1)
    prefill_tma_persistent(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kWgs == 2 || (kWgs == 3 && prefill_tma_max_consumer_wgs(kD, kDv, kF32Out) == 3), "built shapes");
  using S = Wgmma90<kD, kDv, 64 * kWgs>;
  using Sm = PersistSmem<kD, kDv, S::kM>;
  using QL = typename Sm::QL;
  constexpr int kN = S::kN, kDo = wgmma_tile_width(kDv);
  static_assert(kD % 16 == 0 && kDv % 8 == 0 && kDv <= wgmma_tile_width(kD), "k16 steps");
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm sm(smem_raw);
  const bool split_load = Producer<T, kD, kDv, Sm>::split(p);
  const uint32_t producer_parts = split_load ? kTmaParts : 1;  // producer warps per full barrier
  if (threadIdx.x == 0) {
    tma_prefetch_desc(&tp.q);
    sm.init_bars(producer_parts, S::kWarps);
    mbar_init(sm.q_empty(), S::kWarps);
    for (int slot = 0; slot < 2; ++slot) {
      mbar_init(sm.item_full(slot), 1);
      mbar_init(sm.item_empty(slot), S::kWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int warp = int(warp_uniform(threadIdx.x / 32)), lane = int(threadIdx.x) % 32, wg = warp / 4;
  if (wg == kWgs) {  // the producer warpgroup: warp 0, or 2 x kTmaParts warps where pages split a tile
    regs_dealloc<tma_producer_regs(kWgs)>();
    const int pw = warp - 4 * kWgs;
    if (pw < (split_load ? 2 * kTmaParts : 1)) produce_items<T, kD, kDv, S::kM>(tp, sm, pw, lane, split_load);
    return;
  }
  regs_alloc<tma_consumer_regs(kWgs)>();
  const int64_t items = p.row_tiles(S::kM) * p.num_heads * p.num_splits;
  const ScoreLog2 score(p);
  const StageBars bars{sm.k_full(0), sm.k_empty(0), sm.v_full(0), sm.v_empty(0), sm.pins + 4 * threadIdx.x};
  chain_open<kWgs>(wg);
  int i = 0, nq = 0, j0 = 0;
#pragma unroll 1
  for (int64_t L = blockIdx.x; L < items; L += gridDim.x, ++i) {
    const int slot = i & 1;
    mbar_wait(sm.item_full(slot), uint32_t((i >> 1) & 1));
    const TmaItem it = sm.item(slot);
    __syncwarp();  // every lane's reads of the slot precede the release
    release(sm.item_empty(slot), lane);
    if (!it.w.active) continue;
    const WarpKeys<S> wk(it.ck.rows, it.ck.n_begin, it.w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
    const ScoreBias<kAlibi> bias = make_score_bias<kAlibi>(p, it.w.b, it.h, score);
    const int64_t d0 = kAlibi ? bias_d0<S>(it.ck, warp, 0, lane) : 0;
    float o[1][kDo / 8][4] = {};
    float s[kN / 8][4] = {};
    uint32_t pa[kN / 16][4];
    uint32_t pl[kF32Out ? kN / 16 : 1][4];
    float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {}, alpha[2];
    mbar_wait(sm.q_full(), uint32_t(nq & 1));
    if (it.ck.tiles <= 0) release(sm.q_empty(), lane);  // Q not read
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
    ++nq;
    j0 += it.ck.tiles;
  }
  chain_close(wg);
#endif
}

}  // namespace flashserve::kernels::prefill
