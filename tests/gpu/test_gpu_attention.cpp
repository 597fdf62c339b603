// CUDA attention against the fp64 oracle and the CPU reference (tests/cpp/naive's generator and
// comparison): >= 1000 random configurations per run (fresh seed, printed), mirrored to the
// device with their strides, padding and NaN-poisoned unused KV; outputs poisoned, run, copied
// back. Edge cases: zero-length sequences, fully masked rows, block size 1, one token, a
// too-small workspace or a foreign plan (an Error before any write), out-of-range block
// indices and cache rows (NaN rows exactly where the bad keys are visible).
// Reproduce a fuzz failure with FLASHSERVE_SEED=<seed> FLASHSERVE_FUZZ_CASE=<case>.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "flashserve/status.hpp"
#include "gpu_attention_case.hpp"
#include "kernels/attention/select.hpp"
#include "kernels/device_info.hpp"

using flashserve::DType;
using fstest::CaseConfig;
using fstest::KvMode;
namespace fs = flashserve;

namespace {

constexpr uint64_t kSalt = 0x6a7e4c0da11ull;
constexpr int kCases = 1000;
constexpr int kMaxReported = 5;
std::string plan_summary(const fs::Plan& p) {
  return "plan: num_splits=" + std::to_string(p.num_splits) + " granularity=" + std::to_string(p.split_granularity) +
         " workspace=" + std::to_string(p.workspace.total_bytes) + " bytes";
}

// Builds, runs on the CPU (reference, under the GPU plan) and on the GPU; returns "" when the
// GPU agrees with the oracle and with the reference. `own_plan`: the call makes its own plan.
std::string run_and_check(fstest::AttentionCase& ac, bool own_plan = false, std::string* served = nullptr) {
  fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
  fs::Plan plan;
  try {
    plan = fsgpu::plan_case(ac, dc.params);
  } catch (const std::exception& e) {
    return std::string("planning threw: ") + e.what();
  }
  std::pair<fstest::HostTensor, fstest::HostTensor> cpu;
  try {
    cpu = fsgpu::run_cpu(ac, plan);
  } catch (const std::exception& e) {
    return std::string("the CPU reference threw: ") + e.what();
  }
  const auto ws = fsgpu::device_alloc(plan.workspace.total_bytes);
  fs::ExecContext ctx;
  ctx.workspace = ws.get();
  ctx.workspace_bytes = plan.workspace.total_bytes;
  ctx.plan = own_plan ? nullptr : &plan;
  try {
    fsgpu::run_gpu(ac, dc, ctx);
  } catch (const std::exception& e) {
    return plan_summary(plan) + "\nthe CUDA call threw: " + e.what();
  }
  const std::string kernel = fs::attention_kernel_name(dc.params, ac.cfg.batched(), fs::kernels::cuda_device_props(0));
  if (served) *served = kernel;
  const fstest::KernelError kerr = fsgpu::kernel_error(kernel, ac.cfg);
  std::string err = fstest::check_case(ac, kerr);
  err += fsgpu::compare_with_cpu(ac, cpu.first, cpu.second, fsgpu::kernel_rounds_p(kernel, ac.cfg), kerr);
  return err.empty() ? err : plan_summary(plan) + "\n" + err;
}

void expect_gpu_matches(const CaseConfig& c, uint64_t salt) {
  auto rng = fstest::make_rng(salt);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  EXPECT_EQ(run_and_check(ac), "") << fstest::describe(c) << "\n(seed " << fstest::test_seed() << ")";
}

}  // namespace

