// The validated, normalized form of an attention call: what validation produces and what the
// reference (and later the kernels) consume. Every view here has been checked for dtype, rank,
// shape and extent; varlen and batched calls share one addressing scheme:
//
//   sequence b, query row i (0 <= i < q_len(b)):  q[qb(b), q_begin(b) + i, h, :]
//   varlen:  qb(b) = 0, q_begin(b) = cu_seqlens_q[b]      (views have a leading dim of 1)
//   batched: qb(b) = b, q_begin(b) = 0
//
//   KV token t (0 <= t < k_len(b)):
//   paged:      k[block_table[b][t / bs], t % bs, g, :]       (k normalized to NHD)
//   contiguous: k[kb(b), k_begin(b) + t, g, :]
//               varlen: kb = 0, k_begin = cu_seqlens_k[b]; batched: kb = cache_batch_idx[b]
//               (or b), k_begin = 0
#pragma once

#include <cstdint>

#include "flashserve/attention.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::detail {

struct AttnProblem {
  const AttentionParams* params = nullptr;  // the caller's params (scalars, optional tensors)
  bool batched = false;
  bool paged = false;
  int64_t batch = 0;                        // B
  int64_t num_heads = 0, num_kv_heads = 0;  // H, H_kv
  int64_t head_dim = 0, head_dim_v = 0;     // D, Dv
  int64_t block_size = 0;                   // paged only
  int64_t total_q = 0;                      // rows of q over all sequences
  float softmax_scale = 0.0f;               // resolved (default applied)

  // Normalized views (4-D unless noted; see the header comment).
  TensorRef q;              // [Bq, rows, H, D]          Bq = 1 (varlen) or B
  OptTensor q_v;            // [Bq, rows, H, Dv]
  TensorRef out;            // [Bq, rows, H, Dv]
  OptTensor lse;            // [Bq, H, rows] fp32 (3-D)
  OptTensor q_scale;        // [Bq, rows, H] fp32 (3-D), int8 q
  TensorRef k;              // paged [num_blocks, bs, H_kv, D]; contiguous [Bk, rows_k, H_kv, D]
  TensorRef v;              // as k with Dv
  OptTensor k_scale_cache;  // int8 k: paged [num_blocks, bs, H_kv]; contiguous [Bk, rows_k, H_kv]
  OptTensor v_scale;        // int8 v: [H_kv, Dv]
  OptTensor alibi_slopes;   // fp32 [B, H] (stride 0 over B when given as [H])
  OptTensor s_aux;          // [H]
  OptTensor q_descale, k_descale, v_descale;  // fp32 [B, H_kv]

  // Batch metadata (int32, host-readable when the problem is on the CPU).
  OptTensor cu_seqlens_q;     // [B+1]
  OptTensor cu_seqlens_k;     // [B+1]
  OptTensor seqused_k;        // [B]
  OptTensor block_table;      // [B, max_blocks]
  OptTensor cache_batch_idx;  // [B]
  OptTensor cp_tot_seqused_k; // [B], context parallelism: global KV lengths

  int64_t group() const { return num_heads / num_kv_heads; }
};

// Validates `p` for a varlen or batched call and returns the normalized problem. Throws
// flashserve::Error naming the argument (or NotImplemented naming the feature) before any
// write. When the metadata is on the CPU it also checks contents: cu_seqlens monotone and
// within the tensors, lengths within max_seqlen and the cache, block indices in range.
AttnProblem validate_attention(const AttentionParams& p, bool batched);

// The planner's view of a validated problem.
ProblemShape shape_of(const AttnProblem& pr);

// Host reads of the per-sequence metadata (CPU problems only).
int64_t q_begin(const AttnProblem& pr, int64_t b);
int64_t q_len(const AttnProblem& pr, int64_t b);
int64_t k_len(const AttnProblem& pr, int64_t b);

}  // namespace flashserve::detail
