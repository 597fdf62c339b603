// The validated, normalized form of merge_states: what validation (api/validate_merge)
// produces and what the CPU reference and the CUDA kernels consume.
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::detail {

// merge_states after validation. LSE views are normalized to token-major [T, H].
struct MergeProblem {
  int64_t tokens = 0, heads = 0, head_dim = 0;  // T, H, D
  int64_t merge_rows = 0;          // rows t < merge_rows merge a and b; the rest copy b
  Device device{};
  TensorRef out, a_out, b_out;     // [T, H, D]
  TensorRef a_lse, b_lse;          // fp32 [T, H]
  OptTensor out_lse;               // fp32 [T, H], may be absent
  DType out_format = DType::f32;   // f16/bf16/f32, or f8e4m3/f8e5m2 (a u8 out holds e4m3)
  OptTensor output_scale;          // fp32, one element; present iff out_format is fp8
};

}  // namespace flashserve::detail
