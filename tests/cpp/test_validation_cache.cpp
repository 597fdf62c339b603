// Bad inputs to the cache and merge calls (cache.hpp, merge.hpp; SPEC.md §7). Each case starts
// from a valid baseline (checked to run), changes one thing, and checks that the call throws
// flashserve::Error whose message starts with the argument's name (NotImplemented naming CUDA
// where documented) and that every byte of every tensor is unchanged.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "flashserve/cache.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/status.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
using fs::DType;
using fs::KvCacheDType;
using fs::TensorRef;
using fstest::HostTensor;

constexpr fs::Device kCuda{fs::DeviceType::cuda, 0};

enum class Expect { error, not_implemented };

// A bad case: what to change in a valid setup S, and the argument the error must name.
template <class S>
struct Bad {
  std::string label;
  std::string arg;  // empty for NotImplemented
  std::function<void(S&)> mutate;
  Expect expect = Expect::error;
};

// Runs `call` on the mutated setup and checks the rejection and that no byte changed.
template <class S>
void expect_rejected(const Bad<S>& bad, S& s, const std::function<void(S&)>& call) {
  SCOPED_TRACE(bad.label);
#if FLASHSERVE_WITH_CUDA
  // "Not implemented on CUDA" holds in CPU-only builds; CUDA builds run these ops on the device
  // (tests/gpu), and host memory labelled as CUDA would be handed to the kernels.
  if (bad.expect == Expect::not_implemented) return;
#endif
  bad.mutate(s);
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : s.all()) before.push_back(fstest::snapshot(*t));
  try {
    call(s);
    ADD_FAILURE() << "no exception";
  } catch (const fs::Error& e) {
    EXPECT_EQ(bad.expect, Expect::error) << "Error instead of NotImplemented: " << e.what();
    EXPECT_EQ(std::string(e.what()).rfind(bad.arg + ": expected ", 0), 0u) << "message: " << e.what();
  } catch (const fs::NotImplemented& e) {
    EXPECT_EQ(bad.expect, Expect::not_implemented) << "NotImplemented instead of Error: " << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(fstest::same_bytes(*s.all()[i], before[i])) << "tensor " << i << " changed";
}

HostTensor filled(DType t, std::initializer_list<int64_t> shape, float lo, float hi) {
  static auto rng = fstest::make_rng(0xbad);
  HostTensor h = HostTensor::zeros(t, shape);
  fstest::fill_uniform(h, rng, lo, hi);
  return h;
}
HostTensor ints(DType t, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> values) {
  HostTensor h = HostTensor::zeros(t, shape);
  int64_t i = 0;
  for (int64_t v : values) fs::numeric::store_float(static_cast<char*>(h.ref.data) + i++ * int64_t(fs::dtype_size(t)), t, float(v));
  return h;
}

// The reshape_and_cache params both write setups fill alike (scales are each setup's own).
fs::CacheWriteParams write_params(const HostTensor& key, const HostTensor& value, const HostTensor& kc,
                                  const HostTensor& vc, const HostTensor& slots, KvCacheDType mode) {
  fs::CacheWriteParams p;
  p.key = key;
  p.value = value;
  p.key_cache = kc;
  p.value_cache = vc;
  p.slot_mapping = slots;
  p.cache_dtype = mode;
  return p;
}

// ---- reshape_and_cache: T = 4 tokens, H_kv = 2, D = 8, 3 blocks of 4 slots, NHD.
struct WriteSetup {
  HostTensor key = filled(DType::f16, {5, 2, 8}, -2, 2), value = filled(DType::f16, {5, 2, 8}, -2, 2);
  HostTensor kc, vc;
  HostTensor slots = ints(DType::i64, {4}, {0, 5, -1, 11});
  HostTensor k_scale = filled(DType::f32, {2}, 0.5f, 1), v_scale = filled(DType::f32, {}, 0.5f, 1);
  HostTensor v_scale_i8 = filled(DType::f32, {2, 8}, 0.01f, 0.02f);
  HostTensor ksc = HostTensor::zeros(DType::f32, {3, 2, 4});
  fs::CacheWriteParams p;

