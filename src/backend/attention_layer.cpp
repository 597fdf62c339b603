// AttentionLayer::forward (SPEC.md §6): write the new K/V, then one of the paths over the
// metadata: encoder (no cache), cascade (shared prefix ⊕ suffix), chunked local (virtual
// batch), or the decode and prefill parts (with a speculative draft tree when present), each
// a varlen attention call over the paged cache.
#include <algorithm>

#include "common/check.hpp"
#include "backend/layer_ops.hpp"
#include "flashserve/backend.hpp"
#include "flashserve/status.hpp"

namespace flashserve::backend {

using namespace layer;

namespace {

bool is_encoder(const LayerSpec& s) { return s.type == AttnType::encoder || s.type == AttnType::encoder_only; }

// The forward's workspace: partial states of merged passes (cascade, tree), the int8 query,
// the split-KV scratch of the calls' plans.
struct Buffers {
  State a, b;            // "o_prefix"/"lse_prefix", "o_suffix"/"lse_suffix"
  QueryBuffers query;    // int8 caches
  void* split = nullptr;
  size_t split_bytes = 0;
};

// merged passes' partial outputs in `state_dtype` (the workspace is sized for fp32, the largest).
Buffers carve(Carver& ws, const LayerSpec& spec, int64_t T, bool merged, bool cached, size_t split_bytes,
              DType state_dtype = DType::f32) {
  const int64_t H = spec.num_heads, D = spec.head_size, Dv = head_size_v(spec);
  Buffers b;
  if (merged) {
    b.a = take_state(ws, "o_prefix", "lse_prefix", T, H, Dv, state_dtype);
    b.b = take_state(ws, "o_suffix", "lse_suffix", T, H, Dv, state_dtype);
  }
  if (cached) b.query = take_query_buffers(ws, spec.kv_cache_dtype, T, H, D);
  b.split = ws.take_bytes("split_kv", split_bytes);
  b.split_bytes = split_bytes;
  return b;
}

// The largest split-KV workspace among the parts this call runs.
size_t split_bytes_of(const AttentionMetadata& md) {
  size_t n = 0;
  for (const PartMetadata* p : {&md.decode, &md.prefill, &md.cascade.prefix, &md.cascade.suffix, &md.local.part,
                                &md.tree.prefix, &md.tree.tree})
    n = std::max(n, p->plan.workspace.total_bytes);
  return n;
}

// q [>= T, H, D] and out [>= T, H, Dv], before anything is written.
void check_call(const LayerSpec& spec, const AttentionMetadata& md, const TensorRef& q, const TensorRef& out) {
  detail::check_rank(q, "q", 3);
  detail::check_dim(q, "q", 1, spec.num_heads, "num_heads");
  detail::check_dim(q, "q", 2, spec.head_size, "head_size");
  detail::check_rank(out, "out", 3);
  detail::check_dim(out, "out", 1, spec.num_heads, "num_heads");
  detail::check_dim(out, "out", 2, head_size_v(spec), "head_size_v");
  const int64_t T = md.num_actual_tokens;
  if (q.size(0) < T) fail_arg("q", detail::cat("at least num_actual_tokens=", T, " rows"), q.shape_str());
  if (out.size(0) < T) fail_arg("out", detail::cat("at least num_actual_tokens=", T, " rows"), out.shape_str());
}

// q_descale: fp32 [] / [1] / [H_kv] on q's device (a shape that would broadcast wrongly is an
// error, never read as a single scale).
void check_q_descale(const OptTensor& s, int64_t H_kv) {
  if (!s) return;
  detail::check_dtype(*s, "q_descale", {DType::f32});
  if (s->ndim > 1 || (s->ndim == 1 && s->size(0) != 1 && s->size(0) != H_kv))
    fail_arg("q_descale", detail::cat("fp32 [], [1] or [num_kv_heads=", H_kv, "]"), s->shape_str());
}

// out rows of `rows` = merge(a, b) over those rows.
void merge_rows(const PartMetadata& rows, const State& a, const State& b, const TensorRef& out,
                const ExecContext& ctx) {
  const int64_t r0 = rows.token_begin, r1 = rows.token_begin + rows.num_tokens;
  MergeParams mp;
  mp.out = out.slice(0, r0, r1);
  mp.a_out = a.o.slice(0, r0, r1);
  mp.a_lse = a.lse.slice(1, r0, r1);
  mp.b_out = b.o.slice(0, r0, r1);
  mp.b_lse = b.lse.slice(1, r0, r1);
  merge_states(mp, ctx);
}

// Encoder types: each part attends over its own tokens' key/value, non-causal.
void run_encoder(const Modifiers& m, const AttentionMetadata& md, const TensorRef& q, const OptTensor& key,
                 const OptTensor& value, const TensorRef& out, const ExecContext& ctx) {
  if (!key || !value) fail_arg(key ? "value" : "key", "the encoder's [T, H_kv, D] tensor", "none");
  for (const PartMetadata* part : {&md.decode, &md.prefill})
    if (!part->empty()) self_pass(m, Query{q, std::nullopt}, *key, *value, Pass{part, false, true, out, {}}, ctx);
}

// Shared prefix (non-causal, no sink) ⊕ each request's suffix (causal, with the sink).
void run_cascade(const Modifiers& m, const Query& q, const CacheView& cache, const AttentionMetadata& md,
                 const TensorRef& out, const Buffers& buf, const ExecContext& ctx) {
  const CascadeMetadata& c = md.cascade;
  paged_pass(m, q, cache, Pass{&c.prefix, c.prefix.causal, false, buf.a.o, buf.a.lse}, ctx);
  paged_pass(m, q, cache, Pass{&c.suffix, c.suffix.causal, true, buf.b.o, buf.b.lse}, ctx);
  merge_rows(c.prefix, buf.a, buf.b, out, ctx);
}

// The tree pass's view of the cache (block size 1: its block table holds slots), checked
// before anything is written.
CacheView tree_view(const Modifiers& m, const CacheView& cache) {
  if (m.alibi_slopes || !m.window.unbounded())
    fail_not_implemented("speculative tree verify with ALiBi or a sliding window (positions in the tree pass "
                         "are path positions)");
  return slot_view(cache);
}

// Committed prefix (no sink) ⊕ each draft token over its ancestor path (with the sink).
void run_tree(const Modifiers& m, const Query& q, const CacheView& cache, const CacheView& slots,
              const AttentionMetadata& md, const TensorRef& out, const Buffers& buf, const ExecContext& ctx) {
  const TreeMetadata& t = md.tree;
  paged_pass(m, q, cache, Pass{&t.prefix, t.prefix.causal, false, buf.a.o, buf.a.lse}, ctx);
  paged_pass(m, q, slots, Pass{&t.tree, t.tree.causal, true, buf.b.o, buf.b.lse}, ctx);
  merge_rows(t.prefix, buf.a, buf.b, out, ctx);
}

// The passes over the cache that the metadata asks for (ctx.validate_only: checks only).
void run_cached(const Modifiers& m, const AttentionMetadata& md, const TensorRef& q, const CacheView& view,
                const CacheView& slots, const TensorRef& out, const Buffers& buf, const ExecContext& ctx,
                bool decoder) {
  const Query query = prepare_query(q, md.num_actual_tokens, buf.query, ctx);
  if (md.cascade.enabled) return run_cascade(m, query, view, md, out, buf, ctx);
  if (md.local.enabled) {
    if (!md.local.part.empty()) paged_pass(m, query, view, Pass{&md.local.part, md.local.part.causal, true, out, {}}, ctx);
    return;
  }
  if (md.tree.enabled) run_tree(m, query, view, slots, md, out, buf, ctx);
  else if (!md.decode.empty()) paged_pass(m, query, view, Pass{&md.decode, decoder && md.decode.causal, true, out, {}}, ctx);
  if (!md.prefill.empty()) paged_pass(m, query, view, Pass{&md.prefill, decoder && md.prefill.causal, true, out, {}}, ctx);
}

}  // namespace

AttentionLayer::AttentionLayer(const LayerSpec& spec) : spec_(spec) {
  if (spec.num_heads < 1 || spec.num_kv_heads < 1 || spec.num_heads % spec.num_kv_heads != 0)
    fail_arg("num_kv_heads", detail::cat("a divisor of num_heads=", spec.num_heads), spec.num_kv_heads);
  if (spec.head_size < 1) fail_arg("head_size", ">= 1", spec.head_size);
}

size_t AttentionLayer::workspace_bytes(const BuilderConfig& config) const {
  Carver dry;
  carve(dry, spec_, config.max_num_tokens, true, !is_encoder(spec_),
        split_kv_bound(config, spec_.num_heads, head_size_v(spec_)));
  return dry.used();
}

void AttentionLayer::forward(const AttentionMetadata& md, const TensorRef& q, const OptTensor& key,
                             const OptTensor& value, const KvCache* cache, const TensorRef& out,
                             const LayerWorkspace& ws, const ExecContext& ctx) const {
  check_call(spec_, md, q, out);
  const Modifiers m = modifiers_of(spec_);
  const bool encoder = is_encoder(spec_);
  const bool merged = !encoder && (md.cascade.enabled || md.tree.enabled);
  // The cascade's prefix and suffix outputs in out's 16-bit dtype, as FlashAttention's cascade
  // (vLLM) keeps them before merge_attn_states: the passes run the tensor-core kernels' 16-bit
  // path (an fp32 output costs prefill_tma a second P V product for P's rounding residue: 1.5x
  // the prefix pass's tensor work); the LSEs and the merge stay fp32.
  const DType state = md.cascade.enabled && (out.dtype == DType::bf16 || out.dtype == DType::f16) ? out.dtype
                                                                                                  : DType::f32;
  Carver carver(ws);
  const Buffers buf = carve(carver, spec_, md.num_actual_tokens, merged, !encoder, split_bytes_of(md), state);
  ExecContext base = ctx;
  base.workspace = buf.split;
  base.workspace_bytes = buf.split_bytes;
  base.plan = nullptr;
  if (encoder) return run_encoder(m, md, q, key, value, out, base);

  if (!cache) fail_arg("cache", "the layer's KV cache", "none");
  check_q_descale(cache->q_descale, spec_.num_kv_heads);
  const CacheView view = cache_view(*cache, spec_);
  const CacheView slots = md.tree.enabled ? tree_view(m, view) : view;
  const bool write = spec_.writes_kv_cache && key && value;
  const bool decoder = spec_.type == AttnType::decoder;  // cross-attention sees every encoder token
  // Every call is checked (dry run) before the cache is written: a rejected forward writes nothing.
  ExecContext dry = base;
  dry.validate_only = true;
  if (write) write_cache(*cache, spec_, *key, *value, md.slot_mapping, dry);
  run_cached(m, md, q, view, slots, out, buf, dry, decoder);
  if (write) write_cache(*cache, spec_, *key, *value, md.slot_mapping, base);
  run_cached(m, md, q, view, slots, out, buf, base, decoder);
}

void AttentionLayer::update_kv_cache(const TensorRef& key, const TensorRef& value, const KvCache& cache,
                                     const TensorRef& slot_mapping, const ExecContext& ctx) const {
  if (is_encoder(spec_)) fail_arg("attn_type", "a layer with a KV cache (decoder or encoder_decoder)", "an encoder type");
  write_cache(cache, spec_, key, value, slot_mapping, ctx);
}

}  // namespace flashserve::backend
