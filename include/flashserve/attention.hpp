// Attention over a varlen batch or a batched KV cache (SPEC.md §2, §3).
// The device of the tensors selects the implementation: cpu -> reference, cuda -> kernels.
#pragma once

#include <cstdint>

#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve {

// Paged-cache layout. NHD: [num_blocks, block_size, H_kv, D]; HND: [num_blocks, H_kv,
// block_size, D]. Any strides, last dim contiguous.
enum class KvLayout : uint8_t { nhd, hnd };

// Visibility window around the query's aligned position i' (SPEC.md §2.4); -1 = unbounded.
struct Window {
  int left = -1;
  int right = -1;
  bool unbounded() const { return left < 0 && right < 0; }
};

// Every feature is a named field. Shapes use: B batch, H query heads, H_kv KV heads,
// D QK head size, Dv V head size, total_q/total_k varlen totals, sq queries per sequence in
// batched calls. "varlen" = varlen_attention, "batched" = kvcache_attention.
struct AttentionParams {
  // ---- queries and outputs
  TensorRef q;      // varlen [total_q, H, D]; batched [B, sq, H, D]. f16/bf16/f32, fp8
                    // (q_descale optional) or int8 (with q_scale)
  OptTensor q_v;    // [.., H, Dv] (shaped like q, width Dv): adds q_v·v_j to the score (MLA
                    // absorbed decode, D=64 + Dv=512). may be absent
  TensorRef out;    // [.., H, Dv]: q's dtype (f16/bf16 when q is fp8 or int8), or fp32 for any q
                    // (partial states that are merged later keep full precision)
  OptTensor lse;    // fp32; varlen [H, total_q], batched [B, H, sq]. may be absent

  // ---- keys and values
  TensorRef k;      // varlen contiguous [total_k, H_kv, D]; batched contiguous
                    // [B_cache, S_cache, H_kv, D]; paged: see kv_layout
  TensorRef v;      // as k, last dim Dv
  KvLayout kv_layout = KvLayout::nhd;  // paged caches only

  // ---- batch description (int32)
  OptTensor cu_seqlens_q;     // [B+1], varlen only; cu_seqlens_q[0] == 0, non-decreasing,
                              // cu_seqlens_q[B] <= total_q: rows of q past it are padding (a
                              // batch padded for a CUDA graph), never read; their out/lse rows
                              // are never written
  OptTensor cu_seqlens_k;     // [B+1], varlen contiguous KV
  OptTensor seqused_k;        // [B]: KV length per sequence. Paged: seqused_k, or else the
                              // lengths of cu_seqlens_k (FA2's convention); contiguous: overrides
                              // the length from cu_seqlens_k / S_cache (must not exceed it).
                              // Batched calls: cache_seqlens
  OptTensor block_table;      // [B, max_blocks]; its presence makes the KV paged
  OptTensor cache_batch_idx;  // [B], batched contiguous cache: cache row of each sequence
  int64_t max_seqlen_q = 0;   // bounds on the lengths (validated); varlen only
  int64_t max_seqlen_k = 0;

  // ---- score modifiers, applied in this order (SPEC.md §2)
  float softmax_scale = 0.0f;   // 0 -> D^-0.5, or (D + Dv)^-0.5 with q_v
  float softcap = 0.0f;         // > 0 enables s = softcap * tanh(s / softcap)
  OptTensor alibi_slopes;       // fp32 [H] or [B, H]
  bool alibi_sqrt = false;      // use sqrt(|i' - j|)
  bool causal = false;          // j <= i'
  Window window{};              // i' - left <= j <= i' + right
  int64_t chunk_size = 0;       // > 0: chunked local attention, j / c == i' / c
  OptTensor s_aux;              // [H] fp32/f16/bf16: sink logit per head

