// One serving step over a mixed batch, on the CPU: decode requests (one new token each on a
// long context) and chunked-prefill requests (a chunk of new tokens on some context) share a
// paged KV cache and one varlen_attention call, as a serving engine issues them.
//
//   1. K/V of every token (context + new) go into the paged cache through reshape_and_cache,
//      with blocks handed out in shuffled order; unused slots hold NaN.
//   2. One varlen_attention call over the whole batch (causal, with LSE).
//   3. Checks: the first and last query row of every request against an fp64 computation
//      from the unpaged K/V; and cascade-style splitting: a request's KV split into a prefix
//      (non-causal) and a suffix (causal) pass, merged with merge_states, reproduces the single
//      call within rounding.
//
//   mixed_batch [--seed N] [--requests N]     N requests: every third one is a chunked prefill
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/numeric.hpp"

namespace fs = flashserve;

namespace {

constexpr int64_t kHeads = 8, kKvHeads = 2, kHeadDim = 128, kBlock = 16;
constexpr uint16_t kBf16NaN = 0xFFFF;

struct Options {
  uint64_t seed = 0;
  int requests = 6;
};

struct Request {
  bool decode = true;
  int64_t q_len = 0, context = 0;  // new query tokens; KV tokens already in the cache
  int64_t q_begin = 0;             // first row in q / out
  int64_t kv_begin = 0;            // first row in k_src / v_src
  int64_t kv_len() const { return context + q_len; }
};

// Host buffers of one step. bf16 values are stored as uint16_t.
struct Batch {
  std::vector<Request> req;
  int64_t total_q = 0, total_kv = 0, num_blocks = 0, max_blocks = 0;
  std::vector<int32_t> cu_seqlens_q, seqused_k, block_table;  // [B+1], [B], [B, max_blocks]
  std::vector<int64_t> slot_mapping;                          // [total_kv]
  std::vector<uint16_t> q;                                    // [total_q, H, D]
  std::vector<uint16_t> k_src, v_src;                         // [total_kv, H_kv, D]
  std::vector<uint16_t> k_cache, v_cache;                     // [num_blocks, bs, H_kv, D]
  std::vector<uint16_t> out;                                  // [total_q, H, D]
  std::vector<float> lse;                                     // [H, total_q]
  int64_t batch() const { return int64_t(req.size()); }
};

double elapsed_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

float bf(uint16_t x) { return fs::numeric::bf16_to_float(x); }

bool parse_options(int argc, char** argv, Options& o) {
  std::random_device rd;
  const char* env = std::getenv("FLASHSERVE_SEED");
  o.seed = env ? std::strtoull(env, nullptr, 10) : (uint64_t(rd()) << 32 | rd());
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--seed" && has_value) {
      o.seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--requests" && has_value) {
      o.requests = std::atoi(argv[++i]);
      if (o.requests < 1 || o.requests > 256) {
        std::fprintf(stderr, "--requests: expected 1..256, got %s\n", argv[i]);
        return false;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--seed N] [--requests N]\n", argv[0]);
      return false;
    }
  }
  return true;
}

// Decodes first (as engines order them), then chunked prefills; lengths drawn at random.
std::vector<Request> make_requests(int n, std::mt19937_64& rng) {
  const int prefills = n / 3;
  std::uniform_int_distribution<int64_t> decode_ctx(200, 2000), chunk(64, 256), prefill_ctx(256, 1024);
  std::vector<Request> req(static_cast<size_t>(n));
  int64_t q_rows = 0, kv_rows = 0;
  for (int b = 0; b < n; ++b) {
    Request& r = req[size_t(b)];
    r.decode = b < n - prefills;
    r.q_len = r.decode ? 1 : chunk(rng);
    r.context = r.decode ? decode_ctx(rng) : prefill_ctx(rng);
    r.q_begin = q_rows;
    r.kv_begin = kv_rows;
    q_rows += r.q_len;
    kv_rows += r.kv_len();
  }
  return req;
}

