// CUDA launchers of the KV-cache maintenance calls (flashserve/cache.hpp). A plain C++ header:
// host code includes it without CUDA headers. Defined only in CUDA builds (FLASHSERVE_WITH_CUDA=1).
//
// Inputs are validated by src/api/validate_cache.* (shapes, dtypes, devices). The contents that
// index memory (slots, block indices, sequence lengths) live on the device and cannot be checked
// on the host without a synchronization, so on CUDA, out-of-range indices are skipped, never
// accessed: a slot outside [0, num_blocks * block_size) writes nothing, a block_mapping row with
// a block outside [0, num_blocks) copies nothing, an advance_step row whose next position falls
// outside its block-table row (or whose seq_len is negative or INT32_MAX) is written as a padding
// row. Results otherwise equal the CPU reference bit for bit.
//
// Every launch goes on `stream` (a cudaStream_t; null = the default stream) of the current
// device; nothing is allocated and nothing waits for the device, so the calls can be captured in
// a CUDA graph (swap_blocks too, when its host memory is pinned).
#pragma once

#include <span>

#include "problem/cache.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

// One warp per (token, K or V head row). Tokens run in parallel: a slot repeated in
// slot_mapping gets one of its tokens, unspecified which (the CPU keeps the last).
void reshape_and_cache(const detail::CacheWriteProblem& pr, void* stream);

// One launch per 256 caches; block_mapping (int64 [n, 2]) on the device. Pairs run in parallel:
// a destination must not be the source or destination of another pair (the CPU runs them in
// order).
void copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping, void* stream);

// cudaMemcpyAsync (2-D for strided blocks) per block pair, any direction between host and
// device memory; block_mapping on the CPU, already range-checked by the caller.
void swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping, void* stream);

// One thread per row of the tensors (num_seqs rows).
void advance_step(const AdvanceStepParams& p, void* stream);

// One warp per (token, head).
void quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale, void* stream);

}  // namespace flashserve::kernels
