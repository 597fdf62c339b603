// Split-KV: every split count gives the unsplit result within rounding; the unsplit path is
// bitwise reproducible and batch-invariant; split-count choice and plans (scheduler
// metadata); hand-computed softmax cases and the operand decoders of the CPU reference.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "flashserve/attention.hpp"
#include "flashserve/status.hpp"
#include "reference/attn_load.hpp"
#include "support/host_tensor.hpp"

namespace fs = flashserve;
using fs::DType;
using fstest::HostTensor;

namespace {

enum class Kv { varlen_contiguous, varlen_paged, batched_paged, batched_contiguous };

struct SeqSpec {
  int64_t sq = 0, sk = 0;
  uint64_t seed = 0;  // the sequence's data: q, k, v, ALiBi slopes, descales
};

struct Config {
  Kv kv = Kv::varlen_contiguous;
  fs::KvLayout layout = fs::KvLayout::nhd;
  int64_t block_size = 16;
  int64_t H = 1, Hkv = 1, D = 64, Dv = 64;
  bool qv = false;             // q_v [.., H, Dv]
  DType dtype = DType::f32;    // q, out (and k, v unless fp8_kv)
  bool fp8_kv = false;         // k, v float8_e4m3fn with k_descale / v_descale
  bool causal = false;
  fs::Window window{};
  int64_t chunk = 0;
  float softcap = 0.0f;
  bool sinks = false, alibi = false, alibi_sqrt = false, cache_batch_idx = false;
  uint64_t seed = 0;           // per-call tensors (the sinks)
  uint64_t placement = 0;      // where KV blocks and rows go
  std::vector<SeqSpec> seqs;
  bool batched() const { return kv == Kv::batched_paged || kv == Kv::batched_contiguous; }
  bool paged() const { return kv == Kv::varlen_paged || kv == Kv::batched_paged; }
};

std::string describe(const Config& c) {
  static const char* kv[] = {"varlen_contiguous", "varlen_paged", "batched_paged", "batched_contiguous"};
  std::ostringstream os;
  os << kv[int(c.kv)] << (c.paged() ? (c.layout == fs::KvLayout::hnd ? " HND" : " NHD") : "")
     << " bs=" << c.block_size << " H=" << c.H << "/" << c.Hkv << " D=" << c.D << "/" << c.Dv
     << (c.qv ? " q_v" : "") << " " << fs::dtype_name(c.dtype) << (c.fp8_kv ? " fp8kv" : "")
     << (c.causal ? " causal" : "") << " window=(" << c.window.left << "," << c.window.right << ")"
     << " chunk=" << c.chunk << " softcap=" << c.softcap << (c.sinks ? " sinks" : "")
     << (c.alibi ? (c.alibi_sqrt ? " alibi_sqrt" : " alibi") : "") << " lens(q,k)=";
  for (const SeqSpec& s : c.seqs) os << "(" << s.sq << "," << s.sk << ")";
  return os.str();
}

// A built call over owning storage; unused KV slots and rows hold NaN.
struct Built {
  fs::AttentionParams p;
  std::vector<HostTensor> keep;
  HostTensor out, lse;
  std::vector<int64_t> row0;  // first q row of each sequence (varlen), 0 (batched)
  float max_abs_v = 0.0f;     // of the dequantized v
  Config cfg;
};

HostTensor i32_tensor(const std::vector<int64_t>& vals) {
  HostTensor t = HostTensor::zeros(DType::i32, {int64_t(vals.size())});
  for (size_t i = 0; i < vals.size(); ++i) t.set({int64_t(i)}, float(vals[i]));
  return t;
}

fs::TensorRef keep(Built& bt, const HostTensor& t) {
  bt.keep.push_back(t);
  return t.ref;
}

// KV token t of sequence b lives at (d0, d1): paged (block, slot), contiguous (row, token).
struct Placement {
  std::vector<std::vector<int64_t>> blocks;  // paged: per sequence
  std::vector<int64_t> k_start, cache_row;   // varlen contiguous / batched contiguous
};

Placement place_kv(Built& bt, const Config& c, std::mt19937_64& rng) {
  const int64_t B = int64_t(c.seqs.size());
  fs::AttentionParams& p = bt.p;
  Placement pl;
  const DType kvt = c.fp8_kv ? DType::f8e4m3 : c.dtype;
  int64_t max_sk = 0;
  std::vector<int64_t> lens;
  for (const SeqSpec& s : c.seqs) lens.push_back(s.sk), max_sk = std::max(max_sk, s.sk);
  HostTensor k, v;
  if (c.paged()) {
    const int64_t bs = c.block_size, cols = (max_sk + bs - 1) / bs + 1;
    int64_t used = 0;
    for (const SeqSpec& s : c.seqs) used += (s.sk + bs - 1) / bs;
    const int64_t nb = used + 3;
    std::vector<int64_t> ids(static_cast<size_t>(nb));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    HostTensor table = HostTensor::zeros(DType::i32, {B, cols});
    size_t next = 0;
    pl.blocks.resize(size_t(B));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < cols; ++j) {
        const bool use = j < (c.seqs[size_t(b)].sk + bs - 1) / bs;
        if (use) pl.blocks[size_t(b)].push_back(ids[next++]);
        table.set({b, j}, use ? float(pl.blocks[size_t(b)].back()) : -1.0f);
      }
    const bool hnd = c.layout == fs::KvLayout::hnd;
    k = hnd ? HostTensor::zeros(kvt, {nb, c.Hkv, bs, c.D}) : HostTensor::zeros(kvt, {nb, bs, c.Hkv, c.D});
    v = hnd ? HostTensor::zeros(kvt, {nb, c.Hkv, bs, c.Dv}) : HostTensor::zeros(kvt, {nb, bs, c.Hkv, c.Dv});
    p.kv_layout = c.layout;
    p.block_table = keep(bt, table);
    p.seqused_k = keep(bt, i32_tensor(lens));
  } else if (c.kv == Kv::varlen_contiguous) {
    std::vector<int64_t> cu{0};
    for (const SeqSpec& s : c.seqs) {
      pl.k_start.push_back(cu.back());
      cu.push_back(cu.back() + s.sk + int64_t(rng() % 3));  // gaps of unused rows
    }
    k = HostTensor::zeros(kvt, {cu.back(), c.Hkv, c.D});
    v = HostTensor::zeros(kvt, {cu.back(), c.Hkv, c.Dv});
    p.cu_seqlens_k = keep(bt, i32_tensor(cu));
    p.seqused_k = keep(bt, i32_tensor(lens));
  } else {
    const int64_t rows = B + (c.cache_batch_idx ? 2 : 0), len = max_sk + 2;
    for (int64_t b = 0; b < rows; ++b) pl.cache_row.push_back(b);
    if (c.cache_batch_idx) std::shuffle(pl.cache_row.begin(), pl.cache_row.end(), rng);
    pl.cache_row.resize(size_t(B));
    k = HostTensor::zeros(kvt, {rows, len, c.Hkv, c.D});
    v = HostTensor::zeros(kvt, {rows, len, c.Hkv, c.Dv});
    if (c.cache_batch_idx) p.cache_batch_idx = keep(bt, i32_tensor(pl.cache_row));
    p.seqused_k = keep(bt, i32_tensor(lens));
  }
  fstest::poison_storage(k);  // unused rows, blocks and slots stay NaN
  fstest::poison_storage(v);
  p.k = keep(bt, k);
  p.v = keep(bt, v);
  return pl;
}

