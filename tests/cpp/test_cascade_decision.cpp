// The cascade decision (SPEC.md §6): each eligibility rule on its own, prefills always taking
// cascade, and the cost model moving the expected way: more SMs toward split-KV decode, a
// longer shared prefix or more requests toward cascade.
#include <gtest/gtest.h>

#include <vector>

#include "flashserve/backend.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using V32 = std::vector<int32_t>;

be::LayerSpec layer(int64_t heads, int64_t kv_heads) {
  be::LayerSpec l;
  l.num_heads = heads;
  l.num_kv_heads = kv_heads;
  l.head_size = 128;
  return l;
}

fs::DeviceProps sms(int n) {
  fs::DeviceProps d;
  d.device = fs::Device{fs::DeviceType::cuda, 0};
  d.num_sms = n;
  return d;
}

bool decide(int64_t prefix, int64_t reqs, const be::LayerSpec& l, int num_sms, int32_t q = 1) {
  const V32 lens(static_cast<size_t>(reqs), q);
  return be::use_cascade(prefix, lens, l, 1, sms(num_sms));
}

}  // namespace

TEST(CascadeDecision, EligibilityRules) {
  const be::LayerSpec l = layer(32, 8);
  const V32 decodes(256, 1);
  ASSERT_TRUE(be::use_cascade(8192, decodes, l, 1, sms(132)));  // the baseline takes cascade

  EXPECT_FALSE(be::use_cascade(255, decodes, l, 1, sms(1)));
  EXPECT_TRUE(be::use_cascade(256, decodes, l, 1, sms(1)));
  EXPECT_FALSE(be::use_cascade(8192, V32(7, 1), l, 1, sms(1)));
  EXPECT_FALSE(be::use_cascade(0, decodes, l, 1, sms(132)));
  EXPECT_FALSE(be::use_cascade(8192, decodes, l, 2, sms(132)));  // decode context parallel

  be::LayerSpec x = l;
  float slopes[32] = {};
  x.alibi_slopes = fs::TensorRef::contiguous(slopes, fs::DType::f32, {32});
  EXPECT_FALSE(be::use_cascade(8192, decodes, x, 1, sms(132)));
  x = l;
  x.sliding_window = 4096;
  EXPECT_FALSE(be::use_cascade(8192, decodes, x, 1, sms(132)));
  x = l;
  x.attention_chunk_size = 1024;
  EXPECT_FALSE(be::use_cascade(8192, decodes, x, 1, sms(132)));
}

TEST(CascadeDecision, PrefillsAlwaysTakeCascadeWhenEligible) {
  // Tiny prefix, few requests, a huge GPU: the cost model alone would pick decode.
  const be::LayerSpec l = layer(8, 8);
  V32 lens(8, 1);
  ASSERT_FALSE(be::use_cascade(256, lens, l, 1, sms(100000)));
  lens[7] = 2;
  EXPECT_TRUE(be::use_cascade(256, lens, l, 1, sms(100000)));
  lens[0] = 300;
  EXPECT_TRUE(be::use_cascade(256, lens, l, 1, sms(100000)));
  EXPECT_FALSE(be::use_cascade(255, lens, l, 1, sms(1)));  // the rules still hold first
}

TEST(CascadeDecision, CostModelTakesBothSides) {
  const be::LayerSpec l = layer(32, 8);
  EXPECT_TRUE(decide(8192, 256, l, 132));     // many requests re-reading a long prefix
  EXPECT_FALSE(decide(256, 8, layer(8, 8), 132));  // two tiles, eight requests: one wave either way
  EXPECT_TRUE(decide(4096, 64, l, 16));
  EXPECT_FALSE(decide(4096, 64, l, 1 << 20));  // enough SMs to split the prefix fully
  // Requests without queries (q = 0) count as decodes; the prefix pass then has nothing to do.
  EXPECT_TRUE(decide(8192, 256, l, 132, 0));
}

// Monotonicity over random layers: for a < b,
//   cascade with b SMs      => cascade with a SMs,
//   cascade with prefix a   => cascade with prefix b,
//   cascade with a requests => cascade with b requests.
// Each direction must also be seen to flip somewhere, so the checks are not vacuous.
TEST(CascadeDecision, CostModelIsMonotone) {
  auto rng = fstest::make_rng(0xca5cade);
  int flips_sms = 0, flips_prefix = 0, flips_reqs = 0;
  const int kv_choices[] = {1, 2, 4, 8, 16};
  const int group_choices[] = {1, 2, 4, 8, 16, 64, 128};
  for (int it = 0; it < 3000; ++it) {
    const int64_t kv = kv_choices[rng() % 5], group = group_choices[rng() % 7];
    const be::LayerSpec l = layer(kv * group, kv);
    const int64_t reqs = 8 + int64_t(rng() % 600), prefix = 256 + int64_t(rng() % 100000);
    const int s1 = 1 + int(rng() % 2000), s2 = s1 + 1 + int(rng() % 2000);
    const bool at_s1 = decide(prefix, reqs, l, s1), at_s2 = decide(prefix, reqs, l, s2);
    ASSERT_TRUE(!at_s2 || at_s1) << "more SMs took cascade: prefix " << prefix << " reqs " << reqs << " kv " << kv
                                 << " group " << group << " sms " << s1 << " -> " << s2;
    flips_sms += at_s1 != at_s2;

    const int64_t p2 = prefix + 1 + int64_t(rng() % 50000);
    const bool at_p1 = decide(prefix, reqs, l, s1), at_p2 = decide(p2, reqs, l, s1);
    ASSERT_TRUE(!at_p1 || at_p2) << "a longer prefix left cascade: prefix " << prefix << " -> " << p2 << " reqs "
                                 << reqs << " kv " << kv << " group " << group << " sms " << s1;
    flips_prefix += at_p1 != at_p2;

    const int64_t r2 = reqs + 1 + int64_t(rng() % 400);
    const bool at_r1 = decide(prefix, reqs, l, s1), at_r2 = decide(prefix, r2, l, s1);
    ASSERT_TRUE(!at_r1 || at_r2) << "more requests left cascade: reqs " << reqs << " -> " << r2 << " prefix "
                                 << prefix << " kv " << kv << " group " << group << " sms " << s1;
    flips_reqs += at_r1 != at_r2;
  }
  EXPECT_GT(flips_sms, 0);
  EXPECT_GT(flips_prefix, 0);
  EXPECT_GT(flips_reqs, 0);
}

// Sweeping one variable at a time from a point, the decision changes at most once.
TEST(CascadeDecision, SweepsFlipAtMostOnce) {
  const be::LayerSpec l = layer(32, 8);
  auto count_flips = [](auto&& f, int64_t lo, int64_t hi, int64_t step) {
    int flips = 0;
    bool prev = f(lo);
    for (int64_t x = lo + step; x <= hi; x += step) {
      const bool cur = f(x);
      flips += cur != prev;
      prev = cur;
    }
    return flips;
  };
  EXPECT_EQ(count_flips([&](int64_t s) { return decide(2048, 16, l, int(s)); }, 1, 4096, 1), 1);
  EXPECT_LE(count_flips([&](int64_t p) { return decide(p, 16, l, 264); }, 256, 200000, 64), 1);
  EXPECT_LE(count_flips([&](int64_t r) { return decide(1024, r, l, 1024); }, 8, 2000, 1), 1);
}
