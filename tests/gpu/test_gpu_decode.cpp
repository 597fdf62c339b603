// The decode kernel (src/kernels/attention/decode_fwd.cuh) on problems that select it (checked:
// attention_kernel_name == "decode"), against the fp64 oracle and the CPU reference under the
// same plan: batches up to 64, KV up to 8k, block sizes 1/16/256, NHD/HND, GQA 1..16, q_len x
// group up to 16, fp8 KV (e4m3/e5m2 on the tensor cores, bf16/f16/fp8 q, per-tensor and per-head
// descales), int8 K8V8 / K8V16 (int8 q with q_scale, s8 mma, k_scale_cache, v_scale), sinks, soft-cap, window, ALiBi, splits 1..16, LSE; bad block indices
// give NaN rows; a varlen max_seqlen_q below the truth still computes every row; the long
// tiling's TMA form (sm_90a, bf16 and fp8 caches) on pages of 16 x k keys and contiguous caches.
// Configurations not instantiated in this build (FLASHSERVE_DEV_CONFIGS) are skipped, named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "gpu_attention_case.hpp"
#include "kernels/attention/decode_config.hpp"
#include "kernels/attention/select.hpp"
#include "problem/attention.hpp"

using flashserve::DType;
using fstest::CaseConfig;
using fstest::KvMode;
namespace fs = flashserve;

namespace {

// A batched paged bf16 decode problem with D = 128 (the instantiation every build has).
CaseConfig decode_config(int64_t B, int64_t max_k, int64_t group, std::mt19937_64& rng) {
  CaseConfig c;
  c.mode = KvMode::batched_paged;
  c.H_kv = 2;
  c.H = c.H_kv * group;
  c.D = c.Dv = 128;
  c.q_dtype = c.kv_dtype = c.out_dtype = DType::bf16;
  std::uniform_int_distribution<int64_t> len(1, max_k);
  for (int64_t b = 0; b < B; ++b) c.k_lens.push_back(len(rng));
  c.q_lens.assign(size_t(B), 1);
  c.lse = true;
  c.extra_kv_rows = 1;
  c.extra_table_cols = 1;
  c.random_block_ids = true;
  return c;
}

// V's storage dtype of a configuration (K8V16: v16_dtype).
DType v_dtype(const CaseConfig& c) {
  if (c.quant == fstest::QuantMode::int8_k8v16) return c.v16_dtype;
  return c.quant == fstest::QuantMode::none ? c.q_dtype : c.kv_dtype;
}

// An int8 configuration of decode_config (the vLLM int8 fork's formats): q and K int8 with
// per-(token, head) scales, V int8 with per-(KV head, channel) scales (K8V8) or `v16` (K8V16).
void make_int8(CaseConfig& c, bool k8v8, DType v16, DType out) {
  c.quant = k8v8 ? fstest::QuantMode::int8_k8v8 : fstest::QuantMode::int8_k8v16;
  c.q_dtype = c.kv_dtype = DType::i8;
  c.v16_dtype = v16;
  c.out_dtype = out;
}

// Builds and checks one case that must select the decode kernel. Returns false when the
// build lacks the instantiation (the caller skips).
bool expect_decode(const CaseConfig& c, uint64_t salt) {
  auto rng = fstest::make_rng(salt);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [](fs::AttentionParams&) {});
  if (!fs::kernels::decode_config_built(c.kv_dtype, c.D, v_dtype(c))) return false;
  EXPECT_EQ(o.kernel, "decode") << fstest::describe(c);
  EXPECT_EQ(o.error, "") << fstest::describe(c) << "\n(seed " << fstest::test_seed() << ")";
  return true;
}

}  // namespace

