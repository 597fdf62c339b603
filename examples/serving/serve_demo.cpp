// The serving demo: continuous batching over a paged KV cache, every attention call through
// the backend layer (MetadataBuilder::build per step, AttentionLayer::forward per layer).
// Prints a line per step and a summary, verifies a sample of steps against a direct
// computation (exit 1 on a mismatch), writes per-step JSON and a PNG plot of it.
//
//   serve_demo [--seed N] [--requests N] [--rate R] [--groups N] [--steps N] [--layers N] [--dtype bf16|f32]
//              [--head-size D] [--budget T] [--blocks N] [--device auto|cpu|cuda] [--out FILE.json]
//              [--verify-every N] [--print-every N] [--inject-fault STEP] [--no-plot]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <sys/wait.h>

#include "engine.hpp"
#include "flashserve/status.hpp"
#include "report.hpp"
#include "scheduler.hpp"
#include "verify.hpp"

#ifndef SERVE_DEMO_PLOT_SCRIPT
#define SERVE_DEMO_PLOT_SCRIPT "tools/plot_demo.py"
#endif

namespace {

using namespace serving;
namespace fs = flashserve;

struct Options {
  uint64_t seed = 1;
  int requests = 160, groups = 3;
  double rate = 1.2;  // independent arrivals per step
  int64_t max_steps = 0;  // 0: until every request finishes
  int layers = 3;
  std::string dtype = "bf16";
  int64_t head_size = 128, budget = 512;
  int32_t blocks = 640;  // tight enough that the scheduler preempts now and then
  std::string device = "auto";
  std::string out = "build/demo/serve_demo.json";
  int verify_every = 10, print_every = 1;
  int64_t verify_max = 8;
  int64_t fault_step = -1;
  bool plot = true;
};

const char* kUsage =
    "usage: serve_demo [--seed N] [--requests N] [--rate R] [--groups N] [--steps N] [--layers N] [--dtype bf16|f32]\n"
    "                  [--head-size D] [--budget TOKENS] [--blocks N] [--device auto|cpu|cuda]\n"
    "                  [--out FILE.json] [--verify-every N] [--print-every N] [--inject-fault STEP] [--no-plot]\n";

Options parse(int argc, char** argv) {
  Options o;
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--no-plot") {
      o.plot = false;
      continue;
    }
    std::string val;
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
  const auto take = [&](const char* k, auto& field) {
    auto it = kv.find(k);
    if (it == kv.end()) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::string>) field = it->second;
    else if constexpr (std::is_floating_point_v<std::decay_t<decltype(field)>>) field = std::stod(it->second);
    else field = decltype(field + 0)(std::stoll(it->second));
    kv.erase(it);
  };
  take("--seed", o.seed);
  take("--requests", o.requests);
  take("--groups", o.groups);
  take("--rate", o.rate);
  take("--steps", o.max_steps);
  take("--layers", o.layers);
  take("--dtype", o.dtype);
  take("--head-size", o.head_size);
  take("--budget", o.budget);
  take("--blocks", o.blocks);
  take("--device", o.device);
  take("--out", o.out);
  take("--verify-every", o.verify_every);
  take("--print-every", o.print_every);
  take("--inject-fault", o.fault_step);
  if (!kv.empty()) throw std::invalid_argument(kv.begin()->first + ": unknown option");
  if (o.dtype != "bf16" && o.dtype != "f32") throw std::invalid_argument("--dtype: expected bf16 or f32, got " + o.dtype);
  if (o.device != "auto" && o.device != "cpu" && o.device != "cuda")
    throw std::invalid_argument("--device: expected auto, cpu or cuda, got " + o.device);
  return o;
}

// The device the demo runs on. The backend runs on the CPU reference today; CUDA tensors are
// rejected by the library until the kernels land, so asking for CUDA says so.
void select_device(const Options& o) {
  if (o.device == "cuda")
    throw fs::NotImplemented(FLASHSERVE_WITH_CUDA
                                 ? "--device cuda: the CUDA attention kernels are not implemented yet (use --device cpu)"
                                 : "--device cuda: this build has no CUDA (configure the cuda preset), and the CUDA "
                                   "attention kernels are not implemented yet (use --device cpu)");
  std::printf("device: cpu (reference backend%s)\n",
              FLASHSERVE_WITH_CUDA ? "; CUDA kernels not implemented yet, so no GPU is used" : "");
}

