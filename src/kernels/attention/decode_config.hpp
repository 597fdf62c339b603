// The decode kernel's fixed shape and its one table of instantiations (KV storage dtype x
// head size), read by the selection (decode_select.cu), the launcher (decode_fwd.cu) and the
// shared-memory sizing. Plain C++ (no CUDA headers).
//
// Served: q f16/bf16; K/V of q's dtype or fp8 (e4m3/e5m2, descales [B, H_kv]); D == Dv in the
// table; no q_v, no int8; at most kDecodeMaxRows packed query rows (q_len x group) per
// (sequence, KV head) by the shape. The kernel itself loops over row groups, so a sequence
// longer than max_seqlen_q claims is still computed (only slower).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "api/problem.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

struct AttnKernelChoice;

inline constexpr int kDecodeTileKeys = 16;   // keys per warp tile
inline constexpr int kDecodeStages = 3;       // cp.async stages per warp (2 tiles in flight)
inline constexpr int kDecodeMaxRows = 16;     // packed rows per (sequence, KV head) it is picked for
inline constexpr int kDecodeChunk = 16;       // bytes per cp.async / per K shared-memory read

constexpr int decode_warps(int d) { return d > 128 ? 2 : 4; }
constexpr int decode_row_capacity(int d) { return d > 128 ? 8 : 16; }  // rows per pass (registers)
// Rows per pass of the instantiation picked for at most `packed` rows per (sequence, KV head):
// 4 or 8 (small shared memory: 2 CTAs per SM) or the capacity. Any choice is correct (the
// kernel loops over row groups); the launcher dispatches on it (AttnParams::rows_per_cta).
constexpr int decode_rows_for(int d, int64_t packed) {
  return packed <= 4 ? 4 : packed <= 8 ? 8 : decode_row_capacity(d);
}

struct DecodeConfig {
  DType kv;  // K/V storage dtype
  int d;     // D == Dv
};

#if FLASHSERVE_DEV_CONFIGS
inline constexpr DecodeConfig kDecodeConfigs[] = {{DType::bf16, 128}};
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
inline constexpr size_t kDecodeRowMetaBytes = 32;
inline constexpr size_t kDecodeTokenLocBytes = 24;  // TokenLoc (load.cuh)

// Shared memory layout, in bytes (decode_fwd.cuh carves it the same way):
//   q [rows, D] f32 | meta [rows] | per warp: stages x (K [16, D*kvb + 16], V [16, D*kvb],
//   TokenLoc [16]) and p [rows, 16] f32. The cross-warp merge reuses the per-warp area.
// bf16 D=128 with 4 or 8 rows: ~107 / ~110 KB, so two CTAs (8 warps) share an SM.
constexpr size_t decode_k_stride(int kv_bytes, int d) { return size_t(d * kv_bytes + kDecodeChunk); }
constexpr size_t decode_v_stride(int kv_bytes, int d) { return size_t(d * kv_bytes); }
constexpr size_t decode_stage_bytes(int kv_bytes, int d) {
  return kDecodeTileKeys * (decode_k_stride(kv_bytes, d) + decode_v_stride(kv_bytes, d) + kDecodeTokenLocBytes);
}
constexpr size_t decode_warp_bytes(int kv_bytes, int d, int rows) {
  return kDecodeStages * decode_stage_bytes(kv_bytes, d) + size_t(rows) * kDecodeTileKeys * 4;
}
constexpr size_t decode_head_bytes(int d, int rows) { return size_t(rows) * (size_t(d) * 4 + kDecodeRowMetaBytes); }
constexpr size_t decode_smem_bytes(int kv_bytes, int d, int rows) {
  return decode_head_bytes(d, rows) + size_t(decode_warps(d)) * decode_warp_bytes(kv_bytes, d, rows);
}
// The merge area ([warps, rows, D] outputs and [warps, rows, 2] states) fits in the warps' area.
constexpr bool decode_merge_fits(int kv_bytes, int d, int rows) {
  return size_t(rows) * size_t(d + 2) * 4 <= decode_warp_bytes(kv_bytes, d, rows);
}
static_assert(decode_merge_fits(1, 64, 16) && decode_merge_fits(1, 128, 16) && decode_merge_fits(1, 256, 8));

// The decode candidate of select_attention_kernel (decode_select.cu): fills `c` and returns ""
// when it serves the problem, else the reason it declines.
std::string try_decode(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c);

}  // namespace flashserve::kernels
