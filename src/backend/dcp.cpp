// Decode context parallelism (SPEC.md §6). Rank r of W holds KV tokens r, r + W, ... of every
// sequence and H_local query heads. Per layer:
//
//   q_all [W, T, H_local, D]    = all_gather(q): slice s holds rank s's heads, i.e. global heads
//                                 s * H_local + j (rank-major)
//   out_all[s], lse_local[s*H_local : (s+1)*H_local, :] = attention(q_all[s], local KV shard)
//                                 (one call per slice s, over the KV heads that slice reads)
//   lse_all [W, H, T]           = all_gather(lse_local [H, T])
//   out_all[s, t, j] *= exp(lse_all[rank, h, t] - logsumexp_ranks lse_all[:, h, t]),  h = s*H_local + j
//                                 (lse_correct, out_all in its slice-major layout)
//   out [T, H_local, Dv]        = reduce_scatter(out_all): the sum over ranks of slice `rank`
//
// The sink of a head enters once: only on the rank that owns the head (slice s == rank).
#include <algorithm>

#include "api/check.hpp"
#include "backend/layer_ops.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"

namespace flashserve::backend {

using namespace layer;

namespace {


struct DcpBuffers {
  TensorRef q_all;      // [W, T, H_local, D]
  TensorRef out_all;    // [W, T, H_local, Dv]
  TensorRef lse_local;  // fp32 [H, T]
  TensorRef lse_all;    // fp32 [W, H, T]
  QueryBuffers query;   // int8 caches: q_all quantized as [W * T, H_local, D]
  void* split = nullptr;
  size_t split_bytes = 0;
};

DcpBuffers carve(Carver& ws, const LayerSpec& spec, DType act, int64_t W, int64_t T, size_t split_bytes) {
  const int64_t Hl = spec.num_heads, H = W * Hl, D = spec.head_size, Dv = head_size_v(spec);
  DcpBuffers b;
  b.q_all = ws.take("dcp_q_all", act, {W, T, Hl, D}, DType::f32);
  b.out_all = ws.take("dcp_out_all", DType::f32, {W, T, Hl, Dv});
  b.lse_local = ws.take("dcp_lse_local", DType::f32, {H, T});
  b.lse_all = ws.take("dcp_lse_all", DType::f32, {W, H, T});
  b.query = take_query_buffers(ws, spec.kv_cache_dtype, W * T, Hl, D);
  b.split = ws.take_bytes("split_kv", split_bytes);
  b.split_bytes = split_bytes;
  return b;
}

// The KV heads [begin, end) that the query heads of slice s read (GQA: head h reads h / group).
void slice_kv_range(int64_t s, int64_t Hl, int64_t group, int64_t& begin, int64_t& end) {
  if (Hl % group != 0 && group % Hl != 0)
    fail_not_implemented("decode context parallelism with ", Hl, " query heads per rank and ", group,
                         " query heads per KV head (one must divide the other)");
  begin = s * Hl / group;
  end = begin + std::max<int64_t>(1, Hl / group);
}

}  // namespace

DcpAttentionLayer::DcpAttentionLayer(const LayerSpec& local_spec, Communicator& comm)
    : spec_(local_spec), comm_(&comm) {
  const int64_t W = comm.world_size(), H = W * spec_.num_heads;
  if (spec_.num_heads < 1) fail_arg("num_heads", ">= 1 (query heads of this rank)", spec_.num_heads);
  if (spec_.num_kv_heads < 1 || H % spec_.num_kv_heads != 0)
    fail_arg("num_kv_heads", detail::cat("a divisor of the gathered head count ", H), spec_.num_kv_heads);
  if (spec_.type != AttnType::decoder) fail_not_implemented("decode context parallelism for a non-decoder layer");
  if (spec_.alibi_slopes || spec_.sliding_window > 0 || spec_.attention_chunk_size > 0)
    fail_not_implemented("decode context parallelism with ALiBi, a sliding window or chunked local attention");
  int64_t b, e;
  slice_kv_range(0, spec_.num_heads, H / spec_.num_kv_heads, b, e);
}

size_t DcpAttentionLayer::workspace_bytes(const BuilderConfig& config) const {
  Carver dry;
  carve(dry, spec_, spec_.dtype, comm_->world_size(), config.max_num_tokens,
        split_kv_bound(config, spec_.num_heads, head_size_v(spec_)));
  return dry.used();
}

void DcpAttentionLayer::forward(const AttentionMetadata& md, const TensorRef& q, const KvCache& cache,
                                const TensorRef& out, const LayerWorkspace& ws, const ExecContext& ctx) const {
  const int64_t W = comm_->world_size(), rank = comm_->rank(), T = md.num_actual_tokens;
  const int64_t Hl = spec_.num_heads, group = W * Hl / spec_.num_kv_heads;
  detail::check_rank(q, "q", 3);
  detail::check_dim(q, "q", 1, Hl, "num_heads of this rank");
  detail::check_dim(q, "q", 2, spec_.head_size, "head_size");
  detail::check_rank(out, "out", 3);
  detail::check_dim(out, "out", 1, Hl, "num_heads of this rank");
  detail::check_dim(out, "out", 2, head_size_v(spec_), "head_size_v");
  if (q.size(0) < T || out.size(0) < T)
    fail_arg(q.size(0) < T ? "q" : "out", detail::cat("at least num_actual_tokens=", T, " rows"),
             (q.size(0) < T ? q : out).shape_str());
  if (md.cascade.enabled || md.local.enabled || md.tree.enabled)
    fail_not_implemented("decode context parallelism with cascade, chunked local or tree-verify metadata");

  size_t split_bytes = std::max(md.decode.plan.workspace.total_bytes, md.prefill.plan.workspace.total_bytes);
  Carver carver(ws);
  const DcpBuffers buf = carve(carver, spec_, q.dtype, W, T, split_bytes);
  ExecContext base = ctx;
  base.workspace = buf.split;
  base.workspace_bytes = buf.split_bytes;
  base.plan = nullptr;

  comm_->all_gather(q.slice(0, 0, T), buf.q_all);
  const Query all = prepare_query(
      TensorRef::contiguous(buf.q_all.data, buf.q_all.dtype, {W * T, Hl, spec_.head_size}, buf.q_all.device), W * T,
      buf.query, base);
  const CacheView view = cache_view(cache, spec_);
  const Modifiers m = modifiers_of(spec_);
  for (int64_t s = 0; s < W; ++s) {
    int64_t g0, g1;
    slice_kv_range(s, Hl, group, g0, g1);
    const CacheView kv = slice_kv_heads(view, g0, g1);
    Query qs{all.q.slice(0, s * T, (s + 1) * T), std::nullopt};
    if (all.q_scale) qs.q_scale = all.q_scale->slice(0, s * T, (s + 1) * T);
    const TensorRef lse = buf.lse_local.slice(0, s * Hl, (s + 1) * Hl);
    for (const PartMetadata* part : {&md.decode, &md.prefill}) {
      if (part->empty()) continue;
      PassExtras extras;
      if (part->cp_tot_seqused_k.ndim > 0) {
        extras = PassExtras{int(W), int(rank), part->cp_tot_seqused_k};
      } else if (W > 1 && part->max_query_len > 1) {
        fail_arg("cp_tot_seqused_k", "the part's global KV lengths (query_len > 1 under decode context parallelism)",
                 "none");
      }
      paged_pass(m, qs, kv, Pass{part, part->causal, s == rank, buf.out_all.select(0, s), lse}, base, extras);
    }
  }
  comm_->all_gather(buf.lse_local.slice(1, 0, T), buf.lse_all);
  LseCorrectParams lc;
  lc.out = buf.out_all;
  lc.lse_all = buf.lse_all;
  lc.rank = rank;
  lse_correct(lc, base);
  comm_->reduce_scatter(buf.out_all, out.slice(0, 0, T));
}

}  // namespace flashserve::backend
