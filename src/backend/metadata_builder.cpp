// MetadataBuilder (backend.hpp): validates the engine's common metadata, decides how the batch
// is attended (split / cascade / local / tree / encoder) and composes the metadata into fixed
// buffers (builder_compose.cpp). Every check runs before any buffer is written, so a rejected
// build leaves the last metadata intact.
//
// Host arrays: query_start_loc, seq_lens, encoder_seq_lens are read from the spans; the engine's
// block_table is referenced by the parts (row slices, column offsets).
//
// Host metadata (the engine's block_table / slot_mapping on the CPU): the table is also read on
// the host for the cascade prefix check, the local virtual table and advance_decode_step.
// CUDA metadata (CUDA tensors, a CUDA config and a CUDA build; builder_device.cpp): the builder
// still computes on the host, then uploads its buffers with one async copy on config.stream and
// the parts' own views point into its device copy; the local virtual table is gathered on the
// device; the cascade prefix is the scheduler's word (checking it would read the device table);
// the slots of tree verify's draft paths and of advance_decode_step's new tokens are computed on
// the device from (request, position) pairs through the engine's block table.
//
// Speculative tree verify (build with a DraftTree): every request has at most one non-draft
// query token (query_len - num_drafts <= 1: the committed tip), because the committed-prefix
// pass is non-causal: causal attention among several new non-draft tokens cannot share that
// pass. The tree pass reads the cache through a block-size-1 view (slot = block * block_size +
// offset): its block table holds slots, so the caller passes that view of the cache.
#include <algorithm>

#include "common/check.hpp"
#include "common/cp_layout.hpp"
#include "backend/builder_state.hpp"
#include "backend/layer_ops.hpp"
#include "planner/local_batches.hpp"

