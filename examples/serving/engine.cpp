// The demo's model side (engine.hpp).
#include "engine.hpp"

#include <algorithm>
#include <chrono>

#include "flashserve/cache.hpp"
#include "flashserve/numeric.hpp"
#include "flashserve/status.hpp"

namespace serving {

namespace fs = flashserve;
namespace be = flashserve::backend;

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

int threshold_of(const ModelConfig& c, StepKind kind) {
  switch (kind) {
    case StepKind::verify: return 1 + c.spec_tokens;
    case StepKind::tree: return 1 + kTreeDrafts;
    default: return 1;
  }
}

std::unique_ptr<be::MetadataBuilder> make_builder(const ModelConfig& c, const be::LayerSpec& spec, int threshold,
                                                  const Runtime& rt) {
  be::BuilderConfig b;
  b.layer = spec;
  b.block_size = c.block_size;
  b.reorder_batch_threshold = threshold;
  b.enable_cascade = true;
  b.device = rt.props();
  b.stream = rt.stream();
  b.max_num_reqs = c.max_num_reqs;
  b.max_num_tokens = c.max_num_tokens;
  b.max_blocks_per_req = c.max_blocks_per_req;
  b.max_draft_depth = kTreeDrafts;
  return std::make_unique<be::MetadataBuilder>(b);
}

be::LayerSpec layer_spec(const ModelConfig& c) {
  be::LayerSpec s;
  s.num_heads = c.num_heads;
  s.num_kv_heads = c.num_kv_heads;
  s.head_size = c.head_size;
  s.dtype = c.dtype;
  s.kv_cache_dtype = c.kv_cache_dtype;
  s.type = be::AttnType::decoder;
  return s;
}

// The layer must be served on the runtime's device: an unsupported feature (a dtype, a cache
// dtype) is named here, before anything runs.
void check_supported(const ModelConfig& c, const be::LayerSpec& spec, const Runtime& rt) {
  const std::string why = be::Capabilities::unsupported_reason(spec, c.block_size, rt.props());
  if (!why.empty()) throw fs::NotImplemented(rt.name() + ": " + why);
  if (c.fp8_cache() && c.kv_cache_dtype != fs::KvCacheDType::fp8_e4m3)
    throw fs::NotImplemented("the demo's fp8 cache is fp8_e4m3 only, got " +
                             std::string(fs::kv_cache_dtype_name(c.kv_cache_dtype)));
}

}  // namespace

fs::DType ModelConfig::cache_dtype() const { return fp8_cache() ? fs::DType::f8e4m3 : dtype; }

int64_t ModelConfig::block_bytes_all_layers() const {
  return 2 * int64_t(num_layers) * block_size * num_kv_heads * head_size * int64_t(fs::dtype_size(cache_dtype()));
}

Engine::Engine(const ModelConfig& c, Runtime& rt)
    : cfg_(c), rt_(rt), act_(c.seed, c.num_heads, c.num_kv_heads, c.head_size, c.dtype), spec_(layer_spec(c)),
      layer_(spec_) {
  check_supported(c, spec_, rt);
  decode_builder_ = make_builder(c, spec_, threshold_of(c, StepKind::normal), rt);
  spec_builder_ = make_builder(c, spec_, threshold_of(c, StepKind::verify), rt);
  tree_builder_ = make_builder(c, spec_, threshold_of(c, StepKind::tree), rt);
  for (int l = 0; l < c.num_layers; ++l) {
    key_cache_.push_back(rt.alloc(c.cache_dtype(), {c.num_blocks, c.block_size, c.num_kv_heads, c.head_size}));
    value_cache_.push_back(rt.alloc(c.cache_dtype(), {c.num_blocks, c.block_size, c.num_kv_heads, c.head_size}));
    caches_.push_back(key_cache_.back().ref);
    caches_.push_back(value_cache_.back().ref);
    out_.push_back(rt.alloc(c.dtype, {c.max_num_tokens, c.num_heads, c.head_size}));
  }
  if (c.fp8_cache()) {
    kv_scale_ = rt.alloc(fs::DType::f32, {c.num_kv_heads});
    const std::vector<float> scales(size_t(c.num_kv_heads), c.kv_scale);
    rt.upload(kv_scale_.ref.data, scales.data(), scales.size() * sizeof(float));
  }
  q_ = rt.alloc(c.dtype, {c.max_num_tokens, c.num_heads, c.head_size});
  k_ = rt.alloc(c.dtype, {c.max_num_tokens, c.num_kv_heads, c.head_size});
  v_ = rt.alloc(c.dtype, {c.max_num_tokens, c.num_kv_heads, c.head_size});
  size_t ws = 0;
  for (const auto* b : {decode_builder_.get(), spec_builder_.get(), tree_builder_.get()})
    ws = std::max(ws, layer_.workspace_bytes(b->config()));
  workspace_ = rt.alloc(fs::DType::u8, {int64_t(ws)});
  block_table_ = rt.alloc(fs::DType::i32, {c.max_num_reqs, c.max_blocks_per_req});
  slot_mapping_ = rt.alloc(fs::DType::i64, {c.max_num_tokens});
  copy_mapping_ = rt.alloc(fs::DType::i64, {c.num_blocks, 2});
  token_rows_ = rt.alloc(fs::DType::i64, {c.max_num_tokens, 2});
  host_table_ = HostBuffer(fs::DType::i32, {c.max_num_reqs, c.max_blocks_per_req});
  host_slots_ = HostBuffer(fs::DType::i64, {c.max_num_tokens});
  host_out_ = HostBuffer(c.dtype, {c.max_num_tokens, c.num_heads, c.head_size});
  query_start_.assign(size_t(c.max_num_reqs) + 1, 0);
  seq_lens_.assign(size_t(c.max_num_reqs), 0);
  num_drafts_.assign(size_t(c.max_num_reqs), 0);
  parents_.reserve(size_t(c.max_num_tokens));
  copy_pairs_.reserve(size_t(2 * c.num_blocks));
  rows_.reserve(size_t(c.max_num_tokens));
}