  explicit WriteSetup(KvCacheDType mode) {
    const bool fp8 = mode == KvCacheDType::fp8_e4m3 || mode == KvCacheDType::fp8_e5m2;
    const bool int8 = mode == KvCacheDType::int8_k8v8 || mode == KvCacheDType::int8_k8v16;
    kc = HostTensor::zeros(fp8 ? DType::u8 : int8 ? DType::i8 : DType::f16, {3, 4, 2, 8});
    vc = HostTensor::zeros(fp8 ? DType::u8 : mode == KvCacheDType::int8_k8v8 ? DType::i8 : DType::f16, {3, 4, 2, 8});
    for (const HostTensor* t : {&kc, &vc, &ksc}) fstest::poison_storage(*t);
    p = write_params(key, value, kc, vc, slots, mode);
    if (fp8) p.k_scale = k_scale.ref, p.v_scale = v_scale.ref;
    if (mode == KvCacheDType::int8_k8v8) p.v_scale = v_scale_i8.ref;
    if (int8) p.k_scale_cache = ksc.ref;
  }
  std::vector<const HostTensor*> all() const { return {&key, &value, &kc, &vc, &slots, &k_scale, &v_scale, &v_scale_i8, &ksc}; }
};

TensorRef reranked(TensorRef t, int ndim) {
  t.ndim = ndim;
  return t;
}
TensorRef on_cuda(TensorRef t) {
  t.device = kCuda;
  return t;
}
TensorRef with_dtype(TensorRef t, DType d) {
  t.dtype = d;
  return t;
}

}  // namespace

TEST(ValidationCache, BaselinesRun) {
  for (KvCacheDType m : {KvCacheDType::auto_, KvCacheDType::fp8_e4m3, KvCacheDType::fp8_e5m2,
                         KvCacheDType::int8_k8v8, KvCacheDType::int8_k8v16}) {
    WriteSetup s(m);
    EXPECT_NO_THROW(fs::reshape_and_cache(s.p)) << fs::kv_cache_dtype_name(m);
  }
}

