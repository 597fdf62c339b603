// The validated, normalized forms of the layer-variant operations (differential_combine,
// lse_correct, gather_cache): what validation (api/validate_variants) produces and what the
// CPU reference and the CUDA kernels consume.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/check.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::detail {

// differential_combine after validation.
struct DifferentialProblem {
  int64_t tokens = 0, pairs = 0, head_dim = 0;  // T, H / 2, D
  Device device{};
  TensorRef a1, a2, out;                          // [T, 2 * pairs, D]
  TensorRef lambda_q1, lambda_k1, lambda_q2, lambda_k2;  // fp32 [D]
  TensorRef weight;                               // fp32 [2D]
  float lambda_init = 0.0f, eps = 0.0f;
};

// lse_correct after validation; every view normalized to slice-major / head-major.
struct LseCorrectProblem {
  int64_t slices = 0, tokens = 0, slice_heads = 0, head_dim = 0;  // S, T, H / S, Dv
  int64_t world = 0, rank = 0;                                    // W, rank
  Device device{};
  TensorRef out;      // [S, T, H / S, Dv]
  TensorRef lse_all;  // fp32 [W, H, T]
  OptTensor lse_out;  // fp32 [H, T], may be absent
};

// gather_cache after validation.
struct GatherCacheProblem {
  int64_t batch = 0, num_blocks = 0, block_size = 0, width = 0;  // B, cache dims
  int64_t token_begin = 0, token_end = 0;
  Device device{};
  TensorRef cache;           // [num_blocks, block_size, width]
  TensorRef block_table;     // int32 [B, max_blocks]
  TensorRef seqused_k;       // int32 [B]
  OptTensor cu_seqlens_q;    // int32 [B + 1], may be absent
  TensorRef dst;             // [rows, width]
  TensorRef cu_seqlens_dst;  // int32 [B + 1]
};

// Tokens [lo, hi) of request b's context that gather_cache copies (CPU contents).
struct TokenRange {
  int64_t lo = 0, hi = 0;
};
inline TokenRange gather_range(const GatherCacheProblem& pr, int64_t b) {
  const int64_t q_len =
      pr.cu_seqlens_q ? read_index(*pr.cu_seqlens_q, b + 1) - read_index(*pr.cu_seqlens_q, b) : 0;
  const int64_t context = std::max<int64_t>(0, read_index(pr.seqused_k, b) - q_len);
  TokenRange r;
  r.lo = std::min(pr.token_begin, context);
  r.hi = std::max(r.lo, std::min(pr.token_end, context));
  return r;
}

}  // namespace flashserve::detail
