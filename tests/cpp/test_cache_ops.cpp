// KV-cache maintenance (cache.hpp) against naive loops written here: reshape_and_cache in every
// cache dtype, layout and block size, with strided inputs, interleaved K/V caches and skipped
// slots; copy/swap blocks; advance_step; quantize_int8; kv_cache_dtype names. Every cache
// byte that a call must not write is checked unchanged (storage poisoned first).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "flashserve/cache.hpp"
#include "flashserve/status.hpp"
#include "support/cache_operands.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace nm = flashserve::numeric;
using fs::DType;
using fs::KvCacheDType;
using fs::KvLayout;
using fs::TensorRef;
using fstest::block_pairs;
using fstest::HostTensor;
using fstest::mapping_tensor;
using fstest::Mismatches;
using fstest::pick;
using fstest::uniform_int;
using fstest::WriteCase;

// The bytes a call may write in one buffer; every other byte must keep its snapshot.
struct Tracker {
  const HostTensor* t;
  std::vector<unsigned char> before;
  std::vector<char> written;
  explicit Tracker(const HostTensor& h) : t(&h), before(fstest::snapshot(h)), written(h.bytes->size(), 0) {}
  void mark(const void* p, size_t n) {
    const auto off = size_t(static_cast<const unsigned char*>(p) - t->bytes->data());
    ASSERT_LE(off + n, written.size());
    std::fill_n(written.begin() + int64_t(off), n, 1);
  }
  int64_t changed_unmarked() const {
    int64_t n = 0;
    for (size_t i = 0; i < before.size(); ++i) n += !written[i] && (*t->bytes)[i] != before[i];
    return n;
  }
};

void* cache_at(const TensorRef& c, KvLayout l, int64_t b, int64_t o, int64_t h, int64_t x) {
  return l == KvLayout::nhd ? c.at(b, o, h, x) : c.at(b, h, o, x);
}

float scale_for_head(const HostTensor& s, int64_t h) {
  return s.ref.ndim == 0 ? s.get({}) : s.get({s.ref.shape[0] == 1 ? 0 : h});
}

// Checks a plain or fp8 row against the source row; marks its bytes.
void check_row(Mismatches& m, Tracker& tr, const TensorRef& src, int64_t i, int64_t h, void* const* dst,
               int64_t n, DType fmt, const HostTensor* scale, int64_t& saturated) {
  const size_t es = fs::dtype_size(src.dtype);
  for (int64_t c = 0; c < n; ++c) {
    const void* x = src.at(i, h, c);
    if (!scale) {
      m.check(std::memcmp(dst[c], x, es) == 0, "plain element differs at token " + std::to_string(i));
      tr.mark(dst[c], es);
      continue;
    }
    const float y = nm::load_float(x, src.dtype) / scale_for_head(*scale, h);
    const uint8_t code = *static_cast<const uint8_t*>(dst[c]);
    m.check(code == nm::float_to_fp8(y, fmt), "fp8 code differs at token " + std::to_string(i));
    if (std::fabs(y) > nm::fp8_max(fmt)) {
      ++saturated;
      m.check(nm::fp8_to_float(code, fmt) == std::copysign(nm::fp8_max(fmt), y), "not saturated");
    }
    tr.mark(dst[c], 1);
  }
}

