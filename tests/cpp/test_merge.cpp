// merge_states (merge.hpp) against an fp64 merge written here: both LSE layouts, strided
// operands, -inf/+inf LSE rows, both-empty rows, prefill_tokens_with_context, optional out_lse,
// fp8 output with saturation; and the defining property: merging the states of two halves of a
// softmax gives the state of the whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/softmax_state.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/status.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"
#include "support/merge_operands.hpp"

namespace {

namespace fs = flashserve;
namespace nm = flashserve::numeric;
using fs::DType;
using fs::LseLayout;
using fs::TensorRef;
using fstest::HostTensor;
using fstest::lse_at;
using fstest::lse_tensor;
using fstest::MergeCase;
using fstest::Mismatches;
using fstest::uniform_int;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Relative rounding bound of storing into `t` (half an ulp).
double half_ulp(DType t) {
  switch (t) {
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f8e4m3: return std::ldexp(1.0, -4);
    case DType::f8e5m2: return std::ldexp(1.0, -3);
    default: return std::ldexp(1.0, -24);
  }
}
// Smallest positive value of `t` (absolute rounding floor for subnormals).
double min_step(DType t) {
  switch (t) {
    case DType::f16: return std::ldexp(1.0, -24);
    case DType::f8e4m3: return std::ldexp(1.0, -9);
    case DType::f8e5m2: return std::ldexp(1.0, -16);
    default: return 1e-30;
  }
}

void run_merge_case(const MergeCase& mc, std::mt19937_64& rng) {
  SCOPED_TRACE(mc.str());
  const bool fp8 = mc.fp8();
  const DType fmt = mc.format();
  const int64_t T = uniform_int(rng, 1, 40), H = uniform_int(rng, 1, 6);
  const int64_t D = std::vector<int64_t>{8, 40, 64, 128}[rng() % 4];
  HostTensor a = fstest::merge_rows(mc.a_dtype, false, T, H, D), b = fstest::merge_rows(mc.b_dtype, false, T, H, D);
  HostTensor out = fstest::merge_rows(mc.out_dtype, false, T, H, D);
  fstest::fill_uniform(a, rng, -4.0f, 4.0f);
  fstest::fill_uniform(b, rng, -4.0f, 4.0f);
  HostTensor la = lse_tensor(mc.layout, T, H), lb = lse_tensor(mc.layout, T, H), lo = lse_tensor(mc.layout, T, H);
  fstest::fill_lse(rng, la, lb, mc.layout, T, H);
  fstest::poison_storage(out);
  fstest::poison_storage(lo);
  HostTensor scale = mc.scalar_scale ? HostTensor::zeros(DType::f32, {}) : HostTensor::zeros(DType::f32, {1});
  const float sv = fmt == DType::f8e4m3 ? 0.006f : 4e-5f;  // |x| < 4: some outputs saturate
  *scale.ref.ptr<float>() = sv;

  fs::MergeParams p;
  p.out = out;
  p.a_out = a;
  p.a_lse = la;
  p.b_out = b;
  p.b_lse = lb;
  p.lse_layout = mc.layout;
  if (mc.with_out_lse) p.out_lse = lo.ref;
  const int64_t ptwc = mc.prefill ? uniform_int(rng, 0, T) : T;
  if (mc.prefill) p.prefill_tokens_with_context = ptwc;
  if (fp8) p.output_scale = scale.ref;
  fs::merge_states(p);

  Mismatches m;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double rla = *lse_at(la, mc.layout, t, h), rlb = *lse_at(lb, mc.layout, t, h);
      const double na = rla == kInf ? -kInf : rla, nb = rlb == kInf ? -kInf : rlb;
      const double mx = std::max(na, nb);
      const bool copy = t >= ptwc, empty = !copy && mx == -kInf;
      const double wa = copy || empty ? 0.0 : std::exp(na - mx), wb = copy ? 1.0 : empty ? 0.0 : std::exp(nb - mx);
      const double ref_lse = copy ? rlb : empty ? -kInf : mx + std::log(wa + wb);
      for (int64_t c = 0; c < D; ++c) {
        const double xa = a.getd({t, h, c}), xb = b.getd({t, h, c});
        const double ref = empty ? 0.0 : (wa * xa + wb * xb) / (wa + wb);
        const double fp32_err = 2e-6 * (std::fabs(xa) + std::fabs(xb));
        auto at = [&] { return " at t=" + std::to_string(t) + " h=" + std::to_string(h) + " c=" + std::to_string(c); };
        if (!fp8) {
          const double got = out.getd({t, h, c});
          const double tol = half_ulp(mc.out_dtype) * std::fabs(ref) + fp32_err + min_step(mc.out_dtype);
          const bool ok = std::fabs(got - ref) <= tol;
          m.check(ok, ok ? "" : "out " + std::to_string(got) + " ref " + std::to_string(ref) + at());
          continue;
        }
        const double y = ref / sv, mxv = nm::fp8_max(fmt);
        const double got = nm::fp8_to_float(*static_cast<const uint8_t*>(out.ref.at(t, h, c)), fmt);
        if (std::fabs(y) > mxv * (1 + 1e-4)) {
          m.check(got == std::copysign(mxv, y), got == std::copysign(mxv, y) ? "" : "not saturated" + at());
        } else {
          const double tol = half_ulp(fmt) * std::fabs(y) + (fp32_err + 1e-7 * std::fabs(ref)) / sv + min_step(fmt);
          const bool ok = std::fabs(got - std::clamp(y, -mxv, mxv)) <= tol;
          m.check(ok, ok ? "" : "fp8 out " + std::to_string(got) + " want " + std::to_string(y) + at());
        }
      }
      if (!mc.with_out_lse) continue;
      const double got = *lse_at(lo, mc.layout, t, h);
      const bool same_inf = std::isinf(ref_lse) && got == ref_lse;
      m.check(same_inf || std::fabs(got - ref_lse) <= 1e-5 * std::max(1.0, std::fabs(ref_lse)),
              "lse " + std::to_string(got) + " ref " + std::to_string(ref_lse));
    }
  EXPECT_EQ(m.count, 0) << m.first;
  EXPECT_TRUE(fstest::padding_untouched(out)) << "out written outside its view";
  EXPECT_TRUE(fstest::padding_untouched(lo)) << "out_lse written outside its view";
}

