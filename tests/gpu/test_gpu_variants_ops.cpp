// The layer-variant operations on CUDA (variants_ops.hpp) against the CPU reference, on device
// mirrors of the same host operands (outputs poisoned on both sides, padded strides):
// differential_combine (f16/bf16/f32 mixes, in place, zero rows, odd D), lse_correct (both out
// layouts, both LSE layouts, empty / +inf / underflowing ranks, optional lse_out), gather_cache
// (block sizes 1..64, any dtype, > 1024 requests, byte-identical), and gather_cache's
// out-of-range contents, which the device skips (dst rows left poisoned, nothing read or written
// outside). Also validate_only and a CUDA-graph capture of all three equal to eager runs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "flashserve/numeric.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"
#include "support/captured_graph.hpp"
#include "support/checks.hpp"
#include "support/device_tensor.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace nm = flashserve::numeric;
using fs::DType;
using fs::LseLayout;
using fs::TensorRef;
using fsgpu::DeviceTensor;
using fstest::HostTensor;
using fstest::Mismatches;
using fstest::padded_poisoned;
using fstest::pick;
using fstest::seed_note;
using fstest::uniform_int;

// One step of `fmt` at magnitude |x| (an upper bound), plus its smallest subnormal.
double step_of(DType fmt, double x) {
  switch (fmt) {
    case DType::f16: return std::ldexp(std::fabs(x), -10) + std::ldexp(1.0, -24);
    case DType::bf16: return std::ldexp(std::fabs(x), -7) + 1e-38;
    default: return std::ldexp(std::fabs(x), -23);
  }
}

std::string idx_str(const std::vector<int64_t>& idx) {
  std::string s = "[";
  for (size_t i = 0; i < idx.size(); ++i) s += (i ? ", " : "") + std::to_string(idx[i]);
  return s + "]";
}

// Element by element, GPU (downloaded) against CPU: the same bits, or both finite and within
// tol(idx) + one step of the dtype; then every storage byte outside the view equal (both were
// poisoned alike). Counts bit-identical elements.
template <class Tol>
void compare(const HostTensor& cpu, const HostTensor& gpu, const char* name, Tol tol, Mismatches& m, int64_t& exact,
             int64_t& total) {
  const size_t es = fs::dtype_size(cpu.ref.dtype);
  fstest::for_each_index(cpu.ref, [&](const std::vector<int64_t>& idx, int64_t off) {
    const char* pc = static_cast<const char*>(cpu.ref.data) + off * int64_t(es);
    const char* pg = static_cast<const char*>(gpu.ref.data) + off * int64_t(es);
    ++total;
    if (std::memcmp(pc, pg, es) == 0) return void(++exact);
    const double c = nm::load_double(pc, cpu.ref.dtype), g = nm::load_double(pg, cpu.ref.dtype);
    const double t = tol(idx) + step_of(cpu.ref.dtype, std::max(std::fabs(c), std::fabs(g)));
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s%s: cpu %.9g gpu %.9g (tolerance %.3g)", name, idx_str(idx).c_str(), c, g, t);
    m.check(std::isfinite(c) && std::isfinite(g) && std::fabs(c - g) <= t, buf);
  });
  const std::vector<char> in = fstest::view_bytes(cpu);
  for (size_t i = 0; i < in.size(); ++i)
    if (!in[i] && (*cpu.bytes)[i] != (*gpu.bytes)[i]) return m.check(false, std::string(name) + ": bytes outside the view differ");
}

void report(const char* op, int64_t exact, int64_t total) {
  std::printf("[   INFO   ] %s: %lld of %lld output elements bit-identical to the CPU reference\n", op,
              (long long)exact, (long long)total);
}

// ---------------------------------------------------------------- differential_combine

struct DiffRun {
  int64_t T, P, D;
  bool in_place;
  HostTensor a1, a2, out, vec[4], w;
  DeviceTensor da1, da2, dout, dvec[4], dw;
  float lambda_init, eps;

