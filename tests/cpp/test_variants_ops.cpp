// The layer-variant operations (variants_ops.hpp) against naive fp64 computations written here:
// differential_combine (strided and in place, zero rows), lse_correct (both LSE layouts, 3-D and
// slice-major 4-D out, empty and +inf ranks), gather_cache (block sizes 1..16, padded tables and
// caches, with and without this step's queries); validate_only dry runs; and bad inputs, each
// rejected with an Error naming the argument and every byte left as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
using fs::DType;
using fs::LseLayout;
using fs::TensorRef;
using fstest::HostTensor;
using fstest::Mismatches;
using fstest::padding_untouched;
using fstest::padded_poisoned;
using fstest::pick;
using fstest::uniform_int;

constexpr fs::Device kCuda{fs::DeviceType::cuda, 0};
constexpr double kInf = std::numeric_limits<double>::infinity();

// Relative rounding bound of a store into `t` (half an ulp).
double half_ulp(DType t) {
  switch (t) {
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

// Spacing of float16's subnormals: the absolute rounding floor of a store (0 elsewhere here).
double min_step(DType t) { return t == DType::f16 ? std::ldexp(1.0, -24) : 0.0; }

std::string at_str(std::initializer_list<int64_t> idx, double got, double want) {
  std::ostringstream os;
  os << "at [";
  size_t n = 0;
  for (int64_t i : idx) os << (n++ ? ", " : "") << i;
  os << "] got " << got << " want " << want;
  return os.str();
}

// ---------------------------------------------------------------- differential_combine

struct DiffCase {
  DType a1, a2, out;
  bool in_place;  // out is a1
};

void run_differential(const DiffCase& dc, std::mt19937_64& rng) {
  const int64_t T = uniform_int(rng, 0, 12), P = uniform_int(rng, 1, 6), H = 2 * P;
  const int64_t D = pick<int64_t>(rng, {1, 3, 8, 40, 64, 72, 128, 256});
  std::ostringstream name;
  name << fs::dtype_name(dc.a1) << "," << fs::dtype_name(dc.a2) << "->" << fs::dtype_name(dc.out)
       << (dc.in_place ? " in place" : "") << " T=" << T << " H=" << H << " D=" << D;
  SCOPED_TRACE(name.str());
  HostTensor a1 = padded_poisoned(dc.a1, {T, H, D}), a2 = padded_poisoned(dc.a2, {T, H, D});
  fstest::fill_uniform(a1, rng, -3.0f, 3.0f);
  fstest::fill_uniform(a2, rng, -3.0f, 3.0f);
  for (int64_t t = 0; t < T; ++t)  // some all-zero pair rows: out must be exactly 0
    for (int64_t h = 0; h < P; ++h)
      if (rng() % 6 == 0)
        for (int64_t c = 0; c < 2 * D; ++c) a1.set({t, 2 * h + c / D, c % D}, 0.0f), a2.set({t, 2 * h + c / D, c % D}, 0.0f);
  HostTensor vec[4];
  for (HostTensor& v : vec) {
    v = HostTensor::strided(DType::f32, {D}, {2});
    fstest::fill_uniform(v, rng, -0.3f, 0.3f);
  }
  HostTensor w = HostTensor::zeros(DType::f32, {2 * D});
  fstest::fill_uniform(w, rng, 0.5f, 1.5f);
  const float lambda_init = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng);
  const float eps = pick<float>(rng, {1e-5f, 1e-6f, 0.5f});

  // fp64 reference from the inputs as stored.
  double dq1 = 0, dq2 = 0;
  for (int64_t i = 0; i < D; ++i) dq1 += vec[0].getd({i}) * vec[1].getd({i}), dq2 += vec[2].getd({i}) * vec[3].getd({i});
  const double lambda = std::exp(dq1) - std::exp(dq2) + lambda_init;
  std::vector<double> ref(size_t(T * H * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < P; ++h) {
      std::vector<double> x(size_t(2 * D));
      double ss = 0;
      for (int64_t c = 0; c < 2 * D; ++c) {
        x[size_t(c)] = a1.getd({t, 2 * h + c / D, c % D}) - lambda * a2.getd({t, 2 * h + c / D, c % D});
        ss += x[size_t(c)] * x[size_t(c)];
      }
      const double r = 1.0 / std::sqrt(ss / double(2 * D) + eps);
      for (int64_t c = 0; c < 2 * D; ++c)
        ref[size_t((t * H + 2 * h + c / D) * D + c % D)] = x[size_t(c)] * r * w.getd({c}) * (1.0 - lambda_init);
    }

  HostTensor out = dc.in_place ? a1 : padded_poisoned(dc.out, {T, H, D});
  fs::DifferentialCombineParams p;
  p.a1 = a1;
  p.a2 = a2;
  p.lambda_q1 = vec[0];
  p.lambda_k1 = vec[1];
  p.lambda_q2 = vec[2];
  p.lambda_k2 = vec[3];
  p.weight = w;
  p.lambda_init = lambda_init;
  p.eps = eps;
  p.out = out;
  const std::vector<unsigned char> a2_before = fstest::snapshot(a2);
  fs::differential_combine(p);

  Mismatches m;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < D; ++c) {
        const double want = ref[size_t((t * H + h) * D + c)], got = out.getd({t, h, c});
        const double tol = (2 * half_ulp(out.ref.dtype) + 1e-5) * std::fabs(want) + 1e-5;
        m.check(std::fabs(got - want) <= tol, at_str({t, h, c}, got, want));
      }
  EXPECT_EQ(m.count, 0) << "first: " << m.first;
  EXPECT_TRUE(padding_untouched(out)) << "a byte outside out's view was written";
  EXPECT_TRUE(fstest::same_bytes(a2, a2_before)) << "a2 changed";
}

TEST(VariantsOps, DifferentialCombineMatchesFp64) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const DiffCase cases[] = {
      {DType::f32, DType::f32, DType::f32, false}, {DType::f32, DType::f32, DType::f32, true},
      {DType::bf16, DType::bf16, DType::bf16, true}, {DType::f16, DType::f16, DType::f16, false},
      {DType::bf16, DType::f32, DType::f32, false}, {DType::f16, DType::f32, DType::bf16, false},
  };
  for (int rep = 0; rep < 8; ++rep)
    for (const DiffCase& dc : cases) run_differential(dc, rng);
}