// Block tables over shuffled physical blocks (a few spare ones stay unused), the slot of
// every KV token, and the varlen metadata.
void build_paging(Batch& bt, std::mt19937_64& rng) {
  const int64_t B = bt.batch();
  int64_t needed = 0;
  for (const Request& r : bt.req) {
    needed += (r.kv_len() + kBlock - 1) / kBlock;
    bt.max_blocks = std::max(bt.max_blocks, (r.kv_len() + kBlock - 1) / kBlock);
    bt.total_q += r.q_len;
    bt.total_kv += r.kv_len();
  }
  bt.num_blocks = needed + 8;
  std::vector<int32_t> order(size_t(bt.num_blocks));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int32_t(i);
  std::shuffle(order.begin(), order.end(), rng);

  bt.block_table.assign(size_t(B * bt.max_blocks), 0);
  bt.slot_mapping.resize(size_t(bt.total_kv));
  bt.cu_seqlens_q.assign(1, 0);
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const Request& r = bt.req[size_t(b)];
    int32_t* row = &bt.block_table[size_t(b * bt.max_blocks)];
    for (int64_t j = 0; j * kBlock < r.kv_len(); ++j) row[j] = order[next++];
    for (int64_t t = 0; t < r.kv_len(); ++t)
      bt.slot_mapping[size_t(r.kv_begin + t)] = int64_t(row[t / kBlock]) * kBlock + t % kBlock;
    bt.cu_seqlens_q.push_back(int32_t(r.q_begin + r.q_len));
    bt.seqused_k.push_back(int32_t(r.kv_len()));
  }
}

void fill_bf16(std::vector<uint16_t>& v, size_t n, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  v.resize(n);
  for (auto& x : v) x = fs::numeric::float_to_bf16(d(rng));
}

Batch make_batch(const Options& o, std::mt19937_64& rng) {
  Batch bt;
  bt.req = make_requests(o.requests, rng);
  build_paging(bt, rng);
  // q in [-3, 3] makes the softmax peaked enough that a wrong key shows in the output.
  fill_bf16(bt.q, size_t(bt.total_q * kHeads * kHeadDim), -3.0f, 3.0f, rng);
  fill_bf16(bt.k_src, size_t(bt.total_kv * kKvHeads * kHeadDim), -1.0f, 1.0f, rng);
  fill_bf16(bt.v_src, size_t(bt.total_kv * kKvHeads * kHeadDim), -1.0f, 1.0f, rng);
  const size_t cache_elems = size_t(bt.num_blocks * kBlock * kKvHeads * kHeadDim);
  bt.k_cache.assign(cache_elems, kBf16NaN);
  bt.v_cache.assign(cache_elems, kBf16NaN);
  bt.out.assign(size_t(bt.total_q * kHeads * kHeadDim), kBf16NaN);
  bt.lse.assign(size_t(kHeads * bt.total_q), NAN);
  return bt;
}

fs::TensorRef i32(std::vector<int32_t>& v, std::initializer_list<int64_t> shape) {
  return fs::TensorRef::contiguous(v.data(), fs::DType::i32, shape);
}
fs::TensorRef cache_ref(std::vector<uint16_t>& c, const Batch& bt) {
  return fs::TensorRef::contiguous(c.data(), fs::DType::bf16, {bt.num_blocks, kBlock, kKvHeads, kHeadDim});
}

double write_cache(Batch& bt) {
  fs::CacheWriteParams p;
  p.key = fs::TensorRef::contiguous(bt.k_src.data(), fs::DType::bf16, {bt.total_kv, kKvHeads, kHeadDim});
  p.value = fs::TensorRef::contiguous(bt.v_src.data(), fs::DType::bf16, {bt.total_kv, kKvHeads, kHeadDim});
  p.key_cache = cache_ref(bt.k_cache, bt);
  p.value_cache = cache_ref(bt.v_cache, bt);
  p.slot_mapping = fs::TensorRef::contiguous(bt.slot_mapping.data(), fs::DType::i64, {bt.total_kv});
  const auto t0 = std::chrono::steady_clock::now();
  fs::reshape_and_cache(p);
  return elapsed_ms(t0);
}

// Paged varlen attention over the caches; the caller sets q/out/lse and the batch metadata.
fs::AttentionParams paged_params(Batch& bt) {
  fs::AttentionParams p;
  p.k = cache_ref(bt.k_cache, bt);
  p.v = cache_ref(bt.v_cache, bt);
  p.kv_layout = fs::KvLayout::nhd;
  p.causal = true;
  return p;
}

// Runs the call as an engine would: plan first, workspace sized by the plan. Times the call.
double run_attention(const fs::AttentionParams& p, fs::Plan* plan_out = nullptr) {
  const fs::Plan plan = fs::plan_varlen_attention(p, fs::DeviceProps::cpu());
  std::vector<unsigned char> workspace(plan.workspace.total_bytes);
  fs::ExecContext ctx;
  ctx.workspace = workspace.data();
  ctx.workspace_bytes = workspace.size();
  ctx.plan = &plan;
  const auto t0 = std::chrono::steady_clock::now();
  fs::varlen_attention(p, ctx);
  const double ms = elapsed_ms(t0);
  if (plan_out) *plan_out = plan;
  return ms;
}

