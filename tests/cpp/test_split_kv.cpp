// Split-KV: every split count gives the unsplit result within rounding; the unsplit path is
// bitwise reproducible and batch-invariant; split-count choice and plans (scheduler
// metadata); hand-computed softmax cases and the operand decoders of the CPU reference.
// The random cases: support/split_kv_case.hpp.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "common/decode_rows.hpp"
#include "flashserve/attention.hpp"
#include "flashserve/status.hpp"
#include "reference/attn_load.hpp"
#include "support/split_kv_case.hpp"

using namespace fstest::splitkv;

TEST(SplitKv, EverySplitCountMatchesUnsplit) {
  auto rng = fstest::make_rng(0x5b117);
  for (int family = 0; family < kFamilies; ++family) {
    for (int rep = 0; rep < (family == 5 ? 4 : 10); ++rep) {
      const Config c = random_config(rng, family);
      Built bt = build(c);
      const Result base = run(bt, 1);
      const int cap = std::min(fs::kMaxSplits, std::max(1, granules(bt, fs::DeviceProps::cpu())));
      for (int n : {2, 3, 4, 5, 6, 7, 8, 9, 64, 128}) {
        bt.p.num_splits = n;
        const fs::Plan plan = c.batched() ? fs::plan_kvcache_attention(bt.p, fs::DeviceProps::cpu())
                                          : fs::plan_varlen_attention(bt.p, fs::DeviceProps::cpu());
        ASSERT_EQ(plan.num_splits, std::min(n, cap)) << describe(c);
        const std::string err = compare(run(bt, n), base, out_tolerance(bt), kLseTol);
        ASSERT_TRUE(err.empty()) << describe(c) << "\nnum_splits=" << n << ": " << err;
      }
    }
  }
}

TEST(SplitKv, UnsplitIsBitwiseReproducibleAcrossRunsAndThreads) {
  auto rng = fstest::make_rng(0x5b118);
  const int threads = omp_get_max_threads();
  for (int family = 0; family < kFamilies; ++family) {
    const Config c = random_config(rng, family);
    Built bt = build(c);
    const Result a = run(bt, 1), b = run(bt, 1);
    omp_set_num_threads(1);
    const Result one = run(bt, 1);
    omp_set_num_threads(2);
    const Result two = run(bt, 1);
    omp_set_num_threads(threads);
    for (size_t s = 0; s < a.size(); ++s) {
      EXPECT_TRUE(same_bits(a[s].out, b[s].out) && same_bits(a[s].lse, b[s].lse)) << describe(c) << " seq " << s;
      EXPECT_TRUE(same_bits(one[s].out, two[s].out) && same_bits(one[s].lse, two[s].lse))
          << describe(c) << " seq " << s << ": 1 vs 2 threads";
      EXPECT_TRUE(same_bits(a[s].out, one[s].out)) << describe(c) << " seq " << s;
    }
  }
}

TEST(SplitKv, UnsplitIsBatchInvariant) {
  auto rng = fstest::make_rng(0x5b119);
  for (int family = 0; family < kFamilies; ++family) {
    Config c = random_config(rng, family);
    while (c.seqs.size() < 3) c.seqs.push_back({c.seqs[0].sq, c.seqs[0].sk + 7, rng()});
    Built batch = build(c);
    const Result all = run(batch, 1);
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      Config alone = c;
      alone.seqs = {c.seqs[s]};
      alone.placement = rng();  // other block / row placement too
      Built one = build(alone);
      const Result r = run(one, 1);
      EXPECT_TRUE(same_bits(r[0].out, all[s].out) && same_bits(r[0].lse, all[s].lse))
          << describe(c) << ": sequence " << s << " alone differs from it inside the batch";
    }
  }
}