void run_write_case(const WriteCase& wc, std::mt19937_64& rng) {
  SCOPED_TRACE(wc.str());
  const bool fp8 = wc.fp8(), int8 = wc.int8();
  const DType fmt = wc.fp8_format();
  const int64_t H = pick<int64_t>(rng, {1, 2, 3, 4}), D = pick<int64_t>(rng, {8, 16, 40});
  const int64_t Dv = wc.interleaved ? D : pick<int64_t>(rng, {8, 24});
  const int64_t bs = wc.block_size, nb = (40 + bs - 1) / bs + uniform_int(rng, 0, 2);
  const int64_t T = uniform_int(rng, 4, 33), rows = T + uniform_int(rng, 0, 2);

  HostTensor key = HostTensor::strided(wc.dtype, {rows, H, D}, {H * D + 5, D, 1});
  HostTensor value = HostTensor::strided(wc.dtype, {rows, H, Dv}, {H * Dv + 3, Dv, 1});
  fstest::fill_uniform(key, rng, -4.0f, 4.0f);
  fstest::fill_uniform(value, rng, -4.0f, 4.0f);
  key.set({0, 0, 0}, 3.9f);  // saturates every fp8 scale below (token 0 is never skipped)
  value.set({0, 0, 0}, -3.9f);
  fstest::Caches cc = fstest::make_caches(wc, nb, H, D, Dv);
  HostTensor ksc = HostTensor::strided(DType::f32, {nb, H, bs}, {H * (bs + 2) + 1, bs + 2, 1});
  for (const HostTensor* t : {&cc.kb, &cc.vb, &ksc}) fstest::poison_storage(*t);

  const std::vector<int64_t> slots = fstest::random_slots(rng, nb * bs, T);
  HostTensor slot_mapping = fstest::slot_tensor(slots);

  const float lo = fmt == DType::f8e4m3 ? 0.004f : 3e-5f, hi = fmt == DType::f8e4m3 ? 0.008f : 6e-5f;  // |x| < 4: both saturated and in-range values
  HostTensor k_scale = fstest::fp8_scale(rng, wc.scale_rank, H, lo, hi);
  HostTensor v_scale = fstest::fp8_scale(rng, wc.scale_rank, H, lo, hi);
  HostTensor v_scale_i8 = HostTensor::zeros(DType::f32, {H, Dv});
  fstest::fill_uniform(v_scale_i8, rng, 0.02f, 0.05f);

  fs::CacheWriteParams p;
  p.key = key;
  p.value = value;
  p.key_cache = cc.k;
  p.value_cache = cc.v;
  p.layout = wc.layout;
  p.slot_mapping = slot_mapping;
  p.cache_dtype = wc.mode;
  if (fp8) p.k_scale = k_scale.ref;
  if (fp8) p.v_scale = v_scale.ref;
  if (wc.mode == KvCacheDType::int8_k8v8) p.v_scale = v_scale_i8.ref;
  if (int8) p.k_scale_cache = ksc.ref;

  Tracker tk(cc.kb), tv(cc.vb), ts(ksc);
  Tracker& tvv = cc.shared ? tk : tv;
  fs::reshape_and_cache(p);

  Mismatches m;
  int64_t saturated = 0;
  std::vector<void*> dst(static_cast<size_t>(std::max(D, Dv)));
  for (int64_t i = 0; i < T; ++i) {
    const int64_t slot = slots[size_t(i)];
    if (slot < 0) continue;
    const int64_t b = slot / bs, o = slot % bs;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < D; ++c) dst[size_t(c)] = cache_at(cc.k, wc.layout, b, o, h, c);
      if (!int8) {
        check_row(m, tk, key.ref, i, h, dst.data(), D, fmt, fp8 ? &k_scale : nullptr, saturated);
      } else {
        double absmax = 0.0;
        for (int64_t c = 0; c < D; ++c) absmax = std::max(absmax, std::fabs(key.getd({i, h, c})));
        const double want = absmax > 0.0 ? absmax / 127.0 : 1.0;
        const float got = ksc.get({b, h, o});
        m.check(std::fabs(got - want) <= 1e-6 * want, "k scale " + std::to_string(got) + " want " + std::to_string(want));
        ts.mark(ksc.ref.at(b, h, o), 4);
        for (int64_t c = 0; c < D; ++c) {
          const int q = *static_cast<const int8_t*>(dst[size_t(c)]);
          const double err = std::fabs(q * double(got) - key.getd({i, h, c}));
          m.check(std::abs(q) <= 127 && err <= 0.5 * got * (1 + 1e-5), "int8 k round trip error " + std::to_string(err));
          tk.mark(dst[size_t(c)], 1);
        }
      }
      for (int64_t c = 0; c < Dv; ++c) dst[size_t(c)] = cache_at(cc.v, wc.layout, b, o, h, c);
      if (wc.mode != KvCacheDType::int8_k8v8) {
        check_row(m, tvv, value.ref, i, h, dst.data(), Dv, fmt, fp8 ? &v_scale : nullptr, saturated);
        continue;
      }
      for (int64_t c = 0; c < Dv; ++c) {
        const int q = *static_cast<const int8_t*>(dst[size_t(c)]);
        const double want = std::clamp(value.getd({i, h, c}) / v_scale_i8.getd({h, c}), -127.0, 127.0);
        m.check(std::fabs(q - want) <= 0.5 + 1e-4, "int8 v " + std::to_string(q) + " want " + std::to_string(want));
        tvv.mark(dst[size_t(c)], 1);
      }
    }
  }
  EXPECT_EQ(m.count, 0) << m.first;
  EXPECT_EQ(tk.changed_unmarked(), 0) << "key cache bytes outside written slots changed";
  if (!cc.shared) EXPECT_EQ(tv.changed_unmarked(), 0) << "value cache bytes outside written slots changed";
  EXPECT_EQ(ts.changed_unmarked(), 0) << "k_scale_cache bytes outside written slots changed";
  if (fp8) EXPECT_GT(saturated, 0) << "the case should exercise saturation";
}

