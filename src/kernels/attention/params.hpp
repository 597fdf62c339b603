// The one type the attention launchers and kernels share: every operand as a base pointer,
// dtype and element strides of its normalized view (problem/attention.hpp), plus sizes, score
// modifiers, the split-KV plan and the tiling the selection chose. Plain C++ (no CUDA
// headers); filled on the host by kernels/attention/launch.cu, passed by value to kernels.
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

// A strided operand. `data` null = absent (for optional operands). Strides in elements.
struct StridedRef {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int64_t stride[4] = {0, 0, 0, 0};
};

struct AttnParams {
  // ---- queries and outputs (Bq = 1 for varlen, B for batched; rows = q rows per Bq)
  StridedRef q;            // [Bq, rows, H, D]: f32/f16/bf16/fp8/int8
  StridedRef q_v;          // [Bq, rows, H, Dv], may be null (MLA absorbed decode)
  StridedRef q_scale;      // int8 q: f32 [Bq, rows, H], may be null
  StridedRef q_descale;    // fp8 q: f32 [B, H_kv] (stride 0 allowed), may be null (= 1)
  StridedRef out;          // [Bq, rows, H, Dv]: f32/f16/bf16 (data is written)
  StridedRef lse;          // f32 [Bq, H, rows], may be null

  // ---- keys and values
  StridedRef k;            // paged [num_blocks, bs, H_kv, D] (NHD-normalized);
                           // contiguous [Bk, rows_k, H_kv, D]
  StridedRef v;            // as k, last dim Dv
  StridedRef k_scale_cache;  // int8 k: f32 [num_blocks | Bk, bs | rows_k, H_kv], may be null
  StridedRef v_scale;      // int8 v: f32 [H_kv, Dv], may be null
  StridedRef k_descale;    // fp8 k: f32 [B, H_kv], may be null (= 1)
  StridedRef v_descale;    // fp8 v: f32 [B, H_kv], may be null (= 1)

  // ---- batch metadata (int32 device arrays; contents are never trusted: see generic_fwd.cuh)
  StridedRef cu_seqlens_q;     // [B+1], varlen only
  StridedRef cu_seqlens_k;     // [B+1], may be null
  StridedRef seqused_k;        // [B], may be null
  StridedRef block_table;      // [B, max_blocks], paged only
  StridedRef cache_batch_idx;  // [B], batched contiguous, may be null
  StridedRef cp_tot_seqused_k; // [B], context parallelism, may be null

  // ---- score modifiers
  StridedRef alibi;        // f32 [B, H] (stride 0 over B for [H] slopes), may be null
  StridedRef s_aux;        // [H] f32/f16/bf16 sink logits, may be null

  // ---- sizes
  int64_t batch = 0;           // B
  int64_t q_batches = 1;       // Bq
  int64_t q_rows = 0;          // rows per Bq (varlen total_q, batched sq)
  int64_t num_heads = 0, num_kv_heads = 0, group = 1;  // H, H_kv, H / H_kv
  int64_t head_dim = 0, head_dim_v = 0;                // D, Dv
  int64_t qv_dim = 0;          // Dv when q_v is present, else 0
  int64_t kv_dim0 = 0;         // num_blocks (paged) or Bk (contiguous)
  int64_t kv_dim1 = 0;         // block_size (paged) or rows_k (contiguous)
  int64_t max_blocks = 0;      // block_table columns (paged)
  bool batched = false, paged = false;

  float softmax_scale = 1.0f;
  float softcap = 0.0f;        // 0: off
  bool causal = false, alibi_sqrt = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  int64_t chunk = 0;           // 0: off
  int64_t cp_world = 1, cp_rank = 0, cp_interleave = 1;  // common/cp_layout.hpp

  // ---- split-KV (num_splits == 1: out written directly; else partials then combine)
  int num_splits = 1;
  int64_t split_granularity = 1;
  int64_t split_size = 0;        // > 0: batch-invariant fixed-size splits (plan.hpp, Plan::split_size):
                                 // a sequence has its own seq_num_splits; one split is written directly
  int64_t max_split_keys = 0;    // a CTA's most keys: the plan's max_seqlen_k per split (0: unknown)
  int row_ctas = 1;              // decode kernel: CTAs per (sequence, KV head, split) (decode_row_ctas)
  bool cluster_splits = false;   // decode kernel: merge the splits in a cluster (select.hpp: decode_cluster_splits)
  bool decode_tma = false;       // decode kernel: its TMA form for long splits (launchers.hpp: decode_tma_form)
  float* o_partial = nullptr;    // f32 [num_splits, Bq * rows, H, Dv] (workspace)
  float* lse_partial = nullptr;  // f32 [num_splits, Bq * rows, H] (workspace)

  // ---- tiling of the generic kernel (chosen by select_attention_kernel)
  int rows_per_cta = 1;        // query rows per CTA
  int heads_per_cta = 1;       // query heads of one KV head's group per CTA
  int head_slices = 1;         // ceil(group / heads_per_cta)
  int persistent_ctas = 0;     // prefill_tma: CTAs of its persistent form (0: one CTA per item)

  constexpr int64_t total_rows() const { return q_batches * q_rows; }
  // The prefill kernels' row tiles of m rows (their grid's x; prefill_common.cuh: cta_work):
  // batched B x ceil(sq / m); varlen total_q / m + B + 1, enough for every sequence's
  // ceil(sq_b / m) whatever the split of total_q.
  constexpr int64_t row_tiles(int64_t m) const {
    return batched ? batch * ((q_rows + m - 1) / m) : q_rows / m + batch + 1;
  }
  // Their items: (row tile, head, split), the one-item grid's CTAs and the persistent form's walk.
  constexpr int64_t row_tile_items(int64_t m) const { return row_tiles(m) * num_heads * num_splits; }
};

}  // namespace flashserve::kernels
