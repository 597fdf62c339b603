// CPU reference of the layer-variant operations (variants_ops.hpp). Inputs validated by
// src/api/validate_variants.* (gather_cache's contents included).
#pragma once

#include "problem/variants.hpp"

namespace flashserve::reference {

// λ from the four fp32 [D] vectors: exp(q1·k1) - exp(q2·k2) + λ_init, fp32 dots in index order.
float differential_lambda(const TensorRef& q1, const TensorRef& k1, const TensorRef& q2, const TensorRef& k2,
                          float lambda_init);

// Per (t, pair): two passes over the 2D-wide row (sum of squares, then the scaled store), each
// element of a1 / a2 read before out's element is written, so a1 or a2 may be out itself.
void differential_combine(const detail::DifferentialProblem& pr);

// Per (t, h): the global LSE over ranks in fp32 (max, then Σ exp), this rank's factor, and the
// row scaled in place (an empty local state stores zeros without reading the row).
void lse_correct(const detail::LseCorrectProblem& pr);

// cu_seqlens_dst first (prefix sums of the ranges), then the rows by memcpy, requests in
// parallel.
void gather_cache(const detail::GatherCacheProblem& pr);

}  // namespace flashserve::reference