TEST(GpuAttentionFuzz, MatchesOracleAndReference) {
  const auto t0 = std::chrono::steady_clock::now();
  int first = 0, last = kCases;
  if (const char* one = std::getenv("FLASHSERVE_FUZZ_CASE")) first = std::atoi(one), last = first + 1;
  const char* count = std::getenv("FLASHSERVE_FUZZ_CASES");  // reduced runs (sanitizers)
  if (count) last = first + std::max(1, std::atoi(count));
  int ran = 0, failed = 0, split_cases = 0;
  std::map<std::string, int> served;  // cases per serving kernel (fp8 / int8 caches apart): the coverage
  for (int i = first; i < last && failed < kMaxReported; ++i) {
    auto rng = fstest::make_rng(kSalt + uint64_t(i) * 0x9e3779b97f4a7c15ull);
    const CaseConfig cfg = fstest::random_case_config(rng);
    fstest::AttentionCase ac = fstest::build_case(cfg, rng);
    std::string kernel;
    const std::string err = run_and_check(ac, i % 7 == 3, &kernel);
    ++ran;
    ++served[kernel.empty() ? "(none)"
             : kernel + (fs::is_fp8(cfg.kv_dtype)                            ? "/fp8-kv"
                         : cfg.quant == fstest::QuantMode::int8_k8v8  ? "/int8-k8v8"
                         : cfg.quant == fstest::QuantMode::int8_k8v16 ? "/int8-k8v16"
                                                                       : "")];
    split_cases += cfg.num_splits > 1;
    if (err.empty()) continue;
    ++failed;
    ADD_FAILURE() << "case " << i << " (rerun: FLASHSERVE_SEED=" << fstest::test_seed()
                  << " FLASHSERVE_FUZZ_CASE=" << i << ")\n  " << fstest::describe(cfg) << "\n" << err;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[gpu fuzz] %d cases (%d with forced splits) in %.1f s, %d failed, seed %llu\n", ran, split_cases,
              secs, failed, static_cast<unsigned long long>(fstest::test_seed()));
  std::printf("[gpu fuzz] cases per kernel:");
  for (const auto& [k, n] : served) std::printf(" %s %d", k.c_str(), n);
  std::printf("\n");
  if (!count && last - first > 1 && failed == 0) EXPECT_GE(ran, 1000);
}

namespace {

// The instantiation table of the tensor-core prefill kernel the selection tries first on device 0
// (empty when neither applies).
std::vector<fs::kernels::PrefillConfig> prefill_table() {
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  using fs::kernels::AttnKernelId;
  if (FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0 &&
      !fs::kernels::kernel_disabled(AttnKernelId::prefill_wgmma))
    return {std::begin(fs::kernels::kPrefillWgmmaConfigs), std::end(fs::kernels::kPrefillWgmmaConfigs)};
  if (dev.cc_major >= 8 && !fs::kernels::kernel_disabled(AttnKernelId::prefill_mma))
    return {std::begin(fs::kernels::kPrefillConfigs), std::end(fs::kernels::kPrefillConfigs)};
  return {};
}

// A fuzz configuration pulled into the tensor-core prefill kernels' scope: a built (dtype, D, Dv),
// unquantized, no q_v, out of q's dtype (fp32 out, the cascade's and MLA chunks' partials, is
// test_gpu_prefill's: its precision is checked there against the oracle), 16-byte aligned rows
// (paddings in whole 8-element steps); lengths, layouts, splits and every score modifier as drawn.
void into_prefill_scope(CaseConfig& c, const fs::kernels::PrefillConfig& e) {
  c.quant = fstest::QuantMode::none;
  c.has_qv = false;
  c.q_dtype = c.kv_dtype = c.out_dtype = e.dtype;
  c.D = e.head_dim, c.Dv = e.dv();
  auto whole = [](int64_t pad) { return (pad + 7) / 8 * 8; };
  c.q_pad = whole(c.q_pad), c.out_pad = whole(c.out_pad), c.kv_pad = whole(c.kv_pad);
}

// Every fourth D = 64 case of a varlen batch: its first sequence stretched to 129-187 query rows
// (and at least as many keys), so that max_seqlen_q (with the fuzz's slack of up to 5) picks
// prefill_tma's 192-row CTAs (select.hpp: prefill_tma_rows) on Hopper: the three-warpgroup
// instantiation under the fuzz's layouts and modifiers, not only test_gpu_prefill's cases.
void stretch_for_tall_tiles(CaseConfig& c, int i, size_t table_size) {
  if (c.D != 64 || c.Dv != 64 || c.batched() || c.q_lens.empty() || (size_t(i) / table_size) % 4 != 1) return;
  c.q_lens[0] = 129 + (int64_t(i) * 37) % 59;
  c.k_lens[0] = std::max(c.k_lens[0], c.q_lens[0]) + (i % 3) * 17;
}

}  // namespace

