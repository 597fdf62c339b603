// The model side of the demo: a stack of attention layers over one paged KV cache per layer,
// driven through the backend layer exactly as an engine would: per step, copy-on-write block
// copies, the decodes-first reorder, the common metadata (query_start_loc, seq_lens, block
// table, slot mapping) and one MetadataBuilder::build; per layer, AttentionLayer::forward
// (which writes the step's K/V into the cache, then attends).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "activations.hpp"
#include "flashserve/backend.hpp"
#include "host_buffer.hpp"
#include "scheduler.hpp"

namespace serving {

struct ModelConfig {
  uint64_t seed = 1;
  int num_layers = 2;
  int64_t num_heads = 8, num_kv_heads = 2, head_size = 64;
  flashserve::DType dtype = flashserve::DType::bf16;
  int32_t block_size = 16;
  int32_t num_blocks = 2048;
  int64_t max_num_reqs = 64;
  int64_t max_num_tokens = 512;
  int64_t max_blocks_per_req = 160;
  int spec_tokens = 3;  // drafts of linear verify steps: their builder's reorder threshold is 1 + k
};

struct StepStats {
  std::string path;  // decode | prefill | mixed | cascade | verify | tree
  int64_t num_reqs = 0, num_decodes = 0, num_prefills = 0;
  int64_t decode_tokens = 0, prefill_tokens = 0, tokens = 0;
  int64_t cascade_prefix = 0;  // tokens of the shared-prefix pass (cascade path)
  int64_t copies = 0;          // copy-on-write blocks
  double build_us = 0, attention_ms = 0, host_ms = 0;  // host_ms: generating q/k/v
};

// The step's batch in the order the attention saw it (decodes first).
struct OrderedEntry {
  const BatchEntry* entry = nullptr;
  int64_t token_begin = 0;  // first query row in q/out
};

class Engine {
 public:
  explicit Engine(const ModelConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  StepStats run(const StepPlan& plan);

  const ModelConfig& config() const { return cfg_; }
  const Activations& activations() const { return act_; }
  const std::vector<OrderedEntry>& batch() const { return batch_; }
  // Output of `layer` in the last step: [num_tokens, H, D].
  flashserve::TensorRef out(int layer) const;
  // Fault injection for the demo's self-test: overwrites K and V of the first cached block of
  // `e` in every layer with 4.0 (call before run(); the step's verification must then fail).
  void corrupt_cache(const BatchEntry& e);

 private:
  flashserve::backend::MetadataBuilder& builder_for(StepKind kind);
  void order_batch(const StepPlan& plan);
  flashserve::backend::CommonMetadata common_metadata();
  void apply_copies(const StepPlan& plan);
  void fill_qkv(int layer);

  ModelConfig cfg_;
  Activations act_;
  flashserve::backend::LayerSpec spec_;
  flashserve::backend::AttentionLayer layer_;
  std::unique_ptr<flashserve::backend::MetadataBuilder> decode_builder_, spec_builder_, tree_builder_;
  std::vector<HostBuffer> key_cache_, value_cache_;  // per layer [num_blocks, block_size, H_kv, D]
  HostBuffer q_, k_, v_;                             // [max_num_tokens, H(_kv), D]
  std::vector<HostBuffer> out_;                      // per layer [max_num_tokens, H, D]
  HostBuffer workspace_;
  HostBuffer block_table_;                           // int32 [max_num_reqs, max_blocks_per_req]
  HostBuffer slot_mapping_;                          // int64 [max_num_tokens]
  std::vector<int32_t> query_start_, seq_lens_, num_drafts_, parents_;
  std::vector<int64_t> copy_pairs_;
  std::vector<OrderedEntry> batch_;
  int64_t num_tokens_ = 0;
};

}  // namespace serving
