// The demo's reporting: a line per step, a progress line, the final summary (per path: steps,
// tokens, attention time, tokens/s, GB/s, TFLOP/s and the fraction of the device's roofline
// ceiling), and the JSON file (configuration, per-step rows, per-path totals, totals) that
// tools/plot_demo.py draws.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cost.hpp"
#include "engine.hpp"
#include "verify.hpp"

namespace serving {

struct StepRow {
  int64_t step = 0;
  std::string kind;  // scheduler's step kind: normal | group | verify | tree
  StepStats stats;
  StepCost cost;
  int64_t running = 0, waiting = 0, finished = 0, free_blocks = 0;
  int preempted = 0, admitted = 0;
  int64_t proposed_drafts = 0, accepted_drafts = 0, generated = 0;
  bool verified = false;
  VerifyResult verify;
  double verify_ms = 0, wall_ms = 0;
};

struct RunTotals {
  int64_t requests = 0, finished = 0, grouped = 0, groups = 0;
  int64_t prompt_tokens = 0, output_tokens = 0, preemptions = 0;
  int64_t free_blocks = 0, num_blocks = 0;
  double wall_s = 0;
  bool verification_passed = true;
  bool completed = true;  // every request finished (no --steps cut-off)
};

// What the summary needs to know beyond the rows.
struct ReportContext {
  flashserve::DType dtype = flashserve::DType::bf16;
  bool cuda = false;  // device timing: the ceiling fractions mean something
  Ceilings ceilings;
};

// One path's steps together.
struct PathTotals {
  int64_t steps = 0, tokens = 0;
  double attention_ms = 0, bytes = 0, kv_bytes = 0, flops = 0;
  double gbs() const { return bytes / (attention_ms * 1e-3) / 1e9; }
  double tflops() const { return flops / (attention_ms * 1e-3) / 1e12; }
  // Roofline time of the totals over the measured time; memory_bound says which ceiling.
  double ceiling_fraction(const Ceilings& c, bool* memory_bound = nullptr) const;
};
// Per path name, plus "total".
std::map<std::string, PathTotals> path_totals(const std::vector<StepRow>& rows);

using ConfigList = std::vector<std::pair<std::string, std::string>>;

void print_step(std::FILE* f, const StepRow& r);
// step, requests done, tokens/s (wall clock and attention only) so far.
void print_progress(std::FILE* f, const std::vector<StepRow>& rows, int64_t requests, double wall_s);
void print_summary(std::FILE* f, const std::vector<StepRow>& rows, const RunTotals& t, const ReportContext& ctx);
void write_json(const std::string& path, const ConfigList& config, const std::vector<StepRow>& rows,
                const RunTotals& t, const ReportContext& ctx);

}  // namespace serving