ConfigList describe(const Options& o, const ModelConfig& m, const SchedulerConfig& s) {
  return {{"seed", std::to_string(o.seed)}, {"device", "cpu"}, {"layers", std::to_string(m.num_layers)},
          {"num_heads", std::to_string(m.num_heads)}, {"num_kv_heads", std::to_string(m.num_kv_heads)},
          {"head_size", std::to_string(m.head_size)}, {"dtype", o.dtype}, {"block_size", std::to_string(m.block_size)},
          {"num_blocks", std::to_string(m.num_blocks)}, {"token_budget", std::to_string(s.token_budget)},
          {"max_running", std::to_string(s.max_running)}, {"requests", std::to_string(o.requests)},
          {"groups", std::to_string(o.groups)}, {"arrival_rate", std::to_string(o.rate)}, {"spec_tokens", std::to_string(s.spec_tokens)}};
}

// tools/plot_demo.py with the first interpreter that has matplotlib (exit status 3: none).
void plot(const std::string& json) {
  const std::string png = std::filesystem::path(json).replace_extension(".png").string();
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    const std::string cmd = std::string(python) + " '" + SERVE_DEMO_PLOT_SCRIPT + "' '" + json + "' '" + png + "'" +
                            " 2>/dev/null";
    const int rc = std::system(cmd.c_str());
    if (rc == 0) {
      std::printf("plot: %s\n", png.c_str());
      return;
    }
    if (!WIFEXITED(rc) || WEXITSTATUS(rc) != 3) break;
  }
  std::printf("plot: not written (tools/plot_demo.py needs python3 with matplotlib: apt-get install python3-matplotlib)\n");
}

struct Setup {
  WorkloadConfig workload;
  ModelConfig model;
  SchedulerConfig scheduler;
};

