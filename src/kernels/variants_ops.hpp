// CUDA launchers of the layer-variant operations (flashserve/variants_ops.hpp). A plain C++
// header: host code includes it without CUDA headers. Defined only in CUDA builds
// (FLASHSERVE_WITH_CUDA=1).
//
// Inputs are validated by src/api/validate_variants.* (shapes, dtypes, devices). gather_cache's
// contents (lengths, query offsets, block indices) live on the device and are not checked on the
// host: its ranges and row offsets are computed on the device as the CPU does, and a block index
// outside the block-table row or the cache, or a destination row outside dst, is skipped, never
// accessed.
//
// Every launch goes on `stream` (a cudaStream_t; null = the default stream) of the current
// device; nothing is allocated and nothing waits for the device (graph-capturable). fp32 math in
// the reference's order where it is elementwise; reductions (sums of squares, Σ exp) run as trees
// or with the device's expf/logf, so results may differ from the CPU's in the last bits of fp32.
#pragma once

#include "problem/variants.hpp"

namespace flashserve::kernels {

// One warp per (token, head pair) row of width 2D: the sum of squares over the whole row, then
// the scaled store, every element read before any of the row is written (a1 or a2 may be out).
// λ is computed by every block from the four λ vectors (fp32 dots in index order).
void differential_combine(const detail::DifferentialProblem& pr, void* stream);

// One warp per (token, head) row: the global LSE over the W ranks (each lane, in rank order), the
// row scaled in place, or zeros without reading it when this rank's factor is 0.
void lse_correct(const detail::LseCorrectProblem& pr, void* stream);

// Two launches: one block scans the ranges into cu_seqlens_dst (int32, as the CPU; a total past
// INT32_MAX wraps and its rows are skipped), then one warp per destination row in [0, dst rows)
// finds its request by binary search and copies its cache row.
void gather_cache(const detail::GatherCacheProblem& pr, void* stream);

}  // namespace flashserve::kernels