// The splits merged in a cluster (select.hpp: decode_cluster_splits) for 2 to the kernel's
// default bound (decode_cluster_default_max: kDecodeClusterMaxSplits, none for MLA's 8-bit
// latent) uniform splits where the device runs the sm_90a code (9.0); never for
// fixed-size (batch-invariant) splits, one split, more than kClusterMaxCtas, other devices
// (8.x, or 10.0 running sm_80 code) or builds without sm_90a. (FLASHSERVE_DECODE_CLUSTER forces it
// within those bounds: the ctest entries cluster. run this binary so.) Host arithmetic.
TEST(GpuDecode, ClusterMergeBySplits) {
  using fs::kernels::decode_cluster_default_max;
  using fs::kernels::decode_cluster_splits;
  using fs::kernels::kClusterMaxCtas;
  using fs::kernels::kDecodeClusterMaxSplits;
  const char* env = std::getenv("FLASHSERVE_DECODE_CLUSTER");
  const std::string forced = env ? env : "";
  fs::DeviceProps h200 = fs::DeviceProps::h200(), a100 = h200, b200 = h200;
  a100.cc_major = 8, b200.cc_major = 10;
  EXPECT_EQ(decode_cluster_default_max(false, true), kDecodeClusterMaxSplits);
  EXPECT_EQ(decode_cluster_default_max(true, false), kDecodeClusterMaxSplits);
  EXPECT_EQ(decode_cluster_default_max(true, true), 0);
  for (int max : {0, kDecodeClusterMaxSplits})
    for (int n : {2, 3, 8, kClusterMaxCtas}) {
      const bool on = FLASHSERVE_SM90A && (forced == "1" || (forced != "0" && n <= max));
      EXPECT_EQ(decode_cluster_splits(n, 0, max, h200), on) << n;
      EXPECT_FALSE(decode_cluster_splits(n, 0, max, a100)) << n;
      EXPECT_FALSE(decode_cluster_splits(n, 0, max, b200)) << n;
      EXPECT_FALSE(decode_cluster_splits(n, 2048, max, h200)) << n;
    }
  EXPECT_FALSE(decode_cluster_splits(1, 0, kClusterMaxCtas, h200));
  EXPECT_FALSE(decode_cluster_splits(kClusterMaxCtas + 1, 0, kClusterMaxCtas + 1, h200));
}

// The cluster merge and the combine give the same bits (cluster_merge.cuh): the same call at 2
// splits (merged in a cluster where the device runs the sm_90a code and the bound takes 2), 4
// (clustered under FLASHSERVE_DECODE_CLUSTER=1: the ctest cluster. entry) and 18 (past
// kClusterMaxCtas: partials and the combine), the splits past the second empty -- what a
// CUDA-graph replay of a fixed split count meets in an eager call whose keys cap its count at 2
// (test_backend_graphs.py's 1000-step replay found a 1-ulp difference while the cluster summed in
// rank order). KV of 129-256 keys (two granules of 128) in a block table of ~3200 keys
// (max_seqlen_k: 18 splits allowed, each split's span past the short tiling's, so every count
// runs the long tiling), decode and verify rows: the 2-split call against the oracle, then out
// and LSE of the three compared byte for byte.
TEST(GpuDecode, ClusterMergeEqualsCombineBitwise) {
  auto rng = fstest::make_rng(0xc1a55);
  for (int rep = 0; rep < 6; ++rep) {
    CaseConfig c = decode_config(1 + rep % 3, 256, rep % 3 == 2 ? 8 : 4, rng);
    std::uniform_int_distribution<int64_t> len(129, 256);
    for (int64_t& k : c.k_lens) k = len(rng);
    c.q_lens.assign(c.k_lens.size(), rep % 2 ? 4 : 1);
    c.extra_table_cols = 184;
    c.num_splits = 2;
    fstest::AttentionCase ac = fstest::build_case(c, rng);
    const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [](fs::AttentionParams&) {});  // right, first
    EXPECT_EQ(o.kernel, "decode") << fstest::describe(c);
    EXPECT_EQ(o.error, "") << fstest::describe(c) << "\n(seed " << fstest::test_seed() << ")";
    fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
    const int splits[] = {2, 4, 18};
    std::vector<unsigned char> out[3], lse[3];
    for (int i = 0; i < 3; ++i) {
      fs::AttentionParams p = ac.params;
      p.num_splits = splits[i];
      const fs::Plan plan = fsgpu::plan_case(ac, p);
      ASSERT_EQ(plan.num_splits, splits[i]) << fstest::describe(c);
      dc.params.num_splits = p.num_splits;
      fsgpu::run_gpu_planned(ac, dc, plan);
      out[i] = *ac.out.bytes;
      lse[i] = *ac.lse.bytes;
    }
    for (int i = 1; i < 3; ++i) {
      EXPECT_TRUE(out[i] == out[0]) << "out at " << splits[i] << " splits differs from 2, " << fstest::describe(c);
      EXPECT_TRUE(lse[i] == lse[0]) << "lse at " << splits[i] << " splits differs from 2, " << fstest::describe(c);
    }
  }
}

