// The decode kernel's fixed shape and its one table of instantiations (KV storage dtype x
// head size), read by the selection (decode_select.cu), the launcher (decode_fwd.cu) and the
// shared-memory sizing. Plain C++ (no CUDA headers).
//
// Served: q f16/bf16 with K/V of q's dtype or fp8 (e4m3/e5m2, descales [B, H_kv]); q fp8 (q_descale
// [B, H_kv]) with fp8 K/V; D == Dv in the table; no q_v, no int8; at most kDecodeMaxRows packed query rows (q_len x group) per
// (sequence, KV head) by the shape. The kernel itself loops over row groups, so a sequence
// longer than max_seqlen_q claims is still computed (only slower).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "problem/attention.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

struct AttnKernelChoice;

inline constexpr int kDecodeTileKeys = 16;   // keys per warp tile, 16-bit K/V
// Keys per warp tile: 16 for 16-bit K/V, 32 for fp8 (the same 8 KB per tile at D=128: the
// per-tile work (table reads, copy issue, softmax, merges) is paid per byte as for bf16).
constexpr int decode_tile_keys(int kv_bytes) { return kv_bytes == 1 ? 2 * kDecodeTileKeys : kDecodeTileKeys; }
// cp.async stages per warp: 3 (2 tiles = 16 KB in flight per warp at D=128, 16-bit or fp8).
constexpr int decode_stages(int /*kv_bytes*/) { return 3; }
inline constexpr int kDecodeMaxRows = 16;     // packed rows per (sequence, KV head) it is picked for
inline constexpr int kDecodeChunk = 16;       // bytes per cp.async / per K shared-memory read

constexpr int decode_warps(int d) { return d > 128 ? 2 : 4; }
// q.k and p.v run on the tensor cores (mma.sync m16n8k16, decode_mma.cuh): one pass covers 16
// packed rows at the cost of one (the mma's M). 16-bit K/V in q's type; fp8 K/V as f16 operands
// (converted in registers, exact), q as f16 (exact; bf16 q scaled by a power of two per row).
// The fp32 CUDA-core path (decode_mainloop.cuh) stays for kv_bytes where this returns false
// (none now).
constexpr bool decode_uses_mma(int kv_bytes) { return kv_bytes == 2 || kv_bytes == 1; }
// Bytes per stored K/V element: 2 (f16/bf16), 1 (fp8).
constexpr int kv_bytes(DType t) { return (t == DType::f16 || t == DType::bf16) ? 2 : 1; }
constexpr int decode_row_capacity(int kv_bytes, int d) {  // rows per pass (registers)
  return decode_uses_mma(kv_bytes) || d <= 128 ? 16 : 8;
}
// Rows per pass of the instantiation picked for at most `packed` rows per (sequence, KV head):
// the tensor-core path always takes 16; the CUDA-core path 4 or 8 (small shared memory: 2
// CTAs per SM) or the capacity. Any choice is correct (the kernel loops over row groups); the
// launcher dispatches on it (AttnParams::rows_per_cta).
constexpr int decode_rows_for(int kv_bytes, int d, int64_t packed) {
  if (decode_uses_mma(kv_bytes)) return 16;
  return packed <= 4 ? 4 : packed <= 8 ? 8 : decode_row_capacity(kv_bytes, d);
}

struct DecodeConfig {
  DType kv;  // K/V storage dtype
  int d;     // D == Dv
};

#if FLASHSERVE_DEV_CONFIGS
inline constexpr DecodeConfig kDecodeConfigs[] = {{DType::bf16, 128}, {DType::f8e4m3, 128}};  // the benchmark's
#else
inline constexpr DecodeConfig kDecodeConfigs[] = {
    {DType::f16, 64},     {DType::f16, 128},     {DType::f16, 256},     {DType::bf16, 64},
    {DType::bf16, 128},   {DType::bf16, 256},    {DType::f8e4m3, 64},   {DType::f8e4m3, 128},
    {DType::f8e4m3, 256}, {DType::f8e5m2, 64},   {DType::f8e5m2, 128},  {DType::f8e5m2, 256}};
#endif

constexpr bool decode_config_built(DType kv, int64_t d) {
  for (const DecodeConfig& c : kDecodeConfigs)
    if (c.kv == kv && c.d == d) return true;
  return false;
}

// Per-row metadata in shared memory (decode_fwd.cuh's RowMeta).
inline constexpr size_t kDecodeRowMetaBytes = 40;
inline constexpr size_t kDecodeStageMaskBytes = 16;  // a stage's bad-key mask (padded)
// `tile` (keys per warp tile) 0: decode_tile_keys(kv_bytes). fp8 also runs 16-key tiles (a second
// instantiation) on splits too short to give every warp a 32-key tile (decode_fwd.cu).
constexpr size_t decode_loc_bytes(int kv_bytes, int tile = 0) {  // a warp's TokenLoc [tile keys] (load.cuh)
  return size_t(tile ? tile : decode_tile_keys(kv_bytes)) * 24;
}

