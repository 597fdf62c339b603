// The decode kernel's packed rows (q_len x GQA group of one KV head) as the kernel runs them
// and the planner counts them, in one place: the kernel (decode_select.cu, launch.cu) takes
// calls up to decode_max_rows and runs their 16- or 32-row groups in decode_row_ctas CTAs side
// by side; the planner (plan.cpp) counts that many stream units per (sequence, KV head).
#pragma once

#include <cstdint>

namespace flashserve {

// Packed rows per pass of the decode kernel (the mma's M).
inline constexpr int64_t kDecodeRowGroup = 16;
// Verify steps past one group: up to 32 packed rows of a 16-bit cache (prefill_tma ran q_len 8 x
// group 4 at 18% of the copy ceiling), 64 of an 8-bit one (the generic kernel ran fp8 q_len 8
// at 1%).
inline constexpr int64_t kDecodeVerifyMaxRows16 = 32;
inline constexpr int64_t kDecodeVerifyMaxRows8 = 64;
constexpr int64_t decode_max_rows(bool kv_8bit) { return kv_8bit ? kDecodeVerifyMaxRows8 : kDecodeVerifyMaxRows16; }

// Packed rows per CTA for a call's bound on packed rows: one 16-row group, or, for a 16-bit cache,
// two (32 rows) past it, where the long tiling runs both groups' MMAs on each tile of one copy of
// the keys (decode_fwd.cu; the short tiling and batch-invariant calls run 16-row CTAs: as many
// again). H200, verify q8 GQA 4 B64 L4k: bf16 439 -> 349 us, q6 435 -> 320; fp8 299 -> 313 and
// B1 57 -> 72 (its 32-key tiles halve, its conversions bind), so 8-bit caches keep 16-row CTAs
// (bench/RESULTS.md, 2026-11-26 00:40; with issue_tile's batched location reads bf16 q8 315 us).
inline constexpr int64_t kDecodeWideRows = 32;
constexpr int64_t decode_cta_rows(int64_t packed_rows, bool kv_8bit) {
  return packed_rows > kDecodeRowGroup && !kv_8bit ? kDecodeWideRows : kDecodeRowGroup;
}
// CTAs per (sequence, KV head, split) for a call's bound on packed rows: one per CTA's rows
// (decode_cta_rows), up to 4; each takes every R-th group (rows past an understated bound are
// still served), the R side by side in the grid, so they stream the split's KV at the same time
// and the second read comes from L2 (H200: 16-row CTAs at verify q8 B64 L4k took 0.78x the time
// of one CTA's two passes over the KV).
inline constexpr int64_t kDecodeMaxRowCtas = 4;
constexpr int decode_row_ctas(int64_t packed_rows, bool kv_8bit) {
  const int64_t rows = decode_cta_rows(packed_rows, kv_8bit), ctas = (packed_rows + rows - 1) / rows;
  return int(ctas < 1 ? 1 : ctas > kDecodeMaxRowCtas ? kDecodeMaxRowCtas : ctas);
}

}  // namespace flashserve
