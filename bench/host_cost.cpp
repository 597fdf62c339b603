// Host cost of the backend layer (Google Benchmark), in µs:
//  - BM_MetadataBuild/N: MetadataBuilder::build for N requests (3 of 4 decodes on 512..2047
//    tokens of context, the rest chunked prefills of 16..127 tokens), planned for an H200.
//  - BM_MetadataBuildCascade/N: N decodes sharing a 512-token prefix (the shared-block check
//    and the cascade decision included).
//  - BM_ReorderDecodesFirst/N: the decodes-first permutation of N mixed requests.
//  - BM_ForwardDispatch/N vs BM_DirectCalls/N: one layer's forward on a decode batch of N
//    requests with tiny attention (H = H_kv = 1, D = 64, one token of context), against the
//    same work as direct reshape_and_cache + varlen_attention calls: the difference is the
//    layer's dispatch overhead (checks, workspace carving, metadata-to-params). Both run the
//    CPU reference on one OpenMP thread: the tiny attention is a few work items, and a second
//    thread would only add a barrier that a busy machine turns into milliseconds.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/backend.hpp"
#include "flashserve/cache.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;

constexpr int64_t kBlockSize = 16;

be::LayerSpec layer_spec(int64_t heads, int64_t kv_heads, int64_t head_size) {
  be::LayerSpec s;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.head_size = head_size;
  s.dtype = fs::DType::bf16;
  return s;
}

// The engine's common metadata for a batch (decodes first), with the host arrays it points to.
struct Batch {
  std::vector<int32_t> query_start{0}, seq_lens, table;
  std::vector<int64_t> slots;
  int64_t width = 0, max_q = 0, max_seq = 0;

  // Request r gets `q` new tokens on top of `ctx` cached ones; blocks [first_block, ...) are
  // its own unless `shared` blocks at the start are common to every request.
  void add(int32_t q, int32_t ctx) {
    query_start.push_back(query_start.back() + q);
    seq_lens.push_back(q + ctx);
    max_q = std::max<int64_t>(max_q, q);
    max_seq = std::max<int64_t>(max_seq, q + ctx);
  }
  void finish(int64_t shared_blocks) {
    const int64_t R = int64_t(seq_lens.size());
    width = (max_seq + kBlockSize - 1) / kBlockSize;
    table.assign(size_t(R * width), 0);
    int32_t next = int32_t(shared_blocks);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < width; ++j) table[size_t(r * width + j)] = j < shared_blocks ? int32_t(j) : next++;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t pos = seq_lens[size_t(r)] - (query_start[size_t(r) + 1] - query_start[size_t(r)]);
           pos < seq_lens[size_t(r)]; ++pos)
        slots.push_back(int64_t(table[size_t(r * width + pos / kBlockSize)]) * kBlockSize + pos % kBlockSize);
  }
  be::CommonMetadata common() const {
    be::CommonMetadata c;
    c.num_reqs = int64_t(seq_lens.size());
    c.num_actual_tokens = query_start.back();
    c.max_query_len = max_q;
    c.max_seq_len = max_seq;
    c.query_start_loc = query_start;
    c.seq_lens = seq_lens;
    c.block_table = fs::TensorRef::contiguous(const_cast<int32_t*>(table.data()), fs::DType::i32, {c.num_reqs, width});
    c.slot_mapping = fs::TensorRef::contiguous(const_cast<int64_t*>(slots.data()), fs::DType::i64, {int64_t(slots.size())});
    return c;
  }
};

Batch mixed_batch(int n) {
  std::mt19937_64 rng(uint64_t(n) * 7919 + 1);
  std::uniform_int_distribution<int32_t> ctx(512, 2047), chunk(16, 127);
  const int decodes = n - n / 4;
  Batch b;
  for (int i = 0; i < decodes; ++i) b.add(1, ctx(rng));
  for (int i = decodes; i < n; ++i) b.add(chunk(rng), ctx(rng));
  b.finish(0);
  return b;
}

be::BuilderConfig builder_config(const Batch& b, const be::LayerSpec& spec, const fs::DeviceProps& dev) {
  be::BuilderConfig c;
  c.layer = spec;
  c.block_size = kBlockSize;
  c.device = dev;
  c.max_num_reqs = std::max<int64_t>(1, int64_t(b.seq_lens.size()));
  c.max_num_tokens = std::max<int64_t>(1, b.query_start.back());
  c.max_blocks_per_req = b.width;
  return c;
}

void BM_MetadataBuild(benchmark::State& state) {
  const Batch b = mixed_batch(int(state.range(0)));
  be::MetadataBuilder builder(builder_config(b, layer_spec(32, 8, 128), fs::DeviceProps::h200()));
  const be::CommonMetadata cm = b.common();
  for (auto _ : state) benchmark::DoNotOptimize(&builder.build(cm));
  state.counters["tokens"] = double(cm.num_actual_tokens);
}
BENCHMARK(BM_MetadataBuild)->RangeMultiplier(4)->Range(1, 1024)->Unit(benchmark::kMicrosecond);