TEST(ValidationCache, ReshapeAndCache) {
  using K = KvCacheDType;
  using B = Bad<WriteSetup>;
  const std::vector<std::pair<K, B>> cases = {
      {K::auto_, {"key dtype", "key", [](WriteSetup& s) { s.p.key = with_dtype(s.key, DType::i32); }}},
      {K::auto_, {"key rank", "key", [](WriteSetup& s) { s.p.key = reranked(s.key, 2); }}},
      {K::auto_, {"key last dim strided", "key", [](WriteSetup& s) {
         s.p.key = TensorRef::strided(s.key.ref.data, DType::f16, {5, 2, 4}, {16, 8, 2}); }}},
      {K::auto_, {"value dtype differs", "value", [](WriteSetup& s) { s.p.value = with_dtype(s.value, DType::bf16); }}},
      {K::auto_, {"key fewer rows than slots", "key", [](WriteSetup& s) { s.p.key = s.key.ref.slice(0, 0, 3); }}},
      {K::auto_, {"value heads", "value", [](WriteSetup& s) { s.p.value = s.value.ref.slice(1, 0, 1); }}},
      {K::auto_, {"key_cache heads", "key_cache", [](WriteSetup& s) { s.p.key_cache = s.kc.ref.slice(2, 0, 1); }}},
      {K::auto_, {"key_cache rank", "key_cache", [](WriteSetup& s) { s.p.key_cache = s.kc.ref.unsqueeze(0); }}},
      {K::auto_, {"value_cache block size", "value_cache", [](WriteSetup& s) { s.p.value_cache = s.vc.ref.slice(1, 0, 2); }}},
      {K::auto_, {"hnd layout of an nhd cache", "key_cache", [](WriteSetup& s) { s.p.layout = fs::KvLayout::hnd; }}},
      {K::auto_, {"slot past the cache", "slot_mapping", [](WriteSetup& s) {
         *static_cast<int64_t*>(s.slots.ref.at(3)) = 12; }}},
      {K::auto_, {"slot_mapping int32", "slot_mapping", [](WriteSetup& s) { s.p.slot_mapping = with_dtype(s.slots, DType::i32); }}},
      {K::auto_, {"auto cache dtype differs from key", "key_cache", [](WriteSetup& s) { s.p.key_cache = with_dtype(s.kc, DType::bf16); }}},
      {K::fp8_e4m3, {"e5m2 cache for fp8_e4m3", "value_cache", [](WriteSetup& s) { s.p.value_cache = with_dtype(s.vc, DType::f8e5m2); }}},
      {K::fp8_e5m2, {"f16 cache for fp8", "key_cache", [](WriteSetup& s) { s.p.key_cache = with_dtype(s.kc, DType::f16); }}},
      {K::fp8_e4m3, {"k_scale shape [3]", "k_scale", [](WriteSetup& s) {
         s.p.k_scale = TensorRef::contiguous(s.k_scale.ref.data, DType::f32, {3}); }}},
      {K::fp8_e4m3, {"k_scale missing", "k_scale", [](WriteSetup& s) { s.p.k_scale.reset(); }}},
      {K::fp8_e5m2, {"v_scale float16", "v_scale", [](WriteSetup& s) { s.p.v_scale = with_dtype(s.v_scale, DType::f16); }}},
      {K::int8_k8v8, {"int8 without k_scale_cache", "k_scale_cache", [](WriteSetup& s) { s.p.k_scale_cache.reset(); }}},
      {K::int8_k8v16, {"k_scale_cache as [nb, bs, H]", "k_scale_cache", [](WriteSetup& s) {
         s.p.k_scale_cache = TensorRef::contiguous(s.ksc.ref.data, DType::f32, {3, 4, 2}); }}},
      {K::int8_k8v8, {"int8_k8v8 without v_scale", "v_scale", [](WriteSetup& s) { s.p.v_scale.reset(); }}},
      {K::int8_k8v8, {"v_scale shape [H_kv]", "v_scale", [](WriteSetup& s) { s.p.v_scale = s.k_scale.ref; }}},
      {K::int8_k8v16, {"uint8 key cache for int8", "key_cache", [](WriteSetup& s) { s.p.key_cache = with_dtype(s.kc, DType::u8); }}},
      {K::int8_k8v16, {"int8 value cache for k8v16", "value_cache", [](WriteSetup& s) { s.p.value_cache = with_dtype(s.vc, DType::i8); }}},
      {K::auto_, {"mixed devices", "value_cache", [](WriteSetup& s) { s.p.value_cache = on_cuda(s.vc); }}},
      {K::auto_, {"all on CUDA", "", [](WriteSetup& s) {
         for (TensorRef* t : {&s.p.key, &s.p.value, &s.p.key_cache, &s.p.value_cache, &s.p.slot_mapping}) t->device = kCuda;
       }, Expect::not_implemented}},
  };
  for (const auto& [mode, bad] : cases) {
    WriteSetup s(mode);
    expect_rejected<WriteSetup>(bad, s, [](WriteSetup& x) { fs::reshape_and_cache(x.p); });
  }
}

namespace {
// ---- reshape_and_cache with int8 rows given already quantized: T = 4, H_kv = 2, D = 8.
struct GivenSetup {
  HostTensor key = filled(DType::i8, {5, 2, 8}, -100, 100), value;
  HostTensor kc = HostTensor::zeros(DType::i8, {3, 4, 2, 8}), vc;
  HostTensor slots = ints(DType::i64, {4}, {0, 5, -1, 11});
  HostTensor key_scale = filled(DType::f32, {5, 2}, 0.01f, 0.1f);
  HostTensor ksc = HostTensor::zeros(DType::f32, {3, 2, 4});
  HostTensor v_scale = filled(DType::f32, {2, 8}, 0.01f, 0.02f);
  fs::CacheWriteParams p;

  explicit GivenSetup(KvCacheDType mode) {
    const bool k8v8 = mode == KvCacheDType::int8_k8v8;
    value = k8v8 ? filled(DType::i8, {5, 2, 8}, -100, 100) : filled(DType::bf16, {5, 2, 8}, -2, 2);
    vc = HostTensor::zeros(k8v8 ? DType::i8 : DType::bf16, {3, 4, 2, 8});
    for (const HostTensor* t : {&kc, &vc, &ksc}) fstest::poison_storage(*t);
    p = write_params(key, value, kc, vc, slots, mode);
    p.k_scale_cache = ksc.ref;
    p.key_scale = key_scale.ref;
  }
  std::vector<const HostTensor*> all() const { return {&key, &value, &kc, &vc, &slots, &key_scale, &ksc, &v_scale}; }
};
}  // namespace

