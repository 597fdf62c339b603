// Continuous batching over the paged KV cache. Each step gets a token budget: running decodes
// first (one token each, or 1 + drafts on a speculative verify step), then chunked prefill of
// partially prefilled prompts, then new requests admitted first-come first-served while the
// budget and the pool allow. When the pool runs dry the latest admitted request is preempted
// (its blocks freed, recomputed later from scratch).
//
// Shared-prefix groups: the first member admitted (the leader) prefills the group's system
// prompt, chunked to stop exactly at its end; the prompt's blocks are then registered and later
// members start with them shared (refcount > 1), skipping that prefill. Writing the first token
// after the prefix into its last, partial block triggers copy-on-write. Every other step, a
// group with enough members past the prefix is batched on its own ("group step"), so the whole
// batch shares the prefix blocks and the builder can take the cascade path.
//
// Occasional speculative steps: "verify" gives each decode k linear drafts (query 1 + k);
// "tree" runs a decode-only batch where decodes carry a draft tree of two chains of depth 2.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "block_allocator.hpp"
#include "workload.hpp"

namespace serving {

enum class ReqState : uint8_t { pending, waiting, running, finished };

struct Request {
  RequestSpec spec;
  ReqState state = ReqState::pending;
  BlockList blocks;
  int64_t computed = 0;         // tokens whose K/V are in the cache (committed)
  int32_t generated = 0;        // output tokens sampled so far
  int64_t admitted_seq = -1;    // admission order (preemption takes the latest)
  int64_t scheduled_step = -1;  // last step that scheduled it
  int32_t preemptions = 0;
  bool prefilling() const { return computed < spec.prompt_len; }
};

enum class StepKind : uint8_t { normal, group, verify, tree };
const char* step_kind_name(StepKind k);

// One request's share of a step: query positions [first_pos, first_pos + query_len). The last
// num_drafts query tokens are speculative drafts; on tree steps `parents` gives each draft's
// parent among the request's drafts (-1: the committed tip, the first query token).
struct BatchEntry {
  Request* req = nullptr;
  int64_t first_pos = 0;
  int32_t query_len = 0;
  int32_t num_drafts = 0;
  std::vector<int32_t> parents;  // tree steps: [num_drafts]
  bool decode = false;           // the request is past its prompt
};

struct StepPlan {
  int64_t step = 0;
  StepKind kind = StepKind::normal;
  std::vector<BatchEntry> entries;  // scheduling order (the engine reorders decodes first)
  std::vector<CowCopy> copies;      // copy-on-write before the step's writes
  int64_t common_prefix_len = 0;    // tokens in blocks shared by every entry
  int32_t group = -1;               // group steps
  int preempted = 0, admitted = 0;
  int64_t num_tokens() const;
};

struct SchedulerConfig {
  uint64_t seed = 1;
  int64_t token_budget = 512;
  int64_t max_running = 64;   // <= token_budget: every running decode fits a step
  int verify_every = 7;       // a linear speculative verify step every N-th step (0: never)
  int tree_every = 17;        // a draft-tree verify step every N-th step (0: never)
  int spec_tokens = 3;        // drafts per request on verify steps
  int group_min = 8;          // members past the prefix for a group step
  double watermark = 0.02;    // share of the pool kept free when admitting
};

// The draft tree of tree steps: chains (0 -> 1) and (2 -> 3) from the committed tip.
inline constexpr int kTreeDrafts = 4;
inline constexpr int32_t kTreeParents[kTreeDrafts] = {-1, 0, -1, 2};
inline constexpr int kTreeMaxAccept = 2;  // the first chain, laid out right after the tip

struct StepOutcome {
  int finished = 0;
  int64_t accepted_drafts = 0, proposed_drafts = 0;
  int64_t generated = 0;  // output tokens sampled this step
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, const Workload& workload, BlockAllocator& alloc);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Admits arrivals up to `step`, picks the batch, grows/copies blocks for its writes.
  StepPlan schedule(int64_t step);
  // After the step ran: drafts accepted (at random), tokens sampled, finished requests freed.
  StepOutcome commit(const StepPlan& plan);

  bool done() const;
  bool idle() const { return running_.empty() && waiting_.empty(); }
  int64_t next_arrival_step() const;
  int64_t num_running() const { return int64_t(running_.size()); }
  int64_t num_waiting() const { return int64_t(waiting_.size()); }
  int64_t num_finished() const { return finished_; }
  int64_t num_preemptions() const { return preemptions_; }
  const std::vector<Request>& requests() const { return requests_; }

 private:
  struct Group {
    BlockList prefix;          // registered system-prompt blocks (the registry's reference)
    bool registered = false;
    Request* leader = nullptr;
    int32_t prefix_len = 0;
    int members_left = 0;      // members not finished
  };

  StepKind choose_kind(int64_t step, int32_t& group) const;
  bool in_group_step(const Request& r, int32_t group) const;
  int32_t prefill_chunk(const Request& r, int64_t budget) const;
  bool make_room(Request& r, int64_t begin, int64_t end, StepPlan& plan);
  void preempt(Request& r);
  void add_decodes(StepPlan& plan, int64_t& budget);
  void add_prefills(StepPlan& plan, int64_t& budget);
  void admit(StepPlan& plan, int64_t& budget);
  void finish(Request& r);
  void remove_running(Request& r);

  SchedulerConfig cfg_;
  BlockAllocator& alloc_;
  std::vector<Request> requests_;  // by arrival
  size_t next_arrival_ = 0;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;  // admission order
  std::vector<Group> groups_;
  std::mt19937_64 rng_;
  StepKind last_kind_ = StepKind::normal;
  int64_t admissions_ = 0, finished_ = 0, preemptions_ = 0;
};

}  // namespace serving