// ---------------------------------------------------------------- lse_correct

struct LseCase {
  DType out;
  LseLayout layout;
  bool slice_major, with_lse_out;
};

HostTensor lse_tensor(LseLayout layout, bool lead, int64_t W, int64_t H, int64_t T) {
  const bool hm = layout == LseLayout::head_major;
  if (lead) return hm ? padded_poisoned(DType::f32, {W, H, T}) : padded_poisoned(DType::f32, {W, T, H});
  return hm ? padded_poisoned(DType::f32, {H, T}) : padded_poisoned(DType::f32, {T, H});
}
float* lse_at(const HostTensor& l, LseLayout layout, int64_t r, int64_t h, int64_t t) {
  const bool hm = layout == LseLayout::head_major;
  if (l.ref.ndim == 3) return static_cast<float*>(hm ? l.ref.at(r, h, t) : l.ref.at(r, t, h));
  return static_cast<float*>(hm ? l.ref.at(h, t) : l.ref.at(t, h));
}

void run_lse_correct(const LseCase& lc, std::mt19937_64& rng) {
  const int64_t W = uniform_int(rng, 1, 5), rank = uniform_int(rng, 0, W - 1);
  const int64_t S = lc.slice_major ? uniform_int(rng, 1, 3) : 1, Hs = uniform_int(rng, 1, 4), H = S * Hs;
  const int64_t T = uniform_int(rng, 0, 10), Dv = pick<int64_t>(rng, {1, 8, 64, 100});
  std::ostringstream name;
  name << fs::dtype_name(lc.out) << (lc.layout == LseLayout::head_major ? " head_major" : " token_major")
       << (lc.slice_major ? " slice-major" : "") << (lc.with_lse_out ? " lse_out" : "") << " W=" << W
       << " rank=" << rank << " S=" << S << " H=" << H << " T=" << T << " Dv=" << Dv;
  SCOPED_TRACE(name.str());
  HostTensor out = lc.slice_major ? padded_poisoned(lc.out, {S, T, Hs, Dv}) : padded_poisoned(lc.out, {T, H, Dv});
  fstest::fill_uniform(out, rng, -4.0f, 4.0f);
  auto get = [&](int64_t h, int64_t t, int64_t c) {
    return lc.slice_major ? out.getd({h / Hs, t, h % Hs, c}) : out.getd({t, h, c});
  };
  auto poison_row = [&](int64_t h, int64_t t) {
    for (int64_t c = 0; c < Dv; ++c)
      std::memset(lc.slice_major ? out.ref.at(h / Hs, t, h % Hs, c) : out.ref.at(t, h, c), 0xFF, fs::dtype_size(lc.out));
  };

  HostTensor all = lse_tensor(lc.layout, true, W, H, T), lo = lse_tensor(lc.layout, false, W, H, T);
  std::uniform_real_distribution<float> d(-8.0f, 8.0f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t kind = int64_t(rng() % 8);
      for (int64_t r = 0; r < W; ++r) {
        float l = d(rng);
        if (kind == 0 || rng() % 8 == 0) l = pick<float>(rng, {-INFINITY, INFINITY});  // kind 0: every rank empty
        if (kind == 1 && r == rank) l = -120.0f;  // this rank's weight underflows
        *lse_at(all, lc.layout, r, h, t) = l;
      }
    }
  // fp64 reference; rows whose own state is empty are poisoned: they must become 0 unread.
  std::vector<double> ref(size_t(H * T * Dv)), g(size_t(H * T));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      auto norm = [](double l) { return l == kInf ? -kInf : l; };
      double m = -kInf, sum = 0;
      for (int64_t r = 0; r < W; ++r) m = std::max(m, norm(*lse_at(all, lc.layout, r, h, t)));
      if (m != -kInf)
        for (int64_t r = 0; r < W; ++r) sum += std::exp(norm(*lse_at(all, lc.layout, r, h, t)) - m);
      const double gl = m == -kInf ? -kInf : m + std::log(sum), local = norm(*lse_at(all, lc.layout, rank, h, t));
      const double f = local == -kInf ? 0.0 : std::exp(local - gl);
      g[size_t(h * T + t)] = gl;
      for (int64_t c = 0; c < Dv; ++c) ref[size_t((h * T + t) * Dv + c)] = f * get(h, t, c);
      if (local == -kInf) poison_row(h, t);
    }

  fs::LseCorrectParams p;
  p.out = out;
  p.lse_all = all;
  p.rank = rank;
  p.lse_layout = lc.layout;
  if (lc.with_lse_out) p.lse_out = lo.ref;
  const std::vector<unsigned char> all_before = fstest::snapshot(all);
  fs::lse_correct(p);

  Mismatches m;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < Dv; ++c) {
        const double want = ref[size_t((h * T + t) * Dv + c)], got = get(h, t, c);
        const double tol = (2 * half_ulp(lc.out) + 2e-5) * std::fabs(want) + min_step(lc.out) + 1e-30;
        m.check(std::fabs(got - want) <= tol, at_str({h, t, c}, got, want));
      }
      if (!lc.with_lse_out) continue;
      const double want = g[size_t(h * T + t)], got = *lse_at(lo, lc.layout, 0, h, t);
      const bool ok = want == -kInf ? got == -kInf : std::fabs(got - want) <= 1e-5 * (1 + std::fabs(want));
      m.check(ok, "lse_out " + at_str({h, t}, got, want));
    }
  EXPECT_EQ(m.count, 0) << "first: " << m.first;
  EXPECT_TRUE(padding_untouched(out)) << "a byte outside out's view was written";
  EXPECT_TRUE(padding_untouched(lo)) << "a byte outside lse_out's view was written";
  if (!lc.with_lse_out)
    EXPECT_TRUE(std::all_of(lo.bytes->begin(), lo.bytes->end(), [](unsigned char b) { return b == 0xFF; }))
        << "lse_out was written though absent";
  EXPECT_TRUE(fstest::same_bytes(all, all_before)) << "lse_all changed";
}

