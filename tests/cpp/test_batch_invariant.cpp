// Batch-invariant mode (AttentionParams::batch_invariant, Plan::split_size) on the CPU: the
// fixed-size split arithmetic, plans that split by size and name their bounds, and a sequence's
// out and LSE bitwise the same in every batch of its class (the default heuristic shown not to
// be). The random cases: support/split_kv_case.hpp.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>

#include "flashserve/attention.hpp"
#include "flashserve/status.hpp"
#include "support/split_kv_case.hpp"

using namespace fstest::splitkv;

TEST(BatchInvariant, FixedSizeSplitArithmetic) {
  constexpr int64_t S = fs::kBatchInvariantSplitKeys;
  EXPECT_EQ(S % 128, 0);  // a multiple of every kernel's KV tile and split granule
  for (int64_t sk : {int64_t(0), int64_t(1), S - 1, S, S + 1, 3 * S, 3 * S + 5, 40 * S - 1}) {
    const int n = fs::kMaxSplits;
    const int own = fs::seq_num_splits(sk, n, S);
    EXPECT_EQ(own, std::max<int64_t>(1, (sk + S - 1) / S)) << "sk=" << sk;
    int64_t next = 0;
    for (int s = 0; s < n; ++s) {  // contiguous, in order, fixed size, every key once
      const fs::KvRange r = fs::seq_split_range(sk, n, s, 128, S);
      if (s >= own) {
        EXPECT_EQ(r.begin, sk);
        EXPECT_EQ(r.end, sk);
        continue;
      }
      EXPECT_EQ(r.begin, next) << "sk=" << sk << " s=" << s;
      EXPECT_EQ(r.begin, s * S);
      EXPECT_EQ(r.end, std::min(sk, (s + 1) * S));
      next = r.end;
    }
    EXPECT_EQ(next, sk);
    // The boundaries never depend on the call's bound (the batch's longest sequence).
    for (int bound : {own, own + 1, 7 * own + 3})
      if (bound <= fs::kMaxSplits)
        for (int s = 0; s < own; ++s) {
          const fs::KvRange a = fs::seq_split_range(sk, bound, s, 128, S), b = fs::seq_split_range(sk, n, s, 16, S);
          EXPECT_EQ(a.begin, b.begin);
          EXPECT_EQ(a.end, b.end);
        }
  }
  // split_size 0: the count-based split of the default mode.
  EXPECT_EQ(fs::seq_num_splits(100, 7, 0), 7);
  const fs::KvRange d = fs::seq_split_range(100, 4, 1, 16, 0), e = fs::split_kv_range(100, 4, 1, 16);
  EXPECT_EQ(d.begin, e.begin);
  EXPECT_EQ(d.end, e.end);
  // A clamped count (a sequence past the plan's max_seqlen_k) still covers every key.
  EXPECT_EQ(fs::seq_num_splits(5 * S, 2, S), 2);
  EXPECT_EQ(fs::seq_split_range(5 * S, 2, 1, 128, S).end, 5 * S);
}

