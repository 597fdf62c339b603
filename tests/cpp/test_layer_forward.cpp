// AttentionLayer::forward (SPEC.md §6) against direct computations: every path the metadata
// can select (decode + prefill parts, cascade, chunked local, tree verify, encoder, encoder-only,
// cross-attention) and every cache format (auto, fp8 e4m3, int8 K8V8 / K8V16) must give what
// one varlen_attention call over the whole batch gives, and the cache must end up byte-identical
// to one filled directly with reshape_and_cache (or untouched, for a layer sharing its cache).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "flashserve/backend.hpp"
#include "flashserve/status.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::KvCacheDType;
using fs::TensorRef;
using fstest::HostTensor;

constexpr int64_t kMaxTokens = 1024;

// ---------------------------------------------------------------- a batch over a paged cache

struct Scenario {
  be::LayerSpec spec;
  int64_t block_size = 16;
  std::vector<int32_t> q_lens, seq_lens;  // decode requests first; seq_len includes the new tokens
  int64_t prefix = 0;                     // tokens shared by every request (whole blocks, same ids)
  bool fp8_as_u8 = false;                 // fp8 caches typed uint8

  int64_t H() const { return spec.num_heads; }
  int64_t H_kv() const { return spec.num_kv_heads; }
  int64_t D() const { return spec.head_size; }
  int64_t B() const { return int64_t(q_lens.size()); }
};

be::LayerSpec make_spec(int64_t H, int64_t H_kv, int64_t D, DType dtype = DType::f32) {
  be::LayerSpec s;
  s.num_heads = H;
  s.num_kv_heads = H_kv;
  s.head_size = D;
  s.dtype = dtype;
  return s;
}

struct Built {
  int64_t T = 0, num_blocks = 0, width = 0;
  std::vector<int32_t> qsl;                  // [B + 1]
  std::vector<std::vector<int32_t>> blocks;  // per request, its block ids
  std::vector<HostTensor> seq_k, seq_v;      // per request, every position [seq_len, H_kv, D]
  HostTensor q, key, value, out, out_ref;    // q/out [T, H, D]; key/value [T, H_kv, D]: new tokens
  HostTensor kc, vc, ksc;                    // the cache forward writes (context pre-filled)
  HostTensor kc_ref, vc_ref, ksc_ref;        // every token written directly
  HostTensor k_scale, v_scale;
  HostTensor table, slots, cu_q, seqused;

  be::KvCache cache(bool ref = false) const {
    be::KvCache c{.key_cache = (ref ? kc_ref : kc).ref, .value_cache = (ref ? vc_ref : vc).ref};
    if (k_scale.bytes) c.k_scale = k_scale.ref;
    if (v_scale.bytes) c.v_scale = v_scale.ref;
    if (ksc.bytes) c.k_scale_cache = (ref ? ksc_ref : ksc).ref;
    return c;
  }
};

int64_t slot_of(const Scenario& sc, const Built& b, int64_t r, int64_t pos) {
  return int64_t(b.blocks[size_t(r)][size_t(pos / sc.block_size)]) * sc.block_size + pos % sc.block_size;
}

bool is_fp8(KvCacheDType t) { return t == KvCacheDType::fp8_e4m3 || t == KvCacheDType::fp8_e5m2; }
bool is_int8(KvCacheDType t) { return t == KvCacheDType::int8_k8v8 || t == KvCacheDType::int8_k8v16; }

HostTensor make_cache(const Scenario& sc, int64_t nb, DType dtype) {
  const int64_t bs = sc.block_size, Hk = sc.H_kv(), D = sc.D();
  HostTensor t = sc.spec.kv_layout == fs::KvLayout::nhd ? HostTensor::zeros(dtype, {nb, bs, Hk, D})
                                                        : HostTensor::zeros(dtype, {nb, Hk, bs, D});
  fstest::poison_storage(t);
  return t;
}

// Writes the positions of each request selected by `take(r, pos)` into the given caches
// (slot -1 for the others; the shared prefix through request 0 only).
template <class Take>
void write_positions(const Scenario& sc, const Built& b, const HostTensor& kc, const HostTensor& vc,
                     const HostTensor* ksc, Take take) {
  const KvCacheDType cd = sc.spec.kv_cache_dtype;
  for (int64_t r = 0; r < sc.B(); ++r) {
    const int64_t n = sc.seq_lens[size_t(r)];
    HostTensor s = HostTensor::zeros(DType::i64, {n});
    for (int64_t pos = 0; pos < n; ++pos)
      *static_cast<int64_t*>(s.ref.at(pos)) = take(r, pos) && (r == 0 || pos >= sc.prefix) ? slot_of(sc, b, r, pos) : -1;
    fs::CacheWriteParams w;
    w.key = b.seq_k[size_t(r)];
    w.value = b.seq_v[size_t(r)];
    w.key_cache = kc;
    w.value_cache = vc;
    w.layout = sc.spec.kv_layout;
    w.slot_mapping = s;
    w.cache_dtype = cd;
    if (is_fp8(cd) || cd == KvCacheDType::int8_k8v8) w.v_scale = b.v_scale.ref;
    if (is_fp8(cd)) w.k_scale = b.k_scale.ref;
    if (is_int8(cd)) w.k_scale_cache = ksc->ref;
    fs::reshape_and_cache(w);
  }
}