TEST(VariantsOps, LseCorrectMatchesFp64) {
  auto rng = fstest::make_rng(fstest::test_salt());
  for (int rep = 0; rep < 6; ++rep)
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (LseLayout layout : {LseLayout::head_major, LseLayout::token_major})
        for (bool slice_major : {false, true}) run_lse_correct({dt, layout, slice_major, rng() % 2 == 0}, rng);
}

// The defining property: the corrected partial states of W ranks sum to the merged state.
TEST(VariantsOps, LseCorrectedRanksSumToTheMergedState) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const int64_t W = 4, T = 7, H = 3, Dv = 16;
  HostTensor all = padded_poisoned(DType::f32, {W, H, T});
  fstest::fill_uniform(all, rng, -5.0f, 5.0f);
  *static_cast<float*>(all.ref.at(1, 0, 0)) = -INFINITY;
  std::vector<HostTensor> outs;
  std::vector<double> sum(size_t(T * H * Dv), 0.0), want(size_t(T * H * Dv), 0.0);
  for (int64_t r = 0; r < W; ++r) {
    outs.push_back(padded_poisoned(DType::f32, {T, H, Dv}));
    fstest::fill_uniform(outs.back(), rng, -2.0f, 2.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        double z = 0;
        for (int64_t s = 0; s < W; ++s) z += std::exp(all.getd({s, h, t}));
        for (int64_t c = 0; c < Dv; ++c)
          want[size_t((t * H + h) * Dv + c)] += std::exp(all.getd({r, h, t})) / z * outs.back().getd({t, h, c});
      }
    fs::LseCorrectParams p;
    p.out = outs.back();
    p.lse_all = all;
    p.rank = r;
    fs::lse_correct(p);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < Dv; ++c) sum[size_t((t * H + h) * Dv + c)] += outs.back().getd({t, h, c});
  }
  for (size_t i = 0; i < sum.size(); ++i) ASSERT_NEAR(sum[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << "element " << i;
}

// ---------------------------------------------------------------- gather_cache

struct GatherSetup {
  int64_t B = 0, bs = 0, width = 0, nb = 0, max_blocks = 0;
  std::vector<int64_t> seqused, q_lens;
  HostTensor cache, table, seqused_k, cu_q, dst, cu_dst;
};

// B requests with KV lengths up to 60 and up to 8 queries each, blocks shuffled over the cache;
// block-table columns past each request's blocks hold -1.
GatherSetup make_gather(std::mt19937_64& rng, DType dt, int64_t B, int64_t bs, int64_t width, int64_t dst_rows) {
  GatherSetup g;
  g.B = B, g.bs = bs, g.width = width;
  int64_t need = 0;
  for (int64_t b = 0; b < B; ++b) {
    g.seqused.push_back(uniform_int(rng, 0, 60));
    g.q_lens.push_back(uniform_int(rng, 0, 8));
    g.max_blocks = std::max(g.max_blocks, (g.seqused.back() + bs - 1) / bs);
    need += (g.seqused.back() + bs - 1) / bs;
  }
  g.max_blocks += uniform_int(rng, 0, 2);
  g.nb = need + 3;
  g.cache = padded_poisoned(dt, {g.nb, bs, width});
  fstest::fill_uniform(g.cache, rng, dt == DType::u8 ? 0.0f : -3.0f, dt == DType::u8 ? 255.0f : 3.0f);
  std::vector<int32_t> ids(size_t(g.nb));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  g.table = HostTensor::strided(DType::i32, {B, g.max_blocks}, {g.max_blocks + 2, 1});
  g.seqused_k = HostTensor::zeros(DType::i32, {B});
  g.cu_q = HostTensor::zeros(DType::i32, {B + 1});
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = (g.seqused[size_t(b)] + bs - 1) / bs;
    for (int64_t i = 0; i < g.max_blocks; ++i) *static_cast<int32_t*>(g.table.ref.at(b, i)) = i < n ? ids[next++] : -1;
    *static_cast<int32_t*>(g.seqused_k.ref.at(b)) = int32_t(g.seqused[size_t(b)]);
    *static_cast<int32_t*>(g.cu_q.ref.at(b + 1)) = *static_cast<int32_t*>(g.cu_q.ref.at(b)) + int32_t(g.q_lens[size_t(b)]);
  }
  g.dst = padded_poisoned(dt, {dst_rows, width});
  g.cu_dst = padded_poisoned(DType::i32, {B + 1});
  return g;
}

