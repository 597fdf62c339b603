// Composing the metadata of a validated batch (builder_state.hpp): each mode writes its parts'
// buffers in place and points the part views at them (or at the engine's block table).
#include <algorithm>

#include "backend/builder_state.hpp"
#include "backend/layer_ops.hpp"
#include "flashserve/backend_variants.hpp"
#include "planner/local_batches.hpp"

namespace flashserve::backend::builder {

namespace {

TensorRef vec1(int32_t* p, int64_t n) { return TensorRef::contiguous(p, DType::i32, {n}); }

// A part that runs nothing: its views still point at its own buffers (fixed pointers).
PartMetadata idle(PartBuffers& b) {
  PartMetadata p;
  p.cu_seqlens_q = vec1(b.cu.data(), 1);
  p.seqused_k = vec1(b.seqused.data(), 0);
  return p;
}

// The split-KV plan of a part: the config's fixed split count or the heuristic's, capped at
// max_num_splits.
Plan part_plan(const BuilderConfig& c, const PartMetadata& p, int64_t page_size, bool local) {
  ProblemShape s;
  s.batch = p.num_reqs;
  s.max_seqlen_q = p.max_query_len;
  s.max_seqlen_k = p.max_seq_len;
  s.num_heads = call_heads(c);
  s.num_kv_heads = c.layer.num_kv_heads;
  s.head_dim = c.layer.head_size;
  s.head_dim_v = layer::head_size_v(c.layer);
  s.total_q = p.num_tokens;
  s.page_size = page_size;
  s.causal = p.causal;
  s.local = local;
  s.kv_8bit = c.layer.kv_cache_dtype != KvCacheDType::auto_;
  if (c.batch_invariant) {
    // A part holding a query longer than the decode threshold is planned (and called) as the
    // prefill class, whatever its longest query: pass_params takes the plan's bound.
    s.batch_invariant = true;
    if (p.max_query_len > c.reorder_batch_threshold)
      s.max_seqlen_q = std::max<int64_t>(p.max_query_len, kBatchInvariantDecodeMaxQ + 1);
    return make_plan(s, c.device, c.num_splits);
  }
  if (c.num_splits > 0) return make_plan(s, c.device, std::min(c.num_splits, c.max_num_splits));
  Plan plan = make_plan(s, c.device, 0);
  if (plan.num_splits > c.max_num_splits) plan = make_plan(s, c.device, c.max_num_splits);
  return plan;
}

// Requests [r0, r0 + n) of the batch: cu_seqlens_q relative to their first token, seqused_k[i]
// = kv(r0 + i). An empty range gives the idle part.
template <class KvLen>
PartMetadata requests_part(PartBuffers& b, std::span<const int32_t> qsl, int64_t r0, int64_t n, KvLen kv) {
  PartMetadata p = idle(b);
  if (n == 0) return p;
  p.req_begin = r0;
  p.num_reqs = n;
  p.token_begin = qsl[size_t(r0)];
  p.num_tokens = qsl[size_t(r0 + n)] - p.token_begin;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t q = qsl[size_t(r0 + i + 1)] - qsl[size_t(r0 + i)];
    b.cu[size_t(i) + 1] = int32_t(qsl[size_t(r0 + i + 1)] - p.token_begin);
    b.seqused[size_t(i)] = int32_t(kv(r0 + i));
    p.max_query_len = std::max<int64_t>(p.max_query_len, q);
    p.max_seq_len = std::max<int64_t>(p.max_seq_len, b.seqused[size_t(i)]);
  }
  p.cu_seqlens_q = vec1(b.cu.data(), n + 1);
  p.seqused_k = vec1(b.seqused.data(), n);
  return p;
}

bool windowed(const BuilderConfig& c) { return !layer_window(c.layer).unbounded(); }

// ---- modes

void compose_split(State& s) {
  const BuilderConfig& c = s.config;
  const Inputs& in = s.in;
  const bool cross = c.layer.type == AttnType::encoder_decoder;
  const auto kv = [&](int64_t r) {
    return cross ? int64_t(in.encoder_seq_lens[size_t(r)]) : kv_len_on_rank(c, in.seq_lens[size_t(r)]);
  };
  const int64_t nd = s.decision.num_decodes;
  const struct { PartBuffers* buf; PartMetadata* md; int64_t r0, n; } parts[] = {
      {&s.decode, &s.md.decode, 0, nd}, {&s.prefill, &s.md.prefill, nd, in.num_reqs - nd}};
  for (const auto& x : parts) {
    PartMetadata p = requests_part(*x.buf, in.query_start(), x.r0, x.n, kv);
    if (x.n > 0) {
      p.block_table = in.block_table.slice(0, x.r0, x.r0 + x.n);
      p.causal = cross ? false : in.causal;
      if (c.dcp_world_size > 1) {
        for (int64_t i = 0; i < x.n; ++i) x.buf->seqused_global[size_t(i)] = in.seq_lens[size_t(x.r0 + i)];
        p.cp_tot_seqused_k = vec1(x.buf->seqused_global.data(), x.n);
      }
      p.plan = part_plan(c, p, c.block_size, windowed(c));
    }
    *x.md = p;
  }
}

void compose_cascade(State& s) {
  const BuilderConfig& c = s.config;
  const Inputs& in = s.in;
  const int64_t P = s.decision.prefix_len, pb = P / c.block_size, T = in.num_tokens;
  CascadeMetadata& cm = s.md.cascade;
  cm.enabled = true;
  cm.common_prefix_len = P;

  PartMetadata pre = idle(s.cascade_prefix);
  s.cascade_prefix.cu[1] = int32_t(T);
  s.cascade_prefix.seqused[0] = int32_t(P);
  pre.num_reqs = 1;
  pre.num_tokens = pre.max_query_len = T;
  pre.max_seq_len = P;
  pre.cu_seqlens_q = vec1(s.cascade_prefix.cu.data(), 2);
  pre.seqused_k = vec1(s.cascade_prefix.seqused.data(), 1);
  pre.block_table = in.block_table.slice(0, 0, 1).slice(1, 0, pb);
  pre.causal = false;
  pre.plan = part_plan(c, pre, c.block_size, false);
  cm.prefix = pre;

  const auto suffix_len = [&](int64_t r) { return int64_t(in.seq_lens[size_t(r)]) - P; };
  PartMetadata suf = requests_part(s.cascade_suffix, in.query_start(), 0, in.num_reqs, suffix_len);
  suf.block_table = in.block_table.slice(0, 0, in.num_reqs).slice(1, pb, in.block_table.size(1));
  suf.causal = in.causal;
  suf.plan = part_plan(c, suf, c.block_size, false);
  cm.suffix = suf;
}

void compose_local(State& s) {
  const BuilderConfig& c = s.config;
  const Inputs& in = s.in;
  PartBuffers& b = s.local;
  const int64_t V = planner::make_local_virtual_batch(
      in.query_start(), in.seqs(), c.layer.attention_chunk_size,
      {b.cu, b.seqused, s.local_k_start, s.local_request});
  const TensorRef& t = in.block_table;
  if (!in.on_device)  // CUDA metadata: publish gathers from the device table
    planner::gather_local_block_table({static_cast<const int32_t*>(t.data), t.size(0), t.size(1), t.stride[0]},
                                      c.block_size, s.local_k_start, s.local_request, V, s.local_table, s.local_width);
  PartMetadata p = idle(b);
  p.num_reqs = V;
  p.num_tokens = in.num_tokens;
  for (int64_t v = 0; v < V; ++v) {
    p.max_query_len = std::max<int64_t>(p.max_query_len, b.cu[size_t(v) + 1] - b.cu[size_t(v)]);
    p.max_seq_len = std::max<int64_t>(p.max_seq_len, b.seqused[size_t(v)]);
  }
  p.cu_seqlens_q = vec1(b.cu.data(), V + 1);
  p.seqused_k = vec1(b.seqused.data(), V);
  p.block_table = TensorRef::strided(s.local_table.data(), DType::i32, {V, s.local_width}, {s.local_width, 1});
  p.causal = true;
  p.plan = part_plan(c, p, c.block_size, false);
  s.md.local.enabled = true;
  s.md.local.part = p;
}

// KV position of query token t of request r.
int64_t token_pos(const Inputs& in, int64_t r, int64_t t) {
  const int64_t q = in.query_start_loc[size_t(r) + 1] - in.query_start_loc[size_t(r)];
  return in.seq_lens[size_t(r)] - q + (t - in.query_start_loc[size_t(r)]);
}

// Slot of query token t of request r (host metadata): the engine's slot_mapping, or its
// position through the block table after update_block_table.
int64_t token_slot(const State& s, int64_t r, int64_t t) {
  const Inputs& in = s.in;
  if (!in.tree_slots_from_table) return *static_cast<const int64_t*>(in.slot_mapping.at(t));
  const int64_t pos = token_pos(in, r, t), bs = s.config.block_size;
  return int64_t(table_at(in.block_table, r, pos / bs)) * bs + pos % bs;
}

// Row `row` [W] of the tree's slot table: the slots of path[0..len) of request r, zeros after.
// CUDA metadata stages (request, position) pairs instead; publish() resolves them on the device
// through the engine's block table (the same slots slot_mapping holds).
void tree_row(State& s, int64_t r, int64_t row, const int64_t* path, int64_t len) {
  const int64_t W = s.config.max_draft_depth;
  int32_t* slots = s.tree_table.data() + row * W;
  int32_t* src = s.tree_src.data() + 2 * row * W;
  for (int64_t k = 0; k < W; ++k) {
    slots[k] = 0;
    if (s.in.on_device) {
      src[2 * k] = k < len ? int32_t(r) : -1;
      src[2 * k + 1] = k < len ? int32_t(token_pos(s.in, r, path[k])) : 0;
    } else if (k < len) {
      slots[k] = int32_t(token_slot(s, r, path[k]));
    }
  }
}

void compose_tree(State& s) {
  const BuilderConfig& c = s.config;
  const Inputs& in = s.in;
  const auto committed = [&](int64_t r) { return int64_t(in.seq_lens[size_t(r)]) - in.num_drafts[size_t(r)]; };
  PartMetadata pre = requests_part(s.tree_prefix, in.query_start(), 0, in.num_reqs, committed);
  if (pre.num_reqs > 0) {
    pre.block_table = in.block_table.slice(0, 0, in.num_reqs);
    pre.causal = false;
    pre.plan = part_plan(c, pre, c.block_size, false);
  }

  // One request per query token; a draft's KV is its path from the root draft to itself.
  const int64_t T = in.num_tokens, W = c.max_draft_depth;
  PartBuffers& b = s.tree;
  PartMetadata tr = idle(b);
  for (int64_t r = 0; r < in.num_reqs; ++r) {
    for (int64_t t = in.query_start_loc[size_t(r)]; t < in.query_start_loc[size_t(r) + 1]; ++t) {
      int64_t len = 0;
      for (int64_t u = t; u >= 0 && in.tree_parent[size_t(u)] != -2; u = in.tree_parent[size_t(u)]) ++len;
      int64_t* path = s.tree_path.data();  // root draft first
      for (int64_t u = t, k = len; k > 0; u = in.tree_parent[size_t(u)]) path[--k] = u;
      tree_row(s, r, t, path, len);
      b.cu[size_t(t) + 1] = int32_t(t + 1);
      b.seqused[size_t(t)] = int32_t(len);
      tr.max_seq_len = std::max(tr.max_seq_len, len);
    }
  }
  if (T > 0) {
    tr.num_reqs = tr.num_tokens = T;
    tr.max_query_len = 1;
    tr.cu_seqlens_q = vec1(b.cu.data(), T + 1);
    tr.seqused_k = vec1(b.seqused.data(), T);
    tr.block_table = TensorRef::strided(s.tree_table.data(), DType::i32, {T, W}, {W, 1});
    tr.causal = false;
    tr.plan = part_plan(c, tr, 1, false);
  }
  s.md.tree.enabled = true;
  s.md.tree.prefix = pre;
  s.md.tree.tree = tr;
}

void compose_encoder(State& s) {
  const Inputs& in = s.in;
  const auto qlen = [&](int64_t r) {
    return int64_t(in.query_start_loc[size_t(r) + 1]) - in.query_start_loc[size_t(r)];
  };
  PartMetadata p = requests_part(s.prefill, in.query_start(), 0, in.num_reqs, qlen);
  if (p.num_reqs > 0) {
    p.causal = false;
    p.plan = part_plan(s.config, p, 0, windowed(s.config));
  }
  s.md.prefill = p;
}

}  // namespace

