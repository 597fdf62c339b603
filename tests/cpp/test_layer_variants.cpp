// Differential attention and MLA (SPEC.md §6) against their formulas computed directly with
// varlen_attention over whole contiguous sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using fstest::HostTensor;

// Requests over a paged cache: query lengths, KV lengths (new tokens included), shuffled
// block ids, and the host metadata tensors.
struct Paged {
  std::vector<int32_t> q_lens, seq_lens, qsl{0}, cu_k{0};  // cu_k: whole sequences, contiguous
  int64_t bs = 16, width = 0, num_blocks = 0, T = 0, N = 0;
  std::vector<std::vector<int32_t>> blocks;
  HostTensor table, cu_q, seqused, cu_kv;

  int64_t B() const { return int64_t(q_lens.size()); }
  int64_t slot(int64_t r, int64_t pos) const { return int64_t(blocks[size_t(r)][size_t(pos / bs)]) * bs + pos % bs; }
  int64_t max_q() const { return *std::max_element(q_lens.begin(), q_lens.end()); }
  int64_t max_k() const { return *std::max_element(seq_lens.begin(), seq_lens.end()); }
  // The part covering every request (one call).
  be::PartMetadata part(bool causal = true) const {
    be::PartMetadata p;
    p.num_reqs = B();
    p.num_tokens = T;
    p.max_query_len = max_q();
    p.max_seq_len = max_k();
    p.cu_seqlens_q = cu_q;
    p.seqused_k = seqused;
    p.block_table = table;
    p.causal = causal;
    return p;
  }
};