TEST(GpuDecode, GqaLayoutsAndBlockSizes) {
  auto rng = fstest::make_rng(1);
  int i = 0;
  for (int64_t group : {1, 2, 3, 4, 8, 16})
    for (int64_t bs : {1, 16, 256})
      for (fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
        CaseConfig c = decode_config(6, 700, group, rng);
        c.block_size = bs;
        c.layout = layout;
        c.num_splits = 1 + i % 3;
        expect_decode(c, 100 + uint64_t(i++));
      }
}

// The long tiling's TMA form (decode_config.hpp: decode_tma_tiling; sm_90a, D = 128 here: 16-bit
// or fp8 K/V): pages of 16 x k keys (48 included: fp8's 32-key tiles then span two page
// segments of different pages) and contiguous caches, NHD and HND, lengths off the tiles (the
// tail tile by cp.async on the same barriers), 1 or 3 splits, GQA 1 / 4 / 8 (causal verify rows
// past one query row: 4 and 32 packed rows), bf16 and fp8 (e4m3, e5m2; bf16 or fp8 q) caches: the cp.async ring by
// default (kDecodeTmaDefault), the TMA form in the ctest entries tma. (FLASHSERVE_DECODE_TMA=1).
TEST(GpuDecode, TmaFormPagesAndTails) {
  auto rng = fstest::make_rng(15);
  int i = 0, skipped = 0;
  for (DType kv : {DType::bf16, DType::f8e4m3, DType::f8e5m2})
    for (int64_t bs : {16, 32, 48, 64, 256, 0})
      for (int64_t group : {1, 4, 8}) {
        CaseConfig c = decode_config(5, 1200, group, rng);
        if (bs == 0) c.mode = KvMode::batched_contiguous;
        else c.block_size = bs;
        c.layout = i % 2 ? fs::KvLayout::hnd : fs::KvLayout::nhd;
        c.num_splits = 1 + 2 * (i / 2 % 2);
        c.k_lens[0] = 1200 - 7;  // a tail tile in every split count
        if (group != 4) {  // 4 or 32 packed rows from 4 query rows, each seeing its own prefix (32:
                           // a 16-bit cache's 32-row CTAs, an fp8 one's two 16-row CTAs)
          c.q_lens.assign(c.q_lens.size(), 4);
          for (int64_t& k : c.k_lens) k = std::max<int64_t>(k, 4);
          c.causal = true;
        }
        if (kv != DType::bf16) {
          c.kv_dtype = kv;
          c.q_dtype = i % 3 == 2 ? kv : DType::bf16;
          c.quant = fs::is_fp8(c.q_dtype) ? fstest::QuantMode::fp8_qkv : fstest::QuantMode::fp8_kv;
          c.out_dtype = DType::bf16;
          c.descale_broadcast = i % 3;
        }
        skipped += !expect_decode(c, 1500 + uint64_t(i++));
      }
  if (skipped) GTEST_SKIP() << skipped << " (KV dtype, D) configurations not instantiated in this build";
}

TEST(GpuDecode, LargeBatchLongKv) {
  auto rng = fstest::make_rng(2);
  CaseConfig c = decode_config(64, 8192, 4, rng);
  c.H_kv = 1, c.H = 4;
  c.k_lens[0] = 8192;
  c.num_splits = 1;
  expect_decode(c, 200);
  for (int splits : {2, 5, 16}) {
    CaseConfig s = decode_config(16, 8192, 8, rng);
    s.H_kv = 1, s.H = 8;
    s.num_splits = splits;
    s.layout = splits == 5 ? fs::KvLayout::hnd : fs::KvLayout::nhd;
    expect_decode(s, 200 + uint64_t(splits));
  }
}