TEST(ValidationCache, ReshapeAndCacheInt8Given) {
  using K = KvCacheDType;
  using B = Bad<GivenSetup>;
  for (K m : {K::int8_k8v8, K::int8_k8v16}) {
    GivenSetup s(m);
    EXPECT_NO_THROW(fs::reshape_and_cache(s.p)) << fs::kv_cache_dtype_name(m);
  }
  const std::vector<std::pair<K, B>> cases = {
      {K::int8_k8v8, {"no key_scale", "key_scale", [](GivenSetup& s) { s.p.key_scale.reset(); }}},
      {K::int8_k8v16, {"key_scale float16", "key_scale", [](GivenSetup& s) { s.p.key_scale = with_dtype(s.key_scale, DType::f16); }}},
      {K::int8_k8v8, {"key_scale rank 1", "key_scale", [](GivenSetup& s) { s.p.key_scale = reranked(s.key_scale, 1); }}},
      {K::int8_k8v8, {"key_scale fewer rows", "key_scale", [](GivenSetup& s) { s.p.key_scale = s.key_scale.ref.slice(0, 0, 3); }}},
      {K::int8_k8v16, {"key_scale heads", "key_scale", [](GivenSetup& s) { s.p.key_scale = s.key_scale.ref.slice(1, 0, 1); }}},
      {K::int8_k8v8, {"key_scale on CUDA", "key_scale", [](GivenSetup& s) { s.p.key_scale = on_cuda(s.key_scale); }}},
      {K::int8_k8v8, {"int8 key with an auto cache", "key", [](GivenSetup& s) { s.p.cache_dtype = K::auto_; }}},
      {K::int8_k8v8, {"int8 key with an fp8 cache", "key", [](GivenSetup& s) { s.p.cache_dtype = K::fp8_e4m3; }}},
      {K::int8_k8v8, {"k8v8 value bfloat16", "value", [](GivenSetup& s) { s.p.value = with_dtype(s.value, DType::bf16); }}},
      {K::int8_k8v8, {"k8v8 value_cache uint8", "value_cache", [](GivenSetup& s) { s.p.value_cache = with_dtype(s.vc, DType::u8); }}},
      {K::int8_k8v8, {"k8v8 v_scale given", "v_scale", [](GivenSetup& s) { s.p.v_scale = s.v_scale.ref; }}},
      {K::int8_k8v16, {"k8v16 value int8", "value", [](GivenSetup& s) { s.p.value = with_dtype(s.value, DType::i8); }}},
      {K::int8_k8v16, {"k8v16 value_cache float16", "value_cache", [](GivenSetup& s) { s.p.value_cache = with_dtype(s.vc, DType::f16); }}},
      {K::int8_k8v16, {"key_cache bfloat16", "key_cache", [](GivenSetup& s) { s.p.key_cache = with_dtype(s.kc, DType::bf16); }}},
      {K::int8_k8v8, {"no k_scale_cache", "k_scale_cache", [](GivenSetup& s) { s.p.k_scale_cache.reset(); }}},
      {K::int8_k8v8, {"slot past the cache", "slot_mapping", [](GivenSetup& s) {
         *static_cast<int64_t*>(s.slots.ref.at(3)) = 12; }}},
  };
  for (const auto& [mode, bad] : cases) {
    GivenSetup s(mode);
    expect_rejected<GivenSetup>(bad, s, [](GivenSetup& x) { fs::reshape_and_cache(x.p); });
  }
}

TEST(ValidationCache, FloatKeyRejectsKeyScale) {
  WriteSetup s(KvCacheDType::int8_k8v8);
  HostTensor ks = filled(DType::f32, {5, 2}, 0.01f, 0.1f);
  const Bad<WriteSetup> bad{"key_scale with a float key", "key_scale", [&](WriteSetup& x) { x.p.key_scale = ks.ref; }};
  expect_rejected<WriteSetup>(bad, s, [](WriteSetup& x) { fs::reshape_and_cache(x.p); });
}

