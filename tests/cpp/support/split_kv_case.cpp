// The CPU split-KV test cases (split_kv_case.hpp).
#include "support/split_kv_case.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "flashserve/status.hpp"
#include "support/checks.hpp"

namespace fstest::splitkv {

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

fs::TensorRef keep(Built& bt, const HostTensor& t) {
  bt.keep.push_back(t);
  return t.ref;
}

namespace {

HostTensor i32_tensor(const std::vector<int64_t>& vals) {
  HostTensor t = HostTensor::zeros(DType::i32, {int64_t(vals.size())});
  for (size_t i = 0; i < vals.size(); ++i) t.set({int64_t(i)}, float(vals[i]));
  return t;
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

}  // namespace

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

void call(const Built& bt, const fs::ExecContext& ctx) {
  if (bt.cfg.batched()) fs::kvcache_attention(bt.p, ctx);
  else fs::varlen_attention(bt.p, ctx);
}

Result run(Built& bt, int num_splits, const fs::ExecContext& ctx) {
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

int granules(const Built& bt, const fs::DeviceProps& dev) {
  const fs::Plan plan = bt.cfg.batched() ? fs::plan_kvcache_attention(bt.p, dev) : fs::plan_varlen_attention(bt.p, dev);
  return int((plan.shape.max_seqlen_k + plan.split_granularity - 1) / plan.split_granularity);
}

}  // namespace fstest::splitkv
