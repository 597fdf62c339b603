// The decode kernel's fixed shape and its one table of instantiations (KV storage dtype x
// head size), read by the selection (decode_select.cu), the launcher (decode_fwd.cu) and the
// shared-memory sizing. Plain C++ (no CUDA headers).
//
// Served: q f16/bf16 with K/V of q's dtype or fp8 (e4m3/e5m2, descales [B, H_kv]); q fp8 (q_descale
// [B, H_kv]) with fp8 K/V; int8 q (q_scale) with int8 K (k_scale_cache) and int8 V (v_scale,
// K8V8) or 16-bit V (K8V16); D == Dv in the table; no q_v; at most decode_max_rows packed query
// rows (q_len x group) per (sequence, KV head) by the shape (common/decode_rows.hpp). The kernel
// itself loops over row groups, so a sequence longer than max_seqlen_q claims is still computed
// (only slower).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/decode_rows.hpp"
#include "kernels/common/sm_fit.hpp"
#include "problem/attention.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

struct AttnKernelChoice;

inline constexpr int kDecodeTileKeys = 16;   // keys per warp tile, 16-bit K/V

// The KV storage format the shared-memory layout and the tile follow: bytes per stored K and V
// element (2: f16/bf16, 1: fp8 or int8) and whether K is int8 (the vLLM int8 fork's K8V8 /
// K8V16: int8 q and K on the s8 mma with per-key k scales copied per tile, decode_mma.cuh).
struct DecodeKv {
  int kb;     // bytes per K element
  int vb;     // bytes per V element
  bool int8;  // int8 K (and q): per-key scales in the stage
};
// Bytes per stored K/V element: 2 (f16/bf16), 1 (fp8, int8).
constexpr int kv_bytes(DType t) { return (t == DType::f16 || t == DType::bf16) ? 2 : 1; }
constexpr DecodeKv decode_kv(DType k, DType v) { return {kv_bytes(k), kv_bytes(v), k == DType::i8}; }
constexpr DecodeKv decode_kv(DType kv) { return decode_kv(kv, kv); }

// Keys per warp tile: 16 for 16-bit K/V, 32 for 8-bit K and V (fp8, int8 K8V8: the same 8 KB per
// tile at D=128: the per-tile work (table reads, copy issue, softmax, merges) is paid per byte as
// for bf16); int8 K8V16 (6 KB per 16-key tile) takes 16 (32-key tiles would not leave two CTAs
// per SM) with a 4-deep ring instead (3 tiles = 18 KB in flight per warp).
constexpr int decode_tile_keys(DecodeKv f) { return f.kb == 1 && f.vb == 1 ? 2 * kDecodeTileKeys : kDecodeTileKeys; }
// cp.async stages per warp: 3 (2 tiles = 16 KB in flight per warp at D=128, 16-bit or 8-bit K/V);
// 4 for K8V16.
constexpr int decode_stages(DecodeKv f) { return f.kb != f.vb ? 4 : 3; }
inline constexpr int kDecodeChunk = 16;       // bytes per cp.async / per K shared-memory read

constexpr int decode_warps(int d) { return d > 128 ? 2 : 4; }
// q.k and p.v run on the tensor cores (mma.sync, decode_mma.cuh): one pass covers 16 packed rows
// at the cost of one (the mma's M). 16-bit K/V in q's type; fp8 K/V as f16 operands (converted
// in registers, exact), q as f16 (exact; bf16 q scaled by a power of two per row); int8 q.k on
// m16n8k32 s8 (s32 sums, exact), int8 V as f16 operands (exact). Every format (2-byte and
// 1-byte K) takes this path; 16 packed rows per pass (the mma's M), whatever the row count: the
// kernel loops over row groups (common/decode_rows.hpp's kDecodeRowGroup).
inline constexpr int kDecodeRows = int(kDecodeRowGroup);

struct DecodeConfig {
  DType kv;  // K storage dtype
  int d;     // D == Dv
  DType v;   // V storage dtype: kv's, except int8 K8V16 (i8 K, f16/bf16 V)
};

