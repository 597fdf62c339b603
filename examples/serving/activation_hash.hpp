// The demo's activation values as a pure function, shared by the host (activations.cpp) and
// the device (qkv_fill.cu) so that both produce the same bits: a splitmix64 stream per
// (operand, layer, token identity, position); element i of the stream is the (i + 1)-th
// splitmix64 output, mapped to [-range/2, range/2) in steps of range * 2^-24.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SERVING_HD __host__ __device__
#else
#define SERVING_HD
#endif

namespace serving::hash {

inline constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

SERVING_HD inline uint64_t finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

SERVING_HD inline uint64_t mix(uint64_t a, uint64_t b) { return finalize((a ^ (b * 0xd6e8feb86659fd93ull)) + kGolden); }

// The stream of one operand row: op 0 = q, 1 = k, 2 = v.
SERVING_HD inline uint64_t stream_seed(uint64_t seed, int op, int layer, uint64_t identity, int64_t pos) {
  return mix(mix(mix(mix(seed, uint64_t(op) + 1), uint64_t(layer)), identity), uint64_t(pos));
}

// Element i (= head * D + d) of the stream, before rounding to the activation dtype.
SERVING_HD inline float element(uint64_t stream, int64_t i, float range) {
  const float u = float(finalize(stream + uint64_t(i + 1) * kGolden) >> 40) * 0x1p-24f;  // [0, 1)
  return (u - 0.5f) * range;
}

// q entries are uniform in [-2, 2), k and v in [-1, 1).
SERVING_HD inline float range_of(int op) { return op == 0 ? 4.0f : 2.0f; }

}  // namespace serving::hash
