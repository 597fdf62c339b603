// The kernels' CTA shapes as the planner's cost models count them: plan.cpp's split-count
// heuristic and cascade.cpp's cascade decision (one place, so the two count the same CTAs).
#pragma once

#include <cstdint>

namespace flashserve::planner {

inline constexpr int64_t kKvTileKeys = 128;        // KV tokens per tile: the GPU split granule
inline constexpr int64_t kDecodePackedRows = 64;   // decode-like CTAs: packed (query row, head) rows of one KV head
inline constexpr int64_t kPrefillRowsPerCta = 128;  // prefill CTAs: query rows of one head (no GQA packing)
// (prefill_tma takes 192 rows at D = Dv = 64 where select.hpp's prefill_tma_rows picks them: the
// split heuristic still counts 128, up to 1.5x the CTAs that run, so it splits such calls a little
// less often than an exact count would; the cascade's prefix pass, fp32 out, always runs 128.)

// MLA's absorbed decode (q_v: Dv > D): one latent row per key serves every head.
inline constexpr bool is_mla_decode(int64_t head_dim, int64_t head_dim_v) { return head_dim_v > head_dim; }

}  // namespace flashserve::planner