namespace flashserve::backend {

using builder::Decision;
using builder::Inputs;
using builder::Mode;
using builder::State;
using detail::cat;

namespace builder {

namespace {

int64_t local_capacity_of(const BuilderConfig& c) {
  const int64_t chunk = c.layer.attention_chunk_size;
  if (chunk <= 0) return 0;
  // A request of q queries touches at most q / chunk + 2 chunks, and each virtual request
  // holds at least one query.
  return std::min(c.max_num_tokens, 2 * c.max_num_reqs + c.max_num_tokens / chunk + 1);
}

void check_config(const BuilderConfig& c) {
  const LayerSpec& l = c.layer;
  if (c.block_size < 1) fail_arg("block_size", ">= 1", c.block_size);
  if (c.max_num_reqs < 1) fail_arg("max_num_reqs", ">= 1", c.max_num_reqs);
  if (c.max_num_tokens < 1) fail_arg("max_num_tokens", ">= 1", c.max_num_tokens);
  if (c.max_blocks_per_req < 1) fail_arg("max_blocks_per_req", ">= 1", c.max_blocks_per_req);
  if (c.max_draft_depth < 1) fail_arg("max_draft_depth", ">= 1", c.max_draft_depth);
  if (c.max_num_splits < 1 || c.max_num_splits > kMaxSplits)
    fail_arg("max_num_splits", cat("a count in [1, ", kMaxSplits, "]"), c.max_num_splits);
  if (c.num_splits < 0 || c.num_splits > kMaxSplits)
    fail_arg("num_splits", cat("0 (heuristic) or a count in [1, ", kMaxSplits, "]"), c.num_splits);
  if (c.reorder_batch_threshold < 0) fail_arg("reorder_batch_threshold", ">= 0", c.reorder_batch_threshold);
  if (c.batch_invariant && c.num_splits > 1)
    fail_arg("num_splits", "0 (fixed-size splits) or 1 (none) with batch_invariant", c.num_splits);
  if (c.batch_invariant && c.reorder_batch_threshold > kBatchInvariantDecodeMaxQ)
    fail_arg("reorder_batch_threshold", cat("<= ", kBatchInvariantDecodeMaxQ, " with batch_invariant (decode class)"),
             c.reorder_batch_threshold);
  if (c.dcp_world_size < 1) fail_arg("dcp_world_size", ">= 1", c.dcp_world_size);
  if (c.dcp_rank < 0 || c.dcp_rank >= c.dcp_world_size)
    fail_arg("dcp_rank", cat("a rank in [0, ", c.dcp_world_size, ")"), c.dcp_rank);
  if (c.dcp_interleave < 1) fail_arg("dcp_interleave", ">= 1", c.dcp_interleave);
  if (l.num_heads < 1) fail_arg("num_heads", ">= 1", l.num_heads);
  // Under DCP the layer spec is per rank: the KV heads divide the heads of all ranks.
  const int64_t all_heads = l.num_heads * c.dcp_world_size;
  if (l.num_kv_heads < 1 || all_heads % l.num_kv_heads != 0)
    fail_arg("num_kv_heads", cat("a divisor of num_heads x dcp_world_size = ", all_heads), l.num_kv_heads);
  if (l.head_size < 1) fail_arg("head_size", ">= 1", l.head_size);
  if (c.dcp_world_size > 1 && l.type != AttnType::decoder)
    fail_not_implemented("decode context parallelism for a non-decoder layer");
  if (l.attention_chunk_size > 0) {
    if (l.attention_chunk_size % c.block_size != 0)
      fail_arg("attention_chunk_size", cat("a multiple of block_size ", c.block_size), l.attention_chunk_size);
    if (l.type != AttnType::decoder) fail_not_implemented("chunked local attention for a non-decoder layer");
    if (l.sliding_window > 0) fail_not_implemented("chunked local attention with a sliding window");
    if (c.dcp_world_size > 1) fail_not_implemented("chunked local attention with decode context parallelism");
  }
}

const BuilderConfig& checked(const BuilderConfig& c) {
  check_config(c);
  return c;
}

int64_t local_width_of(const BuilderConfig& c) {
  return local_capacity_of(c) ? std::min(c.layer.attention_chunk_size / c.block_size, c.max_blocks_per_req) : 0;
}

// Elements of every buffer State carves from its arena.
size_t arena_elems(const BuilderConfig& c) {
  const int64_t L = local_capacity_of(c);
  const size_t R = size_t(c.max_num_reqs), tree_entries = size_t(c.max_num_tokens * c.max_draft_depth);
  return 4 * PartBuffers::elems(c.max_num_reqs) + PartBuffers::elems(1) + 2 * R + PartBuffers::elems(L) +
         size_t(L) * (2 + size_t(local_width_of(c))) + PartBuffers::elems(c.max_num_tokens) + 3 * tree_entries +
         2 * R + 1;
}

}  // namespace

State::State(const BuilderConfig& c)
    : config(checked(c)),
      local_capacity(local_capacity_of(c)),
      local_width(local_width_of(c)),
      arena(arena_elems(c), arena_on_device(c) ? c.device.device : Device{}) {
  const size_t R = size_t(c.max_num_reqs), T = size_t(c.max_num_tokens);
  decode = PartBuffers::take(arena, c.max_num_reqs);
  prefill = PartBuffers::take(arena, c.max_num_reqs);
  cascade_prefix = PartBuffers::take(arena, 1);
  cascade_suffix = PartBuffers::take(arena, c.max_num_reqs);
  advance_src = arena.take(2 * R);
  local = PartBuffers::take(arena, local_capacity);
  local_k_start = arena.take(size_t(local_capacity));
  local_request = arena.take(size_t(local_capacity));
  local_table = arena.take(size_t(local_capacity * local_width));
  tree_prefix = PartBuffers::take(arena, c.max_num_reqs);
  tree = PartBuffers::take(arena, c.max_num_tokens);
  tree_src = arena.take(2 * T * size_t(c.max_draft_depth));
  tree_table = arena.take(T * size_t(c.max_draft_depth));
  if ((arena.used() & 1) != 0) arena.take(1);  // int64 alignment
  advance_slots = arena.take(2 * R);
  tree_depth.assign(T, 0);
  tree_path.assign(size_t(c.max_draft_depth), 0);
  query_lens.assign(R, 0);
  slots.assign(R, 0);
  in.query_start_loc.assign(R + 1, 0);
  in.seq_lens.assign(R, 0);
  in.encoder_seq_lens.assign(R, 0);
  in.num_drafts.assign(R, 0);
  in.tree_parent.assign(T, -2);
}

}  // namespace builder

// ---------------------------------------------------------------- validation

namespace {

bool is_encoder(const LayerSpec& l) { return l.type == AttnType::encoder || l.type == AttnType::encoder_only; }

// An engine tensor the metadata references: host, or (CUDA metadata) on the config's device.
void check_meta_tensor(const BuilderConfig& c, const TensorRef& t, const char* arg, DType dtype, int ndim) {
  detail::check_rank(t, arg, ndim);
  detail::check_dtype(t, arg, {dtype});
  if (t.device.type == DeviceType::cuda) {
    if (!builder::arena_on_device(c))
      fail_not_implemented("the metadata builder with a CUDA ", arg,
                           FLASHSERVE_WITH_CUDA ? " and a CPU BuilderConfig::device (CUDA metadata needs a CUDA config)"
                                                : " (this build has no CUDA: FLASHSERVE_WITH_CUDA=0)");
    if (t.device != c.device.device)
      fail_arg(arg, cat("a tensor on the config's device ", to_string(c.device.device)), to_string(t.device));
  }
  detail::check_non_negative_strides(t, arg);
  detail::check_data(t, arg);
}

int64_t qlen(std::span<const int32_t> qsl, int64_t r) { return int64_t(qsl[size_t(r) + 1]) - qsl[size_t(r)]; }

// query_start_loc: R + 1 entries from 0, non-decreasing, ending at num_actual_tokens.
void check_queries(const BuilderConfig& c, const CommonMetadata& cm) {
  const int64_t R = cm.num_reqs, T = cm.num_actual_tokens;
  if (R < 0 || R > c.max_num_reqs) fail_arg("num_reqs", cat("a count in [0, max_num_reqs ", c.max_num_reqs, "]"), R);
  if (T < 0 || T > c.max_num_tokens)
    fail_arg("num_actual_tokens", cat("a count in [0, max_num_tokens ", c.max_num_tokens, "]"), T);
  const auto& qsl = cm.query_start_loc;
  if (int64_t(qsl.size()) < R + 1)
    fail_arg("query_start_loc", cat(R + 1, " entries (num_reqs + 1)"), cat(qsl.size(), " entries"));
  if (qsl[0] != 0) fail_arg("query_start_loc", "query_start_loc[0] == 0", qsl[0]);
  int64_t max_q = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (qlen(qsl, r) < 0)
      fail_arg("query_start_loc", "non-decreasing entries", cat("query_start_loc[", r + 1, "]=", qsl[size_t(r) + 1],
                                                               " < query_start_loc[", r, "]=", qsl[size_t(r)]));
    max_q = std::max(max_q, qlen(qsl, r));
  }
  if (qsl[size_t(R)] != T) fail_arg("query_start_loc", cat("a last entry == num_actual_tokens ", T), qsl[size_t(R)]);
  if (cm.max_query_len < max_q) fail_arg("max_query_len", cat(">= ", max_q, " (the longest query)"), cm.max_query_len);
}

// Requests with query_len <= threshold first (reorder_decodes_first); returns their count.
int64_t check_order(const BuilderConfig& c, const CommonMetadata& cm) {
  const int64_t R = cm.num_reqs, thr = c.reorder_batch_threshold;
  int64_t nd = 0;
  while (nd < R && qlen(cm.query_start_loc, nd) <= thr) ++nd;
  for (int64_t r = nd; r < R; ++r)
    if (qlen(cm.query_start_loc, r) <= thr)
      fail_arg("query_start_loc", cat("requests with query_len <= ", thr, " first (see reorder_decodes_first)"),
               cat("request ", r, " (query_len ", qlen(cm.query_start_loc, r), ") after request ", nd, " (query_len ",
                   qlen(cm.query_start_loc, nd), ")"));
  return nd;
}

// KV lengths: the builder's capacity and the engine's block table.
void check_kv_lengths(const BuilderConfig& c, const CommonMetadata& cm) {
  const bool cross = c.layer.type == AttnType::encoder_decoder;
  const char* arg = cross ? "encoder_seq_lens" : "seq_lens";
  const std::span<const int32_t> lens = cross ? cm.encoder_seq_lens : cm.seq_lens;
  const int64_t R = cm.num_reqs;
  if (int64_t(lens.size()) < R) fail_arg(arg, cat(R, " entries (num_reqs)"), cat(lens.size(), " entries"));
  const int64_t cap = c.max_blocks_per_req * c.block_size, table_cap = cm.block_table.size(1) * c.block_size;
  int64_t max_len = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = lens[size_t(r)], q = qlen(cm.query_start_loc, r);
    if (!cross && len < q)
      fail_arg(arg, cat(">= the query length ", q, " of request ", r), cat(arg, "[", r, "]=", len));
    if (len < 0) fail_arg(arg, "lengths >= 0", cat(arg, "[", r, "]=", len));
    if (builder::kv_len_on_rank(c, len) > cap)
      fail_arg(arg, cat("KV lengths (on this DCP rank) <= max_blocks_per_req * block_size = ", cap),
               cat(arg, "[", r, "]=", len));
    if (builder::kv_len_on_rank(c, len) > table_cap)
      fail_arg(arg,
               cat("KV lengths within the block table (", cm.block_table.size(1), " blocks of ", c.block_size, ")"),
               cat(arg, "[", r, "]=", len));
    max_len = std::max(max_len, len);
  }
  if (!cross && cm.max_seq_len < max_len)
    fail_arg("max_seq_len", cat(">= ", max_len, " (the longest sequence)"), cm.max_seq_len);
}