void BM_MetadataBuildCascade(benchmark::State& state) {
  const int n = int(state.range(0));
  constexpr int32_t kPrefix = 512;
  Batch b;
  std::mt19937_64 rng{uint64_t(n)};
  std::uniform_int_distribution<int32_t> suffix(1, 511);
  for (int i = 0; i < n; ++i) b.add(1, kPrefix + suffix(rng));
  b.finish(kPrefix / kBlockSize);
  be::MetadataBuilder builder(builder_config(b, layer_spec(32, 8, 128), fs::DeviceProps::h200()));
  const be::CommonMetadata cm = b.common();
  const be::AttentionMetadata& md = builder.build(cm, kPrefix);
  state.SetLabel(md.cascade.enabled ? "cascade" : "split-KV decode");
  for (auto _ : state) benchmark::DoNotOptimize(&builder.build(cm, kPrefix));
}
BENCHMARK(BM_MetadataBuildCascade)->RangeMultiplier(4)->Range(8, 1024)->Unit(benchmark::kMicrosecond);

void BM_ReorderDecodesFirst(benchmark::State& state) {
  const int n = int(state.range(0));
  std::mt19937_64 rng{uint64_t(n)};
  std::vector<int32_t> qlens(static_cast<size_t>(n));
  for (int32_t& q : qlens) q = rng() % 3 == 0 ? int32_t(16 + rng() % 112) : 1;
  for (auto _ : state) benchmark::DoNotOptimize(be::reorder_decodes_first(qlens, 1));
}
BENCHMARK(BM_ReorderDecodesFirst)->RangeMultiplier(4)->Range(1, 1024)->Unit(benchmark::kMicrosecond);

// A decode batch of n requests with one token of context each (the new one), H = H_kv = 1.
struct TinyDecode {
  static constexpr int64_t D = 64;
  Batch batch;
  std::vector<uint16_t> q, k, v, out, key_cache, value_cache;
  be::LayerSpec spec = layer_spec(1, 1, D);
  explicit TinyDecode(int n) {
    for (int i = 0; i < n; ++i) batch.add(1, 0);
    batch.finish(0);
    q.assign(size_t(n * D), 0x3f80);  // bf16 1.0
    k = v = q;
    out.assign(size_t(n * D), 0);
    key_cache.assign(size_t(n * kBlockSize * D), 0);
    value_cache = key_cache;
  }
  fs::TensorRef t(std::vector<uint16_t>& x, std::initializer_list<int64_t> shape) {
    return fs::TensorRef::contiguous(x.data(), fs::DType::bf16, shape);
  }
  int64_t n() const { return int64_t(batch.seq_lens.size()); }
};

void BM_ForwardDispatch(benchmark::State& state) {
  omp_set_num_threads(1);
  TinyDecode x(int(state.range(0)));
  const int64_t n = x.n(), D = TinyDecode::D;
  be::MetadataBuilder builder(builder_config(x.batch, x.spec, fs::DeviceProps::cpu()));
  const be::AttentionMetadata& md = builder.build(x.batch.common());
  be::AttentionLayer layer(x.spec);
  std::vector<unsigned char> ws(layer.workspace_bytes(builder.config()) + 256);
  const be::KvCache cache{.key_cache = x.t(x.key_cache, {n, kBlockSize, 1, D}),
                          .value_cache = x.t(x.value_cache, {n, kBlockSize, 1, D})};
  const fs::TensorRef q = x.t(x.q, {n, 1, D}), k = x.t(x.k, {n, 1, D}), v = x.t(x.v, {n, 1, D});
  const fs::TensorRef out = x.t(x.out, {n, 1, D});
  const be::LayerWorkspace w{ws.data(), ws.size(), {}};
  for (auto _ : state) layer.forward(md, q, k, v, &cache, out, w);
}
BENCHMARK(BM_ForwardDispatch)->RangeMultiplier(4)->Range(1, 256)->Unit(benchmark::kMicrosecond);

void BM_DirectCalls(benchmark::State& state) {
  omp_set_num_threads(1);
  TinyDecode x(int(state.range(0)));
  const int64_t n = x.n(), D = TinyDecode::D;
  const be::CommonMetadata cm = x.batch.common();
  std::vector<int32_t> cu = x.batch.query_start, used = x.batch.seq_lens;
  fs::CacheWriteParams w;
  w.key = x.t(x.k, {n, 1, D});
  w.value = x.t(x.v, {n, 1, D});
  w.key_cache = x.t(x.key_cache, {n, kBlockSize, 1, D});
  w.value_cache = x.t(x.value_cache, {n, kBlockSize, 1, D});
  w.slot_mapping = cm.slot_mapping;
  fs::AttentionParams p;
  p.q = x.t(x.q, {n, 1, D});
  p.k = w.key_cache;
  p.v = w.value_cache;
  p.out = x.t(x.out, {n, 1, D});
  p.cu_seqlens_q = fs::TensorRef::contiguous(cu.data(), fs::DType::i32, {n + 1});
  p.seqused_k = fs::TensorRef::contiguous(used.data(), fs::DType::i32, {n});
  p.block_table = cm.block_table;
  p.max_seqlen_q = 1;
  p.max_seqlen_k = 1;
  p.causal = true;
  for (auto _ : state) {
    fs::reshape_and_cache(w);
    fs::varlen_attention(p);
  }
}
BENCHMARK(BM_DirectCalls)->RangeMultiplier(4)->Range(1, 256)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
