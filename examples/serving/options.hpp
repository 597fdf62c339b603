// serve_demo's command line: the options, their defaults, and the presets that change the
// defaults (flags given explicitly win over the preset).
//
//   --preset llama3-8b: Llama-3-8B-shaped attention (32 layers, H 32, H_kv 8, D 128, bf16),
//   2000 requests (log-normal prompts, mean ~2k tokens) plus 12 shared-prefix groups of 16,
//   a budget of 8192 tokens per step, up to 256 running requests, a KV pool of up to 80 GB on
//   CUDA, 2 GB on the host (--kv-gb), and a verification bounded for long contexts.
#pragma once

#include <climits>
#include <cstdint>
#include <string>

#include "workload.hpp"

namespace serving {

struct Options {
  std::string preset = "none";
  uint64_t seed = 1;
  WorkloadConfig workload;  // --requests, --groups, --rate; lengths from the preset
  int64_t max_steps = 0;    // 0: until every request finishes
  int layers = 3;
  int64_t num_heads = 8, num_kv_heads = 2, head_size = 128;
  std::string dtype = "bf16", kv_dtype = "auto";
  int64_t budget = 512, max_running = 64;
  int32_t blocks = 640;     // tight enough that the scheduler preempts now and then
  double kv_gb = 0;         // > 0: the pool from this many GB (capped by the free memory), not --blocks;
                            // < 0: the device's default GB
  std::string device = "auto";
  std::string out = "build/demo/serve_demo.json";
  int verify_every = 10;    // every N-th step
  int verify_per_path = -1; // cascade / verify / tree steps verified beyond that: at most N per path (-1: all)
  int64_t verify_max = 8;   // requests per verified step
  int verify_layers = INT_MAX;
  int64_t verify_rows = INT64_MAX;  // last query rows per request
  int print_every = 1;      // a line per N-th step (0: none; failures always)
  int progress_every = 0;   // a progress line per N-th step (0: none)
  int64_t fault_step = -1;
  bool plot = true;
  double bw_ceiling_gbs = 4200, tflops_ceiling = 760;
};

extern const char* const kUsage;

// Throws std::invalid_argument naming the option for an unknown option or a bad value.
Options parse_options(int argc, char** argv);

}  // namespace serving