void make_caches(const Scenario& sc, Built& b, std::mt19937_64& rng) {
  const KvCacheDType cd = sc.spec.kv_cache_dtype;
  DType kt = sc.spec.dtype, vt = sc.spec.dtype;
  if (is_fp8(cd)) kt = vt = sc.fp8_as_u8 ? DType::u8 : (cd == KvCacheDType::fp8_e4m3 ? DType::f8e4m3 : DType::f8e5m2);
  if (is_int8(cd)) kt = DType::i8;
  if (cd == KvCacheDType::int8_k8v8) vt = DType::i8;
  b.kc = make_cache(sc, b.num_blocks, kt);
  b.vc = make_cache(sc, b.num_blocks, vt);
  b.kc_ref = make_cache(sc, b.num_blocks, kt);
  b.vc_ref = make_cache(sc, b.num_blocks, vt);
  if (is_fp8(cd)) {
    b.k_scale = HostTensor::zeros(DType::f32, {sc.H_kv()});
    b.v_scale = HostTensor::zeros(DType::f32, {});
    fstest::fill_uniform(b.k_scale, rng, 0.004f, 0.006f);
    fstest::fill_uniform(b.v_scale, rng, 0.004f, 0.006f);
  }
  if (is_int8(cd)) {
    b.ksc = HostTensor::zeros(DType::f32, {b.num_blocks, sc.H_kv(), sc.block_size});
    b.ksc_ref = HostTensor::zeros(DType::f32, {b.num_blocks, sc.H_kv(), sc.block_size});
    fstest::poison_storage(b.ksc);
    fstest::poison_storage(b.ksc_ref);
  }
  if (cd == KvCacheDType::int8_k8v8) {
    b.v_scale = HostTensor::zeros(DType::f32, {sc.H_kv(), sc.D()});
    fstest::fill_uniform(b.v_scale, rng, 1.0f / 127.0f, 1.2f / 127.0f);
  }
}