void run_gather(std::mt19937_64& rng, DType dt) {
  const int64_t B = uniform_int(rng, 0, 6), bs = pick<int64_t>(rng, {1, 3, 16}), width = pick<int64_t>(rng, {1, 5, 64, 576});
  const bool with_q = rng() % 2 == 0;
  int64_t begin = 0, end = std::numeric_limits<int64_t>::max();
  switch (rng() % 4) {
    case 0: break;
    case 1: end = uniform_int(rng, 0, 30); break;
    case 2: begin = uniform_int(rng, 0, 40), end = begin + uniform_int(rng, 0, 40); break;
    default: begin = 100, end = 200; break;  // past every context
  }
  std::ostringstream name;
  name << fs::dtype_name(dt) << " B=" << B << " bs=" << bs << " width=" << width << (with_q ? " with queries" : "")
       << " range " << begin << ".." << end;
  SCOPED_TRACE(name.str());
  // Naive ranges first: dst gets exactly the rows needed plus 0..2 spare.
  GatherSetup g = make_gather(rng, dt, B, bs, width, 0);
  std::vector<int64_t> lo(static_cast<size_t>(B)), hi(static_cast<size_t>(B));
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ctx = std::max<int64_t>(0, g.seqused[size_t(b)] - (with_q ? g.q_lens[size_t(b)] : 0));
    lo[size_t(b)] = std::min(begin, ctx);
    hi[size_t(b)] = std::max(lo[size_t(b)], std::min(end, ctx));
    total += hi[size_t(b)] - lo[size_t(b)];
  }
  const int64_t spare = uniform_int(rng, 0, 2);
  g.dst = padded_poisoned(dt, {total + spare, width});

  fs::GatherCacheParams p;
  p.cache = g.cache;
  p.block_table = g.table;
  p.seqused_k = g.seqused_k;
  if (with_q) p.cu_seqlens_q = g.cu_q.ref;
  p.token_begin = begin;
  p.token_end = end;
  p.dst = g.dst;
  p.cu_seqlens_dst = g.cu_dst;
  const std::vector<unsigned char> cache_before = fstest::snapshot(g.cache);
  fs::gather_cache(p);

  const size_t row_bytes = size_t(width) * fs::dtype_size(dt);
  const std::vector<unsigned char> poison(row_bytes, 0xFF);
  int64_t row = 0;
  for (int64_t b = 0; b < B; ++b) {
    ASSERT_EQ(*static_cast<const int32_t*>(g.cu_dst.ref.at(b)), row) << "cu_seqlens_dst[" << b << "]";
    for (int64_t t = lo[size_t(b)]; t < hi[size_t(b)]; ++t, ++row) {
      const int64_t block = *static_cast<const int32_t*>(g.table.ref.at(b, t / bs));
      ASSERT_EQ(std::memcmp(g.dst.ref.at(row, 0), g.cache.ref.at(block, t % bs, 0), row_bytes), 0)
          << "request " << b << " token " << t;
    }
  }
  ASSERT_EQ(*static_cast<const int32_t*>(g.cu_dst.ref.at(B)), total) << "cu_seqlens_dst[B]";
  for (; row < total + spare; ++row)
    EXPECT_EQ(std::memcmp(g.dst.ref.at(row, 0), poison.data(), row_bytes), 0) << "spare row " << row << " written";
  EXPECT_TRUE(padding_untouched(g.dst)) << "a byte outside dst's view was written";
  EXPECT_TRUE(padding_untouched(g.cu_dst)) << "a byte outside cu_seqlens_dst's view was written";
  EXPECT_TRUE(fstest::same_bytes(g.cache, cache_before)) << "the cache changed";
}

