// Decode context parallelism (SPEC.md §6; the phases in backend_variants.hpp). Rank r of W
// holds the KV positions t with (t / I) % W == r (common/cp_layout.hpp) and H_local query
// heads. Per layer:
//
//   write_kv                    key/value at md.slot_mapping (this rank's local slots, -1 else)
//   q_all [W, T, H_local, D]    = all_gather(q): slice s holds rank s's heads, i.e. global heads
//                                 s * H_local + j (rank-major)
//   out_all[s], lse_local[s*H_local : (s+1)*H_local, :] = attention(q_all[s], local KV shard)
//                                 (the cp arguments put the queries at their global positions).
//                                 Fused heads (no sinks): q_all copied token-major [T, H, D], one
//                                 call over every head, its output copied back slice-major; with
//                                 sinks one call per slice s, over the KV heads that slice reads
//   lse_all [W, H, T]           = all_gather(lse_local [H, T])
//   out_all[s, t, j] *= exp(lse_all[rank, h, t] - logsumexp_ranks lse_all[:, h, t]),  h = s*H_local + j
//                                 (lse_correct, out_all in its slice-major layout)
//   out [T, H_local, Dv]        = reduce_scatter(out_all): the sum over ranks of slice `rank`,
//                                 in fp32, then converted to out's dtype
//
// The sink of a head enters once: only on the rank that owns the head (slice s == rank).
#include <algorithm>
#include <vector>

#include "common/check.hpp"
#include "backend/layer_ops.hpp"
#include "common/cp_layout.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"

