// The backend layer on CUDA (backend.hpp): MetadataBuilder with CUDA metadata (its own views in
// its device buffer, one async upload per build on a stream) and AttentionLayer::forward over
// device tensors, against the same build and forward on the CPU. Paths: decode + prefill parts
// (NHD, HND), fp8 caches, cascade (with sinks and soft-cap), chunked local attention (the
// virtual block table gathered on the device), encoder-only; the device metadata must equal the
// host metadata element for element, the caches must end byte-identical, the outputs within
// bf16 rounding. Also tree verify and advance_decode_step (their slots resolved on the device),
// and a rebuild reuses the same device pointers (graph replay).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/status.hpp"
#include "kernels/device_info.hpp"
#include "support/checks.hpp"
#include "support/device_tensor.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::KvCacheDType;
using fs::TensorRef;
using fsgpu::DeviceTensor;
using fstest::HostTensor;

// ---------------------------------------------------------------- a batch over a paged cache

struct Scenario {
  be::LayerSpec spec;
  int64_t block_size = 16;
  std::vector<int32_t> q_lens, seq_lens;  // decode requests first; seq_len includes the new tokens
  int64_t prefix = 0;                     // tokens shared by every request (whole blocks, same ids)
  int64_t B() const { return int64_t(q_lens.size()); }
};

be::LayerSpec make_spec(int64_t H, int64_t H_kv, int64_t D) {
  be::LayerSpec s;
  s.num_heads = H;
  s.num_kv_heads = H_kv;
  s.head_size = D;
  s.dtype = DType::bf16;
  return s;
}

bool is_fp8(KvCacheDType t) { return t == KvCacheDType::fp8_e4m3 || t == KvCacheDType::fp8_e5m2; }

// Host inputs: q and the new tokens' key/value, caches holding every context position (other
// slots poisoned), the engine's block table and slot_mapping.
struct Batch {
  int64_t T = 0;
  std::vector<int32_t> qsl;
  HostTensor q, key, value, kc, vc, k_scale, v_scale, table, slots;
};

// Block ids: the shared prefix blocks, then each request's own, in a random order.
std::vector<std::vector<int32_t>> assign_blocks(const Scenario& sc, std::mt19937_64& rng, int64_t& num_blocks) {
  const int64_t bs = sc.block_size, shared = sc.prefix / bs;
  int64_t total = shared;
  for (int32_t s : sc.seq_lens) total += (s + bs - 1) / bs - shared;
  num_blocks = total + 3;
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks), 0);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<int32_t>> rows;
  size_t next = size_t(shared);
  for (int64_t r = 0; r < sc.B(); ++r) {
    std::vector<int32_t> row(ids.begin(), ids.begin() + shared);
    for (int64_t j = shared; j < (sc.seq_lens[size_t(r)] + bs - 1) / bs; ++j) row.push_back(ids[next++]);
    rows.push_back(row);
  }
  return rows;
}

HostTensor make_cache(const Scenario& sc, int64_t nb, DType dtype) {
  const int64_t bs = sc.block_size, Hk = sc.spec.num_kv_heads, D = sc.spec.head_size;
  HostTensor t = sc.spec.kv_layout == fs::KvLayout::nhd ? HostTensor::zeros(dtype, {nb, bs, Hk, D})
                                                        : HostTensor::zeros(dtype, {nb, Hk, bs, D});
  fstest::poison_storage(t);
  return t;
}

