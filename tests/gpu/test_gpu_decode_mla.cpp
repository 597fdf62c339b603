// The MLA absorbed-decode kernels (src/kernels/attention/decode_mla_mma.cuh, and on Hopper
// decode_mla_pp.cuh / decode_mla_wgmma.cuh for 64 rows of a 16-bit cache, decode_mla_heads.cuh for 16 rows of a
// 16-bit or fp8 one: the default run puts the small grids here on its 2 x 2 shape, the "pair."
// ctest entries on the two-CTA shape, or decode_mla for fp8) on problems that select them (checked:
// attention_kernel_name is one of them), against the fp64 oracle and the CPU
// reference under the same plan, outputs poisoned first: q [.., H, 64] + q_v [.., H, 512] against
// one latent cache [.., 576] (v = channels 0..511, k = 512..575) or separate / interleaved k and
// v; H 1, 16, 128 (16- and 64-row CTAs, two row slices at H = 128), q_len 1..4 (causal verify),
// block sizes 1/16/64, paged and contiguous (varlen and batched), zero-length sequences, splits 1
// and forced > 1, LSE, the score modifiers, bad block indices (NaN rows), an understated
// max_seqlen_q; a DCP rank's keys with fp32 out; and the selection: picked for these shapes,
// declined with its reason otherwise.
// bf16 in every build; f16 where instantiated (the full set). fp8 latent caches (e4m3 in every
// build, e5m2 and f16 q where instantiated) with k/v descales per (batch, head), stride 0 over B
// and per tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "gpu_attention_case.hpp"
#include "kernels/attention/select.hpp"
#include "problem/attention.hpp"

using flashserve::DType;
using fstest::CaseConfig;
using fstest::KvMode;
namespace fs = flashserve;

namespace {

// Whether `kernel` (attention_kernel_name) is one of the MLA decode kernels: decode_mla
// (mma.sync, sm80+) or decode_mla_wgmma (sm_90a, 16 or 64 rows of a 16-bit latent cache, 16 of
// an fp8 one: the kernels of decode_mla_wgmma.cuh and decode_mla_heads.cuh; the ctest entries prefixed "mma80."
// take it out of the selection, so the mma.sync kernel serves those rows on Hopper too).
bool mla_kernel(const std::string& kernel) { return kernel == "decode_mla" || kernel == "decode_mla_wgmma"; }

// The kernel that serves this device a 16-bit latent cache (16 or 64 rows) or an fp8 one at 16
// rows: decode_mla_wgmma on Hopper builds with sm_90a.
std::string mla_kernel_hopper() {
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  const bool wgmma = FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0 &&
                     !fs::kernels::kernel_disabled(fs::kernels::AttnKernelId::decode_mla_wgmma);
  return wgmma ? "decode_mla_wgmma" : "decode_mla";
}

// A batched paged bf16 MLA decode problem over one latent cache.
CaseConfig mla_config(int64_t B, int64_t max_k, int64_t H, int64_t q_len, std::mt19937_64& rng) {
  CaseConfig c;
  c.mode = KvMode::batched_paged;
  c.H_kv = 1;
  c.H = H;
  c.D = 64, c.Dv = 512, c.has_qv = true;
  c.kv_latent = true;
  c.block_size = 64;
  c.q_dtype = c.kv_dtype = c.out_dtype = DType::bf16;
  std::uniform_int_distribution<int64_t> len(q_len, std::max(q_len, max_k));
  for (int64_t b = 0; b < B; ++b) c.k_lens.push_back(len(rng));
  c.q_lens.assign(size_t(B), q_len);
  c.causal = q_len > 1;
  c.lse = true;
  c.extra_kv_rows = 1;
  c.extra_table_cols = 1;
  c.random_block_ids = true;
  return c;
}

// Builds and checks one case that must select decode_mla; false when the dtype is not built.
bool expect_mla(const CaseConfig& c, uint64_t salt) {
  if (!fs::kernels::mla_config_built(c.q_dtype, c.kv_dtype)) return false;
  auto rng = fstest::make_rng(salt);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [](fs::AttentionParams&) {});
  EXPECT_TRUE(mla_kernel(o.kernel)) << o.kernel << ": " << fstest::describe(c);
  EXPECT_EQ(o.error, "") << fstest::describe(c) << "\n(seed " << fstest::test_seed() << ")";
  return true;
}