// The tensor-core prefill kernels' instantiations (each head size of the device's table, plain
// and ALiBi) under the fuzz's random batches and score modifiers (soft-cap,
// ALiBi linear and sqrt, causal, window, chunk, sinks, splits): 300 configurations drawn as the
// fuzz draws them and pulled into the kernels' scope, each served by a tensor-core kernel (or
// decode) and checked as the fuzz checks; at D = 64 some with a sequence of one 192-row tile
// (stretch_for_tall_tiles).
TEST(GpuAttentionFuzz, PrefillKernelsMatchOracleAndReference) {
  const std::vector<fs::kernels::PrefillConfig> table = prefill_table();
  if (table.empty()) GTEST_SKIP() << "no tensor-core prefill kernel on this device";
  int failed = 0, generic = 0;
  for (int i = 0; i < 300 && failed < kMaxReported; ++i) {
    auto rng = fstest::make_rng((kSalt ^ 0x7e5f11ull) + uint64_t(i) * 0x9e3779b97f4a7c15ull);
    CaseConfig cfg = fstest::random_case_config(rng);
    into_prefill_scope(cfg, table[size_t(i) % table.size()]);
    stretch_for_tall_tiles(cfg, i, table.size());
    fstest::AttentionCase ac = fstest::build_case(cfg, rng);
    const std::string kernel = fs::attention_kernel_name(ac.params, cfg.batched(), fs::kernels::cuda_device_props(0));
    if (kernel == "generic" && generic++ < kMaxReported)
      ADD_FAILURE() << "case " << i << " served by the generic kernel\n  " << fstest::describe(cfg);
    const std::string err = run_and_check(ac);
    if (err.empty()) continue;
    ++failed;
    ADD_FAILURE() << "case " << i << " (kernel " << kernel << "; rerun: FLASHSERVE_SEED=" << fstest::test_seed()
                  << ")\n  " << fstest::describe(cfg) << "\n" << err;
  }
}

TEST(GpuAttentionEdge, ZeroLengthSequences) {
  for (KvMode mode : fstest::kAllKvModes)
    for (int splits : {1, 3}) {
      CaseConfig c = fstest::small_case_config(mode, {3, 0, 4, 0, 2, 0}, {5, 7, 0, 0, 9, 3});
      c.num_splits = splits;
      c.causal = splits == 3;
      expect_gpu_matches(c, 1);
    }
  for (KvMode mode : {KvMode::batched_paged, KvMode::batched_contiguous}) {
    expect_gpu_matches(fstest::small_case_config(mode, {0}, {4, 6}), 2);
    expect_gpu_matches(fstest::small_case_config(mode, {2}, {0, 0, 0}), 3);
  }
}

// Rows that see no key: out exactly 0 and lse -inf, or the sink's logit with a sink.
TEST(GpuAttentionEdge, FullyMaskedRows) {
  for (KvMode mode : fstest::kAllKvModes)
    for (bool sinks : {false, true}) {
      CaseConfig c = fstest::small_case_config(mode, {6, 3}, {2, 5});  // causal, sq > sk: leading rows see nothing
      c.causal = true;
      c.sinks = sinks;
      expect_gpu_matches(c, 4);
      c.causal = false;
      c.chunk = 4;  // i' < 0 in chunk -1 (floor division)
      expect_gpu_matches(c, 5);
      c.chunk = 0;
      c.window = {0, 0};
      c.q_lens = c.batched() ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{2, 1};
      c.k_lens = {0, 3};
      c.num_splits = 2;
      expect_gpu_matches(c, 6);
    }
}

TEST(GpuAttentionEdge, BlockSizeOneAndOneToken) {
  for (KvMode mode : {KvMode::varlen_paged, KvMode::batched_paged})
    for (int splits : {1, 2, 5}) {
      CaseConfig c = fstest::small_case_config(mode, {1, 4, 1}, {37, 1, 300});
      c.block_size = 1;
      c.random_block_ids = true;
      c.num_splits = splits;
      c.layout = splits == 2 ? fs::KvLayout::hnd : fs::KvLayout::nhd;
      expect_gpu_matches(c, 7);
    }
  for (KvMode mode : fstest::kAllKvModes) {
    CaseConfig c = fstest::small_case_config(mode, {1}, {1});
    c.block_size = 1;
    expect_gpu_matches(c, 8);
  }
}