// Writes request r's context positions (the shared prefix through request 0 only).
void write_context(const Scenario& sc, const Batch& b, const std::vector<int32_t>& blocks, int64_t r,
                   std::mt19937_64& rng) {
  const int64_t ctx = sc.seq_lens[size_t(r)] - sc.q_lens[size_t(r)], bs = sc.block_size;
  if (ctx == 0) return;
  const int64_t Hk = sc.spec.num_kv_heads, D = sc.spec.head_size;
  HostTensor k = HostTensor::zeros(sc.spec.dtype, {ctx, Hk, D}), v = HostTensor::zeros(sc.spec.dtype, {ctx, Hk, D});
  fstest::fill_uniform(k, rng, -1.0f, 1.0f);
  fstest::fill_uniform(v, rng, -1.0f, 1.0f);
  HostTensor s = HostTensor::zeros(DType::i64, {ctx});
  for (int64_t pos = 0; pos < ctx; ++pos)
    *static_cast<int64_t*>(s.ref.at(pos)) =
        r == 0 || pos >= sc.prefix ? int64_t(blocks[size_t(pos / bs)]) * bs + pos % bs : -1;
  fs::CacheWriteParams w;
  w.key = k;
  w.value = v;
  w.key_cache = b.kc;
  w.value_cache = b.vc;
  w.layout = sc.spec.kv_layout;
  w.slot_mapping = s;
  w.cache_dtype = sc.spec.kv_cache_dtype;
  if (is_fp8(sc.spec.kv_cache_dtype)) {
    w.k_scale = b.k_scale.ref;
    w.v_scale = b.v_scale.ref;
  }
  fs::reshape_and_cache(w);
}

Batch make_batch(const Scenario& sc, std::mt19937_64& rng) {
  Batch b;
  const int64_t B = sc.B(), bs = sc.block_size, H = sc.spec.num_heads, Hk = sc.spec.num_kv_heads;
  const int64_t D = sc.spec.head_size;
  b.qsl.assign(size_t(B) + 1, 0);
  for (int64_t r = 0; r < B; ++r) b.qsl[size_t(r) + 1] = b.qsl[size_t(r)] + sc.q_lens[size_t(r)];
  b.T = b.qsl.back();
  int64_t nb = 0;
  const auto blocks = assign_blocks(sc, rng, nb);
  int64_t width = 0;
  for (const auto& row : blocks) width = std::max<int64_t>(width, int64_t(row.size()));
  width += 2;
  b.table = HostTensor::zeros(DType::i32, {B, width});
  for (int64_t r = 0; r < B; ++r)
    for (size_t j = 0; j < blocks[size_t(r)].size(); ++j) b.table.set({r, int64_t(j)}, float(blocks[size_t(r)][j]));

  DType cache_dtype = sc.spec.dtype;
  if (sc.spec.kv_cache_dtype == KvCacheDType::fp8_e4m3) cache_dtype = DType::f8e4m3;
  if (sc.spec.kv_cache_dtype == KvCacheDType::fp8_e5m2) cache_dtype = DType::f8e5m2;
  b.kc = make_cache(sc, nb, cache_dtype);
  b.vc = make_cache(sc, nb, cache_dtype);
  if (is_fp8(sc.spec.kv_cache_dtype)) {
    b.k_scale = HostTensor::zeros(DType::f32, {Hk});
    b.v_scale = HostTensor::zeros(DType::f32, {});
    fstest::fill_uniform(b.k_scale, rng, 0.004f, 0.006f);
    fstest::fill_uniform(b.v_scale, rng, 0.004f, 0.006f);
  }
  for (int64_t r = 0; r < B; ++r) write_context(sc, b, blocks[size_t(r)], r, rng);

  b.q = HostTensor::zeros(sc.spec.dtype, {b.T, H, D});
  b.key = HostTensor::zeros(sc.spec.dtype, {b.T, Hk, D});
  b.value = HostTensor::zeros(sc.spec.dtype, {b.T, Hk, D});
  for (const HostTensor* t : {&b.q, &b.key, &b.value}) fstest::fill_uniform(*t, rng, -1.0f, 1.0f);
  b.slots = HostTensor::zeros(DType::i64, {b.T});
  for (int64_t r = 0; r < B; ++r) {
    const int64_t first = sc.seq_lens[size_t(r)] - sc.q_lens[size_t(r)];
    for (int64_t i = 0; i < sc.q_lens[size_t(r)]; ++i) {
      const int64_t pos = first + i;
      *static_cast<int64_t*>(b.slots.ref.at(b.qsl[size_t(r)] + i)) =
          int64_t(blocks[size_t(r)][size_t(pos / bs)]) * bs + pos % bs;
    }
  }
  return b;
}