// The ModesAndLayouts cases: `mode`, k/v as one latent cache (kv 0), separate (1) or
// interleaved (2), a zero-length sequence, varlen q_lens with 0, causal, `splits`, block 16 / 64.
CaseConfig modes_case(CaseConfig c, KvMode mode, int kv, int splits, int i) {
  c.mode = mode;
  c.kv_latent = kv == 0;
  c.kv_interleaved = kv == 2;
  c.k_lens[1] = 0;
  if (!c.batched()) c.q_lens = {1, 1, 0, 2, 4};
  c.causal = true;
  c.num_splits = splits;
  c.block_size = i % 3 == 0 ? 16 : 64;
  return c;
}

}  // namespace

// H 1 / 16 / 128 x q_len 1..4 x block sizes 1 / 16 / 64, splits 1 and forced > 1.
TEST(GpuDecodeMla, HeadsQlenBlockSizesSplits) {
  auto rng = fstest::make_rng(1);
  int i = 0;
  for (int64_t H : {1, 16, 128})
    for (int64_t q_len : {1, 2, 4})
      for (int64_t bs : {1, 16, 64}) {
        CaseConfig c = mla_config(H == 128 ? 2 : 4, H == 128 ? 300 : 600, H, q_len, rng);
        c.block_size = bs;
        c.num_splits = i % 2 ? 3 : 1;
        expect_mla(c, 100 + uint64_t(i++));
      }
  // q_len 3 (an odd row count: 48 rows at H = 16, one 64-row CTA)
  CaseConfig c = mla_config(3, 500, 16, 3, rng);
  c.num_splits = 2;
  expect_mla(c, 150);
}

// 16 and 64 rows of a 16-bit cache in the pages decode_mla_heads_tma / decode_mla_pp load by TMA
// (16, 32: page segments of a 64-key tile; 64, 128, 256: a tile within a page) and contiguous
// caches, long enough for many tiles, ragged tails and an odd tile count per split; H 16 (q_len
// 1: 16 rows; 3: 48 rows, one 64-row CTA), 64 (one row slice) and 128 (two), q_len 1 and 3
// (several row groups per CTA at H 64: 192 rows over the slices), splits 1, 3 and the planner's.
// Under FLASHSERVE_MLA_PP=0 (the wg32. entries) the same cases run the cp.async kernels.
TEST(GpuDecodeMla, PpPageSizesAndSplits) {
  auto rng = fstest::make_rng(12);
  int i = 0;
  for (int64_t bs : {16, 32, 64, 128, 256, 0})
    for (int64_t H : {16, 64, 128}) {
      const int v = i + i / 3;  // the variant (q_len, splits) cycles apart from H
      CaseConfig c = mla_config(3, 1500, H, v % 3 == 2 ? 3 : 1, rng);
      if (bs == 0) c.mode = KvMode::batched_contiguous;
      else c.block_size = bs;
      c.k_lens[0] = 1500 - 7;  // a ragged last tile
      c.num_splits = v % 3 == 0 ? 1 : v % 3 == 1 ? 3 : 0;
      expect_mla(c, 700 + uint64_t(i++));
    }
}

// Long KV: the tile pipeline over many tiles, splits 1, 4, 16 (and the planner's own choice).
TEST(GpuDecodeMla, LongKvSplits) {
  auto rng = fstest::make_rng(2);
  int i = 0;
  for (int splits : {1, 4, 16, 0})
    for (int64_t H : {16, 128}) {
      CaseConfig c = mla_config(2, 4000, H, 1, rng);
      c.k_lens[0] = 4000;
      c.num_splits = splits;
      expect_mla(c, 200 + uint64_t(i++));
    }
}