// Writes element d of KV head g of token t of sequence b into k or v.
void put_kv(const Config& c, const Placement& pl, const fs::TensorRef& t, int64_t b, int64_t tok,
            int64_t g, int64_t d, float x) {
  const size_t bi = size_t(b);
  void* at;
  if (c.paged()) {
    const int64_t blk = pl.blocks[bi][size_t(tok / c.block_size)], slot = tok % c.block_size;
    at = c.layout == fs::KvLayout::hnd ? t.at(blk, g, slot, d) : t.at(blk, slot, g, d);
  } else {
    at = c.kv == Kv::varlen_contiguous ? t.at(pl.k_start[bi] + tok, g, d) : t.at(pl.cache_row[bi], tok, g, d);
  }
  fs::numeric::store_float(at, t.dtype, x);
}

Built build(const Config& c) {
  Built bt;
  bt.cfg = c;
  fs::AttentionParams& p = bt.p;
  const int64_t B = int64_t(c.seqs.size()), H = c.H, Hkv = c.Hkv;
  std::mt19937_64 place(c.placement);
  int64_t total_q = 0, max_sq = 0, max_sk = 0;
  for (const SeqSpec& s : c.seqs) {
    bt.row0.push_back(c.batched() ? 0 : total_q);
    total_q += s.sq;
    max_sq = std::max(max_sq, s.sq);
    max_sk = std::max(max_sk, s.sk);
  }
  const bool bat = c.batched();
  const int64_t n0 = bat ? B : total_q, n1 = bat ? max_sq : 0;
  auto qshape = [&](int64_t w) { return bat ? HostTensor::zeros(c.dtype, {n0, n1, H, w}) : HostTensor::zeros(c.dtype, {n0, H, w}); };
  p.q = keep(bt, qshape(c.D));
  if (c.qv) p.q_v = keep(bt, qshape(c.Dv));
  bt.out = qshape(c.Dv);
  bt.lse = bat ? HostTensor::zeros(DType::f32, {B, H, max_sq}) : HostTensor::zeros(DType::f32, {H, total_q});
  p.out = bt.out.ref;
  p.lse = bt.lse.ref;
  if (!bat) {
    std::vector<int64_t> cu{0};
    for (const SeqSpec& s : c.seqs) cu.push_back(cu.back() + s.sq);
    p.cu_seqlens_q = keep(bt, i32_tensor(cu));
    p.max_seqlen_q = max_sq;
    p.max_seqlen_k = max_sk;
  }
  const Placement pl = place_kv(bt, c, place);
  HostTensor slopes = HostTensor::zeros(DType::f32, {B, H});
  HostTensor kd = HostTensor::zeros(DType::f32, {B, Hkv}), vd = HostTensor::zeros(DType::f32, {B, Hkv});
  for (int64_t b = 0; b < B; ++b) {
    const SeqSpec& s = c.seqs[size_t(b)];
    std::mt19937_64 rng(s.seed);
    std::uniform_real_distribution<float> u2(-2.0f, 2.0f), u1(-1.0f, 1.0f), us(0.5f, 1.5f), ua(0.0f, 0.5f);
    auto q_at = [&](const fs::TensorRef& t, int64_t i, int64_t h, int64_t d) {
      return bat ? t.at(b, i, h, d) : t.at(bt.row0[size_t(b)] + i, h, d);
    };
    for (int64_t i = 0; i < s.sq; ++i)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < c.D; ++d) fs::numeric::store_float(q_at(p.q, i, h, d), c.dtype, u2(rng));
        if (c.qv)
          for (int64_t d = 0; d < c.Dv; ++d) fs::numeric::store_float(q_at(*p.q_v, i, h, d), c.dtype, u1(rng));
      }
    for (int64_t g = 0; g < Hkv; ++g) {
      kd.set({b, g}, c.fp8_kv ? us(rng) : 1.0f);
      vd.set({b, g}, c.fp8_kv ? us(rng) : 1.0f);
    }
    for (int64_t t = 0; t < s.sk; ++t)
      for (int64_t g = 0; g < Hkv; ++g) {
        for (int64_t d = 0; d < c.D; ++d) put_kv(c, pl, p.k, b, t, g, d, u2(rng));
        for (int64_t d = 0; d < c.Dv; ++d) {
          const float x = u1(rng) * (c.fp8_kv ? 2.0f : 1.0f);
          put_kv(c, pl, p.v, b, t, g, d, x);
          bt.max_abs_v = std::max(bt.max_abs_v, std::fabs(x) * vd.get({b, g}));
        }
      }
    for (int64_t h = 0; h < H; ++h) slopes.set({b, h}, ua(rng));
  }
  if (c.fp8_kv) {
    p.k_descale = keep(bt, kd);
    p.v_descale = keep(bt, vd);
  }
  if (c.alibi) p.alibi_slopes = keep(bt, slopes);
  if (c.sinks) {
    HostTensor sink = HostTensor::zeros(DType::f32, {H});
    std::uniform_real_distribution<float> us(-2.0f, 3.0f);
    std::mt19937_64 rng(c.seed);
    for (int64_t h = 0; h < H; ++h) sink.set({h}, us(rng));
    p.s_aux = keep(bt, sink);
  }
  p.causal = c.causal;
  p.window = c.window;
  p.chunk_size = c.chunk;
  p.softcap = c.softcap;
  p.alibi_sqrt = c.alibi_sqrt;
  return bt;
}