Built build(const Scenario& sc, std::mt19937_64& rng) {
  Built b;
  const int64_t B = sc.B(), bs = sc.block_size, Hk = sc.H_kv(), D = sc.D();
  b.qsl.assign(size_t(B) + 1, 0);
  for (int64_t r = 0; r < B; ++r) b.qsl[size_t(r) + 1] = b.qsl[size_t(r)] + sc.q_lens[size_t(r)];
  b.T = b.qsl.back();

  // Block ids: the shared prefix blocks, then each request's own, in a random order.
  const int64_t shared = sc.prefix / bs;
  int64_t total = shared;
  for (int32_t s : sc.seq_lens) total += (s + bs - 1) / bs - shared;
  b.num_blocks = total + 3;
  std::vector<int32_t> ids(size_t(b.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = size_t(shared);
  for (int64_t r = 0; r < B; ++r) {
    std::vector<int32_t> row(ids.begin(), ids.begin() + shared);
    for (int64_t j = shared; j < (sc.seq_lens[size_t(r)] + bs - 1) / bs; ++j) row.push_back(ids[next++]);
    b.width = std::max<int64_t>(b.width, int64_t(row.size()));
    b.blocks.push_back(row);
  }
  b.width += 2;
  b.table = HostTensor::zeros(DType::i32, {B, b.width});
  b.cu_q = HostTensor::zeros(DType::i32, {B + 1});
  b.seqused = HostTensor::zeros(DType::i32, {B});
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t j = 0; j < b.width; ++j)
      b.table.set({r, j}, float(j < int64_t(b.blocks[size_t(r)].size()) ? b.blocks[size_t(r)][size_t(j)] : 0));
    b.seqused.set({r}, float(sc.seq_lens[size_t(r)]));
  }
  for (int64_t r = 0; r <= B; ++r) b.cu_q.set({r}, float(b.qsl[size_t(r)]));

  // Every position's K/V (the prefix copied from request 0), the new tokens, q.
  for (int64_t r = 0; r < B; ++r) {
    const int64_t n = sc.seq_lens[size_t(r)];
    b.seq_k.push_back(HostTensor::zeros(sc.spec.dtype, {n, Hk, D}));
    b.seq_v.push_back(HostTensor::zeros(sc.spec.dtype, {n, Hk, D}));
    fstest::fill_uniform(b.seq_k.back(), rng, -1.0f, 1.0f);
    fstest::fill_uniform(b.seq_v.back(), rng, -1.0f, 1.0f);
    const size_t row = size_t(Hk * D) * fs::dtype_size(sc.spec.dtype);
    if (r > 0 && sc.prefix > 0) {
      std::memcpy(b.seq_k.back().ref.data, b.seq_k[0].ref.data, size_t(sc.prefix) * row);
      std::memcpy(b.seq_v.back().ref.data, b.seq_v[0].ref.data, size_t(sc.prefix) * row);
    }
  }
  b.q = HostTensor::zeros(sc.spec.dtype, {b.T, sc.H(), D});
  fstest::fill_uniform(b.q, rng, -1.0f, 1.0f);
  b.key = HostTensor::zeros(sc.spec.dtype, {b.T, Hk, D});
  b.value = HostTensor::zeros(sc.spec.dtype, {b.T, Hk, D});
  b.slots = HostTensor::zeros(DType::i64, {b.T});
  const size_t row = size_t(Hk * D) * fs::dtype_size(sc.spec.dtype);
  for (int64_t r = 0; r < B; ++r) {
    const int64_t q = sc.q_lens[size_t(r)], first = sc.seq_lens[size_t(r)] - q;
    for (int64_t i = 0; i < q; ++i) {
      const int64_t t = b.qsl[size_t(r)] + i;
      std::memcpy(b.key.ref.at(t, 0, 0), b.seq_k[size_t(r)].ref.at(first + i, 0, 0), row);
      std::memcpy(b.value.ref.at(t, 0, 0), b.seq_v[size_t(r)].ref.at(first + i, 0, 0), row);
      *static_cast<int64_t*>(b.slots.ref.at(t)) = slot_of(sc, b, r, first + i);
    }
  }
  b.out = HostTensor::zeros(sc.spec.dtype, {b.T, sc.H(), D});
  b.out_ref = HostTensor::zeros(sc.spec.dtype, {b.T, sc.H(), D});

  make_caches(sc, b, rng);
  const auto context = [&](int64_t r, int64_t pos) { return pos < sc.seq_lens[size_t(r)] - sc.q_lens[size_t(r)]; };
  write_positions(sc, b, b.kc, b.vc, &b.ksc, context);
  write_positions(sc, b, b.kc_ref, b.vc_ref, &b.ksc_ref, [](int64_t, int64_t) { return true; });
  return b;
}

be::BuilderConfig config_of(const Scenario& sc) {
  be::BuilderConfig c;
  c.layer = sc.spec;
  c.block_size = sc.block_size;
  c.device = fs::DeviceProps::cpu();
  c.max_num_reqs = 64;
  c.max_num_tokens = kMaxTokens;
  c.max_blocks_per_req = 256;
  return c;
}

be::CommonMetadata common_of(const Scenario& sc, const Built& b) {
  be::CommonMetadata cm;
  cm.num_reqs = sc.B();
  cm.num_actual_tokens = b.T;
  cm.max_query_len = *std::max_element(sc.q_lens.begin(), sc.q_lens.end());
  cm.max_seq_len = *std::max_element(sc.seq_lens.begin(), sc.seq_lens.end());
  cm.query_start_loc = b.qsl;
  cm.seq_lens = sc.seq_lens;
  cm.block_table = b.table;
  cm.slot_mapping = b.slots;
  return cm;
}

// The forward under test, with a workspace of exactly workspace_bytes(config).
void forward(const Scenario& sc, Built& b, const be::AttentionMetadata& md, bool ref_cache = false) {
  const be::AttentionLayer layer(sc.spec);
  std::vector<unsigned char> ws(layer.workspace_bytes(config_of(sc)));
  fstest::poison_storage(b.out);
  const be::KvCache cache = b.cache(ref_cache);
  layer.forward(md, b.q.ref, b.key.ref, b.value.ref, &cache, b.out, be::LayerWorkspace{ws.data(), ws.size()});
}

// The layer's modifiers on a direct call.
void add_modifiers(const be::LayerSpec& s, fs::AttentionParams& p) {
  p.softmax_scale = s.scale;
  p.softcap = s.softcap;
  p.alibi_slopes = s.alibi_slopes;
  p.alibi_sqrt = s.alibi_sqrt;
  p.s_aux = s.sinks;
  p.window = be::layer_window(s);
  p.num_splits = 1;
}