// Many short splits (the planner's: 4 tiles per CTA at B = 1 L = 16k and B = 8 L = 4k, where the
// launcher takes decode_mla_heads_tma), each shape three times: every CTA's Q must have landed
// before its first S (a missing cp.async commit gave non-finite rows now and then, in the
// benchmark's runs only).
TEST(GpuDecodeMla, ManyShortSplits) {
  auto rng = fstest::make_rng(13);
  int i = 0;
  for (int64_t B : {1, 8})
    for (int rep = 0; rep < 3; ++rep) {
      const int64_t L = B == 1 ? 16384 : 4096;
      CaseConfig c = mla_config(B, L, 16, 1, rng);
      c.k_lens.assign(size_t(B), L);
      c.num_splits = 0;
      expect_mla(c, 900 + uint64_t(i++));
    }
}

// Paged and contiguous, varlen and batched; latent, separate and interleaved k/v; zero-length
// sequences and q_len 0.
TEST(GpuDecodeMla, ModesAndLayouts) {
  auto rng = fstest::make_rng(3);
  int i = 0;
  for (KvMode mode : fstest::kAllKvModes)
    for (int kv : {0, 1, 2})  // latent, separate, interleaved
      for (int splits : {1, 3}) {
        // H 16 (16-row CTAs) and 64 (one 64-row CTA: the wgmma kernel on Hopper)
        expect_mla(modes_case(mla_config(5, 400, i % 4 < 2 ? 16 : 64, 1, rng), mode, kv, splits, i), 300 + uint64_t(i));
        ++i;
      }
}

TEST(GpuDecodeMla, ScoreModifiers) {
  auto rng = fstest::make_rng(4);
  for (int v = 0; v < 8; ++v) {
    CaseConfig c = mla_config(4, 700, v % 3 == 0 ? 128 : 16, 1 + v % 2, rng);
    c.sinks = v % 2 == 0;
    c.sink_dtype = v % 4 == 0 ? DType::bf16 : DType::f32;
    c.softcap = v % 3 == 1 ? 30.0f : 0.0f;
    if (v % 4 == 1) c.window = {127, 0};
    if (v == 3) c.window = {40, -1};
    c.alibi = v % 5 == 2 ? 1 + v % 2 : 0;
    c.chunk = v == 6 ? 64 : 0;
    c.softmax_scale = v == 5 ? 0.02f : 0.0f;
    c.num_splits = 1 + v % 4;
    c.lse = v != 4;
    expect_mla(c, 400 + uint64_t(v));
  }
}

TEST(GpuDecodeMla, F16) {
  auto rng = fstest::make_rng(5);
  int skipped = 0;
  for (int64_t H : {16, 128}) {
    CaseConfig c = mla_config(3, 500, H, 2, rng);
    c.q_dtype = c.kv_dtype = c.out_dtype = DType::f16;
    c.num_splits = H == 16 ? 2 : 1;
    skipped += !expect_mla(c, 500 + uint64_t(H));
  }
  if (skipped) GTEST_SKIP() << "f16 MLA decode not instantiated in this build";
}

// One DCP rank's call (bench/dcp_bench.py; vLLM's MLA under decode context parallelism): rank r
// of W holds the keys at global positions t with t % W == r, causal verify rows at their global
// positions, the LSE, and out in fp32 (the partial output lse_correct rescales) or q's dtype.
// Against the CPU reference under the same plan (the fp64 oracle has no context parallelism).
TEST(GpuDecodeMla, ContextParallelFp32Out) {
  auto rng = fstest::make_rng(10);
  int i = 0;
  for (int world : {2, 3})
    for (int64_t H : {16, 128})
      for (int64_t q_len : {1, 3}) {
        const int rank = i % world;
        const std::vector<int64_t> global = {900, q_len, 257};
        CaseConfig c = mla_config(3, 1, H, q_len, rng);
        c.k_lens.clear();
        for (int64_t g : global) c.k_lens.push_back(g / world + (g % world > rank));
        c.causal = true;
        c.out_dtype = i % 4 == 3 ? DType::bf16 : DType::f32;
        c.num_splits = 1 + i % 3;
        ++i;
        if (!fs::kernels::mla_config_built(c.q_dtype)) continue;
        auto crng = fstest::make_rng(600 + uint64_t(i));
        fstest::AttentionCase ac = fstest::build_case(c, crng);
        fsgpu::set_context_parallel(ac, global, world, rank);
        std::string kernel;
        EXPECT_EQ(fsgpu::match_cpu_reference(ac, kernel), "")
            << "world " << world << " rank " << rank << "\n" << fstest::describe(c);
        EXPECT_TRUE(mla_kernel(kernel)) << kernel << ": " << fstest::describe(c);
      }
}

