// merge_states on CUDA (merge.hpp) against the CPU reference: both LSE layouts, padded and dense
// (vector path) operands, -inf/+inf LSE rows, both-empty rows, prefill_tokens_with_context,
// optional out_lse, fp8 output (e4m3, e5m2, u8) with saturation. Rows whose weights are exact
// (copied rows, rows with an empty side) must match bit for bit; merged rows within fp32
// rounding of the weights (device expf/logf) plus one step of the output format. Also a
// CUDA-graph capture of reshape_and_cache + merge_states, replayed on new inputs, equal to eager
// runs; and validate_only.
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

#include "flashserve/cache.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/status.hpp"
#include "support/captured_graph.hpp"
#include "support/device_tensor.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"
#include "support/merge_operands.hpp"

namespace {

namespace fs = flashserve;
namespace nm = flashserve::numeric;
using fs::DType;
using fs::LseLayout;
using fs::TensorRef;
using fsgpu::DeviceTensor;
using fstest::HostTensor;
using fstest::lse_at;
using fstest::lse_tensor;
using fstest::MergeCase;
using fstest::Mismatches;
using fstest::seed_note;
using fstest::uniform_int;

// Host operands (the reference runs on them) and their device mirrors (outputs poisoned).
struct MergeRun {
  MergeCase mc;
  int64_t T, H, D, ptwc;
  HostTensor a, b, la, lb, out, lo, scale;
  DeviceTensor da, db, dla, dlb, dout, dlo, dscale;