  DiffRun(DType t1, DType t2, DType to, bool in_place_, std::mt19937_64& rng)
      : T(uniform_int(rng, 0, 40)), P(uniform_int(rng, 1, 8)), D(pick<int64_t>(rng, {1, 3, 8, 40, 64, 72, 128, 256, 264})),
        in_place(in_place_), a1(padded_poisoned(t1, {T, 2 * P, D})), a2(padded_poisoned(t2, {T, 2 * P, D})),
        out(in_place ? a1 : padded_poisoned(to, {T, 2 * P, D})), w(HostTensor::zeros(DType::f32, {2 * D})) {
    fstest::fill_uniform(a1, rng, -3.0f, 3.0f);
    fstest::fill_uniform(a2, rng, -3.0f, 3.0f);
    for (int64_t t = 0; t < T; ++t)  // some all-zero pair rows
      for (int64_t h = 0; h < P; ++h)
        if (rng() % 6 == 0)
          for (int64_t c = 0; c < 2 * D; ++c) a1.set({t, 2 * h + c / D, c % D}, 0.0f), a2.set({t, 2 * h + c / D, c % D}, 0.0f);
    for (HostTensor& v : vec) {
      v = HostTensor::strided(DType::f32, {D}, {2});
      fstest::fill_uniform(v, rng, -0.3f, 0.3f);
    }
    fstest::fill_uniform(w, rng, 0.5f, 1.5f);
    lambda_init = std::uniform_real_distribution<float>(0.05f, 0.95f)(rng);
    eps = pick<float>(rng, {1e-5f, 1e-6f, 0.5f});
    da1 = DeviceTensor::mirror(a1), da2 = DeviceTensor::mirror(a2), dw = DeviceTensor::mirror(w);
    for (int i = 0; i < 4; ++i) dvec[i] = DeviceTensor::mirror(vec[i]);
    dout = in_place ? da1 : DeviceTensor::poisoned_mirror(out);
  }
  fs::DifferentialCombineParams params(bool gpu) const {
    fs::DifferentialCombineParams p;
    p.a1 = gpu ? da1.ref : a1.ref;
    p.a2 = gpu ? da2.ref : a2.ref;
    p.lambda_q1 = gpu ? dvec[0].ref : vec[0].ref;
    p.lambda_k1 = gpu ? dvec[1].ref : vec[1].ref;
    p.lambda_q2 = gpu ? dvec[2].ref : vec[2].ref;
    p.lambda_k2 = gpu ? dvec[3].ref : vec[3].ref;
    p.weight = gpu ? dw.ref : w.ref;
    p.lambda_init = lambda_init;
    p.eps = eps;
    p.out = gpu ? dout.ref : out.ref;
    return p;
  }
  std::string str() const {
    return std::string(fs::dtype_name(a1.ref.dtype)) + "," + std::string(fs::dtype_name(a2.ref.dtype)) + "->" +
           std::string(fs::dtype_name(out.ref.dtype)) + (in_place ? " in place" : "") + " T=" + std::to_string(T) +
           " H=" + std::to_string(2 * P) + " D=" + std::to_string(D);
  }
};

// Per element: |a1| + |λ a2| scaled as the output (r (1 - λ_init) |weight|), from the inputs in
// fp64 (before an in-place run). The reductions may round differently: 1e-4 of that.
std::vector<double> diff_magnitudes(const DiffRun& r) {
  double d1 = 0, d2 = 0;
  for (int64_t i = 0; i < r.D; ++i) d1 += r.vec[0].getd({i}) * r.vec[1].getd({i}), d2 += r.vec[2].getd({i}) * r.vec[3].getd({i});
  const double lambda = std::exp(d1) - std::exp(d2) + r.lambda_init;
  std::vector<double> mag(size_t(r.T * 2 * r.P * r.D));
  for (int64_t t = 0; t < r.T; ++t)
    for (int64_t p = 0; p < r.P; ++p) {
      double ss = 0;
      for (int64_t c = 0; c < 2 * r.D; ++c) {
        const double x = r.a1.getd({t, 2 * p + c / r.D, c % r.D}) - lambda * r.a2.getd({t, 2 * p + c / r.D, c % r.D});
        ss += x * x;
      }
      const double s = (1.0 - r.lambda_init) / std::sqrt(ss / double(2 * r.D) + r.eps);
      for (int64_t c = 0; c < 2 * r.D; ++c) {
        const int64_t h = 2 * p + c / r.D;
        const double x = std::fabs(r.a1.getd({t, h, c % r.D})) + std::fabs(lambda * r.a2.getd({t, h, c % r.D}));
        mag[size_t((t * 2 * r.P + h) * r.D + c % r.D)] = x * s * r.w.getd({c});
      }
    }
  return mag;
}