std::vector<WriteCase> write_cases(std::mt19937_64& rng) {
  std::vector<WriteCase> cases;
  for (KvLayout l : {KvLayout::nhd, KvLayout::hnd})
    for (bool inter : {false, true})
      for (int64_t bs : {1, 5, 16}) {
        for (DType t : {DType::f16, DType::bf16, DType::f32})
          cases.push_back({l, inter, false, bs, KvCacheDType::auto_, t, DType::u8, 0});
        for (int rank : {0, 1, 2}) {
          cases.push_back({l, inter, false, bs, KvCacheDType::fp8_e4m3, pick(rng, {DType::f16, DType::bf16}),
                           rank == 1 ? DType::f8e4m3 : DType::u8, rank});
          cases.push_back({l, inter, false, bs, KvCacheDType::fp8_e5m2, pick(rng, {DType::f16, DType::bf16, DType::f32}),
                           rank == 1 ? DType::u8 : DType::f8e5m2, rank});
        }
        cases.push_back({l, inter, false, bs, KvCacheDType::int8_k8v8, pick(rng, {DType::f16, DType::bf16}), DType::u8, 0});
        if (!inter)  // the v cache holds f16/bf16 while k is int8: separate buffers
          cases.push_back({l, inter, false, bs, KvCacheDType::int8_k8v16, pick(rng, {DType::f16, DType::bf16}), DType::u8, 0});
      }
  return cases;
}

}  // namespace

TEST(KvCacheDTypeNames, ParseAndName) {
  EXPECT_EQ(fs::parse_kv_cache_dtype("auto"), KvCacheDType::auto_);
  EXPECT_EQ(fs::parse_kv_cache_dtype("fp8"), KvCacheDType::fp8_e4m3);
  EXPECT_EQ(fs::parse_kv_cache_dtype("fp8_e4m3"), KvCacheDType::fp8_e4m3);
  EXPECT_EQ(fs::parse_kv_cache_dtype("fp8_e5m2"), KvCacheDType::fp8_e5m2);
  EXPECT_EQ(fs::parse_kv_cache_dtype("int8"), KvCacheDType::int8_k8v8);
  EXPECT_EQ(fs::parse_kv_cache_dtype("int8_k8v8"), KvCacheDType::int8_k8v8);
  EXPECT_EQ(fs::parse_kv_cache_dtype("int8_k8v16"), KvCacheDType::int8_k8v16);
  for (KvCacheDType t : {KvCacheDType::auto_, KvCacheDType::fp8_e4m3, KvCacheDType::fp8_e5m2,
                         KvCacheDType::int8_k8v8, KvCacheDType::int8_k8v16})
    EXPECT_EQ(fs::parse_kv_cache_dtype(fs::kv_cache_dtype_name(t)), t);
  try {
    fs::parse_kv_cache_dtype("fp4", "cache_dtype");
    ADD_FAILURE() << "no throw";
  } catch (const fs::Error& e) {
    EXPECT_STREQ(e.what(), "cache_dtype: expected one of auto, fp8, fp8_e4m3, fp8_e5m2, int8, int8_k8v16, got 'fp4'");
  }
}

