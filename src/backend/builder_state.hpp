// The metadata builder's state (backend.hpp, MetadataBuilder): fixed int32 buffers carved once
// from one block sized from the BuilderConfig (the Arena), the last build's inputs (copied, so
// advance_decode_step and update_block_table can recompose) and the decision of how the batch
// is attended.
//
// Every part has its own buffers, each view starting at element 0, so a part's
// cu_seqlens_q / seqused_k / cp_tot_seqused_k pointers never move between builds (CUDA-graph
// replay reads the captured pointers). Block-table views of the engine's table move with it.
//
// CUDA metadata (builder_device.cpp): with a CUDA config in a CUDA build the block is pinned
// host staging plus a device copy; compose writes the staging on the host, publish uploads it
// (one async copy) and rebases the views onto the device copy.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "flashserve/backend.hpp"

namespace flashserve::backend::builder {

// One block of int32 buffers, carved in order by take(). Host memory (pageable), or with a
// device (CUDA config, CUDA build) pinned host staging and a device copy of the same size.
class Arena {
 public:
  Arena(size_t elems, const Device& device);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  std::span<int32_t> take(size_t n);  // the next n elements, zeroed
  int32_t* host() const { return host_; }
  int32_t* device_copy() const { return device_; }  // null without a device
  // The device twin of staging element p (p within the staging buffer; a device copy exists).
  int32_t* on_device(const int32_t* p) const { return device_ + (p - host_); }
  const Device& device() const { return device_at_; }
  size_t elems() const { return elems_; }
  size_t used() const { return used_; }
  bool holds(const void* p) const;                  // p within [host, host + elems]
  void* event() const { return event_; }            // end of the last upload (device only)

 private:
  std::vector<int32_t> pageable_;
  int32_t* host_ = nullptr;
  int32_t* device_ = nullptr;
  void* event_ = nullptr;
  Device device_at_{};
  size_t elems_ = 0, used_ = 0;
};

// Buffers of one part: cu_seqlens_q [cap + 1], seqused_k [cap], cp_tot_seqused_k [cap].
struct PartBuffers {
  std::span<int32_t> cu, seqused, seqused_global;
  static size_t elems(int64_t cap) { return 3 * size_t(cap) + 1; }
  static PartBuffers take(Arena& a, int64_t cap) {
    return {a.take(size_t(cap) + 1), a.take(size_t(cap)), a.take(size_t(cap))};
  }
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
  bool on_device = false;                 // the metadata views point into the device copy
  std::span<const int32_t> query_start() const { return {query_start_loc.data(), size_t(num_reqs) + 1}; }
  std::span<const int32_t> seqs() const { return {seq_lens.data(), size_t(num_reqs)}; }
};

struct State {
  BuilderConfig config;
  AttentionMetadata md;
  Inputs in;
  Decision decision;
  int64_t local_capacity = 0, local_width = 0;

  // In the arena, in this order: what split / cascade / encoder builds use first (the upload
  // copies a prefix), then the local buffers, then the tree's.
  Arena arena;
  PartBuffers decode, prefill;             // max_num_reqs each
  PartBuffers cascade_prefix, cascade_suffix;  // 1, max_num_reqs
  std::span<int32_t> advance_src;          // [max_num_reqs][2]: advance_decode_step's (request,
                                           // position) pairs (CUDA metadata: slots on the device)
  PartBuffers local;                       // local_capacity virtual requests
  std::span<int32_t> local_k_start, local_request;  // [local_capacity]
  std::span<int32_t> local_table;          // [local_capacity, local_width]
  PartBuffers tree_prefix, tree;           // max_num_reqs, max_num_tokens (one per query token)
  std::span<int32_t> tree_src;             // [max_num_tokens, max_draft_depth][2]: (request,
                                           // position) of each tree_table entry (CUDA metadata)
  std::span<int32_t> tree_table;           // [max_num_tokens, max_draft_depth]: slots
  std::span<int32_t> advance_slots;        // int64 [max_num_reqs] (device side only, 8-byte aligned)
  bool advance_pending = false;            // publish() computes advance_slots on the device
  std::vector<int32_t> tree_depth;         // [max_num_tokens] scratch of validation
  std::vector<int64_t> tree_path;          // [max_draft_depth] scratch of compose_tree
  std::vector<int32_t> query_lens;         // [max_num_reqs] scratch for use_cascade
  std::vector<int64_t> slots;              // [max_num_reqs]: advance_decode_step's slot_mapping

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

// CUDA metadata (builder_device.cpp). Whether the arena has a device copy: a CUDA config in a
// CUDA build (CPU-only builds: never).
bool arena_on_device(const BuilderConfig& c);
// Before compose rewrites the staging: waits for the last upload to have read it.
void wait_upload(State& s);
// After compose, when s.in.on_device: one async copy of the used prefix of the staging to the
// device copy on config.stream, the local block table and the slot tables (tree verify,
// advance_decode_step when advance_pending) computed from the engine's device table, and every
// view into the arena rebased onto the device copy. Host metadata: nothing.
void publish(State& s);
// advance_decode_step's device slot_mapping (int64 [max_num_reqs]); null without a device copy.
int64_t* advance_slots_device(const State& s);

}  // namespace flashserve::backend::builder