double attend_batch(Batch& bt, fs::Plan& plan) {
  fs::AttentionParams p = paged_params(bt);
  p.q = fs::TensorRef::contiguous(bt.q.data(), fs::DType::bf16, {bt.total_q, kHeads, kHeadDim});
  p.out = fs::TensorRef::contiguous(bt.out.data(), fs::DType::bf16, {bt.total_q, kHeads, kHeadDim});
  p.lse = fs::TensorRef::contiguous(bt.lse.data(), fs::DType::f32, {kHeads, bt.total_q});
  p.cu_seqlens_q = i32(bt.cu_seqlens_q, {bt.batch() + 1});
  p.seqused_k = i32(bt.seqused_k, {bt.batch()});
  p.block_table = i32(bt.block_table, {bt.batch(), bt.max_blocks});
  for (const Request& r : bt.req) {
    p.max_seqlen_q = std::max(p.max_seqlen_q, r.q_len);
    p.max_seqlen_k = std::max(p.max_seqlen_k, r.kv_len());
  }
  return run_attention(p, &plan);
}

// fp64 attention of query row i of request b, head h, from the unpaged K/V (causal,
// bottom-right aligned). mass[d] = sum_j p_j |v_jd| bounds the rounding of the weighted sum.
struct RowRef {
  std::vector<double> o, mass;
  double lse = 0;
};

RowRef reference_row(const Batch& bt, const Request& r, int64_t i, int64_t h) {
  const int64_t g = h / (kHeads / kKvHeads), last = i + r.context;  // visible keys 0..last
  const uint16_t* q = &bt.q[size_t(((r.q_begin + i) * kHeads + h) * kHeadDim)];
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  std::vector<double> s(size_t(last + 1));
  double m = -INFINITY;
  for (int64_t j = 0; j <= last; ++j) {
    const uint16_t* k = &bt.k_src[size_t(((r.kv_begin + j) * kKvHeads + g) * kHeadDim)];
    double dot = 0;
    for (int64_t d = 0; d < kHeadDim; ++d) dot += double(bf(q[d])) * double(bf(k[d]));
    s[size_t(j)] = dot * scale;
    m = std::max(m, s[size_t(j)]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - m));
  RowRef ref{std::vector<double>(size_t(kHeadDim)), std::vector<double>(size_t(kHeadDim)), m + std::log(sum)};
  for (int64_t j = 0; j <= last; ++j) {
    const uint16_t* v = &bt.v_src[size_t(((r.kv_begin + j) * kKvHeads + g) * kHeadDim)];
    for (int64_t d = 0; d < kHeadDim; ++d) {
      ref.o[size_t(d)] += s[size_t(j)] / sum * double(bf(v[d]));
      ref.mass[size_t(d)] += s[size_t(j)] / sum * std::fabs(double(bf(v[d])));
    }
  }
  return ref;
}

struct Check {
  double max_out_err = 0, max_lse_err = 0;
  int64_t failures = 0;     // values out of tolerance (NaN included)
  void add(double err, double tol, double& max_err) {
    max_err = std::max(max_err, err);
    if (!(err <= tol)) ++failures;
  }
  void add_out(double got, double want, double tol) { add(std::fabs(got - want), tol, max_out_err); }
  void add_lse(double got, double want) {
    add(std::fabs(got - want), 1e-4 * std::max(1.0, std::fabs(want)), max_lse_err);
  }
  bool ok() const { return failures == 0; }
  const char* verdict() const { return ok() ? "ok" : "MISMATCH"; }
};

// First and last query row of each request, every head: bf16 output within 2^-8 of
// (|ref| + mass), LSE within 1e-4 relative.
Check check_against_fp64(const Batch& bt) {
  Check c;
  for (const Request& r : bt.req) {
    for (int64_t i : {int64_t(0), r.q_len - 1}) {
      for (int64_t h = 0; h < kHeads; ++h) {
        const RowRef ref = reference_row(bt, r, i, h);
        const uint16_t* o = &bt.out[size_t(((r.q_begin + i) * kHeads + h) * kHeadDim)];
        for (int64_t d = 0; d < kHeadDim; ++d)
          c.add_out(bf(o[d]), ref.o[size_t(d)], std::ldexp(std::fabs(ref.o[size_t(d)]) + ref.mass[size_t(d)], -8));
        c.add_lse(bt.lse[size_t(h * bt.total_q + r.q_begin + i)], ref.lse);
      }
    }
  }
  return c;
}