// One sequence's results: out [sq, H, Dv], lse [H, sq].
struct SeqOut {
  std::vector<float> out, lse;
};
using Result = std::vector<SeqOut>;

void call(const Built& bt, const fs::ExecContext& ctx = {}) {
  if (bt.cfg.batched()) fs::kvcache_attention(bt.p, ctx);
  else fs::varlen_attention(bt.p, ctx);
}

Result run(Built& bt, int num_splits, const fs::ExecContext& ctx = {}) {
  bt.p.num_splits = num_splits;
  fstest::poison_storage(bt.out);
  fstest::poison_storage(bt.lse);
  call(bt, ctx);
  const Config& c = bt.cfg;
  Result r(c.seqs.size());
  for (size_t b = 0; b < c.seqs.size(); ++b) {
    const int64_t sq = c.seqs[b].sq, row = bt.row0[b], bi = int64_t(b);
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t d = 0; d < c.Dv; ++d)
          r[b].out.push_back(c.batched() ? bt.out.get({bi, i, h, d}) : bt.out.get({row + i, h, d}));
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < sq; ++i)
        r[b].lse.push_back(c.batched() ? bt.lse.get({bi, h, i}) : bt.lse.get({h, row + i}));
  }
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Empty when `got` matches `want` within the tolerances; else the first mismatch.
std::string compare(const Result& got, const Result& want, float out_tol, float lse_tol) {
  auto bad = [](size_t b, const char* what, size_t k, float g, float w) {
    return fs::detail::cat("seq ", b, " ", what, "[", k, "]: got ", g, ", want ", w);
  };
  for (size_t b = 0; b < want.size(); ++b) {
    for (size_t k = 0; k < want[b].out.size(); ++k) {
      const float g = got[b].out[k], w = want[b].out[k];
      if (!std::isfinite(g) || !(std::fabs(g - w) <= out_tol)) return bad(b, "out", k, g, w);
    }
    for (size_t k = 0; k < want[b].lse.size(); ++k) {
      const float g = got[b].lse[k], w = want[b].lse[k];
      const bool inf = std::isinf(w) || std::isinf(g);
      if (inf ? g != w : !(std::fabs(g - w) <= lse_tol * std::max(1.0f, std::fabs(w)))) return bad(b, "lse", k, g, w);
    }
  }
  return "";
}