Engine::~Engine() = default;

fs::TensorRef Engine::fetch_out(int layer) {
  const fs::TensorRef& src = out_[size_t(layer)].ref;
  rt_.download(host_out_.ref().data, src.data, size_t(num_tokens_ * src.stride[0]) * fs::dtype_size(src.dtype));
  return host_out_.ref().slice(0, 0, num_tokens_);
}

be::MetadataBuilder& Engine::builder_for(StepKind kind) {
  switch (kind) {
    case StepKind::verify: return *spec_builder_;
    case StepKind::tree: return *tree_builder_;
    default: return *decode_builder_;
  }
}

// Copy-on-write: the (src, dst) pairs go to the runtime, then one copy_blocks over every layer.
void Engine::apply_copies(const StepPlan& plan) {
  if (plan.copies.empty()) return;
  copy_pairs_.clear();
  for (const CowCopy& c : plan.copies) {
    copy_pairs_.push_back(c.src);
    copy_pairs_.push_back(c.dst);
  }
  rt_.upload(copy_mapping_.ref.data, copy_pairs_.data(), copy_pairs_.size() * sizeof(int64_t));
  fs::ExecContext ctx;
  ctx.stream = rt_.stream();
  fs::copy_blocks(caches_, copy_mapping_.ref.slice(0, 0, int64_t(plan.copies.size())), ctx);
}

// Decodes first (backend::reorder_decodes_first), then per request its KV length after the
// step, its block-table row, and the slots and token rows of its query tokens.
void Engine::order_batch(const StepPlan& plan) {
  if (int64_t(plan.entries.size()) > cfg_.max_num_reqs || plan.num_tokens() > cfg_.max_num_tokens)
    throw std::length_error("step larger than the engine's max_num_reqs / max_num_tokens");
  std::vector<int32_t> qlens;
  for (const BatchEntry& e : plan.entries) qlens.push_back(e.query_len);
  const std::vector<int32_t> order = be::reorder_decodes_first(qlens, threshold_of(cfg_, plan.kind));
  const int64_t bs = cfg_.block_size, width = cfg_.max_blocks_per_req;
  auto* table = host_table_.data<int32_t>();
  auto* slots = host_slots_.data<int64_t>();
  batch_.clear();
  parents_.clear();
  rows_.clear();
  int64_t tok = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const BatchEntry& e = plan.entries[size_t(order[i])];
    const BlockList& blocks = e.req->blocks;
    if (int64_t(blocks.size()) > width) throw std::length_error("request longer than max_blocks_per_req");
    batch_.push_back({&e, tok});
    std::copy(blocks.begin(), blocks.end(), table + int64_t(i) * width);
    const TokenOwner owner = TokenOwner::of(e.req->spec);
    for (int64_t t = 0; t < e.query_len; ++t) {
      const int64_t pos = e.first_pos + t;
      slots[tok + t] = int64_t(blocks[size_t(pos / bs)]) * bs + pos % bs;
      rows_.push_back({owner.identity(pos), pos});
    }
    seq_lens_[i] = int32_t(e.first_pos + e.query_len);
    num_drafts_[i] = e.parents.empty() ? 0 : e.num_drafts;
    parents_.insert(parents_.end(), e.parents.begin(), e.parents.end());
    tok += e.query_len;
    query_start_[i + 1] = int32_t(tok);
  }
  num_tokens_ = tok;
}

// The step's block-table rows, slots and token rows into the runtime's buffers.
void Engine::upload_step() {
  const size_t R = batch_.size(), T = size_t(num_tokens_);
  rt_.upload(block_table_.ref.data, host_table_.ref().data, R * size_t(cfg_.max_blocks_per_req) * sizeof(int32_t));
  rt_.upload(slot_mapping_.ref.data, host_slots_.ref().data, T * sizeof(int64_t));
  rt_.upload(token_rows_.ref.data, rows_.data(), T * sizeof(TokenRow));
}