namespace flashserve::backend {

using namespace layer;

namespace {

struct DcpBuffers {
  TensorRef q_all;      // [W, T, H_local, D]
  TensorRef q_tok;      // [T, H, D]: q_all token-major (fused heads)
  TensorRef out_tok;    // fp32 [T, H, Dv] (fused heads)
  TensorRef out_all;    // fp32 [W, T, H_local, Dv]
  TensorRef out_sum;    // fp32 [T, H_local, Dv]: the reduce-scatter's result (out of another dtype)
  TensorRef lse_local;  // fp32 [H, T]
  TensorRef lse_all;    // fp32 [W, H, T]
  LayerWorkspace rest;  // attend's
};

DcpBuffers carve(Carver& ws, const LayerSpec& spec, DType act, int64_t W, int64_t T) {
  const int64_t Hl = spec.num_heads, H = W * Hl, D = spec.head_size, Dv = head_size_v(spec);
  DcpBuffers b;
  b.q_all = ws.take("dcp_q_all", act, {W, T, Hl, D}, DType::f32);
  b.q_tok = ws.take("dcp_q_tok", act, {T, H, D}, DType::f32);
  b.out_tok = ws.take("dcp_out_tok", DType::f32, {T, H, Dv});
  b.out_all = ws.take("dcp_out_all", DType::f32, {W, T, Hl, Dv});
  b.out_sum = ws.take("dcp_out_sum", DType::f32, {T, Hl, Dv});
  b.lse_local = ws.take("dcp_lse_local", DType::f32, {H, T});
  b.lse_all = ws.take("dcp_lse_all", DType::f32, {W, H, T});
  b.rest = ws.rest();
  return b;
}

struct AttendBuffers {
  QueryBuffers query;  // int8 caches: q_all quantized as [W * T, H_local, D]
  void* split = nullptr;
  size_t split_bytes = 0;
};

AttendBuffers carve_attend(Carver& ws, const LayerSpec& spec, int64_t W, int64_t T, size_t split_bytes) {
  AttendBuffers b;
  b.query = take_query_buffers(ws, spec.kv_cache_dtype, W * T, spec.num_heads, spec.head_size);
  b.split = ws.take_bytes("split_kv", split_bytes);
  b.split_bytes = split_bytes;
  return b;
}

// One attention call of slice s: its query heads [j0, j1) (of the slice's H_local) read the KV
// heads [g0, g1) (GQA: global head h reads KV head h / group).
struct HeadRun {
  int64_t j0, j1, g0, g1;
};

// The calls of slice s: one when the slice's heads cover whole KV-head groups or share one KV
// head; else one per KV head the slice touches (e.g. 2 heads per rank, 3 per KV head).
std::vector<HeadRun> head_runs(int64_t s, int64_t Hl, int64_t group) {
  const int64_t h0 = s * Hl, h1 = h0 + Hl;
  if (Hl % group == 0 || (group % Hl == 0)) {
    const int64_t g0 = h0 / group;
    return {HeadRun{0, Hl, g0, g0 + std::max<int64_t>(1, Hl / group)}};
  }
  std::vector<HeadRun> runs;
  for (int64_t h = h0; h < h1;) {
    const int64_t g = h / group, e = std::min(h1, (g + 1) * group);
    runs.push_back(HeadRun{h - h0, e - h0, g, g + 1});
    h = e;
  }
  return runs;
}

void check_spec(const LayerSpec& spec, int W, int rank) {
  const int64_t H = int64_t(W) * spec.num_heads;
  if (W < 1) fail_arg("world_size", ">= 1", W);
  if (rank < 0 || rank >= W) fail_arg("rank", detail::cat("a rank in [0, ", W, ")"), rank);
  if (spec.num_heads < 1) fail_arg("num_heads", ">= 1 (query heads of this rank)", spec.num_heads);
  if (spec.num_kv_heads < 1 || H % spec.num_kv_heads != 0)
    fail_arg("num_kv_heads", detail::cat("a divisor of the gathered head count ", H), spec.num_kv_heads);
  if (spec.type != AttnType::decoder) fail_not_implemented("decode context parallelism for a non-decoder layer");
  if (spec.alibi_slopes || spec.sliding_window > 0 || spec.attention_chunk_size > 0)
    fail_not_implemented("decode context parallelism with ALiBi, a sliding window or chunked local attention");
}

// dst[t, s, :] = src[t, s, :] over [T, W, width] views of any strides (last dim contiguous),
// converting the dtype: merge_states copies the second state raw for rows at or past
// prefill_tokens_with_context (0: every row). `lse` is any fp32 [W, T] view (not read).
void copy_rows(const TensorRef& dst, const TensorRef& src, const TensorRef& lse, const ExecContext& ctx) {
  MergeParams cv;
  cv.out = dst;
  cv.a_out = cv.b_out = src;
  cv.a_lse = cv.b_lse = lse;
  cv.prefill_tokens_with_context = 0;
  merge_states(cv, ctx);
}

// The [T, W, H_local * width] view of a slice-major [W, T, H_local, width] buffer and of a
// token-major [T, W * H_local, width] one: the same (t, s) rows of H_local * width elements.
TensorRef slice_major_rows(void* data, DType t, int64_t W, int64_t T, int64_t row, Device dev) {
  return TensorRef::strided(data, t, {T, W, row}, {row, T * row, 1}, dev);
}
TensorRef token_major_rows(void* data, DType t, int64_t W, int64_t T, int64_t row, Device dev) {
  return TensorRef::strided(data, t, {T, W, row}, {W * row, row, 1}, dev);
}

}  // namespace

DcpAttentionLayer::DcpAttentionLayer(const LayerSpec& local_spec, Communicator& comm)
    : spec_(local_spec), comm_(&comm), world_(comm.world_size()), rank_(comm.rank()) {
  check_spec(spec_, world_, rank_);
}

DcpAttentionLayer::DcpAttentionLayer(const LayerSpec& local_spec, int world_size, int rank)
    : spec_(local_spec), world_(world_size), rank_(rank) {
  check_spec(spec_, world_, rank_);
}

int64_t DcpAttentionLayer::local_len(int64_t global_len, int world, int rank, int64_t interleave) {
  return cp_local_len(global_len, world, rank, interleave);
}
int DcpAttentionLayer::owner(int64_t pos, int world, int64_t interleave) {
  return int(cp_owner(pos, world, interleave));
}
int64_t DcpAttentionLayer::local_index(int64_t pos, int world, int64_t interleave) {
  return cp_local_index(pos, world, interleave);
}

size_t DcpAttentionLayer::attend_workspace_bytes(const BuilderConfig& config) const {
  Carver dry;
  carve_attend(dry, spec_, world_, config.max_num_tokens,
               split_kv_bound(config, world_ * spec_.num_heads, head_size_v(spec_)));
  return dry.used();
}

size_t DcpAttentionLayer::workspace_bytes(const BuilderConfig& config) const {
  Carver dry;
  carve(dry, spec_, spec_.dtype, world_, config.max_num_tokens);
  return dry.used() + attend_workspace_bytes(config);
}

void DcpAttentionLayer::check_md(const AttentionMetadata& md) const {
  if (md.dcp_world_size != world_ || md.dcp_rank != rank_)
    fail_arg("md", detail::cat("metadata of DCP rank ", rank_, " of ", world_, " (a builder with dcp_world_size=", world_,
                               ", dcp_rank=", rank_, ")"),
             detail::cat("rank ", md.dcp_rank, " of ", md.dcp_world_size));
  if (md.cascade.enabled || md.local.enabled || md.tree.enabled)
    fail_not_implemented("decode context parallelism with cascade, chunked local or tree-verify metadata");
}

void DcpAttentionLayer::write_kv(const AttentionMetadata& md, const TensorRef& key, const TensorRef& value,
                                 const KvCache& cache, const ExecContext& ctx) const {
  check_md(md);
  if (md.slot_mapping.ndim == 0) fail_arg("md.slot_mapping", "this rank's slots of the new tokens", "none");
  write_cache(cache, spec_, key, value, md.slot_mapping, ctx);
}

void DcpAttentionLayer::attend(const AttentionMetadata& md, const TensorRef& q_all, const KvCache& cache,
                               const TensorRef& out_all, const TensorRef& lse_local, const LayerWorkspace& ws,
                               const ExecContext& ctx) const {
  check_md(md);
  const int64_t W = world_, T = md.num_actual_tokens, Hl = spec_.num_heads, H = W * Hl;
  const int64_t group = H / spec_.num_kv_heads, D = spec_.head_size, Dv = head_size_v(spec_);
  // Slice-major [W, T, H_local, D] (as gathered): a call per slice. Token-major [T, H, D]: one
  // call over every head (global head h reads KV head h / group), no sinks.
  const bool fused = q_all.ndim == 3;
  const int64_t tdim = fused ? 0 : 1;
  if (fused) {
    detail::check_dim(q_all, "q_all", 1, H, "world_size x num_heads (token-major [T, H, D])");
    detail::check_dim(q_all, "q_all", 2, D, "head_size");
    detail::check_rank(out_all, "out_all", 3);
    detail::check_dim(out_all, "out_all", 1, H, "world_size x num_heads (token-major [T, H, Dv])");
    detail::check_dim(out_all, "out_all", 2, Dv, "head_size_v");
    if (spec_.sinks)
      fail_not_implemented("sinks with token-major queries (a sink enters only its rank's heads): pass q_all as "
                           "[W, T, H_local, D]");
  } else {
    detail::check_rank(q_all, "q_all", 4);
    detail::check_dim(q_all, "q_all", 0, W, "world_size");
    detail::check_dim(q_all, "q_all", 2, Hl, "num_heads of this rank");
    detail::check_dim(q_all, "q_all", 3, D, "head_size");
    detail::check_rank(out_all, "out_all", 4);
    detail::check_dim(out_all, "out_all", 0, W, "world_size");
    detail::check_dim(out_all, "out_all", 2, Hl, "num_heads of this rank");
    detail::check_dim(out_all, "out_all", 3, Dv, "head_size_v");
  }
  detail::check_rank(lse_local, "lse_local", 2);
  detail::check_dim(lse_local, "lse_local", 0, H, "world_size x num_heads");
  if (out_all.dtype != DType::f32) fail_arg("out_all", "fp32", dtype_name(out_all.dtype));
  if (lse_local.dtype != DType::f32) fail_arg("lse_local", "fp32", dtype_name(lse_local.dtype));
  if (q_all.size(tdim) < T || out_all.size(tdim) < T || lse_local.size(1) < T)
    fail_arg(q_all.size(tdim) < T ? "q_all" : out_all.size(tdim) < T ? "out_all" : "lse_local",
             detail::cat("at least num_actual_tokens=", T, " tokens"),
             (q_all.size(tdim) < T ? q_all : out_all.size(tdim) < T ? out_all : lse_local).shape_str());

  const size_t split_bytes = std::max(md.decode.plan.workspace.total_bytes, md.prefill.plan.workspace.total_bytes);
  Carver carver(ws);
  const AttendBuffers buf = carve_attend(carver, spec_, W, T, split_bytes);
  ExecContext base = ctx;
  base.workspace = buf.split;
  base.workspace_bytes = buf.split_bytes;
  base.plan = nullptr;

  const CacheView view = cache_view(cache, spec_);
  const Modifiers m = modifiers_of(spec_);
  const auto passes = [&](const Modifiers& mr, const Query& qr, const CacheView& kv, const TensorRef& o,
                          const TensorRef& lse, bool sink) {
    for (const PartMetadata* part : {&md.decode, &md.prefill}) {
      if (part->empty()) continue;
      PassExtras extras;
      if (part->cp_tot_seqused_k.ndim > 0) {
        extras = PassExtras{int(W), rank_, md.dcp_interleave, part->cp_tot_seqused_k};
      } else if (W > 1) {
        fail_arg("cp_tot_seqused_k", "the part's global KV lengths (metadata of a DCP builder)", "none");
      }
      paged_pass(mr, qr, kv, Pass{part, part->causal, sink, o, lse}, base, extras);
    }
  };
  if (fused) {
    QueryBuffers qb;  // the [W * T, H_local] buffers hold [T, H] alike
    if (buf.query.q8) qb.q8 = TensorRef::contiguous(buf.query.q8->data, buf.query.q8->dtype, {T, H, D}, q_all.device);
    if (buf.query.scale)
      qb.scale = TensorRef::contiguous(buf.query.scale->data, buf.query.scale->dtype, {T, H}, q_all.device);
    passes(m, prepare_query(q_all, T, qb, base), view, out_all, lse_local, false);
    return;
  }
  for (int64_t s = 0; s < W; ++s) {
    QueryBuffers qb;
    if (buf.query.q8) qb.q8 = buf.query.q8->slice(0, s * T, (s + 1) * T);
    if (buf.query.scale) qb.scale = buf.query.scale->slice(0, s * T, (s + 1) * T);
    const Query qs = prepare_query(q_all.select(0, s), T, qb, base);
    for (const HeadRun& run : head_runs(s, Hl, group)) {
      const CacheView kv = slice_kv_heads(view, run.g0, run.g1);
      const bool whole = run.j0 == 0 && run.j1 == Hl;
      Query qr = qs;
      Modifiers mr = m;
      if (!whole) {
        qr.q = qs.q.slice(1, run.j0, run.j1);
        if (qs.q_scale) qr.q_scale = qs.q_scale->slice(1, run.j0, run.j1);
        if (m.sinks) mr.sinks = m.sinks->slice(0, run.j0, run.j1);
      }
      passes(mr, qr, kv, out_all.select(0, s).slice(1, run.j0, run.j1),
             lse_local.slice(0, s * Hl + run.j0, s * Hl + run.j1), s == rank_);
    }
  }
}

void DcpAttentionLayer::correct(const TensorRef& out_all, const TensorRef& lse_all, const ExecContext& ctx) const {
  LseCorrectParams lc;
  lc.out = out_all;
  lc.lse_all = lse_all;
  lc.rank = rank_;
  lse_correct(lc, ctx);
}

void DcpAttentionLayer::forward(const AttentionMetadata& md, const TensorRef& q, const OptTensor& key,
                                const OptTensor& value, const KvCache& cache, const TensorRef& out,
                                const LayerWorkspace& ws, const ExecContext& ctx) const {
  if (comm_ == nullptr)
    fail_arg("communicator", "a DcpAttentionLayer made with a Communicator (forward runs the collectives)",
             "a phases-only layer");
  check_md(md);
  const int64_t W = world_, T = md.num_actual_tokens, Hl = spec_.num_heads;
  detail::check_rank(q, "q", 3);
  detail::check_dim(q, "q", 1, Hl, "num_heads of this rank");
  detail::check_dim(q, "q", 2, spec_.head_size, "head_size");
  detail::check_rank(out, "out", 3);
  detail::check_dim(out, "out", 1, Hl, "num_heads of this rank");
  detail::check_dim(out, "out", 2, head_size_v(spec_), "head_size_v");
  if (q.size(0) < T || out.size(0) < T)
    fail_arg(q.size(0) < T ? "q" : "out", detail::cat("at least num_actual_tokens=", T, " rows"),
             (q.size(0) < T ? q : out).shape_str());
  if (q.dtype != spec_.dtype && !is_fp8(spec_.kv_cache_dtype))
    fail_arg("q", detail::cat(dtype_name(spec_.dtype), " (the spec's dtype)"), dtype_name(q.dtype));

  Carver carver(ws);
  const DcpBuffers buf = carve(carver, spec_, q.dtype, W, T);
  const bool write = spec_.writes_kv_cache && key && value;
  // Fused heads (no sinks, 16/32-bit q): one attention call over every gathered head, q_all and out moved
  // between the slice-major layout of the collectives and the token-major one of the call by
  // strided copies (merge_states' raw copy); with sinks, one call per rank's slice.
  const bool fused = !spec_.sinks.has_value() && (q.dtype == DType::bf16 || q.dtype == DType::f16 ||
                                                    q.dtype == DType::f32);
  const int64_t D = spec_.head_size, Dv = head_size_v(spec_);
  const Device dev = q.device;
  const TensorRef lse_rows = buf.lse_all.select(0, 0).slice(0, 0, W);  // [W, T], never read
  const TensorRef q_from = slice_major_rows(buf.q_all.data, q.dtype, W, T, Hl * D, dev);
  const TensorRef q_to = token_major_rows(buf.q_tok.data, q.dtype, W, T, Hl * D, dev);
  const TensorRef o_from = token_major_rows(buf.out_tok.data, DType::f32, W, T, Hl * Dv, dev);
  const TensorRef o_to = slice_major_rows(buf.out_all.data, DType::f32, W, T, Hl * Dv, dev);
  const TensorRef& q_call = fused ? buf.q_tok : buf.q_all;
  const TensorRef& o_call = fused ? buf.out_tok : buf.out_all;
  const bool direct = out.dtype == DType::f32 && out.slice(0, 0, T).is_contiguous();
  const auto convert_out = [&](const ExecContext& c) {
    MergeParams cv;
    cv.out = out.slice(0, 0, T);
    cv.a_out = cv.b_out = buf.out_sum;
    cv.a_lse = cv.b_lse = buf.lse_local.slice(0, 0, Hl);
    cv.prefill_tokens_with_context = 0;
    merge_states(cv, c);
  };

  // Every call is checked (dry run) before the cache is written and before the first
  // collective: a rejected forward writes nothing and leaves the group in step.
  ExecContext dry = ctx;
  dry.validate_only = true;
  if (write) write_kv(md, *key, *value, cache, dry);
  if (fused) copy_rows(q_to, q_from, lse_rows, dry);
  attend(md, q_call, cache, o_call, buf.lse_local, buf.rest, dry);
  if (fused) copy_rows(o_to, o_from, lse_rows, dry);
  if (!direct) convert_out(dry);

  if (write) write_kv(md, *key, *value, cache, ctx);
  comm_->all_gather(q.slice(0, 0, T), buf.q_all, ctx.stream);
  if (fused) copy_rows(q_to, q_from, lse_rows, ctx);
  attend(md, q_call, cache, o_call, buf.lse_local, buf.rest, ctx);
  comm_->all_gather(buf.lse_local, buf.lse_all, ctx.stream);
  correct(o_call, buf.lse_all, ctx);
  if (fused) copy_rows(o_to, o_from, lse_rows, ctx);
  if (direct) {
    comm_->reduce_scatter(buf.out_all, out.slice(0, 0, T), ctx.stream);
    return;
  }
  // The sum in fp32, then out's dtype.
  comm_->reduce_scatter(buf.out_all, buf.out_sum, ctx.stream);
  convert_out(ctx);
}

}  // namespace flashserve::backend