// The (out, lse) of softmax(s) v over keys [lo, hi), in fp64.
void partial_state(const std::vector<double>& s, const std::vector<double>& v, int64_t D, int64_t lo, int64_t hi,
                   std::vector<double>& out, double& lse) {
  out.assign(size_t(D), 0.0);
  if (lo == hi) {
    lse = -kInf;
    return;
  }
  const double mx = *std::max_element(s.begin() + lo, s.begin() + hi);
  double sum = 0.0;
  for (int64_t j = lo; j < hi; ++j) {
    const double w = std::exp(s[size_t(j)] - mx);
    sum += w;
    for (int64_t c = 0; c < D; ++c) out[size_t(c)] += w * v[size_t(j * D + c)];
  }
  for (double& x : out) x /= sum;
  lse = mx + std::log(sum);
}

}  // namespace

TEST(MergeStates, MatchesFp64Merge) {
  auto rng = fstest::make_rng(0x3e26e);
  const DType floats[] = {DType::f16, DType::bf16, DType::f32};
  for (int rep = 0; rep < 4; ++rep) {
    for (LseLayout layout : {LseLayout::head_major, LseLayout::token_major}) {
      for (DType in : floats)
        for (DType out : floats)
          for (int v = 0; v < 2; ++v) run_merge_case({in, floats[rng() % 3], out, layout, v == 0, v == 1}, rng);
      for (DType out : {DType::f8e4m3, DType::f8e5m2, DType::u8})
        for (int v = 0; v < 2; ++v)
          run_merge_case({floats[rng() % 3], floats[rng() % 3], out, layout, true, v == 1, false, v == 0}, rng);
    }
  }
}

