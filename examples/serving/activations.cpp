// Deterministic q/k/v rows (activations.hpp): the streams of activation_hash.hpp.
#include "activations.hpp"

#include "activation_hash.hpp"
#include "flashserve/numeric.hpp"

namespace serving {

uint64_t TokenOwner::identity(int64_t pos) const {
  const bool shared = group >= 0 && pos < prefix_len;
  return shared ? (uint64_t(1) << 63) | uint64_t(group) : uint64_t(uint32_t(request));
}

Activations::Activations(uint64_t seed, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                         flashserve::DType dtype)
    : seed_(seed), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_size_(head_size), dtype_(dtype) {}

void Activations::fill(Operand op, const TokenRow& token, int layer, const flashserve::TensorRef& dst,
                       int64_t row) const {
  const uint64_t stream = hash::stream_seed(seed_, int(op), layer, token.identity, token.pos);
  const float range = hash::range_of(int(op));
  const size_t es = flashserve::dtype_size(dtype_);
  for (int64_t h = 0; h < heads(op); ++h) {
    char* p = static_cast<char*>(dst.at(row, h, 0));
    for (int64_t d = 0; d < head_size_; ++d)
      flashserve::numeric::store_float(p + d * es, dtype_, hash::element(stream, h * head_size_ + d, range));
  }
}

}  // namespace serving