  // ---- quantized operands (SPEC.md §5). fp8 descales are optional (absent = 1.0, as in
  // FlashAttention-3). Given for a 16-bit or fp32 operand they are checked (fp32 [B, H_kv]) and
  // left unused, as FlashAttention does; for an int8 operand they are an error.
  OptTensor q_descale;          // fp8 q: fp32 [B, H_kv] (stride-0 broadcasts allowed)
  OptTensor k_descale;          // fp8 k cache: fp32 [B, H_kv]
  OptTensor v_descale;          // fp8 v cache: fp32 [B, H_kv]
  OptTensor q_scale;            // int8 q: fp32 per (token, head): varlen [total_q, H],
                                // batched [B, sq, H]; any strides (e.g. a transposed [H, total_q])
  OptTensor k_scale_cache;      // int8 k: fp32 per (token, KV head): paged
                                // [num_blocks, H_kv, block_size]; contiguous shaped like k
                                // without D ([total_k, H_kv] / [B_cache, S_cache, H_kv])
  OptTensor v_scale;            // int8 v (K8V8): fp32 [H_kv, Dv], static per (head, channel)

  // ---- context parallelism: this rank holds the KV tokens of global positions t with
  // (t / cp_interleave) % world == rank, local index (t / (cp_interleave * world)) *
  // cp_interleave + t % cp_interleave (cp_interleave 1: t = local * world + rank)
  int cp_world_size = 1;
  int cp_rank = 0;
  int64_t cp_interleave = 1;    // vLLM's cp_kv_cache_interleave_size
  OptTensor cp_tot_seqused_k;   // int32 [B]: global KV lengths (required when cp_world_size > 1)

  // ---- execution
  int num_splits = 0;           // 0 heuristic, 1 none (deterministic), >1 forced
  // Batch-invariant mode (plan.hpp, kBatchInvariantSplitKeys): a row's reduction order, kernel
  // and tile depend on its own sequence only, so its output is bitwise the same whatever else
  // the call holds, among calls of one class: max_seqlen_q <= kBatchInvariantDecodeMaxQ
  // (decode and verify: KV split at multiples of a fixed size, the decode kernel where it
  // serves, else the others unsplit) or longer (never split). num_splits 0 or 1 (none).
  bool batch_invariant = false;
};

// Varlen attention (flash_attn_varlen_func): q varlen; KV contiguous (cu_seqlens_k) or paged
// (block_table + seqused_k).
void varlen_attention(const AttentionParams& p, const ExecContext& ctx = {});

// Batched attention over a KV cache (flash_attn_with_kvcache): q [B, sq, H, D]; KV paged
// (block_table) or contiguous [B_cache, S_cache, H_kv, D]; seqused_k = cache_seqlens.
void kvcache_attention(const AttentionParams& p, const ExecContext& ctx = {});

// The plan for a call (split count, workspace) without running it: a dry run of the same
// selection and sizing that the call performs. Reads shapes only, never tensor contents.
Plan plan_varlen_attention(const AttentionParams& p, const DeviceProps& dev);
Plan plan_kvcache_attention(const AttentionParams& p, const DeviceProps& dev);

// The plan a call given `given` (ExecContext::plan, e.g. from scheduler metadata) runs with:
// `given` when made for the call's shape; made for the same shape with another number of rows
// of q (total_q: a batch planned, then padded for a CUDA graph), `given`'s split count with a
// workspace for the call's rows. Throws naming scheduler_metadata when made for another shape.
// Size the call's workspace with this plan. Reads shapes only.
Plan plan_varlen_attention(const AttentionParams& p, const DeviceProps& dev, const Plan& given);
Plan plan_kvcache_attention(const AttentionParams& p, const DeviceProps& dev, const Plan& given);

// Why this problem is unsupported on `dev` (empty when supported): the same checks the
// call makes, as a string instead of an exception.
std::string attention_unsupported_reason(const AttentionParams& p, bool batched,
                                         const DeviceProps& dev);

// Which kernel serves this problem on `dev`: "reference" on the CPU; on CUDA the selection's
// name ("decode", "prefill_wgmma", "prefill_mma", "generic"; the tensor-core prefill kernels
// serve every score modifier: window, chunk, soft-cap, ALiBi and sqrt-ALiBi, sinks). Validates like the call (throws the same errors);
// throws NotImplemented when no kernel serves it.
std::string attention_kernel_name(const AttentionParams& p, bool batched, const DeviceProps& dev);

}  // namespace flashserve