constexpr int kFamilies = 8;

// Family: 0 varlen paged NHD, 1 varlen paged HND, 2 varlen contiguous, 3 batched paged,
// 4 batched contiguous, 5 long-KV decode (1.5k-2.1k keys), 6 fp8 KV, 7 MLA decode with q_v.
Config random_config(std::mt19937_64& rng, int family) {
  auto uni = [&](int64_t lo, int64_t hi) { return lo + int64_t(rng() % uint64_t(hi - lo + 1)); };
  auto pick = [&](std::initializer_list<int64_t> xs) { return *(xs.begin() + rng() % xs.size()); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng) < p; };
  Config c;
  c.seed = rng();
  c.placement = rng();
  c.kv = (family <= 1 || family == 6) ? Kv::varlen_paged
         : family == 2                 ? Kv::varlen_contiguous
         : family == 4                 ? Kv::batched_contiguous
                                       : Kv::batched_paged;
  c.layout = (family == 1 || (family >= 3 && chance(0.5))) ? fs::KvLayout::hnd : fs::KvLayout::nhd;
  c.block_size = pick({1, 3, 16, 32});
  c.Hkv = uni(1, family == 5 ? 2 : 3);
  c.H = c.Hkv * (family == 5 ? pick({1, 4}) : pick({1, 2, 4, 8}));
  c.D = c.Dv = pick({8, 40, 64, 72, 128});
  if (chance(0.1)) c.D = 192, c.Dv = 128;
  if (family == 6) c.fp8_kv = true, c.dtype = DType::bf16;
  else if (chance(0.2)) c.dtype = DType::bf16;
  if (family == 7) c.qv = true, c.D = 64, c.Dv = 512, c.Hkv = 1, c.H = pick({4, 8, 16});
  c.cache_batch_idx = chance(0.5);

  const int64_t B = uni(1, 4), common_sq = uni(1, family >= 5 ? 2 : 8);
  for (int64_t b = 0; b < B; ++b) {
    SeqSpec s;
    s.seed = rng();
    s.sk = family == 5 ? uni(1500, 2100) : chance(0.1) ? 0 : uni(1, family == 7 ? 150 : 300);
    s.sq = c.batched() ? common_sq : uni(0, 24);
    c.seqs.push_back(s);
  }
  c.causal = chance(0.5);
  if (chance(0.25)) c.window = {int(pick({-1, 0, 5, 31, 64})), int(pick({-1, 0, 3, 16}))};
  if (chance(0.15)) c.chunk = pick({4, 16, 37, 64});
  if (chance(0.25)) c.softcap = std::uniform_real_distribution<float>(5.0f, 30.0f)(rng);
  c.sinks = chance(0.4);
  c.alibi = chance(0.25);
  c.alibi_sqrt = c.alibi && chance(0.5);
  return c;
}

