// CUDA launcher of merge_states (flashserve/merge.hpp). A plain C++ header: host code includes it
// without CUDA headers. Defined only in CUDA builds (FLASHSERVE_WITH_CUDA=1).
#pragma once

#include "problem/merge.hpp"

namespace flashserve::kernels {

// One warp per (token, head) row, on `stream` (a cudaStream_t; null = the default stream) of the
// current device; no allocation, no host synchronization (graph-capturable). fp32 math through
// merge_lse (common/softmax_state.hpp) as the CPU reference; the weights come from the device's
// expf/logf, so merged values may differ from the CPU's in the last bits of fp32 (copied rows,
// empty rows and rows with one empty side are bit-exact).
void merge_states(const detail::MergeProblem& pr, void* stream);

}  // namespace flashserve::kernels
