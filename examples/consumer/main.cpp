// An engine's first use of an installed flashserve: one varlen attention call over a paged
// KV cache, then one backend step (MetadataBuilder::build + AttentionLayer::forward, which also
// writes the step's K/V), checked against a direct fp64 computation. CPU tensors, so it runs
// the same against a CPU or a CUDA install. Exits 1 on a mismatch.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/backend.hpp"
#include "flashserve/status.hpp"

namespace fs = flashserve;
namespace be = flashserve::backend;

namespace {

constexpr int64_t H = 4, Hkv = 2, D = 64, kBlock = 16, kBlocks = 8;

// fp64 attention of query row `row` (head h) over the first n positions of a request's
// blocks; the query is the last position (bottom-right causal alignment).
double ref_out(const std::vector<float>& q, const std::vector<float>& kc, const std::vector<float>& vc,
               const std::vector<int32_t>& blocks, int64_t n, int64_t row, int64_t h, int64_t d) {
  const int64_t g = h / (H / Hkv);
  std::vector<double> s(size_t(n), 0.0);
  double mx = -INFINITY, sum = 0.0, acc = 0.0;
  auto at = [&](const std::vector<float>& c, int64_t pos, int64_t dd) {
    const int64_t slot = int64_t(blocks[size_t(pos / kBlock)]) * kBlock + pos % kBlock;
    return double(c[size_t((slot * Hkv + g) * D + dd)]);
  };
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t dd = 0; dd < D; ++dd) s[size_t(j)] += double(q[size_t((row * H + h) * D + dd)]) * at(kc, j, dd);
    s[size_t(j)] /= std::sqrt(double(D));
    mx = std::max(mx, s[size_t(j)]);
  }
  for (int64_t j = 0; j < n; ++j) {
    const double p = std::exp(s[size_t(j)] - mx);
    sum += p;
    acc += p * at(vc, j, d);
  }
  return acc / sum;
}

double max_err(const std::vector<float>& out, const std::vector<float>& q, const std::vector<float>& kc,
               const std::vector<float>& vc, const std::vector<std::vector<int32_t>>& tables,
               const std::vector<int32_t>& seq_lens) {
  double err = 0.0;
  for (size_t b = 0; b < tables.size(); ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const double r = ref_out(q, kc, vc, tables[b], seq_lens[b], int64_t(b), h, d);
        err = std::max(err, std::abs(double(out[size_t((int64_t(b) * H + h) * D + d)]) - r));
      }
  return err;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  auto randn = [&](size_t n) { std::vector<float> v(n); for (float& x : v) x = nd(rng); return v; };

  // Two decode requests (one new token each) over a paged cache; their blocks interleaved.
  const std::vector<std::vector<int32_t>> tables = {{5, 1, 6}, {2, 7, 0}};
  const std::vector<int32_t> seq_lens = {37, 20}, cu_q = {0, 1, 2};
  std::vector<int32_t> table_flat;
  for (const auto& t : tables) table_flat.insert(table_flat.end(), t.begin(), t.end());
  std::vector<float> q = randn(2 * H * D), kc = randn(kBlocks * kBlock * Hkv * D), vc = randn(kc.size());
  std::vector<float> out(q.size(), NAN);

  // 1. The raw operation: varlen attention over the paged cache.
  fs::AttentionParams p;
  p.q = fs::TensorRef::contiguous(q.data(), fs::DType::f32, {2, H, D});
  p.k = fs::TensorRef::contiguous(kc.data(), fs::DType::f32, {kBlocks, kBlock, Hkv, D});
  p.v = fs::TensorRef::contiguous(vc.data(), fs::DType::f32, {kBlocks, kBlock, Hkv, D});
  p.out = fs::TensorRef::contiguous(out.data(), fs::DType::f32, {2, H, D});
  p.cu_seqlens_q = fs::TensorRef::contiguous(const_cast<int32_t*>(cu_q.data()), fs::DType::i32, {3});
  p.seqused_k = fs::TensorRef::contiguous(const_cast<int32_t*>(seq_lens.data()), fs::DType::i32, {2});
  p.block_table = fs::TensorRef::contiguous(table_flat.data(), fs::DType::i32, {2, 3});
  p.max_seqlen_q = 1;
  p.max_seqlen_k = 37;
  p.causal = true;
  fs::varlen_attention(p);
  const double err1 = max_err(out, q, kc, vc, tables, seq_lens);
  std::printf("varlen_attention (%s): max |err| vs fp64 %.2e\n",
              fs::attention_kernel_name(p, false, fs::DeviceProps::cpu()).c_str(), err1);

  // 2. One backend step: the new token's K/V go into the cache through the layer's forward.
  be::LayerSpec spec;
  spec.num_heads = H;
  spec.num_kv_heads = Hkv;
  spec.head_size = D;
  spec.dtype = fs::DType::f32;
  be::BuilderConfig cfg;
  cfg.layer = spec;
  cfg.block_size = kBlock;
  cfg.device = fs::DeviceProps::cpu();
  cfg.max_num_reqs = 8;
  cfg.max_num_tokens = 64;
  cfg.max_blocks_per_req = 8;
  be::MetadataBuilder builder(cfg);
  std::vector<int64_t> slots(2);
  for (size_t b = 0; b < 2; ++b) {
    const int64_t pos = seq_lens[b] - 1;
    slots[b] = int64_t(tables[b][size_t(pos / kBlock)]) * kBlock + pos % kBlock;
  }
  be::CommonMetadata common;
  common.num_reqs = 2;
  common.num_actual_tokens = 2;
  common.max_query_len = 1;
  common.max_seq_len = 37;
  common.query_start_loc = cu_q;
  common.seq_lens = seq_lens;
  common.block_table = *p.block_table;
  common.slot_mapping = fs::TensorRef::contiguous(slots.data(), fs::DType::i64, {2});
  const be::AttentionMetadata& md = builder.build(common);

  be::AttentionLayer layer(spec);
  std::vector<uint8_t> ws_bytes(layer.workspace_bytes(cfg));
  std::vector<float> key = randn(2 * Hkv * D), value = randn(2 * Hkv * D), out2(q.size(), NAN);
  be::KvCache cache{.key_cache = p.k, .value_cache = p.v};
  layer.forward(md, p.q, fs::TensorRef::contiguous(key.data(), fs::DType::f32, {2, Hkv, D}),
                fs::TensorRef::contiguous(value.data(), fs::DType::f32, {2, Hkv, D}), &cache,
                fs::TensorRef::contiguous(out2.data(), fs::DType::f32, {2, H, D}),
                be::LayerWorkspace{ws_bytes.data(), ws_bytes.size(), {}});
  const double err2 = max_err(out2, q, kc, vc, tables, seq_lens);  // kc/vc now hold the new K/V
  std::printf("backend step (%lld decodes): max |err| vs fp64 %.2e\n", (long long)md.num_decodes, err2);

  bool written = true;  // the layer wrote the step's K/V at the slots
  for (size_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < Hkv * D; ++i)
      written = written && kc[size_t(slots[b] * Hkv * D + i)] == key[size_t(int64_t(b) * Hkv * D + i)] &&
                vc[size_t(slots[b] * Hkv * D + i)] == value[size_t(int64_t(b) * Hkv * D + i)];
  std::printf("backend step: new K/V %s the cache\n", written ? "written to" : "MISSING from");

  const bool ok = err1 < 1e-4 && err2 < 1e-4 && written;
  std::printf("consumer: %s\n", ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