// Shared memory layout, in bytes (decode_fwd.cuh carves it the same way):
//   q [rows, D] (f32; tensor-core path: q's 16-bit type or, for fp8 K/V, f16 in the channel order
//   of decode_mma.cuh; rows padded by 16 B) | meta [rows] |
//   per warp: stages x (K [tile keys, D*kvb + 16 (fp8: D)], V [tile keys, D*kvb + 16], bad-key mask), TokenLoc [16] and, on the
//   CUDA-core path, p [rows, 16] f32. The +16 B row pads put ldmatrix rows (and the CUDA-core
//   path's lanes) on distinct banks. The cross-warp merge reuses the per-warp area.
// bf16 D=128, 16 rows: 111 KB; fp8 D=128 (32-key tiles): 110 KB; so two CTAs (8 warps) share an SM.
// fp8 K rows are unpadded (16-byte chunk c of key row r stored at c ^ (r & 1): decode_mma.cuh's
// reads stay on distinct banks), so that 32-key fp8 stages keep two CTAs per SM.
constexpr size_t decode_k_stride(int kv_bytes, int d) {
  return kv_bytes == 1 ? size_t(d) : size_t(d * kv_bytes + kDecodeChunk);
}
constexpr size_t decode_v_stride(int kv_bytes, int d) { return size_t(d * kv_bytes + kDecodeChunk); }
constexpr size_t decode_q_stride(int kv_bytes, int d) {  // bytes per q row in shared memory
  return decode_uses_mma(kv_bytes) ? size_t(d * 2 + kDecodeChunk) : size_t(d) * 4;
}
constexpr size_t decode_stage_bytes(int kv_bytes, int d, int tile = 0) {
  return size_t(tile ? tile : decode_tile_keys(kv_bytes)) * (decode_k_stride(kv_bytes, d) + decode_v_stride(kv_bytes, d)) +
         kDecodeStageMaskBytes;
}
constexpr size_t decode_warp_bytes(int kv_bytes, int d, int rows, int tile = 0) {
  return size_t(decode_stages(kv_bytes)) * decode_stage_bytes(kv_bytes, d, tile) + decode_loc_bytes(kv_bytes, tile) +
         (decode_uses_mma(kv_bytes) ? 0 : size_t(rows) * decode_tile_keys(kv_bytes) * 4);
}
constexpr size_t decode_head_bytes(int kv_bytes, int d, int rows) {
  return size_t(rows) * (decode_q_stride(kv_bytes, d) + kDecodeRowMetaBytes);
}
constexpr size_t decode_smem_bytes(int kv_bytes, int d, int rows, int tile = 0) {
  return decode_head_bytes(kv_bytes, d, rows) + size_t(decode_warps(d)) * decode_warp_bytes(kv_bytes, d, rows, tile);
}
// The tile the launcher runs: fp8 takes 16-key tiles when a split's key span (bounded by the
// block table's width x block size, or the contiguous cache's rows) leaves some warp without a
// 32-key tile (short contexts: all warps stay busy; measured at L = 64 on the H200, 32-key fp8
// tiles took 1.16x bf16's time).
constexpr int decode_launch_tile(int kv_bytes, int d, int64_t span, int splits) {
  const int64_t per_split = (span + splits - 1) / (splits > 0 ? splits : 1);
  return kv_bytes == 1 && per_split < int64_t(decode_warps(d)) * decode_tile_keys(kv_bytes) ? kDecodeTileKeys
                                                                                             : decode_tile_keys(kv_bytes);
}
// The merge area ([warps, rows, D] outputs and [warps, rows, 2] states) fits in the warps' area.
constexpr bool decode_merge_fits(int kv_bytes, int d, int rows) {
  return size_t(rows) * size_t(d + 2) * 4 <= decode_warp_bytes(kv_bytes, d, rows);
}
static_assert(decode_merge_fits(1, 64, 16) && decode_merge_fits(1, 128, 16) && decode_merge_fits(1, 256, 8));
static_assert(decode_merge_fits(2, 64, 16) && decode_merge_fits(2, 128, 16) && decode_merge_fits(2, 256, 16));
// Two CTAs per SM (228 KB, 1 KB reserved per CTA) for the bf16 D=128 and D=256 shapes.
static_assert(2 * (decode_smem_bytes(2, 128, 16) + 1024) <= 228 * 1024);
static_assert(2 * (decode_smem_bytes(2, 256, 16) + 1024) <= 228 * 1024);
static_assert(2 * (decode_smem_bytes(1, 128, 16) + 1024) <= 228 * 1024);
static_assert(2 * (decode_smem_bytes(1, 256, 16) + 1024) <= 228 * 1024);

// The decode candidate of select_attention_kernel (decode_select.cu): fills `c` and returns ""
// when it serves the problem, else the reason it declines.
std::string try_decode(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c);

}  // namespace flashserve::kernels