TEST(BatchInvariant, PlansSplitBySizeAndNameTheirBounds) {
  fs::ProblemShape s;
  s.batch = 64;
  s.max_seqlen_q = 1;
  s.max_seqlen_k = 4096;
  s.num_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = s.head_dim_v = 128;
  s.total_q = 64;
  s.page_size = 16;
  s.batch_invariant = true;
  const fs::DeviceProps gpu = fs::DeviceProps::h200(), cpu = fs::DeviceProps::cpu();
  for (const fs::DeviceProps& dev : {gpu, cpu}) {
    fs::Plan p = fs::make_plan(s, dev, 0);
    EXPECT_EQ(p.split_size, fs::kBatchInvariantSplitKeys);
    EXPECT_EQ(p.num_splits, 4);
    EXPECT_EQ(p.workspace.count > 0, dev.device.type == fs::DeviceType::cuda);
    fs::ProblemShape longer = s;  // the count follows max_seqlen_k alone, not B or the device
    longer.max_seqlen_k = 32 * 1024 + 1;
    longer.batch = longer.total_q = 1;
    EXPECT_EQ(fs::make_plan(longer, dev, 0).num_splits, 33);
    p = fs::make_plan(s, dev, 1);  // none
    EXPECT_EQ(p.num_splits, 1);
    EXPECT_EQ(p.split_size, 0);
    EXPECT_THROW(fs::make_plan(s, dev, 2), fs::Error);  // a count is not batch-invariant
    fs::ProblemShape prefill = s;  // longer queries: never split
    prefill.max_seqlen_q = fs::kBatchInvariantDecodeMaxQ + 1;
    prefill.total_q = 64 * prefill.max_seqlen_q;
    p = fs::make_plan(prefill, dev, 0);
    EXPECT_EQ(p.num_splits, 1);
    EXPECT_EQ(p.split_size, 0);
    fs::ProblemShape huge = s;  // more than kMaxSplits splits: an error naming max_seqlen_k
    huge.max_seqlen_k = fs::kMaxSplits * fs::kBatchInvariantSplitKeys + 1;
    try {
      fs::make_plan(huge, dev, 0);
      ADD_FAILURE() << "expected an error";
    } catch (const fs::Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_seqlen_k"), std::string::npos) << e.what();
    }
  }
  fs::ProblemShape wide = s;  // the CUDA workspace bound: an error naming it, never fewer splits
  wide.batch = wide.total_q = 1024;
  wide.max_seqlen_k = 8192;
  EXPECT_GT(8 * wide.total_q * wide.num_heads, fs::max_invariant_split_rows(gpu));
  try {
    fs::make_plan(wide, gpu, 0);
    ADD_FAILURE() << "expected an error";
  } catch (const fs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_invariant_split_rows"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fs::make_plan(wide, cpu, 0).num_splits, 8);  // the CPU merges in registers
  // The decode shapes fit (bf16 GQA 32/8: B=64 L=4k, B=16 L=8k, B=1 L=32k, B=256 L=1k).
  for (auto [b, l] : {std::pair<int64_t, int64_t>{64, 4096}, {16, 8192}, {1, 32768}, {256, 1024}}) {
    fs::ProblemShape d = s;
    d.batch = d.total_q = b;
    d.max_seqlen_k = l;
    EXPECT_NO_THROW(fs::make_plan(d, gpu, 0)) << "B=" << b << " L=" << l;
  }
  fs::ProblemShape plain = s;  // the flag is part of the shape a plan was made for
  plain.batch_invariant = false;
  EXPECT_FALSE(plain == s);
}

namespace {
// A random batch of one class: decode-like (every q_len <= kBatchInvariantDecodeMaxQ) with KV
// lengths across several fixed-size splits, or longer queries.
Config invariant_config(std::mt19937_64& rng, int family, bool decode_class) {
  Config c = random_config(rng, family);
  auto uni = [&](int64_t lo, int64_t hi) { return lo + int64_t(rng() % uint64_t(hi - lo + 1)); };
  const int64_t common_sq = decode_class ? uni(1, 8) : uni(17, 20);
  while (c.seqs.size() < 3) c.seqs.push_back({});
  for (SeqSpec& s : c.seqs) {
    s.seed = rng();
    s.sk = uni(0, 4) == 0 ? uni(0, 200) : uni(900, 3300);
    s.sq = c.batched() ? common_sq : decode_class ? uni(0, fs::kBatchInvariantDecodeMaxQ) : uni(17, 20);
  }
  c.chunk = 0;  // keep the keys visible across split boundaries (any modifier is invariant)
  return c;
}
}  // namespace

TEST(BatchInvariant, OutputOfASequenceIsTheSameInEveryBatch) {
  auto rng = fstest::make_rng(0xb1a5);
  for (int trial = 0; trial < 2 * kFamilies; ++trial) {
    const bool decode_class = trial % 4 != 3;
    Config c = invariant_config(rng, trial % kFamilies, decode_class);
    Built batch = build(c);
    batch.p.batch_invariant = true;
    const Result all = run(batch, 0);
    const Result unsplit = run(batch, 1);  // the same values within split rounding
    ASSERT_TRUE(compare(all, unsplit, out_tolerance(batch), kLseTol).empty()) << describe(c);
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      Config alone = c;
      alone.seqs = {c.seqs[s]};
      alone.placement = rng();
      Built one = build(alone);
      one.p.batch_invariant = true;
      const Result r = run(one, 0);
      EXPECT_TRUE(same_bits(r[0].out, all[s].out) && same_bits(r[0].lse, all[s].lse))
          << describe(c) << ": sequence " << s << " alone differs from it inside the batch";
      // and inside another random batch of its class
      Config other = invariant_config(rng, trial % kFamilies, decode_class);
      other.kv = c.kv, other.layout = c.layout, other.block_size = c.block_size, other.H = c.H, other.Hkv = c.Hkv;
      other.D = c.D, other.Dv = c.Dv, other.qv = c.qv, other.dtype = c.dtype, other.fp8_kv = c.fp8_kv;
      other.causal = c.causal, other.window = c.window, other.softcap = c.softcap, other.sinks = c.sinks;
      other.alibi = c.alibi, other.alibi_sqrt = c.alibi_sqrt, other.seed = c.seed;
      if (c.batched())
        for (SeqSpec& q : other.seqs) q.sq = c.seqs[s].sq;
      const size_t at = rng() % (other.seqs.size() + 1);
      other.seqs.insert(other.seqs.begin() + ptrdiff_t(at), c.seqs[s]);
      Built mix = build(other);
      mix.p.batch_invariant = true;
      const Result m = run(mix, 0);
      EXPECT_TRUE(same_bits(m[at].out, all[s].out) && same_bits(m[at].lse, all[s].lse))
          << describe(other) << ": sequence " << at << " differs from it in " << describe(c);
    }
  }
}

// The check above can fail: the default mode's heuristic picks the split count from the
// batch (here, on 4 CPU workers: one sequence alone is split 4 ways, 16 together are not).
TEST(BatchInvariant, DefaultSplitsAreNotBatchInvariant) {
  const int threads = omp_get_max_threads();
  omp_set_num_threads(4);
  Config c;
  c.kv = Kv::varlen_paged;
  c.H = 1, c.Hkv = 1, c.D = c.Dv = 64;
  c.seed = 7, c.placement = 11;
  for (uint64_t b = 0; b < 16; ++b) c.seqs.push_back({1, 3000, b + 1});
  Built batch = build(c);
  Config alone = c;
  alone.seqs = {c.seqs[0]};
  Built one = build(alone);
  EXPECT_EQ(fs::plan_varlen_attention(one.p, fs::DeviceProps::cpu()).num_splits, 4);
  EXPECT_EQ(fs::plan_varlen_attention(batch.p, fs::DeviceProps::cpu()).num_splits, 1);
  const Result all = run(batch, 0), r = run(one, 0);
  EXPECT_FALSE(same_bits(r[0].out, all[0].out)) << "the heuristic's splits gave the same bits";
  one.p.batch_invariant = true;
  batch.p.batch_invariant = true;
  EXPECT_TRUE(same_bits(run(one, 0)[0].out, run(batch, 0)[0].out));
  omp_set_num_threads(threads);
}
