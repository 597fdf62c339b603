// The sm_90a warp-specialized prefill kernel (FlashAttention-3's design, our way): a producer
// warp loads K and V tiles (thread 0 the Q tile, as soon as the CTA's row tile is known) with
// TMA into 128-byte-swizzled shared memory through mbarrier pipelines, while two consumer
// warpgroups run prefill_wgmma's mainloop (S = Q K^T and O += P V on wgmma, the softmax of tile
// j overlapping P V of tile j - 1) in ping-pong: named barriers
// hand the tensor cores from one warpgroup to the other, so one warpgroup's softmax runs while
// the other's GEMMs do. Serves prefill_wgmma's scope for contiguous K/V and paged caches whose
// block size P is a multiple of 16 that divides the kN-key tile or is divided by it (select.cu:
// try_prefill_tma; other block sizes stay on prefill_wgmma): a paged tile is one TMA box per
// page segment (min(kN, P) rows), at the page's block id.
//
// CTA: 384 threads = consumer warpgroups 0, 1 (threads 0-255: rows 64 wg .. 64 wg + 63, the
// TileShape and epilogue of prefill_wgmma) + the producer warpgroup 2 (one warp works, or all
// four where pages are shorter than the tile: Producer; 40 registers; the consumers take 232
// with setmaxnreg). The CTA schedule (prefill_common.cuh: 128 query rows of one sequence x head
// x split) and the epilogue (store_rows, through the warp's own Q rows) are prefill_wgmma's. At D = 64 (select.hpp: prefill_tma_rows) a CTA may
// take 192 rows instead: three consumer warpgroups in a ping-pong round robin, 512 threads, 160
// registers each and 32 for the producer (FlashAttention-3's D = 64 tile). There a warpgroup's
// GEMMs of a 128-key tile take 512 clk of the tensor pipe while its softmax (64 MUFU
// exponentials and ~420 instructions per thread, one warp per SM sub-partition) takes longer:
// with two warpgroups a tile measured ~2700 clk (D = 64 S = 2k: 23.8 us per 16-tile CTA), about
// two softmaxes back to back; with three, two softmaxes run while one warpgroup's GEMMs do
// (H200: D = 64 S = 2k 735 -> 666 us, S = 8k 2812 -> 2475, paged blocks of 16 637 -> 546).
//
// Pipelines (mbarriers, 2 stages each): K full / empty, V full / empty, and Q full. A full
// barrier completes on its producer warps' 32 arrivals each plus the TMA bytes; an empty one on
// one arrival per consumer warp after its wgmma reading the stage completed. A tile whose keys
// leave the sequence or the cache (the last of a CTA, or bad metadata: a block id outside the
// cache, which TMA would zero-fill) or, paged, does not start a page segment is copied by a
// producer warp with cp.async instead (keys outside the cache NaN, values zero; tokens past the
// sequence zero), as prefill_common.cuh's copies do, so garbage past a sequence never meets
// P = 0 in P V.
//
// Per 128-key tile at D = 128 (H200 SM: 4096 dense bf16 FLOP/clk): 2 GEMMs x 64 x 128 x 128 x 2
// per warpgroup = 4.2 MFLOP = 1024 clk of the tensor pipe per warpgroup; the softmax of one
// warpgroup (64 x 128 exp2 on 16 MUFU/clk = 512 clk, ~256 clk of FP32) hides under the other's
// GEMMs, so the tensor pipe is the bound: ~2048 clk per tile for both, ~90% of peak predicted
// if TMA keeps up (64 KB per tile per 2048 clk = 32 B/clk per SM, 4.2 TB/s over 132 SMs at
// 1.98 GHz... served mostly from L2: heads of one KV head share it). Measured (ncu, bench/RESULTS.md
// 2026-11-25 03:36): the tensor pipe 71% active at D = 128 (~2900 clk per tile), 42% at D = 64
// (the softmax as long as the GEMMs), 78% at D = 256; the per-tile overheads (turn, barriers,
// the producer) are what FlashAttention-3's longer key tiles amortize.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/attention/prefill_wgmma.cuh"
#include "kernels/attention/tma_tiles.cuh"
#include "kernels/common/tma.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels::prefill {