TEST(GpuVariantsOps, DifferentialCombineEqualsCpu) {
  auto rng = fstest::make_rng(0x5d1f);
  const DType floats[] = {DType::f16, DType::bf16, DType::f32};
  int64_t exact = 0, total = 0;
  for (int rep = 0; rep < 3; ++rep)
    for (DType t1 : floats)
      for (DType to : floats)
        for (bool in_place : {false, true}) {
          if (in_place && t1 != to) continue;
          DiffRun r(t1, floats[rng() % 3], to, in_place, rng);
          const std::vector<double> mag = diff_magnitudes(r);
          fs::differential_combine(r.params(false));
          fs::differential_combine(r.params(true));
          fsgpu::sync();
          Mismatches m;
          const int64_t H = 2 * r.P;
          compare(r.out, r.dout.download(r.out), "out", [&](const std::vector<int64_t>& i) {
            return 1e-4 * mag[size_t((i[0] * H + i[1]) * r.D + i[2])]; }, m, exact, total);
          if (!in_place) EXPECT_TRUE(fstest::same_bytes(r.da1.download(r.a1), *r.a1.bytes)) << "a1 changed";
          EXPECT_TRUE(fstest::same_bytes(r.da2.download(r.a2), *r.a2.bytes)) << "a2 changed";
          EXPECT_EQ(m.count, 0) << r.str() << ": " << m.count << " mismatches; first: " << m.first << seed_note();
        }
  report("differential_combine", exact, total);
}

// ---------------------------------------------------------------- lse_correct

struct LseRun {
  DType dtype;
  LseLayout layout;
  bool slice_major, with_lse_out;
  int64_t W, rank, S, Hs, T, Dv;
  HostTensor out, in, all, lo;  // in: out before the run (tolerances)
  DeviceTensor dout, dall, dlo;

  LseRun(DType dt, LseLayout l, bool sm, bool with_lo, std::mt19937_64& rng)
      : dtype(dt), layout(l), slice_major(sm), with_lse_out(with_lo), W(uniform_int(rng, 1, 8)),
        rank(uniform_int(rng, 0, W - 1)), S(sm ? uniform_int(rng, 1, 4) : 1), Hs(uniform_int(rng, 1, 8)),
        T(uniform_int(rng, 0, 64)), Dv(pick<int64_t>(rng, {1, 8, 40, 64, 100, 128, 512})),
        out(sm ? padded_poisoned(dt, {S, T, Hs, Dv}) : padded_poisoned(dt, {T, S * Hs, Dv})),
        all(l == LseLayout::head_major ? padded_poisoned(DType::f32, {W, S * Hs, T}) : padded_poisoned(DType::f32, {W, T, S * Hs})),
        lo(l == LseLayout::head_major ? padded_poisoned(DType::f32, {S * Hs, T}) : padded_poisoned(DType::f32, {T, S * Hs})) {
    fstest::fill_uniform(out, rng, -4.0f, 4.0f);
    std::uniform_real_distribution<float> d(-8.0f, 8.0f);
    for (int64_t h = 0; h < S * Hs; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t kind = int64_t(rng() % 8);
        for (int64_t r = 0; r < W; ++r) {
          float x = d(rng);
          if (kind == 0 || rng() % 8 == 0) x = pick<float>(rng, {-INFINITY, INFINITY});  // kind 0: every rank empty
          if (kind == 1 && r == rank) x = -120.0f;                                      // this rank underflows
          *lse(r, h, t) = x;
        }
        if (std::isinf(*lse(rank, h, t)))  // an empty own state: the row must become 0 unread
          for (int64_t c = 0; c < Dv; ++c) std::memset(row(h, t, c), 0xFF, fs::dtype_size(dt));
      }
    in = out.clone();
    dout = DeviceTensor::mirror(out), dall = DeviceTensor::mirror(all), dlo = DeviceTensor::poisoned_mirror(lo);
  }
  float* lse(int64_t r, int64_t h, int64_t t) const {
    return static_cast<float*>(layout == LseLayout::head_major ? all.ref.at(r, h, t) : all.ref.at(r, t, h));
  }
  void* row(int64_t h, int64_t t, int64_t c) const {
    return slice_major ? out.ref.at(h / Hs, t, h % Hs, c) : out.ref.at(t, h, c);
  }
  fs::LseCorrectParams params(bool gpu) const {
    fs::LseCorrectParams p;
    p.out = gpu ? dout.ref : out.ref;
    p.lse_all = gpu ? dall.ref : all.ref;
    p.rank = rank;
    p.lse_layout = layout;
    if (with_lse_out) p.lse_out = gpu ? dlo.ref : lo.ref;
    return p;
  }
  std::string str() const {
    return std::string(fs::dtype_name(dtype)) + (layout == LseLayout::head_major ? " head_major" : " token_major") +
           (slice_major ? " slice-major" : "") + (with_lse_out ? " lse_out" : "") + " W=" + std::to_string(W) +
           " rank=" + std::to_string(rank) + " S=" + std::to_string(S) + " H=" + std::to_string(S * Hs) +
           " T=" + std::to_string(T) + " Dv=" + std::to_string(Dv);
  }
};

