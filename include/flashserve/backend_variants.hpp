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
// KV token i of rank r is global token i * world + r. Each rank holds H_local = H / world
// query heads; forward all-gathers queries over heads, attends over its local KV with LSE,
// then reduce-scatters the LSE-corrected outputs back to its own heads.
class DcpAttentionLayer {
 public:
  DcpAttentionLayer(const LayerSpec& local_spec, Communicator& comm);
  size_t workspace_bytes(const BuilderConfig& config) const;
  // q [T, H_local, D]; cache: this rank's shard; md built with dcp_world_size/dcp_rank (the
  // seq_lens are global lengths); out [T, H_local, Dv].
  void forward(const AttentionMetadata& md, const TensorRef& q, const KvCache& cache, const TensorRef& out,
               const LayerWorkspace& ws, const ExecContext& ctx = {}) const;
  // Local length of a global length on `rank`.
  static int64_t local_len(int64_t global_len, int world, int rank) {
    return global_len > rank ? (global_len - rank + world - 1) / world : 0;
  }

 private:
  LayerSpec spec_;
  Communicator* comm_;
};

}  // namespace flashserve::backend