// The CTA of wgs consumer warpgroups and one producer warpgroup, and their setmaxnreg split.
// setmaxnreg moves registers within the CTA's launch allocation (65536 / threads per thread,
// rounded down to 8): two consumer warpgroups (384 threads, 168 x 384 = 64512) take 232 x 256 +
// 40 x 128, all of it (a producer at 48 leaves the consumers' increase waiting forever); three
// (prefill_tma_rows 192: 512 threads, 128 x 512 = 65536) 160 x 384 + 32 x 128, FlashAttention-3's
// split at D = 64.
constexpr int tma_threads(int wgs) { return 128 * (wgs + 1); }
constexpr int tma_consumer_regs(int wgs) { return wgs == 2 ? 232 : 160; }
constexpr int tma_producer_regs(int wgs) { return wgs == 2 ? 40 : 32; }
constexpr bool tma_regs_fit(int wgs) {
  return 128 * (wgs * tma_consumer_regs(wgs) + tma_producer_regs(wgs)) <= 65536 / tma_threads(wgs) / 8 * 8 *
                                                                               tma_threads(wgs);
}
static_assert(tma_regs_fit(2) && tma_regs_fit(3), "setmaxnreg within the launch allocation");
// The two-warpgroup CTA (prefill_tma's default, prefill_fp8's).
inline constexpr int kTmaThreads = tma_threads(2);
inline constexpr int kTmaConsumerRegs = tma_consumer_regs(2), kTmaProducerRegs = tma_producer_regs(2);

// The kernel's parameters: the operands' tensor maps next to AttnParams.
struct TmaAttnParams {
  CUtensorMap q, k, v;  // make_tma_map: boxes of 128 query rows / prefill_tma_box_rows keys x 64 channels
  AttnParams p;
};

// Shared memory: prefill_wgmma's [Q | K 0, 1 | V 0, 1] (two V stages: the empty barriers order
// the reuse; Q of kM = 128 or 192 rows), then the rows' key ranges (int2 [kM]), the wait pins
// (consume_tiles: one float per consumer thread) and the mbarriers.
template <int kD, int kDv, int kM = kWgmmaRowsPerCta>
struct TmaSmem {
  static constexpr int kN = wgmma_tile_keys(kD, kDv);
  using QL = SwizzledTile<kM>;
  using KvL = SwizzledTile<kN>;
  static constexpr uint32_t kQBytes = kM * wgmma_tile_width(kD) * 2;
  static constexpr uint32_t kKBytes = kN * wgmma_tile_width(kD) * 2, kVBytes = kN * wgmma_tile_width(kDv) * 2;
  static constexpr uint32_t kTiles = kQBytes + 2 * kKBytes + 2 * kVBytes;
  static constexpr uint32_t kPinBytes = wait_pin_bytes(kM);
  static constexpr uint32_t kBars = 9;
  static constexpr uint32_t kBytes = 1024 + kTiles + kM * 8 + kPinBytes + kBars * 8;
  uint32_t q, pins, bars;
  unsigned char* ranges;
  FS_DEV explicit TmaSmem(unsigned char* raw) {
    const uint32_t base = smem_u32(raw), aligned = warp_uniform((base + 1023u) & ~1023u);
    q = aligned;
    ranges = raw + (aligned - base) + kTiles;
    pins = aligned + kTiles + kM * 8;
    bars = pins + kPinBytes;
  }
  FS_DEV uint32_t k(int st) const { return q + kQBytes + uint32_t(st) * kKBytes; }
  FS_DEV uint32_t v(int st) const { return q + kQBytes + 2 * kKBytes + uint32_t(st) * kVBytes; }
  FS_DEV uint32_t q_full() const { return bars; }
  FS_DEV uint32_t k_full(int st) const { return bars + 8 + 8 * st; }
  FS_DEV uint32_t k_empty(int st) const { return bars + 24 + 8 * st; }
  FS_DEV uint32_t v_full(int st) const { return bars + 40 + 8 * st; }
  FS_DEV uint32_t v_empty(int st) const { return bars + 56 + 8 * st; }
  // The pipelines' mbarriers (one thread): Q full, K / V full (each producer warp's 32 arrivals
  // plus the bytes) and empty (one arrival per consumer warp).
  FS_DEV void init_bars(uint32_t producer_parts, uint32_t consumer_warps) const {
    mbar_init(q_full(), 1);
    for (int st = 0; st < 2; ++st) {
      mbar_init(k_full(st), kFullArrivals * producer_parts);
      mbar_init(v_full(st), kFullArrivals * producer_parts);
      mbar_init(k_empty(st), consumer_warps);
      mbar_init(v_empty(st), consumer_warps);
    }
  }
};