struct CascadeResult {
  int64_t prefix = 0, suffix = 0;
  double prefix_ms = 0, suffix_ms = 0, merge_ms = 0;
  std::vector<uint16_t> o_a, o_b, out;  // prefix, suffix, merged: [q_len, H, D]
  std::vector<float> l_a, l_b, lse;      // [H, q_len]
};

// Request b's KV split at `prefix` tokens (a block multiple, <= its context, so every query
// sees the whole prefix): a non-causal pass over the prefix blocks and a causal pass over
// the remaining ones (slices of its block_table row), merged with merge_states.
CascadeResult run_cascade(Batch& bt, int64_t b, int64_t prefix) {
  const Request& r = bt.req[size_t(b)];
  const int64_t T = r.q_len, n = T * kHeads * kHeadDim;
  CascadeResult res;
  res.prefix = prefix;
  res.suffix = r.kv_len() - prefix;
  for (auto* o : {&res.o_a, &res.o_b, &res.out}) o->assign(size_t(n), kBf16NaN);
  for (auto* l : {&res.l_a, &res.l_b, &res.lse}) l->assign(size_t(kHeads * T), NAN);
  std::vector<int32_t> cu_q = {0, int32_t(T)}, used_a = {int32_t(res.prefix)}, used_b = {int32_t(res.suffix)};
  auto state = [&](std::vector<uint16_t>& o) { return fs::TensorRef::contiguous(o.data(), fs::DType::bf16, {T, kHeads, kHeadDim}); };
  auto lse = [&](std::vector<float>& l) { return fs::TensorRef::contiguous(l.data(), fs::DType::f32, {kHeads, T}); };
  const fs::TensorRef row = i32(bt.block_table, {bt.batch(), bt.max_blocks}).slice(0, b, b + 1);

  fs::AttentionParams p = paged_params(bt);
  p.q = fs::TensorRef::contiguous(&bt.q[size_t(r.q_begin * kHeads * kHeadDim)], fs::DType::bf16, {T, kHeads, kHeadDim});
  p.cu_seqlens_q = i32(cu_q, {2});
  p.max_seqlen_q = T;

  p.out = state(res.o_a);
  p.lse = lse(res.l_a);
  p.causal = false;
  p.block_table = row.slice(1, 0, prefix / kBlock);
  p.seqused_k = i32(used_a, {1});
  p.max_seqlen_k = res.prefix;
  res.prefix_ms = run_attention(p);

  p.out = state(res.o_b);
  p.lse = lse(res.l_b);
  p.causal = true;
  p.block_table = row.slice(1, prefix / kBlock, bt.max_blocks);
  p.seqused_k = i32(used_b, {1});
  p.max_seqlen_k = res.suffix;
  res.suffix_ms = run_attention(p);

  fs::MergeParams mp;
  mp.out = state(res.out);
  mp.out_lse = lse(res.lse);
  mp.a_out = state(res.o_a);
  mp.a_lse = lse(res.l_a);
  mp.b_out = state(res.o_b);
  mp.b_lse = lse(res.l_b);
  const auto t0 = std::chrono::steady_clock::now();
  fs::merge_states(mp);
  res.merge_ms = elapsed_ms(t0);
  return res;
}

// The merged state against the single call's rows. The partial outputs and the merged one
// are each rounded to bf16 once (2^-9 relative), the single call's once: 2^-7 of the largest
// magnitude covers it.
Check compare_cascade(const Batch& bt, const Request& r, const CascadeResult& c) {
  Check check;
  const uint16_t* full = &bt.out[size_t(r.q_begin * kHeads * kHeadDim)];
  for (int64_t t = 0; t < r.q_len; ++t) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t d = 0; d < kHeadDim; ++d) {
        const size_t i = size_t((t * kHeads + h) * kHeadDim + d);
        const double want = bf(full[i]);
        const double mag = std::max({std::fabs(want), std::fabs(double(bf(c.o_a[i]))), std::fabs(double(bf(c.o_b[i])))});
        check.add_out(bf(c.out[i]), want, std::ldexp(mag, -7) + 1e-6);
      }
      check.add_lse(c.lse[size_t(h * r.q_len + t)], bt.lse[size_t(h * bt.total_q + r.q_begin + t)]);
    }
  }
  return check;
}

