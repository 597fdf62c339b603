// Deterministic q/k/v rows (activations.hpp): a splitmix64 stream per (operand, layer, token).
#include "activations.hpp"

#include "flashserve/numeric.hpp"

namespace serving {

namespace {

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t s = a ^ (b * 0xd6e8feb86659fd93ull);
  return splitmix(s);
}

}  // namespace

uint64_t TokenOwner::identity(int64_t pos) const {
  const bool shared = group >= 0 && pos < prefix_len;
  return shared ? (uint64_t(1) << 63) | uint64_t(group) : uint64_t(uint32_t(request));
}

Activations::Activations(uint64_t seed, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                         flashserve::DType dtype)
    : seed_(seed), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_size_(head_size), dtype_(dtype) {}

void Activations::fill(Operand op, const TokenOwner& owner, int64_t pos, int layer, const flashserve::TensorRef& dst,
                       int64_t row) const {
  uint64_t s = mix(mix(mix(mix(seed_, uint64_t(op) + 1), uint64_t(layer)), owner.identity(pos)), uint64_t(pos));
  const float range = op == Operand::q ? 4.0f : 2.0f;
  const size_t es = flashserve::dtype_size(dtype_);
  for (int64_t h = 0; h < heads(op); ++h) {
    char* p = static_cast<char*>(dst.at(row, h, 0));
    for (int64_t d = 0; d < head_size_; ++d) {
      const float u = float(splitmix(s) >> 40) * 0x1p-24f;  // [0, 1)
      flashserve::numeric::store_float(p + d * es, dtype_, (u - 0.5f) * range);
    }
  }
}

}  // namespace serving
