// Continuous batching (scheduler.hpp).
#include "scheduler.hpp"

#include <algorithm>

namespace serving {

const char* step_kind_name(StepKind k) {
  switch (k) {
    case StepKind::normal: return "normal";
    case StepKind::group: return "group";
    case StepKind::verify: return "verify";
    case StepKind::tree: return "tree";
  }
  return "?";
}

int64_t StepPlan::num_tokens() const {
  int64_t n = 0;
  for (const BatchEntry& e : entries) n += e.query_len;
  return n;
}

Scheduler::Scheduler(const SchedulerConfig& config, const Workload& workload, BlockAllocator& alloc)
    : cfg_(config), alloc_(alloc), rng_(config.seed * 0xbf58476d1ce4e5b9ull + 3) {
  for (const RequestSpec& s : workload.requests) {
    Request r;
    r.spec = s;
    requests_.push_back(std::move(r));
  }
  groups_.resize(size_t(workload.num_groups));
  for (const RequestSpec& s : workload.requests) {
    if (s.group < 0) continue;
    Group& g = groups_[size_t(s.group)];
    g.prefix_len = s.prefix_len;
    ++g.members_left;
  }
}

Scheduler::~Scheduler() {
  for (Request& r : requests_) alloc_.free_all(r.blocks);
  for (Group& g : groups_) alloc_.free_all(g.prefix);
}

bool Scheduler::done() const { return next_arrival_ == requests_.size() && idle(); }

int64_t Scheduler::next_arrival_step() const {
  return next_arrival_ < requests_.size() ? requests_[next_arrival_].spec.arrival_step : -1;
}

// ---------------------------------------------------------------- choosing the batch

StepKind Scheduler::choose_kind(int64_t step, int32_t& group) const {
  group = -1;
  const bool any_decode = std::any_of(running_.begin(), running_.end(), [](const Request* r) { return !r->prefilling(); });
  if (any_decode && cfg_.tree_every > 0 && step % cfg_.tree_every == cfg_.tree_every - 1) return StepKind::tree;
  if (any_decode && cfg_.verify_every > 0 && step % cfg_.verify_every == cfg_.verify_every - 1) return StepKind::verify;
  if (last_kind_ == StepKind::group) return StepKind::normal;
  int best = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!groups_[g].registered) continue;
    const int n = int(std::count_if(running_.begin(), running_.end(),
                                    [&](const Request* r) { return in_group_step(*r, int32_t(g)); }));
    if (n >= cfg_.group_min && n > best) {
      best = n;
      group = int32_t(g);
    }
  }
  return group >= 0 ? StepKind::group : StepKind::normal;
}

bool Scheduler::in_group_step(const Request& r, int32_t group) const {
  return r.spec.group == group && r.computed >= r.spec.prefix_len;
}

// A leader stops its chunk at the end of the system prompt, so the prompt's blocks can be
// registered before anything else is written into them.
int32_t Scheduler::prefill_chunk(const Request& r, int64_t budget) const {
  int64_t end = r.spec.prompt_len;
  if (r.spec.group >= 0) {
    const Group& g = groups_[size_t(r.spec.group)];
    if (!g.registered && r.computed < g.prefix_len) end = g.prefix_len;
  }
  return int32_t(std::min<int64_t>(end - r.computed, budget));
}

// Blocks for writing positions [begin, end) of r, preempting the latest admitted requests not
// in this step while the pool is short. False when even that is not enough.
bool Scheduler::make_room(Request& r, int64_t begin, int64_t end, StepPlan& plan) {
  while (alloc_.blocks_needed(r.blocks, begin, end) > alloc_.num_free()) {
    Request* victim = nullptr;
    for (Request* c : running_)
      if (c != &r && c->scheduled_step != plan.step && (!victim || c->admitted_seq > victim->admitted_seq)) victim = c;
    if (!victim) return false;
    preempt(*victim);
    ++plan.preempted;
  }
  alloc_.prepare_write(r.blocks, begin, end, plan.copies);
  return true;
}

void Scheduler::preempt(Request& r) {
  alloc_.free_all(r.blocks);
  r.computed = 0;
  r.generated = 0;
  ++r.preemptions;
  ++preemptions_;
  if (r.spec.group >= 0 && groups_[size_t(r.spec.group)].leader == &r) groups_[size_t(r.spec.group)].leader = nullptr;
  remove_running(r);
  r.state = ReqState::waiting;
  waiting_.push_front(&r);
}

void Scheduler::remove_running(Request& r) {
  running_.erase(std::find(running_.begin(), running_.end(), &r));
}

void Scheduler::add_decodes(StepPlan& plan, int64_t& budget) {
  const std::vector<Request*> snapshot = running_;
  int64_t decodes = 0;
  for (const Request* r : snapshot)
    if (!r->prefilling() && (plan.group < 0 || in_group_step(*r, plan.group))) ++decodes;
  int64_t spare = budget - decodes;  // tokens left for drafts
  for (Request* r : snapshot) {
    if (r->state != ReqState::running || r->prefilling()) continue;
    if (plan.group >= 0 && !in_group_step(*r, plan.group)) continue;
    const int64_t room = r->spec.output_len - r->generated - 1;  // drafts that could be accepted
    BatchEntry e{r, r->computed, 1, 0, {}, true};
    if (plan.kind == StepKind::verify) {
      e.num_drafts = int32_t(std::clamp<int64_t>(std::min<int64_t>(cfg_.spec_tokens, room), 0, spare));
    } else if (plan.kind == StepKind::tree && room >= kTreeMaxAccept && spare >= kTreeDrafts) {
      e.num_drafts = kTreeDrafts;
      e.parents.assign(kTreeParents, kTreeParents + kTreeDrafts);
    }
    e.query_len += e.num_drafts;
    if (!make_room(*r, e.first_pos, e.first_pos + e.query_len, plan)) continue;
    spare -= e.num_drafts;
    budget -= e.query_len;
    r->scheduled_step = plan.step;
    plan.entries.push_back(std::move(e));
  }
}