// Splits of at most 128 keys (decode_config.hpp: decode_launch_short) run on the short tiling
// (16-key tiles, two stages, three CTAs per SM, q's fragments from shared memory): every format,
// GQA groups and verify rows up to 16, block sizes 1 and 16, one split of a short context or
// several of a longer one, with the modifiers, sinks and fp32 outputs.
TEST(GpuDecode, ShortSplitsEveryFormat) {
  auto rng = fstest::make_rng(12);
  int i = 0, skipped = 0;
  for (int fmt = 0; fmt < 4; ++fmt)  // bf16, fp8 e4m3, int8 K8V8, int8 K8V16
    for (int v = 0; v < 6; ++v) {
      // The table's span (ceil(max_k / block) + 1 extra column, x block) over the splits <= 128.
      const bool split = v % 2 == 1;
      const int64_t group = v % 3 == 0 ? 8 : 4, q_len = v == 4 ? 4 : 1;
      CaseConfig c = decode_config(9, split ? 480 : 96, group, rng);
      c.block_size = v == 2 ? 1 : 16;
      c.num_splits = split ? 4 : 1;
      c.q_lens.assign(c.k_lens.size(), q_len);
      for (int64_t& k : c.k_lens) k = std::max(k, q_len);
      c.causal = q_len > 1;
      if (fmt == 1) {
        c.kv_dtype = DType::f8e4m3;
        c.quant = fstest::QuantMode::fp8_kv;
      }
      if (fmt >= 2) make_int8(c, fmt == 2, DType::bf16, DType::bf16);
      if (fmt < 2) {
        c.sinks = v % 2 == 0;
        c.softcap = v == 1 ? 30.0f : 0.0f;
        c.alibi = v == 3 ? 1 : 0;
        if (v == 5) c.window = {40, 0};
        if (v == 3) c.out_dtype = DType::f32;
      }
      skipped += !expect_decode(c, 1500 + uint64_t(i++));
    }
  if (skipped) GTEST_SKIP() << skipped << " (KV dtype, D) configurations not instantiated in this build";
}

// Speculative verify: q_len x group up to 16 rows, causal (rows see different prefixes).
TEST(GpuDecode, ShortVerifyCausal) {
  auto rng = fstest::make_rng(3);
  for (int64_t q_len : {2, 4, 8})
    for (int splits : {1, 3}) {
      CaseConfig c = decode_config(5, 500, 16 / q_len, rng);
      c.q_lens.assign(c.k_lens.size(), q_len);
      for (int64_t& k : c.k_lens) k = std::max(k, q_len);
      c.causal = true;
      c.num_splits = splits;
      expect_decode(c, 300 + uint64_t(q_len * 10 + splits));
    }
}

// Verify steps past 16 packed rows stay on the decode kernel (common/decode_rows.hpp:
// decode_cta_rows, decode_max_rows): 32 rows of a 16-bit cache in 32-row CTAs that run two
// 16-row passes per tile, up to 64 of an fp8 or int8 one in 16-row CTAs side by side; causal,
// splits 1 and 3, sinks, a window, ALiBi, soft-cap and fp32 outputs now and then.
TEST(GpuDecode, VerifyPastSixteenRows) {
  auto rng = fstest::make_rng(11);
  int i = 0, skipped = 0;
  for (int fmt = 0; fmt < 3; ++fmt)  // bf16, fp8 e4m3, int8 K8V8
    for (int64_t rows : {24, 32, 48, 64}) {
      if (fmt == 0 && rows > 32) continue;
      const int64_t group = i % 2 ? 4 : 8, q_len = rows / group;
      CaseConfig c = decode_config(4, i % 3 == 2 ? 90 : 800, group, rng);
      if (fmt == 1) {
        c.kv_dtype = DType::f8e4m3;
        c.quant = fstest::QuantMode::fp8_kv;
      }
      if (fmt == 2) make_int8(c, true, DType::bf16, DType::bf16);
      c.q_lens.assign(c.k_lens.size(), q_len);
      for (int64_t& k : c.k_lens) k = std::max(k, q_len);
      c.causal = true;
      c.num_splits = i % 2 ? 3 : 1;
      c.sinks = i % 4 == 1 && fmt != 2;
      if (i % 5 == 3 && fmt != 2) c.window = {100, 0};
      // The modifiers' slow path (32-row CTAs read a row's position and slope from its RowMeta)
      // and fp32 outputs (P's residue pass) on both passes.
      if (fmt != 2) {
        c.alibi = i % 3 == 1 ? 1 : 0;
        c.softcap = i % 4 == 2 ? 30.0f : 0.0f;
        if (i % 5 == 4) c.out_dtype = DType::f32;
      }
      skipped += !expect_decode(c, 1300 + uint64_t(i++));
    }
  if (skipped) GTEST_SKIP() << skipped << " (KV dtype, D) configurations not instantiated in this build";
}

