// The decode kernel: few query rows per KV head (decode, short speculative verify), KV streamed
// once per KV head, the generic kernel's modifiers (masks.cuh, softmax.cuh, epilogue.cuh).
// q.k and p.v run on the tensor cores (decode_mma.cuh): 16-bit K/V in q's type, fp8 K/V as f16
// operands converted in registers, int8 K8V8 / K8V16 with q.k on the s8 mma (decode_config.hpp
// says how each is exact). The fp32 CUDA-core path that served fp8 before (1.2 TB/s at B=64
// L=4k, 1.5x bf16's time; its v3/v4 instruction counts are in the history of this file) is gone.
//
// CTA = (sequence b, KV head g, split, r); grid (B x R x H_kv, 1, num_splits) with the KV head
// fastest for long splits (the heads of a sequence read the same pages together), (B x R, H_kv,
// num_splits) for short ones (decode_fwd.cu's launch_rows). Its packed rows are
// the sequence's q_len x group (query row, head) pairs of KV head g, taken 16 at a time (the
// mma's M; one pass over the split's KV per row group), every R-th group from group r: R = 1 up
// to 16 rows; past them a 16-bit cache's long splits run 32-row CTAs (two mma passes per tile on
// one copy of the keys), an 8-bit cache's more 16-row CTAs side by side (common/decode_rows.hpp:
// decode_cta_rows, decode_row_ctas). Warps split the keys: warp w owns tiles w,
// w + W, ... (16 keys; 32 for 8-bit K and V on long splits) and streams them through its own
// decode_stages()-deep cp.async ring (16-byte copies, no CTA barrier in the main loop; each
// tile's block-table entries are read one tile ahead into registers, so the dependent table
// load never stalls a copy issue); per tile a warp runs q.k, the online softmax and p.v on its
// 16 rows (decode_mma.cuh). The W warp states merge at the end (shared memory), then out (or
// the split partial) and LSE; with the splits launched as one cluster (decode_fwd.cu), the split
// partials stay in shared memory and the cluster merges them (cluster_merge.cuh), no combine.
// The TMA form (sm_90a, 16-bit K/V at D <= 128 or fp8 at D = 128, long splits; decode_config.hpp:
// decode_tma_tiling) keeps this structure: a warp's ring completes mbarriers instead of cp.async
// groups, its tiles loaded as TMA boxes (one per 16-row page segment and 128-byte column block)
// by a few lanes (issue_tma) where the cp.async ring issues 16 copies per lane and tile.
//
// Arithmetic (H200, paged bf16, B=64, L=4096, H=32, H_kv=8, D=128, block 16): KV bytes =
// 64 * 4096 * 8 * 128 * 2 (K, V) * 2 B = 1.07 GB, q/out < 1 MB; ~4.3 TB/s copy ceiling = 33 GB/s
// per SM, so ~1 us of latency needs ~33 KB in flight per SM. Two CTAs (8 warps) per SM, each
// warp with 2 tiles of 8 KB in flight: 128 KB per SM. A warp's tile is a dependent chain
// (table load, copies, mma, shuffles), so throughput scales with resident warps: the planner
// splits decode shapes until (B x H_kv x splits) fills 2 CTAs per SM for one wave, splits of
// >= 1024 keys (plan.cpp, stream_splits), e.g. B=16, L=8k: 2 splits of 4096 keys (256 CTAs).
//
// Where the time goes (H200, bf16, B=64 L=4k, 2026-11-25: %globaltimer at each CTA's phases,
// bench/RESULTS.md): the stream itself runs at ~4.1-4.2 TB/s (time grows 65 us per 1k keys);
// the rest is per-CTA and per-wave. Each CTA spent ~5 us staging q (one dependent 2-byte load
// per element, now 16-byte loads issued together) and ~4-6 us before its first tile landed
// (block-table read, then the copies; now issued before the q setup), ~1.3 us merging. CTA
// durations spread 94-158 us (first wave 118-158): the SMs of the smaller GPCs stream ~12%
// faster, so the second wave ends over ~60 us and the last ~25 us run with fewer than half the
// CTAs. What would move it: persistent CTAs taking (sequence, KV head, key chunk) work from a
// counter, the next item's first tiles issued while the current one drains.
// Per instruction stream (ncu, B = 64 L = 4k, 2026-11-26): a warp's copy issue waits on the
// memory pipeline (the loop's top, long scoreboard on the previous copies' registers: 28% of
// bf16's stall samples, 20% of fp8's) and its compute on its copies; fp8's conversions and mma
// add fixed-latency waits (1.8 per instruction at 2 warps per scheduler, issue slots 32% busy).
// Row-sized cp.async.bulk copies instead were 5-33% slower (bench/RESULTS.md 01:18).
// Short contexts (ncu, B = 256 L = 64, 2026-11-25): each CTA is one dependent chain of ~1500
// warp instructions at ~8 cycles each (~6 us: wait, short and long scoreboard, the barrier after
// q's setup), 2 CTAs per SM by registers and shared memory, issue slots 22% busy, DRAM 27%;
// bf16 54.7 us, 29% of the copy ceiling. fp8 staged q element by element then (2063
// instructions per warp, 1.32x bf16's time); its staging now reads 8-element chunks (1.07x).
// The short tiling (decode_config.hpp: 16-key tiles, a two-deep ring, three CTAs per SM, q's
// fragments from shared memory) overlaps three chains per SM: bf16 54.8 -> 44.6 us (35% of the
// copy ceiling), fp8 59.1 -> 47.1, then 45.4 with its rows' metadata written side by side
// (bench/RESULTS.md 22:10).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/attention/decode_config.hpp"
#include "kernels/attention/epilogue.cuh"
#include "kernels/attention/generic_fwd.cuh"
#include "kernels/attention/load.cuh"
#include "kernels/attention/masks.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/softmax.cuh"
#include "kernels/common/mma.cuh"
#include "kernels/common/tma.cuh"
#include "kernels/common/wgmma.cuh"