TEST(GpuVariantsOps, LseCorrectEqualsCpu) {
  auto rng = fstest::make_rng(0x5d20);
  int64_t exact = 0, total = 0;
  for (int rep = 0; rep < 3; ++rep)
    for (DType dt : {DType::f16, DType::bf16, DType::f32})
      for (LseLayout layout : {LseLayout::head_major, LseLayout::token_major})
        for (bool slice_major : {false, true}) {
          LseRun r(dt, layout, slice_major, rng() % 2 == 0, rng);
          fs::lse_correct(r.params(false));
          fs::lse_correct(r.params(true));
          fsgpu::sync();
          Mismatches m;
          // The factor exp(local - g) from the device's expf/logf: a few fp32 ulps of the input.
          compare(r.out, r.dout.download(r.out), "out", [&](const std::vector<int64_t>& i) {
            const double x = slice_major ? r.in.getd({i[0], i[1], i[2], i[3]}) : r.in.getd({i[0], i[1], i[2]});
            return std::isfinite(x) ? 1e-5 * std::fabs(x) : 0.0; }, m, exact, total);
          const HostTensor glo = r.dlo.download(r.lo);
          if (r.with_lse_out)
            compare(r.lo, glo, "lse_out", [&](const std::vector<int64_t>& i) {
              return 1e-6 * std::max(1.0, std::fabs(r.lo.getd({i[0], i[1]}))); }, m, exact, total);
          else
            EXPECT_TRUE(fstest::same_bytes(glo, *r.lo.bytes)) << "lse_out written though absent";
          EXPECT_EQ(m.count, 0) << r.str() << ": " << m.count << " mismatches; first: " << m.first << seed_note();
        }
  report("lse_correct", exact, total);
}

// ---------------------------------------------------------------- gather_cache

// B requests over a shuffled paged cache; block-table columns past a request's blocks hold -1,
// rows padded. A random token range unless `whole` (every context from 0); rows of up to 576
// elements, or up to 8 when `narrow` (many requests). dst gets total + spare rows, poisoned.
struct GatherRun {
  int64_t B, bs, width, nb = 0, max_blocks = 0, total = 0;
  int64_t begin = 0, end = std::numeric_limits<int64_t>::max();
  bool with_q;
  HostTensor cache, table, seqused_k, cu_q, dst, cu_dst;
  DeviceTensor dcache, dtable, dseq, dcu_q, ddst, dcu_dst;