TEST(VariantsOps, GatherCacheMatchesNaive) {
  auto rng = fstest::make_rng(fstest::test_salt());
  for (int rep = 0; rep < 12; ++rep)
    for (DType dt : {DType::bf16, DType::f32, DType::u8, DType::f16}) run_gather(rng, dt);
}

// ---------------------------------------------------------------- validate_only, bad inputs

// One valid call of each op over small tensors; all() lists every tensor for byte checks.
struct OpSet {
  std::mt19937_64 rng = fstest::make_rng(0x0e5);
  // differential_combine: T = 3, H = 4, D = 8
  HostTensor a1 = padded_poisoned(DType::bf16, {3, 4, 8}), a2 = padded_poisoned(DType::bf16, {3, 4, 8});
  HostTensor q1 = HostTensor::zeros(DType::f32, {8}), k1 = HostTensor::zeros(DType::f32, {8});
  HostTensor q2 = HostTensor::zeros(DType::f32, {8}), k2 = HostTensor::zeros(DType::f32, {8});
  HostTensor w = HostTensor::zeros(DType::f32, {16});
  HostTensor d_out = padded_poisoned(DType::bf16, {3, 4, 8});
  fs::DifferentialCombineParams dp;
  // lse_correct: W = 2 ranks, slice-major out [2, T = 3, 2, 16], lse_all [2, H = 4, 3]
  HostTensor l_out = padded_poisoned(DType::f32, {2, 3, 2, 16}), l_all = padded_poisoned(DType::f32, {2, 4, 3});
  HostTensor l_glob = padded_poisoned(DType::f32, {4, 3});
  fs::LseCorrectParams lp;
  // gather_cache: 3 requests over a [12, 4, 576] bf16 cache
  GatherSetup g;
  fs::GatherCacheParams gp;

