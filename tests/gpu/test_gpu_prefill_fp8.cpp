// The sm_90a fp8 prefill kernel (kernels/attention/prefill_fp8.cuh: q, k, v fp8 e4m3 with
// descales, what vLLM and SGLang send with an fp8 KV cache) against the fp64 oracle and the CPU
// reference under the same plan, with the kernel's error model (fsgpu::kernel_error: P in e4m3,
// 2^-4 relative; q.k accumulated by fp8 wgmma) and, as a check of systematic error that model's
// bound would hide, the relative error ||out - ref|| / ||ref|| against the reference < 4e-2 (e4m3
// P alone gives ~2.5%: its rounding is ~2^-5 of each weight, whatever the row length).
// Every in-scope case must be served by prefill_fp8 on a 9.0 device of an sm_90a build:
// varlen and batched, contiguous and paged (block sizes 16 .. 256, NHD and HND, random block
// ids), causal and not, chunked prefill, GQA, splits (fp32 partials), out bf16 / f16 / fp32,
// the modifiers it takes (window, soft-cap, sinks, chunked local), descale broadcasts, and
// block ids outside the cache (NaN rows). Problems outside its scope (e5m2, a 16-bit q over an
// fp8 cache, D = 64, ALiBi, block size 80) must go elsewhere and still match. ctest runs the
// binary again with the persistent form forced on (prefix persistent.) and off (prefix onecta.).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_attention_case.hpp"
#include "kernels/attention/select.hpp"

using flashserve::DType;
using fstest::CaseConfig;
using fstest::KvMode;
namespace fs = flashserve;

namespace {

// An fp8 q/k/v D = 128 prefill configuration with LSE, out bf16.
CaseConfig fp8_config(KvMode mode, std::vector<int64_t> q_lens, std::vector<int64_t> k_lens, int64_t H, int64_t H_kv) {
  CaseConfig c = fsgpu::prefill_case_config(mode, std::move(q_lens), std::move(k_lens), H, H_kv, DType::f8e4m3);
  c.quant = fstest::QuantMode::fp8_qkv;
  c.out_dtype = DType::bf16;
  return c;
}

bool hopper() {
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  return FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0 &&
         !fs::kernels::kernel_disabled(fs::kernels::AttnKernelId::prefill_fp8);
}

// The oracle and the CPU reference (element by element, and relative error < 4e-2).
std::string run_and_check(fstest::AttentionCase& ac, std::string& kernel) {
  return fsgpu::check_prefill_case(ac, kernel, 4e-2, true);
}

// Checks the case and that prefill_fp8 serves it on Hopper (`want_fp8`), or that it does not.
void expect_fp8_matches(const CaseConfig& c, uint64_t salt, bool want_fp8 = true) {
  auto rng = fstest::make_rng(salt);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  std::string kernel;
  EXPECT_EQ(run_and_check(ac, kernel), "") << fstest::describe(c) << "\n(seed " << fstest::test_seed() << ")";
  if (want_fp8 && hopper()) EXPECT_EQ(kernel, "prefill_fp8") << fstest::describe(c);
  if (!want_fp8) EXPECT_NE(kernel, "prefill_fp8") << fstest::describe(c);
}

}  // namespace

TEST(GpuPrefillFp8, VarlenCausalAndGqa) {
  const std::vector<int64_t> q = {1, 130, 777, 1100, 64, 129};
  struct Variant { bool causal; int64_t H_kv; };
  for (Variant v : {Variant{true, 4}, Variant{true, 1}, Variant{false, 2}}) {
    CaseConfig c = fp8_config(KvMode::varlen_contiguous, q, q, 4, v.H_kv);
    c.causal = v.causal;
    expect_fp8_matches(c, 1);
  }
  CaseConfig c = fp8_config(KvMode::varlen_contiguous, {200, 3, 90}, {3000, 70, 90}, 8, 1);  // chunked prefill
  c.causal = true;
  expect_fp8_matches(c, 2);
}

TEST(GpuPrefillFp8, PagedBlockSizes) {
  int variant = 0;
  for (int64_t bs : {16, 64, 128, 256})
    for (fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
      CaseConfig c = fp8_config(KvMode::varlen_paged, {300, 17, 129, 1}, {700, 17, 300, 40}, 4, 2);
      c.block_size = bs;
      c.layout = layout;
      c.random_block_ids = true;
      c.causal = variant % 2 == 0;
      c.num_splits = variant % 3 == 1 ? 3 : 1;
      expect_fp8_matches(c, 10 + uint64_t(variant++));
    }
  CaseConfig c = fp8_config(KvMode::batched_paged, {150}, {150, 400, 9}, 4, 4);
  c.block_size = 32;
  c.causal = true;
  expect_fp8_matches(c, 20);
}

