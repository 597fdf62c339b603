// Verification of a served step against a direct computation: for a sample of the step's
// requests, every query row of every layer is recomputed with flashserve::varlen_attention
// (causal, no KV split) over a freshly built contiguous copy of the request's KV history,
// regenerated from the seed (never read from the paged cache), and compared with the
// backend's output. Draft-tree tokens see the committed tokens plus their ancestor path.
#pragma once

#include <cstdint>
#include <string>

#include "engine.hpp"

namespace serving {

// |out - ref| <= atol + rtol * |ref| per element.
struct Tolerance {
  double atol = 0, rtol = 0;
};
Tolerance tolerance_for(flashserve::DType dtype);

struct VerifyResult {
  int64_t requests = 0, rows = 0, bad_rows = 0;
  double max_ratio = 0;  // max |out - ref| / (atol + rtol |ref|): <= 1 passes
  double max_abs = 0;
  std::string first_failure;
  bool passed() const { return bad_rows == 0; }
};

// Checks up to `max_requests` requests of the engine's last step, spread over its batch.
VerifyResult verify_step(const Engine& engine, int64_t max_requests);

}  // namespace serving