namespace {

// An fp8 latent cache (k/v descales as descale_broadcast: 0 [B, 1], 1 stride 0 over B, 2 per tensor).
CaseConfig fp8_config(CaseConfig c, DType kv, int descale) {
  c.quant = fstest::QuantMode::fp8_kv;
  c.kv_dtype = kv;
  c.descale_broadcast = descale;
  return c;
}

}  // namespace

// fp8 latent caches: e4m3 and e5m2 x H 1 / 16 / 128 x q_len 1..4, block sizes 1 / 16 / 64,
// splits 1 and forced > 1, the three descale shapes.
TEST(GpuDecodeMla, Fp8LatentHeadsQlenBlockSizesSplits) {
  auto rng = fstest::make_rng(11);
  int i = 0, skipped = 0;
  for (DType kv : {DType::f8e4m3, DType::f8e5m2})
    for (int64_t H : {1, 16, 128})
      for (int64_t q_len : {1, 2, 3, 4}) {
        CaseConfig c = fp8_config(mla_config(H == 128 ? 2 : 4, H == 128 ? 300 : 600, H, q_len, rng), kv, (i / 2) % 3);
        c.block_size = i % 3 == 0 ? 1 : i % 3 == 1 ? 16 : 64;
        c.num_splits = i % 2 ? 3 : 1;
        skipped += !expect_mla(c, 1100 + uint64_t(i++));
      }
  if (skipped) GTEST_SKIP() << skipped << " fp8 cases (e5m2) not instantiated in this build";
}

// fp8: long KV (many 64-key load tiles, a partial last one), splits 1 / 4 / 16 / the planner's;
// paged and contiguous, latent and separate k/v, zero-length sequences; modifiers; f16 q.
TEST(GpuDecodeMla, Fp8LatentLongKvModesModifiers) {
  auto rng = fstest::make_rng(12);
  int i = 0;
  for (int splits : {1, 4, 16, 0})
    for (int64_t H : {16, 128}) {
      CaseConfig c = fp8_config(mla_config(2, 4000, H, 1, rng), DType::f8e4m3, i % 3);
      c.k_lens[0] = 4000 - 17;
      c.num_splits = splits;
      expect_mla(c, 1200 + uint64_t(i++));
    }
  for (KvMode mode : fstest::kAllKvModes)
    for (int kv : {0, 1})  // latent, separate
      for (int splits : {1, 3}) {
        const CaseConfig c = fp8_config(mla_config(5, 400, 16, 1, rng), DType::f8e4m3, i % 3);
        expect_mla(modes_case(c, mode, kv, splits, i), 1200 + uint64_t(i));
        ++i;
      }
  for (int v = 0; v < 6; ++v) {
    CaseConfig c = fp8_config(mla_config(4, 700, v % 3 == 0 ? 128 : 16, 1 + v % 2, rng), DType::f8e4m3, v % 3);
    c.sinks = v % 2 == 0;
    c.softcap = v % 3 == 1 ? 30.0f : 0.0f;
    if (v % 4 == 1) c.window = {127, 0};
    c.alibi = v == 2 ? 1 : 0;
    c.num_splits = 1 + v % 4;
    expect_mla(c, 1300 + uint64_t(v));
  }
  int skipped = 0;
  for (int64_t H : {16, 128}) {
    CaseConfig c = fp8_config(mla_config(3, 500, H, 2, rng), DType::f8e4m3, 2);
    c.q_dtype = c.out_dtype = DType::f16;
    c.num_splits = H == 16 ? 2 : 1;
    skipped += !expect_mla(c, 1400 + uint64_t(H));
  }
  if (skipped) GTEST_SKIP() << "f16 q with an fp8 latent cache not instantiated in this build";
}