#if FLASHSERVE_DEV_CONFIGS
inline constexpr DecodeConfig kDecodeConfigs[] = {  // the benchmark's (e5m2: its row and the GPU tests' e5m2 cases)
    {DType::bf16, 128, DType::bf16}, {DType::f8e4m3, 128, DType::f8e4m3}, {DType::f8e5m2, 128, DType::f8e5m2},
    {DType::i8, 128, DType::i8},     {DType::i8, 128, DType::bf16}};
#else
inline constexpr DecodeConfig kDecodeConfigs[] = {
    {DType::f16, 64, DType::f16},       {DType::f16, 128, DType::f16},       {DType::f16, 256, DType::f16},
    {DType::bf16, 64, DType::bf16},     {DType::bf16, 128, DType::bf16},     {DType::bf16, 256, DType::bf16},
    {DType::f8e4m3, 64, DType::f8e4m3}, {DType::f8e4m3, 128, DType::f8e4m3}, {DType::f8e4m3, 256, DType::f8e4m3},
    {DType::f8e5m2, 64, DType::f8e5m2}, {DType::f8e5m2, 128, DType::f8e5m2}, {DType::f8e5m2, 256, DType::f8e5m2},
    {DType::i8, 64, DType::i8},         {DType::i8, 128, DType::i8},         {DType::i8, 256, DType::i8},
    {DType::i8, 64, DType::f16},        {DType::i8, 128, DType::f16},        {DType::i8, 256, DType::f16},
    {DType::i8, 64, DType::bf16},       {DType::i8, 128, DType::bf16},       {DType::i8, 256, DType::bf16}};
#endif

constexpr bool decode_config_built(DType kv, int64_t d, DType v) {
  for (const DecodeConfig& c : kDecodeConfigs)
    if (c.kv == kv && c.d == d && c.v == v) return true;
  return false;
}
constexpr bool decode_config_built(DType kv, int64_t d) { return decode_config_built(kv, d, kv); }

// Per-row metadata in shared memory (decode_fwd.cuh's RowMeta).
inline constexpr size_t kDecodeRowMetaBytes = 40;
inline constexpr size_t kDecodeStageMaskBytes = 16;  // a stage's bad-key mask (padded)

// How a launch streams keys: keys per warp tile, the depth of each warp's ring, the CTAs per SM
// the kernel's launch bounds ask for (its register budget: 255 at 2, 168 at 3), and whether the
// ring is the TMA form (decode_tma_tiling).
struct DecodeTiling {
  int keys;
  int stages;
  int ctas;
  bool tma = false;
};
// Long splits: decode_tile_keys and decode_stages, two CTAs per SM (by shared memory).
constexpr DecodeTiling decode_tiling(DecodeKv f) { return {decode_tile_keys(f), decode_stages(f), 2}; }
// The TMA form of the long tiling (sm_90a; 16-bit K and V at D = 64 or 128, or fp8 K and V at
// D = 128, whose rows fill 128-byte column blocks; launchers.hpp's decode_tma_form says where): a
// tile whose keys are all in the cache, 16 rows per page segment (pages of 16 x k keys, or
// contiguous rows), is one TMA box per segment and 128-byte column block of K and of V, issued by
// as many lanes,
// completing the stage's full mbarrier, where the cp.async ring takes 512 16-byte copies per tile
// and warp (ncu, bf16 B = 1 L = 32k: 27% of the stall samples wait for the block-table entries
// queued behind them); other tiles (sequence tails, bad block ids) are copied with cp.async as
// before, arriving on the same barrier. Stages hold K then V as SwizzledTile<keys> (128-byte
// swizzle, no row pad: TMA's layout), 1024-byte aligned; the bad-key masks after the stages, the
// barriers after the rows' metadata (outside the warps' area, which the merge reuses).
// D = 256 stays on the ring: its TMA kernels spill more (full build: bf16 208 B of stack against
// the ring's 176, fp8 280 against 72) and no row of the A/B measures it.
constexpr bool decode_has_tma(DecodeKv f, int d) { return f.kb == f.vb && !f.int8 && d * f.kb >= 128 && d <= 128; }
constexpr DecodeTiling decode_tma_tiling(DecodeKv f) {
  DecodeTiling t = decode_tiling(f);
  t.tma = true;
  return t;
}
constexpr size_t decode_loc_bytes(DecodeTiling t) { return size_t(t.keys) * 24; }  // a warp's TokenLoc [keys] (load.cuh)