// One varlen call over the whole batch and the directly filled cache.
void direct_paged(const Scenario& sc, Built& b, int64_t chunk = 0) {
  fs::AttentionParams p;
  HostTensor q8, qs;
  p.q = b.q;
  if (is_int8(sc.spec.kv_cache_dtype)) {
    q8 = HostTensor::zeros(DType::i8, {b.T, sc.H(), sc.D()});
    qs = HostTensor::zeros(DType::f32, {b.T, sc.H()});
    fs::quantize_int8(b.q, q8, qs);
    p.q = q8;
    p.q_scale = qs.ref;
    p.k_scale_cache = b.ksc_ref.ref;
    if (sc.spec.kv_cache_dtype == KvCacheDType::int8_k8v8) p.v_scale = b.v_scale.ref;
  }
  p.out = b.out_ref;
  p.k = b.kc_ref;
  p.v = b.vc_ref;
  if (is_fp8(sc.spec.kv_cache_dtype)) {
    const DType f = sc.spec.kv_cache_dtype == KvCacheDType::fp8_e4m3 ? DType::f8e4m3 : DType::f8e5m2;
    p.k.dtype = p.v.dtype = f;
    p.k_descale = TensorRef::strided(b.k_scale.ref.data, DType::f32, {sc.B(), sc.H_kv()}, {0, 1});
    p.v_descale = TensorRef::strided(b.v_scale.ref.data, DType::f32, {sc.B(), sc.H_kv()}, {0, 0});
  }
  p.kv_layout = sc.spec.kv_layout;
  p.cu_seqlens_q = b.cu_q.ref;
  p.seqused_k = b.seqused.ref;
  p.block_table = b.table.ref;
  p.max_seqlen_q = *std::max_element(sc.q_lens.begin(), sc.q_lens.end());
  p.max_seqlen_k = *std::max_element(sc.seq_lens.begin(), sc.seq_lens.end());
  p.causal = true;
  p.chunk_size = chunk;
  add_modifiers(sc.spec, p);
  fstest::poison_storage(b.out_ref);
  fs::varlen_attention(p);
}

double atol_of(const be::LayerSpec& s) { return s.dtype == DType::f32 ? 2e-5 : 2e-2; }

// Forward writes the new tokens (the cache then equals the directly filled one) and gives the
// direct call's output.
void check_paged(const Scenario& sc, const be::AttentionMetadata& md, Built& b, int64_t chunk = 0) {
  forward(sc, b, md);
  direct_paged(sc, b, chunk);
  fstest::expect_rows_close(b.out, b.out_ref, b.T, atol_of(sc.spec), 1e-3);
  EXPECT_TRUE(fstest::same_bytes(b.kc, fstest::snapshot(b.kc_ref))) << "key cache differs from a direct write";
  EXPECT_TRUE(fstest::same_bytes(b.vc, fstest::snapshot(b.vc_ref))) << "value cache differs from a direct write";
  if (b.ksc.bytes) EXPECT_TRUE(fstest::same_bytes(b.ksc, fstest::snapshot(b.ksc_ref))) << "k_scale_cache differs";
}

Scenario mixed_batch(be::LayerSpec spec) {
  Scenario sc;
  sc.spec = spec;
  sc.q_lens = {1, 1, 1, 7, 33, 16};
  sc.seq_lens = {40, 1, 130, 7, 90, 200};
  return sc;
}

// ---------------------------------------------------------------- decode + prefill parts

TEST(LayerForward, DecodeAndPrefillPartsMatchOneCall) {
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
      SCOPED_TRACE(std::string(fs::dtype_name(dt)) + (layout == fs::KvLayout::nhd ? " NHD" : " HND"));
      auto rng = fstest::make_rng(fstest::test_salt() + int(dt) * 2 + int(layout));
      be::LayerSpec spec = make_spec(8, 2, 64, dt);
      spec.kv_layout = layout;
      const Scenario sc = mixed_batch(spec);
      Built b = build(sc, rng);
      be::MetadataBuilder mb(config_of(sc));
      const be::AttentionMetadata& md = mb.build(common_of(sc, b));
      ASSERT_EQ(md.num_decodes, 3);
      ASSERT_FALSE(md.decode.empty());
      ASSERT_FALSE(md.prefill.empty());
      check_paged(sc, md, b);
    }
  }
}

