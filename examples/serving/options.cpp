// serve_demo's options (options.hpp).
#include "options.hpp"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <type_traits>

#include "flashserve/cache.hpp"

namespace serving {

const char* const kUsage =
    "usage: serve_demo [--preset none|llama3-8b] [--device auto|cpu|cuda] [--seed N] [--requests N] [--rate R]\n"
    "                  [--groups N] [--steps N] [--layers N] [--heads H] [--kv-heads H] [--head-size D]\n"
    "                  [--dtype bf16|f32] [--kv-dtype auto|fp8] [--budget TOKENS] [--max-running N]\n"
    "                  [--blocks N | --kv-gb GB] [--bw-ceiling-gbs GBS] [--tflops-ceiling TFLOPS]\n"
    "                  [--verify-every N] [--verify-per-path N] [--verify-max N] [--verify-layers N] [--verify-rows N]\n"
    "                  [--print-every N] [--progress-every N] [--out FILE.json] [--inject-fault STEP] [--no-plot]\n";

namespace {

// Llama-3-8B-shaped attention under a long-prompt workload (options.hpp).
void apply_llama3_8b(Options& o) {
  o.layers = 32;
  o.num_heads = 32;
  o.num_kv_heads = 8;
  o.head_size = 128;
  WorkloadConfig& w = o.workload;
  w.num_requests = 2000;
  w.arrival_rate = 4;
  w.prompt_median = 1450;  // log-normal, sigma 0.8: mean ~2000 tokens
  w.prompt_sigma = 0.8;
  w.prompt_min = 32;
  w.prompt_max = 16384;
  w.output_mean = 128;
  w.output_max = 1024;
  w.num_groups = 12;
  w.group_size = 16;
  w.group_prefix = 2040;  // not block aligned: the first member's write copies the last block
  w.group_suffix_median = 200;
  w.group_output_min = 64;
  o.budget = 8192;
  o.max_running = 256;
  o.kv_gb = -1;  // the device's default (serve_demo.cpp: 80 GB on CUDA, 2 GB on the host)
  // The CPU reference of a long-context step is slow: every 25th step, and the first 3 steps of
  // each speculative / cascade path; the first layer, 4 requests, their last 8 query rows.
  o.verify_every = 25;
  o.verify_per_path = 3;
  o.verify_max = 4;
  o.verify_layers = 1;
  o.verify_rows = 8;
  o.print_every = 0;
  o.progress_every = 50;
}

template <class T>
void convert(const std::string& s, T& field) {
  if constexpr (std::is_same_v<T, std::string>) field = s;
  else if constexpr (std::is_floating_point_v<T>) field = T(std::stod(s));
  else field = T(std::stoll(s));
}

void validate(const Options& o) {
  if (o.preset != "none" && o.preset != "llama3-8b")
    throw std::invalid_argument("--preset: expected none or llama3-8b, got " + o.preset);
  if (o.dtype != "bf16" && o.dtype != "f32") throw std::invalid_argument("--dtype: expected bf16 or f32, got " + o.dtype);
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda")
    throw std::invalid_argument("--device: expected auto, cpu or cuda, got " + o.device);
  flashserve::parse_kv_cache_dtype(o.kv_dtype, "--kv-dtype");
  if (o.bw_ceiling_gbs <= 0 || o.tflops_ceiling <= 0)
    throw std::invalid_argument("--bw-ceiling-gbs and --tflops-ceiling: expected > 0");
  if (o.verify_max < 1 || o.verify_layers < 1 || o.verify_rows < 1)
    throw std::invalid_argument("--verify-max, --verify-layers, --verify-rows: expected >= 1");
}

}  // namespace

Options parse_options(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  bool plot = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], val;
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--no-plot") {
      plot = false;
      continue;
    }
    if (const size_t eq = a.find('='); eq != std::string::npos) {
      val = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (i + 1 < argc) {
      val = argv[++i];
    } else {
      throw std::invalid_argument(a + ": expected a value");
    }
    kv[a] = val;
  }
  Options o;
  o.plot = plot;
  const auto take = [&](const char* k, auto& field) {
    if (auto it = kv.find(k); it != kv.end()) {
      convert(it->second, field);
      kv.erase(it);
    }
  };
  take("--preset", o.preset);
  take("--device", o.device);
  if (o.preset == "llama3-8b") apply_llama3_8b(o);
  take("--seed", o.seed);
  o.workload.seed = o.seed;
  take("--requests", o.workload.num_requests);
  take("--groups", o.workload.num_groups);
  take("--rate", o.workload.arrival_rate);
  take("--steps", o.max_steps);
  take("--layers", o.layers);
  take("--heads", o.num_heads);
  take("--kv-heads", o.num_kv_heads);
  take("--head-size", o.head_size);
  take("--dtype", o.dtype);
  take("--kv-dtype", o.kv_dtype);
  take("--budget", o.budget);
  take("--max-running", o.max_running);
  if (kv.count("--blocks") && kv.count("--kv-gb")) throw std::invalid_argument("--blocks, --kv-gb: give one of them");
  if (kv.count("--blocks")) o.kv_gb = 0;
  take("--blocks", o.blocks);
  take("--kv-gb", o.kv_gb);
  take("--out", o.out);
  take("--verify-every", o.verify_every);
  take("--verify-per-path", o.verify_per_path);
  take("--verify-max", o.verify_max);
  take("--verify-layers", o.verify_layers);
  take("--verify-rows", o.verify_rows);
  take("--print-every", o.print_every);
  take("--progress-every", o.progress_every);
  take("--inject-fault", o.fault_step);
  take("--bw-ceiling-gbs", o.bw_ceiling_gbs);
  take("--tflops-ceiling", o.tflops_ceiling);
  if (!kv.empty()) throw std::invalid_argument(kv.begin()->first + ": unknown option");
  validate(o);
  return o;
}

}  // namespace serving