// Rounding allowed between split counts: fp32 merging, plus one unit of a 16-bit out dtype.
float out_tolerance(const Built& bt) {
  const float ulp = bt.cfg.dtype == DType::bf16 ? 0x1p-7f : 0.0f;
  return (3e-5f + ulp) * std::max(bt.max_abs_v, 1e-3f);
}
constexpr float kLseTol = 2e-5f;

int granules(const Built& bt, const fs::DeviceProps& dev) {
  const fs::Plan plan = bt.cfg.batched() ? fs::plan_kvcache_attention(bt.p, dev) : fs::plan_varlen_attention(bt.p, dev);
  return int((plan.shape.max_seqlen_k + plan.split_granularity - 1) / plan.split_granularity);
}

}  // namespace

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
  fs::ProblemShape s;
  s.batch = 1;
  s.max_seqlen_q = 1;
  s.max_seqlen_k = 32768;
  s.num_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = s.head_dim_v = 128;
  s.total_q = 1;
  s.page_size = 16;
  EXPECT_GT(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), 1);
  s.batch = s.total_q = 256;
  EXPECT_EQ(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), 1);
  s.batch = s.total_q = 1;
  s.max_seqlen_k = 8;  // a single granule: nothing to split
  EXPECT_EQ(fs::choose_num_splits(s, fs::DeviceProps::h200(), 0), 1);
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

// ---- batch-invariant mode (AttentionParams::batch_invariant, Plan::split_size)

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