// Shared memory layout, in bytes (decode_fwd.cuh carves it the same way):
//   q [rows, D] (q's 16-bit type or, for fp8 K/V, f16 in the channel order of decode_mma.cuh;
//   int8: int8 in that module's order; rows padded by 16 B) | meta [rows] |
//   per warp: stages x (K [tile keys, D*kb + 16 (8-bit: D)], V [tile keys, D*vb + 16], bad-key
//   mask, int8: k scales [tile keys] f32) and TokenLoc [tile]. The +16 B row pads put ldmatrix
//   rows on distinct banks. The cross-warp merge reuses the per-warp area.
// Long tiling at D=128, 16 rows: bf16 111 KB; fp8 (32-key tiles) 110 KB; int8 K8V8 112 KB, K8V16
// (16-key tiles, 4 stages) 108 KB; so two CTAs (8 warps) share an SM. Short tiling: bf16 75 KB,
// fp8 41 KB, K8V8 42 KB, K8V16 57 KB.
// 8-bit K rows are unpadded (16-byte chunk c of key row r stored at c ^ (r & 1): decode_mma.cuh's
// reads stay on distinct banks), so that 32-key fp8 stages keep two CTAs per SM.
constexpr size_t decode_k_stride(DecodeKv f, int d) {
  return f.kb == 1 ? size_t(d) : size_t(d * f.kb + kDecodeChunk);
}
constexpr size_t decode_v_stride(DecodeKv f, int d) { return size_t(d * f.vb + kDecodeChunk); }
constexpr size_t decode_q_stride(DecodeKv, int d) {  // bytes per q row in shared memory
  return size_t(d * 2 + kDecodeChunk);
}
constexpr size_t decode_kscale_offset(DecodeKv f, int d, DecodeTiling t) {  // in a stage
  return size_t(t.keys) * (decode_k_stride(f, d) + decode_v_stride(f, d)) + kDecodeStageMaskBytes;
}
constexpr size_t decode_stage_bytes(DecodeKv f, int d, DecodeTiling t) {
  if (t.tma) return size_t(t.keys) * size_t(d) * size_t(f.kb + f.vb);  // K, V swizzled (a multiple of 1 KB)
  return decode_kscale_offset(f, d, t) + (f.int8 ? size_t(t.keys) * 4 : 0);
}
constexpr size_t decode_round_kb(size_t bytes) { return (bytes + 1023) / 1024 * 1024; }
constexpr size_t decode_warp_bytes(DecodeKv f, int d, DecodeTiling t) {
  if (t.tma)  // the stages, their bad-key masks, TokenLoc [keys]; the next warp's stages 1 KB aligned
    return decode_round_kb(size_t(t.stages) * (decode_stage_bytes(f, d, t) + kDecodeStageMaskBytes) +
                           decode_loc_bytes(t));
  return size_t(t.stages) * decode_stage_bytes(f, d, t) + decode_loc_bytes(t);
}
constexpr size_t decode_head_bytes(DecodeKv f, int d, int rows) {
  return size_t(rows) * (decode_q_stride(f, d) + kDecodeRowMetaBytes);
}
// The TMA form's full barriers [warps, stages] after the rows' metadata, then up to 1 KB to the
// warps' area's alignment.
constexpr size_t decode_tma_head_bytes(int d, DecodeTiling t) {
  return t.tma ? size_t(decode_warps(d)) * size_t(t.stages) * 8 + 1024 : 0;
}
constexpr size_t decode_smem_bytes(DecodeKv f, int d, int rows, DecodeTiling t) {
  return decode_head_bytes(f, d, rows) + decode_tma_head_bytes(d, t) +
         size_t(decode_warps(d)) * decode_warp_bytes(f, d, t);
}
constexpr size_t decode_smem_bytes(DecodeKv f, int d, int rows) { return decode_smem_bytes(f, d, rows, decode_tiling(f)); }
// Short splits (no warp streams more than two 16-key tiles): the CTA is one latency chain (table,
// copies, q, one or two tiles, merge, store: ~12k cycles at 8 cycles per instruction, ncu at
// B = 256 L = 64) with little to stream, so more of them share an SM: 16-key tiles in a two-deep
// ring, three CTAs per SM where shared memory holds them (every format at D <= 128; two at
// D = 256, which has two warps), q's fragments read from shared memory per tile (decode_mma.cuh:
// held in registers they made the 168-register budget spill 100-230 B, whose local loads ate
// the third CTA's gain: bf16 L = 64 54.8 -> 54.0 us; from shared memory 54.8 -> 44.6 us,
// bench/RESULTS.md 22:10).
constexpr DecodeTiling decode_short_tiling(DecodeKv f, int d) {
  DecodeTiling t{kDecodeTileKeys, 2, 3};
  if (!sm90_ctas_fit(decode_smem_bytes(f, d, kDecodeRows, t), t.ctas)) t.ctas = 2;
  return t;
}
// 32-row CTAs (common/decode_rows.hpp: verify steps past 16 packed rows of a 16-bit cache; long
// splits): 16-key tiles (two passes' scores and O already hold 160 registers), two CTAs per SM,
// the long tiling's ring made shallower until it fits beside the larger q (D = 128: 2 stages,
// 81 KB). 8-bit caches keep 16-row CTAs (decode_cta_rows: fp8 ran slower in 32-row ones).
constexpr bool decode_has_wide(DecodeKv f) { return f.kb == 2; }
constexpr DecodeTiling decode_wide_tiling(DecodeKv f, int d, bool tma = false) {
  DecodeTiling t{kDecodeTileKeys, decode_stages(f), 2, tma};
  while (t.stages > 2 && !sm90_ctas_fit(decode_smem_bytes(f, d, int(kDecodeWideRows), t), t.ctas)) --t.stages;
  return t;
}
// The TMA form of the 32-row CTAs (decode_tma_tiling's stages, unpadded): D = 128 keeps the long
// tiling's 3 stages (107 KB) where the padded ring fits 2.
constexpr DecodeTiling decode_wide_tma_tiling(DecodeKv f, int d) { return decode_wide_tiling(f, d, true); }
// Whether the launch takes the short tiling: a split's key span (bounded by the block table's
// width x block size, or the contiguous cache's rows) gives no warp more than two 16-key tiles.
constexpr bool decode_launch_short(int d, int64_t span, int splits) {
  const int64_t per_split = (span + splits - 1) / (splits > 0 ? splits : 1);
  return per_split <= int64_t(decode_warps(d)) * 2 * kDecodeTileKeys;
}
// The merge area ([warps, rows, D] outputs and [warps, rows, 2] states) fits in the warps' area.
constexpr bool decode_merge_fits(DecodeKv f, int d, int rows, DecodeTiling t) {
  return size_t(rows) * size_t(d + 2) * 4 <= decode_warp_bytes(f, d, t);
}
// Splits merged in a cluster (cluster_merge.cuh): the merge area and, after it, the CTA's
// normalized partial rows ([rows, D] and their LSEs [rows]) and cluster_combine's scratch
// ([kClusterMaxCtas + 1, rows]) fit in the warps' area.
constexpr bool decode_cluster_merge_fits(DecodeKv f, int d, int rows, DecodeTiling t) {
  const size_t floats = size_t(decode_warps(d)) * size_t(rows) * size_t(d + 2) + size_t(rows) * size_t(d + 1) +
                        size_t(kClusterMaxCtas + 1) * size_t(rows);
  return floats * 4 <= size_t(decode_warps(d)) * decode_warp_bytes(f, d, t);
}
constexpr bool decode_merge_fits(DecodeKv f, int d, int rows) {
  return decode_merge_fits(f, d, rows, decode_tiling(f)) && decode_merge_fits(f, d, rows, decode_short_tiling(f, d)) &&
         (!decode_has_wide(f) || decode_merge_fits(f, d, int(kDecodeWideRows), decode_wide_tiling(f, d)));
}
inline constexpr DecodeKv kDecodeBf16 = decode_kv(DType::bf16), kDecodeFp8 = decode_kv(DType::f8e4m3),
                          kDecodeK8V8 = decode_kv(DType::i8), kDecodeK8V16 = decode_kv(DType::i8, DType::bf16);