void print_requests(const Batch& bt) {
  std::printf("%4s  %-8s %8s %8s %7s %7s %10s %17s\n", "req", "kind", "q_tokens", "context", "kv_len",
              "blocks", "|out|", "lse min .. max");
  for (int64_t b = 0; b < bt.batch(); ++b) {
    const Request& r = bt.req[size_t(b)];
    double norm = 0;
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t i = r.q_begin * kHeads * kHeadDim; i < (r.q_begin + r.q_len) * kHeads * kHeadDim; ++i)
      norm += double(bf(bt.out[size_t(i)])) * bf(bt.out[size_t(i)]);
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t t = r.q_begin; t < r.q_begin + r.q_len; ++t) {
        lo = std::min(lo, bt.lse[size_t(h * bt.total_q + t)]);
        hi = std::max(hi, bt.lse[size_t(h * bt.total_q + t)]);
      }
    std::printf("%4lld  %-8s %8lld %8lld %7lld %7lld %10.4f %8.3f .. %.3f\n", (long long)b,
                r.decode ? "decode" : "prefill", (long long)r.q_len, (long long)r.context,
                (long long)r.kv_len(), (long long)((r.kv_len() + kBlock - 1) / kBlock), std::sqrt(norm), lo, hi);
  }
}

bool report_cascade(Batch& bt, int64_t b) {
  const Request& r = bt.req[size_t(b)];
  const int64_t prefix = std::min(r.context, r.kv_len() / 2) / kBlock * kBlock;
  if (prefix == 0) return true;
  const CascadeResult c = run_cascade(bt, b, prefix);
  const Check check = compare_cascade(bt, r, c);
  std::printf("cascade, request %lld (%s): prefix %lld + suffix %lld KV tokens; prefix pass %.3f ms, "
              "suffix pass %.3f ms, merge_states %.3f ms; max |dout| %.2e, max |dlse| %.2e: %s\n",
              (long long)b, r.decode ? "decode" : "prefill", (long long)c.prefix, (long long)c.suffix,
              c.prefix_ms, c.suffix_ms, c.merge_ms, check.max_out_err, check.max_lse_err, check.verdict());
  if (!check.ok()) std::printf("  %lld values out of tolerance\n", (long long)check.failures);
  return check.ok();
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!parse_options(argc, argv, opt)) return 2;
  std::mt19937_64 rng(opt.seed);
  Batch bt = make_batch(opt, rng);
  const int64_t prefills = opt.requests / 3;
  std::printf("flashserve mixed batch: %d requests (%lld decode, %lld chunked prefill), H=%lld H_kv=%lld "
              "D=%lld, bf16, paged KV (block %lld, %lld blocks, NHD), seed %llu\n",
              opt.requests, (long long)(opt.requests - prefills), (long long)prefills, (long long)kHeads,
              (long long)kKvHeads, (long long)kHeadDim, (long long)kBlock, (long long)bt.num_blocks,
              (unsigned long long)opt.seed);

  try {
    const double cache_ms = write_cache(bt);
    std::printf("reshape_and_cache: %lld tokens in %.3f ms\n", (long long)bt.total_kv, cache_ms);
    fs::Plan plan;
    const double attn_ms = attend_batch(bt, plan);
    std::printf("varlen_attention: %lld query rows over %lld KV tokens in %.3f ms (plan: %d KV splits, "
                "workspace %zu bytes)\n", (long long)bt.total_q, (long long)bt.total_kv, attn_ms,
                plan.num_splits, plan.workspace.total_bytes);
    print_requests(bt);

    const Check ref = check_against_fp64(bt);
    std::printf("fp64 check, first and last query row of each request: max |dout| %.2e, max |dlse| %.2e: %s\n",
                ref.max_out_err, ref.max_lse_err, ref.verdict());
    if (!ref.ok()) std::printf("  %lld values out of tolerance\n", (long long)ref.failures);
    bool pass = ref.ok();
    pass = report_cascade(bt, 0) && pass;
    const int64_t first_prefill = opt.requests - prefills;
    if (prefills > 0) pass = report_cascade(bt, first_prefill) && pass;
    std::printf("verification: %s\n", pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    std::printf("verification: FAIL\n");
    return 1;
  }
}