Paged make_paged(std::vector<int32_t> q_lens, std::vector<int32_t> seq_lens, int64_t bs, std::mt19937_64& rng) {
  Paged pg;
  pg.q_lens = std::move(q_lens);
  pg.seq_lens = std::move(seq_lens);
  pg.bs = bs;
  for (int64_t r = 0; r < pg.B(); ++r) {
    pg.qsl.push_back(pg.qsl.back() + pg.q_lens[size_t(r)]);
    pg.cu_k.push_back(pg.cu_k.back() + pg.seq_lens[size_t(r)]);
    pg.num_blocks += (pg.seq_lens[size_t(r)] + bs - 1) / bs;
  }
  pg.T = pg.qsl.back();
  pg.N = pg.cu_k.back();
  pg.num_blocks += 2;
  std::vector<int32_t> ids(size_t(pg.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  for (int64_t r = 0; r < pg.B(); ++r) {
    const int64_t n = (pg.seq_lens[size_t(r)] + bs - 1) / bs;
    pg.blocks.emplace_back(ids.begin() + int64_t(next), ids.begin() + int64_t(next) + n);
    next += size_t(n);
    pg.width = std::max(pg.width, n + 1);
  }
  pg.table = HostTensor::zeros(DType::i32, {pg.B(), pg.width});
  pg.cu_q = HostTensor::zeros(DType::i32, {pg.B() + 1});
  pg.cu_kv = HostTensor::zeros(DType::i32, {pg.B() + 1});
  pg.seqused = HostTensor::zeros(DType::i32, {pg.B()});
  for (int64_t r = 0; r < pg.B(); ++r) {
    for (size_t j = 0; j < pg.blocks[size_t(r)].size(); ++j) pg.table.set({r, int64_t(j)}, float(pg.blocks[size_t(r)][j]));
    pg.seqused.set({r}, float(pg.seq_lens[size_t(r)]));
  }
  for (int64_t r = 0; r <= pg.B(); ++r) {
    pg.cu_q.set({r}, float(pg.qsl[size_t(r)]));
    pg.cu_kv.set({r}, float(pg.cu_k[size_t(r)]));
  }
  return pg;
}

HostTensor random(DType dt, std::initializer_list<int64_t> shape, std::mt19937_64& rng, float lo = -1.0f,
                  float hi = 1.0f) {
  HostTensor t = HostTensor::zeros(dt, shape);
  fstest::fill_uniform(t, rng, lo, hi);
  return t;
}

// Even (0) or odd (1) heads of x [n, H, D].
TensorRef half_heads(const TensorRef& x, int half) {
  TensorRef v = x.slice(1, half, x.size(1));
  v.shape[1] = x.size(1) / 2;
  v.stride[1] *= 2;
  return v;
}

// Rows (request r, position p) of whole contiguous sequences kv [N, ...] selected by `take`,
// written into a paged cache (reshape_and_cache).
template <class Take>
void write_rows(const Paged& pg, const TensorRef& k, const TensorRef& v, const TensorRef& kc, const TensorRef& vc,
                Take take) {
  std::vector<int64_t> rows, slots;
  for (int64_t r = 0; r < pg.B(); ++r)
    for (int64_t p = 0; p < pg.seq_lens[size_t(r)]; ++p)
      if (take(r, p)) {
        rows.push_back(pg.cu_k[size_t(r)] + p);
        slots.push_back(pg.slot(r, p));
      }
  // Slot -1 for the rows not taken: every row of k/v goes through one call.
  HostTensor sm = HostTensor::zeros(DType::i64, {pg.N});
  for (int64_t i = 0; i < pg.N; ++i) *static_cast<int64_t*>(sm.ref.at(i)) = -1;
  for (size_t i = 0; i < rows.size(); ++i) *static_cast<int64_t*>(sm.ref.at(rows[i])) = slots[i];
  fs::CacheWriteParams w;
  w.key = k;
  w.value = v;
  w.key_cache = kc;
  w.value_cache = vc;
  w.slot_mapping = sm;
  fs::reshape_and_cache(w);
}

// ---------------------------------------------------------------- differential attention

struct DiffCaches {
  HostTensor k1, v1, k2, v2;
  be::DifferentialCache cache() const { return {{k1.ref, v1.ref, {}, {}, {}}, {k2.ref, v2.ref, {}, {}, {}}}; }
};

DiffCaches diff_caches(const Paged& pg, DType dt, int64_t Hk, int64_t D) {
  DiffCaches c;
  for (HostTensor* t : {&c.k1, &c.v1, &c.k2, &c.v2}) {
    *t = HostTensor::zeros(dt, {pg.num_blocks, pg.bs, Hk / 2, D});
    fstest::poison_storage(*t);
  }
  return c;
}

TEST(DifferentialAttention, LambdaFollowsTheFourVectors) {
  auto rng = fstest::make_rng(fstest::test_salt());
  be::DifferentialSpec s;
  s.base.num_heads = 4;
  s.base.num_kv_heads = 2;
  s.base.head_size = 16;
  s.lambda_init = 0.3f;
  HostTensor q1 = random(DType::f32, {16}, rng, -0.3f, 0.3f), k1 = random(DType::f32, {16}, rng, -0.3f, 0.3f),
             q2 = random(DType::f32, {16}, rng, -0.3f, 0.3f), k2 = random(DType::f32, {16}, rng, -0.3f, 0.3f),
             w = random(DType::f32, {32}, rng);
  s.lambda_q1 = q1;
  s.lambda_k1 = k1;
  s.lambda_q2 = q2;
  s.lambda_k2 = k2;
  s.subln_weight = w;
  double d1 = 0, d2 = 0;
  for (int64_t i = 0; i < 16; ++i) {
    d1 += q1.getd({i}) * k1.getd({i});
    d2 += q2.getd({i}) * k2.getd({i});
  }
  EXPECT_NEAR(be::DifferentialAttentionLayer(s).lambda_full(), std::exp(d1) - std::exp(d2) + 0.3, 1e-5);
  s.subln_weight = q1;  // [D] instead of [2D]
  EXPECT_THROW(be::DifferentialAttentionLayer{s}, fs::Error);
}

TEST(DifferentialAttention, MatchesTheFormulaOverWholeSequences) {
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(fs::dtype_name(dt));
    auto rng = fstest::make_rng(fstest::test_salt() + int(dt));
    const int64_t H = 8, Hk = 4, D = 32;
    const Paged pg = make_paged({1, 1, 9, 20}, {30, 1, 9, 64}, 16, rng);
    const HostTensor kf = random(dt, {pg.N, Hk, D}, rng), vf = random(dt, {pg.N, Hk, D}, rng);
    const HostTensor q = random(dt, {pg.T, H, D}, rng);
    HostTensor key = HostTensor::zeros(dt, {pg.T, Hk, D}), value = HostTensor::zeros(dt, {pg.T, Hk, D});
    HostTensor slots = HostTensor::zeros(DType::i64, {pg.T});
    const size_t row = size_t(Hk * D) * fs::dtype_size(dt);
    for (int64_t r = 0; r < pg.B(); ++r)
      for (int64_t i = 0; i < pg.q_lens[size_t(r)]; ++i) {
        const int64_t t = pg.qsl[size_t(r)] + i, pos = pg.seq_lens[size_t(r)] - pg.q_lens[size_t(r)] + i;
        std::memcpy(key.ref.at(t, 0, 0), kf.ref.at(pg.cu_k[size_t(r)] + pos, 0, 0), row);
        std::memcpy(value.ref.at(t, 0, 0), vf.ref.at(pg.cu_k[size_t(r)] + pos, 0, 0), row);
        *static_cast<int64_t*>(slots.ref.at(t)) = pg.slot(r, pos);
      }
    const auto context = [&](int64_t r, int64_t p) { return p < pg.seq_lens[size_t(r)] - pg.q_lens[size_t(r)]; };
    const auto every = [](int64_t, int64_t) { return true; };
    DiffCaches caches = diff_caches(pg, dt, Hk, D), direct = diff_caches(pg, dt, Hk, D);
    for (int h = 0; h < 2; ++h) {
      const DiffCaches& c = caches;
      write_rows(pg, half_heads(kf, h), half_heads(vf, h), (h ? c.k2 : c.k1).ref, (h ? c.v2 : c.v1).ref, context);
      write_rows(pg, half_heads(kf, h), half_heads(vf, h), (h ? direct.k2 : direct.k1).ref,
                 (h ? direct.v2 : direct.v1).ref, every);
    }

    be::DifferentialSpec s;
    s.base.num_heads = H;
    s.base.num_kv_heads = Hk;
    s.base.head_size = D;
    s.base.dtype = dt;
    s.lambda_init = 0.8f;
    const HostTensor lq1 = random(DType::f32, {D}, rng, -0.1f, 0.1f), lk1 = random(DType::f32, {D}, rng, -0.1f, 0.1f),
                     lq2 = random(DType::f32, {D}, rng, -0.1f, 0.1f), lk2 = random(DType::f32, {D}, rng, -0.1f, 0.1f),
                     w = random(DType::f32, {2 * D}, rng, 0.5f, 1.5f);
    s.lambda_q1 = lq1;
    s.lambda_k1 = lk1;
    s.lambda_q2 = lq2;
    s.lambda_k2 = lk2;
    s.subln_weight = w;
    const be::DifferentialAttentionLayer layer(s);
    be::BuilderConfig cfg;
    cfg.layer = s.base;
    cfg.block_size = pg.bs;
    cfg.max_num_tokens = 256;
    cfg.device = fs::DeviceProps::cpu();
    be::MetadataBuilder mb(cfg);
    be::CommonMetadata cm;
    cm.num_reqs = pg.B();
    cm.num_actual_tokens = pg.T;
    cm.max_query_len = pg.max_q();
    cm.max_seq_len = pg.max_k();
    cm.query_start_loc = pg.qsl;
    cm.seq_lens = pg.seq_lens;
    cm.block_table = pg.table;
    cm.slot_mapping = slots;
    const be::AttentionMetadata& md = mb.build(cm);
    std::vector<unsigned char> ws(layer.workspace_bytes(cfg));
    HostTensor out = HostTensor::zeros(dt, {pg.T, H, D});
    fstest::poison_storage(out);
    layer.forward(md, q.ref, key.ref, value.ref, caches.cache(), out, be::LayerWorkspace{ws.data(), ws.size()});
    for (auto [got, want] : {std::pair{&caches.k1, &direct.k1}, std::pair{&caches.v1, &direct.v1},
                             std::pair{&caches.k2, &direct.k2}, std::pair{&caches.v2, &direct.v2}})
      EXPECT_TRUE(fstest::same_bytes(*got, fstest::snapshot(*want))) << "a half cache differs from a direct write";

    // a[qh][vh] = attn(q_qh, k_qh, v_vh) over whole sequences; out = RMSNorm(a1 - λ a2) (1 - λ_init).
    HostTensor a[2][2];
    for (int qh = 0; qh < 2; ++qh)
      for (int vh = 0; vh < 2; ++vh) {
        a[qh][vh] = HostTensor::zeros(dt, {pg.T, H / 2, D});
        fs::AttentionParams p;
        p.q = half_heads(q, qh);
        p.k = half_heads(kf, qh);
        p.v = half_heads(vf, vh);
        p.out = a[qh][vh];
        p.cu_seqlens_q = pg.cu_q.ref;
        p.cu_seqlens_k = pg.cu_kv.ref;
        p.max_seqlen_q = pg.max_q();
        p.max_seqlen_k = pg.max_k();
        p.causal = true;
        p.num_splits = 1;
        fs::varlen_attention(p);
      }
    const double lambda = layer.lambda_full();
    HostTensor ref = HostTensor::zeros(DType::f64, {pg.T, H, D});
    for (int64_t t = 0; t < pg.T; ++t)
      for (int64_t h = 0; h < H / 2; ++h) {
        std::vector<double> x(size_t(2 * D));
        double ss = 0;
        for (int64_t c = 0; c < 2 * D; ++c) {
          x[size_t(c)] = a[0][c / D].getd({t, h, c % D}) - lambda * a[1][c / D].getd({t, h, c % D});
          ss += x[size_t(c)] * x[size_t(c)];
        }
        const double r = 1.0 / std::sqrt(ss / double(2 * D) + s.rms_eps);
        for (int64_t c = 0; c < 2 * D; ++c)
          ref.set({t, 2 * h + c / D, c % D}, float(x[size_t(c)] * r * w.getd({c}) * (1.0 - s.lambda_init)));
      }
    fstest::expect_rows_close(out, ref, out.ref.size(0), dt == DType::f32 ? 1e-4 : 4e-2, 1e-3);
  }
}

// ---------------------------------------------------------------- MLA

TEST(Mla, PrefillMergesContextChunksWithTheCausalNewTokens) {
  const int64_t H = 4, Dq = 192, Dv = 128;
  const std::vector<int32_t> ctx{0, 40, 7, 100}, fresh{5, 1, 12, 30};
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const std::vector<int64_t>& cuts :
         {std::vector<int64_t>{}, std::vector<int64_t>{0}, std::vector<int64_t>{0, 16, 64}}) {
      SCOPED_TRACE(std::string(fs::dtype_name(dt)) + " chunks " + std::to_string(cuts.size()));
      auto rng = fstest::make_rng(fstest::test_salt() + int(dt) * 8 + cuts.size());
      std::vector<int32_t> seq(4);
      for (size_t r = 0; r < 4; ++r) seq[r] = ctx[r] + fresh[r];
      const Paged pg = make_paged(fresh, seq, 16, rng);
      const HostTensor kf = random(dt, {pg.N, H, Dq}, rng), vf = random(dt, {pg.N, H, Dv}, rng);
      const HostTensor q = random(dt, {pg.T, H, Dq}, rng);
      HostTensor k = HostTensor::zeros(dt, {pg.T, H, Dq}), v = HostTensor::zeros(dt, {pg.T, H, Dv});
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t i = 0; i < fresh[size_t(r)]; ++i) {
          const int64_t src = pg.cu_k[size_t(r)] + ctx[size_t(r)] + i, dst = pg.qsl[size_t(r)] + i;
          std::memcpy(k.ref.at(dst, 0, 0), kf.ref.at(src, 0, 0), size_t(H * Dq) * fs::dtype_size(dt));
          std::memcpy(v.ref.at(dst, 0, 0), vf.ref.at(src, 0, 0), size_t(H * Dv) * fs::dtype_size(dt));
        }
      // Chunk c holds context tokens [cuts[c], cuts[c + 1]) of every request.
      std::vector<HostTensor> store;
      std::vector<be::MlaContextChunk> chunks;
      for (size_t c = 0; c < cuts.size(); ++c) {
        const int64_t lo = cuts[c], hi = c + 1 < cuts.size() ? cuts[c + 1] : INT32_MAX;
        std::vector<int64_t> rows;
        HostTensor cu = HostTensor::zeros(DType::i32, {5});
        int64_t max_len = 0;
        for (int64_t r = 0; r < 4; ++r) {
          const int64_t a = std::min<int64_t>(lo, ctx[size_t(r)]), e = std::min<int64_t>(hi, ctx[size_t(r)]);
          for (int64_t p = a; p < e; ++p) rows.push_back(pg.cu_k[size_t(r)] + p);
          cu.set({r + 1}, float(rows.size()));
          max_len = std::max(max_len, e - a);
        }
        const int64_t n = std::max<int64_t>(1, int64_t(rows.size()));
        HostTensor ck = HostTensor::zeros(dt, {n, H, Dq}), cv = HostTensor::zeros(dt, {n, H, Dv});
        for (size_t i = 0; i < rows.size(); ++i) {
          std::memcpy(ck.ref.at(int64_t(i), 0, 0), kf.ref.at(rows[i], 0, 0), size_t(H * Dq) * fs::dtype_size(dt));
          std::memcpy(cv.ref.at(int64_t(i), 0, 0), vf.ref.at(rows[i], 0, 0), size_t(H * Dv) * fs::dtype_size(dt));
        }
        chunks.push_back({ck.ref, cv.ref, cu.ref, max_len});
        store.insert(store.end(), {ck, cv, cu});
      }
      be::MlaSpec spec;
      spec.num_heads = H;
      spec.dtype = dt;
      const be::MlaLayer layer(spec);
      be::BuilderConfig cfg;
      cfg.max_num_tokens = 64;
      std::vector<unsigned char> ws(layer.workspace_bytes(cfg));
      HostTensor out = HostTensor::zeros(dt, {pg.T, H, Dv}), ref = HostTensor::zeros(dt, {pg.T, H, Dv});
      fstest::poison_storage(out);
      layer.prefill(pg.part(), q, k, v, chunks, out, be::LayerWorkspace{ws.data(), ws.size()});

      fs::AttentionParams p;  // [context | new] per request (no context: the new tokens), bottom-right causal
      const bool none = cuts.empty();
      p.q = q;
      p.k = none ? k : kf;
      p.v = none ? v : vf;
      p.out = ref;
      p.cu_seqlens_q = pg.cu_q.ref;
      p.cu_seqlens_k = none ? pg.cu_q.ref : pg.cu_kv.ref;
      p.max_seqlen_q = pg.max_q();
      p.max_seqlen_k = none ? pg.max_q() : pg.max_k();
      p.causal = true;
      p.num_splits = 1;
      fs::varlen_attention(p);
      fstest::expect_rows_close(out, ref, out.ref.size(0), dt == DType::f32 ? 2e-5 : 2e-2, 1e-3);
    }
  }
}

