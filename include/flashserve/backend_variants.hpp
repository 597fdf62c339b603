// Layer variants composed from the attention, cache and merge operations (SPEC.md §6):
// differential attention, MLA prefill/decode, decode context parallelism.
#pragma once

#include <cstdint>
#include <span>

#include "flashserve/backend.hpp"

namespace flashserve::backend {

// ---------------------------------------------------------------- differential attention
// Heads come in interleaved pairs: q1 = even heads, q2 = odd heads (likewise k, v).
// λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init; a1 = attn(q1, k1, [v1|v2]); a2 = attn(q2, k2, [v1|v2]);
// out = RMSNorm(a1 - λ a2) * (1 - λ_init) over width 2D, re-interleaved to [T, H, D].
struct DifferentialSpec {
  LayerSpec base;          // num_heads / num_kv_heads count both halves (even), head_size D
  float lambda_init = 0.8f;
  TensorRef lambda_q1, lambda_k1, lambda_q2, lambda_k2;  // fp32 [D]
  TensorRef subln_weight;  // fp32 [2D], RMSNorm weight
  float rms_eps = 1e-5f;
};

// The two halves' caches (each [num_blocks, block_size, H_kv / 2, D]).
struct DifferentialCache {
  KvCache half1;  // k1 / v1
  KvCache half2;  // k2 / v2
};

class DifferentialAttentionLayer {
 public:
  explicit DifferentialAttentionLayer(const DifferentialSpec& spec);
  float lambda_full() const;  // λ from the four vectors
  size_t workspace_bytes(const BuilderConfig& config) const;
  // q [T, H, D], key/value [T, H_kv, D], out [T, H, D].
  void forward(const AttentionMetadata& md, const TensorRef& q, const OptTensor& key, const OptTensor& value,
               const DifferentialCache& cache, const TensorRef& out, const LayerWorkspace& ws,
               const ExecContext& ctx = {}) const;

 private:
  DifferentialSpec spec_;
};

// ---------------------------------------------------------------- MLA
// Latent cache: [num_blocks, block_size, 576] (kv_c 512 then k_pe 64), one KV head.
struct MlaSpec {
  int64_t num_heads = 0;
  int64_t kv_lora_rank = 512;
  int64_t qk_rope_head_dim = 64;
  int64_t qk_nope_head_dim = 128;
  int64_t v_head_dim = 128;
  float scale = 0.0f;  // softmax scale of the un-absorbed form: (nope + rope)^-0.5 when 0
  DType dtype = DType::bf16;
};

// A context chunk the caller has up-projected: k [n, H, nope + rope], v [n, H, v_head_dim],
// with cu_seqlens_k [B + 1] over the prefill requests.
struct MlaContextChunk {
  TensorRef k, v, cu_seqlens_k;
  int64_t max_seqlen_k = 0;
};

class MlaLayer {
 public:
  explicit MlaLayer(const MlaSpec& spec);
  size_t workspace_bytes(const BuilderConfig& config) const;
  // Prefill: new tokens causal (D = 192, Dv = 128) ⊕ each context chunk non-causal with LSE.
  // q/k [T, H, 192], v [T, H, 128] for the prefill part's tokens; out [T, H, 128].
  void prefill(const PartMetadata& part, const TensorRef& q, const TensorRef& k, const TensorRef& v,
               std::span<const MlaContextChunk> context, const TensorRef& out, const LayerWorkspace& ws,
               const ExecContext& ctx = {}) const;
  // Absorbed decode: q_pe [T, H, 64] against the rope part, q_nope_absorbed [T, H, 512] (q_v)
  // against the latent part; out [T, H, 512] (the caller applies W_UV).
  void decode(const PartMetadata& part, const TensorRef& q_pe, const TensorRef& q_nope_absorbed,
              const TensorRef& latent_cache, const TensorRef& out, const ExecContext& ctx = {}) const;
  // Gathers the latent rows of tokens [begin, end) of each request into dst [n, 576].
  void gather_context(const PartMetadata& part, const TensorRef& latent_cache, int64_t begin, int64_t end,
                      const TensorRef& dst, const TensorRef& cu_seqlens_dst, const ExecContext& ctx = {}) const;

