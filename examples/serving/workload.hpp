// The demo's synthetic traffic: requests arriving over simulated steps with realistic lengths.
// Independent requests arrive as a Poisson process; prompts are log-normal, outputs geometric.
// Shared-prefix groups (a tenant's common system prompt) arrive as bursts whose members share
// the prompt's first `prefix_len` tokens. Everything is a function of the seed.
#pragma once

#include <cstdint>
#include <vector>

namespace serving {

struct WorkloadConfig {
  uint64_t seed = 1;
  int num_requests = 160;         // independent requests
  double arrival_rate = 1.2;      // independent arrivals per step (Poisson)
  double prompt_median = 300;     // log-normal prompt lengths (tokens)
  double prompt_sigma = 0.8;
  int prompt_min = 8, prompt_max = 2048;
  double output_mean = 40;        // geometric output lengths (tokens, >= 1)
  int output_max = 256;
  int num_groups = 3;             // shared-prefix groups
  int group_size = 10;            // members per group
  int group_prefix = 300;         // shared system prompt (tokens; not block aligned: CoW)
  double group_suffix_median = 40;  // members' own prompt tokens after the prefix
  int group_output_min = 24;      // members answer at least this much (their decodes overlap)
};

struct RequestSpec {
  int32_t id = 0;
  int64_t arrival_step = 0;
  int32_t prompt_len = 0;
  int32_t output_len = 0;
  int32_t group = -1;       // shared-prefix group, -1 for none
  int32_t prefix_len = 0;   // the group's shared prompt tokens (within prompt_len)
};

struct Workload {
  std::vector<RequestSpec> requests;  // by arrival step, then id
  int num_groups = 0;
  int64_t total_prompt_tokens() const;
  int64_t total_output_tokens() const;
};

Workload make_workload(const WorkloadConfig& config);

}  // namespace serving