be::BuilderConfig config_of(const Scenario& sc, const fs::DeviceProps& dev, void* stream = nullptr) {
  be::BuilderConfig c;
  c.layer = sc.spec;
  c.block_size = sc.block_size;
  c.device = dev;
  c.max_num_reqs = 64;
  c.max_num_tokens = 1024;
  c.max_blocks_per_req = 256;
  c.stream = stream;
  return c;
}

be::CommonMetadata common_of(const Scenario& sc, const Batch& b, const TensorRef& table, const TensorRef& slots) {
  be::CommonMetadata cm;
  cm.num_reqs = sc.B();
  cm.num_actual_tokens = b.T;
  cm.max_query_len = *std::max_element(sc.q_lens.begin(), sc.q_lens.end());
  cm.max_seq_len = *std::max_element(sc.seq_lens.begin(), sc.seq_lens.end());
  cm.query_start_loc = b.qsl;
  cm.seq_lens = sc.seq_lens;
  cm.block_table = table;
  cm.slot_mapping = slots;
  return cm;
}

// ---------------------------------------------------------------- CPU vs CUDA

struct Outcome {
  HostTensor out, kc, vc;
};

// How a test gets its metadata from a builder and the step's common metadata (the same on
// both devices): a build with a prefix hint by default.
using StepFn = std::function<const be::AttentionMetadata&(be::MetadataBuilder&, const be::CommonMetadata&)>;
StepFn plain_build(int64_t prefix_hint) {
  return [prefix_hint](be::MetadataBuilder& mb, const be::CommonMetadata& cm) -> const be::AttentionMetadata& {
    return mb.build(cm, prefix_hint);
  };
}

// md_out views the builder's buffers: `keep` receives the builder so they outlive the call.
Outcome run_cpu(const Scenario& sc, const Batch& b, const StepFn& step, be::AttentionMetadata* md_out = nullptr,
                std::unique_ptr<be::MetadataBuilder>* keep = nullptr) {
  Outcome o{HostTensor::zeros(sc.spec.dtype, {b.T, sc.spec.num_heads, sc.spec.head_size}), b.kc.clone(), b.vc.clone()};
  auto owned = std::make_unique<be::MetadataBuilder>(config_of(sc, fs::DeviceProps::cpu()));
  be::MetadataBuilder& mb = *owned;
  const be::AttentionMetadata& md = step(mb, common_of(sc, b, b.table, b.slots));
  const be::AttentionLayer layer(sc.spec);
  std::vector<unsigned char> ws(layer.workspace_bytes(mb.config()));
  be::KvCache cache{.key_cache = o.kc.ref, .value_cache = o.vc.ref};
  if (b.k_scale.bytes) cache.k_scale = b.k_scale.ref;
  if (b.v_scale.bytes) cache.v_scale = b.v_scale.ref;
  fstest::poison(o.out);
  layer.forward(md, b.q.ref, b.key.ref, b.value.ref, &cache, o.out, be::LayerWorkspace{ws.data(), ws.size()});
  if (md_out) *md_out = md;
  if (keep) *keep = std::move(owned);
  return o;
}

std::vector<int32_t> download_i32(const TensorRef& t) {
  std::vector<int32_t> v;
  if (t.ndim == 0 || t.numel() == 0) return v;
  const int64_t rows = t.ndim == 2 ? t.size(0) : 1, cols = t.size(t.ndim - 1);
  const int64_t stride = t.ndim == 2 ? t.stride[0] : cols;
  v.resize(size_t(rows * cols));
  EXPECT_EQ(cudaMemcpy2D(v.data(), size_t(cols) * 4, t.data, size_t(stride) * 4, size_t(cols) * 4, size_t(rows),
                         cudaMemcpyDeviceToHost),
            cudaSuccess);
  return v;
}

std::vector<int32_t> host_i32(const TensorRef& t) {
  std::vector<int32_t> v;
  if (t.ndim == 0) return v;
  fstest::for_each_index(t, [&](const std::vector<int64_t>&, int64_t off) {
    v.push_back(static_cast<const int32_t*>(t.data)[off]);
  });
  return v;
}

