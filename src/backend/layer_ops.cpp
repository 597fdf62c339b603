// Building blocks of the backend layers: workspace carving, cache views, one attention pass.
#include "backend/layer_ops.hpp"

#include <algorithm>

#include "flashserve/status.hpp"

namespace flashserve::backend::layer {

namespace {

size_t align_up(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// A per-tensor ([] / [1]) or per-KV-head ([H_kv]) fp32 scale as the [B, H_kv] descale the
// attention call takes: stride 0 over B (and over heads for a single scale).
TensorRef broadcast_descale(const TensorRef& s, int64_t B, int64_t H_kv) {
  const bool per_head = s.ndim == 1 && s.size(0) == H_kv && H_kv > 1;
  return TensorRef::strided(s.data, s.dtype, {B, H_kv}, {0, per_head ? s.stride[0] : 0}, s.device);
}

// The builder's plan for this call when it was made for the call's dimensions (see Pass).
const Plan* plan_for(const PartMetadata& part, const AttentionParams& p, int64_t H_kv, int64_t page_size) {
  const ProblemShape& s = part.plan.shape;
  if (part.num_reqs == 0 || s.batch != part.num_reqs) return nullptr;
  const bool same_dims = s.num_heads == p.q.size(1) && s.num_kv_heads == H_kv && s.head_dim == p.q.size(2) &&
                         s.head_dim_v == p.out.size(2) && s.page_size == page_size;
  return same_dims ? &part.plan : nullptr;
}

// The pass's rows of q/out/lse and the layer's modifiers.
AttentionParams pass_params(const Modifiers& m, const Query& q, const Pass& pass) {
  const PartMetadata& part = *pass.part;
  const int64_t b = part.token_begin, e = part.token_begin + part.num_tokens;
  AttentionParams p;
  p.q = q.q.slice(0, b, e);
  if (q.q_scale) p.q_scale = q.q_scale->slice(0, b, e);
  p.out = pass.out.slice(0, b, e);
  if (pass.lse) p.lse = pass.lse->slice(1, b, e);
  p.cu_seqlens_q = part.cu_seqlens_q;
  p.max_seqlen_q = part.max_query_len;
  if (part.plan.shape.batch_invariant) {  // the class the part was planned in (part_plan)
    p.batch_invariant = true;
    p.max_seqlen_q = std::max(p.max_seqlen_q, part.plan.shape.max_seqlen_q);
  }
  p.causal = pass.causal;
  p.softmax_scale = m.scale;
  p.softcap = m.softcap;
  p.alibi_slopes = m.alibi_slopes;
  p.alibi_sqrt = m.alibi_sqrt;
  p.window = m.window;
  if (pass.sink) p.s_aux = m.sinks;
  return p;
}

ExecContext with_plan(const ExecContext& ctx, const Plan* plan) {
  ExecContext c = ctx;
  c.plan = plan;
  return c;
}

}  // namespace

// ---------------------------------------------------------------- workspace

void* Carver::take_bytes(std::string_view name, size_t bytes) {
  const size_t offset = align_up(used_);
  used_ = offset + bytes;
  if (!ws_) return nullptr;
  if (used_ > ws_->bytes)
    fail_arg("workspace", detail::cat("at least ", used_, " bytes (buffer ", name, ": ", bytes, " bytes at offset ", offset, ")"),
             detail::cat(ws_->bytes, " bytes"));
  if (bytes > 0 && ws_->data == nullptr) fail_arg("workspace", "non-null data", "a null pointer");
  return static_cast<char*>(ws_->data) + offset;
}

TensorRef Carver::take(std::string_view name, DType dtype, std::initializer_list<int64_t> shape, DType sized_as) {
  TensorRef t = TensorRef::contiguous(nullptr, dtype, shape, ws_ ? ws_->device : Device{});
  const size_t elem = std::max(dtype_size(dtype), dtype_size(sized_as));
  t.data = take_bytes(name, size_t(t.numel()) * elem);
  return t;
}

LayerWorkspace Carver::rest() const {
  if (!ws_) return {};
  const size_t offset = std::min(align_up(used_), ws_->bytes);
  return LayerWorkspace{ws_->data ? static_cast<char*>(ws_->data) + offset : nullptr, ws_->bytes - offset, ws_->device};
}

State take_state(Carver& c, std::string_view o_name, std::string_view lse_name, int64_t T, int64_t H, int64_t Dv,
                 DType o_dtype) {
  State s;
  s.o = c.take(o_name, o_dtype, {T, H, Dv});
  s.lse = c.take(lse_name, DType::f32, {H, T});
  return s;
}

int64_t split_partial_rows(const BuilderConfig& config, int64_t H, const DeviceProps& dev) {
  if (config.batch_invariant)  // fixed-size splits: up to kMaxSplits, bounded by the invariant bound
    return std::min(int64_t(kMaxSplits) * config.max_num_tokens * H, max_invariant_split_rows(dev));
  const int64_t splits = std::clamp(config.max_num_splits, 1, kMaxSplits);
  return std::min(splits * config.max_num_tokens * H, max_split_rows(dev));
}

size_t split_kv_bound(const BuilderConfig& config, int64_t H, int64_t Dv) {
  if (config.device.device.type != DeviceType::cuda) return 0;  // the CPU reference merges in registers
  return align_up(split_workspace(split_partial_rows(config, H, config.device), Dv).total_bytes);
}

void require_host(const TensorRef& t, std::string_view what) {
  if (t.device.type == DeviceType::cuda)
    fail_not_implemented(what, " on CUDA tensors (the CUDA kernels are not built yet)");
}

// ---------------------------------------------------------------- operands

Modifiers modifiers_of(const LayerSpec& spec) {
  Modifiers m;
  m.scale = spec.scale;
  m.softcap = spec.softcap;
  m.alibi_slopes = spec.alibi_slopes;
  m.alibi_sqrt = spec.alibi_sqrt;
  m.sinks = spec.sinks;
  m.window = layer_window(spec);
  return m;
}

bool is_int8(KvCacheDType t) { return t == KvCacheDType::int8_k8v8 || t == KvCacheDType::int8_k8v16; }
bool is_fp8(KvCacheDType t) { return t == KvCacheDType::fp8_e4m3 || t == KvCacheDType::fp8_e5m2; }

QueryBuffers take_query_buffers(Carver& ws, KvCacheDType cache_dtype, int64_t T, int64_t H, int64_t D) {
  if (!is_int8(cache_dtype)) return {};
  QueryBuffers b;
  b.q8 = ws.take("q_int8", DType::i8, {T, H, D});
  b.scale = ws.take("q_scale", DType::f32, {T, H});
  return b;
}

Query prepare_query(const TensorRef& q, int64_t T, const QueryBuffers& b, const ExecContext& ctx) {
  if (!b.q8) return {q, std::nullopt};
  quantize_int8(q.slice(0, 0, T), *b.q8, *b.scale, ctx);
  return {*b.q8, *b.scale};
}

CacheView cache_view(const KvCache& cache, const LayerSpec& spec) {
  CacheView v;
  v.k = cache.key_cache;
  v.v = cache.value_cache;
  v.layout = spec.kv_layout;
  v.dtype = spec.kv_cache_dtype;
  v.q_descale = cache.q_descale;
  if (is_fp8(v.dtype)) {
    const DType fmt = v.dtype == KvCacheDType::fp8_e4m3 ? DType::f8e4m3 : DType::f8e5m2;
    if (v.k.dtype == DType::u8) v.k.dtype = fmt;
    if (v.v.dtype == DType::u8) v.v.dtype = fmt;
    v.k_scale = cache.k_scale;
    v.v_scale = cache.v_scale;
  } else if (is_int8(v.dtype)) {
    v.k_scale_cache = cache.k_scale_cache;
    if (v.dtype == KvCacheDType::int8_k8v8) v.v_scale = cache.v_scale;
  }
  return v;
}

CacheView slice_kv_heads(const CacheView& c, int64_t begin, int64_t end) {
  const int64_t H_kv = c.num_kv_heads();
  const int head_dim = c.layout == KvLayout::nhd ? 2 : 1;
  CacheView s = c;
  s.k = c.k.slice(head_dim, begin, end);
  s.v = c.v.slice(head_dim, begin, end);
  auto per_head = [&](const OptTensor& t) -> OptTensor {
    if (!t || t->ndim == 0 || t->size(0) != H_kv || (t->ndim == 1 && H_kv == 1)) return t;
    return t->slice(0, begin, end);  // fp8 [H_kv], int8 v_scale [H_kv, Dv]
  };
  s.k_scale = per_head(c.k_scale);
  s.v_scale = per_head(c.v_scale);
  s.q_descale = per_head(c.q_descale);
  if (c.k_scale_cache) s.k_scale_cache = c.k_scale_cache->slice(1, begin, end);
  return s;
}

CacheView slot_view(const CacheView& c) {
  const bool nhd = c.layout == KvLayout::nhd;
  const int slot_dim = nhd ? 1 : 2;
  auto view = [&](const TensorRef& t, const char* arg) {
    const int64_t bs = t.size(slot_dim), ss = t.stride[slot_dim];
    if (t.ndim != 4 || t.stride[0] != bs * ss)
      fail_not_implemented("speculative tree verify over a ", nhd ? "NHD" : "HND", " cache whose ", arg,
                           " slots are not evenly spaced (block stride ", t.stride[0], ", slot stride ", ss,
                           ", block size ", bs, ")");
    TensorRef v = t;
    v.shape[0] = t.size(0) * bs;
    v.stride[0] = ss;
    v.shape[slot_dim] = 1;
    return v;
  };
  CacheView s = c;
  s.k = view(c.k, "key_cache");
  s.v = view(c.v, "value_cache");
  if (c.k_scale_cache) {  // [num_blocks, H_kv, block_size]
    const TensorRef& t = *c.k_scale_cache;
    if (t.ndim != 3 || t.stride[0] != t.size(2) * t.stride[2])
      fail_not_implemented("speculative tree verify with an int8 cache whose k_scale_cache slots are not evenly spaced");
    TensorRef v = t;
    v.shape[0] = t.size(0) * t.size(2);
    v.stride[0] = t.stride[2];
    v.shape[2] = 1;
    s.k_scale_cache = v;
  }
  return s;
}

void write_cache(const KvCache& cache, const LayerSpec& spec, const TensorRef& key, const TensorRef& value,
                 const TensorRef& slot_mapping, const ExecContext& ctx) {
  CacheWriteParams w;
  w.key = key;
  w.value = value;
  w.key_cache = cache.key_cache;
  w.value_cache = cache.value_cache;
  w.layout = spec.kv_layout;
  w.slot_mapping = slot_mapping;
  w.cache_dtype = spec.kv_cache_dtype;
  if (is_fp8(spec.kv_cache_dtype)) {
    w.k_scale = cache.k_scale;
    w.v_scale = cache.v_scale;
  } else if (is_int8(spec.kv_cache_dtype)) {
    w.k_scale_cache = cache.k_scale_cache;
    if (spec.kv_cache_dtype == KvCacheDType::int8_k8v8) w.v_scale = cache.v_scale;
  }
  reshape_and_cache(w, ctx);
}

// ---------------------------------------------------------------- one attention pass

void paged_pass(const Modifiers& m, const Query& q, const CacheView& cache, const Pass& pass, const ExecContext& ctx,
                const PassExtras& extras) {
  const PartMetadata& part = *pass.part;
  AttentionParams p = pass_params(m, q, pass);
  p.k = cache.k;
  p.v = cache.v;
  p.kv_layout = cache.layout;
  p.seqused_k = part.seqused_k;
  p.block_table = part.block_table;
  p.max_seqlen_k = part.max_seq_len;
  const int64_t H_kv = cache.num_kv_heads();
  if (cache.q_descale) p.q_descale = broadcast_descale(*cache.q_descale, part.num_reqs, H_kv);
  if (is_fp8(cache.dtype)) {
    if (cache.k_scale) p.k_descale = broadcast_descale(*cache.k_scale, part.num_reqs, H_kv);
    if (cache.v_scale) p.v_descale = broadcast_descale(*cache.v_scale, part.num_reqs, H_kv);
  } else if (is_int8(cache.dtype)) {
    p.k_scale_cache = cache.k_scale_cache;
    p.v_scale = cache.v_scale;
  }
  p.cp_world_size = extras.cp_world_size;
  p.cp_rank = extras.cp_rank;
  p.cp_interleave = extras.cp_interleave;
  p.cp_tot_seqused_k = extras.cp_tot_seqused_k;
  const int64_t page = cache.layout == KvLayout::nhd ? cache.k.size(1) : cache.k.size(2);
  varlen_attention(p, with_plan(ctx, plan_for(part, p, H_kv, page)));
}

void self_pass(const Modifiers& m, const Query& q, const TensorRef& key, const TensorRef& value, const Pass& pass,
               const ExecContext& ctx) {
  const PartMetadata& part = *pass.part;
  AttentionParams p = pass_params(m, q, pass);
  const int64_t b = part.token_begin, e = part.token_begin + part.num_tokens;
  p.k = key.slice(0, b, e);
  p.v = value.slice(0, b, e);
  p.cu_seqlens_k = part.cu_seqlens_q;
  p.max_seqlen_k = part.max_query_len;
  varlen_attention(p, with_plan(ctx, plan_for(part, p, key.size(1), 0)));
}

}  // namespace flashserve::backend::layer
