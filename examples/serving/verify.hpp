// Verification of a served step against a direct computation: for a sample of the step's
// requests, its query rows in each layer (within the limits below) are recomputed with flashserve::varlen_attention
// (causal, no KV split) over a freshly built contiguous copy of the request's KV history,
// regenerated from the seed (never read from the paged cache), and compared with the
// backend's output. Draft-tree tokens see the committed tokens plus their ancestor path. With
// an fp8 cache the reference K/V are rounded through the cache format (x / scale to e4m3 and
// back; the power-of-two scale keeps that exact in bf16), so both sides attend over the same
// values. The limits bound the CPU cost on long contexts.
#pragma once

#include <climits>
#include <cstdint>
#include <string>

#include "engine.hpp"

namespace serving {

// |out - ref| <= atol + rtol * |ref| per element.
struct Tolerance {
  double atol = 0, rtol = 0;
};
// The CPU backend against the CPU reference, or the CUDA kernels (other summation orders, P
// rounded to 16 bits before p·v) against it.
Tolerance tolerance_for(flashserve::DType dtype, bool cuda);

struct VerifyLimits {
  int64_t max_requests = 8;     // spread over the batch
  int max_layers = 1 << 30;     // the first layers
  int64_t max_rows = INT64_MAX; // the last query rows of each request (tree drafts: each its own)
};

struct VerifyResult {
  int64_t requests = 0, rows = 0, bad_rows = 0;
  double max_ratio = 0;  // max |out - ref| / (atol + rtol |ref|): <= 1 passes
  double max_abs = 0;
  std::string first_failure;
  bool passed() const { return bad_rows == 0; }
};

// Checks the engine's last step within `limits` (outputs copied from the runtime's memory).
VerifyResult verify_step(Engine& engine, const VerifyLimits& limits);

}  // namespace serving
