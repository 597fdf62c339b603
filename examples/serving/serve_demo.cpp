// The serving demo: continuous batching over a paged KV cache, every attention call through
// the backend layer (MetadataBuilder::build per step, AttentionLayer::forward per layer), on
// the CPU reference or on a CUDA device (KV cache, activations and metadata in device memory,
// attention timed with cudaEvents). Prints step and progress lines and a per-path summary
// (tokens/s, GB/s, TFLOP/s, fraction of the roofline ceiling), verifies a sample of steps
// against a direct CPU computation (exit 1 on a mismatch or a leaked KV block), writes
// per-step JSON and a PNG plot of it. Options: options.hpp (serve_demo --help).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <sys/wait.h>

#include "cost.hpp"
#include "engine.hpp"
#include "flashserve/status.hpp"
#include "options.hpp"
#include "report.hpp"
#include "runtime.hpp"
#include "scheduler.hpp"
#include "verify.hpp"

#ifndef SERVE_DEMO_PLOT_SCRIPT
#define SERVE_DEMO_PLOT_SCRIPT "tools/plot_demo.py"
#endif

namespace {

using namespace serving;
namespace fs = flashserve;

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

// KV pool blocks: --blocks, or --kv-gb (default 80 on CUDA, 2 on the host) capped by the free
// memory less a reserve for everything else the engine allocates.
int32_t pool_blocks(const Options& o, const ModelConfig& m, const Runtime& rt) {
  if (o.kv_gb == 0) return o.blocks;
  const double want = (o.kv_gb > 0 ? o.kv_gb : rt.is_cuda() ? 80 : 2) * 1e9;
  const double out_bytes = double(m.num_layers * m.max_num_tokens * m.num_heads * m.head_size * 2);
  const double free = double(rt.free_bytes()), usable = free - out_bytes - 8e9;
  const double bytes = std::min(want, usable);
  const int64_t blocks = std::min<int64_t>(int64_t(bytes / double(m.block_bytes_all_layers())), INT32_MAX);
  std::printf("KV pool: %lld blocks of %d tokens, %.1f GB (%.0f GB asked, %.1f GB free)\n", (long long)blocks, m.block_size,
              double(blocks) * double(m.block_bytes_all_layers()) / 1e9, want / 1e9, free / 1e9);
  return int32_t(std::max<int64_t>(blocks, 0));
}

ModelConfig model_of(const Options& o, const Runtime& rt) {
  ModelConfig m;
  m.seed = o.seed;
  m.num_layers = o.layers;
  m.num_heads = o.num_heads;
  m.num_kv_heads = o.num_kv_heads;
  m.head_size = o.head_size;
  m.dtype = o.dtype == "f32" ? fs::DType::f32 : fs::DType::bf16;
  m.kv_cache_dtype = fs::parse_kv_cache_dtype(o.kv_dtype, "--kv-dtype");
  m.max_num_tokens = o.budget;
  m.max_num_reqs = std::min<int64_t>(o.max_running, o.budget);
  const WorkloadConfig& w = o.workload;
  m.max_blocks_per_req = (w.prompt_max + w.group_prefix + w.output_max + 2 * kTreeDrafts) / m.block_size + 2;
  m.num_blocks = pool_blocks(o, m, rt);
  return m;
}

Setup setup_of(const Options& o, const Runtime& rt) {
  if (o.layers < 1 || o.workload.num_requests < 0 || o.workload.num_groups < 0 || o.workload.arrival_rate <= 0)
    throw std::invalid_argument("--layers >= 1, --requests >= 0, --groups >= 0 and --rate > 0 expected");
  if (o.budget < 1 + kTreeDrafts) throw std::invalid_argument("--budget: expected >= 5 tokens, got " + std::to_string(o.budget));
  Setup s;
  s.workload = o.workload;
  s.model = model_of(o, rt);
  s.scheduler.seed = o.seed;
  s.scheduler.token_budget = o.budget;
  s.scheduler.max_running = s.model.max_num_reqs;
  s.scheduler.spec_tokens = s.model.spec_tokens;
  // The longest request must fit the pool beside the admission reserve, or it would wait forever.
  const ModelConfig& m = s.model;
  const int64_t need = m.max_blocks_per_req + int64_t(s.scheduler.watermark * m.num_blocks) + 1;
  if (m.num_blocks < need)
    throw std::invalid_argument("KV pool: expected >= " + std::to_string(need) +
                                " blocks (the longest request's blocks plus the admission reserve), got " +
                                std::to_string(m.num_blocks) + " (raise --blocks or --kv-gb, or lower --layers)");
  return s;
}

ConfigList describe(const Options& o, const Setup& s, const Runtime& rt) {
  const ModelConfig& m = s.model;
  return {{"preset", o.preset}, {"seed", std::to_string(o.seed)}, {"device", rt.is_cuda() ? "cuda" : "cpu"},
          {"device_name", rt.name()}, {"timing", rt.is_cuda() ? "cuda_events" : "host_clock"},
          {"layers", std::to_string(m.num_layers)}, {"num_heads", std::to_string(m.num_heads)},
          {"num_kv_heads", std::to_string(m.num_kv_heads)}, {"head_size", std::to_string(m.head_size)},
          {"dtype", o.dtype}, {"kv_cache_dtype", std::string(fs::kv_cache_dtype_name(m.kv_cache_dtype))},
          {"block_size", std::to_string(m.block_size)}, {"num_blocks", std::to_string(m.num_blocks)},
          {"token_budget", std::to_string(s.scheduler.token_budget)}, {"max_running", std::to_string(s.scheduler.max_running)},
          {"requests", std::to_string(s.workload.num_requests)}, {"groups", std::to_string(s.workload.num_groups)},
          {"arrival_rate", std::to_string(s.workload.arrival_rate)}, {"spec_tokens", std::to_string(s.scheduler.spec_tokens)},
          {"bw_ceiling_gbs", std::to_string(o.bw_ceiling_gbs)}, {"tflops_ceiling", std::to_string(o.tflops_ceiling)}};
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

bool special_path(const std::string& p) { return p == "cascade" || p == "verify" || p == "tree"; }

// The serving loop's state: the pool, the model side, the rows so far.
struct Demo {
  const Options& opt;
  BlockAllocator alloc;
  Engine engine;
  std::vector<StepRow> rows;
  std::map<std::string, int> verified_by_path;  // special paths verified beyond every N-th step
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
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

  // Every verify_every-th step; cascade / verify / tree steps up to verify_per_path each.
  bool sampled(const std::string& path) {
    if (opt.verify_every > 0 && int64_t(rows.size()) % opt.verify_every == 0) return true;
    if (!special_path(path)) return false;
    int& n = verified_by_path[path];
    if (opt.verify_per_path >= 0 && n >= opt.verify_per_path) return false;
    ++n;
    return true;
  }

  // Runs a scheduled step through the engine, verifies it when sampled, commits it.
  StepRow serve(const StepPlan& plan, Scheduler& sched) {
    const auto t0 = std::chrono::steady_clock::now();
    StepRow r;
    r.step = plan.step;
    r.kind = step_kind_name(plan.kind);
    const bool fault = maybe_inject_fault(plan);
    r.stats = engine.run(plan);
    r.cost = step_cost(engine, r.stats.cascade_prefix);
    r.verified = sampled(r.stats.path) || fault;
    if (r.verified) {
      const auto v0 = std::chrono::steady_clock::now();
      VerifyLimits lim{opt.verify_max, opt.verify_layers, opt.verify_rows};
      if (fault) lim.max_requests = INT64_MAX;
      r.verify = verify_step(engine, lim);
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

  // Lines: every print_every-th step and every failure; progress every progress_every-th.
  void report(const StepRow& r, int64_t requests) {
    const bool failed = r.verified && !r.verify.passed();
    if (failed) {
      passed = false;
      std::printf("verification FAILED at step %lld: %s (%lld of %lld rows)\n", (long long)r.step,
                  r.verify.first_failure.c_str(), (long long)r.verify.bad_rows, (long long)r.verify.rows);
    }
    const size_t n = rows.size();
    if (failed || (opt.print_every > 0 && n % size_t(opt.print_every) == 0)) print_step(stdout, r);
    if (opt.progress_every > 0 && n % size_t(opt.progress_every) == 0)
      print_progress(stdout, rows, requests, ms_since(start) / 1e3);
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
      rows.push_back(std::move(r));
      report(rows.back(), int64_t(w.requests.size()));
    }
    t.completed = sched.done();
    t.finished = sched.num_finished();
    t.preemptions = sched.num_preemptions();
    return t;
  }
};

void print_header(const Options& o, const Setup& s, const Workload& w) {
  const ModelConfig& m = s.model;
  std::printf("serve_demo%s%s: %zu requests (%d shared-prefix groups of %d), %lld prompt + %lld output tokens;"
              " %d layers, H=%lld H_kv=%lld D=%lld %s, KV cache %s, %d blocks of %d tokens, budget %lld tokens/step,"
              " up to %lld running\n",
              o.preset == "none" ? "" : " --preset ", o.preset == "none" ? "" : o.preset.c_str(), w.requests.size(),
              s.workload.num_groups, s.workload.group_size, (long long)w.total_prompt_tokens(),
              (long long)w.total_output_tokens(), m.num_layers, (long long)m.num_heads, (long long)m.num_kv_heads,
              (long long)m.head_size, o.dtype.c_str(), std::string(fs::kv_cache_dtype_name(m.kv_cache_dtype)).c_str(),
              m.num_blocks, m.block_size, (long long)o.budget, (long long)s.scheduler.max_running);
  if (o.verify_per_path >= 0 || o.verify_layers < m.num_layers || o.verify_rows != INT64_MAX)
    std::printf("verification (bounded, the CPU reference of long contexts is slow): every %dth step and up to %d steps"
                " of each cascade/verify/tree path; the first %d layer(s), up to %lld requests per step, their last %lld"
                " query rows\n",
                o.verify_every, o.verify_per_path, std::min(o.verify_layers, m.num_layers), (long long)o.verify_max,
                (long long)o.verify_rows);
}

int run(const Options& o) {
  const std::unique_ptr<Runtime> rt = make_runtime(o.device, 3 * o.layers);
  std::printf("device: %s (timing: %s)\n", rt->name().c_str(), rt->is_cuda() ? "cudaEvents" : "wall clock");
  const Setup s = setup_of(o, *rt);
  const Workload w = make_workload(s.workload);
  print_header(o, s, w);
  const ModelConfig& mc = s.model;
  Demo demo{o, BlockAllocator(mc.num_blocks, mc.block_size), Engine(mc, *rt), {}, {}};
  demo.start = std::chrono::steady_clock::now();
  RunTotals t = demo.serve_all(w, s.scheduler);
  t.wall_s = ms_since(demo.start) / 1e3;
  t.verification_passed = demo.passed;
  t.requests = int64_t(w.requests.size());
  t.groups = w.num_groups;
  for (const RequestSpec& r : w.requests) t.grouped += r.group >= 0;
  t.prompt_tokens = w.total_prompt_tokens();
  t.output_tokens = w.total_output_tokens();
  t.free_blocks = demo.alloc.num_free();
  t.num_blocks = demo.alloc.num_blocks();
  const ReportContext ctx{mc.dtype, rt->is_cuda(), Ceilings{o.bw_ceiling_gbs * 1e9, o.tflops_ceiling * 1e12}};
  print_summary(stdout, demo.rows, t, ctx);

  const std::filesystem::path json(o.out);
  if (json.has_parent_path()) std::filesystem::create_directories(json.parent_path());
  write_json(o.out, describe(o, s, *rt), demo.rows, t, ctx);
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
    return run(parse_options(argc, argv));
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
