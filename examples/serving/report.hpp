// The demo's reporting: one progress line per step, the final summary table, and the JSON
// file (configuration, per-step rows, totals) that tools/plot_demo.py draws.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "verify.hpp"

namespace serving {

struct StepRow {
  int64_t step = 0;
  std::string kind;  // scheduler's step kind: normal | group | verify | tree
  StepStats stats;
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

using ConfigList = std::vector<std::pair<std::string, std::string>>;

void print_step(std::FILE* f, const StepRow& r);
void print_summary(std::FILE* f, const std::vector<StepRow>& rows, const RunTotals& t, flashserve::DType dtype);
void write_json(const std::string& path, const ConfigList& config, const std::vector<StepRow>& rows,
                const RunTotals& t);

}  // namespace serving