// fp8: a block index outside the cache gives exactly the NaN rows (the 64-key load tile's second
// compute tile included).
TEST(GpuDecodeMla, Fp8BadBlockIndexGivesNanRows) {
  for (int splits : {1, 3}) {
    auto rng = fstest::make_rng(13);
    CaseConfig c = fp8_config(mla_config(3, 10, 16, 1, rng), DType::f8e4m3, 0);
    c.k_lens = {40, 70, 33};
    c.block_size = 16;
    c.window = {20, 0};  // sequence 1 sees keys 49..69: blocks 3 and 4
    c.num_splits = splits;
    fstest::AttentionCase ac = fstest::build_case(c, rng);
    fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
    const fs::Plan plan = fsgpu::plan_case(ac, dc.params);
    const auto cpu = fsgpu::run_cpu(ac, plan);
    ASSERT_EQ(fsgpu::served(dc.params, true), mla_kernel_hopper());  // 16 rows: the wgmma kernel on Hopper
    for (int col : {1, 3, 4}) {
      int32_t* entry = static_cast<int32_t*>(ac.params.block_table->at(1, col));
      const int32_t good_id = *entry;
      *entry = -1;
      dc.upload(ac);
      fsgpu::run_gpu_planned(ac, dc, plan);
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t d = 0; d < c.Dv; ++d) {
            const float x = ac.out.get({b, 0, h, d}), y = cpu.first.get({b, 0, h, d});
            if (b == 1 && col >= 3) ASSERT_TRUE(std::isnan(x)) << "b=1 h=" << h << " d=" << d << " col " << col;
            else ASSERT_NEAR(x, y, 1e-2 * (1.0 + std::fabs(y))) << "b=" << b << " h=" << h << " col " << col;
          }
      *entry = good_id;
    }
  }
}

// A varlen max_seqlen_q below the truth: 4 rows x 16 heads = 64 packed rows, sized for 16.
TEST(GpuDecodeMla, UnderstatedMaxSeqlenQ) {
  auto rng = fstest::make_rng(6);
  CaseConfig c = mla_config(3, 400, 16, 1, rng);
  c.mode = KvMode::varlen_paged;
  c.q_lens = {4, 1, 3};
  for (int64_t& k : c.k_lens) k = std::max<int64_t>(k, 4);
  c.causal = true;
  c.num_splits = 1;
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [](fs::AttentionParams& p) { p.max_seqlen_q = 1; });
  EXPECT_TRUE(mla_kernel(o.kernel)) << o.kernel;
  EXPECT_EQ(o.error, "") << fstest::describe(c);
}

// A block index outside the cache is never read: exactly the rows that see its keys are NaN
// (the wgmma kernels on Hopper, 16 and 64 rows).
TEST(GpuDecodeMla, BadBlockIndexGivesNanRows) {
  for (int64_t H : {16, 128})
    for (int splits : {1, 3})
      for (int bad_id : {-1, 1 << 20}) {
        auto rng = fstest::make_rng(8);
        CaseConfig c = mla_config(3, 10, H, 1, rng);
        c.k_lens = {40, 70, 33};
        c.block_size = 16;
        c.window = {20, 0};  // sequence 1 sees keys 49..69, not block 1 (16..31)
        c.num_splits = splits;
        fstest::AttentionCase ac = fstest::build_case(c, rng);
        fsgpu::expect_bad_block_nan_rows(ac, mla_kernel_hopper(), bad_id, splits);
      }
}

namespace {

// try_decode_mla's answer for a case (host tensors: the selection reads shapes and pointers only).
std::string mla_why(const CaseConfig& c, fs::kernels::AttnKernelChoice& choice) {
  auto rng = fstest::make_rng(7);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  const fs::detail::AttnProblem pr = fs::detail::validate_attention(ac.params, c.batched());
  return fs::kernels::try_decode_mla(pr, fs::DeviceProps::h200(), choice);
}

}  // namespace