TEST(ReshapeAndCache, EveryModeLayoutAndBlockSize) {
  auto rng = fstest::make_rng(0x5e11);
  for (int rep = 0; rep < 4; ++rep)
    for (const WriteCase& wc : write_cases(rng)) run_write_case(wc, rng);
}

TEST(ReshapeAndCache, NoTokens) {
  HostTensor key = HostTensor::zeros(DType::f16, {2, 1, 8}), cache = HostTensor::zeros(DType::f16, {2, 4, 1, 8});
  HostTensor vcache = HostTensor::zeros(DType::f16, {2, 4, 1, 8}), slots = HostTensor::zeros(DType::i64, {0});
  fstest::poison_storage(cache);
  const auto before = fstest::snapshot(cache);
  fs::CacheWriteParams p;
  p.key = p.value = key;
  p.key_cache = cache;
  p.value_cache = vcache;
  p.slot_mapping = slots;
  fs::reshape_and_cache(p);
  EXPECT_TRUE(fstest::same_bytes(cache, before));
}

namespace {

// Expected storage after copying block s to block d of the view `c` (elementwise, from `orig`).
void copy_block_bytes(std::vector<unsigned char>& expect, const std::vector<unsigned char>& orig,
                      const HostTensor& buf, const TensorRef& c, int64_t s, int64_t d) {
  const TensorRef src = c.select(0, s), dst = c.select(0, d);
  const size_t es = fs::dtype_size(c.dtype);
  const auto base = [&](const TensorRef& v) { return static_cast<const unsigned char*>(v.data) - buf.bytes->data(); };
  fstest::for_each_index(src, [&](const std::vector<int64_t>&, int64_t off) {
    std::memcpy(&expect[size_t(base(dst) + off * int64_t(es))], &orig[size_t(base(src) + off * int64_t(es))], es);
  });
}

}  // namespace

TEST(CopyBlocks, SeveralCachesAnyStrides) {
  auto rng = fstest::make_rng(0xc0b1);
  for (int rep = 0; rep < 6; ++rep) {
    const int64_t nb = uniform_int(rng, 4, 12), bs = pick<int64_t>(rng, {1, 5, 16}), H = 2, D = 8;
    HostTensor inter = HostTensor::zeros(DType::bf16, {nb, 2, bs, H, D});
    HostTensor plain = HostTensor::strided(DType::f16, {nb, H, bs, D}, {H * bs * 9 + 3, bs * 9, 9, 1});
    HostTensor scales = HostTensor::zeros(DType::f32, {nb, H, bs});
    HostTensor tags = HostTensor::zeros(DType::i32, {nb});
    const std::vector<const HostTensor*> bufs{&inter, &plain, &scales, &tags};
    for (const HostTensor* b : bufs) {
      TensorRef flat = TensorRef::contiguous(b->bytes->data(), b->ref.dtype, {int64_t(b->bytes->size() / fs::dtype_size(b->ref.dtype))});
      fstest::fill_uniform(flat, rng, -100.0f, 100.0f);
    }
    const std::vector<TensorRef> caches{inter.ref.select(1, 0), inter.ref.select(1, 1), plain.ref, scales.ref, tags.ref};
    const std::vector<const HostTensor*> owner{&inter, &inter, &plain, &scales, &tags};
    const int64_t n = uniform_int(rng, 0, nb / 2);
    HostTensor m = mapping_tensor(block_pairs(rng, nb, nb, n, true));

    std::vector<std::vector<unsigned char>> orig, expect;
    for (const HostTensor* b : bufs) orig.push_back(fstest::snapshot(*b));
    expect = orig;
    for (int64_t r = 0; r < n; ++r)
      for (size_t c = 0; c < caches.size(); ++c) {
        const size_t bi = size_t(std::find(bufs.begin(), bufs.end(), owner[c]) - bufs.begin());
        copy_block_bytes(expect[bi], orig[bi], *owner[c], caches[c], *static_cast<int64_t*>(m.ref.at(r, 0)),
                         *static_cast<int64_t*>(m.ref.at(r, 1)));
      }
    fs::copy_blocks(caches, m);
    for (size_t bi = 0; bi < bufs.size(); ++bi) EXPECT_TRUE(fstest::same_bytes(*bufs[bi], expect[bi])) << "buffer " << bi;
  }
}

