// Merging partial attention states (SPEC.md §4): (o_a, lse_a) ⊕ (o_b, lse_b).
#pragma once

#include <cstdint>
#include <optional>

#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve {

// LSE layouts: vLLM's merge_attn_states uses [H, T]; SGLang's merge_state_v2 uses [T, H].
enum class LseLayout : uint8_t { head_major, token_major };

struct MergeParams {
  TensorRef out;            // [T, H, D]; f16/bf16/f32, or fp8 with output_scale
  OptTensor out_lse;        // fp32, layout lse_layout. may be absent
  TensorRef a_out;          // prefix state [T, H, D] (f16/bf16/f32)
  TensorRef a_lse;          // fp32 [H, T] or [T, H]
  TensorRef b_out;          // suffix state [T, H, D]
  TensorRef b_lse;
  LseLayout lse_layout = LseLayout::head_major;
  // Rows t >= this copy the suffix state (b) raw: prefill tokens without context.
  std::optional<int64_t> prefill_tokens_with_context;
  OptTensor output_scale;   // fp32 [] or [1]: out is fp8, stores clamp(x / scale, ±max)
};

// m = max(l_a, l_b); w = exp(l - m); o = (w_a o_a + w_b o_b) / (w_a + w_b); l = m + log(w_a + w_b).
// +inf LSE counts as -inf; both empty -> o = 0, l = -inf. fp32 math.
void merge_states(const MergeParams& p, const ExecContext& ctx = {});

}  // namespace flashserve