int64_t kv_len_on_rank(const BuilderConfig& c, int64_t global_len) {
  return c.dcp_world_size > 1 ? DcpAttentionLayer::local_len(global_len, c.dcp_world_size, c.dcp_rank, c.dcp_interleave)
                              : global_len;
}

int64_t call_heads(const BuilderConfig& c) { return c.layer.num_heads * c.dcp_world_size; }

void compose(State& s) {
  const Inputs& in = s.in;
  AttentionMetadata& md = s.md;
  const Decision& d = s.decision;
  md = AttentionMetadata{};
  md.dcp_world_size = s.config.dcp_world_size;
  md.dcp_rank = s.config.dcp_rank;
  md.dcp_interleave = s.config.dcp_interleave;
  md.num_actual_tokens = in.num_tokens;
  md.num_reqs = in.num_reqs;
  md.num_decodes = d.num_decodes;
  md.num_decode_tokens = in.query_start_loc[size_t(d.num_decodes)];
  md.num_prefills = in.num_reqs - d.num_decodes;
  md.num_prefill_tokens = in.num_tokens - md.num_decode_tokens;
  // Cross-attention writes the encoder's tokens (all of slot_mapping), not the decoder's queries.
  const bool cross = s.config.layer.type == AttnType::encoder_decoder;
  md.slot_mapping = in.slot_mapping.ndim == 0 ? TensorRef{}
                    : cross                   ? in.slot_mapping
                                              : in.slot_mapping.slice(0, 0, in.num_tokens);
  md.decode = idle(s.decode);
  md.prefill = idle(s.prefill);
  md.cascade.prefix = idle(s.cascade_prefix);
  md.cascade.suffix = idle(s.cascade_suffix);
  md.local.part = idle(s.local);
  md.tree.prefix = idle(s.tree_prefix);
  md.tree.tree = idle(s.tree);
  switch (d.mode) {
    case Mode::split: compose_split(s); break;
    case Mode::cascade: compose_cascade(s); break;
    case Mode::local: compose_local(s); break;
    case Mode::tree: compose_tree(s); break;
    case Mode::encoder: compose_encoder(s); break;
  }
}

}  // namespace flashserve::backend::builder