TEST(SwapBlocks, CpuToCpuBothWays) {
  auto rng = fstest::make_rng(0x5a4b);
  for (int rep = 0; rep < 6; ++rep) {
    const int64_t bs = pick<int64_t>(rng, {1, 5, 16}), H = 3, D = 16;
    const int64_t na = uniform_int(rng, 2, 8), nh = uniform_int(rng, 2, 8);
    HostTensor dev = HostTensor::zeros(DType::f16, {na, 2, bs, H, D});  // "device" cache, K/V interleaved
    HostTensor host = HostTensor::strided(DType::f16, {nh, bs, H, D}, {bs * H * D + 4, H * D, D, 1});
    for (const HostTensor* b : {&dev, &host})
      fstest::fill_uniform(TensorRef::contiguous(b->bytes->data(), DType::f16, {int64_t(b->bytes->size() / 2)}), rng, -8, 8);
    const TensorRef dk = dev.ref.select(1, 0);
    const bool out = rep % 2 == 0;  // device -> host, else host -> device
    const TensorRef& src = out ? dk : host.ref;
    const TensorRef& dst = out ? host.ref : dk;
    const HostTensor& dbuf = out ? host : dev;
    const HostTensor& sbuf = out ? dev : host;
    const int64_t n = uniform_int(rng, 0, std::min(src.size(0), dst.size(0)));
    HostTensor m = mapping_tensor(block_pairs(rng, src.size(0), dst.size(0), n, false));
    const auto sorig = fstest::snapshot(sbuf);
    auto expect = fstest::snapshot(dbuf);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t s = *static_cast<int64_t*>(m.ref.at(r, 0)), d = *static_cast<int64_t*>(m.ref.at(r, 1));
      fstest::for_each_index(src.select(0, s), [&](const std::vector<int64_t>& idx, int64_t) {
        const void* from = src.select(0, s).at(idx[0], idx[1], idx[2]);
        void* to = dst.select(0, d).at(idx[0], idx[1], idx[2]);
        std::memcpy(&expect[size_t(static_cast<unsigned char*>(to) - dbuf.bytes->data())], from, 2);
      });
    }
    fs::swap_blocks(src, dst, m);
    EXPECT_TRUE(fstest::same_bytes(dbuf, expect)) << "rep " << rep;
    EXPECT_TRUE(fstest::same_bytes(sbuf, sorig)) << "source changed, rep " << rep;
  }
}

TEST(AdvanceStep, MatchesNaiveLoop) {
  auto rng = fstest::make_rng(0xadd5);
  for (int rep = 0; rep < 20; ++rep) {
    const int64_t num_seqs = uniform_int(rng, 1, 20), num_queries = uniform_int(rng, 0, num_seqs);
    const int64_t bs = pick<int64_t>(rng, {1, 5, 16}), max_blocks = uniform_int(rng, 1, 6), extra = 2;
    const int64_t R = num_seqs + extra;
    const fstest::StepBuffers s = fstest::step_buffers(rng, R, num_queries, bs, max_blocks);
    const HostTensor &tokens = s.tokens, &positions = s.positions, &slots = s.slots, &lens = s.lens;
    const HostTensor &sampled = s.sampled, &tables = s.tables;
    std::vector<int64_t> want_tok(static_cast<size_t>(R)), want_pos(want_tok), want_slot(want_tok), want_len(want_tok);
    for (int64_t i = 0; i < R; ++i) {
      want_tok[size_t(i)] = int64_t(tokens.getd({i}));
      want_pos[size_t(i)] = int64_t(positions.getd({i}));
      want_slot[size_t(i)] = int64_t(slots.getd({i}));
      want_len[size_t(i)] = int64_t(lens.getd({i}));
      if (i >= num_seqs) continue;
      if (i >= num_queries) {
        want_tok[size_t(i)] = 0, want_pos[size_t(i)] = 0, want_slot[size_t(i)] = -1;
        continue;
      }
      const int64_t pos = want_len[size_t(i)];
      want_tok[size_t(i)] = int64_t(sampled.getd({i, 0}));
      want_len[size_t(i)] = pos + 1;
      want_pos[size_t(i)] = pos;
      want_slot[size_t(i)] = int64_t(tables.getd({i, pos / bs})) * bs + pos % bs;
    }
    fs::advance_step(fstest::step_params(s, num_seqs, num_queries, bs));
    for (int64_t i = 0; i < R; ++i) {
      EXPECT_EQ(int64_t(tokens.getd({i})), want_tok[size_t(i)]) << "row " << i;
      EXPECT_EQ(int64_t(positions.getd({i})), want_pos[size_t(i)]) << "row " << i;
      EXPECT_EQ(int64_t(slots.getd({i})), want_slot[size_t(i)]) << "row " << i;
      EXPECT_EQ(int64_t(lens.getd({i})), want_len[size_t(i)]) << "row " << i;
    }
  }
}

