// The model side of the demo: a stack of attention layers over one paged KV cache per layer,
// driven through the backend layer exactly as an engine would: per step, copy-on-write block
// copies, the decodes-first reorder, the common metadata (query_start_loc, seq_lens, block
// table, slot mapping) and one MetadataBuilder::build; per layer, AttentionLayer::forward
// (which writes the step's K/V into the cache, then attends). Every tensor lives in the
// runtime's memory (host, or a CUDA device), allocated once at construction; a step moves only
// its inputs there (copy-on-write pairs, block-table rows, slots, token rows).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "activations.hpp"
#include "flashserve/backend.hpp"
#include "host_buffer.hpp"
#include "runtime.hpp"
#include "scheduler.hpp"

namespace serving {

struct ModelConfig {
  uint64_t seed = 1;
  int num_layers = 2;
  int64_t num_heads = 8, num_kv_heads = 2, head_size = 64;
  flashserve::DType dtype = flashserve::DType::bf16;
  flashserve::KvCacheDType kv_cache_dtype = flashserve::KvCacheDType::auto_;  // auto_ or fp8_e4m3
  float kv_scale = 1.0f / 256;  // fp8 caches: k and v scale (a power of two: dequantized values are exact in bf16)
  int32_t block_size = 16;
  int32_t num_blocks = 2048;
  int64_t max_num_reqs = 64;
  int64_t max_num_tokens = 512;
  int64_t max_blocks_per_req = 160;
  int spec_tokens = 3;  // drafts of linear verify steps: their builder's reorder threshold is 1 + k
  flashserve::DType cache_dtype() const;
  bool fp8_cache() const { return kv_cache_dtype != flashserve::KvCacheDType::auto_; }
  // Bytes of one block in every layer's K and V caches.
  int64_t block_bytes_all_layers() const;
};

struct StepStats {
  std::string path;  // decode | prefill | mixed | cascade | verify | tree
  int64_t num_reqs = 0, num_decodes = 0, num_prefills = 0;
  int64_t decode_tokens = 0, prefill_tokens = 0, tokens = 0;
  int64_t cascade_prefix = 0;  // tokens of the shared-prefix pass (cascade path)
  int64_t copies = 0;          // copy-on-write blocks
  double build_us = 0, attention_ms = 0, qkv_ms = 0;  // attention and q/k/v generation, every layer
};

// The step's batch in the order the attention saw it (decodes first).
struct OrderedEntry {
  const BatchEntry* entry = nullptr;
  int64_t token_begin = 0;  // first query row in q/out
};

class Engine {
 public:
  Engine(const ModelConfig& config, Runtime& runtime);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  StepStats run(const StepPlan& plan);

  const ModelConfig& config() const { return cfg_; }
  const Activations& activations() const { return act_; }
  const std::vector<OrderedEntry>& batch() const { return batch_; }
  Runtime& runtime() const { return rt_; }
  // Output of `layer` in the last step, copied to a host buffer (valid until the next call):
  // [num_tokens, H, D].
  flashserve::TensorRef fetch_out(int layer);
  // Fault injection for the demo's self-test: overwrites K and V of the first cached block of
  // `e` in every layer with 4.0 (call before run(); the step's verification must then fail).
  void corrupt_cache(const BatchEntry& e);

 private:
  flashserve::backend::MetadataBuilder& builder_for(StepKind kind);
  void order_batch(const StepPlan& plan);
  flashserve::backend::CommonMetadata common_metadata();
  void apply_copies(const StepPlan& plan);
  void upload_step();
  void run_layers(const flashserve::backend::AttentionMetadata& md, StepStats& st);
  flashserve::backend::KvCache cache_of(int layer) const;

  ModelConfig cfg_;
  Runtime& rt_;
  Activations act_;
  flashserve::backend::LayerSpec spec_;
  flashserve::backend::AttentionLayer layer_;
  std::unique_ptr<flashserve::backend::MetadataBuilder> decode_builder_, spec_builder_, tree_builder_;
  // In the runtime's memory:
  std::vector<Buffer> key_cache_, value_cache_;  // per layer [num_blocks, block_size, H_kv, D], cache_dtype()
  std::vector<flashserve::TensorRef> caches_;    // every K and V cache (copy_blocks)
  Buffer kv_scale_;                              // fp8: f32 [H_kv] = kv_scale
  Buffer q_, k_, v_;                             // [max_num_tokens, H(_kv), D]
  std::vector<Buffer> out_;                      // per layer [max_num_tokens, H, D]
  Buffer workspace_;
  Buffer block_table_;                           // int32 [max_num_reqs, max_blocks_per_req]
  Buffer slot_mapping_;                          // int64 [max_num_tokens]
  Buffer copy_mapping_;                          // int64 [num_blocks, 2]
  Buffer token_rows_;                            // TokenRow [max_num_tokens] (as int64 pairs)
  // Host staging of the step's inputs, and of an output being verified:
  HostBuffer host_table_, host_slots_, host_out_;
  std::vector<int32_t> query_start_, seq_lens_, num_drafts_, parents_;
  std::vector<int64_t> copy_pairs_;
  std::vector<TokenRow> rows_;
  std::vector<OrderedEntry> batch_;
  int64_t num_tokens_ = 0;
};

}  // namespace serving