static_assert(decode_merge_fits(kDecodeFp8, 64, 16) && decode_merge_fits(kDecodeFp8, 128, 16) &&
              decode_merge_fits(kDecodeFp8, 256, 8));
static_assert(decode_merge_fits(kDecodeBf16, 64, 16) && decode_merge_fits(kDecodeBf16, 128, 16) &&
              decode_merge_fits(kDecodeBf16, 256, 16));
static_assert(decode_merge_fits(kDecodeK8V8, 64, 16) && decode_merge_fits(kDecodeK8V8, 256, 16) &&
              decode_merge_fits(kDecodeK8V16, 64, 16) && decode_merge_fits(kDecodeK8V16, 256, 16));
// The CTAs per SM each tiling asks for fit in shared memory (228 KB, 1 KB reserved per CTA) for
// the D=128 and D=256 shapes of every format; the short tiling takes three at D = 128.
constexpr bool decode_ctas_fit(DecodeKv f, int d) {
  const DecodeTiling l = decode_tiling(f), s = decode_short_tiling(f, d), w = decode_wide_tiling(f, d);
  return sm90_ctas_fit(decode_smem_bytes(f, d, 16, l), l.ctas) && sm90_ctas_fit(decode_smem_bytes(f, d, 16, s), s.ctas) &&
         (!decode_has_wide(f) || sm90_ctas_fit(decode_smem_bytes(f, d, int(kDecodeWideRows), w), w.ctas));
}
static_assert(decode_ctas_fit(kDecodeBf16, 128) && decode_ctas_fit(kDecodeBf16, 256));
static_assert(sm90_ctas_fit(decode_smem_bytes(kDecodeBf16, 64, 16, decode_tma_tiling(kDecodeBf16)), 2) &&
              sm90_ctas_fit(decode_smem_bytes(kDecodeBf16, 128, 16, decode_tma_tiling(kDecodeBf16)), 2) &&
              decode_merge_fits(kDecodeBf16, 64, 16, decode_tma_tiling(kDecodeBf16)));
