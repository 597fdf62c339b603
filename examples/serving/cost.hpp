// The work in a step's attention, counted from its actual batch over every layer, and the
// roofline a device's ceilings put on it. Bytes: what must move at least: each request's KV
// read once (on the cascade path the shared prefix once for the whole batch), q read, out
// written, the new K/V read and written into the cache. FLOPs: 4 * D per visible key, query
// row and head (q·k and p·v; causal rows see their position + 1 keys, a draft its committed
// context plus its ancestor path).
#pragma once

#include <cstdint>

#include "engine.hpp"

namespace serving {

struct StepCost {
  double kv_bytes = 0;  // KV cache read
  double bytes = 0;     // kv_bytes + q, out, new K/V
  double flops = 0;
};

StepCost step_cost(const Engine& engine, int64_t cascade_prefix);

struct Ceilings {
  double bytes_per_s = 4.2e12;  // H200 HBM copy ceiling
  double flops_per_s = 760e12;  // H200 bf16 dense tensor cores
};

// The time the ceilings allow for `c`: max(bytes / bandwidth, flops / compute); `memory_bound`
// says which term is larger.
double roofline_ms(const StepCost& c, const Ceilings& ceil, bool* memory_bound = nullptr);

}  // namespace serving
