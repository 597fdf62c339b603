// MLA (SPEC.md §6). Prefill: the new tokens attend causally to themselves (D = 192, Dv = 128)
// and non-causally to each up-projected context chunk; the partial states merge in order
// (chunk 0 ⊕ chunk 1 ⊕ ... ⊕ new tokens). Decode: the absorbed form, q_pe (64) against the rope
// part and q_v (512) against the latent part of one [num_blocks, block_size, 576] cache.
#include <algorithm>
#include <cmath>

#include "common/check.hpp"
#include "backend/layer_ops.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"

namespace flashserve::backend {

using namespace layer;

namespace {

struct PrefillBuffers {
  State acc[2];  // the running merge, ping-ponged
  State pass;    // the pass being merged in
};

PrefillBuffers carve(Carver& ws, int64_t T, int64_t H, int64_t Dv) {
  PrefillBuffers b;
  b.acc[0] = take_state(ws, "mla_acc0", "mla_acc0_lse", T, H, Dv);
  b.acc[1] = take_state(ws, "mla_acc1", "mla_acc1_lse", T, H, Dv);
  b.pass = take_state(ws, "mla_pass", "mla_pass_lse", T, H, Dv);
  return b;
}

void merge(const State& a, const State& b, const TensorRef& out, const OptTensor& out_lse, const ExecContext& ctx) {
  MergeParams mp;
  mp.out = out;
  mp.out_lse = out_lse;
  mp.a_out = a.o;
  mp.a_lse = a.lse;
  mp.b_out = b.o;
  mp.b_lse = b.lse;
  merge_states(mp, ctx);
}

// Rows [0, T) of a [>= T, ...] tensor.
TensorRef rows(const TensorRef& t, int64_t T) { return t.slice(0, 0, T); }

}  // namespace

MlaLayer::MlaLayer(const MlaSpec& spec) : spec_(spec) {
  if (spec.num_heads < 1) fail_arg("num_heads", ">= 1", spec.num_heads);
  for (auto [v, arg] : {std::pair{spec.kv_lora_rank, "kv_lora_rank"}, std::pair{spec.qk_rope_head_dim, "qk_rope_head_dim"},
                        std::pair{spec.qk_nope_head_dim, "qk_nope_head_dim"}, std::pair{spec.v_head_dim, "v_head_dim"}})
    if (v < 1) fail_arg(arg, ">= 1", v);
}

size_t MlaLayer::workspace_bytes(const BuilderConfig& config) const {
  Carver dry;
  carve(dry, config.max_num_tokens, spec_.num_heads, spec_.v_head_dim);
  return dry.used();
}

void MlaLayer::prefill(const PartMetadata& part, const TensorRef& q, const TensorRef& k, const TensorRef& v,
                       std::span<const MlaContextChunk> context, const TensorRef& out, const LayerWorkspace& ws,
                       const ExecContext& ctx) const {
  const int64_t T = part.num_tokens;
  ExecContext c = ctx;
  c.plan = nullptr;  // several calls of different shapes: each plans itself
  AttentionParams p;
  p.q = rows(q, T);
  p.cu_seqlens_q = part.cu_seqlens_q;
  p.max_seqlen_q = part.max_query_len;
  p.batch_invariant = part.plan.shape.batch_invariant;  // the part's class (builder_compose part_plan)
  if (p.batch_invariant) p.max_seqlen_q = std::max(p.max_seqlen_q, part.plan.shape.max_seqlen_q);
  p.softmax_scale = spec_.scale != 0.0f ? spec_.scale
                                        : 1.0f / std::sqrt(float(spec_.qk_nope_head_dim + spec_.qk_rope_head_dim));
  auto attend_new = [&](const TensorRef& o, const OptTensor& lse) {  // causal, sq == sk
    AttentionParams n = p;
    n.k = rows(k, T);
    n.v = rows(v, T);
    n.cu_seqlens_k = part.cu_seqlens_q;
    n.max_seqlen_k = part.max_query_len;
    n.causal = true;
    n.out = o;
    n.lse = lse;
    varlen_attention(n, c);
  };
  if (context.empty()) return attend_new(rows(out, T), std::nullopt);

  Carver carver(ws);
  const PrefillBuffers buf = carve(carver, T, spec_.num_heads, spec_.v_head_dim);
  int cur = 0;
  for (size_t i = 0; i < context.size(); ++i) {
    const MlaContextChunk& ch = context[i];
    AttentionParams cp = p;
    cp.k = ch.k;
    cp.v = ch.v;
    cp.cu_seqlens_k = ch.cu_seqlens_k;
    cp.max_seqlen_k = ch.max_seqlen_k;
    cp.causal = false;
    const State& dst = i == 0 ? buf.acc[0] : buf.pass;
    cp.out = dst.o;
    cp.lse = dst.lse;
    varlen_attention(cp, c);
    if (i > 0) {
      merge(buf.acc[cur], buf.pass, buf.acc[1 - cur].o, buf.acc[1 - cur].lse, c);
      cur = 1 - cur;
    }
  }
  attend_new(buf.pass.o, buf.pass.lse);
  merge(buf.acc[cur], buf.pass, rows(out, T), std::nullopt, c);
}

void MlaLayer::decode(const PartMetadata& part, const TensorRef& q_pe, const TensorRef& q_nope_absorbed,
                      const TensorRef& latent_cache, const TensorRef& out, const ExecContext& ctx) const {
  const int64_t L = spec_.kv_lora_rank, R = spec_.qk_rope_head_dim, T = part.num_tokens;
  detail::check_rank(latent_cache, "latent_cache", 3);
  detail::check_dim(latent_cache, "latent_cache", 2, L + R, "kv_lora_rank + qk_rope_head_dim");
  AttentionParams p;
  p.q = rows(q_pe, T);
  p.q_v = rows(q_nope_absorbed, T);
  p.out = rows(out, T);
  p.k = latent_cache.slice(2, L, L + R).unsqueeze(2);  // [num_blocks, block_size, 1, R]
  p.v = latent_cache.slice(2, 0, L).unsqueeze(2);      // [num_blocks, block_size, 1, L]
  p.block_table = part.block_table;
  p.seqused_k = part.seqused_k;
  p.cu_seqlens_q = part.cu_seqlens_q;
  p.max_seqlen_q = part.max_query_len;
  p.batch_invariant = part.plan.shape.batch_invariant;  // the part's class (builder_compose part_plan)
  if (p.batch_invariant) p.max_seqlen_q = std::max(p.max_seqlen_q, part.plan.shape.max_seqlen_q);
  p.max_seqlen_k = part.max_seq_len;
  p.causal = part.causal;
  p.softmax_scale = spec_.scale != 0.0f ? spec_.scale
                                        : 1.0f / std::sqrt(float(spec_.qk_nope_head_dim + spec_.qk_rope_head_dim));
  varlen_attention(p, ctx);
}

void MlaLayer::gather_context(const PartMetadata& part, const TensorRef& latent_cache, int64_t begin, int64_t end,
                              const TensorRef& dst, const TensorRef& cu_seqlens_dst, const ExecContext& ctx) const {
  detail::check_rank(latent_cache, "latent_cache", 3);
  detail::check_dim(latent_cache, "latent_cache", 2, spec_.kv_lora_rank + spec_.qk_rope_head_dim,
                    "kv_lora_rank + qk_rope_head_dim");
  detail::check_last_contiguous(latent_cache, "latent_cache");
  if (begin < 0 || end < begin) fail_arg("end", detail::cat(">= begin=", begin, " >= 0"), end);
  GatherCacheParams g;  // tokens [begin, end) of each request's context (KV before this step's queries)
  g.cache = latent_cache;
  g.block_table = part.block_table;
  g.seqused_k = part.seqused_k;
  g.cu_seqlens_q = part.cu_seqlens_q;
  g.token_begin = begin;
  g.token_end = end;
  g.dst = dst;
  g.cu_seqlens_dst = cu_seqlens_dst;
  gather_cache(g, ctx);
}

}  // namespace flashserve::backend