TEST(SplitKv, HeuristicSplitsOnlyWhenTheGpuWouldIdle) {
  fs::ProblemShape s = decode_shape(1, 32768);
  EXPECT_GT(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), 1);
  s.batch = s.total_q = 256;
  EXPECT_EQ(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), 1);
  s.batch = s.total_q = 1;
  s.max_seqlen_k = 8;  // a single granule: nothing to split
  EXPECT_EQ(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), 1);
  // The cascade prefix pass of 256 decodes (GQA 32/8) over a 32k shared prefix: one sequence of
  // 256 query rows, 32 heads x 2 row tiles = 64 prefill CTAs for 132 SMs: split in 2.
  fs::ProblemShape pre = decode_shape(1, 32768);
  pre.max_seqlen_q = pre.total_q = 256;
  ASSERT_EQ(pre.num_heads, 32);
  ASSERT_EQ(pre.num_kv_heads, 8);
  EXPECT_EQ(fs::choose_num_splits(pre, fs::DeviceProps::h200(), 0), 2);
  pre.max_seqlen_q = pre.total_q = 8192;  // a long prefill fills the GPU unsplit
  EXPECT_EQ(fs::choose_num_splits(pre, fs::DeviceProps::h200(), 0), 1);
  // A verify step of up to 32 packed rows (q_len 8 x GQA 4) of a 16-bit cache runs one 32-row
  // decode CTA per (sequence, KV head), as the decode step; an 8-bit cache's runs 16-row CTAs,
  // two side by side (common/decode_rows.hpp: decode_cta_rows, decode_row_ctas): half the decode
  // step's splits fill the same slots.
  fs::ProblemShape verify = decode_shape(1, 32768);
  const int decode_splits = fs::choose_num_splits(verify, fs::DeviceProps::h200(), 0);
  verify.max_seqlen_q = verify.total_q = 8;
  EXPECT_EQ(fs::choose_num_splits(verify, fs::DeviceProps::h200(), 0), decode_splits);
  fs::ProblemShape verify8 = decode_shape(1, 32768);
  verify8.kv_8bit = true;
  const int decode8_splits = fs::choose_num_splits(verify8, fs::DeviceProps::h200(), 0);
  verify8.max_seqlen_q = verify8.total_q = 8;
  EXPECT_EQ(2 * fs::choose_num_splits(verify8, fs::DeviceProps::h200(), 0), decode8_splits);
  // MLA's absorbed decode (H = 16, one latent head, D 64 + Dv 512; the splits measured fastest
  // on the H200, plan.cpp: stream_slots): a 16-bit latent splits up to one CTA per SM, an fp8
  // one up to two; at least 256 keys per split.
  struct MlaRow { int64_t batch, keys; bool fp8; int want; };
  for (const MlaRow r : {MlaRow{64, 4096, false, 2}, MlaRow{64, 4096, true, 4}, MlaRow{1, 32768, false, 128},
                         MlaRow{1, 32768, true, 128}, MlaRow{16, 4096, false, 8}, MlaRow{16, 8192, true, 16},
                         MlaRow{32, 4096, false, 4}, MlaRow{32, 4096, true, 8}, MlaRow{128, 8192, false, 1},
                         MlaRow{128, 8192, true, 2}, MlaRow{8, 4096, false, 16}, MlaRow{256, 1024, true, 1}}) {
    fs::ProblemShape mla = decode_shape(r.batch, r.keys);
    mla.num_heads = 16, mla.num_kv_heads = 1, mla.head_dim = 64, mla.head_dim_v = 512, mla.page_size = 64;
    mla.kv_8bit = r.fp8;
    EXPECT_EQ(fs::choose_num_splits(mla, fs::DeviceProps::h200(), 0), r.want)
        << "B=" << r.batch << " L=" << r.keys << (r.fp8 ? " fp8" : " bf16");
  }
}