  OpSet() {
    for (const HostTensor* t : {&a1, &a2, &q1, &k1, &q2, &k2, &w, &l_out, &l_all})
      fstest::fill_uniform(*t, rng, -1.0f, 1.0f);
    dp.a1 = a1, dp.a2 = a2, dp.lambda_q1 = q1, dp.lambda_k1 = k1, dp.lambda_q2 = q2, dp.lambda_k2 = k2;
    dp.weight = w, dp.out = d_out;
    lp.out = l_out, lp.lse_all = l_all, lp.rank = 1, lp.lse_out = l_glob.ref;
    do g = make_gather(rng, DType::bf16, 3, 4, 576, 200);
    while (g.seqused[0] - g.q_lens[0] < 9);  // request 0's context reaches its third block
    gp.cache = g.cache, gp.block_table = g.table, gp.seqused_k = g.seqused_k, gp.cu_seqlens_q = g.cu_q.ref;
    gp.dst = g.dst, gp.cu_seqlens_dst = g.cu_dst;
  }
  std::vector<const HostTensor*> all() const {
    return {&a1, &a2, &q1, &k1, &q2, &k2, &w, &d_out, &l_out, &l_all, &l_glob,
            &g.cache, &g.table, &g.seqused_k, &g.cu_q, &g.dst, &g.cu_dst};
  }
  void differential(const fs::ExecContext& c = {}) { fs::differential_combine(dp, c); }
  void lse(const fs::ExecContext& c = {}) { fs::lse_correct(lp, c); }
  void gather(const fs::ExecContext& c = {}) { fs::gather_cache(gp, c); }
};

TensorRef with_dtype(TensorRef t, DType d) {
  t.dtype = d;
  return t;
}
TensorRef on_cuda(TensorRef t) {
  t.device = kCuda;
  return t;
}

enum class Op { differential, lse, gather };

struct Bad {
  std::string label;
  Op op;
  std::string arg;  // empty: NotImplemented naming CUDA
  std::function<void(OpSet&)> mutate;
};

void expect_rejected(const Bad& bad) {
  SCOPED_TRACE(bad.label);
#if FLASHSERVE_WITH_CUDA
  // "Not implemented on CUDA" holds in CPU-only builds; CUDA builds run these ops on the device
  // (tests/gpu), and host memory labelled as CUDA would be handed to the kernels.
  if (bad.arg.empty()) return;
#endif
  OpSet s;
  bad.mutate(s);
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : s.all()) before.push_back(fstest::snapshot(*t));
  try {
    if (bad.op == Op::differential) s.differential();
    if (bad.op == Op::lse) s.lse();
    if (bad.op == Op::gather) s.gather();
    ADD_FAILURE() << "no exception";
  } catch (const fs::Error& e) {
    EXPECT_FALSE(bad.arg.empty()) << "Error instead of NotImplemented: " << e.what();
    EXPECT_EQ(std::string(e.what()).rfind(bad.arg + ": expected ", 0), 0u) << "message: " << e.what();
  } catch (const fs::NotImplemented& e) {
    EXPECT_TRUE(bad.arg.empty()) << "NotImplemented instead of Error: " << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  const std::vector<const HostTensor*> all = s.all();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(fstest::same_bytes(*all[i], before[i])) << "tensor " << i << " changed";
}

