// The demo's model side (engine.hpp).
#include "engine.hpp"

#include <algorithm>
#include <chrono>

#include "flashserve/cache.hpp"
#include "flashserve/numeric.hpp"

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

std::unique_ptr<be::MetadataBuilder> make_builder(const ModelConfig& c, const be::LayerSpec& spec, int threshold) {
  be::BuilderConfig b;
  b.layer = spec;
  b.block_size = c.block_size;
  b.reorder_batch_threshold = threshold;
  b.enable_cascade = true;
  b.device = fs::DeviceProps::cpu();
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
  s.type = be::AttnType::decoder;
  return s;
}

}  // namespace

Engine::Engine(const ModelConfig& c)
    : cfg_(c),
      act_(c.seed, c.num_heads, c.num_kv_heads, c.head_size, c.dtype),
      spec_(layer_spec(c)),
      layer_(spec_) {
  decode_builder_ = make_builder(c, spec_, threshold_of(c, StepKind::normal));
  spec_builder_ = make_builder(c, spec_, threshold_of(c, StepKind::verify));
  tree_builder_ = make_builder(c, spec_, threshold_of(c, StepKind::tree));
  for (int l = 0; l < c.num_layers; ++l) {
    key_cache_.emplace_back(c.dtype, std::initializer_list<int64_t>{c.num_blocks, c.block_size, c.num_kv_heads, c.head_size});
    value_cache_.emplace_back(c.dtype, std::initializer_list<int64_t>{c.num_blocks, c.block_size, c.num_kv_heads, c.head_size});
    out_.emplace_back(c.dtype, std::initializer_list<int64_t>{c.max_num_tokens, c.num_heads, c.head_size});
  }
  q_ = HostBuffer(c.dtype, {c.max_num_tokens, c.num_heads, c.head_size});
  k_ = HostBuffer(c.dtype, {c.max_num_tokens, c.num_kv_heads, c.head_size});
  v_ = HostBuffer(c.dtype, {c.max_num_tokens, c.num_kv_heads, c.head_size});
  size_t ws = 0;
  for (const auto* b : {decode_builder_.get(), spec_builder_.get(), tree_builder_.get()})
    ws = std::max(ws, layer_.workspace_bytes(b->config()));
  workspace_ = HostBuffer(fs::DType::u8, {int64_t(ws)});
  block_table_ = HostBuffer(fs::DType::i32, {c.max_num_reqs, c.max_blocks_per_req});
  slot_mapping_ = HostBuffer(fs::DType::i64, {c.max_num_tokens});
  query_start_.assign(size_t(c.max_num_reqs) + 1, 0);
  seq_lens_.assign(size_t(c.max_num_reqs), 0);
  num_drafts_.assign(size_t(c.max_num_reqs), 0);
  parents_.reserve(size_t(c.max_num_tokens));
  copy_pairs_.reserve(size_t(2 * c.num_blocks));
}

Engine::~Engine() = default;

fs::TensorRef Engine::out(int layer) const { return out_[size_t(layer)].ref().slice(0, 0, num_tokens_); }

be::MetadataBuilder& Engine::builder_for(StepKind kind) {
  switch (kind) {
    case StepKind::verify: return *spec_builder_;
    case StepKind::tree: return *tree_builder_;
    default: return *decode_builder_;
  }
}

void Engine::apply_copies(const StepPlan& plan) {
  if (plan.copies.empty()) return;
  copy_pairs_.clear();
  for (const CowCopy& c : plan.copies) {
    copy_pairs_.push_back(c.src);
    copy_pairs_.push_back(c.dst);
  }
  std::vector<fs::TensorRef> caches;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    caches.push_back(key_cache_[size_t(l)].ref());
    caches.push_back(value_cache_[size_t(l)].ref());
  }
  const auto mapping = fs::TensorRef::contiguous(copy_pairs_.data(), fs::DType::i64, {int64_t(plan.copies.size()), 2});
  fs::copy_blocks(caches, mapping);
}

