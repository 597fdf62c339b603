// Context parallelism in attention: KV token t of rank r sits at global position t * W + r, or
// with an interleave I at (t / I) * W * I + r * I + t % I.
// Attention over each rank's shard with cp_world_size / cp_rank / cp_tot_seqused_k, merged over
// the ranks by LSE, must equal attention over the whole KV (masks and ALiBi in global positions).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "flashserve/attention.hpp"
#include "support/host_tensor.hpp"

using flashserve::AttentionParams;
using flashserve::DType;
using fstest::HostTensor;

namespace {

struct Result {
  HostTensor out, lse;  // [total_q, H, D], [H, total_q]
};

// Varlen contiguous attention over the given KV (rows of k/v per sequence in `k_rows`).
Result run(const HostTensor& q, const HostTensor& k, const HostTensor& v, const std::vector<int32_t>& cu_q,
           const std::vector<int32_t>& cu_k, const AttentionParams& mods, int world, int rank,
           const std::vector<int32_t>& tot, int64_t interleave = 1) {
  const int64_t tq = q.ref.size(0), H = q.ref.size(1), D = q.ref.size(2), B = int64_t(cu_q.size()) - 1;
  Result r{HostTensor::zeros(DType::f32, {tq, H, D}), HostTensor::zeros(DType::f32, {H, tq})};
  fstest::poison(r.out.ref);
  fstest::poison(r.lse.ref);
  HostTensor cq = HostTensor::zeros(DType::i32, {B + 1}), ck = HostTensor::zeros(DType::i32, {B + 1});
  HostTensor ct = HostTensor::zeros(DType::i32, {B});
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b <= B; ++b) {
    cq.ref.ptr<int32_t>()[b] = cu_q[size_t(b)];
    ck.ref.ptr<int32_t>()[b] = cu_k[size_t(b)];
    if (b < B) {
      ct.ref.ptr<int32_t>()[b] = tot[size_t(b)];
      max_q = std::max<int64_t>(max_q, cu_q[size_t(b) + 1] - cu_q[size_t(b)]);
      max_k = std::max<int64_t>(max_k, cu_k[size_t(b) + 1] - cu_k[size_t(b)]);
    }
  }
  AttentionParams p = mods;
  p.q = q.ref;
  p.k = k.ref;
  p.v = v.ref;
  p.out = r.out.ref;
  p.lse = r.lse.ref;
  p.cu_seqlens_q = cq.ref;
  p.cu_seqlens_k = ck.ref;
  p.max_seqlen_q = max_q;
  p.max_seqlen_k = max_k;
  p.cp_world_size = world;
  p.cp_rank = rank;
  p.cp_interleave = interleave;
  if (world > 1) p.cp_tot_seqused_k = ct.ref;
  flashserve::varlen_attention(p);
  return r;
}

}  // namespace