// The tensor maps of q, k and v (host side, per call): Q boxes of 128 rows; K/V boxes of a tile
// of kN keys, or one page of a paged cache with fewer keys (the kernel loads a tile as its page
// segments; paged, dim 0 is the block id and dim 1 the row in it). prefill_tma's and
// prefill_fp8's.
template <int kD, int kDv, int kM = kWgmmaRowsPerCta>
TmaAttnParams tma_params(const AttnParams& p) {
  const int box = prefill_tma_box_rows(wgmma_tile_keys(kD, kDv), p.paged, p.kv_dim1);
  TmaAttnParams tp;
  tp.p = p;
  tp.q = make_tma_map(p.q, p.q_batches, p.q_rows, p.num_heads, kD, kM, "q");
  tp.k = make_tma_map(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kD, box, "k");
  tp.v = make_tma_map(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kDv, box, "v");
  return tp;
}

template <int kD, int kDv, int kM = kWgmmaRowsPerCta>
constexpr size_t prefill_tma_smem_bytes_of() {
  return TmaSmem<kD, kDv, kM>::kBytes;
}

// The CTA's Q tile (128 rows of head h, kW channels of T: one box per 128-byte column block) by
// TMA, completing q_full. One thread, as soon as the row tile is known (prefill_tma, prefill_fp8).
template <class T, int kW, class Sm>
FS_DEV void load_q(const TmaAttnParams& tp, const Sm& sm, const CtaWork& w, int64_t h) {
  mbar_arrive_expect_tx(sm.q_full(), Sm::kQBytes);
#pragma unroll
  for (int c = 0; c < kW * int(sizeof(T)) / 128; ++c)
    tma_load_4d(sm.q + uint32_t(c) * Sm::QL::kBlockBytes, &tp.q, sm.q_full(), c * (128 / int(sizeof(T))), int(h),
                int(w.q_row0), int(w.qb));
}

// The producer warps: K and V of every tile into the stage (j % 2) its consumers released, by TMA
// where tma_tile allows (one box per page segment and 128-byte column block, issued lane by lane
// after the segment's block id), else copy_tail. Where a tile is one box per column block
// (contiguous K/V, pages >= the tile) one warp loads both (run_both); where a paged tile is
// several page segments (`split`: pages shorter than the tile), 2 x kTmaParts warps do, each
// operand's column blocks dealt over kTmaParts warps (run_operand), so the chains of block-id
// loads and box issues run side by side: one warp issuing all 32 boxes of a 128-key tile at
// block size 16 was the bound there (ncu, bench/RESULTS.md 2026-11-25 19:30-20:10: the consumers'
// K / V full waits a third of their samples, the producer never waiting on an empty stage;
// split, block 16: 1.30-1.42x at D = 128 and 256), while at one box per block the extra warps
// cost 2-5% (S = 512). At D = 64 (one column block) the second warp of a pair only arrives:
// dealing it alternate page segments instead measured no faster (RESULTS.md 2026-11-25 20:00).
// The kernel's thread 0 loads Q (load_q).
inline constexpr int kTmaParts = 2;
static_assert(2 * kTmaParts <= 4, "the producer warpgroup's warps");