// Checks the common metadata; returns whether the metadata goes to the device: the engine's
// block_table is CUDA (encoder layers, which have none: their optional slot_mapping is CUDA).
bool check_common(const BuilderConfig& c, const CommonMetadata& cm) {
  check_queries(c, cm);
  const bool encoder = is_encoder(c.layer);
  if (!encoder) {
    check_meta_tensor(c, cm.block_table, "block_table", DType::i32, 2);
    detail::check_last_contiguous(cm.block_table, "block_table");
    if (cm.block_table.size(0) < cm.num_reqs)
      fail_arg("block_table", cat(">= ", cm.num_reqs, " rows (num_reqs)"), cm.block_table.shape_str());
    check_kv_lengths(c, cm);
    check_order(c, cm);
  }
  if (c.layer.type == AttnType::decoder || cm.slot_mapping.ndim > 0) {
    check_meta_tensor(c, cm.slot_mapping, "slot_mapping", DType::i64, 1);
    if (cm.slot_mapping.size(0) < cm.num_actual_tokens)
      fail_arg("slot_mapping", cat(">= ", cm.num_actual_tokens, " entries (num_actual_tokens)"),
               cm.slot_mapping.shape_str());
  }
  if (encoder && cm.slot_mapping.ndim == 0) return false;
  const TensorRef& lead = encoder ? cm.slot_mapping : cm.block_table;
  const bool on_device = lead.device.type == DeviceType::cuda;
  if (!encoder && cm.slot_mapping.ndim > 0 && cm.slot_mapping.device != lead.device)
    fail_arg("slot_mapping", cat("a tensor on block_table's device ", to_string(lead.device)),
             to_string(cm.slot_mapping.device));
  return on_device;
}