// The decode split counts measured fastest on the H200 (bf16, H = 32, D = 128, block 16; every
// count swept, bench/RESULTS.md 2026-11-25 07:22): the heuristic picks them, or one within 3%
// (GQA 16 B=4 L=16k: 16 splits 41.9 us, 32 splits of 512 keys 40.7).
// The decode kernel's CTAs per (sequence, KV head) as the kernel launches them and the planner
// counts them (common/decode_rows.hpp): one 16-row CTA up to 16 packed rows; past it a 16-bit
// cache's 32-row CTAs, an 8-bit cache's 16-row CTAs side by side, at most four.
TEST(SplitKv, DecodeRowCtasByCacheFormat) {
  struct Row { int64_t rows; bool kv_8bit; int64_t cta_rows; int ctas; };
  const Row want[] = {{1, false, 16, 1},  {16, false, 16, 1}, {17, false, 32, 1}, {32, false, 32, 1},
                      {33, false, 32, 2}, {1, true, 16, 1},   {16, true, 16, 1},  {17, true, 16, 2},
                      {32, true, 16, 2},  {48, true, 16, 3},  {64, true, 16, 4},  {200, true, 16, 4},
                      {200, false, 32, 4}};
  for (const Row& r : want) {
    EXPECT_EQ(fs::decode_cta_rows(r.rows, r.kv_8bit), r.cta_rows) << r.rows << (r.kv_8bit ? " 8-bit" : " 16-bit");
    EXPECT_EQ(fs::decode_row_ctas(r.rows, r.kv_8bit), r.ctas) << r.rows << (r.kv_8bit ? " 8-bit" : " 16-bit");
  }
  // Every packed row has a CTA within a cache format's bound (decode_max_rows).
  for (bool b8 : {false, true})
    for (int64_t rows = 1; rows <= fs::decode_max_rows(b8); ++rows)
      EXPECT_GE(fs::decode_row_ctas(rows, b8) * fs::decode_cta_rows(rows, b8), rows) << rows;
}

TEST(SplitKv, HeuristicPicksTheMeasuredDecodeSplits) {
  struct Row { int64_t group, batch, keys; int want; };
  const Row rows[] = {{4, 1, 32768, 32}, {4, 4, 16384, 8},  {4, 16, 8192, 2}, {4, 64, 4096, 1},
                      {8, 1, 32768, 32}, {8, 4, 16384, 16}, {8, 16, 8192, 4}, {8, 64, 4096, 1},
                      {16, 1, 32768, 32}, {16, 4, 16384, 16}, {16, 16, 8192, 8}, {16, 64, 4096, 2}};
  for (const Row& r : rows) {
    fs::ProblemShape s = decode_shape(r.batch, r.keys);
    s.num_kv_heads = s.num_heads / r.group;
    EXPECT_EQ(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), r.want)
        << "GQA " << r.group << " B=" << r.batch << " L=" << r.keys;
  }
}

TEST(SplitKv, RequestedSplitsAreCapped) {
  fs::ProblemShape s;
  s.batch = 1;
  s.max_seqlen_q = 1;
  s.num_heads = s.num_kv_heads = 1;
  s.head_dim = s.head_dim_v = 64;
  s.max_seqlen_k = 1 << 20;
  const fs::DeviceProps cpu = fs::DeviceProps::cpu();
  EXPECT_EQ(fs::choose_num_splits(s, cpu, 1), 1);
  EXPECT_EQ(fs::choose_num_splits(s, cpu, 7), 7);
  EXPECT_EQ(fs::choose_num_splits(s, cpu, 1000), fs::kMaxSplits);
  s.max_seqlen_k = 100;  // 7 granules of 16
  EXPECT_EQ(fs::choose_num_splits(s, cpu, 50), 7);
  s.max_seqlen_k = 0;
  EXPECT_EQ(fs::choose_num_splits(s, cpu, 50), 1);
  EXPECT_THROW(fs::choose_num_splits(s, cpu, -1), fs::Error);
}