TEST(GpuDecode, ScoreModifiers) {
  auto rng = fstest::make_rng(4);
  for (int v = 0; v < 8; ++v) {
    CaseConfig c = decode_config(7, 900, 4, rng);
    c.sinks = v % 2 == 0;
    c.sink_dtype = v % 4 == 0 ? DType::bf16 : DType::f32;
    c.softcap = v % 3 == 0 ? 30.0f : 0.0f;
    if (v % 4 == 1) c.window = {127, 0};
    if (v == 3) c.window = {40, -1};
    c.alibi = v % 5 == 2 ? 1 + v % 2 : 0;
    c.alibi_sqrt = v == 7;
    c.chunk = v == 6 ? 64 : 0;
    c.causal = v % 2 == 1;
    c.out_dtype = v == 5 ? DType::f32 : DType::bf16;
    c.num_splits = 1 + v % 4;
    c.lse = v != 4;
    expect_decode(c, 400 + uint64_t(v));
  }
}

// Varlen and contiguous KV, zero-length sequences, q_len 0 and rows that see nothing.
TEST(GpuDecode, VarlenContiguousAndEmpty) {
  auto rng = fstest::make_rng(5);
  for (KvMode mode : {KvMode::varlen_paged, KvMode::varlen_contiguous, KvMode::batched_contiguous})
    for (int splits : {1, 4}) {
      CaseConfig c = decode_config(6, 300, 4, rng);
      c.mode = mode;
      c.k_lens[1] = 0;
      if (!c.batched()) c.q_lens = {1, 1, 0, 2, 1, 4};
      c.window = {0, 0};
      c.causal = splits == 4;
      c.num_splits = splits;
      expect_decode(c, 500 + uint64_t(splits));
    }
}

TEST(GpuDecode, Fp8KvAndOtherHeadSizes) {
  auto rng = fstest::make_rng(6);
  int i = 0, skipped = 0;
  for (DType kv : {DType::f8e4m3, DType::f8e5m2, DType::f16, DType::bf16})
    for (int64_t d : {64, 128, 256}) {
      CaseConfig c = decode_config(5, 600, d == 256 ? 16 : 8, rng);  // 16 rows at D = 256: two row groups
      c.D = c.Dv = d;
      c.q_dtype = kv == DType::f16 ? DType::f16 : DType::bf16;
      c.kv_dtype = kv;
      c.out_dtype = c.q_dtype;
      if (fs::is_fp8(kv)) c.quant = fstest::QuantMode::fp8_kv;
      c.descale_broadcast = i % 3;
      c.sinks = i % 2 == 0;
      c.num_splits = 1 + i % 3;
      c.layout = i % 2 ? fs::KvLayout::hnd : fs::KvLayout::nhd;
      skipped += !expect_decode(c, 600 + uint64_t(i++));
    }
  if (skipped) GTEST_SKIP() << skipped << " (KV dtype, D) configurations not instantiated in this build";
}