namespace {
// ---- copy_blocks / swap_blocks: two caches of 4 blocks, mapping (0 -> 2), (1 -> 3).
struct BlockSetup {
  HostTensor a = filled(DType::f16, {4, 3, 2, 8}, -1, 1), b = filled(DType::f16, {4, 3, 2, 8}, -1, 1);
  HostTensor host = filled(DType::f16, {6, 3, 2, 8}, -1, 1);
  HostTensor mapping = ints(DType::i64, {2, 2}, {0, 2, 1, 3});
  std::vector<TensorRef> caches{a.ref, b.ref};
  TensorRef src = a.ref, dst = host.ref, map = mapping.ref;
  std::vector<const HostTensor*> all() const { return {&a, &b, &host, &mapping}; }
};
}  // namespace

TEST(ValidationCache, CopyAndSwapBlocks) {
  using B = Bad<BlockSetup>;
  auto set = [](BlockSetup& s, int64_t row, int64_t col, int64_t v) { *static_cast<int64_t*>(s.mapping.ref.at(row, col)) = v; };
  {
    BlockSetup s;
    EXPECT_NO_THROW(fs::copy_blocks(s.caches, s.map));
    EXPECT_NO_THROW(fs::swap_blocks(s.src, s.dst, s.map));
  }
  const std::vector<B> copy_cases = {
      {"destination block past the end", "block_mapping", [&](BlockSetup& s) { set(s, 1, 1, 4); }},
      {"negative source block", "block_mapping", [&](BlockSetup& s) { set(s, 1, 0, -1); }},
      {"block_mapping int32", "block_mapping", [](BlockSetup& s) { s.map = with_dtype(s.mapping, DType::i32); }},
      {"block_mapping [n, 3]", "block_mapping", [](BlockSetup& s) { s.map = TensorRef::contiguous(s.mapping.ref.data, DType::i64, {1, 3}); }},
      {"caches with different block counts", "caches[1]", [](BlockSetup& s) { s.caches[1] = s.b.ref.slice(0, 0, 3); }},
      {"caches on different devices", "caches[1]", [](BlockSetup& s) { s.caches[1] = on_cuda(s.b); }},
      {"caches on CUDA", "", [](BlockSetup& s) {
         s.caches = {on_cuda(s.a), on_cuda(s.b)};
         s.map = on_cuda(s.mapping);
       }, Expect::not_implemented},
  };
  for (const B& bad : copy_cases) {
    BlockSetup s;
    expect_rejected<BlockSetup>(bad, s, [](BlockSetup& x) { fs::copy_blocks(x.caches, x.map); });
  }
  const std::vector<B> swap_cases = {
      {"dtype mismatch", "dst", [](BlockSetup& s) { s.dst = with_dtype(s.host, DType::bf16); }},
      {"block shape mismatch", "dst", [](BlockSetup& s) { s.dst = s.host.ref.slice(1, 0, 2); }},
      {"block_mapping on CUDA", "block_mapping", [](BlockSetup& s) { s.map = on_cuda(s.mapping); }},
      {"source block past the end", "block_mapping", [&](BlockSetup& s) { set(s, 0, 0, 4); }},
      {"device to host", "", [](BlockSetup& s) { s.src = on_cuda(s.a); }, Expect::not_implemented},
  };
  for (const B& bad : swap_cases) {
    BlockSetup s;
    expect_rejected<BlockSetup>(bad, s, [](BlockSetup& x) { fs::swap_blocks(x.src, x.dst, x.map); });
  }
}