TEST(LayerForward, ModifiersReachEveryCall) {
  auto rng = fstest::make_rng(fstest::test_salt());
  HostTensor slopes = HostTensor::zeros(DType::f32, {4});
  HostTensor sinks = HostTensor::zeros(DType::f32, {4});
  fstest::fill_uniform(slopes, rng, 0.01f, 0.1f);
  fstest::fill_uniform(sinks, rng, -1.0f, 2.0f);
  for (int variant = 0; variant < 5; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    be::LayerSpec spec = make_spec(4, 4, 32);
    spec.scale = 0.3f;
    if (variant == 0) spec.softcap = 5.0f;
    if (variant == 1 || variant == 4) spec.alibi_slopes = slopes.ref;
    spec.alibi_sqrt = variant == 4;
    if (variant == 2) spec.sinks = sinks.ref;
    if (variant == 3) spec.sliding_window = 24;
    const Scenario sc = mixed_batch(spec);
    Built b = build(sc, rng);
    be::MetadataBuilder mb(config_of(sc));
    check_paged(sc, mb.build(common_of(sc, b)), b);
  }
}

TEST(LayerForward, QuantizedCachesMatchDirectCallsOnTheSameCache) {
  const struct {
    KvCacheDType dtype;
    bool as_u8;
  } cases[] = {{KvCacheDType::fp8_e4m3, false}, {KvCacheDType::fp8_e4m3, true}, {KvCacheDType::fp8_e5m2, false},
               {KvCacheDType::int8_k8v8, false}, {KvCacheDType::int8_k8v16, false}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(fs::kv_cache_dtype_name(c.dtype)) + (c.as_u8 ? " (uint8)" : ""));
    auto rng = fstest::make_rng(fstest::test_salt() + int(c.dtype) * 2 + c.as_u8);
    be::LayerSpec spec = make_spec(8, 2, 64, DType::bf16);
    spec.kv_cache_dtype = c.dtype;
    Scenario sc = mixed_batch(spec);
    sc.fp8_as_u8 = c.as_u8;
    Built b = build(sc, rng);
    be::MetadataBuilder mb(config_of(sc));
    check_paged(sc, mb.build(common_of(sc, b)), b);
  }
}

TEST(LayerForward, SharedCacheLayerLeavesTheCacheUntouched) {
  auto rng = fstest::make_rng(fstest::test_salt());
  be::LayerSpec spec = make_spec(8, 2, 64);
  spec.writes_kv_cache = false;
  const Scenario sc = mixed_batch(spec);
  Built b = build(sc, rng);
  be::MetadataBuilder mb(config_of(sc));
  const auto ksnap = fstest::snapshot(b.kc_ref), vsnap = fstest::snapshot(b.vc_ref);
  forward(sc, b, mb.build(common_of(sc, b)), /*ref_cache=*/true);
  EXPECT_TRUE(fstest::same_bytes(b.kc_ref, ksnap));
  EXPECT_TRUE(fstest::same_bytes(b.vc_ref, vsnap));
  HostTensor got = b.out;
  b.out = HostTensor::zeros(DType::f32, {b.T, 8, 64});
  direct_paged(sc, b);
  fstest::expect_rows_close(got, b.out_ref, b.T, 2e-5, 1e-3);
}

TEST(LayerForward, UpdateKvCacheThenANonWritingForward) {
  // vLLM's do_kv_cache_update split: update_kv_cache writes what forward would have written,
  // and a forward of a non-writing layer then reads it.
  for (const KvCacheDType dt : {KvCacheDType::auto_, KvCacheDType::fp8_e4m3, KvCacheDType::int8_k8v8}) {
    SCOPED_TRACE(fs::kv_cache_dtype_name(dt));
    auto rng = fstest::make_rng(fstest::test_salt() + int(dt));
    be::LayerSpec spec = make_spec(8, 2, 64, DType::bf16);
    spec.kv_cache_dtype = dt;
    spec.writes_kv_cache = false;
    const Scenario sc = mixed_batch(spec);
    Built b = build(sc, rng);
    be::MetadataBuilder mb(config_of(sc));
    const be::AttentionMetadata& md = mb.build(common_of(sc, b));
    const be::AttentionLayer layer(sc.spec);
    const auto before = fstest::snapshot(b.kc);
    forward(sc, b, md);
    EXPECT_TRUE(fstest::same_bytes(b.kc, before)) << "a non-writing forward wrote the cache";
    layer.update_kv_cache(b.key, b.value, b.cache(), b.slots);
    EXPECT_TRUE(fstest::same_bytes(b.kc, fstest::snapshot(b.kc_ref))) << "key cache differs from a direct write";
    EXPECT_TRUE(fstest::same_bytes(b.vc, fstest::snapshot(b.vc_ref))) << "value cache differs from a direct write";
    if (b.ksc.bytes) EXPECT_TRUE(fstest::same_bytes(b.ksc, fstest::snapshot(b.ksc_ref))) << "k_scale_cache differs";
    forward(sc, b, md);
    direct_paged(sc, b);
    fstest::expect_rows_close(b.out, b.out_ref, b.T, atol_of(sc.spec), 1e-3);
  }
}