// The device part holds the host part's values, its own views on the device.
void expect_same_part(const be::PartMetadata& dev, const be::PartMetadata& host, const char* name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(dev.num_reqs, host.num_reqs);
  EXPECT_EQ(dev.num_tokens, host.num_tokens);
  EXPECT_EQ(dev.max_seq_len, host.max_seq_len);
  if (host.empty()) return;
  for (const auto& [d, h] : {std::pair{&dev.cu_seqlens_q, &host.cu_seqlens_q}, {&dev.seqused_k, &host.seqused_k},
                             {&dev.block_table, &host.block_table}}) {
    EXPECT_EQ(d->device.type, fs::DeviceType::cuda);
    EXPECT_EQ(download_i32(*d), host_i32(*h));
  }
}

struct GpuRun {
  Scenario sc;
  Batch b;
  cudaStream_t stream = nullptr;
  DeviceTensor q, key, value, kc, vc, k_scale, v_scale, table, slots, out;
  std::shared_ptr<void> ws;

  GpuRun(const Scenario& s, const Batch& batch) : sc(s), b(batch) {
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    q = DeviceTensor::mirror(b.q);
    key = DeviceTensor::mirror(b.key);
    value = DeviceTensor::mirror(b.value);
    kc = DeviceTensor::mirror(b.kc);
    vc = DeviceTensor::mirror(b.vc);
    if (b.k_scale.bytes) k_scale = DeviceTensor::mirror(b.k_scale);
    if (b.v_scale.bytes) v_scale = DeviceTensor::mirror(b.v_scale);
    table = DeviceTensor::mirror(b.table);
    slots = DeviceTensor::mirror(b.slots);
    out = DeviceTensor::poisoned_mirror(HostTensor::zeros(sc.spec.dtype, {b.T, sc.spec.num_heads, sc.spec.head_size}));
  }
  ~GpuRun() { cudaStreamDestroy(stream); }

  be::BuilderConfig config() const { return config_of(sc, fs::kernels::cuda_device_props(0), stream); }
  // The step's common metadata over the device table and slots.
  be::CommonMetadata common() const { return common_of(sc, b, table.ref, slots.ref); }

  void forward(const be::AttentionMetadata& md) {
    const be::AttentionLayer layer(sc.spec);
    const size_t bytes = layer.workspace_bytes(config());
    if (!ws) ws = fsgpu::device_alloc(bytes);
    be::KvCache cache{.key_cache = kc.ref, .value_cache = vc.ref};
    if (b.k_scale.bytes) cache.k_scale = k_scale.ref;
    if (b.v_scale.bytes) cache.v_scale = v_scale.ref;
    fs::ExecContext ctx;
    ctx.stream = stream;
    layer.forward(md, q.ref, key.ref, value.ref, &cache, out.ref,
                  be::LayerWorkspace{ws.get(), bytes, fs::Device{fs::DeviceType::cuda, 0}}, ctx);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }

  Outcome download() const {
    Outcome o{HostTensor::zeros(sc.spec.dtype, {b.T, sc.spec.num_heads, sc.spec.head_size}), b.kc.clone(),
              b.vc.clone()};
    out.copy_to(o.out);
    kc.copy_to(o.kc);
    vc.copy_to(o.vc);
    return o;
  }
};