// Every row's first `blocks` blocks equal row 0's (the cascade prefix is shared).
// A table on the device is the scheduler's word (reading it would sync): not checked.
void check_shared_prefix(const TensorRef& table, int64_t num_reqs, int64_t blocks) {
  if (table.device.type == DeviceType::cuda) return;
  for (int64_t r = 1; r < num_reqs; ++r)
    for (int64_t j = 0; j < blocks; ++j)
      if (builder::table_at(table, r, j) != builder::table_at(table, 0, j))
        fail_arg("common_prefix_len", cat("the first ", blocks, " blocks shared by every block_table row"),
                 cat("block_table[", r, "][", j, "]=", builder::table_at(table, r, j), " != block_table[0][", j,
                     "]=", builder::table_at(table, 0, j)));
}

void check_tree_layer(const BuilderConfig& c) {
  const LayerSpec& l = c.layer;
  if (l.type != AttnType::decoder) fail_not_implemented("speculative tree verify for a non-decoder layer");
  if (l.sliding_window > 0) fail_not_implemented("speculative tree verify with a sliding window");
  if (l.attention_chunk_size > 0) fail_not_implemented("speculative tree verify with chunked local attention");
  if (l.alibi_slopes) fail_not_implemented("speculative tree verify with ALiBi");
  if (c.dcp_world_size > 1) fail_not_implemented("speculative tree verify with decode context parallelism");
}

