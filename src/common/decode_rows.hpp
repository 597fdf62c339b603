// The decode kernel's packed rows (q_len x GQA group of one KV head) as the kernel runs them
// and the planner counts them, in one place: the kernel (decode_select.cu, launch.cu) takes
// calls up to decode_max_rows and runs their 16-row groups in decode_row_ctas CTAs side by side;
// the planner (plan.cpp) counts that many stream units per (sequence, KV head).
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

// CTAs per (sequence, KV head, split) for a call's bound on packed rows: one per 16-row group, up
// to 4; each takes every R-th group (rows past an understated bound are still served), the R side
// by side in the grid, so they stream the split's KV at the same time and the second read comes
// from L2 (H200: verify q8 B64 L4k 0.78x the time of one CTA's two passes).
inline constexpr int64_t kDecodeMaxRowCtas = 4;
constexpr int decode_row_ctas(int64_t packed_rows) {
  const int64_t groups = (packed_rows + kDecodeRowGroup - 1) / kDecodeRowGroup;
  return int(groups < 1 ? 1 : groups > kDecodeMaxRowCtas ? kDecodeMaxRowCtas : groups);
}

}  // namespace flashserve
