// Shared memory per SM for the kernels' CTAs-per-SM choices (plain C++: the kernel configs that
// the selection and the planner read include it).
#pragma once

#include <cstddef>

namespace flashserve::kernels {

// Whether `ctas` CTAs of `bytes` of dynamic shared memory each fit one sm_90 SM (228 KB, of
// which the hardware reserves 1 KB per CTA).
constexpr bool sm90_ctas_fit(size_t bytes, int ctas) { return size_t(ctas) * (bytes + 1024) <= 228 * 1024; }

// Thread-block clusters of at most 16 CTAs (sm_90's non-portable bound; 8 is the portable one):
// the split-KV merge in a cluster (attention/cluster_merge.cuh) and its launch
// (common/cluster_launch.cuh).
inline constexpr int kClusterMaxCtas = 16;

}  // namespace flashserve::kernels
