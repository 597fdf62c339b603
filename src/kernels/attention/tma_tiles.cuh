// A KV tile's loads for the TMA producers (prefill_tma.cuh, prefill_fp8.cuh, decode_mla_pp.cuh):
// whether TMA can load a tile and where its page segments lie (tma_tile*), the boxes of one
// stage (tma_stage), and the cp.async path of the tiles it cannot (copy_tail: sequence tails,
// bad metadata), each completing a full mbarrier of kFullArrivals arrivals. In prefill's
// namespace, with the token location (token_offsets) they build on.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/attention/prefill_common.cuh"
#include "kernels/attention/select.hpp"
#include "kernels/common/tma.cuh"

namespace flashserve::kernels::prefill {

// The producer's cp.async copy of one tile (kC 16-byte chunks per row of K (kKeys) or V) for
// keys [n0, n0 + kN), each token located by token_offsets (contiguous or paged): tokens past
// the sequence zero, tokens the metadata places outside the cache (a bad block id, a block
// table column past max_blocks, a cache row out of range) NaN keys or zero values; then the
// stage is published on `full`, every lane arriving once its own writes are complete and
// visible (kFullArrivals: a release per writer, which racecheck follows, where __syncwarp and
// one lane's arrival order the same writes without it). One block-table load per chunk: the
// path of tails and bad metadata only.
// Arrivals that complete a K or V full barrier's phase: the producer warp's 32 lanes (copy_tail,
// tma_stage), plus the TMA bytes.
inline constexpr uint32_t kFullArrivals = 32;

template <class T, class L, int kN, int kC, bool kKeys>
FS_DEV void copy_tail(const AttnParams& p, const SeqKv& kv, int64_t sk, int64_t n0, uint32_t dst, uint32_t full,
                      int lane) {
  const T* base = static_cast<const T*>(kKeys ? p.k.data : p.v.data);
#pragma unroll 1  // the producer runs on 40 registers
  for (int idx = lane; idx < kN * kC; idx += 32) {
    const int row = idx / kC, c = idx % kC;
    const int64_t t = n0 + row;
    const uint32_t at = dst + L::at(row, c);
    int64_t k_off = 0, v_off = 0;
    const bool in = t < sk;
    if (in && !token_offsets(p, kv, t, k_off, v_off)) {
      const uint32_t x = kKeys ? nan_word<T>() : 0u;
      st_shared_v4(at, x, x, x, x);
      continue;
    }
    cp_async_16(at, base + (kKeys ? k_off : v_off) + c * (16 / int(sizeof(T))), in);  // offsets 0 past the sequence: nothing read
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_shared();  // the generic-proxy writes, visible to wgmma
  mbar_arrive(full);
}

// Whether TMA loads the tile at keys [n0, n0 + kN) (warp-uniform), and where producer lane
// `lane` (< kN / seg, one page segment of `seg` rows each) finds its segment: row `row` of
// dim 1 (the cache row, or the row in the page) of index `blk` of dim 0 (the cache batch, or
// the block id). The tile must lie in the sequence and the cache; paged, its segments must
// start pages (n0 a multiple of seg: true for tiles of a kN-aligned CTA start with splits at
// the GPU plan's 128-key granularity, else the tile goes to copy_tail) and every block id
// be inside the cache: TMA zero-fills out of bounds, where keys outside the cache must be NaN.
// tma_tile_id gives lane's block id (paged, a tile TMA may load; else 0), which a producer may
// load a tile ahead to hide its latency, and tma_tile_from decides with it.
template <int kN>
FS_DEV bool tma_tile_candidate(const AttnParams& p, const KeyRange& cache, int64_t sk, int64_t n0, int seg) {
  if (n0 < cache.lo || n0 + kN > imin(sk, cache.hi)) return false;
  return !p.paged || (uint32_t(n0) & uint32_t(seg - 1)) == 0;  // seg: a power of two (16 .. kN); 0 <= n0 < 2^31
}
template <int kN>
FS_DEV int64_t tma_tile_id(const AttnParams& p, const SeqKv& kv, const KeyRange& cache, int64_t sk, int64_t n0,
                           int seg, int lane) {
  if (!p.paged || lane >= kN / seg || !tma_tile_candidate<kN>(p, cache, sk, n0, seg)) return 0;
  // n0 + kN <= max_blocks x P: the column is in the table; t < 2^31
  return load_index2(p.block_table, kv.b, (uint32_t(n0) + uint32_t(lane * seg)) / uint32_t(p.kv_dim1));
}
template <int kN>
FS_DEV bool tma_tile_from(const AttnParams& p, const SeqKv& kv, const KeyRange& cache, int64_t sk, int64_t n0,
                          int seg, int lane, int64_t id, int& row, int& blk) {
  if (!tma_tile_candidate<kN>(p, cache, sk, n0, seg)) return false;
  if (!p.paged) {
    row = int(kv.k_begin + n0);
    blk = int(kv.kb);
    return true;
  }
  bool bad = false;
  if (lane < kN / seg) {
    const uint32_t bs = uint32_t(p.kv_dim1), t = uint32_t(n0) + uint32_t(lane * seg);
    bad = id < 0 || id >= p.kv_dim0;
    row = int(t - t / bs * bs);
    blk = int(id);
  }
  return !__any_sync(kFullMask, bad);
}
template <int kN>
FS_DEV bool tma_tile(const AttnParams& p, const SeqKv& kv, const KeyRange& cache, int64_t sk, int64_t n0, int seg,
                     int lane, int& row, int& blk) {
  return tma_tile_from<kN>(p, kv, cache, sk, n0, seg, lane, tma_tile_id<kN>(p, kv, cache, sk, n0, seg, lane), row,
                           blk);
}

// One stage of K or V (kW channels of T) by TMA, or part `part` of it of `parts` (a power of
// two: producer warps sharing the stage, column blocks dealt round robin; every lane of each
// arrives on `full`, which counts parts x kFullArrivals): part 0's lane 0 expects the whole
// tile's bytes (the others' arrivals cannot complete the phase before it), then each of the
// tile's kN / seg lanes loads its page segment (seg rows at tile row lane x seg: a multiple of 16
// rows, 2 KB, so the box lands 1024-byte aligned and the 128-byte swizzle TMA derives from the
// address is SwizzledTile's), one box per 128-byte column block of its part.
template <class T, class L, int kN, int kW>
FS_DEV void tma_stage(const CUtensorMap* map, uint32_t dst, uint32_t full, uint32_t bytes, int seg, int g, int row,
                      int blk, int part, int parts, int lane) {
  if (part == 0 && lane == 0) mbar_arrive_expect_tx(full, bytes);
  else mbar_arrive(full);
  __syncwarp();
  if (lane >= kN / seg) return;
  const uint32_t at = dst + uint32_t(lane * seg) * 128u;
#pragma unroll
  for (int c = 0; c < tile_row_bytes(kW, sizeof(T)) / 128; ++c)
    if ((c & (parts - 1)) == part)  // parts: a power of two
      tma_load_4d(at + uint32_t(c) * L::kBlockBytes, map, full, c * (128 / int(sizeof(T))), g, row, blk);
}

}  // namespace flashserve::kernels::prefill
