// CPU reference of merge_states (merge.hpp, SPEC.md §4). Input validated by
// src/api/validate_merge.*.
#pragma once

#include "problem/merge.hpp"

namespace flashserve::reference {

// Per (t, h): rows t < merge_rows merge a and b through merge_lse in fp32 (a side with weight 0
// is not read, so an empty state's output may hold anything); rows past it copy b. The result
// is stored in out's format (fp8: clamp(x / scale, ±max), nearest even).
void merge_states(const detail::MergeProblem& pr);

}  // namespace flashserve::reference