TEST(LayerForward, BadQDescaleIsRejectedBeforeTheCacheWrite) {
  auto rng = fstest::make_rng(fstest::test_salt());
  be::LayerSpec spec = make_spec(8, 2, 64, DType::bf16);
  spec.kv_cache_dtype = KvCacheDType::fp8_e4m3;
  const Scenario sc = mixed_batch(spec);
  Built b = build(sc, rng);
  be::MetadataBuilder mb(config_of(sc));
  const be::AttentionMetadata& md = mb.build(common_of(sc, b));
  HostTensor bad = HostTensor::zeros(DType::f32, {3});
  be::KvCache cache = b.cache();
  cache.q_descale = bad.ref;
  const auto before = fstest::snapshot(b.kc);
  const be::AttentionLayer layer(sc.spec);
  std::vector<unsigned char> ws(layer.workspace_bytes(config_of(sc)));
  try {
    layer.forward(md, b.q.ref, b.key.ref, b.value.ref, &cache, b.out, be::LayerWorkspace{ws.data(), ws.size()});
    ADD_FAILURE() << "a [3] q_descale with H_kv = 2 was accepted";
  } catch (const fs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_descale"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fstest::same_bytes(b.kc, before));
}

// ---------------------------------------------------------------- cascade, local

Scenario prefix_batch(be::LayerSpec spec, bool all_decode) {
  Scenario sc;
  sc.spec = spec;
  sc.prefix = 272;  // 17 blocks
  for (int r = 0; r < 10; ++r) {
    const int32_t q = all_decode || r < 4 ? 1 : 3 + 5 * r;
    sc.q_lens.push_back(q);
    sc.seq_lens.push_back(int32_t(sc.prefix) + 5 + 13 * r + q);
  }
  return sc;
}

TEST(LayerForward, CascadeMatchesOneCall) {
  auto rng = fstest::make_rng(fstest::test_salt());
  HostTensor sinks = HostTensor::zeros(DType::f32, {8});
  fstest::fill_uniform(sinks, rng, 0.0f, 3.0f);
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    be::LayerSpec spec = make_spec(8, 2, 64);
    if (variant == 1) {
      spec.sinks = sinks.ref;
      spec.softcap = 8.0f;
    }
    if (variant == 2) spec.dtype = DType::bf16;
    const Scenario sc = prefix_batch(spec, variant == 0);
    Built b = build(sc, rng);
    be::MetadataBuilder mb(config_of(sc));
    const be::AttentionMetadata& md = mb.build(common_of(sc, b), sc.prefix + 7);
    ASSERT_TRUE(md.cascade.enabled);
    EXPECT_EQ(md.cascade.common_prefix_len, sc.prefix);
    check_paged(sc, md, b);
  }
}

TEST(LayerForward, WorkspaceOverflowNamesTheBuffer) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const Scenario sc = prefix_batch(make_spec(8, 2, 64), false);
  Built b = build(sc, rng);
  be::MetadataBuilder mb(config_of(sc));
  const be::AttentionMetadata& md = mb.build(common_of(sc, b), sc.prefix);
  ASSERT_TRUE(md.cascade.enabled);
  std::vector<unsigned char> ws(1000);
  const be::KvCache cache = b.cache();
  try {
    be::AttentionLayer(sc.spec).forward(md, b.q.ref, b.key.ref, b.value.ref, &cache, b.out,
                                        be::LayerWorkspace{ws.data(), ws.size()});
    FAIL() << "no error";
  } catch (const fs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("o_prefix"), std::string::npos) << e.what();
  }
}

TEST(LayerForward, ChunkedLocalMatchesOneCallWithChunks) {
  auto rng = fstest::make_rng(fstest::test_salt());
  be::LayerSpec spec = make_spec(8, 4, 64);
  spec.attention_chunk_size = 32;
  Scenario sc;
  sc.spec = spec;
  sc.q_lens = {1, 1, 4, 10, 45, 70};
  sc.seq_lens = {33, 64, 6, 77, 45, 150};
  Built b = build(sc, rng);
  be::MetadataBuilder mb(config_of(sc));
  const be::AttentionMetadata& md = mb.build(common_of(sc, b));
  ASSERT_TRUE(md.local.enabled);
  check_paged(sc, md, b, spec.attention_chunk_size);
}

// A direct varlen call over contiguous K/V with the modifiers of `p`, no split.
void direct_contiguous(fs::AttentionParams p, const TensorRef& q, const TensorRef& k, const TensorRef& v,
                       const TensorRef& out, const TensorRef& cu_q, const TensorRef& cu_k, int64_t max_q, int64_t max_k) {
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.max_seqlen_q = max_q;
  p.max_seqlen_k = max_k;
  p.num_splits = 1;
  fstest::poison(out);
  fs::varlen_attention(p);
}