// Decodes first (backend::reorder_decodes_first), then per request its KV length after the
// step, its block-table row and the slots of its query tokens.
void Engine::order_batch(const StepPlan& plan) {
  if (int64_t(plan.entries.size()) > cfg_.max_num_reqs || plan.num_tokens() > cfg_.max_num_tokens)
    throw std::length_error("step larger than the engine's max_num_reqs / max_num_tokens");
  std::vector<int32_t> qlens;
  for (const BatchEntry& e : plan.entries) qlens.push_back(e.query_len);
  const std::vector<int32_t> order = be::reorder_decodes_first(qlens, threshold_of(cfg_, plan.kind));
  const int64_t bs = cfg_.block_size, width = cfg_.max_blocks_per_req;
  auto* table = block_table_.data<int32_t>();
  auto* slots = slot_mapping_.data<int64_t>();
  batch_.clear();
  parents_.clear();
  int64_t tok = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const BatchEntry& e = plan.entries[size_t(order[i])];
    const BlockList& blocks = e.req->blocks;
    if (int64_t(blocks.size()) > width) throw std::length_error("request longer than max_blocks_per_req");
    batch_.push_back({&e, tok});
    std::copy(blocks.begin(), blocks.end(), table + int64_t(i) * width);
    for (int64_t t = 0; t < e.query_len; ++t) {
      const int64_t pos = e.first_pos + t;
      slots[tok + t] = int64_t(blocks[size_t(pos / bs)]) * bs + pos % bs;
    }
    seq_lens_[i] = int32_t(e.first_pos + e.query_len);
    num_drafts_[i] = e.parents.empty() ? 0 : e.num_drafts;
    parents_.insert(parents_.end(), e.parents.begin(), e.parents.end());
    tok += e.query_len;
    query_start_[i + 1] = int32_t(tok);
  }
  num_tokens_ = tok;
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
  cm.block_table = block_table_.ref().slice(0, 0, R);
  cm.slot_mapping = slot_mapping_.ref().slice(0, 0, num_tokens_);
  cm.causal = true;
  return cm;
}

void Engine::fill_qkv(int layer) {
  for (const OrderedEntry& o : batch_) {
    const TokenOwner owner = TokenOwner::of(o.entry->req->spec);
    for (int64_t t = 0; t < o.entry->query_len; ++t) {
      const int64_t row = o.token_begin + t, pos = o.entry->first_pos + t;
      act_.fill(Operand::q, owner, pos, layer, q_.ref(), row);
      act_.fill(Operand::k, owner, pos, layer, k_.ref(), row);
      act_.fill(Operand::v, owner, pos, layer, v_.ref(), row);
    }
  }
}

StepStats Engine::run(const StepPlan& plan) {
  StepStats st;
  apply_copies(plan);
  order_batch(plan);
  const be::CommonMetadata cm = common_metadata();
  const be::DraftTree tree{parents_, std::span<const int32_t>(num_drafts_.data(), batch_.size())};
  auto t0 = Clock::now();
  const be::AttentionMetadata& md =
      builder_for(plan.kind).build(cm, plan.common_prefix_len, plan.kind == StepKind::tree ? &tree : nullptr);
  st.build_us = ms_since(t0) * 1e3;

  const be::LayerWorkspace ws{workspace_.ref().data, workspace_.bytes(), {}};
  for (int l = 0; l < cfg_.num_layers; ++l) {
    t0 = Clock::now();
    fill_qkv(l);
    st.host_ms += ms_since(t0);
    const be::KvCache cache{key_cache_[size_t(l)].ref(), value_cache_[size_t(l)].ref(), {}, {}, {}};
    t0 = Clock::now();
    layer_.forward(md, q_.ref(), k_.ref(), v_.ref(), &cache, out_[size_t(l)].ref(), ws);
    st.attention_ms += ms_since(t0);
  }

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

void Engine::corrupt_cache(const BatchEntry& e) {
  const int32_t block = e.req->blocks.at(0);
  for (const auto* caches : {&key_cache_, &value_cache_})
    for (const HostBuffer& c : *caches) {
      const fs::TensorRef& t = c.ref();
      for (int64_t s = 0; s < t.size(1); ++s)
        for (int64_t h = 0; h < t.size(2); ++h)
          for (int64_t d = 0; d < t.size(3); ++d) fs::numeric::store_float(t.at(block, s, h, d), t.dtype, 4.0f);
    }
}

}  // namespace serving