  MergeRun(const MergeCase& c, int64_t T_, int64_t H_, int64_t D_, std::mt19937_64& rng)
      : mc(c), T(T_), H(H_), D(D_), a(fstest::merge_rows(c.a_dtype, c.dense, T, H, D)),
        b(fstest::merge_rows(c.b_dtype, c.dense, T, H, D)), la(lse_tensor(c.layout, T, H)), lb(lse_tensor(c.layout, T, H)),
        out(fstest::merge_rows(c.out_dtype, c.dense, T, H, D)),
        lo(lse_tensor(c.layout, T, H)), scale(HostTensor::zeros(DType::f32, {1})) {
    ptwc = c.prefill ? uniform_int(rng, 0, T) : T;
    *scale.ref.ptr<float>() = c.format() == DType::f8e4m3 ? 0.006f : 4e-5f;  // |x| < 4: some outputs saturate
    randomize(rng);
    dout = DeviceTensor::poisoned_mirror(out);
    dlo = DeviceTensor::poisoned_mirror(lo);
    dscale = DeviceTensor::mirror(scale);
  }
  // New inputs, copied into the same device buffers once they exist (a captured graph keeps
  // their addresses); outputs poisoned again on both sides.
  void randomize(std::mt19937_64& rng) {
    fstest::fill_uniform(a, rng, -4.0f, 4.0f);
    fstest::fill_uniform(b, rng, -4.0f, 4.0f);
    for (int64_t t = 0; t < T; t += 3) b.set({t, 0, 0}, -0.0f);  // copied rows keep the sign
    fstest::fill_lse(rng, la, lb, mc.layout, T, H);
    if (!da.storage) {
      da = DeviceTensor::mirror(a), db = DeviceTensor::mirror(b);
      dla = DeviceTensor::mirror(la), dlb = DeviceTensor::mirror(lb);
      return;
    }
    da.copy_from(a), db.copy_from(b), dla.copy_from(la), dlb.copy_from(lb);
    fstest::poison_storage(out);
    fstest::poison_storage(lo);
    fsgpu::poison(dout);
    fsgpu::poison(dlo);
  }
  fs::MergeParams params(bool gpu) const {
    fs::MergeParams p;
    p.out = gpu ? dout.ref : out.ref;
    p.a_out = gpu ? da.ref : a.ref;
    p.a_lse = gpu ? dla.ref : la.ref;
    p.b_out = gpu ? db.ref : b.ref;
    p.b_lse = gpu ? dlb.ref : lb.ref;
    p.lse_layout = mc.layout;
    if (mc.with_out_lse) p.out_lse = gpu ? dlo.ref : lo.ref;
    if (mc.prefill) p.prefill_tokens_with_context = ptwc;
    if (mc.fp8()) p.output_scale = gpu ? dscale.ref : scale.ref;
    return p;
  }
  std::string str() const {
    return mc.str() + " T " + std::to_string(T) + " H " + std::to_string(H) + " D " + std::to_string(D) +
           " prefill_tokens_with_context " + std::to_string(ptwc);
  }
};

// One step of `fmt` at magnitude |x| (an upper bound), plus its smallest subnormal.
double step_of(DType fmt, double x) {
  switch (fmt) {
    case DType::f16: return std::ldexp(std::fabs(x), -10) + std::ldexp(1.0, -24);
    case DType::bf16: return std::ldexp(std::fabs(x), -7) + 1e-38;
    case DType::f8e4m3: return std::ldexp(std::fabs(x), -3) + std::ldexp(1.0, -9);
    case DType::f8e5m2: return std::ldexp(std::fabs(x), -2) + std::ldexp(1.0, -16);
    default: return 0.0;
  }
}

// Compares the GPU's out / out_lse (downloaded) with the reference's (in r's host tensors).
// Counts bit-exact elements in `exact` out of `total`.
void check_merge(const MergeRun& r, const HostTensor& gout, const HostTensor& glo, Mismatches& m, int64_t& exact,
                 int64_t& total) {
  const DType fmt = r.mc.fp8() ? r.mc.format() : r.mc.out_dtype;
  const double sv = r.mc.fp8() ? double(*r.scale.ref.ptr<float>()) : 1.0;
  const size_t es = fs::dtype_size(r.out.ref.dtype);
  auto value = [&](const HostTensor& o, int64_t t, int64_t h, int64_t c) {
    return nm::load_double(o.ref.at(t, h, c), fmt);
  };
  for (int64_t t = 0; t < r.T; ++t)
    for (int64_t h = 0; h < r.H; ++h) {
      const float la = *lse_at(r.la, r.mc.layout, t, h), lb = *lse_at(r.lb, r.mc.layout, t, h);
      const bool exact_row = t >= r.ptwc || std::isinf(la) || std::isinf(lb);
      const std::string at = " at t=" + std::to_string(t) + " h=" + std::to_string(h) + " (lse_a " +
                             std::to_string(la) + ", lse_b " + std::to_string(lb) + ")";
      for (int64_t c = 0; c < r.D; ++c) {
        const bool same = std::memcmp(r.out.ref.at(t, h, c), gout.ref.at(t, h, c), es) == 0;
        exact += same;
        ++total;
        if (same) continue;
        const double cpu = value(r.out, t, h, c), gpu = value(gout, t, h, c);
        const double mag = (std::fabs(r.a.getd({t, h, c})) + std::fabs(r.b.getd({t, h, c}))) / sv;
        const double tol = 4e-6 * mag + step_of(fmt, std::max(std::fabs(cpu), std::fabs(gpu)));
        const bool ok = !exact_row && std::fabs(cpu - gpu) <= tol;
        char buf[160];
        std::snprintf(buf, sizeof buf, "out c=%lld: cpu %.9g gpu %.9g (tolerance %.3g%s)", (long long)c, cpu, gpu, tol,
                      exact_row ? ", row must be exact" : "");
        m.check(ok, buf + at);
      }
      if (!r.mc.with_out_lse) continue;
      const float cpu = *lse_at(r.lo, r.mc.layout, t, h), gpu = *lse_at(glo, r.mc.layout, t, h);
      const bool same = std::memcmp(&cpu, &gpu, 4) == 0;
      const bool ok = same || (!exact_row && std::fabs(double(cpu) - gpu) <= 1e-6 * std::max(1.0, std::fabs(double(cpu))));
      m.check(ok, "out_lse: cpu " + std::to_string(cpu) + " gpu " + std::to_string(gpu) + at);
    }
  auto padding = [&](const HostTensor& cpu, const HostTensor& gpu, const char* name) {  // both poisoned
    const std::vector<char> in = fstest::view_bytes(cpu);
    for (size_t i = 0; i < in.size(); ++i)
      m.check(in[i] || (*cpu.bytes)[i] == (*gpu.bytes)[i], std::string(name) + ": bytes outside the view written");
  };
  padding(r.out, gout, "out");
  padding(r.lo, glo, "out_lse");
}

// Runs one case on the CPU and the GPU and compares.
void run_merge_case(const MergeCase& mc, std::mt19937_64& rng, int64_t& exact, int64_t& total) {
  const int64_t T = uniform_int(rng, 1, 200), H = uniform_int(rng, 1, 8);
  const int64_t D = std::vector<int64_t>{8, 40, 64, 72, 128, 256}[rng() % 6];
  MergeRun r(mc, T, H, D, rng);
  fs::merge_states(r.params(false));
  fs::merge_states(r.params(true));
  fsgpu::sync();
  Mismatches m;
  check_merge(r, r.dout.download(r.out), r.dlo.download(r.lo), m, exact, total);
  EXPECT_EQ(m.count, 0) << r.str() << ": " << m.count << " mismatches; first: " << m.first << seed_note();
}

}  // namespace

