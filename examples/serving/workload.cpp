// Synthetic traffic (workload.hpp).
#include "workload.hpp"

#include <algorithm>
#include <cmath>
#include <random>

namespace serving {

namespace {

int32_t lognormal_len(std::mt19937_64& rng, double median, double sigma, int lo, int hi) {
  std::lognormal_distribution<double> d(std::log(median), sigma);
  return int32_t(std::clamp<double>(std::round(d(rng)), lo, hi));
}

// Geometric on {1, 2, ...} with the given mean.
int32_t geometric_len(std::mt19937_64& rng, double mean, int lo, int hi) {
  std::geometric_distribution<int> d(1.0 / std::max(1.0, mean));
  return int32_t(std::clamp(1 + d(rng), lo, hi));
}

}  // namespace

int64_t Workload::total_prompt_tokens() const {
  int64_t n = 0;
  for (const RequestSpec& r : requests) n += r.prompt_len;
  return n;
}

int64_t Workload::total_output_tokens() const {
  int64_t n = 0;
  for (const RequestSpec& r : requests) n += r.output_len;
  return n;
}

Workload make_workload(const WorkloadConfig& c) {
  std::mt19937_64 rng(c.seed * 0x9e3779b97f4a7c15ull + 17);
  Workload w;
  w.num_groups = c.num_groups;
  std::exponential_distribution<double> gap(c.arrival_rate > 0 ? c.arrival_rate : 1.0);
  double t = 0;
  int32_t id = 0;
  for (int i = 0; i < c.num_requests; ++i) {
    RequestSpec r;
    r.id = id++;
    r.arrival_step = int64_t(t);
    r.prompt_len = lognormal_len(rng, c.prompt_median, c.prompt_sigma, c.prompt_min, c.prompt_max);
    r.output_len = geometric_len(rng, c.output_mean, 1, c.output_max);
    w.requests.push_back(r);
    t += gap(rng);
  }
  // Group bursts spread over the arrival span, members a few steps apart.
  const double span = std::max(1.0, t);
  for (int g = 0; g < c.num_groups; ++g) {
    double tg = span * (g + 0.5) / (c.num_groups + 0.5);
    std::exponential_distribution<double> burst(2.0);
    for (int m = 0; m < c.group_size; ++m) {
      RequestSpec r;
      r.id = id++;
      r.arrival_step = int64_t(tg);
      r.group = g;
      r.prefix_len = c.group_prefix;
      r.prompt_len = c.group_prefix + lognormal_len(rng, c.group_suffix_median, 0.6, 8, 512);
      r.output_len = geometric_len(rng, c.output_mean, c.group_output_min, c.output_max);
      w.requests.push_back(r);
      tg += burst(rng);
    }
  }
  std::stable_sort(w.requests.begin(), w.requests.end(), [](const RequestSpec& a, const RequestSpec& b) {
    return a.arrival_step != b.arrival_step ? a.arrival_step < b.arrival_step : a.id < b.id;
  });
  return w;
}

}  // namespace serving