  GatherRun(DType dt, int64_t B_, int64_t max_len, std::mt19937_64& rng, bool whole = false, bool narrow = false)
      : B(B_), bs(pick<int64_t>(rng, {1, 3, 16, 64})),
        width(narrow ? pick<int64_t>(rng, {1, 5, 8}) : pick<int64_t>(rng, {1, 5, 64, 576})), with_q(rng() % 2 == 0) {
    std::vector<int64_t> seq(static_cast<size_t>(B)), qlen(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      seq[size_t(b)] = uniform_int(rng, 0, max_len), qlen[size_t(b)] = uniform_int(rng, 0, 8);
      max_blocks = std::max(max_blocks, (seq[size_t(b)] + bs - 1) / bs);
      nb += (seq[size_t(b)] + bs - 1) / bs;
    }
    max_blocks += uniform_int(rng, 0, 2);
    nb += 3;
    switch (whole ? 0 : rng() % 4) {
      case 0: break;
      case 1: end = uniform_int(rng, 0, max_len / 2); break;
      case 2: begin = uniform_int(rng, 0, max_len / 2), end = begin + uniform_int(rng, 0, max_len / 2); break;
      default: begin = max_len + 1, end = 2 * max_len + 2; break;  // past every context
    }
    cache = padded_poisoned(dt, {nb, bs, width});
    fstest::fill_uniform(cache, rng, dt == DType::u8 ? 0.0f : -3.0f, dt == DType::u8 ? 255.0f : 3.0f);
    std::vector<int32_t> ids(static_cast<size_t>(nb));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table = HostTensor::strided(DType::i32, {B, max_blocks}, {max_blocks + 2, 1});
    seqused_k = HostTensor::zeros(DType::i32, {B});
    cu_q = HostTensor::zeros(DType::i32, {B + 1});
    size_t next = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = (seq[size_t(b)] + bs - 1) / bs;
      for (int64_t i = 0; i < max_blocks; ++i) *static_cast<int32_t*>(table.ref.at(b, i)) = i < n ? ids[next++] : -1;
      *static_cast<int32_t*>(seqused_k.ref.at(b)) = int32_t(seq[size_t(b)]);
      *static_cast<int32_t*>(cu_q.ref.at(b + 1)) = *static_cast<int32_t*>(cu_q.ref.at(b)) + int32_t(qlen[size_t(b)]);
      const int64_t ctx = std::max<int64_t>(0, seq[size_t(b)] - (with_q ? qlen[size_t(b)] : 0));
      const int64_t lo = std::min(begin, ctx);
      total += std::max(lo, std::min(end, ctx)) - lo;
    }
    dst = padded_poisoned(dt, {total + uniform_int(rng, 0, 3), width});
    cu_dst = padded_poisoned(DType::i32, {B + 1});
    upload();
  }
  // Inputs mirrored, outputs poisoned (the host tensors were poisoned when made).
  void upload() {
    dcache = DeviceTensor::mirror(cache), dtable = DeviceTensor::mirror(table), dseq = DeviceTensor::mirror(seqused_k);
    dcu_q = DeviceTensor::mirror(cu_q), ddst = DeviceTensor::mirror(dst), dcu_dst = DeviceTensor::mirror(cu_dst);
  }
  fs::GatherCacheParams params(bool gpu) const {
    fs::GatherCacheParams p;
    p.cache = gpu ? dcache.ref : cache.ref;
    p.block_table = gpu ? dtable.ref : table.ref;
    p.seqused_k = gpu ? dseq.ref : seqused_k.ref;
    if (with_q) p.cu_seqlens_q = gpu ? dcu_q.ref : cu_q.ref;
    p.token_begin = begin;
    p.token_end = end;
    p.dst = gpu ? ddst.ref : dst.ref;
    p.cu_seqlens_dst = gpu ? dcu_dst.ref : cu_dst.ref;
    return p;
  }
  std::string str() const {
    return std::string(fs::dtype_name(cache.ref.dtype)) + " B=" + std::to_string(B) + " bs=" + std::to_string(bs) +
           " width=" + std::to_string(width) + (with_q ? " with queries" : "") + " range " + std::to_string(begin) +
           ".." + std::to_string(end) + " total " + std::to_string(total);
  }
};

void expect_gather_equal(const GatherRun& r, const HostTensor& dst, const HostTensor& cu_dst, const std::string& what) {
  EXPECT_TRUE(fstest::same_bytes(r.ddst.download(r.dst), *dst.bytes)) << what << ": dst differs; " << r.str() << seed_note();
  EXPECT_TRUE(fstest::same_bytes(r.dcu_dst.download(r.cu_dst), *cu_dst.bytes))
      << what << ": cu_seqlens_dst differs; " << r.str() << seed_note();
  EXPECT_TRUE(fstest::same_bytes(r.dcache.download(r.cache), *r.cache.bytes)) << what << ": the cache changed";
}

TEST(GpuVariantsOps, GatherCacheEqualsCpuBitForBit) {
  auto rng = fstest::make_rng(0x5d21);
  for (int rep = 0; rep < 6; ++rep)
    for (DType dt : {DType::u8, DType::f16, DType::bf16, DType::f32}) {
      const bool many = rep == 0;  // more requests than the offsets scan's block
      GatherRun r(dt, many ? uniform_int(rng, 1025, 3000) : uniform_int(rng, 0, 40), many ? 12 : 200, rng, false, many);
      fs::gather_cache(r.params(false));
      fs::gather_cache(r.params(true));
      fsgpu::sync();
      expect_gather_equal(r, r.dst, r.cu_dst, "vs CPU");
    }
}