std::vector<int64_t> download_i64(const TensorRef& t) {
  std::vector<int64_t> v(size_t(t.numel()));
  if (!v.empty()) EXPECT_EQ(cudaMemcpy(v.data(), t.data, v.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

std::vector<int64_t> host_i64(const TensorRef& t) {
  std::vector<int64_t> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = *static_cast<const int64_t*>(t.at(i));
  return v;
}

// Builds (by `step`) and runs the scenario on both devices; `check` sees the device metadata
// first. The device metadata must equal the host metadata (every part, and slot_mapping).
template <class Check>
void compare(const Scenario& sc, const StepFn& step, Check check) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const Batch b = make_batch(sc, rng);
  be::AttentionMetadata host_md;
  std::unique_ptr<be::MetadataBuilder> host_builder;  // host_md's views live in its buffers
  const Outcome want = run_cpu(sc, b, step, &host_md, &host_builder);

  GpuRun g(sc, b);
  be::MetadataBuilder mb(g.config());
  const be::AttentionMetadata& md = step(mb, g.common());
  check(md);
  ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
  for (const auto& [d, h, name] : {std::tuple{&md.decode, &host_md.decode, "decode"},
                                   {&md.prefill, &host_md.prefill, "prefill"},
                                   {&md.cascade.prefix, &host_md.cascade.prefix, "cascade prefix"},
                                   {&md.cascade.suffix, &host_md.cascade.suffix, "cascade suffix"},
                                   {&md.local.part, &host_md.local.part, "local"},
                                   {&md.tree.prefix, &host_md.tree.prefix, "tree prefix"},
                                   {&md.tree.tree, &host_md.tree.tree, "tree"}})
    expect_same_part(*d, *h, name);
  EXPECT_EQ(md.slot_mapping.device.type, fs::DeviceType::cuda);
  EXPECT_EQ(download_i64(md.slot_mapping), host_i64(host_md.slot_mapping));
  g.forward(md);
  const Outcome got = g.download();
  fstest::expect_rows_close(got.out, want.out, b.T, 2e-2, 2e-2);
  EXPECT_TRUE(fstest::same_bytes(got.kc, fstest::snapshot(want.kc))) << "key cache differs from the CPU forward's";
  EXPECT_TRUE(fstest::same_bytes(got.vc, fstest::snapshot(want.vc))) << "value cache differs from the CPU forward's";
}

Scenario mixed_batch(be::LayerSpec spec) {
  Scenario sc;
  sc.spec = spec;
  sc.q_lens = {1, 1, 1, 7, 33, 16};
  sc.seq_lens = {40, 1, 130, 7, 90, 200};
  return sc;
}

Scenario prefix_batch(be::LayerSpec spec) {
  Scenario sc;
  sc.spec = spec;
  sc.prefix = 272;  // 17 blocks
  for (int r = 0; r < 10; ++r) {
    const int32_t q = r < 4 ? 1 : 3 + 5 * r;
    sc.q_lens.push_back(q);
    sc.seq_lens.push_back(int32_t(sc.prefix) + 5 + 13 * r + q);
  }
  return sc;
}

// ---------------------------------------------------------------- paths

TEST(GpuLayer, DecodeAndPrefillParts) {
  for (const fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
    SCOPED_TRACE(layout == fs::KvLayout::nhd ? "NHD" : "HND");
    be::LayerSpec spec = make_spec(8, 2, 128);
    spec.kv_layout = layout;
    compare(mixed_batch(spec), plain_build(0), [](const be::AttentionMetadata& md) {
      EXPECT_EQ(md.num_decodes, 3);
      EXPECT_FALSE(md.decode.empty());
      EXPECT_FALSE(md.prefill.empty());
    });
  }
}

TEST(GpuLayer, Fp8Caches) {
  for (const KvCacheDType dt : {KvCacheDType::fp8_e4m3, KvCacheDType::fp8_e5m2}) {
    SCOPED_TRACE(fs::kv_cache_dtype_name(dt));
    be::LayerSpec spec = make_spec(8, 2, 128);
    spec.kv_cache_dtype = dt;
    compare(mixed_batch(spec), plain_build(0), [](const be::AttentionMetadata&) {});
  }
}

TEST(GpuLayer, Cascade) {
  auto rng = fstest::make_rng(fstest::test_salt() + 1);
  HostTensor sinks = HostTensor::zeros(DType::f32, {8});
  fstest::fill_uniform(sinks, rng, 0.0f, 3.0f);
  const DeviceTensor dsinks = DeviceTensor::mirror(sinks);
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    be::LayerSpec spec = make_spec(8, 2, 128);
    Scenario sc = prefix_batch(spec);
    if (variant == 1) sc.spec.softcap = 8.0f;
    // Sinks: a host tensor for the CPU run, its device mirror for the CUDA run.
    if (variant == 1) sc.spec.sinks = sinks.ref;
    auto rng2 = fstest::make_rng(fstest::test_salt() + 2 + variant);
    const Batch b = make_batch(sc, rng2);
    be::AttentionMetadata host_md;
    std::unique_ptr<be::MetadataBuilder> host_builder;  // host_md's views live in its buffers
    const Outcome want = run_cpu(sc, b, plain_build(sc.prefix + 7), &host_md, &host_builder);
    ASSERT_TRUE(host_md.cascade.enabled);
    Scenario dsc = sc;
    if (variant == 1) dsc.spec.sinks = dsinks.ref;
    GpuRun g(dsc, b);
    be::MetadataBuilder mb(g.config());
    const be::AttentionMetadata& md = mb.build(g.common(), sc.prefix + 7);
    ASSERT_TRUE(md.cascade.enabled);
    EXPECT_EQ(md.cascade.common_prefix_len, sc.prefix);
    expect_same_part(md.cascade.prefix, host_md.cascade.prefix, "cascade prefix");
    expect_same_part(md.cascade.suffix, host_md.cascade.suffix, "cascade suffix");
    g.forward(md);
    const Outcome got = g.download();
    fstest::expect_rows_close(got.out, want.out, b.T, 2e-2, 2e-2);
    EXPECT_TRUE(fstest::same_bytes(got.kc, fstest::snapshot(want.kc)));
  }
}

TEST(GpuLayer, ChunkedLocal) {
  be::LayerSpec spec = make_spec(8, 4, 64);
  spec.attention_chunk_size = 32;
  Scenario sc;
  sc.spec = spec;
  sc.q_lens = {1, 1, 4, 10, 45, 70};
  sc.seq_lens = {33, 64, 6, 77, 45, 150};
  compare(sc, plain_build(0), [](const be::AttentionMetadata& md) { EXPECT_TRUE(md.local.enabled); });
}

// ---------------------------------------------------------------- builder properties

// A rebuild rewrites the same device buffers: the views a graph captured stay valid.
TEST(GpuLayer, RebuildKeepsDevicePointers) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const Scenario sc = mixed_batch(make_spec(8, 2, 128));
  const Batch b = make_batch(sc, rng);
  GpuRun g(sc, b);
  be::MetadataBuilder mb(g.config());
  const be::CommonMetadata cm = g.common();
  const be::AttentionMetadata first = mb.build(cm);
  Scenario dec = sc;  // a decode-only step of the first three requests
  dec.q_lens = {1, 1, 1};
  dec.seq_lens = {41, 2, 131};
  const std::vector<int32_t> qsl{0, 1, 2, 3};
  be::CommonMetadata cm2 = cm;
  cm2.num_reqs = 3;
  cm2.num_actual_tokens = 3;
  cm2.max_query_len = 1;
  cm2.query_start_loc = qsl;
  cm2.seq_lens = dec.seq_lens;
  const be::AttentionMetadata& second = mb.build(cm2);
  EXPECT_EQ(second.decode.cu_seqlens_q.data, first.decode.cu_seqlens_q.data);
  EXPECT_EQ(second.decode.seqused_k.data, first.decode.seqused_k.data);
  EXPECT_EQ(download_i32(second.decode.seqused_k), (std::vector<int32_t>{41, 2, 131}));
}