TEST(QuantizeInt8, PerTokenHeadScales) {
  auto rng = fstest::make_rng(0x9a47);
  for (DType t : {DType::f16, DType::bf16, DType::f32}) {
    const int64_t T = uniform_int(rng, 1, 20), H = uniform_int(rng, 1, 4), D = pick<int64_t>(rng, {8, 40, 128});
    HostTensor x = HostTensor::strided(t, {T, H, D}, {H * D * 2, D, 1});
    fstest::fill_uniform(x, rng, -30.0f, 30.0f);
    for (int64_t c = 0; c < D; ++c) x.set({0, 0, c}, 0.0f);  // an all-zero row: scale 1
    HostTensor out = HostTensor::zeros(DType::i8, {T, H, D}), scale = HostTensor::zeros(DType::f32, {T, H});
    fstest::poison(out);
    fstest::poison(scale);
    fs::quantize_int8(x, out, scale);
    Mismatches m;
    for (int64_t i = 0; i < T; ++i)
      for (int64_t h = 0; h < H; ++h) {
        double absmax = 0.0;
        for (int64_t c = 0; c < D; ++c) absmax = std::max(absmax, std::fabs(x.getd({i, h, c})));
        const double want = absmax > 0.0 ? absmax / 127.0 : 1.0, got = scale.getd({i, h});
        m.check(std::fabs(got - want) <= 1e-6 * want, "scale " + std::to_string(got) + " want " + std::to_string(want));
        int max_q = 0;
        for (int64_t c = 0; c < D; ++c) {
          const int q = int(out.getd({i, h, c}));
          max_q = std::max(max_q, std::abs(q));
          m.check(std::fabs(q * got - x.getd({i, h, c})) <= 0.5 * got * (1 + 1e-5), "round trip");
        }
        m.check(absmax == 0.0 ? max_q == 0 : max_q == 127, "absmax maps to 127");
      }
    EXPECT_EQ(m.count, 0) << fs::dtype_name(t) << ": " << m.first;
  }
}

