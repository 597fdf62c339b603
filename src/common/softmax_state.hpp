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

// The sum of v(s) for s < n in split_combine's order (combine.cu: merge_split_lses): lane l of a
// warp sums v(l), v(l + 32), ... from 0, then the lanes' butterfly (xor 16, 8, 4, 2, 1), lane
// 0's value. The cluster merge sums in the same order, so both merges give the same bits (a
// CUDA-graph replay of a fixed split count and an eager call whose keys cap it lower meet them).
// (The butterfly as a compile-time tree over kW lanes: lane kL's value after the step of offset
// kO is its value after the step of 2 kO plus lane kL + kO's; leaf(l) is lane l's own sum. Lanes
// past n hold zeros, which leave sums as they are: for n <= 2 the tree of 2 lanes is the
// warp's, at a fraction of the registers.)
template <int kL, int kO, int kW, class Leaf>
FS_HD float butterfly_sum(Leaf&& leaf) {
  if constexpr (kO == kW) return leaf(kL);
  else return butterfly_sum<kL, 2 * kO, kW>(leaf) + butterfly_sum<kL + kO, 2 * kO, kW>(leaf);
}
template <class V>
FS_HD float combine_order_sum(int n, V&& v) {
  const auto leaf = [&](int l) {
    float a = 0.0f;
    for (int s = l; s < n; s += 32) a += v(s);
    return a;
  };
  return n <= 2 ? butterfly_sum<0, 1, 2>(leaf) : butterfly_sum<0, 1, 32>(leaf);
}

// The merge of n states at once: their LSEs lse_of(s) for s < n (normalized here) give the
// merged LSE (returned) and each state's weight exp(l_s - lse), passed to set_weight(s, w) (the
// sum over states of w_s x o_s is the merged output); NaN when any l_s is NaN (every weight NaN
// too), -inf and weights 0 when all are empty. merge_lse folded over the states, up to fp32
// rounding; bit for bit split_combine's LSE and weights (the exponentials summed in its order,
// combine_order_sum). The split-KV merge of the CUDA kernels' clusters (attention/
// cluster_merge.cuh), which reads the LSEs from its peers' shared memory: accessors rather than
// arrays, which would go to the stack there.
template <class LseOf, class SetWeight>
FS_HD float merge_lses(int n, LseOf&& lse_of, SetWeight&& set_weight) {
  float mx = -INFINITY;
  bool nan = false;
  for (int s = 0; s < n; ++s) {
    const float x = normalize_lse(lse_of(s));
    nan |= x != x;
    mx = fmaxf(mx, x);
  }
  if (nan || mx == -INFINITY) {
    for (int s = 0; s < n; ++s) set_weight(s, nan ? NAN : 0.0f);
    return nan ? NAN : -INFINITY;
  }
  const float sum = combine_order_sum(n, [&](int s) { return expf(normalize_lse(lse_of(s)) - mx); });
  const float inv = 1.0f / sum;
  for (int s = 0; s < n; ++s) set_weight(s, expf(normalize_lse(lse_of(s)) - mx) * inv);
  return mx + logf(sum);
}

}  // namespace flashserve