// Contents the CPU rejects; the device skips what they index: the expected dst is the CPU's run
// on valid contents with the skipped rows poisoned again, cu_seqlens_dst unchanged.
TEST(GpuVariantsOps, GatherCacheSkipsOutOfRangeContents) {
  auto rng = fstest::make_rng(0x5d22);
  for (int rep = 0; rep < 8; ++rep) {
    GatherRun r(pick<DType>(rng, {DType::u8, DType::bf16}), uniform_int(rng, 1, 12), 100, rng, true);
    fs::gather_cache(r.params(false));  // the valid run
    HostTensor want = r.dst.clone();
    const int64_t bs = r.bs;
    const size_t row_bytes = size_t(r.width) * fs::dtype_size(r.dst.ref.dtype);
    int64_t row = 0, bad_rows = 0;
    for (int64_t b = 0; b < r.B; ++b) {  // corrupt some used block indices; their rows stay poisoned
      const int64_t ctx = *static_cast<const int32_t*>(r.cu_dst.ref.at(b + 1)) - *static_cast<const int32_t*>(r.cu_dst.ref.at(b));
      for (int64_t t = 0; t < ctx; ++t, ++row) {
        int32_t* id = static_cast<int32_t*>(r.table.ref.at(b, t / bs));
        if (t % bs == 0 && rng() % 3 == 0) *id = pick<int32_t>(rng, {-1, int32_t(r.nb), std::numeric_limits<int32_t>::max()});
        if (*id < 0 || *id >= r.nb) std::memset(want.ref.at(row, 0), 0xFF, row_bytes), ++bad_rows;
      }
    }
    const int64_t short_rows = uniform_int(rng, 0, r.total);  // dst shorter than the total: the rest skipped
    for (int64_t i = short_rows; i < r.dst.ref.size(0); ++i) std::memset(want.ref.at(i, 0), 0xFF, row_bytes);
    r.upload();  // the corrupted table; the outputs poisoned again on the device
    fsgpu::poison(r.ddst);
    fsgpu::poison(r.dcu_dst);
    fs::GatherCacheParams p = r.params(true);
    p.dst = r.ddst.ref.slice(0, 0, short_rows);
    fs::gather_cache(p);
    fsgpu::sync();
    SCOPED_TRACE(std::to_string(bad_rows) + " rows with a bad block, dst rows " + std::to_string(short_rows));
    expect_gather_equal(r, want, r.cu_dst, "out of range");
  }
}

// A context past the block-table row, negative lengths, decreasing query offsets: nothing read
// outside the table row or the cache; past-the-row tokens skipped.
TEST(GpuVariantsOps, GatherCacheSkipsTokensPastTheTableRow) {
  auto rng = fstest::make_rng(0x5d23);
  GatherRun r(DType::f16, 6, 80, rng, true);
  r.with_q = true;
  const int64_t cols = std::min<int64_t>(2, r.max_blocks);  // the table cut to `cols` columns
  for (int64_t b = 0; b < r.B; ++b) *static_cast<int32_t*>(r.seqused_k.ref.at(b)) = int32_t(40 + 10 * b);
  *static_cast<int32_t*>(r.seqused_k.ref.at(0)) = -5;            // context 0
  *static_cast<int32_t*>(r.cu_q.ref.at(3)) = -30;                 // request 2: q_len < 0, context past seqused
  r.dst = padded_poisoned(r.dst.ref.dtype, {4000, r.width});
  r.cu_dst = padded_poisoned(DType::i32, {r.B + 1});
  r.upload();
  fs::GatherCacheParams p = r.params(true);
  p.block_table = r.dtable.ref.slice(1, 0, cols);
  fs::gather_cache(p);
  fsgpu::sync();
  // Expected on the host with the device's rules.
  HostTensor want = r.dst.clone(), want_cu = r.cu_dst.clone();
  const size_t row_bytes = size_t(r.width) * fs::dtype_size(r.dst.ref.dtype);
  int64_t row = 0;
  for (int64_t b = 0; b < r.B; ++b) {
    *static_cast<int32_t*>(want_cu.ref.at(b)) = int32_t(row);
    const int64_t q = int64_t(*static_cast<int32_t*>(r.cu_q.ref.at(b + 1))) - *static_cast<int32_t*>(r.cu_q.ref.at(b));
    const int64_t ctx = std::max<int64_t>(0, *static_cast<int32_t*>(r.seqused_k.ref.at(b)) - q);
    for (int64_t t = 0; t < ctx; ++t, ++row) {
      if (t / r.bs >= cols) continue;
      const int32_t id = *static_cast<int32_t*>(r.table.ref.at(b, t / r.bs));
      if (id >= 0 && id < r.nb) std::memcpy(want.ref.at(row, 0), r.cache.ref.at(id, t % r.bs, 0), row_bytes);
    }
  }
  *static_cast<int32_t*>(want_cu.ref.at(r.B)) = int32_t(row);
  ASSERT_LE(row, 4000);
  expect_gather_equal(r, want, want_cu, "past the table row");
}