TEST(SplitKv, PlanFromSchedulerMetadataDrivesTheCallAndMustMatch) {
  auto rng = fstest::make_rng(0x5b11a);
  for (int family : {0, 3}) {
    Config c = random_config(rng, family);
    for (SeqSpec& s : c.seqs) s.sk = std::max<int64_t>(s.sk, 120);
    Built bt = build(c);
    bt.p.num_splits = 5;
    const fs::Plan plan = c.batched() ? fs::plan_kvcache_attention(bt.p, fs::DeviceProps::cpu())
                                      : fs::plan_varlen_attention(bt.p, fs::DeviceProps::cpu());
    ASSERT_EQ(plan.num_splits, 5);
    fs::ExecContext ctx;
    ctx.plan = &plan;
    const Result forced = run(bt, 5), planned = run(bt, 1, ctx);  // the plan wins over num_splits
    for (size_t s = 0; s < forced.size(); ++s)
      EXPECT_TRUE(same_bits(forced[s].out, planned[s].out) && same_bits(forced[s].lse, planned[s].lse)) << describe(c);

    Config other = c;
    other.seqs.push_back({c.seqs[0].sq, c.seqs[0].sk + 50, rng()});  // another batch shape
    Built stale = build(other);
    fstest::poison_storage(stale.out);
    const auto before = fstest::snapshot(stale.out);
    try {
      call(stale, ctx);
      ADD_FAILURE() << "a plan made for another shape was accepted: " << describe(other);
    } catch (const fs::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("scheduler_metadata: expected a plan made for ", 0), 0u) << e.what();
    }
    EXPECT_TRUE(fstest::same_bytes(stale.out, before)) << "out written by a rejected call";
  }
}

namespace {

// One varlen sequence, H = H_kv = 1, D = Dv = 8, f32, contiguous KV (token t at row t),
// every q/k/v element 0; softmax_scale 1. Tests then set the few values they need.
Built tiny(int64_t sq, int64_t sk) {
  Config c;
  c.kv = Kv::varlen_contiguous;
  c.D = c.Dv = 8;
  c.seqs = {{sq, sk, 1}};
  Built bt = build(c);
  for (const fs::TensorRef* t : {&bt.p.q, &bt.p.k, &bt.p.v})
    fstest::for_each_index(*t, [&](const std::vector<int64_t>&, int64_t off) {
      static_cast<float*>(t->data)[off] = 0.0f;
    });
  bt.p.softmax_scale = 1.0f;
  return bt;
}

void set_row(const fs::TensorRef& t, int64_t row, int64_t d, float x) {
  *static_cast<float*>(t.at(row, 0, d)) = x;
}

HostTensor sink_of(float x) {
  HostTensor s = HostTensor::zeros(DType::f32, {1});
  s.set({0}, x);
  return s;
}

}  // namespace

TEST(ReferenceAttention, HandComputedSoftmax) {
  // s = (0, ln 3): p = (1/4, 3/4); v0 = 1, v1 = 5: out = 4, lse = ln 4.
  Built bt = tiny(1, 2);
  set_row(bt.p.q, 0, 0, 1.0f);
  set_row(bt.p.k, 1, 0, std::log(3.0f));
  for (int64_t d = 0; d < 8; ++d) set_row(bt.p.v, 0, d, 1.0f), set_row(bt.p.v, 1, d, 5.0f);
  Result r = run(bt, 1);
  for (float o : r[0].out) EXPECT_NEAR(o, 4.0f, 1e-6f);
  EXPECT_NEAR(r[0].lse[0], std::log(4.0f), 1e-6f);
  // A sink of ln 4 joins the denominator only: out = (1 + 15) / 8, lse = ln 8.
  const HostTensor sink = sink_of(std::log(4.0f));
  bt.p.s_aux = sink.ref;
  r = run(bt, 1);
  for (float o : r[0].out) EXPECT_NEAR(o, 2.0f, 1e-6f);
  EXPECT_NEAR(r[0].lse[0], std::log(8.0f), 1e-6f);
}

