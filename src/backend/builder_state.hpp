// The metadata builder's state (backend.hpp, MetadataBuilder): fixed host buffers sized once
// from the BuilderConfig, the last build's inputs (copied, so advance_decode_step and
// update_block_table can recompose) and the decision of how the batch is attended.
//
// Every part has its own buffers, each view starting at element 0, so a part's
// cu_seqlens_q / seqused_k / cp_tot_seqused_k pointers never move between builds (CUDA-graph
// replay reads the captured pointers). Block-table views of the engine's table move with it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "flashserve/backend.hpp"

namespace flashserve::backend::builder {

// Buffers of one part: cu_seqlens_q [cap + 1], seqused_k [cap], cp_tot_seqused_k [cap].
struct PartBuffers {
  std::vector<int32_t> cu, seqused, seqused_global;
  explicit PartBuffers(int64_t cap = 0)
      : cu(size_t(cap) + 1, 0), seqused(size_t(cap), 0), seqused_global(size_t(cap), 0) {}
};

// How a batch is attended; each mode fills its parts and leaves the others idle.
enum class Mode : uint8_t {
  split,    // decode part + prefill part over the paged cache (decoder or cross-attention)
  cascade,  // shared-prefix pass + per-request suffix pass
  local,    // chunked local attention as a virtual batch
  tree,     // speculative verify: committed-prefix pass + draft-tree pass
  encoder,  // no cache: one part over the query sequences themselves
};

struct Decision {
  Mode mode = Mode::split;
  int64_t num_decodes = 0;       // leading requests with query_len <= reorder_batch_threshold
  int64_t prefix_len = 0;        // cascade: common prefix in tokens (whole blocks)
  int64_t num_virtual = 0;       // local: virtual requests
};

// The last build's inputs, as build() received them (host arrays copied).
struct Inputs {
  bool valid = false;
  int64_t num_reqs = 0, num_tokens = 0;
  std::vector<int32_t> query_start_loc;   // [max_num_reqs + 1]
  std::vector<int32_t> seq_lens;          // [max_num_reqs]
  std::vector<int32_t> encoder_seq_lens;  // [max_num_reqs]
  TensorRef block_table;                  // the engine's (ndim 0 for encoder layers)
  TensorRef slot_mapping;                 // the engine's, or `slots` after advance_decode_step
  bool causal = true;
  int64_t common_prefix_len = 0;
  // Draft tree (tree mode): per request its number of drafts; per query token its parent's
  // token index (-1: the committed tip; -2: not a draft). Slots of the tree pass come from
  // slot_mapping, or from the block table by position once update_block_table re-pointed it.
  std::vector<int32_t> num_drafts;        // [max_num_reqs]
  std::vector<int32_t> tree_parent;       // [max_num_tokens]
  bool tree_slots_from_table = false;
  std::span<const int32_t> query_start() const { return {query_start_loc.data(), size_t(num_reqs) + 1}; }
  std::span<const int32_t> seqs() const { return {seq_lens.data(), size_t(num_reqs)}; }
};

struct State {
  BuilderConfig config;
  AttentionMetadata md;
  Inputs in;
  Decision decision;

  PartBuffers decode, prefill;             // max_num_reqs each
  PartBuffers cascade_prefix, cascade_suffix;  // 1, max_num_reqs
  PartBuffers local;                       // local_capacity virtual requests
  PartBuffers tree_prefix, tree;           // max_num_reqs, max_num_tokens (one per query token)
  std::vector<int32_t> local_k_start, local_request;  // [local_capacity]
  std::vector<int32_t> local_table;        // [local_capacity, local_width]
  std::vector<int32_t> tree_table;         // [max_num_tokens, max_draft_depth]: slots
  std::vector<int32_t> tree_depth;         // [max_num_tokens] scratch of validation
  std::vector<int32_t> query_lens;         // [max_num_reqs] scratch for use_cascade
  std::vector<int64_t> slots;              // [max_num_reqs]: advance_decode_step's slot_mapping
  int64_t local_capacity = 0, local_width = 0;

  explicit State(const BuilderConfig& c);
};

// ---- shared helpers

// Host read of block_table[r][j] (int32, any strides).
inline int32_t table_at(const TensorRef& t, int64_t r, int64_t j) {
  return *static_cast<const int32_t*>(t.at(r, j));
}
// KV length that request r reads on this rank (DCP shards a global length).
int64_t kv_len_on_rank(const BuilderConfig& c, int64_t global_len);
// Query heads of the attention calls (DCP gathers every rank's heads).
int64_t call_heads(const BuilderConfig& c);

// Writes every part of state.md from state.in and state.decision (builder_compose.cpp).
// The inputs were validated; nothing here throws.
void compose(State& s);

}  // namespace flashserve::backend::builder