// Long KV with every split count, GQA decode packing, MLA head sizes and D = 256.
TEST(GpuAttentionEdge, LongSplitsAndWideHeads) {
  for (int splits : {1, 2, 3, 7, 16}) {
    CaseConfig c = fstest::small_case_config(KvMode::varlen_paged, {1, 1, 5}, {2000, 700, 1290});
    c.H = 16, c.H_kv = 2;
    c.q_dtype = c.kv_dtype = c.out_dtype = DType::bf16;
    c.num_splits = splits;
    c.sinks = splits % 2 == 1;
    c.causal = true;
    expect_gpu_matches(c, 9);
  }
  struct Heads { int64_t D, Dv; bool qv; };
  for (Heads hd : {Heads{256, 256, false}, Heads{192, 128, false}, Heads{64, 512, true}, Heads{40, 40, false}})
    for (int splits : {1, 4}) {
      CaseConfig c = fstest::small_case_config(KvMode::batched_paged, {2}, {300, 129});
      c.D = hd.D, c.Dv = hd.Dv, c.has_qv = hd.qv;
      c.H = 8, c.H_kv = 1;
      c.q_dtype = c.out_dtype = DType::f16;
      c.kv_dtype = hd.qv ? DType::f16 : DType::f8e4m3;
      c.quant = hd.qv ? fstest::QuantMode::none : fstest::QuantMode::fp8_kv;
      c.num_splits = splits;
      expect_gpu_matches(c, 10);
    }
}