TEST(GpuMergeStates, EqualsCpu) {
  auto rng = fstest::make_rng(0x3e27);
  const DType floats[] = {DType::f16, DType::bf16, DType::f32};
  int64_t exact = 0, total = 0;
  for (int rep = 0; rep < 2; ++rep)
    for (LseLayout layout : {LseLayout::head_major, LseLayout::token_major})
      for (bool dense : {false, true}) {
        for (DType in : floats)
          for (DType out : floats)
            for (int v = 0; v < 2; ++v)
              run_merge_case({in, floats[rng() % 3], out, layout, v == 0, v == 1, dense}, rng, exact, total);
        for (DType out : {DType::f8e4m3, DType::f8e5m2, DType::u8})
          for (int v = 0; v < 2; ++v)
            run_merge_case({floats[rng() % 3], floats[rng() % 3], out, layout, true, v == 1, dense}, rng, exact, total);
      }
  std::printf("[   INFO   ] merge_states: %lld of %lld output elements bit-identical to the CPU reference\n",
              (long long)exact, (long long)total);
}

TEST(GpuMergeStates, ValidateOnlyWritesNothing) {
  auto rng = fstest::make_rng(0x3e28);
  MergeRun r({DType::f16, DType::f16, DType::f16, LseLayout::head_major, true, false, true}, 5, 2, 16, rng);
  fs::ExecContext ctx;
  ctx.validate_only = true;
  fs::merge_states(r.params(true), ctx);
  fsgpu::sync();
  EXPECT_TRUE(fstest::same_bytes(r.dout.download(r.out), *r.out.bytes)) << "out written";
  EXPECT_TRUE(fstest::same_bytes(r.dlo.download(r.lo), *r.lo.bytes)) << "out_lse written";
}

namespace {

// reshape_and_cache operands for the graph test: fp8 e4m3 cache with per-head scales.
struct CacheRun {
  int64_t T = 24, H = 4, D = 64, bs = 16, nb = 6;
  HostTensor key = HostTensor::zeros(DType::bf16, {T, H, D}), value = HostTensor::zeros(DType::bf16, {T, H, D});
  HostTensor kc = HostTensor::zeros(DType::u8, {nb, bs, H, D}), vc = HostTensor::zeros(DType::u8, {nb, H, bs, D});
  HostTensor slots = HostTensor::zeros(DType::i64, {T}), ks = HostTensor::zeros(DType::f32, {H}), vs = HostTensor::zeros(DType::f32, {H});
  DeviceTensor dkey, dvalue, dkc, dvc, dslots, dks, dvs;

