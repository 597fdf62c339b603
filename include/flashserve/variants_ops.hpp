// Operations of the layer variants (SPEC.md §6) that are neither attention nor a merge:
// the differential-attention combine, the LSE correction of decode context parallelism, and
// the gather of paged cache rows into a contiguous buffer (MLA context chunks). Each validates
// its arguments (flashserve::Error naming the argument, before any write) and dispatches by
// device, so the layers in backend_variants.hpp only orchestrate.
#pragma once

#include <cstdint>
#include <limits>

#include "flashserve/merge.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve {

// ---------------------------------------------------------------- differential combine
// Heads come in interleaved pairs: pair h is heads (2h, 2h + 1), and its row of width 2D is
// head 2h's D values then head 2h + 1's (a contiguous [T, H/2, 2D] tensor is the same memory
// as [T, H, D]). With λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init (fp32, computed by the call),
// for each (t, h) and c < 2D:
//   x = a1[t, h, c] - λ a2[t, h, c];  r = 1 / sqrt(mean_c x² + eps)
//   out[t, h, c] = x r weight[c] (1 - λ_init)
// fp32 math. a1 may be `out` itself (in place); no other overlap is allowed.
struct DifferentialCombineParams {
  TensorRef a1;         // [T, H, D] f16/bf16/f32, H even: attn(q1, k1, [v1|v2]) as pairs
  TensorRef a2;         // [T, H, D] f16/bf16/f32: attn(q2, k2, [v1|v2]) as pairs
  TensorRef lambda_q1;  // fp32 [D]
  TensorRef lambda_k1;  // fp32 [D]
  TensorRef lambda_q2;  // fp32 [D]
  TensorRef lambda_k2;  // fp32 [D]
  TensorRef weight;     // fp32 [2D]: the RMSNorm (subln) weight
  float lambda_init = 0.8f;
  float eps = 1e-5f;
  TensorRef out;        // [T, H, D] f16/bf16/f32, written
};
void differential_combine(const DifferentialCombineParams& p, const ExecContext& ctx = {});

// ---------------------------------------------------------------- LSE correction (DCP)
// Each of W ranks attended the same queries over its shard of the KV; this rank's partial
// output is scaled in place so that the sum over ranks is the full result. For each (t, h):
//   g = log Σ_r exp(lse_all[r, h, t])   (+inf counts as -inf; -inf when every rank is empty)
//   out[t, h, :] *= exp(lse_all[rank, h, t] - g),  or = 0 when this rank's LSE is -inf / +inf
//   lse_out[h, t] = g
// out may be given slice-major as [S, T, H/S, Dv], global head h = s * (H/S) + j at
// out[s, t, j]: the layout a reduce-scatter over heads takes. fp32 math.
struct LseCorrectParams {
  TensorRef out;        // [T, H, Dv] or [S, T, H/S, Dv], f16/bf16/f32, scaled in place
  TensorRef lse_all;    // fp32 [W, H, T] (head_major) or [W, T, H] (token_major): every rank's LSE
  int64_t rank = 0;     // this rank, in [0, W)
  OptTensor lse_out;    // fp32 [H, T] or [T, H] per lse_layout: the global LSE. may be absent
  LseLayout lse_layout = LseLayout::head_major;
};
void lse_correct(const LseCorrectParams& p, const ExecContext& ctx = {});

// ---------------------------------------------------------------- gather cache rows
// Copies the rows of tokens [token_begin, token_end) of each request's context from a paged
// cache into dst, requests in order (vLLM's gather_cache with the ranges computed by the call):
//   context_len[b] = max(0, seqused_k[b] - query_len[b])   (query_len = 0 without cu_seqlens_q)
//   lo[b] = min(token_begin, context_len[b]);  hi[b] = max(lo[b], min(token_end, context_len[b]))
//   cu_seqlens_dst[b] = Σ_{i<b} (hi[i] - lo[i]);  dst[cu_seqlens_dst[b] + t - lo[b]] = row of t
// where token t of request b is cache[block_table[b][t / block_size], t % block_size]. Rows of
// dst past the total are left untouched.
struct GatherCacheParams {
  TensorRef cache;           // [num_blocks, block_size, width], any dtype, last dim contiguous
  TensorRef block_table;     // int32 [B, max_blocks] (row stride free)
  TensorRef seqused_k;       // int32 [B]: KV length of each request
  OptTensor cu_seqlens_q;    // int32 [B + 1]: this step's queries, excluded from the context. may be absent
  int64_t token_begin = 0;   // the token range of every request's context to gather
  int64_t token_end = std::numeric_limits<int64_t>::max();
  TensorRef dst;             // [>= total rows, width], cache's dtype, written
  TensorRef cu_seqlens_dst;  // int32 [B + 1], written: request b's rows start at cu_seqlens_dst[b]
};
void gather_cache(const GatherCacheParams& p, const ExecContext& ctx = {});

}  // namespace flashserve