void set_i32(const HostTensor& t, std::initializer_list<int64_t> idx, int32_t v) {
  int64_t off = 0, d = 0;
  for (int64_t i : idx) off += i * t.ref.stride[size_t(d++)];
  static_cast<int32_t*>(t.ref.data)[off] = v;
}

}  // namespace

TEST(VariantsOps, BaselinesRunAndValidateOnlyWritesNothing) {
  OpSet s;
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : s.all()) before.push_back(fstest::snapshot(*t));
  fs::ExecContext dry;
  dry.validate_only = true;
  s.differential(dry);
  s.lse(dry);
  s.gather(dry);
  const std::vector<const HostTensor*> all = s.all();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(fstest::same_bytes(*all[i], before[i])) << "tensor " << i << " changed";
  EXPECT_NO_THROW(s.differential());
  EXPECT_NO_THROW(s.lse());
  EXPECT_NO_THROW(s.gather());
  EXPECT_FALSE(fstest::same_bytes(s.d_out, before[7])) << "differential_combine wrote nothing";
  EXPECT_FALSE(fstest::same_bytes(s.g.cu_dst, before[16])) << "gather_cache wrote nothing";

  OpSet bad;  // validate_only still checks the CPU contents that index memory
  set_i32(bad.g.table, {0, 0}, int32_t(bad.g.nb));
  EXPECT_THROW(bad.gather(dry), fs::Error);
}