// ---------------------------------------------------------------- tree verify

// Each query token against the committed KV and its ancestor drafts (itself included), one
// contiguous sequence per token.
void direct_tree(const Scenario& sc, Built& b, const std::vector<int32_t>& num_drafts,
                 const std::vector<int32_t>& parents) {
  const int64_t Hk = sc.H_kv(), D = sc.D();
  std::vector<std::pair<int64_t, int64_t>> kv_rows;  // (request, position) in order
  std::vector<int32_t> cu_k{0};
  for (int64_t r = 0, k0 = 0; r < sc.B(); ++r) {
    const int64_t nd = num_drafts[size_t(r)], committed = sc.seq_lens[size_t(r)] - nd;
    for (int64_t i = 0; i < sc.q_lens[size_t(r)]; ++i) {
      for (int64_t p = 0; p < committed; ++p) kv_rows.push_back({r, p});
      const int64_t d = i - (sc.q_lens[size_t(r)] - nd);  // draft index, < 0 for the tip
      std::vector<int64_t> path;
      for (int64_t u = d; u >= 0; u = parents[size_t(k0 + u)]) path.push_back(committed + u);
      for (auto it = path.rbegin(); it != path.rend(); ++it) kv_rows.push_back({r, *it});
      cu_k.push_back(int32_t(kv_rows.size()));
    }
    k0 += nd;
  }
  const int64_t n = int64_t(kv_rows.size()), es = int64_t(fs::dtype_size(sc.spec.dtype));
  HostTensor k = HostTensor::zeros(sc.spec.dtype, {n, Hk, D}), v = HostTensor::zeros(sc.spec.dtype, {n, Hk, D});
  for (int64_t i = 0; i < n; ++i) {
    const auto [r, pos] = kv_rows[size_t(i)];
    std::memcpy(k.ref.at(i, 0, 0), b.seq_k[size_t(r)].ref.at(pos, 0, 0), size_t(Hk * D * es));
    std::memcpy(v.ref.at(i, 0, 0), b.seq_v[size_t(r)].ref.at(pos, 0, 0), size_t(Hk * D * es));
  }
  HostTensor cu_q = HostTensor::zeros(DType::i32, {b.T + 1}), cuk = HostTensor::zeros(DType::i32, {b.T + 1});
  int64_t max_k = 0;
  for (int64_t t = 0; t <= b.T; ++t) {
    cu_q.set({t}, float(t));
    cuk.set({t}, float(cu_k[size_t(t)]));
    if (t > 0) max_k = std::max<int64_t>(max_k, cu_k[size_t(t)] - cu_k[size_t(t) - 1]);
  }
  fs::AttentionParams p;
  add_modifiers(sc.spec, p);
  direct_contiguous(p, b.q, k, v, b.out_ref, cu_q, cuk, 1, max_k);
}

TEST(LayerForward, TreeVerifyMatchesAttentionOverAncestors) {
  auto rng = fstest::make_rng(fstest::test_salt());
  HostTensor sinks = HostTensor::zeros(DType::f32, {8});
  fstest::fill_uniform(sinks, rng, -1.0f, 1.0f);
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    be::LayerSpec spec = make_spec(8, 2, 64);
    if (variant == 1) {
      spec.sinks = sinks.ref;
      spec.softcap = 4.0f;
    }
    Scenario sc;
    sc.spec = spec;
    sc.block_size = variant == 0 ? 16 : 1;
    // Request 0: the tip and 4 drafts; 1: 3 drafts, no tip; 2: the tip and 6 drafts.
    const std::vector<int32_t> num_drafts{4, 3, 6};
    const std::vector<int32_t> parents{-1, 0, 0, 1, -1, -1, 1, -1, 0, 1, 2, 0, 4};
    sc.q_lens = {5, 3, 7};
    sc.seq_lens = {40, 23, 70};
    Built b = build(sc, rng);
    be::BuilderConfig cfg = config_of(sc);
    be::MetadataBuilder mb(cfg);
    const be::DraftTree tree{parents, num_drafts};
    const be::AttentionMetadata& md = mb.build(common_of(sc, b), 0, &tree);
    ASSERT_TRUE(md.tree.enabled);
    forward(sc, b, md);
    EXPECT_TRUE(fstest::same_bytes(b.kc, fstest::snapshot(b.kc_ref)));
    direct_tree(sc, b, num_drafts, parents);
    fstest::expect_rows_close(b.out, b.out_ref, b.T, 2e-5, 1e-3);
    sc.spec.kv_layout = fs::KvLayout::hnd;  // slots of an HND cache with 2 KV heads: no block-size-1 view
    Built h = build(sc, rng);
    const auto snap = fstest::snapshot(h.kc);
    EXPECT_THROW(forward(sc, h, md), fs::NotImplemented);
    EXPECT_TRUE(fstest::same_bytes(h.kc, snap)) << "a rejected call wrote the cache";
  }
}