namespace {

// A case with forced splits whose plan needs a workspace.
fstest::AttentionCase split_case(uint64_t salt, int64_t k_len) {
  CaseConfig c = fstest::small_case_config(KvMode::varlen_paged, {2, 1}, {k_len, 300});
  c.num_splits = 4;
  auto rng = fstest::make_rng(salt);
  return fstest::build_case(c, rng);
}

bool all_poison(const fstest::HostTensor& h) {
  for (unsigned char x : *h.bytes)
    if (x != 0xFF) return false;
  return true;
}

// Runs a call that must throw flashserve::Error starting with `prefix` and write nothing.
void expect_rejected(fstest::AttentionCase& ac, const fsgpu::DeviceCase& dc, const fs::ExecContext& ctx,
                     const std::string& prefix) {
  fsgpu::poison(dc.mirror_of(ac.out));
  fsgpu::poison(dc.mirror_of(ac.lse));
  try {
    fsgpu::call(ac, dc.params, ctx);
    ADD_FAILURE() << "accepted; expected an error starting with \"" << prefix << "\"";
  } catch (const fs::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
  fsgpu::sync();
  dc.mirror_of(ac.out).copy_to(ac.out);
  dc.mirror_of(ac.lse).copy_to(ac.lse);
  EXPECT_TRUE(all_poison(ac.out)) << "out was written by a rejected call";
  EXPECT_TRUE(all_poison(ac.lse)) << "lse was written by a rejected call";
}

}  // namespace

TEST(GpuAttentionErrors, WorkspaceTooSmallWritesNothing) {
  fstest::AttentionCase ac = split_case(11, 900);
  const fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
  const fs::Plan plan = fsgpu::plan_case(ac, dc.params);
  ASSERT_GT(plan.num_splits, 1);
  ASSERT_GT(plan.workspace.total_bytes, 0u);
  const auto ws = fsgpu::device_alloc(plan.workspace.total_bytes);
  fs::ExecContext ctx;
  ctx.workspace = ws.get();
  ctx.workspace_bytes = plan.workspace.total_bytes - 1;
  ctx.plan = &plan;
  expect_rejected(ac, dc, ctx, "workspace: expected at least " + std::to_string(plan.workspace.total_bytes) + " bytes");
  ctx.plan = nullptr;  // the call's own plan needs the same
  expect_rejected(ac, dc, ctx, "workspace: expected at least");
  ctx.workspace_bytes = plan.workspace.total_bytes;
  ctx.validate_only = true;  // a dry run with enough workspace: no error, nothing written
  fsgpu::poison(dc.mirror_of(ac.out));
  fsgpu::call(ac, dc.params, ctx);
  fsgpu::sync();
  dc.mirror_of(ac.out).copy_to(ac.out);
  EXPECT_TRUE(all_poison(ac.out)) << "validate_only wrote out";
}

TEST(GpuAttentionErrors, PlanForAnotherShapeOrDevice) {
  fstest::AttentionCase ac = split_case(12, 900);
  fstest::AttentionCase other = split_case(12, 1500);  // another max_seqlen_k
  const fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
  const fs::Plan foreign = fsgpu::plan_case(other, fsgpu::mirror_case(other).params);
  const auto ws = fsgpu::device_alloc(foreign.workspace.total_bytes + (1 << 20));
  fs::ExecContext ctx;
  ctx.workspace = ws.get();
  ctx.workspace_bytes = foreign.workspace.total_bytes + (1 << 20);
  ctx.plan = &foreign;
  expect_rejected(ac, dc, ctx, "scheduler_metadata: expected a plan made for");
  const fs::Plan cpu_plan = fs::plan_varlen_attention(ac.params, fs::DeviceProps::cpu());  // no workspace buffers
  ASSERT_GT(cpu_plan.num_splits, 1);
  ctx.plan = &cpu_plan;
  expect_rejected(ac, dc, ctx, "scheduler_metadata: expected a plan made for a CUDA device");
}

namespace {

// Whether row i of sequence b sees any key in [k0, k1).
bool sees_any(const fstest::AttentionCase& ac, int64_t b, int64_t i, int64_t k0, int64_t k1) {
  const fstest::NaiveSequence& s = ac.seqs[size_t(b)];
  for (int64_t t = k0; t < std::min(k1, s.sk); ++t)
    if (fstest::naive_visible(ac.feats[size_t(b)], i, t, s.sq, s.sk)) return true;
  return false;
}

// After corrupting sequence `bad_b`'s keys [k0, k1) on the device: rows that see one of them
// are NaN in every channel (and lse), every other row matches the CPU reference of the
// uncorrupted case.
void expect_nan_rows(fstest::AttentionCase& ac, const std::pair<fstest::HostTensor, fstest::HostTensor>& cpu,
                     int64_t bad_b, int64_t k0, int64_t k1, const std::string& what) {
  const CaseConfig& c = ac.cfg;
  int64_t nan_rows = 0, wrong = 0;
  for (int64_t b = 0; b < c.batch(); ++b) {
    const fstest::NaiveSequence& s = ac.seqs[size_t(b)];
    for (int64_t i = 0; i < s.sq; ++i)
      for (int64_t h = 0; h < s.H; ++h) {
        const bool want_nan = b == bad_b && sees_any(ac, b, i, k0, k1);
        const int64_t row = c.batched() ? i : ac.q_row0[size_t(b)] + i;
        for (int64_t d = 0; d < s.Dv; ++d) {
          const float x = c.batched() ? ac.out.get({b, i, h, d}) : ac.out.get({row, h, d});
          const float y = c.batched() ? cpu.first.get({b, i, h, d}) : cpu.first.get({row, h, d});
          const bool ok = want_nan ? std::isnan(x) : std::fabs(double(x) - double(y)) <= 1e-5 * (1.0 + std::fabs(y));
          if (!ok && wrong++ < 5)
            ADD_FAILURE() << what << ": b=" << b << " i=" << i << " h=" << h << " d=" << d << " got " << x
                          << (want_nan ? ", want NaN" : ", want ") << (want_nan ? 0.0f : y);
        }
        const float l = c.batched() ? *static_cast<const float*>(ac.lse.ref.at(b, h, i))
                                    : *static_cast<const float*>(ac.lse.ref.at(h, row));
        if (want_nan && !std::isnan(l) && wrong++ < 5) ADD_FAILURE() << what << ": lse not NaN at b=" << b << " i=" << i;
        nan_rows += want_nan;
      }
  }
  EXPECT_GT(nan_rows, 0) << what << ": the test corrupts no visible key";
  EXPECT_EQ(wrong, 0) << what << "\n" << fstest::describe(c);
}

}  // namespace

// Block indices outside [0, num_blocks) (and cache rows outside the cache) are never read:
// the keys they hold become NaN, so exactly the rows that see them are NaN.
TEST(GpuAttentionErrors, OutOfRangeBlockIndexGivesNanRows) {
  for (KvMode mode : {KvMode::varlen_paged, KvMode::batched_paged})
    for (int splits : {1, 3})
      for (int bad_id : {-1, 1 << 20}) {
        CaseConfig c = fstest::small_case_config(mode, {3, 5, 2}, {10, 13, 7});
        c.block_size = 4;
        c.causal = true;
        c.num_splits = splits;
        auto rng = fstest::make_rng(13);
        fstest::AttentionCase ac = fstest::build_case(c, rng);
        const fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
        const fs::Plan plan = fsgpu::plan_case(ac, dc.params);
        const auto cpu = fsgpu::run_cpu(ac, plan);
        // Sequence 1's block column 3 holds key 12, seen only by its last row(s).
        *static_cast<int32_t*>(ac.params.block_table->at(1, 3)) = bad_id;
        dc.upload(ac);
        const auto ws = fsgpu::device_alloc(plan.workspace.total_bytes);
        fs::ExecContext ctx;
        ctx.workspace = ws.get();
        ctx.workspace_bytes = plan.workspace.total_bytes;
        ctx.plan = &plan;
        fsgpu::run_gpu(ac, dc, ctx);
        expect_nan_rows(ac, cpu, 1, 12, 16, "block id " + std::to_string(bad_id) + " splits " + std::to_string(splits));
      }
  // A contiguous cache row outside the cache (cache_batch_idx past B_cache).
  CaseConfig c = fstest::small_case_config(KvMode::batched_contiguous, {2}, {6, 9, 4});
  c.use_cache_batch_idx = true;
  auto rng = fstest::make_rng(14);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  const fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
  const fs::Plan plan = fsgpu::plan_case(ac, dc.params);
  const auto cpu = fsgpu::run_cpu(ac, plan);
  *static_cast<int32_t*>(ac.params.cache_batch_idx->at(1)) = 1000;
  dc.upload(ac);
  fsgpu::run_gpu(ac, dc, fs::ExecContext{});
  expect_nan_rows(ac, cpu, 1, 0, 9, "cache_batch_idx 1000");
}

// Context parallelism (not drawn by the fuzz generator): rank r of W holds global keys
// r, r + W, ... (interleave 1) or runs of I keys dealt round-robin (position t on rank
// (t / I) % W); masks and ALiBi use global positions. Compared with the CPU reference.
TEST(GpuAttentionEdge, ContextParallelMatchesReference) {
  const std::vector<int64_t> global = {40, 7, 300};
  for (int64_t il : {1, 16, 5})
  for (int world : {2, 3})
    for (int rank = 0; rank < world; ++rank)
      for (int variant = 0; variant < 3; ++variant) {
        std::vector<int64_t> local;
        for (int64_t g : global) {
          int64_t n = 0;
          for (int64_t t = 0; t < g; ++t) n += (t / il) % world == rank;
          local.push_back(n);
        }
        CaseConfig c = fstest::small_case_config(variant == 2 ? KvMode::batched_paged : KvMode::varlen_paged, {3, 1, 6}, local);
        c.causal = variant != 1;
        if (variant == 1) c.window = {20, 3};
        c.alibi = variant == 2 ? 1 : 0;
        c.num_splits = variant + 1;
        auto rng = fstest::make_rng(15);
        fstest::AttentionCase ac = fstest::build_case(c, rng);
        fsgpu::set_context_parallel(ac, global, world, rank, il);
        std::string kernel;
        EXPECT_EQ(fsgpu::match_cpu_reference(ac, kernel), "")
            << "world " << world << " rank " << rank << " interleave " << il << " variant " << variant << "\n"
            << fstest::describe(c);
      }
}