be::CommonMetadata Engine::common_metadata() {
  const int64_t R = int64_t(batch_.size());
  be::CommonMetadata cm;
  cm.num_reqs = R;
  cm.num_actual_tokens = num_tokens_;
  for (int64_t i = 0; i < R; ++i) {
    cm.max_query_len = std::max<int64_t>(cm.max_query_len, query_start_[size_t(i) + 1] - query_start_[size_t(i)]);
    cm.max_seq_len = std::max<int64_t>(cm.max_seq_len, seq_lens_[size_t(i)]);
  }
  cm.query_start_loc = std::span<const int32_t>(query_start_.data(), size_t(R) + 1);
  cm.seq_lens = std::span<const int32_t>(seq_lens_.data(), size_t(R));
  cm.block_table = block_table_.ref.slice(0, 0, R);
  cm.slot_mapping = slot_mapping_.ref.slice(0, 0, num_tokens_);
  cm.causal = true;
  return cm;
}

be::KvCache Engine::cache_of(int layer) const {
  be::KvCache cache{.key_cache = key_cache_[size_t(layer)].ref, .value_cache = value_cache_[size_t(layer)].ref};
  if (cfg_.fp8_cache()) cache.k_scale = cache.v_scale = kv_scale_.ref;
  return cache;
}

// Per layer: q/k/v generated, then the forward; marks 3l .. 3l + 2 time both.
void Engine::run_layers(const be::AttentionMetadata& md, StepStats& st) {
  const be::LayerWorkspace ws{workspace_.ref.data, workspace_.bytes, workspace_.ref.device};
  fs::ExecContext ctx;
  ctx.stream = rt_.stream();
  QkvFill fill{&act_, rows_, static_cast<const TokenRow*>(token_rows_.ref.data), 0, q_.ref, k_.ref, v_.ref};
  for (int l = 0; l < cfg_.num_layers; ++l) {
    fill.layer = l;
    rt_.mark(3 * l);
    rt_.fill_qkv(fill);
    rt_.mark(3 * l + 1);
    const be::KvCache cache = cache_of(l);
    layer_.forward(md, q_.ref, k_.ref, v_.ref, &cache, out_[size_t(l)].ref, ws, ctx);
    rt_.mark(3 * l + 2);
  }
  for (int l = 0; l < cfg_.num_layers; ++l) {
    st.qkv_ms += rt_.elapsed_ms(3 * l, 3 * l + 1);
    st.attention_ms += rt_.elapsed_ms(3 * l + 1, 3 * l + 2);
  }
}

StepStats Engine::run(const StepPlan& plan) {
  StepStats st;
  apply_copies(plan);
  order_batch(plan);
  upload_step();
  const be::CommonMetadata cm = common_metadata();
  const be::DraftTree tree{parents_, std::span<const int32_t>(num_drafts_.data(), batch_.size())};
  const auto t0 = Clock::now();
  const be::AttentionMetadata& md =
      builder_for(plan.kind).build(cm, plan.common_prefix_len, plan.kind == StepKind::tree ? &tree : nullptr);
  st.build_us = ms_since(t0) * 1e3;
  run_layers(md, st);

  st.num_reqs = md.num_reqs;
  st.num_decodes = md.num_decodes;
  st.num_prefills = md.num_prefills;
  st.decode_tokens = md.num_decode_tokens;
  st.prefill_tokens = md.num_prefill_tokens;
  st.tokens = md.num_actual_tokens;
  st.copies = int64_t(plan.copies.size());
  st.cascade_prefix = md.cascade.enabled ? md.cascade.common_prefix_len : 0;
  if (md.cascade.enabled) st.path = "cascade";
  else if (md.tree.enabled) st.path = "tree";
  else if (plan.kind == StepKind::verify) st.path = "verify";
  else if (md.num_prefills == 0) st.path = "decode";
  else if (md.num_decodes == 0) st.path = "prefill";
  else st.path = "mixed";
  return st;
}

// Block e.req->blocks[0] of every layer's K and V caches becomes 4.0 (in an fp8 cache 4 / scale,
// which saturates: still far outside the [-1, 1) of real K/V).
void Engine::corrupt_cache(const BatchEntry& e) {
  const int32_t block = e.req->blocks.at(0);
  const fs::DType cd = cfg_.cache_dtype();
  const HostBuffer fours(cd, {cfg_.block_size * cfg_.num_kv_heads * cfg_.head_size});
  const float value = cfg_.fp8_cache() ? 4.0f / cfg_.kv_scale : 4.0f;
  for (int64_t i = 0; i < fours.ref().numel(); ++i) fs::numeric::store_float(fours.ref().at(i), cd, value);
  const size_t bytes = size_t(fours.ref().numel()) * fs::dtype_size(cd);
  for (const fs::TensorRef& c : caches_) rt_.upload(c.at(block, 0, 0, 0), fours.ref().data, bytes);
}

}  // namespace serving