TEST(ReferenceAttention, HandComputedAcrossSplits) {
  // 40 equal scores, v_j = j: out = mean = 19.5, lse = ln 40; 3 splits of 16 keys; with a sink
  // of ln 40 the output halves and lse = ln 80, applied once, not per split.
  Built bt = tiny(1, 40);
  for (int64_t j = 0; j < 40; ++j)
    for (int64_t d = 0; d < 8; ++d) set_row(bt.p.v, j, d, float(j));
  for (int n : {1, 3}) {
    Result r = run(bt, n);
    for (float o : r[0].out) EXPECT_NEAR(o, 19.5f, 2e-5f) << n;
    EXPECT_NEAR(r[0].lse[0], std::log(40.0f), 1e-6f) << n;
  }
  const HostTensor sink = sink_of(std::log(40.0f));
  bt.p.s_aux = sink.ref;
  for (int n : {1, 3}) {
    Result r = run(bt, n);
    for (float o : r[0].out) EXPECT_NEAR(o, 9.75f, 2e-5f) << n;
    EXPECT_NEAR(r[0].lse[0], std::log(80.0f), 2e-6f) << n;
  }
}

TEST(ReferenceAttention, RowsWithoutVisibleKeys) {
  // sq = 3 > sk = 1: aligned positions -2, -1, 0. q0 = (1, ..), k0 = (0.5, ..): s = 0.5.
  Built bt = tiny(3, 1);
  for (int64_t i = 0; i < 3; ++i) set_row(bt.p.q, i, 0, 1.0f);
  set_row(bt.p.k, 0, 0, 0.5f);
  for (int64_t d = 0; d < 8; ++d) set_row(bt.p.v, 0, d, float(d + 1));
  auto expect_rows = [&](const Result& r, float empty_lse, const char* what) {
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(r[0].out[size_t(i * 8 + d)], 0.0f) << what << " row " << i;
      EXPECT_EQ(r[0].lse[size_t(i)], empty_lse) << what << " row " << i;
    }
    for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(r[0].out[size_t(16 + d)], float(d + 1)) << what;
  };
  bt.p.causal = true;
  expect_rows(run(bt, 1), -INFINITY, "causal");
  bt.p.causal = false;
  bt.p.chunk_size = 2;  // chunks by floor division: -2, -1 lie in [-2, 0), position 0 in [0, 2)
  expect_rows(run(bt, 1), -INFINITY, "chunk 2");
  const HostTensor sink = sink_of(-0.75f);
  bt.p.s_aux = sink.ref;
  Result r = run(bt, 1);
  for (int64_t i = 0; i < 2; ++i) EXPECT_EQ(r[0].lse[size_t(i)], -0.75f) << "sink, row " << i;
  for (int64_t i = 0; i < 2 * 8; ++i) EXPECT_EQ(r[0].out[size_t(i)], 0.0f);

  // Window (0, 0) at position 2 of 3 keys sees key 2 only.
  Built w = tiny(1, 3);
  for (int64_t j = 0; j < 3; ++j) set_row(w.p.v, j, 0, float(10 * j));
  w.p.window = {0, 0};
  r = run(w, 1);
  EXPECT_EQ(r[0].out[0], 20.0f);
  EXPECT_EQ(r[0].lse[0], 0.0f);
}