namespace {
// ---- advance_step: 3 sequences, 2 queries, block size 4, 2 blocks per row.
struct StepSetup {
  HostTensor tokens = ints(DType::i64, {3}, {7, 7, 7}), positions = ints(DType::i64, {3}, {1, 1, 1});
  HostTensor slots = ints(DType::i64, {3}, {2, 2, 2}), lens = ints(DType::i32, {3}, {5, 7, 3});
  HostTensor sampled = ints(DType::i64, {2, 1}, {11, 12});
  HostTensor tables = ints(DType::i32, {3, 2}, {4, 5, 6, 7, 8, 9});
  fs::AdvanceStepParams p;
  StepSetup() {
    p.num_seqs = 3;
    p.num_queries = 2;
    p.block_size = 4;
    p.input_tokens = tokens;
    p.sampled_token_ids = sampled;
    p.input_positions = positions;
    p.seq_lens = lens;
    p.slot_mapping = slots;
    p.block_tables = tables;
  }
  std::vector<const HostTensor*> all() const { return {&tokens, &positions, &slots, &lens, &sampled, &tables}; }
};
}  // namespace

TEST(ValidationCache, AdvanceStep) {
  using B = Bad<StepSetup>;
  {
    StepSetup s;
    EXPECT_NO_THROW(fs::advance_step(s.p));
  }
  const std::vector<B> cases = {
      {"seq_lens int64", "seq_lens", [](StepSetup& s) { s.p.seq_lens = with_dtype(s.lens, DType::i64); }},
      {"position past the block table row", "block_tables", [](StepSetup& s) {
         *static_cast<int32_t*>(s.lens.ref.at(1)) = 8; }},
      {"negative seq_len", "seq_lens", [](StepSetup& s) { *static_cast<int32_t*>(s.lens.ref.at(0)) = -1; }},
      {"num_seqs below num_queries", "num_seqs", [](StepSetup& s) { s.p.num_seqs = 1; }},
      {"block_size 0", "block_size", [](StepSetup& s) { s.p.block_size = 0; }},
      {"sampled_token_ids [n, 2]", "sampled_token_ids", [](StepSetup& s) {
         s.p.sampled_token_ids = TensorRef::contiguous(s.sampled.ref.data, DType::i64, {1, 2}); }},
      {"block_tables last dim strided", "block_tables", [](StepSetup& s) {
         s.p.block_tables = TensorRef::strided(s.tables.ref.data, DType::i32, {3, 2}, {1, 2}); }},
      {"input_tokens too short", "input_tokens", [](StepSetup& s) { s.p.input_tokens = s.tokens.ref.slice(0, 0, 2); }},
      {"block_tables float", "block_tables", [](StepSetup& s) { s.p.block_tables = with_dtype(s.tables, DType::f32); }},
      {"on CUDA", "", [](StepSetup& s) {
         for (TensorRef* t : {&s.p.input_tokens, &s.p.sampled_token_ids, &s.p.input_positions, &s.p.seq_lens,
                              &s.p.slot_mapping, &s.p.block_tables}) t->device = kCuda;
       }, Expect::not_implemented},
  };
  for (const B& bad : cases) {
    StepSetup s;
    expect_rejected<StepSetup>(bad, s, [](StepSetup& x) { fs::advance_step(x.p); });
  }
}

namespace {
// ---- quantize_int8: x [3, 2, 8].
struct QuantSetup {
  HostTensor x = filled(DType::bf16, {3, 2, 8}, -1, 1), out = HostTensor::zeros(DType::i8, {3, 2, 8});
  HostTensor scale = HostTensor::zeros(DType::f32, {3, 2});
  TensorRef xr = x.ref, outr = out.ref, scaler = scale.ref;
  std::vector<const HostTensor*> all() const { return {&x, &out, &scale}; }
};
// ---- merge_states: T = 3, H = 2, D = 8, head-major LSE.
struct MergeSetup {
  HostTensor a = filled(DType::f16, {3, 2, 8}, -1, 1), b = filled(DType::f16, {3, 2, 8}, -1, 1);
  HostTensor la = filled(DType::f32, {2, 3}, -2, 2), lb = filled(DType::f32, {2, 3}, -2, 2);
  HostTensor out = HostTensor::zeros(DType::f16, {3, 2, 8}), lo = HostTensor::zeros(DType::f32, {2, 3});
  HostTensor out8 = HostTensor::zeros(DType::f8e4m3, {3, 2, 8}), scale = filled(DType::f32, {2}, 0.1f, 1);
  fs::MergeParams p;
  MergeSetup() {
    for (const HostTensor* t : {&out, &lo, &out8}) fstest::poison_storage(*t);
    p.out = out;
    p.out_lse = lo.ref;
    p.a_out = a;
    p.a_lse = la;
    p.b_out = b;
    p.b_lse = lb;
  }
  std::vector<const HostTensor*> all() const { return {&a, &b, &la, &lb, &out, &lo, &out8, &scale}; }
};
}  // namespace