TEST(ContextParallel, ShardsMergedEqualWholeKv) {
  auto rng = fstest::make_rng(0xC0FFEE);
  for (int iter = 0; iter < 40; ++iter) {
    const int64_t B = 1 + int64_t(rng() % 3), Hkv = 1 + int64_t(rng() % 2), H = Hkv * (1 + int64_t(rng() % 3));
    const int64_t D = 16;
    const int world = 2 + int(rng() % 3);
    const int64_t il = rng() % 2 ? 1 : 1 + int64_t(rng() % 5);
    std::vector<int32_t> cu_q{0}, cu_k{0}, tot;
    for (int64_t b = 0; b < B; ++b) {
      const int32_t sk = int32_t(rng() % 40), sq = int32_t(std::min<uint64_t>(sk, 1 + rng() % 6));
      cu_q.push_back(cu_q.back() + sq);
      cu_k.push_back(cu_k.back() + sk);
      tot.push_back(sk);
    }
    const int64_t tq = cu_q.back(), tk = cu_k.back();
    HostTensor q = HostTensor::zeros(DType::f32, {tq, H, D});
    HostTensor k = HostTensor::zeros(DType::f32, {tk, Hkv, D}), v = HostTensor::zeros(DType::f32, {tk, Hkv, D});
    fstest::fill_uniform(q.ref, rng, -1, 1);
    fstest::fill_uniform(k.ref, rng, -1, 1);
    fstest::fill_uniform(v.ref, rng, -1, 1);
    AttentionParams mods;
    mods.causal = rng() % 4 != 0;
    if (rng() % 3 == 0) mods.window = {int(rng() % 12), -1};
    if (rng() % 4 == 0) mods.chunk_size = 1 + int64_t(rng() % 9);
    HostTensor slopes = HostTensor::zeros(DType::f32, {H});
    if (rng() % 3 == 0) {
      fstest::fill_uniform(slopes.ref, rng, 0.01f, 0.5f);
      mods.alibi_slopes = slopes.ref;
    }
    const Result whole = run(q, k, v, cu_q, cu_k, mods, 1, 0, tot);

    // Merge the ranks' states in fp64: out = Σ exp(lse_r - lse) out_r.
    std::vector<double> num(size_t(tq * H * D), 0.0), den(size_t(tq * H), 0.0);
    std::vector<double> mx(size_t(tq * H), -INFINITY);
    std::vector<Result> parts;
    for (int r = 0; r < world; ++r) {
      std::vector<int32_t> lcu{0};
      // Local keys of rank r: the global positions g < tot with (g / il) % world == r, in order.
      std::vector<std::vector<int64_t>> mine(static_cast<size_t>(B));
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t g = 0; g < tot[size_t(b)]; ++g)
          if ((g / il) % world == r) mine[size_t(b)].push_back(g);
        lcu.push_back(lcu.back() + int32_t(mine[size_t(b)].size()));
      }
      HostTensor lk = HostTensor::zeros(DType::f32, {lcu.back(), Hkv, D}), lv = HostTensor::zeros(DType::f32, {lcu.back(), Hkv, D});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < lcu[size_t(b) + 1] - lcu[size_t(b)]; ++t)
          for (int64_t g = 0; g < Hkv; ++g)
            for (int64_t d = 0; d < D; ++d) {
              const int64_t src = cu_k[size_t(b)] + mine[size_t(b)][size_t(t)];
              lk.set({lcu[size_t(b)] + t, g, d}, k.get({src, g, d}));
              lv.set({lcu[size_t(b)] + t, g, d}, v.get({src, g, d}));
            }
      parts.push_back(run(q, lk, lv, cu_q, lcu, mods, world, r, tot, il));
      for (int64_t i = 0; i < tq * H; ++i) mx[size_t(i)] = std::max(mx[size_t(i)], double(parts.back().lse.ref.ptr<float>()[(i % H) * tq + i / H]));
    }
    for (const Result& pr : parts)
      for (int64_t t = 0; t < tq; ++t)
        for (int64_t h = 0; h < H; ++h) {
          const double l = pr.lse.get({h, t}), m = mx[size_t(t * H + h)];
          if (l == -INFINITY) continue;
          const double w = std::exp(l - m);
          den[size_t(t * H + h)] += w;
          for (int64_t d = 0; d < D; ++d) num[size_t((t * H + h) * D + d)] += w * pr.out.get({t, h, d});
        }
    for (int64_t t = 0; t < tq; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const double wl = whole.lse.get({h, t});
        const double dn = den[size_t(t * H + h)];
        const double ml = dn > 0 ? mx[size_t(t * H + h)] + std::log(dn) : -INFINITY;
        ASSERT_EQ(std::isinf(wl), std::isinf(ml)) << "iter " << iter << " t " << t << " h " << h;
        if (!std::isinf(wl)) ASSERT_NEAR(wl, ml, 2e-5) << "iter " << iter;
        for (int64_t d = 0; d < D; ++d) {
          const double want = whole.out.get({t, h, d});
          const double got = dn > 0 ? num[size_t((t * H + h) * D + d)] / dn : 0.0;
          ASSERT_NEAR(want, got, 2e-5) << "iter " << iter << " t " << t << " h " << h << " world " << world
                                       << " interleave " << il;
        }
      }
  }
}