 private:
  MlaSpec spec_;
};

// ---------------------------------------------------------------- decode context parallel
// W ranks share every sequence's KV: position t lives on rank (t / I) % W at local index
// (t / (I * W)) * I + t % I, I the interleave (vLLM's cp_kv_cache_interleave_size; I = 1:
// rank t % W, local index t / W). Each rank holds H_local query heads and every KV head of its
// shard. A step, per layer:
//
//   write_kv    the new tokens' K/V into this rank's shard at md.slot_mapping (the engine's
//               local slots: -1 for the positions other ranks own)
//   all_gather  q [T, H_local, D] -> q_all [W, T, H_local, D] (global head s * H_local + j)
//   attend      q_all over the local shard, H = W * H_local heads, queries at their global
//               positions (causal verify steps see only earlier positions) ->
//               out_all fp32 [W, T, H_local, Dv], lse_local fp32 [H, T]
//   all_gather  lse_local -> lse_all fp32 [W, H, T]
//   correct     out_all *= exp(lse_local - logsumexp over ranks)            (lse_correct)
//   reduce_scatter  out_all -> out [T, H_local, Dv]: the sum over ranks of slice `rank`
//
// forward() runs them with a Communicator. The phases are public for an engine that owns its
// collectives (the Python backend runs them around torch.distributed / vLLM's dcp group): each
// phase only enqueues kernels on ctx's stream, never allocates or synchronizes, so a step
// including the engine's collectives captures in one CUDA graph.
class DcpAttentionLayer {
 public:
  DcpAttentionLayer(const LayerSpec& local_spec, Communicator& comm);
  // The phases only, for rank `rank` of `world_size` (forward() is an error).
  DcpAttentionLayer(const LayerSpec& local_spec, int world_size, int rank);
  const LayerSpec& spec() const { return spec_; }
  int world_size() const { return world_; }
  int rank() const { return rank_; }
  // forward()'s workspace (q_all, out_all, LSEs and the split-KV buffer), for batches up to the
  // builder's capacities.
  size_t workspace_bytes(const BuilderConfig& config) const;
  // attend()'s workspace alone (the split-KV buffer, and the int8 query buffers).
  size_t attend_workspace_bytes(const BuilderConfig& config) const;

  // q [T, H_local, D]; key/value [T, H_kv, D(v)]: this step's new tokens, written to the shard
  // at md.slot_mapping unless absent or the spec does not write (KV sharing); cache: this
  // rank's shard; md from a builder with this rank's dcp_world_size / dcp_rank /
  // dcp_interleave (seq_lens global); out [T, H_local, Dv]. Every argument is checked before
  // the first collective. Without sinks (and with a 16/32-bit q) the attention is one call over
  // every gathered head (attend's token-major layout; the workspace holds the transposes).
  void forward(const AttentionMetadata& md, const TensorRef& q, const OptTensor& key, const OptTensor& value,
               const KvCache& cache, const TensorRef& out, const LayerWorkspace& ws,
               const ExecContext& ctx = {}) const;
  // The same without new tokens to write (the engine wrote the shard, or KV sharing).
  void forward(const AttentionMetadata& md, const TensorRef& q, const KvCache& cache, const TensorRef& out,
               const LayerWorkspace& ws, const ExecContext& ctx = {}) const {
    forward(md, q, std::nullopt, std::nullopt, cache, out, ws, ctx);
  }

  // ---- the phases
  void write_kv(const AttentionMetadata& md, const TensorRef& key, const TensorRef& value, const KvCache& cache,
                const ExecContext& ctx = {}) const;
  // Two layouts, rows [0, T) written:
  //  - slice-major, as gathered: q_all [W, >= T, H_local, D], out_all fp32 [W, >= T, H_local, Dv]:
  //    one attention call per slice (per KV head when a slice straddles KV-head groups);
  //  - token-major: q_all [>= T, H, D] (global head s * H_local + j at column s * H_local + j),
  //    out_all fp32 [>= T, H, Dv]: ONE call over every head, as many CTAs as the single-device
  //    layer on 1/W of the keys (the engine transposes the gathered q and, before the
  //    reduce-scatter, out_all: tiny copies for decode). Not with sinks (a sink enters only its
  //    own rank's heads).
  // lse_local fp32 [H, >= T] (columns [0, T) written) in both.
  void attend(const AttentionMetadata& md, const TensorRef& q_all, const KvCache& cache, const TensorRef& out_all,
              const TensorRef& lse_local, const LayerWorkspace& ws, const ExecContext& ctx = {}) const;
  // out_all fp32 [W, T, H_local, Dv] or [T, H, Dv] scaled in place; lse_all fp32 [W, H, T].
  void correct(const TensorRef& out_all, const TensorRef& lse_all, const ExecContext& ctx = {}) const;

  // ---- the layout (common to the builder, the kernels' cp arguments and the engine's slots)
  // How many of the global positions [0, global_len) live on `rank`.
  static int64_t local_len(int64_t global_len, int world, int rank, int64_t interleave = 1);
  // The rank that holds global position `pos`, and its local index there.
  static int owner(int64_t pos, int world, int64_t interleave = 1);
  static int64_t local_index(int64_t pos, int world, int64_t interleave = 1);

 private:
  void check_md(const AttentionMetadata& md) const;
  LayerSpec spec_;
  Communicator* comm_ = nullptr;
  int world_ = 1, rank_ = 0;
};

}  // namespace flashserve::backend
