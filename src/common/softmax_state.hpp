// The partial softmax state of one query row and head, and its exact merge (SPEC.md §4).
// Split-KV combine, cascade, speculative-verify expansion and context parallelism all reduce
// to `merge_lse`. Usable from host and device code.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define FS_HD __host__ __device__ __forceinline__
#else
#define FS_HD inline
#endif

namespace flashserve {

// An LSE of +inf is what some producers write for "no keys": treat it as -inf.
FS_HD float normalize_lse(float lse) { return (lse == INFINITY) ? -INFINITY : lse; }

// Weights of two states to merge: w_a, w_b with w_a + w_b > 0 unless both are empty.
struct MergeWeights {
  float w_a, w_b, lse;  // lse of the merged state (-inf when both are empty)
};

FS_HD MergeWeights merge_lse(float lse_a, float lse_b) {
  // A NaN state (a poisoned or invalid read) stays visible: fmaxf alone would drop it.
  if (lse_a != lse_a || lse_b != lse_b) return {NAN, NAN, NAN};
  lse_a = normalize_lse(lse_a);
  lse_b = normalize_lse(lse_b);
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) return {0.0f, 0.0f, -INFINITY};
  const float ea = expf(lse_a - m), eb = expf(lse_b - m);
  const float sum = ea + eb;
  return {ea / sum, eb / sum, m + logf(sum)};
}

// The merge of n states at once: their LSEs l [n] (normalized here) give the merged LSE
// (returned) and each state's weight w [n] = exp(l_s - lse) (the sum over states of w_s x o_s is
// the merged output); NaN when any l_s is NaN (w NaN too), -inf and w 0 when all are empty.
// merge_lse folded over the states, up to fp32 rounding (the split-KV merges of the CUDA kernels
// in a cluster, attention/cluster_merge.cuh).
FS_HD float merge_lses(const float* l, int n, float* w) {
  float mx = -INFINITY;
  bool nan = false;
  for (int s = 0; s < n; ++s) {
    const float x = normalize_lse(l[s]);
    nan |= x != x;
    mx = fmaxf(mx, x);
  }
  if (nan) {
    for (int s = 0; s < n; ++s) w[s] = NAN;
    return NAN;
  }
  float sum = 0.0f;
  for (int s = 0; s < n; ++s) {
    w[s] = mx == -INFINITY ? 0.0f : expf(normalize_lse(l[s]) - mx);
    sum += w[s];
  }
  if (mx == -INFINITY) return -INFINITY;
  for (int s = 0; s < n; ++s) w[s] /= sum;
  return mx + logf(sum);
}

}  // namespace flashserve