// Tree verify with CUDA metadata: the draft paths' slots come from the device block table.
TEST(GpuLayer, TreeVerify) {
  Scenario sc = mixed_batch(make_spec(8, 2, 128));
  sc.q_lens = {1, 1, 3, 4};  // decodes first
  sc.seq_lens = {17, 9, 40, 130};
  static const std::vector<int32_t> num_drafts{1, 0, 3, 3}, parents{-1, -1, 0, 0, -1, 0, 1};
  const StepFn step = [](be::MetadataBuilder& mb, const be::CommonMetadata& cm) -> const be::AttentionMetadata& {
    const be::DraftTree tree{parents, num_drafts};
    return mb.build(cm, 0, &tree);
  };
  compare(sc, step, [](const be::AttentionMetadata& md) {
    EXPECT_TRUE(md.tree.enabled);
    EXPECT_EQ(md.tree.tree.num_reqs, 9);
  });
}

// Multi-step decode with CUDA metadata: the new slot_mapping computed on the device.
TEST(GpuLayer, AdvanceDecodeStep) {
  for (const int dcp : {1, 2}) {
    SCOPED_TRACE("dcp world " + std::to_string(dcp));
    Scenario sc = mixed_batch(make_spec(8, 2, 128));
    sc.q_lens = {1, 1, 1};
    sc.seq_lens = {40, 2, 130};
    // The previous step's build (one token shorter), advanced: the batch's step, whose slots
    // the engine's slot_mapping holds (checked against the host builder's).
    const StepFn step = [sc](be::MetadataBuilder& mb, const be::CommonMetadata& cm) -> const be::AttentionMetadata& {
      std::vector<int32_t> before = sc.seq_lens;
      for (int32_t& len : before) --len;
      be::CommonMetadata prev = cm;
      prev.seq_lens = before;
      mb.build(prev);
      return mb.advance_decode_step();
    };
    if (dcp == 1) {
      compare(sc, step, [](const be::AttentionMetadata& md) { EXPECT_EQ(md.num_decodes, 3); });
      continue;
    }
    // DCP rank 1 of 2: the metadata (slots -1 off this rank) against the host builder's.
    auto rng = fstest::make_rng(fstest::test_salt());
    const Batch b = make_batch(sc, rng);
    GpuRun g(sc, b);
    be::BuilderConfig hc = config_of(sc, fs::DeviceProps::cpu()), dc = g.config();
    hc.dcp_world_size = dc.dcp_world_size = 2;
    hc.dcp_rank = dc.dcp_rank = 1;
    be::MetadataBuilder host(hc), dev(dc);
    const be::AttentionMetadata& hm = step(host, common_of(sc, b, b.table, b.slots));
    const be::AttentionMetadata& dm = step(dev, g.common());
    ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
    expect_same_part(dm.decode, hm.decode, "decode");
    EXPECT_EQ(download_i64(dm.slot_mapping), host_i64(hm.slot_mapping));
  }
}

