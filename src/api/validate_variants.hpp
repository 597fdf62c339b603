// Validation of the layer-variant operations (variants_ops.hpp): shapes, dtypes and devices
// first (no tensor contents read), then, for CPU calls, the contents that index memory
// (gather_cache's lengths and block indices). Everything throws flashserve::Error naming the
// argument before any write.
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"
#include "flashserve/variants_ops.hpp"
#include "problem/variants.hpp"

namespace flashserve::detail {

DifferentialProblem validate_differential_combine(const DifferentialCombineParams& p);

LseCorrectProblem validate_lse_correct(const LseCorrectParams& p);

GatherCacheProblem validate_gather_cache(const GatherCacheParams& p);

// CPU contents: lengths non-negative, cu_seqlens_q non-decreasing, every block read inside the
// block-table row and the cache, dst large enough and the row offsets within int32.
void check_gather_contents(const GatherCacheProblem& pr);

}  // namespace flashserve::detail
