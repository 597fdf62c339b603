// Validation of merge_states (merge.hpp): shapes, dtypes, devices; throws flashserve::Error
// naming the argument before any write.
#pragma once

#include <cstdint>

#include "flashserve/merge.hpp"
#include "problem/merge.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::detail {

MergeProblem validate_merge(const MergeParams& p);

}  // namespace flashserve::detail