// Drafts per request (the last num_drafts query tokens, at most one other), parents within
// the request's earlier drafts, paths within max_draft_depth, slots within int32.
void check_tree(State& s, const CommonMetadata& cm, const DraftTree& tree) {
  check_tree_layer(s.config);
  const int64_t R = cm.num_reqs;
  if (int64_t(tree.num_drafts.size()) != R)
    fail_arg("num_drafts", cat(R, " entries (num_reqs)"), cat(tree.num_drafts.size(), " entries"));
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nd = tree.num_drafts[size_t(r)], q = qlen(cm.query_start_loc, r);
    if (nd < 0 || nd > q) fail_arg("num_drafts", cat("a count in [0, ", q, "] (query_len of request ", r, ")"), nd);
    if (q - nd > 1)
      fail_arg("num_drafts", "at most one non-draft query token per request (query_len - num_drafts <= 1)",
               cat("request ", r, " with query_len ", q, " and ", nd, " drafts"));
    total += nd;
  }
  if (int64_t(tree.parents.size()) != total)
    fail_arg("parents", cat(total, " entries (the sum of num_drafts)"), cat(tree.parents.size(), " entries"));
  for (int64_t r = 0, k = 0; r < R; ++r) {
    const int64_t nd = tree.num_drafts[size_t(r)], first = cm.query_start_loc[size_t(r) + 1] - nd;
    for (int64_t d = 0; d < nd; ++d, ++k) {
      const int64_t p = tree.parents[size_t(k)];
      if (p < -1 || p >= d) fail_arg("parents", cat("a parent in [-1, ", d, ") for draft ", d, " of request ", r), p);
      const int32_t depth = s.tree_depth[size_t(k)] = p < 0 ? 1 : s.tree_depth[size_t(k - d + p)] + 1;
      if (depth > s.config.max_draft_depth)
        fail_arg("max_draft_depth", cat(">= ", depth, " (a draft path of request ", r, ")"), s.config.max_draft_depth);
      // Device slots are resolved on the device (publish): out-of-range ones are bad slots.
      if (cm.slot_mapping.device.type == DeviceType::cuda) continue;
      const int64_t slot = detail::read_index(cm.slot_mapping, first + d);
      if (slot < 0 || slot > INT32_MAX)
        fail_arg("slot_mapping", "draft slots in [0, 2^31)", cat("slot_mapping[", first + d, "]=", slot));
    }
  }
}

// How the batch is attended. Reads the inputs only (and scratch buffers).
Decision decide(State& s, const CommonMetadata& cm, int64_t common_prefix_len, const DraftTree* tree) {
  const BuilderConfig& c = s.config;
  Decision d;
  if (is_encoder(c.layer)) {
    if (tree) fail_not_implemented("speculative tree verify for an encoder layer");
    d.mode = Mode::encoder;
    return d;
  }
  d.num_decodes = check_order(c, cm);
  if (common_prefix_len < 0) fail_arg("common_prefix_len", ">= 0", common_prefix_len);
  if (tree) {
    check_tree(s, cm, *tree);
    d.mode = Mode::tree;
    return d;
  }
  const std::span<const int32_t> qsl = cm.query_start_loc.first(size_t(cm.num_reqs) + 1);
  const std::span<const int32_t> seqs = cm.seq_lens.first(size_t(cm.num_reqs));
  if (c.layer.attention_chunk_size > 0) {
    d.num_virtual = planner::count_local_virtual_requests(qsl, seqs, c.layer.attention_chunk_size);
    if (d.num_virtual > s.local_capacity)
      fail_arg("num_actual_tokens", cat("a batch of at most ", s.local_capacity, " virtual requests"), d.num_virtual);
    d.mode = Mode::local;
    return d;
  }
  if (!c.enable_cascade || c.batch_invariant || c.layer.type != AttnType::decoder || cm.num_reqs == 0 || cm.num_actual_tokens == 0)
    return d;
  // The prefix must be context of every request (its new tokens attend causally), in whole blocks.
  int64_t prefix = common_prefix_len;
  for (int64_t r = 0; r < cm.num_reqs; ++r) {
    prefix = std::min<int64_t>(prefix, seqs[size_t(r)] - qlen(qsl, r));
    s.query_lens[size_t(r)] = int32_t(qlen(qsl, r));
  }
  prefix = prefix / c.block_size * c.block_size;
  const std::span<const int32_t> qlens(s.query_lens.data(), size_t(cm.num_reqs));
  if (!use_cascade(prefix, qlens, c.layer, c.dcp_world_size, c.device)) return d;
  check_shared_prefix(cm.block_table, cm.num_reqs, prefix / c.block_size);
  d.mode = Mode::cascade;
  d.prefix_len = prefix;
  return d;
}