TEST(VariantsOps, BadInputsAreRejectedBeforeAnyWrite) {
  using D = Op;
  const std::vector<Bad> cases = {
      // differential_combine
      {"a1 odd head count", D::differential, "a1", [](OpSet& s) { s.dp.a1 = s.a1.ref.slice(1, 0, 3); }},
      {"a2 fewer tokens", D::differential, "a2", [](OpSet& s) { s.dp.a2 = s.a2.ref.slice(0, 0, 2); }},
      {"out int32", D::differential, "out", [](OpSet& s) { s.dp.out = with_dtype(s.d_out, DType::i32); }},
      {"out last dim strided", D::differential, "out", [](OpSet& s) {
         s.dp.out = TensorRef::strided(s.d_out.ref.data, DType::bf16, {3, 4, 4}, {40, 9, 2}); }},
      {"weight [D]", D::differential, "weight", [](OpSet& s) { s.dp.weight = s.w.ref.slice(0, 0, 8); }},
      {"lambda_k2 float16", D::differential, "lambda_k2", [](OpSet& s) { s.dp.lambda_k2 = with_dtype(s.k2, DType::f16); }},
      {"lambda_q1 [D + 1]", D::differential, "lambda_q1", [](OpSet& s) {
         s.dp.lambda_q1 = TensorRef::contiguous(s.w.ref.data, DType::f32, {9}); }},
      {"negative eps", D::differential, "eps", [](OpSet& s) { s.dp.eps = -1e-5f; }},
      {"lambda_init NaN", D::differential, "lambda_init", [](OpSet& s) { s.dp.lambda_init = NAN; }},
      {"out on another device", D::differential, "out", [](OpSet& s) { s.dp.out = on_cuda(s.d_out); }},
      {"all on CUDA", D::differential, "", [](OpSet& s) {
         for (TensorRef* t : {&s.dp.a1, &s.dp.a2, &s.dp.lambda_q1, &s.dp.lambda_k1, &s.dp.lambda_q2, &s.dp.lambda_k2,
                              &s.dp.weight, &s.dp.out}) t->device = kCuda; }},
      // lse_correct
      {"rank == W", D::lse, "rank", [](OpSet& s) { s.lp.rank = 2; }},
      {"negative rank", D::lse, "rank", [](OpSet& s) { s.lp.rank = -1; }},
      {"token-major lse_all for head_major", D::lse, "lse_all", [](OpSet& s) { s.lp.lse_layout = LseLayout::token_major; }},
      {"lse_all float16", D::lse, "lse_all", [](OpSet& s) { s.lp.lse_all = with_dtype(s.l_all, DType::f16); }},
      {"lse_all heads of one slice", D::lse, "lse_all", [](OpSet& s) { s.lp.lse_all = s.l_all.ref.slice(1, 0, 2); }},
      {"out 2 dims", D::lse, "out", [](OpSet& s) { s.lp.out = s.l_out.ref.select(0, 0).select(0, 0); }},
      {"out int8", D::lse, "out", [](OpSet& s) { s.lp.out = with_dtype(s.l_out, DType::i8); }},
      {"lse_out [T, H]", D::lse, "lse_out", [](OpSet& s) { s.lp.lse_out = s.l_glob.ref.permute({1, 0}); }},
      {"lse_all on CUDA", D::lse, "lse_all", [](OpSet& s) { s.lp.lse_all = on_cuda(s.l_all); }},
      {"all on CUDA", D::lse, "", [](OpSet& s) {
         s.lp.out = on_cuda(s.l_out), s.lp.lse_all = on_cuda(s.l_all), s.lp.lse_out = on_cuda(s.l_glob); }},
      // gather_cache
      {"block index past the cache", D::gather, "block_table", [](OpSet& s) { set_i32(s.g.table, {0, 2}, int32_t(s.g.nb)); }},
      {"negative block index", D::gather, "block_table", [](OpSet& s) { set_i32(s.g.table, {0, 0}, -1); }},
      {"context past the table's columns", D::gather, "block_table", [](OpSet& s) {
         s.gp.block_table = s.g.table.ref.slice(1, 0, 2); s.gp.cu_seqlens_q.reset(); }},
      {"block_table int64", D::gather, "block_table", [](OpSet& s) {
         s.gp.block_table = with_dtype(s.g.table, DType::i64); }},
      {"dst too few rows", D::gather, "dst", [](OpSet& s) { s.gp.dst = s.g.dst.ref.slice(0, 0, 8); }},
      {"dst dtype differs", D::gather, "dst", [](OpSet& s) { s.gp.dst = with_dtype(s.g.dst, DType::f16); }},
      {"dst width", D::gather, "dst", [](OpSet& s) { s.gp.dst = s.g.dst.ref.slice(1, 0, 512); }},
      {"seqused_k [B + 1]", D::gather, "seqused_k", [](OpSet& s) { s.gp.seqused_k = s.g.cu_q.ref; }},
      {"negative seqused_k", D::gather, "seqused_k", [](OpSet& s) { set_i32(s.g.seqused_k, {1}, -3); }},
      {"cu_seqlens_q decreasing", D::gather, "cu_seqlens_q", [](OpSet& s) { set_i32(s.g.cu_q, {1}, 1000); }},
      {"cu_seqlens_dst int64", D::gather, "cu_seqlens_dst", [](OpSet& s) {
         s.gp.cu_seqlens_dst = with_dtype(s.g.cu_dst, DType::i64); }},
      {"token_end < token_begin", D::gather, "token_end", [](OpSet& s) { s.gp.token_begin = 5, s.gp.token_end = 4; }},
      {"negative token_begin", D::gather, "token_begin", [](OpSet& s) { s.gp.token_begin = -1; }},
      {"cache without slots", D::gather, "cache", [](OpSet& s) { s.gp.cache = s.g.cache.ref.slice(1, 0, 0); }},
      {"dst on CUDA", D::gather, "dst", [](OpSet& s) { s.gp.dst = on_cuda(s.g.dst); }},
      {"all on CUDA", D::gather, "", [](OpSet& s) {
         for (TensorRef* t : {&s.gp.cache, &s.gp.block_table, &s.gp.seqused_k, &*s.gp.cu_seqlens_q, &s.gp.dst,
                              &s.gp.cu_seqlens_dst}) t->device = kCuda; }},
  };
  for (const Bad& bad : cases) expect_rejected(bad);
}