// Picked (16 rows for q_len x H <= 16, else 64, row slices = ceil(q_len x H / rows)) for the MLA
// shapes; declined, with the reason, otherwise.
TEST(GpuDecodeMla, Selection) {
  auto rng = fstest::make_rng(9);
  struct Want { int64_t H, q_len; int rows, slices; };
  // A 16-bit cache: the wgmma kernels on the H200 in builds with sm_90a code (16 rows:
  // decode_mla_heads.cuh's shared memory, 64: decode_mla_wgmma.cuh's).
  const bool wg = FLASHSERVE_SM90A && !fs::kernels::kernel_disabled(fs::kernels::AttnKernelId::decode_mla_wgmma);
  for (Want w : {Want{1, 1, 16, 1}, Want{16, 1, 16, 1}, Want{16, 2, 64, 1}, Want{128, 1, 64, 2}, Want{128, 4, 64, 8}}) {
    const CaseConfig c = mla_config(2, 100, w.H, w.q_len, rng);
    fs::kernels::AttnKernelChoice choice;
    EXPECT_EQ(mla_why(c, choice), "") << "H " << w.H << " q_len " << w.q_len;
    EXPECT_EQ(choice.kernel, wg ? fs::kernels::AttnKernelId::decode_mla_wgmma : fs::kernels::AttnKernelId::decode_mla);
    EXPECT_EQ(choice.rows_per_cta, w.rows);
    EXPECT_EQ(choice.head_slices, w.slices);
    const size_t wg_smem = w.rows == 64 ? fs::kernels::mla_rows64_smem_bytes() : fs::kernels::mla_rows16_smem_bytes(false);
    EXPECT_EQ(choice.smem_bytes, wg ? wg_smem : fs::kernels::mla_smem_bytes(w.rows));
  }
  {  // fp32 out (a DCP rank's partial output) as well
    CaseConfig c = mla_config(2, 100, 16, 1, rng);
    c.out_dtype = DType::f32;
    fs::kernels::AttnKernelChoice choice;
    EXPECT_EQ(mla_why(c, choice), "");
  }
  auto declines = [&](auto edit, const std::string& why) {
    CaseConfig c = mla_config(2, 100, 16, 1, rng);
    edit(c);
    fs::kernels::AttnKernelChoice choice;
    const std::string got = mla_why(c, choice);
    EXPECT_NE(got.find(why), std::string::npos) << "got \"" << got << "\", expected it to name \"" << why << "\"";
    EXPECT_FALSE(choice.supported());
  };
  declines([](CaseConfig& c) { c.D = 128, c.Dv = 128, c.has_qv = false; }, "q_v");
  declines([](CaseConfig& c) { c.H_kv = 2, c.H = 32; }, "H_kv = 1");
  declines([](CaseConfig& c) { c.q_dtype = c.kv_dtype = c.out_dtype = DType::f32; }, "float16/bfloat16");
  declines([](CaseConfig& c) { c.quant = fstest::QuantMode::fp8_qkv, c.q_dtype = c.kv_dtype = DType::f8e4m3; },
           "float16/bfloat16");
  if (!fs::kernels::mla_config_built(DType::bf16, DType::f8e5m2))
    declines([](CaseConfig& c) { c.quant = fstest::QuantMode::fp8_kv, c.kv_dtype = DType::f8e5m2; }, "instantiated");
  // fp8 latent caches (e4m3: every build): picked; 16 rows on the wgmma kernel where it is built
  // (its f16 tile and raw stages), 64 rows on mma.sync (the 64-key fp8 load tiles).
  for (Want w : {Want{16, 1, 16, 1}, Want{128, 1, 64, 2}}) {
    CaseConfig c = mla_config(2, 100, w.H, w.q_len, rng);
    c.quant = fstest::QuantMode::fp8_kv, c.kv_dtype = DType::f8e4m3;
    fs::kernels::AttnKernelChoice choice;
    EXPECT_EQ(mla_why(c, choice), "") << "fp8 H " << w.H;
    const bool wg16 = wg && w.rows == 16;
    EXPECT_EQ(choice.kernel, wg16 ? fs::kernels::AttnKernelId::decode_mla_wgmma : fs::kernels::AttnKernelId::decode_mla);
    EXPECT_EQ(choice.rows_per_cta, w.rows);
    EXPECT_EQ(choice.head_slices, w.slices);
    EXPECT_EQ(choice.smem_bytes, wg16 ? fs::kernels::mla_rows16_smem_bytes(true) : fs::kernels::mla_smem_bytes(w.rows, 1));
  }
  declines([](CaseConfig& c) { c.kv_latent = false, c.kv_pad = 3; }, "16 bytes");
  declines([](CaseConfig& c) { c.q_pad = 3; }, "16 bytes");
}