void store_inputs(State& s, const CommonMetadata& cm, int64_t common_prefix_len, const DraftTree* tree,
                  bool on_device) {
  Inputs& in = s.in;
  const size_t R = size_t(cm.num_reqs);
  in.valid = true;
  in.on_device = on_device;
  in.num_reqs = cm.num_reqs;
  in.num_tokens = cm.num_actual_tokens;
  std::copy_n(cm.query_start_loc.begin(), R + 1, in.query_start_loc.begin());
  if (cm.seq_lens.size() >= R) std::copy_n(cm.seq_lens.begin(), R, in.seq_lens.begin());
  if (cm.encoder_seq_lens.size() >= R) std::copy_n(cm.encoder_seq_lens.begin(), R, in.encoder_seq_lens.begin());
  in.block_table = cm.block_table;
  in.slot_mapping = cm.slot_mapping;
  in.causal = cm.causal;
  in.common_prefix_len = common_prefix_len;
  in.tree_slots_from_table = false;
  if (!tree) return;
  for (size_t r = 0, k = 0; r < R; ++r) {
    const int32_t nd = in.num_drafts[r] = tree->num_drafts[r];
    const int32_t first = in.query_start_loc[r + 1] - nd;
    for (int32_t t = in.query_start_loc[r]; t < first; ++t) in.tree_parent[size_t(t)] = -2;
    for (int32_t d = 0; d < nd; ++d, ++k) {
      const int32_t p = tree->parents[k];
      in.tree_parent[size_t(first + d)] = p < 0 ? -1 : first + p;
    }
  }
}

// Rewrites the metadata from the stored inputs and decision (and uploads it: CUDA metadata).
void recompose(State& s) {
  builder::wait_upload(s);
  builder::compose(s);
  builder::publish(s);
}

}  // namespace

// ---------------------------------------------------------------- MetadataBuilder

struct MetadataBuilder::State : builder::State {
  using builder::State::State;
};

MetadataBuilder::MetadataBuilder(const BuilderConfig& config) : state_(new State(config)) {}

MetadataBuilder::~MetadataBuilder() { delete state_; }

const BuilderConfig& MetadataBuilder::config() const { return state_->config; }

const AttentionMetadata& MetadataBuilder::build(const CommonMetadata& common, int64_t common_prefix_len,
                                                const DraftTree* tree) {
  State& s = *state_;
  const bool on_device = check_common(s.config, common);
  const Decision d = decide(s, common, common_prefix_len, tree);
  store_inputs(s, common, common_prefix_len, tree, on_device);
  s.decision = d;
  recompose(s);
  return s.md;
}

const AttentionMetadata& MetadataBuilder::update_block_table(const TensorRef& block_table) {
  State& s = *state_;
  if (!s.in.valid) fail_arg("block_table", "a build before update_block_table", "none");
  if (s.decision.mode == Mode::encoder)
    fail_arg("block_table", "a layer with a KV cache", "an encoder layer's metadata (no block table)");
  check_meta_tensor(s.config, block_table, "block_table", DType::i32, 2);
  detail::check_last_contiguous(block_table, "block_table");
  const TensorRef& old = s.in.block_table;
  if (block_table.device != old.device)
    fail_arg("block_table", cat("a table on ", to_string(old.device), " (that of the built metadata)"),
             to_string(block_table.device));
  if (block_table.size(0) != old.size(0) || block_table.size(1) != old.size(1))
    fail_arg("block_table", cat("shape ", old.shape_str(), " (that of the built metadata)"), block_table.shape_str());
  if (s.decision.mode == Mode::cascade)
    check_shared_prefix(block_table, s.in.num_reqs, s.decision.prefix_len / s.config.block_size);
  s.in.block_table = block_table;
  s.in.tree_slots_from_table = s.decision.mode == Mode::tree;
  recompose(s);
  return s.md;
}