TEST(ReferenceAttention, CudaTensorsAreNotImplementedInCpuBuilds) {
#if FLASHSERVE_WITH_CUDA
  GTEST_SKIP() << "CUDA build: CUDA tensors run the kernels (tests/gpu)";
#endif
  Built bt = tiny(2, 5);
  EXPECT_EQ(fs::attention_unsupported_reason(bt.p, false, fs::DeviceProps::cpu()), "");
  const fs::Device gpu{fs::DeviceType::cuda, 0};
  for (fs::TensorRef* t : {&bt.p.q, &bt.p.out, &bt.p.k, &bt.p.v}) t->device = gpu;
  for (fs::OptTensor* t : {&bt.p.lse, &bt.p.cu_seqlens_q, &bt.p.cu_seqlens_k, &bt.p.seqused_k}) (*t)->device = gpu;
  try {
    fs::varlen_attention(bt.p);
    ADD_FAILURE() << "CUDA tensors were accepted";
  } catch (const fs::NotImplemented& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  EXPECT_NE(fs::attention_unsupported_reason(bt.p, false, fs::DeviceProps::cpu()).find("CUDA"), std::string::npos);
}

TEST(ReferenceLoad, DecodersMatchNumericLoads) {
  for (DType t : {DType::f16, DType::bf16, DType::f8e4m3, DType::f8e5m2, DType::i8, DType::f32}) {
    const int codes = fs::dtype_size(t) == 1 ? 256 : 65536;
    const auto decode = fs::reference::row_decoder(t);
    for (int c = 0; c < codes; ++c) {
      unsigned char raw[4] = {};
      if (t == DType::f32) {
        const float x = fs::numeric::float_of(uint32_t(c) * 65537u);  // a spread of bit patterns
        std::memcpy(raw, &x, 4);
      } else {
        std::memcpy(raw, &c, fs::dtype_size(t));
      }
      float got[2] = {-1.0f, -1.0f};
      decode(raw, 1, 1.0f, nullptr, got, 2);
      const float want = fs::numeric::load_float(raw, t);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got[0])) << fs::dtype_name(t) << " code " << c;
      } else {
        ASSERT_EQ(fs::numeric::bits_of(got[0]), fs::numeric::bits_of(want)) << fs::dtype_name(t) << " code " << c;
      }
      ASSERT_EQ(got[1], -1.0f);
    }
  }
  // Scales: dst[k * stride] = x[k] * scale * chan[k].
  const int8_t x[3] = {2, -3, 5};
  const float chan[3] = {0.5f, 2.0f, 4.0f};
  float out[6] = {};
  fs::reference::row_decoder(DType::i8)(x, 3, 3.0f, chan, out, 2);
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(out[2], -18.0f);
  EXPECT_EQ(out[4], 60.0f);
}

// On CUDA the split partials (splits x total_q x H rows) stay within max_split_rows, whatever is
// requested: the backend sizes its workspace with that bound, not with the batch capacity.
TEST(SplitKv, SplitRowsBoundTheWorkspaceOnCuda) {
  fs::ProblemShape s;
  s.batch = 64;
  s.max_seqlen_q = 16;
  s.total_q = 64 * 16;
  s.num_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = s.head_dim_v = 128;
  s.max_seqlen_k = 1 << 16;
  const fs::DeviceProps gpu = fs::DeviceProps::h200();
  const int64_t bound = fs::max_split_rows(gpu), rows = s.total_q * s.num_heads;
  EXPECT_EQ(bound, 16896);  // 2 x 2 waves x 2 CTAs x 132 SMs x 16 rows
  const int forced = fs::choose_num_splits(s, gpu, 64);
  EXPECT_EQ(forced, 1);  // one split is already 32768 rows
  const fs::Plan plan = fs::make_plan(s, gpu, 64);
  EXPECT_LE(plan.workspace.total_bytes, size_t(bound) * (128 + 1) * 4 + 2 * fs::kWorkspaceAlign);
  for (int64_t b : {1, 4, 16, 64, 256}) {  // heuristic decode shapes stay within the bound too
    s.batch = b;
    s.max_seqlen_q = 1;
    s.total_q = b;
    EXPECT_LE(fs::choose_num_splits(s, gpu, 0) * s.total_q * s.num_heads, bound) << "B=" << b;
  }
  EXPECT_EQ(fs::choose_num_splits(s, fs::DeviceProps::cpu(), 64), 64);  // the CPU merges in registers
}