// Latent rows of every request's whole sequence: kv_c [N, 1, 512] and k_pe [N, 1, 64].
void gather_latent(const Paged& pg, const HostTensor& latent, const HostTensor& kv_c, const HostTensor& k_pe) {
  const size_t es = fs::dtype_size(latent.ref.dtype);
  for (int64_t r = 0; r < pg.B(); ++r)
    for (int64_t p = 0; p < pg.seq_lens[size_t(r)]; ++p) {
      const int64_t s = pg.slot(r, p), n = pg.cu_k[size_t(r)] + p;
      std::memcpy(kv_c.ref.at(n, 0, 0), latent.ref.at(s / pg.bs, s % pg.bs, 0), 512 * es);
      std::memcpy(k_pe.ref.at(n, 0, 0), latent.ref.at(s / pg.bs, s % pg.bs, 512), 64 * es);
    }
}

TEST(Mla, AbsorbedDecodeMatchesAttentionWithQv) {
  const int64_t H = 8;
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const int32_t q_len : {1, 3}) {
      SCOPED_TRACE(std::string(fs::dtype_name(dt)) + " q_len " + std::to_string(q_len));
      auto rng = fstest::make_rng(fstest::test_salt() + int(dt) * 4 + q_len);
      const Paged pg = make_paged({q_len, q_len, q_len, q_len}, {33, q_len, 70, 16}, 16, rng);
      const HostTensor latent = random(dt, {pg.num_blocks, pg.bs, 576}, rng);
      const HostTensor q_pe = random(dt, {pg.T, H, 64}, rng), q_nope = random(dt, {pg.T, H, 512}, rng);
      HostTensor out = HostTensor::zeros(dt, {pg.T, H, 512}), ref = HostTensor::zeros(dt, {pg.T, H, 512});
      be::MlaSpec spec;
      spec.num_heads = H;
      spec.dtype = dt;
      fstest::poison_storage(out);
      be::MlaLayer(spec).decode(pg.part(), q_pe, q_nope, latent, out);

      const HostTensor kv_c = HostTensor::zeros(dt, {pg.N, 1, 512}), k_pe = HostTensor::zeros(dt, {pg.N, 1, 64});
      gather_latent(pg, latent, kv_c, k_pe);
      fs::AttentionParams p;
      p.q = q_pe;
      p.q_v = q_nope.ref;
      p.k = k_pe;
      p.v = kv_c;
      p.out = ref;
      p.cu_seqlens_q = pg.cu_q.ref;
      p.cu_seqlens_k = pg.cu_kv.ref;
      p.max_seqlen_q = q_len;
      p.max_seqlen_k = pg.max_k();
      p.causal = true;
      p.softmax_scale = float(1.0 / std::sqrt(192.0));
      p.num_splits = 1;
      fs::varlen_attention(p);
      fstest::expect_rows_close(out, ref, out.ref.size(0), dt == DType::f32 ? 2e-5 : 2e-2, 1e-3);
    }
  }
}