TEST(MergeStates, TwoHalvesOfASoftmaxMergeToTheWhole) {
  auto rng = fstest::make_rng(0x4a1f);
  for (LseLayout layout : {LseLayout::head_major, LseLayout::token_major}) {
    const int64_t T = 24, H = 3, D = 40;
    HostTensor a = fstest::merge_rows(DType::f32, false, T, H, D), b = fstest::merge_rows(DType::f32, false, T, H, D);
    HostTensor out = fstest::merge_rows(DType::f32, false, T, H, D);
    HostTensor la = lse_tensor(layout, T, H), lb = lse_tensor(layout, T, H), lo = lse_tensor(layout, T, H);
    fstest::poison_storage(out);
    fstest::poison_storage(lo);
    std::vector<std::vector<double>> whole(size_t(T * H));
    std::vector<double> whole_lse(size_t(T * H));
    std::uniform_real_distribution<double> score(-8.0, 8.0), val(-1.0, 1.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t n = t == 0 ? 0 : uniform_int(rng, 1, 64), k = uniform_int(rng, 0, n);  // row 0: no keys
        std::vector<double> s(static_cast<size_t>(n)), v(static_cast<size_t>(n * D)), pa, pb;
        for (double& x : s) x = score(rng);
        for (double& x : v) x = val(rng);
        double lsa, lsb;
        partial_state(s, v, D, 0, k, pa, lsa);
        partial_state(s, v, D, k, n, pb, lsb);
        partial_state(s, v, D, 0, n, whole[size_t(t * H + h)], whole_lse[size_t(t * H + h)]);
        for (int64_t c = 0; c < D; ++c) {
          a.set({t, h, c}, float(pa[size_t(c)]));
          b.set({t, h, c}, float(pb[size_t(c)]));
        }
        *lse_at(la, layout, t, h) = float(lsa);
        *lse_at(lb, layout, t, h) = float(lsb);
      }
    fs::MergeParams p;
    p.out = out;
    p.out_lse = lo.ref;
    p.a_out = a;
    p.a_lse = la;
    p.b_out = b;
    p.b_lse = lb;
    p.lse_layout = layout;
    fs::merge_states(p);
    Mismatches m;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const double want_lse = whole_lse[size_t(t * H + h)], got_lse = *lse_at(lo, layout, t, h);
        m.check(got_lse == want_lse || std::fabs(got_lse - want_lse) <= 2e-6 * std::max(1.0, std::fabs(want_lse)),
                "lse " + std::to_string(got_lse) + " want " + std::to_string(want_lse));
        for (int64_t c = 0; c < D; ++c) {
          const double want = whole[size_t(t * H + h)][size_t(c)], got = out.getd({t, h, c});
          m.check(std::fabs(got - want) <= 2e-6, "out " + std::to_string(got) + " want " + std::to_string(want));
        }
      }
    EXPECT_EQ(m.count, 0) << m.first;
  }
}

TEST(MergeStates, NoTokens) {
  HostTensor a = HostTensor::zeros(DType::f16, {0, 2, 8}), l = HostTensor::zeros(DType::f32, {2, 0});
  fs::MergeParams p;
  p.out = p.a_out = p.b_out = a;
  p.a_lse = p.b_lse = l;
  p.prefill_tokens_with_context = 0;
  EXPECT_NO_THROW(fs::merge_states(p));
}