// ---------------------------------------------------------------- validate_only, graphs

TEST(GpuVariantsOps, ValidateOnlyWritesNothing) {
  auto rng = fstest::make_rng(0x5d24);
  fs::ExecContext dry;
  dry.validate_only = true;
  DiffRun d(DType::bf16, DType::bf16, DType::bf16, false, rng);
  LseRun l(DType::f16, LseLayout::token_major, true, true, rng);
  GatherRun g(DType::bf16, 5, 50, rng);
  const HostTensor lout = l.dout.download(l.out);
  fs::differential_combine(d.params(true), dry);
  fs::lse_correct(l.params(true), dry);
  fs::gather_cache(g.params(true), dry);
  fsgpu::sync();
  EXPECT_TRUE(fstest::same_bytes(d.dout.download(d.out), *d.out.bytes)) << "differential out written";
  EXPECT_TRUE(fstest::same_bytes(l.dout.download(l.out), *lout.bytes)) << "lse_correct out written";
  EXPECT_TRUE(fstest::same_bytes(l.dlo.download(l.lo), *l.lo.bytes)) << "lse_out written";
  EXPECT_TRUE(fstest::same_bytes(g.ddst.download(g.dst), *g.dst.bytes)) << "gather dst written";
  EXPECT_TRUE(fstest::same_bytes(g.dcu_dst.download(g.cu_dst), *g.cu_dst.bytes)) << "cu_seqlens_dst written";
}

// The three ops captured on a stream and replayed equal eager runs on the same inputs.
TEST(GpuVariantsOps, GraphReplayEqualsEager) {
  auto rng = fstest::make_rng(0x5d25);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  fs::ExecContext ctx;
  ctx.stream = stream;
  DiffRun d(DType::bf16, DType::f32, DType::f16, false, rng);
  LseRun l(DType::bf16, LseLayout::head_major, false, true, rng);
  GatherRun g(DType::u8, 1500, 10, rng, true, true);
  const HostTensor l_in = l.dout.download(l.out);  // lse_correct scales in place: restored per run
  auto run = [&] {
    fs::differential_combine(d.params(true), ctx);
    fs::lse_correct(l.params(true), ctx);
    fs::gather_cache(g.params(true), ctx);
  };
  fsgpu::CapturedGraph(stream, run).replay();
  const HostTensor outs[] = {d.dout.download(d.out), l.dout.download(l.out), l.dlo.download(l.lo),
                             g.ddst.download(g.dst), g.dcu_dst.download(g.cu_dst)};
  fsgpu::poison(d.dout), fsgpu::poison(l.dlo), fsgpu::poison(g.ddst), fsgpu::poison(g.dcu_dst);
  l.dout.copy_from(l_in);
  fsgpu::sync();
  run();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(fstest::same_bytes(outs[0], *d.dout.download(d.out).bytes)) << "differential: graph != eager" << seed_note();
  EXPECT_TRUE(fstest::same_bytes(outs[1], *l.dout.download(l.out).bytes)) << "lse out: graph != eager" << seed_note();
  EXPECT_TRUE(fstest::same_bytes(outs[2], *l.dlo.download(l.lo).bytes)) << "lse_out: graph != eager" << seed_note();
  EXPECT_TRUE(fstest::same_bytes(outs[3], *g.ddst.download(g.dst).bytes)) << "gather dst: graph != eager" << seed_note();
  EXPECT_TRUE(fstest::same_bytes(outs[4], *g.dcu_dst.download(g.cu_dst).bytes)) << "cu_seqlens_dst: graph != eager";
  cudaStreamDestroy(stream);
}

}  // namespace