// Out f16 and fp32 (the partials of cascade), splits, descale broadcasts, batched contiguous.
TEST(GpuPrefillFp8, OutDtypesSplitsAndDescales) {
  int variant = 0;
  for (DType ot : {DType::f16, DType::f32, DType::bf16})
    for (int broadcast : {0, 1, 2}) {
      CaseConfig c = fp8_config(variant % 2 ? KvMode::batched_contiguous : KvMode::varlen_contiguous, {260, 33},
                                {600, 33}, 4, 2);
      c.out_dtype = ot;
      c.descale_broadcast = broadcast;
      c.causal = variant % 3 != 2;
      c.num_splits = variant % 2 ? 2 : 1;
      expect_fp8_matches(c, 30 + uint64_t(variant++));
    }
}

// Grids of many more items than SMs (the persistent form walks ~17 per CTA at 132 SMs, inactive
// row tiles among them), per-(sequence, KV head) descales that differ from item to item, causal
// and not, GQA, keys past the queries.
TEST(GpuPrefillFp8, ManyItemsPerCta) {
  std::vector<int64_t> q, k;
  fsgpu::many_short_sequences(q, k);
  int variant = 0;
  for (int64_t H_kv : {8, 2}) {
    CaseConfig c = fp8_config(KvMode::varlen_contiguous, q, k, 8, H_kv);
    c.causal = variant == 0;
    expect_fp8_matches(c, 50 + uint64_t(variant++));
  }
}

TEST(GpuPrefillFp8, Modifiers) {
  const std::vector<int64_t> q = {300, 129, 1}, k = {900, 129, 40};
  for (int m = 0; m < 5; ++m) {
    CaseConfig c = fp8_config(KvMode::varlen_paged, q, k, 4, 2);
    c.block_size = 64;
    c.causal = true;
    if (m == 0) c.window = {100, 0};
    if (m == 1) c.softcap = 30.0f;
    if (m == 2) c.sinks = true;
    if (m == 3) c.chunk = 128;
    if (m == 4) {
      c.window = {64, 64};
      c.causal = false;
      c.sinks = true;
      c.softcap = 20.0f;
    }
    expect_fp8_matches(c, 40 + uint64_t(m));
  }
}

// A block id outside the cache (-1, 2^20) at column 3 of sequence 1's table (block sizes 16
// and 64, with and without splits): exactly the rows of sequence 1 that see its keys are NaN
// (the producer copies that tile with cp.async, NaN keys: TMA would zero-fill it), every other
// output matches the CPU reference run on the good table.
TEST(GpuPrefillFp8, BadBlockIdGivesNanRows) {
  for (int64_t bs : {16, 64})
    for (int splits : {1, 3})
      for (int32_t bad_id : {-1, 1 << 20}) {
        CaseConfig c = fp8_config(KvMode::varlen_paged, {200, 700, 90}, {200, 700, 90}, 4, 2);
        c.causal = true;
        c.block_size = bs;
        c.random_block_ids = true;
        c.num_splits = splits;
        std::string kernel;
        EXPECT_EQ(fsgpu::check_bad_block_nan_rows(c, 50 + uint64_t(bs), 3, bad_id, 0.1, kernel), "")
            << "bs " << bs << " splits " << splits << " bad id " << bad_id;
        if (hopper()) EXPECT_EQ(kernel, "prefill_fp8");
      }
}

// Outside the kernel's scope: other kernels serve these, correctly.
TEST(GpuPrefillFp8, DeclinedCasesGoElsewhere) {
  CaseConfig c = fp8_config(KvMode::varlen_contiguous, {200, 7}, {200, 7}, 4, 2);
  c.causal = true;
  CaseConfig e5 = c;
  e5.q_dtype = e5.kv_dtype = DType::f8e5m2;
  expect_fp8_matches(e5, 60, false);
  CaseConfig q16 = c;
  q16.quant = fstest::QuantMode::fp8_kv;
  q16.q_dtype = DType::bf16;
  expect_fp8_matches(q16, 61, false);
  CaseConfig d64 = c;
  d64.D = d64.Dv = 64;
  expect_fp8_matches(d64, 62, false);
  CaseConfig alibi = c;
  alibi.alibi = 1;
  expect_fp8_matches(alibi, 63, false);
  CaseConfig bs80 = fp8_config(KvMode::varlen_paged, {200, 7}, {300, 7}, 4, 2);
  bs80.block_size = 80;
  expect_fp8_matches(bs80, 64, false);
}
