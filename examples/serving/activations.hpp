// The demo's stand-in for a model: no weights, so each layer's q/k/v rows are pseudo-random,
// a pure function of (seed, operand, layer, token identity, position). A verification can
// regenerate any token's K/V without reading the cache. Tokens of a group's shared system
// prompt have the group as identity, so every member computes (and shares) the same K/V.
// The values come from activation_hash.hpp, which the CUDA fill (qkv_fill.hpp) shares.
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"
#include "workload.hpp"

namespace serving {

enum class Operand : uint8_t { q, k, v };

// Whose token sits at a position: the group's for positions inside its prefix, else the
// request's own.
struct TokenOwner {
  int32_t request = 0;
  int32_t group = -1;
  int32_t prefix_len = 0;
  static TokenOwner of(const RequestSpec& s) { return {s.id, s.group, s.prefix_len}; }
  uint64_t identity(int64_t pos) const;
};

// One query row of a step as the activation generators see it.
struct TokenRow {
  uint64_t identity = 0;  // TokenOwner::identity(pos)
  int64_t pos = 0;
};

class Activations {
 public:
  Activations(uint64_t seed, int64_t num_heads, int64_t num_kv_heads, int64_t head_size, flashserve::DType dtype);
  flashserve::DType dtype() const { return dtype_; }
  int64_t heads(Operand op) const { return op == Operand::q ? num_heads_ : num_kv_heads_; }
  // Row `row` of dst ([rows, heads(op), head_size], dtype(); last two dims contiguous) gets the
  // operand of the token at `pos` of `owner` in layer `layer`. q entries are uniform in
  // [-2, 2), k and v in [-1, 1), rounded to the dtype.
  void fill(Operand op, const TokenOwner& owner, int64_t pos, int layer, const flashserve::TensorRef& dst,
            int64_t row) const {
    fill(op, TokenRow{owner.identity(pos), pos}, layer, dst, row);
  }
  void fill(Operand op, const TokenRow& token, int layer, const flashserve::TensorRef& dst, int64_t row) const;
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_;
  int64_t num_heads_, num_kv_heads_, head_size_;
  flashserve::DType dtype_;
};

}  // namespace serving
