#include "support/engine_step.hpp"

#include <algorithm>

namespace fstest {

using flashserve::DType;
using flashserve::TensorRef;

TensorRef EngineStep::table_ref() const {
  return TensorRef::strided(const_cast<int32_t*>(table.data()), DType::i32, {rows, cols}, {stride, 1});
}

bool EngineStep::in_table(const void* p) const {
  const auto* x = static_cast<const int32_t*>(p);
  return x >= table.data() && x < table.data() + table.size();
}

flashserve::backend::CommonMetadata EngineStep::common(bool paged) const {
  flashserve::backend::CommonMetadata c;
  c.num_reqs = num_reqs();
  c.num_actual_tokens = num_tokens();
  for (int64_t r = 0; r < num_reqs(); ++r) c.max_query_len = std::max<int64_t>(c.max_query_len, q(r));
  for (int32_t s : seq) c.max_seq_len = std::max<int64_t>(c.max_seq_len, s);
  c.query_start_loc = qsl;
  c.seq_lens = seq;
  c.encoder_seq_lens = enc;
  if (paged) {
    c.block_table = table_ref();
    c.slot_mapping = TensorRef::contiguous(const_cast<int64_t*>(slots.data()), DType::i64, {int64_t(slots.size())});
  }
  return c;
}

}  // namespace fstest