template <class T, int kD, int kDv, class Sm>
struct Producer {
  using L = typename Sm::KvL;
  static constexpr int kN = Sm::kN;
  struct Tile {
    bool whole = false;
    int row = 0, blk = 0;
    int64_t n0 = 0;
  };
  const TmaAttnParams& tp;
  const SeqKv& kv;
  const CtaKeys& ck;
  const Sm& sm;
  int64_t sk;
  KeyRange cache;
  int seg, lane;

  FS_DEV Producer(const TmaAttnParams& tp_, const CtaWork& w, const SeqKv& kv_, const CtaKeys& ck_, const Sm& sm_,
                  int lane_)
      : tp(tp_), kv(kv_), ck(ck_), sm(sm_), sk(kv_len(tp_.p, w.b)), cache(generic::cache_tokens(tp_.p, kv_)),
        seg(prefill_tma_box_rows(kN, tp_.p.paged, tp_.p.kv_dim1)), lane(lane_) {}
  static FS_DEV bool split(const AttnParams& p) { return prefill_tma_box_rows(kN, p.paged, p.kv_dim1) < kN; }

  FS_DEV Tile locate(int j) const {
    Tile t;
    t.n0 = ck.n_begin + int64_t(j) * kN;
    t.whole = tma_tile<kN>(tp.p, kv, cache, sk, t.n0, seg, lane, t.row, t.blk);
    return t;
  }
  // Stage j % 2 of K (kKeys) or V, part `part` of `parts`, once the consumers released it. j
  // counts the CTA's tiles (the persistent kernel's earlier items' too: j0 of run_both).
  template <bool kKeys>
  FS_DEV void load(int j, const Tile& t, int part, int parts) const {
    constexpr int kW = kKeys ? kD : kDv;
    const int st = j & 1;
    const uint32_t dst = kKeys ? sm.k(st) : sm.v(st), full = kKeys ? sm.k_full(st) : sm.v_full(st);
    if (j >= 2) mbar_wait(kKeys ? sm.k_empty(st) : sm.v_empty(st), uint32_t((j >> 1) & 1) ^ 1u);
    if (t.whole)
      tma_stage<T, L, kN, kW>(kKeys ? &tp.k : &tp.v, dst, full, kKeys ? Sm::kKBytes : Sm::kVBytes, seg, int(kv.g),
                              t.row, t.blk, part, parts, lane);
    else if (part == 0) copy_tail<T, L, kN, kW / 8, kKeys>(tp.p, kv, sk, t.n0, dst, full, lane);
    else mbar_arrive(full);
  }
  // One operand's part of every tile (split), the next tile's block ids read before the wait.
  template <bool kKeys>
  FS_DEV void run_operand(int part, int j0 = 0) const {
    if (ck.tiles <= 0) return;
    Tile t = locate(0);
#pragma unroll 1
    for (int j = 0; j < ck.tiles; ++j) {
      Tile next;
      if (j + 1 < ck.tiles) next = locate(j + 1);
      load<kKeys>(j0 + j, t, part, kTmaParts);
      t = next;
    }
  }
  // Both operands from one warp. At 128-key tiles K runs a tile ahead of V: K(j + 1) waits only
  // for S(j - 1) to release its stage, not behind V(j), whose stage P V(j - 2) frees half a
  // period later (ncu, D = 128 S = 8k: the consumers' K-full wait 3.8% -> 1.4% of samples, the
  // tensor pipe 71% -> 74% active, 6% less time); at 64-key tiles (D = 256) it measured 1.6%
  // slower, so there K(j) precedes V(j).
  // j0: the CTA's tiles before this item's (the persistent kernel; 0 otherwise).
  FS_DEV void run_both(int j0 = 0) const {
    constexpr bool kKAhead = kN >= 128;
    if (ck.tiles <= 0) return;
    Tile t = locate(0);  // tile j's location (the next one's block ids read a tile early)
    if (kKAhead) load<true>(j0, t, 0, 1);
#pragma unroll 1
    for (int j = 0; j < ck.tiles; ++j) {
      Tile next;
      if (j + 1 < ck.tiles) next = locate(j + 1);
      if (!kKAhead) load<true>(j0 + j, t, 0, 1);
      else if (j + 1 < ck.tiles) load<true>(j0 + j + 1, next, 0, 1);
      load<false>(j0 + j, t, 0, 1);
      t = next;
    }
  }
};