const AttentionMetadata& MetadataBuilder::advance_decode_step() {
  State& s = *state_;
  const BuilderConfig& c = s.config;
  Inputs& in = s.in;
  const bool decodable = in.valid && c.layer.type == AttnType::decoder && s.decision.mode != Mode::tree;
  if (!decodable)
    fail_arg("advance_decode_step", "a last build of a decoder layer without a draft tree",
             in.valid ? "another build" : "no build");
  for (int64_t r = 0; r < in.num_reqs; ++r)
    if (qlen(in.query_start(), r) != 1)
      fail_arg("advance_decode_step", "a decode-only last build (every query_len 1)",
               cat("request ", r, " with query_len ", qlen(in.query_start(), r)));
  const int64_t cap = c.max_blocks_per_req * c.block_size, table_cap = in.block_table.size(1) * c.block_size;
  for (int64_t r = 0; r < in.num_reqs; ++r) {
    const int64_t len = int64_t(in.seq_lens[size_t(r)]) + 1;
    if (builder::kv_len_on_rank(c, len) > std::min(cap, table_cap))
      fail_arg("seq_lens", cat("room for one more token (max_blocks_per_req * block_size = ", cap, ", block_table ",
                               in.block_table.shape_str(), ")"),
               cat("seq_lens[", r, "]=", len - 1));
  }
  for (int32_t& len : std::span(in.seq_lens.data(), size_t(in.num_reqs))) ++len;
  CommonMetadata cm;
  cm.num_reqs = in.num_reqs;
  cm.num_actual_tokens = in.num_tokens;
  cm.query_start_loc = in.query_start();
  cm.seq_lens = in.seqs();
  cm.block_table = in.block_table;
  cm.slot_mapping = in.slot_mapping;
  cm.causal = in.causal;
  Decision d;
  try {
    d = decide(s, cm, in.common_prefix_len, nullptr);
  } catch (...) {
    for (int32_t& len : std::span(in.seq_lens.data(), size_t(in.num_reqs))) --len;
    throw;
  }
  // The new token of request r is at position seq_len - 1; with DCP only this rank's tokens
  // (common/cp_layout.hpp: (position / interleave) % world == rank) get a slot, the others -1. CUDA metadata: (request, local
  // position) pairs, resolved through the device block table after the upload (publish).
  builder::wait_upload(s);  // advance_src is staging
  for (int64_t r = 0; r < in.num_reqs; ++r) {
    const int64_t pos = int64_t(in.seq_lens[size_t(r)]) - 1;
    const int64_t w = c.dcp_world_size, bs = c.block_size, local = cp_local_index(pos, w, c.dcp_interleave);
    const bool mine = cp_owner(pos, w, c.dcp_interleave) == c.dcp_rank;
    s.advance_src[2 * size_t(r)] = mine ? int32_t(r) : -1;
    s.advance_src[2 * size_t(r) + 1] = int32_t(local);
    if (!in.on_device)
      s.slots[size_t(r)] = mine ? int64_t(builder::table_at(in.block_table, r, local / bs)) * bs + local % bs : -1;
  }
  in.slot_mapping = in.on_device ? TensorRef::contiguous(builder::advance_slots_device(s), DType::i64, {in.num_reqs},
                                                         in.block_table.device)
                                 : TensorRef::contiguous(s.slots.data(), DType::i64, {in.num_reqs});
  s.advance_pending = in.on_device;
  s.decision = d;
  recompose(s);
  return s.md;
}

size_t MetadataBuilder::max_workspace_bytes() const {
  const BuilderConfig& c = state_->config;
  DeviceProps dev = c.device;
  if (dev.device.type != DeviceType::cuda) {
    dev = DeviceProps::h200();
    dev.device = Device{DeviceType::cuda, 0};
  }
  // Any part's call: at most max_num_splits splits of every token's heads, and never more
  // partial rows than a plan on the device holds (max_split_rows).
  return split_workspace(layer::split_partial_rows(c, builder::call_heads(c), dev), layer::head_size_v(c.layer))
      .total_bytes;
}

}  // namespace flashserve::backend