// fp8 caches on the tensor cores (decode_mma.cuh): e4m3 and e5m2; q bf16 (scaled into f16 per
// row), f16, or fp8 of either format with q_descale; descales per KV head ([B, H_kv], or stride 0
// over B) and per tensor (strides (0, 0)); block sizes 1/16/64; q_len 1 (group 8) and 4 (group
// 4, causal verify: 16 rows); splits 1..4; fp32 out (P's residue mma) now and then; short
// contexts (16-key tiles) and long ones (32-key tiles); q rows padded (aligned or not).
TEST(GpuDecode, Fp8KvTensorCores) {
  auto rng = fstest::make_rng(9);
  int i = 0, skipped = 0;
  for (DType kv : {DType::f8e4m3, DType::f8e5m2})
    for (DType q : {DType::bf16, DType::f16, DType::f8e4m3, DType::f8e5m2})
      for (int64_t bs : {1, 16, 64})
        for (int64_t q_len : {1, 4}) {
          // every fourth case short (<= 60 keys): the short tiling (decode_launch_short)
          CaseConfig c = decode_config(5, i % 4 == 3 ? 60 : 700, q_len == 1 ? 8 : 4, rng);
          c.kv_dtype = kv;
          c.q_dtype = q;
          c.quant = fs::is_fp8(q) ? fstest::QuantMode::fp8_qkv : fstest::QuantMode::fp8_kv;
          c.out_dtype = fs::is_fp8(q) ? (i % 2 ? DType::f16 : DType::bf16) : i % 7 == 3 ? DType::f32 : q;
          c.descale_broadcast = i % 3;
          c.q_pad = i % 4 == 1 ? 3 : i % 4 == 2 ? 8 : 0;  // q rows off 8-element alignment: element-wise staging
          c.block_size = bs;
          c.q_lens.assign(c.k_lens.size(), q_len);
          for (int64_t& k : c.k_lens) k = std::max(k, q_len);
          c.causal = q_len > 1;
          c.num_splits = 1 + i % 4;
          c.layout = i % 5 == 2 ? fs::KvLayout::hnd : fs::KvLayout::nhd;
          c.sinks = i % 6 == 1;
          c.softcap = i % 9 == 4 ? 20.0f : 0.0f;
          skipped += !expect_decode(c, 900 + uint64_t(i++));
        }
  if (skipped) GTEST_SKIP() << skipped << " (KV dtype, D) configurations not instantiated in this build";
}

// int8 caches on the tensor cores (decode_mma.cuh): K8V8 (V int8 with v_scale [H_kv, D]) and
// K8V16 (V f16/bf16), int8 q with q_scale (the fork's decode); q.k on the s8 mma with the keys'
// scales copied per tile; block sizes 1/16/64; q_len 1-4 with GQA groups 1/4/8 (q_len x group <=
// 16); splits 1 and forced 2..4; short contexts (K8V8's 16-key tiles) and long ones (32-key
// tiles); f16/bf16 out; NHD and HND; sinks and soft-cap now and then; q rows padded (aligned or
// not). Out and LSE are poisoned before the GPU run (run_gpu).
TEST(GpuDecode, Int8TensorCores) {
  auto rng = fstest::make_rng(10);
  int i = 0, skipped = 0;
  for (int fmt = 0; fmt < 3; ++fmt)  // K8V8, K8V16 bf16, K8V16 f16
    for (int64_t bs : {1, 16, 64})
      for (int64_t group : {1, 4, 8})
        for (int64_t q_len : {1, 2, 4}) {
          if (q_len * group > 16) continue;
          CaseConfig c = decode_config(5, i % 4 == 3 ? 60 : 700, group, rng);
          make_int8(c, fmt == 0, fmt == 2 ? DType::f16 : DType::bf16, i % 2 ? DType::f16 : DType::bf16);
          c.q_pad = i % 4 == 1 ? 3 : i % 4 == 2 ? 8 : 0;  // q rows off 8-element alignment: element-wise staging
          c.block_size = bs;
          c.q_lens.assign(c.k_lens.size(), q_len);
          for (int64_t& k : c.k_lens) k = std::max(k, q_len);
          c.causal = q_len > 1;
          c.num_splits = i % 3 == 0 ? 1 : 1 + i % 4;
          c.layout = i % 5 == 2 ? fs::KvLayout::hnd : fs::KvLayout::nhd;
          c.sinks = i % 6 == 1;
          c.softcap = i % 9 == 4 ? 20.0f : 0.0f;
          skipped += !expect_decode(c, 1100 + uint64_t(i++));
        }
  // every split count of a long context, both formats
  for (int splits : {1, 2, 7}) {
    for (int fmt = 0; fmt < 2; ++fmt) {
      CaseConfig c = decode_config(8, 4096, 8, rng);
      make_int8(c, fmt == 0, DType::bf16, DType::bf16);
      c.k_lens[0] = 4096;
      c.num_splits = splits;
      skipped += !expect_decode(c, 1200 + uint64_t(splits * 2 + fmt));
    }
  }
  if (skipped) GTEST_SKIP() << skipped << " (K, V, D) configurations not instantiated in this build";
}