void Scheduler::add_prefills(StepPlan& plan, int64_t& budget) {
  const std::vector<Request*> snapshot = running_;
  for (Request* r : snapshot) {
    if (budget <= 0) return;
    if (r->state != ReqState::running || !r->prefilling() || r->scheduled_step == plan.step) continue;
    if (plan.group >= 0 && !in_group_step(*r, plan.group)) continue;
    const int32_t chunk = prefill_chunk(*r, budget);
    if (chunk <= 0 || !make_room(*r, r->computed, r->computed + chunk, plan)) continue;
    budget -= chunk;
    r->scheduled_step = plan.step;
    plan.entries.push_back(BatchEntry{r, r->computed, chunk, 0, {}, false});
  }
}

// First come, first served; a member of a group whose prompt is still being prefilled by its
// leader waits without blocking the requests behind it.
void Scheduler::admit(StepPlan& plan, int64_t& budget) {
  const int64_t reserve = int64_t(cfg_.watermark * alloc_.num_blocks());
  for (auto it = waiting_.begin(); it != waiting_.end() && budget > 0 && int64_t(running_.size()) < cfg_.max_running;) {
    Request& r = **it;
    Group* g = r.spec.group >= 0 ? &groups_[size_t(r.spec.group)] : nullptr;
    if (g && !g->registered && g->leader) {
      ++it;
      continue;
    }
    if (g && g->registered) {
      r.blocks = alloc_.share(g->prefix, g->prefix_len);
      r.computed = g->prefix_len;
    }
    const int32_t chunk = prefill_chunk(r, budget);
    if (alloc_.blocks_needed(r.blocks, r.computed, r.computed + chunk) + reserve > alloc_.num_free()) {
      alloc_.free_all(r.blocks);
      r.computed = 0;
      return;
    }
    alloc_.prepare_write(r.blocks, r.computed, r.computed + chunk, plan.copies);
    if (g && !g->registered) g->leader = &r;
    r.state = ReqState::running;
    r.admitted_seq = admissions_++;
    r.scheduled_step = plan.step;
    running_.push_back(&r);
    plan.entries.push_back(BatchEntry{&r, r.computed, chunk, 0, {}, false});
    ++plan.admitted;
    budget -= chunk;
    it = waiting_.erase(it);
  }
}

StepPlan Scheduler::schedule(int64_t step) {
  for (; next_arrival_ < requests_.size() && requests_[next_arrival_].spec.arrival_step <= step; ++next_arrival_) {
    requests_[next_arrival_].state = ReqState::waiting;
    waiting_.push_back(&requests_[next_arrival_]);
  }
  StepPlan plan;
  plan.step = step;
  plan.kind = choose_kind(step, plan.group);
  int64_t budget = cfg_.token_budget;
  add_decodes(plan, budget);
  if (plan.kind != StepKind::tree) add_prefills(plan, budget);
  if (plan.kind == StepKind::normal || plan.kind == StepKind::verify) admit(plan, budget);
  // Blocks shared by every entry (after copy-on-write: none of them is written this step).
  size_t common = plan.entries.empty() ? 0 : plan.entries[0].req->blocks.size();
  for (const BatchEntry& e : plan.entries) {
    const BlockList& a = plan.entries[0].req->blocks;
    const BlockList& b = e.req->blocks;
    size_t n = 0;
    while (n < std::min(common, b.size()) && a[n] == b[n]) ++n;
    common = n;
  }
  plan.common_prefix_len = int64_t(common) * alloc_.block_size();
  last_kind_ = plan.kind;
  return plan;
}

// ---------------------------------------------------------------- after the step

void Scheduler::finish(Request& r) {
  alloc_.free_all(r.blocks);
  remove_running(r);
  r.state = ReqState::finished;
  ++finished_;
  if (r.spec.group < 0) return;
  Group& g = groups_[size_t(r.spec.group)];
  if (g.leader == &r) g.leader = nullptr;
  if (--g.members_left == 0) alloc_.free_all(g.prefix);
}

StepOutcome Scheduler::commit(const StepPlan& plan) {
  StepOutcome out;
  for (const BatchEntry& e : plan.entries) {
    Request& r = *e.req;
    if (!e.decode) {
      r.computed += e.query_len;
      Group* g = r.spec.group >= 0 ? &groups_[size_t(r.spec.group)] : nullptr;
      if (g && g->leader == &r && !g->registered && r.computed == g->prefix_len) {
        g->prefix = alloc_.share(r.blocks, g->prefix_len);
        g->registered = true;
      }
      if (r.prefilling()) continue;
      r.generated = 1;
      out.generated += 1;
    } else {
      const int max_accept = e.parents.empty() ? e.num_drafts : kTreeMaxAccept;
      const int accepted = e.num_drafts > 0 ? int(std::uniform_int_distribution<int>(0, max_accept)(rng_)) : 0;
      out.proposed_drafts += e.num_drafts;
      out.accepted_drafts += accepted;
      r.computed += 1 + accepted;
      r.generated += 1 + accepted;
      out.generated += 1 + accepted;
    }
    if (r.generated >= r.spec.output_len) {
      finish(r);
      ++out.finished;
    }
  }
  return out;
}

}  // namespace serving
