// Step costs (cost.hpp).
#include "cost.hpp"

#include <algorithm>

#include "flashserve/tensor.hpp"

namespace serving {

namespace {

// Keys the query rows of one request see, summed over its rows.
int64_t visible_keys(const BatchEntry& e) {
  const int64_t p = e.first_pos, q = e.query_len;
  if (e.parents.empty()) return q * p + q * (q + 1) / 2;
  int64_t sum = p + 1;  // the committed tip
  for (int32_t d = 0; d < e.num_drafts; ++d) {
    int64_t depth = 0;
    for (int32_t a = d; a >= 0; a = e.parents[size_t(a)]) ++depth;
    sum += p + 1 + depth;
  }
  return sum;
}

}  // namespace

StepCost step_cost(const Engine& engine, int64_t cascade_prefix) {
  const ModelConfig& m = engine.config();
  const double act = double(flashserve::dtype_size(m.dtype)), cache = double(flashserve::dtype_size(m.cache_dtype()));
  const double kv_row = double(m.num_kv_heads * 2 * m.head_size);  // K and V of one token
  const double q_row = double(m.num_heads * m.head_size);
  int64_t kv_tokens = 0, tokens = 0, keys = 0;
  for (const OrderedEntry& o : engine.batch()) {
    const BatchEntry& e = *o.entry;
    kv_tokens += e.first_pos + e.query_len - cascade_prefix;
    tokens += e.query_len;
    keys += visible_keys(e);
  }
  if (!engine.batch().empty()) kv_tokens += cascade_prefix;
  StepCost c;
  c.kv_bytes = double(kv_tokens) * kv_row * cache;
  c.bytes = c.kv_bytes + double(tokens) * (2 * q_row * act + kv_row * (act + cache));
  c.flops = 4.0 * double(keys) * q_row;
  const double layers = double(m.num_layers);
  c.kv_bytes *= layers;
  c.bytes *= layers;
  c.flops *= layers;
  return c;
}

double roofline_ms(const StepCost& c, const Ceilings& ceil, bool* memory_bound) {
  const double mem = c.bytes / ceil.bytes_per_s, compute = c.flops / ceil.flops_per_s;
  if (memory_bound) *memory_bound = mem >= compute;
  return std::max(mem, compute) * 1e3;
}

}  // namespace serving