// The fuzz generator's configurations moved into decode_mla's scope: q_v with D = 64 / Dv = 512,
// H_kv = 1 (H drawn from 1..128), a built (q, KV) dtype pair (fp8 KV with the generator's
// descale shape, else no quantization),
// paddings in whole 16-byte steps, q_len <= 4; a latent cache half of the time; every mode,
// layout, stride, modifier, split and length the generator draws. Prints how many cases
// decode_mla served (an understated bound or a failed alignment sends some elsewhere, checked
// the same way).
TEST(GpuDecodeMla, Fuzz) {
  constexpr int kCases = 150;
  int ran = 0, failed = 0, served_mla = 0;
  for (int i = 0; i < kCases && failed < 5; ++i) {
    auto rng = fstest::make_rng(3000 + uint64_t(i));
    CaseConfig c = fstest::random_case_config(rng);
    const fs::kernels::MlaConfig built = fs::kernels::kMlaConfigs[size_t(i) % std::size(fs::kernels::kMlaConfigs)];
    c.quant = fs::is_fp8(built.kv) ? fstest::QuantMode::fp8_kv : fstest::QuantMode::none;
    c.has_qv = true;
    c.D = 64, c.Dv = 512;
    c.H_kv = 1;
    const int64_t heads[] = {1, 2, 8, 16, 16, 32, 128};
    c.H = heads[size_t(i) % std::size(heads)];
    c.q_dtype = c.out_dtype = built.dtype;
    c.kv_dtype = built.kv;
    c.sink_dtype = DType::f32;
    auto whole = [](int64_t pad, int64_t elems) { return (pad + elems - 1) / elems * elems; };  // 16 bytes
    c.q_pad = whole(c.q_pad, 8), c.out_pad = whole(c.out_pad, 8);
    c.kv_pad = whole(c.kv_pad, fs::is_fp8(built.kv) ? 16 : 8);
    c.kv_latent = (i / 2) % 2 == 0;  // both layouts for each built pair (dev: 2 pairs)
    for (int64_t& q : c.q_lens) q = std::min<int64_t>(q, 4);
    if (c.batched()) c.q_lens.assign(c.q_lens.size(), c.q_lens.empty() ? 1 : c.q_lens[0]);
    if (c.H >= 32)
      for (int64_t& k : c.k_lens) k = std::min<int64_t>(k, 300);  // the CPU reference's time
    auto crng = fstest::make_rng(4000 + uint64_t(i));
    fstest::AttentionCase ac = fstest::build_case(c, crng);
    const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [](fs::AttentionParams&) {});
    ++ran;
    served_mla += mla_kernel(o.kernel);
    if (o.error.empty()) continue;
    ++failed;
    ADD_FAILURE() << "decode_mla fuzz case " << i << " (served by " << o.kernel << ")\n  " << fstest::describe(c)
                  << "\n" << o.error << "(seed " << fstest::test_seed() << ")";
  }
  std::printf("[decode_mla fuzz] %d cases, %d served by decode_mla, %d failed\n", ran, served_mla, failed);
  if (failed == 0) EXPECT_GE(served_mla, ran / 2) << "the fuzz should mostly reach the decode_mla kernel";
}