// merge_lses (n states at once: the CUDA kernels' merge of a cluster's splits) against
// merge_lse folded over the states, on random LSEs with empty (-inf, +inf) and NaN states mixed
// in: the same LSE and weights (the folded weights are the products of each fold's), up to fp32
// rounding; NaN anywhere gives NaN, all empty gives -inf and zero weights.
TEST(MergeStates, ManyAtOnceMatchesFoldedPairs) {
  auto rng = fstest::make_rng(0x5c1d);
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  for (int rep = 0; rep < 2000; ++rep) {
    const int n = 1 + int(rng() % 16);
    std::vector<float> l(static_cast<size_t>(n)), w(l), fw(l);
    for (float& x : l) {
      const unsigned k = unsigned(rng() % 16);
      x = k == 0 ? -INFINITY : k == 1 ? INFINITY : (k == 2 && rep % 7 == 0) ? NAN : u(rng);
    }
    if (rep % 5 == 0)
      for (float& x : l) x = rng() % 2 ? -INFINITY : INFINITY;  // every state empty
    const float lse =
        fs::merge_lses(n, [&](int s) { return l[size_t(s)]; }, [&](int s, float ws) { w[size_t(s)] = ws; });
    float acc = l[0];  // the fold: state 0, then each next one merged in
    fw[0] = 1.0f;
    for (int s = 1; s < n; ++s) {
      const fs::MergeWeights mw = fs::merge_lse(acc, l[size_t(s)]);
      for (int t = 0; t < s; ++t) fw[size_t(t)] *= mw.w_a;
      fw[size_t(s)] = mw.w_b;
      acc = mw.lse;
    }
    if (n == 1 && acc == acc) acc = fs::normalize_lse(acc), fw[0] = acc == -INFINITY ? 0.0f : 1.0f;
    if (acc != acc) {
      EXPECT_TRUE(lse != lse) << rep;
      continue;
    }
    EXPECT_EQ(lse == -INFINITY, acc == -INFINITY) << rep;
    if (acc == -INFINITY) {
      for (int s = 0; s < n; ++s) EXPECT_EQ(w[size_t(s)], 0.0f) << rep;
      continue;
    }
    EXPECT_NEAR(lse, acc, 1e-5f * std::max(1.0f, std::fabs(acc))) << rep;
    float sum = 0.0f;
    for (int s = 0; s < n; ++s) {
      EXPECT_NEAR(w[size_t(s)], fw[size_t(s)], 1e-5f) << rep << " state " << s;
      sum += w[size_t(s)];
    }
    EXPECT_NEAR(sum, 1.0f, 1e-5f) << rep;
  }
}

// combine_order_sum (merge_lses' sum of exponentials, the cluster merge's) against the warp's
// own order in split_combine, simulated lane by lane: lane l sums v(l), v(l + 32), ... from 0,
// then every lane adds its xor partner's value at offsets 16, 8, 4, 2, 1, lane 0's result; bit
// for bit, for 1 to 80 terms of mixed magnitudes (the 2-lane shortcut and past 32 included).
// The cluster merge equals the combine only while this holds.
TEST(MergeStates, ManyAtOnceSumsInTheCombineOrder) {
  auto rng = fstest::make_rng(0xb077e2f1);
  std::uniform_real_distribution<float> mag(-20.0f, 0.0f);
  for (int rep = 0; rep < 3000; ++rep) {
    const int n = 1 + int(rng() % 80);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = rng() % 9 == 0 ? 0.0f : std::exp2(mag(rng)) * (1.0f + float(rng() % 1000) / 999.0f);
    float lane[32];
    for (int l = 0; l < 32; ++l) {
      float a = 0.0f;
      for (int s = l; s < n; s += 32) a += v[size_t(s)];
      lane[l] = a;
    }
    for (int o = 16; o > 0; o >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ o];
      std::copy(next, next + 32, lane);
    }
    const float got = fs::combine_order_sum(n, [&](int s) { return v[size_t(s)]; });
    EXPECT_EQ(std::memcmp(&got, &lane[0], sizeof(float)), 0) << "n " << n << ": " << got << " vs " << lane[0];
  }
}
