// CPU reference of the KV-cache maintenance calls (cache.hpp). Inputs are validated (and, for
// contents that index memory, checked) by src/api/validate_cache.*; these only compute.
#pragma once

#include <cstdint>
#include <span>

#include "problem/cache.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::reference {

// Writes each token with slot >= 0 into its slot; in slot_mapping order (a repeated slot keeps
// the last token).
void reshape_and_cache(const detail::CacheWriteProblem& pr);

// For each (src, dst) row in order: block dst of every cache = block src (dim-0 slices).
void copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping);
// For each (s, d) row in order: dst block d = src block s.
void swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping);

// vLLM's advance_step_flashattn, rows [num_queries, num_seqs) being CUDA-graph padding
// (input_tokens = 0, input_positions = 0, slot_mapping = -1; seq_lens untouched).
void advance_step(const AdvanceStepParams& p);

// x [T, H, D] -> out int8 [T, H, D], scale fp32 [T, H].
void quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale);

// Dynamic int8 quantization of n contiguous values of dtype t: scale = absmax / 127 (1 when
// absmax is 0), out[c] = round_to_int8(x[c] / scale). Returns the scale.
float quantize_row_int8(const void* x, DType t, int64_t n, int8_t* out);
// Nearest integer (ties to even) clamped to ±127; NaN -> 0.
int8_t round_to_int8(float x);

}  // namespace flashserve::reference