// Ping-pong (a round robin of kWgs consumer warpgroups): warpgroup wg waits for its turn (named
// barrier 1 + wg) before issuing its GEMMs and hands the turn over after (the next warpgroup's
// barrier). All walk the same tiles, so with the last warpgroup opening warpgroup 0's first turn
// and skipping its last hand-over, every barrier sees as many arrivals as waits.
// kChain (the persistent kernel, whose items follow one another): the last warpgroup's last
// hand-over of an item opens warpgroup 0's first turn of the next, so the kernel opens the very
// first turn once and warpgroup 0 takes the one hand-over left at its end (chain_open,
// chain_close).
template <int kWgs, bool kChain = false>
struct PingPong {
  int wg;
  FS_DEV void my_turn() const { named_sync(1 + wg, 2 * 128); }
  FS_DEV void hand_over(bool last) const {
    if (kChain || !(wg == kWgs - 1 && last)) named_arrive(1 + (wg + 1 == kWgs ? 0 : wg + 1), 2 * 128);
  }
};
template <int kWgs>
FS_DEV void chain_open(int wg) {
  if (wg == kWgs - 1) named_arrive(1, 2 * 128);
}
FS_DEV void chain_close(int wg) {
  if (wg == 0) named_sync(1, 2 * 128);
}

// One consumer warp's release of a stage: its lane 0 arrives once its wgmma reading it is done.
FS_DEV void release(uint32_t empty, int lane) {
  if (lane == 0) mbar_arrive(empty);
}

// The stage-0 mbarriers of the K and V operands the consumers wait on and release; stage st's
// sit 8 st bytes further.
struct StageBars {
  uint32_t k_full, k_empty, v_full, v_empty;
  uint32_t pin;  // the thread's wait pin (pin_wait)
  static FS_DEV uint32_t at(uint32_t bar, int st) { return bar + 8u * uint32_t(st); }
};

// wgmma_wait<0>, after x when kPin. ptxas schedules wgmma.wait_group as early as its block
// allows (it reads no register): the wait for P V(j - 1) goes ahead of tile j's softmax and
// serializes the two (ncu, D = 128: 10% of the consumers' time in it, every exponential after
// it). It keeps the wait after shared-memory stores, so storing a value the whole softmax feeds
// (its row sums) to the thread's own word pins the wait behind the softmax. Measured on the H200
// (bench/RESULTS.md, 2026-11-25 03:36-04:06): D = 64 S = 2k 6% faster pinned, D = 128 even, D = 256
// (64-key tiles) and the fp8 kernel 6-9% slower, so the kernels pin at 128-key bf16 tiles only.
template <bool kPin>
FS_DEV void pin_wait(uint32_t pin, float x) {
  if constexpr (kPin) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(pin), "f"(x) : "memory");
  wgmma_wait<0>();
}