// ---------------------------------------------------------------- encoders, cross-attention

TEST(LayerForward, EncoderLayersAttendNonCausallyWithoutACache) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const struct { be::AttnType type; int64_t window; } cases[] = {
      {be::AttnType::encoder, 0}, {be::AttnType::encoder_only, 0}, {be::AttnType::encoder_only, 9}};
  for (const auto& c : cases) {
    SCOPED_TRACE("type " + std::to_string(int(c.type)) + " window " + std::to_string(c.window));
    Scenario sc;  // whole sequences as new tokens: key/value are the encoder's K/V
    sc.spec = make_spec(8, 2, 64);
    sc.spec.type = c.type;
    sc.spec.sliding_window = c.window;
    sc.q_lens = sc.seq_lens = {5, 1, 40, 17};
    Built b = build(sc, rng);
    be::MetadataBuilder mb(config_of(sc));
    be::CommonMetadata cm = common_of(sc, b);
    cm.block_table = cm.slot_mapping = TensorRef{};
    cm.causal = false;
    const be::AttentionLayer layer(sc.spec);
    std::vector<unsigned char> ws(layer.workspace_bytes(mb.config()));
    fstest::poison_storage(b.out);
    layer.forward(mb.build(cm), b.q.ref, b.key.ref, b.value.ref, nullptr, b.out,
                  be::LayerWorkspace{ws.data(), ws.size()});
    fs::AttentionParams p;
    if (c.window > 0) p.window = fs::Window{int(c.window - 1), int(c.window - 1)};
    direct_contiguous(p, b.q, b.key, b.value, b.out_ref, b.cu_q, b.cu_q, 40, 40);
    fstest::expect_rows_close(b.out, b.out_ref, b.T, 2e-5, 1e-3);
  }
}

TEST(LayerForward, CrossAttentionFillsTheCacheOnceAndSeesEveryEncoderToken) {
  auto rng = fstest::make_rng(fstest::test_salt());
  be::LayerSpec spec = make_spec(8, 2, 64);
  spec.type = be::AttnType::encoder_decoder;
  Scenario enc;  // encoder outputs {30, 12, 50}: every token new; e.key/value, e.slots
  enc.spec = spec;
  enc.q_lens = enc.seq_lens = {30, 12, 50};
  Built e = build(enc, rng);
  Scenario dec;  // decoder queries {1, 1, 6}, decodes first
  dec.spec = spec;
  dec.q_lens = {1, 1, 6};
  dec.seq_lens = {4, 9, 6};
  Built d = build(dec, rng);

  be::MetadataBuilder mb(config_of(enc));
  be::CommonMetadata cm = common_of(dec, d);
  cm.encoder_seq_lens = enc.seq_lens;
  cm.block_table = e.table;
  cm.slot_mapping = e.slots;
  cm.causal = false;
  const be::AttentionMetadata& md = mb.build(cm);
  ASSERT_EQ(md.slot_mapping.size(0), e.slots.ref.size(0));  // every encoder token's slot

  const be::AttentionLayer layer(spec);
  std::vector<unsigned char> ws(layer.workspace_bytes(mb.config()));
  const be::KvCache cache = e.cache();
  for (int step = 0; step < 2; ++step) {  // step 0 writes the cache, step 1 only reads it
    fstest::poison_storage(d.out);
    layer.forward(md, d.q.ref, step == 0 ? fs::OptTensor(e.key.ref) : std::nullopt,
                  step == 0 ? fs::OptTensor(e.value.ref) : std::nullopt, &cache, d.out,
                  be::LayerWorkspace{ws.data(), ws.size()});
    EXPECT_TRUE(fstest::same_bytes(e.kc, fstest::snapshot(e.kc_ref)));
    EXPECT_TRUE(fstest::same_bytes(e.vc, fstest::snapshot(e.vc_ref)));
    fs::AttentionParams p;
    p.q = d.q;
    p.out = d.out_ref;
    p.k = e.kc_ref;
    p.v = e.vc_ref;
    p.cu_seqlens_q = d.cu_q.ref;
    p.seqused_k = e.seqused.ref;
    p.block_table = e.table.ref;
    p.max_seqlen_q = 6;
    p.max_seqlen_k = 50;
    p.num_splits = 1;
    fs::varlen_attention(p);
    fstest::expect_rows_close(d.out, d.out_ref, d.T, 2e-5, 1e-3);
  }
}

}  // namespace