Setup setup_of(const Options& o) {
  Setup s;
  s.workload.seed = o.seed;
  s.workload.num_requests = o.requests;
  s.workload.num_groups = o.groups;
  s.workload.arrival_rate = o.rate;
  ModelConfig& m = s.model;
  m.seed = o.seed;
  m.num_layers = o.layers;
  m.head_size = o.head_size;
  m.dtype = o.dtype == "f32" ? fs::DType::f32 : fs::DType::bf16;
  m.num_blocks = o.blocks;
  m.max_num_tokens = o.budget;
  const WorkloadConfig& w = s.workload;
  m.max_blocks_per_req = (w.prompt_max + w.group_prefix + w.output_max + 2 * kTreeDrafts) / m.block_size + 2;
  s.scheduler.seed = o.seed;
  s.scheduler.token_budget = o.budget;
  s.scheduler.max_running = m.max_num_reqs = std::min<int64_t>(64, o.budget);
  s.scheduler.spec_tokens = m.spec_tokens;
  // The longest request must fit the pool beside the admission reserve, or it would wait forever.
  const int64_t need = m.max_blocks_per_req + int64_t(s.scheduler.watermark * o.blocks) + 1;
  if (o.blocks < need)
    throw std::invalid_argument("--blocks: expected >= " + std::to_string(need) +
                                " (the longest request's blocks plus the admission reserve), got " +
                                std::to_string(o.blocks));
  if (o.budget < 1 + kTreeDrafts) throw std::invalid_argument("--budget: expected >= 5 tokens, got " + std::to_string(o.budget));
  if (o.layers < 1 || o.requests < 0 || o.groups < 0 || o.rate <= 0)
    throw std::invalid_argument("--layers >= 1, --requests >= 0, --groups >= 0 and --rate > 0 expected");
  return s;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The serving loop's state: the pool, the model side, the rows so far.
struct Demo {
  const Options& opt;
  BlockAllocator alloc;
  Engine engine;
  std::vector<StepRow> rows;
  bool fault_done = false;
  bool passed = true;

  // --inject-fault: the first step from then on with a request that has cached tokens.
  bool maybe_inject_fault(const StepPlan& plan) {
    if (opt.fault_step < 0 || plan.step < opt.fault_step || fault_done) return false;
    for (const BatchEntry& e : plan.entries)
      if (e.first_pos > 0) {
        engine.corrupt_cache(e);
        return fault_done = true;
      }
    return false;
  }

  // Runs a scheduled step through the engine, verifies it when sampled, commits it.
  StepRow serve(const StepPlan& plan, Scheduler& sched) {
    const auto t0 = std::chrono::steady_clock::now();
    StepRow r;
    r.step = plan.step;
    r.kind = step_kind_name(plan.kind);
    const bool fault = maybe_inject_fault(plan);
    r.stats = engine.run(plan);
    const std::string& path = r.stats.path;
    r.verified = fault || (opt.verify_every > 0 && int64_t(rows.size()) % opt.verify_every == 0) ||
                 path == "cascade" || path == "verify" || path == "tree";
    if (r.verified) {
      const auto v0 = std::chrono::steady_clock::now();
      r.verify = verify_step(engine, fault ? INT64_MAX : opt.verify_max);
      r.verify_ms = ms_since(v0);
    }
    const StepOutcome out = sched.commit(plan);
    r.running = sched.num_running();
    r.waiting = sched.num_waiting();
    r.finished = sched.num_finished();
    r.free_blocks = alloc.num_free();
    r.preempted = plan.preempted;
    r.admitted = plan.admitted;
    r.proposed_drafts = out.proposed_drafts;
    r.accepted_drafts = out.accepted_drafts;
    r.generated = out.generated;
    r.wall_ms = ms_since(t0);
    return r;
  }

  // Progress: every print_every-th step, every cascade / tree step, every failure.
  void report(const StepRow& r) {
    const bool failed = r.verified && !r.verify.passed();
    if (failed) {
      passed = false;
      std::printf("verification FAILED at step %lld: %s (%lld of %lld rows)\n", (long long)r.step,
                  r.verify.first_failure.c_str(), (long long)r.verify.bad_rows, (long long)r.verify.rows);
    }
    if (failed || r.stats.path == "cascade" || r.stats.path == "tree" ||
        rows.size() % size_t(std::max(1, opt.print_every)) == 0)
      print_step(stdout, r);
    std::fflush(stdout);
  }

  // Serves the workload until every request finished (or --steps served steps).
  RunTotals serve_all(const Workload& w, const SchedulerConfig& sc) {
    RunTotals t;
    Scheduler sched(sc, w, alloc);
    int stalled = 0;
    for (int64_t step = 0; !sched.done() && (opt.max_steps <= 0 || int64_t(rows.size()) < opt.max_steps); ++step) {
      if (sched.idle()) step = std::max(step, sched.next_arrival_step());
      const StepPlan plan = sched.schedule(step);
      if (plan.entries.empty()) {
        if (++stalled > 1000) throw std::runtime_error("the scheduler made no progress for 1000 steps");
        continue;
      }
      stalled = 0;
      StepRow r = serve(plan, sched);
      report(r);
      rows.push_back(std::move(r));
    }
    t.completed = sched.done();
    t.finished = sched.num_finished();
    t.preemptions = sched.num_preemptions();
    return t;
  }
};

int run(const Options& o) {
  const Setup s = setup_of(o);
  select_device(o);
  const Workload w = make_workload(s.workload);
  const ModelConfig& mc = s.model;
  std::printf("serve_demo: %zu requests (%d shared-prefix groups of %d), %lld prompt + %lld output tokens;"
              " %d layers, H=%lld H_kv=%lld D=%lld %s, %d blocks of %d tokens, budget %lld tokens/step\n",
              w.requests.size(), s.workload.num_groups, s.workload.group_size, (long long)w.total_prompt_tokens(),
              (long long)w.total_output_tokens(), mc.num_layers, (long long)mc.num_heads, (long long)mc.num_kv_heads,
              (long long)mc.head_size, o.dtype.c_str(), mc.num_blocks, mc.block_size, (long long)o.budget);
  Demo demo{o, BlockAllocator(mc.num_blocks, mc.block_size), Engine(mc), {}};
  const auto t0 = std::chrono::steady_clock::now();
  RunTotals t = demo.serve_all(w, s.scheduler);
  t.wall_s = ms_since(t0) / 1e3;
  t.verification_passed = demo.passed;
  t.requests = int64_t(w.requests.size());
  t.groups = w.num_groups;
  for (const RequestSpec& r : w.requests) t.grouped += r.group >= 0;
  t.prompt_tokens = w.total_prompt_tokens();
  t.output_tokens = w.total_output_tokens();
  t.free_blocks = demo.alloc.num_free();
  t.num_blocks = demo.alloc.num_blocks();
  print_summary(stdout, demo.rows, t, mc.dtype);

  const std::filesystem::path json(o.out);
  if (json.has_parent_path()) std::filesystem::create_directories(json.parent_path());
  write_json(o.out, describe(o, mc, s.scheduler), demo.rows, t);
  std::printf("json: %s\n", o.out.c_str());
  if (o.plot) plot(o.out);
  const bool leak = t.completed && t.free_blocks != t.num_blocks;
  if (leak) std::printf("KV pool: %lld blocks leaked\n", (long long)(t.num_blocks - t.free_blocks));
  std::printf("serve_demo: %s\n", t.verification_passed && !leak ? "PASS" : "FAIL");
  return t.verification_passed && !leak ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const fs::NotImplemented& e) {
    std::fprintf(stderr, "serve_demo: NotImplemented: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "serve_demo: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve_demo: error: %s\n", e.what());
    return 1;
  }
}
