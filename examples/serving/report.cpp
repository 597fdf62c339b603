// Reporting (report.hpp).
#include "report.hpp"

#include <algorithm>
#include <fstream>
#include <stdexcept>

namespace serving {

namespace {

const char* const kPaths[] = {"decode", "prefill", "mixed", "cascade", "verify", "tree", "total"};

// JSON string escaping for the few characters our strings can hold.
std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

std::string num(double x) {
  if (!(x == x) || x > 1e300 || x < -1e300) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", x);
  return b;
}

void write_row(std::ofstream& o, const StepRow& r) {
  const StepStats& s = r.stats;
  o << "{\"step\": " << r.step << ", \"kind\": " << quoted(r.kind) << ", \"path\": " << quoted(s.path)
    << ", \"num_reqs\": " << s.num_reqs << ", \"num_decodes\": " << s.num_decodes
    << ", \"num_prefills\": " << s.num_prefills << ", \"tokens\": " << s.tokens
    << ", \"decode_tokens\": " << s.decode_tokens << ", \"prefill_tokens\": " << s.prefill_tokens
    << ", \"cascade_prefix\": " << s.cascade_prefix << ", \"cow_blocks\": " << s.copies
    << ", \"attention_ms\": " << num(s.attention_ms) << ", \"bytes\": " << num(r.cost.bytes)
    << ", \"kv_bytes\": " << num(r.cost.kv_bytes) << ", \"flops\": " << num(r.cost.flops)
    << ", \"build_us\": " << num(s.build_us) << ", \"qkv_ms\": " << num(s.qkv_ms) << ", \"wall_ms\": " << num(r.wall_ms)
    << ", \"running\": " << r.running << ", \"waiting\": " << r.waiting << ", \"finished\": " << r.finished
    << ", \"free_blocks\": " << r.free_blocks << ", \"preempted\": " << r.preempted << ", \"admitted\": " << r.admitted
    << ", \"generated\": " << r.generated << ", \"proposed_drafts\": " << r.proposed_drafts
    << ", \"accepted_drafts\": " << r.accepted_drafts << ", \"verified\": " << (r.verified ? "true" : "false");
  if (r.verified)
    o << ", \"verify\": {\"passed\": " << (r.verify.passed() ? "true" : "false") << ", \"requests\": "
      << r.verify.requests << ", \"rows\": " << r.verify.rows << ", \"bad_rows\": " << r.verify.bad_rows
      << ", \"max_ratio\": " << num(r.verify.max_ratio) << ", \"max_abs\": " << num(r.verify.max_abs)
      << ", \"ms\": " << num(r.verify_ms) << "}";
  o << "}";
}

void write_paths(std::ofstream& o, const std::vector<StepRow>& rows, const ReportContext& ctx) {
  const auto by_path = path_totals(rows);
  o << "  \"paths\": {";
  bool first = true;
  for (const char* p : kPaths) {
    const auto it = by_path.find(p);
    if (it == by_path.end()) continue;
    const PathTotals& x = it->second;
    bool mem = false;
    const double frac = x.ceiling_fraction(ctx.ceilings, &mem);
    o << (first ? "\n" : ",\n") << "    " << quoted(p) << ": {\"steps\": " << x.steps << ", \"tokens\": " << x.tokens
      << ", \"attention_ms\": " << num(x.attention_ms) << ", \"bytes\": " << num(x.bytes)
      << ", \"kv_bytes\": " << num(x.kv_bytes) << ", \"flops\": " << num(x.flops)
      << ", \"tokens_per_s\": " << num(double(x.tokens) / (x.attention_ms * 1e-3)) << ", \"gbs\": " << num(x.gbs())
      << ", \"tflops\": " << num(x.tflops()) << ", \"ceiling_fraction\": " << (ctx.cuda ? num(frac) : "null")
      << ", \"bound\": " << quoted(mem ? "memory" : "compute") << "}";
    first = false;
  }
  o << "\n  },\n";
}

// The per-path table.
void print_paths(std::FILE* f, std::map<std::string, PathTotals>& by_path, const ReportContext& ctx) {
  std::fprintf(f, "\n%-8s %6s %9s %13s %9s %11s %9s %9s  %s\n", "path", "steps", "tokens", "attention ms", "ms/step",
               "tokens/s", "GB/s", "TFLOP/s", ctx.cuda ? "of ceiling" : "");
  for (const char* p : kPaths) {
    if (!by_path.count(p)) continue;
    const PathTotals& x = by_path[p];
    bool mem = false;
    const double frac = x.ceiling_fraction(ctx.ceilings, &mem);
    std::fprintf(f, "%-8s %6lld %9lld %13.1f %9.2f %11.0f %9.1f %9.2f", p, (long long)x.steps, (long long)x.tokens,
                 x.attention_ms, x.attention_ms / double(x.steps), double(x.tokens) / (x.attention_ms / 1e3), x.gbs(),
                 x.tflops());
    if (ctx.cuda) std::fprintf(f, "  %5.1f%% %s", 100 * frac, mem ? "HBM" : "compute");
    std::fprintf(f, "\n");
  }
  if (ctx.cuda)
    std::fprintf(f, "ceilings: %.0f GB/s HBM, %.0f TFLOP/s (--bw-ceiling-gbs, --tflops-ceiling); of ceiling = max(bytes /"
                 " bandwidth, FLOPs / compute) / attention time, from each step's batch (cost.hpp)\n",
                 ctx.ceilings.bytes_per_s / 1e9, ctx.ceilings.flops_per_s / 1e12);
}

}  // namespace

double PathTotals::ceiling_fraction(const Ceilings& c, bool* memory_bound) const {
  return roofline_ms(StepCost{kv_bytes, bytes, flops}, c, memory_bound) / attention_ms;
}

std::map<std::string, PathTotals> path_totals(const std::vector<StepRow>& rows) {
  std::map<std::string, PathTotals> by_path;
  for (const StepRow& r : rows)
    for (PathTotals* p : {&by_path[r.stats.path], &by_path["total"]}) {
      ++p->steps;
      p->tokens += r.stats.tokens;
      p->attention_ms += r.stats.attention_ms;
      p->bytes += r.cost.bytes;
      p->kv_bytes += r.cost.kv_bytes;
      p->flops += r.cost.flops;
    }
  return by_path;
}

void print_step(std::FILE* f, const StepRow& r) {
  const StepStats& s = r.stats;
  std::fprintf(f, "step %4lld %-6s %-7s| reqs %3lld (dec %3lld pre %2lld) | tok %4lld | run %3lld wait %3lld done %3lld"
               " | attn %7.1f ms | build %5.0f us",
               (long long)r.step, r.kind.c_str(), s.path.c_str(), (long long)s.num_reqs, (long long)s.num_decodes,
               (long long)s.num_prefills, (long long)s.tokens, (long long)r.running, (long long)r.waiting,
               (long long)r.finished, s.attention_ms, s.build_us);
  if (s.cascade_prefix) std::fprintf(f, " | prefix %lld", (long long)s.cascade_prefix);
  if (s.copies) std::fprintf(f, " | cow %lld", (long long)s.copies);
  if (r.proposed_drafts) std::fprintf(f, " | drafts %lld/%lld", (long long)r.accepted_drafts, (long long)r.proposed_drafts);
  if (r.preempted) std::fprintf(f, " | preempted %d", r.preempted);
  if (r.verified)
    std::fprintf(f, " | verify %s (%lld rows, err %.2f)", r.verify.passed() ? "ok" : "FAIL", (long long)r.verify.rows,
                 r.verify.max_ratio);
  std::fprintf(f, "\n");
}

void print_progress(std::FILE* f, const std::vector<StepRow>& rows, int64_t requests, double wall_s) {
  if (rows.empty()) return;
  int64_t tokens = 0;
  double attention_ms = 0;
  for (const StepRow& r : rows) {
    tokens += r.stats.tokens;
    attention_ms += r.stats.attention_ms;
  }
  const StepRow& last = rows.back();
  std::fprintf(f, "progress: step %lld (%zu served) | requests done %lld of %lld, running %lld, waiting %lld | %lld tokens:"
               " %.0f tokens/s wall, %.0f tokens/s attention | %.1f s\n",
               (long long)last.step, rows.size(), (long long)last.finished, (long long)requests, (long long)last.running,
               (long long)last.waiting, (long long)tokens, double(tokens) / wall_s,
               double(tokens) / (attention_ms * 1e-3), wall_s);
}

void print_summary(std::FILE* f, const std::vector<StepRow>& rows, const RunTotals& t, const ReportContext& ctx) {
  auto by_path = path_totals(rows);
  print_paths(f, by_path, ctx);
  int64_t vsteps = 0, vreqs = 0, vrows = 0, vbad = 0, cow = 0, proposed = 0, accepted = 0;
  double vmax = 0, verify_ms = 0, qkv_ms = 0, build_us = 0;
  for (const StepRow& r : rows) {
    cow += r.stats.copies;
    proposed += r.proposed_drafts;
    accepted += r.accepted_drafts;
    qkv_ms += r.stats.qkv_ms;
    build_us += r.stats.build_us;
    if (!r.verified) continue;
    ++vsteps;
    vreqs += r.verify.requests;
    vrows += r.verify.rows;
    vbad += r.verify.bad_rows;
    vmax = std::max(vmax, r.verify.max_ratio);
    verify_ms += r.verify_ms;
  }
  std::fprintf(f, "\nrequests: %lld of %lld finished (%lld in %lld shared-prefix groups); %lld prompt + %lld output tokens;"
               " %lld preemptions\n",
               (long long)t.finished, (long long)t.requests, (long long)t.grouped, (long long)t.groups,
               (long long)t.prompt_tokens, (long long)t.output_tokens, (long long)t.preemptions);
  std::fprintf(f, "speculative: %lld drafts proposed, %lld accepted; copy-on-write: %lld blocks; metadata build: %.0f us/step\n",
               (long long)proposed, (long long)accepted, (long long)cow, build_us / double(std::max<size_t>(1, rows.size())));
  std::fprintf(f, "KV pool: %lld of %lld blocks free at exit%s\n", (long long)t.free_blocks, (long long)t.num_blocks,
               t.free_blocks == t.num_blocks ? " (no leak)" : "");
  const Tolerance tol = tolerance_for(ctx.dtype, ctx.cuda);
  std::fprintf(f, "verification: %lld steps, %lld request checks, %lld rows x layers, %lld bad; max |out-ref|/tol %.3f"
               " (%s: atol %g, rtol %g): %s\n",
               (long long)vsteps, (long long)vreqs, (long long)vrows, (long long)vbad, vmax,
               std::string(flashserve::dtype_name(ctx.dtype)).c_str(), tol.atol, tol.rtol, vbad ? "FAIL" : "PASS");
  std::fprintf(f, "wall time: %.1f s (attention %.1f s, q/k/v generation %.1f s, verification %.1f s)\n", t.wall_s,
               by_path["total"].attention_ms / 1e3, qkv_ms / 1e3, verify_ms / 1e3);
}

void write_json(const std::string& path, const ConfigList& config, const std::vector<StepRow>& rows,
                const RunTotals& t, const ReportContext& ctx) {
  std::ofstream o(path);
  if (!o) throw std::runtime_error("cannot write " + path);
  o << "{\n  \"config\": {";
  for (size_t i = 0; i < config.size(); ++i)
    o << (i ? ", " : "") << quoted(config[i].first) << ": " << quoted(config[i].second);
  o << "},\n  \"totals\": {\"requests\": " << t.requests << ", \"finished\": " << t.finished
    << ", \"prompt_tokens\": " << t.prompt_tokens << ", \"output_tokens\": " << t.output_tokens
    << ", \"preemptions\": " << t.preemptions << ", \"free_blocks\": " << t.free_blocks
    << ", \"num_blocks\": " << t.num_blocks << ", \"wall_s\": " << num(t.wall_s)
    << ", \"verification_passed\": " << (t.verification_passed ? "true" : "false")
    << ", \"completed\": " << (t.completed ? "true" : "false") << "},\n";
  write_paths(o, rows, ctx);
  o << "  \"steps\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    o << "    ";
    write_row(o, rows[i]);
    o << (i + 1 < rows.size() ? ",\n" : "\n");
  }
  o << "  ]\n}\n";
}

}  // namespace serving