TEST(Mla, GatherContextCopiesTheLatentRowsOfARange) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const Paged pg = make_paged({3, 1, 8, 2}, {40, 1, 20, 70}, 16, rng);  // contexts 37, 0, 12, 68
  const HostTensor latent = random(DType::bf16, {pg.num_blocks, pg.bs, 576}, rng);
  be::MlaSpec spec;
  spec.num_heads = 4;
  const be::MlaLayer layer(spec);
  for (const auto [begin, end] : {std::pair<int64_t, int64_t>{0, 16}, {16, 64}, {30, 100}, {0, 1000}}) {
    SCOPED_TRACE(std::to_string(begin) + ".." + std::to_string(end));
    HostTensor dst = HostTensor::zeros(DType::bf16, {200, 576}), cu = HostTensor::zeros(DType::i32, {5});
    fstest::poison_storage(cu);
    layer.gather_context(pg.part(), latent, begin, end, dst, cu);
    int64_t row = 0;
    for (int64_t r = 0; r < 4; ++r) {
      EXPECT_EQ(cu.get({r}), float(row));
      const int64_t c = pg.seq_lens[size_t(r)] - pg.q_lens[size_t(r)];
      for (int64_t t = std::min(begin, c); t < std::min(end, c); ++t, ++row) {
        const int64_t s = pg.slot(r, t);
        ASSERT_EQ(std::memcmp(dst.ref.at(row, 0), latent.ref.at(s / pg.bs, s % pg.bs, 0), 576 * 2), 0)
            << "request " << r << " token " << t;
      }
    }
    EXPECT_EQ(cu.get({4}), float(row));
  }
  HostTensor small = HostTensor::zeros(DType::bf16, {10, 576}), cu = HostTensor::zeros(DType::i32, {5});
  EXPECT_THROW(layer.gather_context(pg.part(), latent, 0, 100, small, cu), fs::Error);
}

}  // namespace