namespace {

// reshape_and_cache with int8 rows given already quantized (the int8 fork's
// reshape_and_cache_flash_int8 / _mix): key rows and (K8V8) int8 value rows byte for byte,
// (K8V16) 16-bit value rows as given, key_scale[t, h] (a transposed, strided view) into
// k_scale_cache; padding slots (-1) and every other byte untouched.
void run_given_int8(KvCacheDType mode, KvLayout layout, std::mt19937_64& rng) {
  const bool k8v8 = mode == KvCacheDType::int8_k8v8;
  const int64_t T = uniform_int(rng, 1, 12), pad = uniform_int(rng, 0, 3), H = uniform_int(rng, 1, 3);
  const int64_t D = pick<int64_t>(rng, {8, 16, 40}), bs = pick<int64_t>(rng, {1, 4, 16});
  const int64_t nb = (T + bs - 1) / bs + 2;
  const DType vt = k8v8 ? DType::i8 : pick(rng, {DType::f16, DType::bf16});
  HostTensor key = HostTensor::strided(DType::i8, {T + pad, H, D}, {H * D + 8, D, 1});
  HostTensor value = HostTensor::zeros(vt, {T + pad, H, D});
  for (auto& b : *key.bytes) b = static_cast<unsigned char>(uniform_int(rng, -127, 127));
  if (k8v8) {
    for (auto& b : *value.bytes) b = static_cast<unsigned char>(uniform_int(rng, -127, 127));
  } else {
    fstest::fill_uniform(value, rng, -3.0f, 3.0f);
  }
  HostTensor scale_store = HostTensor::zeros(DType::f32, {H, T + pad});  // head-major, passed as [T, H]
  fstest::fill_uniform(scale_store, rng, 0.001f, 0.1f);
  const TensorRef key_scale = scale_store.ref.permute({1, 0});
  auto cache_of = [&](DType t) {
    return layout == KvLayout::nhd ? HostTensor::zeros(t, {nb, bs, H, D}) : HostTensor::zeros(t, {nb, H, bs, D});
  };
  HostTensor kc = cache_of(DType::i8), vc = cache_of(vt), ksc = HostTensor::zeros(DType::f32, {nb, H, bs});
  for (const HostTensor* t : {&kc, &vc, &ksc}) fstest::poison_storage(*t);
  // distinct slots, some skipped
  std::vector<int64_t> perm(size_t(nb * bs));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = int64_t(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  HostTensor slots = HostTensor::zeros(DType::i64, {T});
  for (int64_t i = 0; i < T; ++i)
    *static_cast<int64_t*>(slots.ref.at(i)) = uniform_int(rng, 0, 4) == 0 ? -1 : perm[size_t(i)];
  Tracker tk(kc), tv(vc), ts(ksc);
  fs::CacheWriteParams p;
  p.key = key;
  p.value = value;
  p.key_cache = kc;
  p.value_cache = vc;
  p.layout = layout;
  p.slot_mapping = slots;
  p.cache_dtype = mode;
  p.k_scale_cache = ksc.ref;
  p.key_scale = key_scale;
  fs::reshape_and_cache(p);
  Mismatches m;
  const size_t vs = fs::dtype_size(vt);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t slot = *static_cast<const int64_t*>(slots.ref.at(i));
    if (slot < 0) continue;
    const int64_t b = slot / bs, o = slot % bs;
    for (int64_t h = 0; h < H; ++h) {
      const void* kd = cache_at(kc.ref, layout, b, o, h, 0);
      const void* vd = cache_at(vc.ref, layout, b, o, h, 0);
      m.check(std::memcmp(kd, key.ref.at(i, h, 0), size_t(D)) == 0, "key row");
      m.check(std::memcmp(vd, value.ref.at(i, h, 0), size_t(D) * vs) == 0, "value row");
      const void* sd = ksc.ref.at(b, h, o);
      m.check(*static_cast<const float*>(sd) == *static_cast<const float*>(key_scale.at(i, h)), "key scale");
      tk.mark(kd, size_t(D));
      tv.mark(vd, size_t(D) * vs);
      ts.mark(sd, sizeof(float));
    }
  }
  EXPECT_EQ(m.count, 0) << m.first;
  EXPECT_EQ(tk.changed_unmarked(), 0);
  EXPECT_EQ(tv.changed_unmarked(), 0);
  EXPECT_EQ(ts.changed_unmarked(), 0);
}

}  // namespace

TEST(ReshapeAndCache, Int8RowsGivenQuantized) {
  auto rng = fstest::make_rng(0x18a1);
  for (int rep = 0; rep < 6; ++rep)
    for (KvCacheDType mode : {KvCacheDType::int8_k8v8, KvCacheDType::int8_k8v16})
      for (KvLayout layout : {KvLayout::nhd, KvLayout::hnd}) {
        SCOPED_TRACE(std::string(fs::kv_cache_dtype_name(mode)) + (layout == KvLayout::nhd ? " nhd" : " hnd"));
        run_given_int8(mode, layout, rng);
      }
}