static_assert(decode_wide_tma_tiling(kDecodeBf16, 128).stages == 3 &&
              decode_wide_tiling(kDecodeBf16, 128).stages == 2 &&
              decode_merge_fits(kDecodeBf16, 128, int(kDecodeWideRows), decode_wide_tma_tiling(kDecodeBf16, 128)));
static_assert(sm90_ctas_fit(decode_smem_bytes(kDecodeFp8, 128, 16, decode_tma_tiling(kDecodeFp8)), 2));
static_assert(decode_ctas_fit(kDecodeFp8, 128) && decode_ctas_fit(kDecodeFp8, 256));
static_assert(decode_ctas_fit(kDecodeK8V8, 128) && decode_ctas_fit(kDecodeK8V8, 256));
static_assert(decode_ctas_fit(kDecodeK8V16, 128) && decode_ctas_fit(kDecodeK8V16, 256));
static_assert(decode_short_tiling(kDecodeBf16, 128).ctas == 3 && decode_short_tiling(kDecodeFp8, 128).ctas == 3 &&
              decode_short_tiling(kDecodeK8V8, 128).ctas == 3 && decode_short_tiling(kDecodeK8V16, 128).ctas == 3);

// The decode candidate of select_attention_kernel (decode_select.cu): fills `c` and returns ""
// when it serves the problem, else the reason it declines.
std::string try_decode(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c);

}  // namespace flashserve::kernels