// advance_decode_step after a build that took the cascade: the decision is made again on the
// advanced step, against the engine's block table on the device (never read on the host).
TEST(GpuLayer, AdvanceDecodeStepWithCascade) {
  Scenario sc;
  sc.spec = make_spec(8, 2, 128);
  sc.prefix = 2048;  // 128 shared blocks; 24 decodes: the cost model takes the cascade
  for (int r = 0; r < 24; ++r) {
    sc.q_lens.push_back(1);
    sc.seq_lens.push_back(int32_t(sc.prefix) + 5 + 7 * r + 1);
  }
  const StepFn step = [sc](be::MetadataBuilder& mb, const be::CommonMetadata& cm) -> const be::AttentionMetadata& {
    std::vector<int32_t> before = sc.seq_lens;
    for (int32_t& len : before) --len;
    be::CommonMetadata prev = cm;
    prev.seq_lens = before;
    mb.build(prev, sc.prefix + 7);
    return mb.advance_decode_step();
  };
  compare(sc, step, [](const be::AttentionMetadata& md) { EXPECT_TRUE(md.cascade.enabled); });
}

TEST(GpuLayer, MixedDevicesAreRejected) {
  auto rng = fstest::make_rng(fstest::test_salt());
  const Scenario sc = mixed_batch(make_spec(8, 2, 128));
  const Batch b = make_batch(sc, rng);
  GpuRun g(sc, b);
  be::MetadataBuilder mb(g.config());
  be::CommonMetadata mixed = g.common();
  mixed.slot_mapping = b.slots.ref;  // host slots beside a device table
  EXPECT_THROW(mb.build(mixed), fs::Error);
}

}  // namespace