  void randomize(std::mt19937_64& rng) {
    fstest::fill_uniform(key, rng, -4.0f, 4.0f);
    fstest::fill_uniform(value, rng, -4.0f, 4.0f);
    fstest::fill_uniform(ks, rng, 0.004f, 0.02f);
    fstest::fill_uniform(vs, rng, 0.004f, 0.02f);
    std::vector<int64_t> s(static_cast<size_t>(nb * bs));
    std::iota(s.begin(), s.end(), 0);
    std::shuffle(s.begin(), s.end(), rng);
    for (int64_t i = 0; i < T; ++i) *static_cast<int64_t*>(slots.ref.at(i)) = rng() % 5 == 0 ? -1 : s[size_t(i)];
    fstest::poison_storage(kc);
    fstest::poison_storage(vc);
  }
  // Device buffers: allocated once, refilled in place (the graph keeps the addresses).
  void upload() {
    if (!dkey.storage) {
      dkey = DeviceTensor::mirror(key), dvalue = DeviceTensor::mirror(value), dkc = DeviceTensor::mirror(kc);
      dvc = DeviceTensor::mirror(vc), dslots = DeviceTensor::mirror(slots), dks = DeviceTensor::mirror(ks);
      dvs = DeviceTensor::mirror(vs);
      return;
    }
    dkey.copy_from(key), dvalue.copy_from(value), dkc.copy_from(kc), dvc.copy_from(vc);
    dslots.copy_from(slots), dks.copy_from(ks), dvs.copy_from(vs);
  }
  fs::CacheWriteParams params(bool gpu) const {
    fs::CacheWriteParams p;
    p.key = gpu ? dkey.ref : key.ref;
    p.value = gpu ? dvalue.ref : value.ref;
    p.key_cache = gpu ? dkc.ref : kc.ref;
    p.value_cache = gpu ? dvc.ref.permute({0, 2, 1, 3}) : vc.ref.permute({0, 2, 1, 3});  // HND storage, NHD view
    p.slot_mapping = gpu ? dslots.ref : slots.ref;
    p.cache_dtype = fs::KvCacheDType::fp8_e4m3;
    p.k_scale = gpu ? dks.ref : ks.ref;
    p.v_scale = gpu ? dvs.ref : vs.ref;
    return p;
  }
};

}  // namespace

TEST(GpuGraph, ReshapeAndCacheThenMergeReplaysEqualEager) {
  auto rng = fstest::make_rng(0x6a4f);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  fs::ExecContext ctx;
  ctx.stream = stream;
  CacheRun cr;
  cr.randomize(rng);
  cr.upload();
  MergeRun mr({DType::f16, DType::bf16, DType::bf16, LseLayout::head_major, true, true, true}, 48, 8, 128, rng);
  fsgpu::sync();

  const fsgpu::CapturedGraph graph(stream, [&] {
    fs::reshape_and_cache(cr.params(true), ctx);
    fs::merge_states(mr.params(true), ctx);
  });

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    cr.randomize(rng);  // new inputs in the same device buffers; outputs poisoned
    cr.upload();
    mr.randomize(rng);
    fsgpu::sync();
    graph.replay();
    const HostTensor g_kc = cr.dkc.download(cr.kc), g_vc = cr.dvc.download(cr.vc);
    const HostTensor g_out = mr.dout.download(mr.out), g_lo = mr.dlo.download(mr.lo);

    cr.upload();  // the same inputs again, outputs poisoned: the eager run
    fsgpu::poison(mr.dout);
    fsgpu::poison(mr.dlo);
    fsgpu::sync();
    fs::reshape_and_cache(cr.params(true), ctx);
    fs::merge_states(mr.params(true), ctx);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(fstest::same_bytes(g_kc, *cr.dkc.download(cr.kc).bytes)) << "key cache: graph != eager" << seed_note();
    EXPECT_TRUE(fstest::same_bytes(g_vc, *cr.dvc.download(cr.vc).bytes)) << "value cache: graph != eager" << seed_note();
    EXPECT_TRUE(fstest::same_bytes(g_out, *mr.dout.download(mr.out).bytes)) << "merge out: graph != eager" << seed_note();
    EXPECT_TRUE(fstest::same_bytes(g_lo, *mr.dlo.download(mr.lo).bytes)) << "merge lse: graph != eager" << seed_note();

    fs::reshape_and_cache(cr.params(false));  // and both equal the CPU reference
    fs::merge_states(mr.params(false));
    EXPECT_TRUE(fstest::same_bytes(cr.kc, *g_kc.bytes)) << "key cache: graph != CPU" << seed_note();
    EXPECT_TRUE(fstest::same_bytes(cr.vc, *g_vc.bytes)) << "value cache: graph != CPU" << seed_note();
    Mismatches m;
    int64_t exact = 0, total = 0;
    check_merge(mr, g_out, g_lo, m, exact, total);
    EXPECT_EQ(m.count, 0) << "merge: graph != CPU: " << m.first << seed_note();
  }
  cudaStreamDestroy(stream);
}