TEST(ValidationCache, QuantizeInt8) {
  using B = Bad<QuantSetup>;
  {
    QuantSetup s;
    EXPECT_NO_THROW(fs::quantize_int8(s.xr, s.outr, s.scaler));
  }
  const std::vector<B> cases = {
      {"out uint8", "out", [](QuantSetup& s) { s.outr = with_dtype(s.out, DType::u8); }},
      {"scale [T]", "scale", [](QuantSetup& s) { s.scaler = s.scale.ref.select(1, 0); }},
      {"x int8", "x", [](QuantSetup& s) { s.xr = with_dtype(s.x, DType::i8); }},
      {"out shape", "out", [](QuantSetup& s) { s.outr = s.out.ref.slice(2, 0, 4); }},
      {"mixed devices", "scale", [](QuantSetup& s) { s.scaler = on_cuda(s.scale); }},
  };
  for (const B& bad : cases) {
    QuantSetup s;
    expect_rejected<QuantSetup>(bad, s, [](QuantSetup& x) { fs::quantize_int8(x.xr, x.outr, x.scaler); });
  }
}

TEST(ValidationCache, MergeStates) {
  using B = Bad<MergeSetup>;
  {
    MergeSetup s;
    EXPECT_NO_THROW(fs::merge_states(s.p));
  }
  const std::vector<B> cases = {
      {"a_out int8", "a_out", [](MergeSetup& s) { s.p.a_out = with_dtype(s.a, DType::i8); }},
      {"b_out fewer heads", "b_out", [](MergeSetup& s) { s.p.b_out = s.b.ref.slice(1, 0, 1); }},
      {"a_lse token-major under head_major", "a_lse", [](MergeSetup& s) { s.p.a_lse = s.la.ref.permute({1, 0}); }},
      {"b_lse float16", "b_lse", [](MergeSetup& s) { s.p.b_lse = with_dtype(s.lb, DType::f16); }},
      {"out_lse shape", "out_lse", [](MergeSetup& s) { s.p.out_lse = s.lo.ref.slice(1, 0, 2); }},
      {"out last dim strided", "out", [](MergeSetup& s) {
         s.p.out = TensorRef::strided(s.out.ref.data, DType::f16, {3, 2, 4}, {16, 8, 2}); }},
      {"fp8 out without output_scale", "out", [](MergeSetup& s) { s.p.out = s.out8; }},
      {"output_scale with a float16 out", "out", [](MergeSetup& s) { s.p.output_scale = s.scale.ref.slice(0, 0, 1); }},
      {"output_scale [2]", "output_scale", [](MergeSetup& s) {
         s.p.out = s.out8;
         s.p.output_scale = s.scale.ref;
       }},
      {"prefill_tokens_with_context past T", "prefill_tokens_with_context", [](MergeSetup& s) {
         s.p.prefill_tokens_with_context = 4; }},
      {"mixed devices", "b_lse", [](MergeSetup& s) { s.p.b_lse = on_cuda(s.lb); }},
      {"on CUDA", "", [](MergeSetup& s) {
         for (TensorRef* t : {&s.p.out, &s.p.a_out, &s.p.a_lse, &s.p.b_out, &s.p.b_lse}) t->device = kCuda;
         s.p.out_lse->device = kCuda;
       }, Expect::not_implemented},
  };
  for (const B& bad : cases) {
    MergeSetup s;
    expect_rejected<MergeSetup>(bad, s, [](MergeSetup& x) { fs::merge_states(x.p); });
  }
}

TEST(ValidationCache, UnknownKvCacheDType) {
  try {
    fs::parse_kv_cache_dtype("fp16");
    ADD_FAILURE() << "no exception";
  } catch (const fs::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("kv_cache_dtype: expected one of ", 0), 0u) << e.what();
  }
}
