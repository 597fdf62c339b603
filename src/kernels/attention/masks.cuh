// Score variants of SPEC.md §2 as small functors; default-constructed they are the identity
// (every key visible, scores unchanged), so a kernel composes only what a problem enables.
//
//   Visibility:     steps 4 (causal, window, chunk) as an interval of local keys, in global
//                   positions under context parallelism (common/cp_layout.hpp: local key t of
//                   rank r is global (t / I) * world * I + r * I + t % I, I the interleave).
//   ScoreTransform: steps 1-3 (scale, soft-cap, ALiBi) on one dot product.
#pragma once

#include <cstdint>

#include "common/cp_layout.hpp"
#include "common/softmax_state.hpp"
#include "kernels/attention/load.cuh"

namespace flashserve::kernels {

FS_HD int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
FS_HD int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
FS_HD int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

struct KeyRange {
  int64_t lo, hi;  // [lo, hi), empty when lo >= hi
};

struct Visibility {
  bool causal = false;
  int64_t left = -1, right = -1;  // window; -1 unbounded
  int64_t chunk = 0;              // 0: off
  int64_t cp_world = 1, cp_rank = 0, cp_interleave = 1;

  // First local key whose global position is >= gpos (gpos >= 0): the local keys below it.
  FS_DEV int64_t local_from_global(int64_t gpos) const { return cp_local_len(gpos, cp_world, cp_rank, cp_interleave); }

  // Local keys visible from aligned global position pos of a sequence of sk_global keys.
  FS_DEV KeyRange operator()(int64_t pos, int64_t sk_global) const {
    int64_t lo = 0, hi = sk_global;
    if (causal) hi = imin(hi, pos + 1);
    if (left >= 0) lo = imax(lo, pos - left);
    if (right >= 0) hi = imin(hi, pos + right + 1);
    if (chunk > 0) {
      const int64_t start = floor_div(pos, chunk) * chunk;
      lo = imax(lo, start);
      hi = imin(hi, start + chunk);
    }
    hi = imax(hi, lo);
    if (cp_world > 1) {
      lo = local_from_global(lo);
      hi = imax(lo, local_from_global(hi));
    }
    return {lo, hi};
  }
};

struct ScoreTransform {
  float scale = 1.0f;
  float softcap = 0.0f;  // 0: off
  bool alibi = false, alibi_sqrt = false;
  int64_t cp_world = 1, cp_rank = 0, cp_interleave = 1;

  // No soft-cap and no ALiBi: the logit is dot x scale.
  FS_DEV bool plain() const { return softcap <= 0.0f && !alibi; }

  // The logit of local key `key` for a row at aligned global position pos with ALiBi slope.
  FS_DEV float operator()(float dot, int64_t pos, int64_t key, float slope) const {
    float x = dot * scale;
    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
    if (alibi) {
      const int64_t diff = pos - cp_global_pos(key, cp_world, cp_rank, cp_interleave);
      const float dist = float(diff < 0 ? -diff : diff);
      x -= slope * (alibi_sqrt ? sqrtf(dist) : dist);
    }
    return x;
  }
};

FS_HD Visibility make_visibility(const AttnParams& p) {
  return Visibility{p.causal, p.window_left, p.window_right, p.chunk, p.cp_world, p.cp_rank, p.cp_interleave};
}

FS_HD ScoreTransform make_score_transform(const AttnParams& p) {
  return ScoreTransform{p.softmax_scale, p.softcap, p.alibi.data != nullptr, p.alibi_sqrt, p.cp_world, p.cp_rank,
                        p.cp_interleave};
}

}  // namespace flashserve::kernels