namespace flashserve::kernels::decode {

constexpr int kTile = kDecodeTileKeys;
constexpr int32_t kTokenSkip = 2;  // TokenLoc.state: not loaded (outside every row's keys); zeros


// One packed row of the CTA's current row group (shared by all warps).
struct RowMeta {
  int64_t pos;      // aligned global position i + sk_global - sq
  int64_t lo, hi;   // visible local keys within the split's range, bounded to the cache
  float slope;      // ALiBi
  int32_t active;
  float qk_scale;   // fp8 K/V: what the f16 q.k products are multiplied by (k_descale x q_descale /
                    // the row's power-of-two q scale); int8: the row's q_scale; 1 otherwise
};
static_assert(sizeof(RowMeta) == kDecodeRowMetaBytes, "decode_config.hpp sizes shared memory with it");

// Union of rows [0, nrows)'s visible keys, keys(j) giving row j's (empty rows skipped): the keys
// a row group streams, the same in every thread.
template <class Keys>
FS_DEV KeyRange key_union(int nrows, const KvRange& range, Keys&& keys) {
  KeyRange u{range.end, range.begin};
  for (int j = 0; j < nrows; ++j) {
    const KeyRange k = keys(j);
    if (k.lo >= k.hi) continue;
    u.lo = imin(u.lo, k.lo);
    u.hi = imax(u.hi, k.hi);
  }
  return u;
}
// The union over the rows' metadata in shared memory.
FS_DEV KeyRange rows_key_union(const RowMeta* meta, int nrows, const KvRange& range) {
  return key_union(nrows, range, [&](int j) { return KeyRange{meta[j].lo, meta[j].hi}; });
}

static_assert(sizeof(TokenLoc) * kTile == decode_loc_bytes(decode_tiling(kDecodeBf16)) &&
                  2 * decode_loc_bytes(decode_tiling(kDecodeBf16)) == decode_loc_bytes(decode_tiling(kDecodeFp8)),
              "decode_config.hpp sizes shared memory with it");

template <DType kKv, DType kV, int kD, int kR, DecodeTiling kTl = decode_tiling(decode_kv(kKv, kV))>
struct Shape {
  static constexpr DType kKDtype = kKv;  // K storage
  static constexpr DType kVDtype = kV;   // V storage
  static constexpr DecodeKv kFmt = decode_kv(kKv, kV);
  static constexpr int kDim = kD;
  static constexpr int kWarps = decode_warps(kD);
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = kR;
  static constexpr int kKb = kFmt.kb;    // bytes per K element
  static constexpr int kVb = kFmt.vb;    // bytes per V element
  static constexpr bool kInt8 = kFmt.int8;  // int8 q and K (s8 mma, per-key scales in the stage)
  static constexpr int kChunks = kD * kKb / kDecodeChunk;  // 16-byte chunks per K row
  static constexpr int kVChunks = kD * kVb / kDecodeChunk;  // 16-byte chunks per V row
  static constexpr int kElems = kDecodeChunk / kKb;       // K elements per chunk
  static constexpr int kChan = kD / 32;                   // output channels per lane
  static constexpr int kKStride = int(decode_k_stride(kFmt, kD));  // +16 B: lanes hit distinct banks
  static constexpr int kVStride = int(decode_v_stride(kFmt, kD));
  static constexpr int kQStride = int(decode_q_stride(kFmt, kD));  // bytes per q row in shared memory
  static constexpr int kStages = kTl.stages;  // cp.async ring depth per warp
  static constexpr int kCtas = kTl.ctas;      // CTAs per SM of the launch bounds (registers: 255 at 2, 168 at 3)
  static constexpr int kTile = kTl.keys;      // keys per warp tile
  static constexpr bool kTma = kTl.tma;       // the TMA form (decode_config.hpp: decode_tma_tiling)
  static constexpr size_t kStageBytes = decode_stage_bytes(kFmt, kD, kTl);
  static constexpr size_t kKScaleOffset = decode_kscale_offset(kFmt, kD, kTl);  // int8: k scales in a stage
  static constexpr size_t kWarpBytes = decode_warp_bytes(kFmt, kD, kTl);
  // A warp's TokenLoc scratch: after its stages (the TMA form: after their bad-key masks too).
  static constexpr size_t kLocOffset = kStages * (kStageBytes + (kTl.tma ? kDecodeStageMaskBytes : 0));
  static_assert(kStages >= 2, "a ring: one tile issued ahead of the one consumed");
  static_assert(kChunks >= 2 && kChunks <= 32 && 32 % kChunks == 0, "a warp copies whole rows");
  static_assert(kVChunks >= 2 && kVChunks <= 32 && 32 % kVChunks == 0, "a warp copies whole rows");
  static_assert(kTile % (32 / kChunks) == 0 && kTile % (32 / kVChunks) == 0, "a tile is whole copy steps");
  static_assert(kChan >= 2, "channels per lane");
  static_assert(kR == 16 || kR == 32, "the tensor cores take 16 rows (the mma's M) per pass, one or two passes");
  static_assert(decode_merge_fits(kFmt, kD, kR, kTl), "the merge area fits in the warps' area");
  static_assert(kKScaleOffset % 16 == 0, "int8 k scales: 16-byte aligned in the stage");
  static_assert(kLocOffset + decode_loc_bytes(kTl) <= kWarpBytes, "the warp's area holds its scratch");
  static_assert(!kTma || (decode_has_tma(kFmt, kD) && kStageBytes % 1024 == 0 && kWarpBytes % 1024 == 0 &&
                          kTile % 16 == 0),
                "the TMA form: 16-bit or fp8 K and V in 128-byte column blocks, 16-row segments, stages 1 KB "
                "aligned");
  // The TMA form's K and V tiles: 16-byte chunk c of key row r at Swz::at(r, c) (TMA's 128-byte
  // swizzle per 128-byte column block); the others' at r x kKStride (kVStride) + 16 c (8-bit K:
  // chunk c ^ (r & 1)).
  using Swz = SwizzledTile<kTile>;
};

// A warp's view of its stage `s`: K [kTile, kKStride] bytes, V [kTile, kVStride] (the TMA form:
// K then V swizzled, S::k_at / v_at), the bad-key mask (bit k: key k lies outside the cache;
// issue_tile; the TMA form's after the stages), int8 K: the keys' scales [kTile] f32 (0 for keys
// not loaded).
template <class S>
struct Stage {
  unsigned char* k;
  unsigned char* v;
  uint32_t* bad;
  float* kscale;
  FS_DEV Stage(unsigned char* warp_base, int s) {
    k = warp_base + size_t(s) * S::kStageBytes;
    if constexpr (S::kTma) {
      v = k + S::kTile * S::kDim * S::kKb;
      bad = reinterpret_cast<uint32_t*>(warp_base + S::kStages * S::kStageBytes + s * kDecodeStageMaskBytes);
      kscale = nullptr;
    } else {
      v = k + S::kTile * S::kKStride;
      bad = reinterpret_cast<uint32_t*>(v + S::kTile * S::kVStride);
      kscale = reinterpret_cast<float*>(k + S::kKScaleOffset);
    }
  }
};

// The TMA form's tensor maps (make_tma_map: boxes of 16 keys x 128 bytes of one head) beside
// the parameters; the other forms' kernels take AttnParams alone.
struct DecodeTmaParams {
  CUtensorMap k, v;
  AttnParams p;
};

// The CTA's sequence: q rows [row_begin, row_end) (clamped into the flat rows: metadata is
// never trusted) and its KV.
struct DecodeSeq {
  SeqRows rows;
  SeqKv kv;
  int64_t sk = 0, sk_global = 0;
  KvRange range{0, 0};
  KeyRange cache{0, 0};
  int splits = 1;  // the sequence's own split count (p.num_splits unless p.split_size > 0)
};

FS_DEV DecodeSeq decode_sequence(const AttnParams& p, int64_t b, int64_t g, int split) {
  DecodeSeq s;
  s.rows.b = b;
  if (p.batched) {
    s.rows.qb = b;
    s.rows.row_begin = b * p.q_rows;
    s.rows.row_end = s.rows.row_begin + p.q_rows;
  } else {
    s.rows.row_begin = imax(0, load_index(p.cu_seqlens_q, b));
    s.rows.row_end = imin(p.total_rows(), load_index(p.cu_seqlens_q, b + 1));
    s.rows.row_end = imax(s.rows.row_begin, s.rows.row_end);
  }
  s.kv = seq_kv(p, b, g);
  s.sk = kv_len(p, b);
  s.sk_global = kv_len_global(p, b, s.sk);
  s.splits = seq_num_splits(s.sk, p.num_splits, p.split_size);
  s.range = seq_split_range(s.sk, p.num_splits, split, p.split_granularity, p.split_size);
  s.cache = generic::cache_tokens(p, s.kv);
  return s;
}

}  // namespace flashserve::kernels::decode

#include "kernels/attention/decode_mainloop.cuh"