// The selection on int8 problems: picked (16 rows per pass) for K8V8 and K8V16 of a built (K, V,
// D); declined, with the reason, otherwise.
TEST(GpuDecode, Int8Selection) {
  auto rng = fstest::make_rng(11);
  auto why = [&](const CaseConfig& c, fs::kernels::AttnKernelChoice& choice) {
    auto crng = fstest::make_rng(12);
    fstest::AttentionCase ac = fstest::build_case(c, crng);
    const fs::detail::AttnProblem pr = fs::detail::validate_attention(ac.params, c.batched());
    return fs::kernels::try_decode(pr, fs::DeviceProps::h200(), choice);
  };
  for (int fmt = 0; fmt < 2; ++fmt)
    for (int64_t group : {1, 8}) {
      CaseConfig c = decode_config(3, 100, group, rng);
      make_int8(c, fmt == 0, DType::bf16, DType::bf16);
      fs::kernels::AttnKernelChoice choice;
      EXPECT_EQ(why(c, choice), "") << fstest::describe(c);
      EXPECT_EQ(choice.kernel, fs::kernels::AttnKernelId::decode);
      EXPECT_EQ(choice.rows_per_cta, 16);
      EXPECT_LE(2 * (choice.smem_bytes + 1024), size_t(228 * 1024)) << "two CTAs per SM";
    }
  auto declines = [&](auto edit, const std::string& reason) {
    CaseConfig c = decode_config(3, 100, 4, rng);
    make_int8(c, true, DType::bf16, DType::bf16);
    edit(c);
    fs::kernels::AttnKernelChoice choice;
    const std::string got = why(c, choice);
    EXPECT_NE(got.find(reason), std::string::npos) << "got \"" << got << "\", expected it to name \"" << reason << "\"";
    EXPECT_FALSE(choice.supported());
  };
  declines([](CaseConfig& c) { c.D = c.Dv = 96; }, "instantiated");  // no int8 D=96 in any build
  declines(
      [](CaseConfig& c) {
        c.q_lens.assign(c.k_lens.size(), 32);  // 128 rows: past the 8-bit cache's verify bound (64)
        for (int64_t& k : c.k_lens) k = std::max<int64_t>(k, 32);
      },
      "q_len x group");
  declines([](CaseConfig& c) { c.kv_pad = 3; }, "16 bytes");
}