// The consumers' mainloop of the TMA kernels (prefill_tma, prefill_fp8), software-pipelined
// within each warpgroup so that the softmax of tile j runs while P V of tile j - 1 does, the
// warpgroups in ping-pong: per tile, wait for K j and V j - 1, issue S = Q K j and O += P(j-1)
// V(j-1) in the warpgroup's turn, release K j once S is complete, softmax, release V j - 1 once
// O is complete, rescale O and pack P(j); the first tile's P V peeled off, the last tile's
// after the loop. The kernel gives its accumulators S and O and its parts: qk(st) and pv(st)
// issue the GEMMs over stage st (a commit group each) into them, softmax(j) runs on the
// completed S and returns a value that depends on all of it (pin_wait), rescale() scales O by
// the softmax's alpha, pack() makes P(j) from S.
// The persistent kernel (kChain) chains its items: j0 counts the CTA's tiles before this item's
// (the stages and phases run on), the ping-pong hands over across items (PingPong), and
// q_empty (non-zero) is released once the item's last S is complete, so that the next item's Q
// loads during the last softmax, P V and epilogue.
template <bool kPin, int kNS, int kNO, int kWgs = 2, bool kChain = false, class Qk, class Pv, class Softmax,
          class Rescale, class Pack>
FS_DEV void consume_tiles(int tiles, int wg, int lane, const StageBars& b, float (&s)[kNS][4], float (&o)[kNO][4],
                          const Qk& qk, const Pv& pv, const Softmax& softmax, const Rescale& rescale,
                          const Pack& pack, int j0 = 0, uint32_t q_empty = 0) {
  if (tiles <= 0) return;
  const PingPong<kWgs, kChain> turn{wg};
  const auto parity = [j0](int j) { return uint32_t(((j0 + j) >> 1) & 1); };
  const auto stage = [j0](int j) { return (j0 + j) & 1; };
  if (!kChain) chain_open<kWgs>(wg);  // one item: its own first turn opened here
  mbar_wait(StageBars::at(b.k_full, stage(0)), parity(0));
  turn.my_turn();
  qk(stage(0));
  turn.hand_over(false);
  wgmma_wait<0>();
  fence_operands(s);
  release(StageBars::at(b.k_empty, stage(0)), lane);
  if (kChain && tiles == 1) release(q_empty, lane);
  softmax(0);  // o is still 0: no rescale
  pack();
  for (int j = 1; j < tiles; ++j) {
    const int st = stage(j), prev = st ^ 1;
    mbar_wait(StageBars::at(b.k_full, st), parity(j));
    mbar_wait(StageBars::at(b.v_full, prev), parity(j - 1));
    turn.my_turn();
    qk(st);
    pv(prev);
    turn.hand_over(false);
    wgmma_wait<1>();
    fence_operands(s);
    release(StageBars::at(b.k_empty, st), lane);
    if (kChain && j == tiles - 1) release(q_empty, lane);
    pin_wait<kPin>(b.pin, softmax(j));  // P(j-1) V(j-1) added: P's registers free, O final for it
    fence_operands(o);
    release(StageBars::at(b.v_empty, prev), lane);
    rescale();
    pack();
  }
  const int last = stage(tiles - 1);
  mbar_wait(StageBars::at(b.v_full, last), parity(tiles - 1));
  turn.my_turn();
  pv(last);
  turn.hand_over(true);
  wgmma_wait<0>();
  fence_operands(o);
  if constexpr (kChain) release(StageBars::at(b.v_empty, last), lane);  // the next item's tiles reuse it
}

