// Test support for the MetadataBuilder tests: an engine's step as the builder reads it.
#pragma once

#include <cstdint>
#include <vector>

#include "flashserve/backend.hpp"

namespace fstest {

// The host inputs of one engine step: query_start_loc [R + 1], seq_lens [R],
// encoder_seq_lens [R], a block table [rows, cols] with row stride `stride` (rows >= R), and
// the slot of each query token [qsl.back()].
struct EngineStep {
  std::vector<int32_t> qsl{0}, seq, enc;
  int64_t rows = 0, cols = 0, stride = 0;
  std::vector<int32_t> table;
  std::vector<int64_t> slots;

  int64_t num_reqs() const { return int64_t(seq.size()); }
  int64_t num_tokens() const { return qsl.back(); }
  int64_t q(int64_t r) const { return qsl[size_t(r) + 1] - qsl[size_t(r)]; }
  int32_t block(int64_t r, int64_t j) const { return table[size_t(r * stride + j)]; }
  flashserve::TensorRef table_ref() const;
  bool in_table(const void* p) const;
  // The builder's input over these vectors; paged = false (encoders) leaves block_table and
  // slot_mapping empty.
  flashserve::backend::CommonMetadata common(bool paged = true) const;
};

}  // namespace fstest