// The fuzz generator's configurations moved into the decode kernel's scope: a built (KV dtype,
// D) (fp8 with bf16/f16 q, or fp8 q with q_descale; int8 K8V8 / K8V16 with int8 q), q_len x
// group up to the verify bound (32 rows of a 16-bit cache, 64 of an 8-bit one: row groups in
// side-by-side CTAs), no q_v; every layout, stride, mode, modifier, split and length the
// generator draws, against the oracle and the reference. Prints how many cases the decode kernel served (alignment pads and understated
// bounds send some to the generic kernel, which is checked the same way).
TEST(GpuDecode, Fuzz) {
  constexpr int kCases = 400;
  constexpr size_t kBuilt = std::size(fs::kernels::kDecodeConfigs);
  int ran = 0, failed = 0, served_decode = 0, served_fp8 = 0, served_int8 = 0;
  for (int i = 0; i < kCases && failed < 5; ++i) {
    auto rng = fstest::make_rng(1000 + uint64_t(i));
    CaseConfig c = fstest::random_case_config(rng);
    const fs::kernels::DecodeConfig built = fs::kernels::kDecodeConfigs[size_t(i) % kBuilt];
    c.has_qv = false;
    c.D = c.Dv = built.d;
    if (built.kv == DType::i8) {  // the int8 fork's formats: int8 q with q_scale
      make_int8(c, built.v == DType::i8, built.v == DType::i8 ? DType::bf16 : built.v,
                i % 2 ? DType::f16 : DType::bf16);
      if (built.v != DType::i8) c.kv_interleaved = false;  // K and V rows of different widths
    } else if (fs::is_fp8(built.kv)) {
      const bool fp8_q = i % 3 == 0;
      c.quant = fp8_q ? fstest::QuantMode::fp8_qkv : fstest::QuantMode::fp8_kv;
      c.kv_dtype = built.kv;
      c.q_dtype = fp8_q ? (i % 2 ? DType::f8e4m3 : DType::f8e5m2) : (i % 2 ? DType::bf16 : DType::f16);
      c.out_dtype = fp8_q ? (i % 4 < 2 ? DType::bf16 : DType::f16) : i % 5 == 1 ? DType::f32 : c.q_dtype;
    } else {
      c.quant = fstest::QuantMode::none;
      c.q_dtype = c.kv_dtype = built.kv;
      c.out_dtype = i % 5 == 1 ? DType::f32 : built.kv;
    }
    const int64_t bound = fs::decode_max_rows(fs::kernels::kv_bytes(built.kv) == 1);
    const int64_t group = c.H / c.H_kv, max_q = std::max<int64_t>(1, (i % 3 == 2 ? bound : 16) / group);
    for (int64_t& q : c.q_lens) q = std::min(q, max_q);
    if (c.batched()) c.q_lens.assign(c.q_lens.size(), c.q_lens.empty() ? 1 : c.q_lens[0]);
    auto crng = fstest::make_rng(2000 + uint64_t(i));
    fstest::AttentionCase ac = fstest::build_case(c, crng);
    const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [](fs::AttentionParams&) {});
    ++ran;
    served_decode += o.kernel == "decode";
    served_fp8 += o.kernel == "decode" && fs::is_fp8(c.kv_dtype);
    served_int8 += o.kernel == "decode" && c.kv_dtype == DType::i8;
    if (o.error.empty()) continue;
    ++failed;
    ADD_FAILURE() << "decode fuzz case " << i << " (served by " << o.kernel << ")\n  " << fstest::describe(c) << "\n"
                  << o.error << "(seed " << fstest::test_seed() << ")";
  }
  std::printf("[decode fuzz] %d cases, %d served by decode (%d with fp8 K/V, %d with int8 K), %d failed\n", ran,
              served_decode, served_fp8, served_int8, failed);
  if (failed == 0) EXPECT_GE(served_decode, ran / 4) << "the fuzz should mostly reach the decode kernel";
}

// A varlen max_seqlen_q below the truth (the GPU never trusts it): 5 rows x group 8 = 40
// packed rows, selected as decode by the bound of 1 x 8, computed in row groups.
// (max_seqlen_q 4 x group 8 = 32: one 32-row CTA per sequence, decode_cta_rows; sequence 0's 40
// rows are two row groups, the second served by the CTA's loop.)
TEST(GpuDecode, UnderstatedMaxSeqlenQ) {
  for (int64_t stated : {1, 4}) {
    auto rng = fstest::make_rng(7);
    CaseConfig c = decode_config(3, 400, 8, rng);
    c.mode = KvMode::varlen_paged;
    c.q_lens = {5, 1, 3};
    c.causal = true;
    c.num_splits = stated == 1 ? 1 : 2;
    fstest::AttentionCase ac = fstest::build_case(c, rng);
    const fsgpu::Outcome o = fsgpu::run_and_compare(ac, [&](fs::AttentionParams& p) { p.max_seqlen_q = stated; });
    EXPECT_EQ(o.kernel, "decode");
    EXPECT_EQ(o.error, "") << fstest::describe(c) << " stated max_seqlen_q " << stated;
  }
}

// A block index outside the cache is never read: exactly the rows that see its keys are NaN.
TEST(GpuDecode, BadBlockIndexGivesNanRows) {
  for (int splits : {1, 3})
    for (int bad_id : {-1, 1 << 20}) {
      auto rng = fstest::make_rng(8);
      CaseConfig c = decode_config(3, 10, 4, rng);
      c.k_lens = {40, 70, 33};
      c.block_size = 16;
      c.window = {20, 0};  // the last row of sequence 1 sees keys 49..69, not block 1 (16..31)
      c.num_splits = splits;
      fstest::AttentionCase ac = fstest::build_case(c, rng);
      fsgpu::expect_bad_block_nan_rows(ac, "decode", bad_id, splits);
    }
}