template <class T, int kD, int kDv, bool kF32Out, bool kAlibi, int kWgs = 2>
__global__ void __launch_bounds__(tma_threads(kWgs), 1) prefill_tma(const __grid_constant__ TmaAttnParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kWgs == 2 || (kWgs == 3 && prefill_tma_max_consumer_wgs(kD, kDv, kF32Out) == 3), "built shapes");
  using S = Wgmma90<kD, kDv, 64 * kWgs>;
  using Sm = TmaSmem<kD, kDv, S::kM>;
  using QL = typename Sm::QL;
  constexpr int kN = S::kN, kDo = wgmma_tile_width(kDv);
  // D = 96: the second box's channels past D load as zeros (tma_map.cuh); copy_tail leaves them
  // stale, which QK^T (D in k16 steps) never reads and P V only adds into unstored channels.
  static_assert(kD % 16 == 0 && kDv % 8 == 0 && kDv <= wgmma_tile_width(kD), "k16 steps; out staged in Q's rows");
  const AttnParams& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm sm(smem_raw);
  const bool split_load = Producer<T, kD, kDv, Sm>::split(p);
  const uint32_t producer_parts = split_load ? kTmaParts : 1;  // producer warps per full barrier
  if (threadIdx.x == 0) {  // before the CTA's work lookup, which waits for device metadata
    tma_prefetch_desc(&tp.q);
    sm.init_bars(producer_parts, S::kWarps);
    mbar_init_fence();
  }
  int64_t h;
  const CtaWork w = cta_of_block<S::kM>(p, h);
  if (!w.active) return;
  // Q as soon as the row tile is known: its ~1.1 us (H200) overlaps the KV metadata reads below.
  if (threadIdx.x == 0) load_q<T, wgmma_tile_width(kD)>(tp, sm, w, h);
  const int warp = int(warp_uniform(threadIdx.x / 32)), lane = int(threadIdx.x) % 32, wg = warp / 4;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const CtaKeys ck = cta_keys<kN>(p, w, kv, split);
  __syncthreads();
  if (wg == kWgs) {  // the producer warpgroup
    regs_dealloc<tma_producer_regs(kWgs)>();
    const Producer<T, kD, kDv, Sm> pr(tp, w, kv, ck, sm, lane);
    const int pw = warp - 4 * kWgs;  // split: K on producer warps 0 .. kTmaParts - 1, V on the next kTmaParts
    if (!split_load) {
      if (pw == 0) pr.run_both();
    } else if (pw < kTmaParts) {
      pr.template run_operand<true>(pw);
    } else if (pw < 2 * kTmaParts) {
      pr.template run_operand<false>(pw - kTmaParts);
    }
    return;
  }
  regs_alloc<tma_consumer_regs(kWgs)>();
  const WarpKeys<S> wk(ck.rows, ck.n_begin, w.rows, warp, lane, reinterpret_cast<int2*>(sm.ranges));
  const ScoreLog2 score(p);
  const ScoreBias<kAlibi> bias = make_score_bias<kAlibi>(p, w.b, h, score);
  const int64_t d0 = kAlibi ? bias_d0<S>(ck, warp, 0, lane) : 0;
  float o[1][kDo / 8][4] = {};
  float s[kN / 8][4] = {};
  uint32_t pa[kN / 16][4];
  uint32_t pl[kF32Out ? kN / 16 : 1][4];
  float m[1][2] = {{kNegInf, kNegInf}}, l[1][2] = {}, alpha[2];
  mbar_wait(sm.q_full(), 0);
  consume_tiles<kN == 128, kN / 8, kDo / 8, kWgs>(
      ck.tiles, wg, lane,
      StageBars{sm.k_full(0), sm.k_empty(0), sm.v_full(0), sm.v_empty(0), sm.pins + 4 * threadIdx.x}, s, o[0],
      [&](int st) { issue_qk<T, kD, kN, S::kM>(sm.q, sm.k(st), wg, s); },
      [&](int st) { issue_pv<T, kDo, kN, kF32Out>(pa, pl, sm.v(st), o[0]); },
      [&](int j) {
        // Lazy rescaling where O's multiplies are worth skipping (D >= 128; at D = 64 it cost
        // 0.5-1.1% at S <= 2k: bench/RESULTS.md 22:10): 0 keeps the exact running max.
        prefill::softmax_tile<S, kN>(wk, score, bias, d0, j, warp, lane, s, m[0], l[0], alpha, 0.0f,
                                     kDo >= 128 ? kLazyMax : 0.0f);
        return l[0][0] + l[0][1];
      },
      [&] { rescale_o<kDo>(o[0], alpha); }, [&] { prefill::pack_p<T, kN, kF32Out>(s, pa, pl); });
  store_rows<S, QL, T, kDo, kDv, std::conditional_t<kF32Out, float, T>>(p, w, h, split, o, m, l, score.exp_mul, sm.q,
                                                                        warp, lane);
#endif
}

}  // namespace flashserve::kernels::prefill
