// Decode context parallelism (SPEC.md §6) on simulated ranks (threads, support/sim_comm):
// W ranks, each holding the KV positions t with (t / I) % W == r of every sequence (I the
// interleave) and H / W query heads, writing their share of the step's new K/V themselves,
// must give what one AttentionLayer gives over the whole cache with every head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "support/checks.hpp"
#include "support/dcp_shard.hpp"
#include "support/host_tensor.hpp"
#include "support/sim_comm.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using fstest::HostTensor;

constexpr int64_t kBs = 16, kD = 64;

using Batch = fstest::DcpBatch;
using Shard = fstest::DcpShard;

// Rank r of W's shard in f32, unwritten slots NaN (support/dcp_shard).
Shard make_shard(const Batch& bt, int W, int r, int64_t il, bool context_only, std::mt19937_64& rng) {
  return fstest::make_dcp_shard(bt, W, r, il, context_only, rng, {kBs, kD, DType::f32, true});
}

be::BuilderConfig config_of(const be::LayerSpec& spec, int W, int r, int64_t il = 1, int threshold = 4) {
  be::BuilderConfig c = fstest::dcp_builder_config(spec, W, r, il, kBs, 64, threshold);
  c.device = fs::DeviceProps::cpu();
  return c;
}

be::CommonMetadata common_of(const Batch& bt, const Shard& s) {
  be::CommonMetadata cm;
  cm.num_reqs = bt.B();
  cm.num_actual_tokens = bt.T();
  cm.max_query_len = bt.q_len;
  cm.max_seq_len = *std::max_element(bt.seq_lens.begin(), bt.seq_lens.end());
  cm.query_start_loc = bt.qsl;
  cm.seq_lens = bt.seq_lens;
  cm.block_table = s.table;
  cm.slot_mapping = s.slots;
  return cm;
}

void expect_close(const TensorRef& got, const TensorRef& want, double atol) {
  int64_t bad = 0;
  std::ostringstream first;
  for (int64_t t = 0; t < got.size(0); ++t)
    for (int64_t h = 0; h < got.size(1); ++h)
      for (int64_t c = 0; c < got.size(2); ++c) {
        const double x = fs::numeric::load_double(got.at(t, h, c), got.dtype);
        const double y = fs::numeric::load_double(want.at(t, h, c), want.dtype);
        if (std::isfinite(x) && std::fabs(x - y) <= atol) continue;
        if (bad++ < 5) first << " [" << t << "," << h << "," << c << "] got " << x << " want " << y << ";";
      }
  EXPECT_EQ(bad, 0) << "mismatches:" << first.str();
}

struct DcpCase {
  int world = 2;
  int64_t heads_per_rank = 2, H_kv = 2, q_len = 1;
  bool sinks = false;
  int64_t interleave = 1;
  DType out = DType::f32;  // bf16: the fp32 sum is converted to out's dtype
  int threshold = 4;       // reorder_batch_threshold: below q_len, the requests are the prefill part
};

void run_case(const DcpCase& c) {
  SCOPED_TRACE(::testing::Message() << "world " << c.world << " H_local " << c.heads_per_rank << " H_kv " << c.H_kv
                                    << " q_len " << c.q_len << " interleave " << c.interleave
                                    << (c.sinks ? " sinks" : ""));
  auto rng = fstest::make_rng(fstest::test_salt() + uint64_t(c.world * 1000 + c.heads_per_rank * 100 + c.H_kv * 10 + c.q_len));
  const int W = c.world;
  const int64_t Hl = c.heads_per_rank, H = W * Hl;
  Batch bt;
  bt.q_len = c.q_len;
  bt.H_kv = c.H_kv;
  bt.seq_lens = {37, int32_t(c.q_len), 100, 64, 5 + int32_t(c.q_len), 129};
  for (int32_t len : bt.seq_lens) {
    bt.qsl.push_back(bt.qsl.back() + int32_t(c.q_len));
    bt.k.push_back(HostTensor::zeros(DType::f32, {len, c.H_kv, kD}));
    bt.v.push_back(HostTensor::zeros(DType::f32, {len, c.H_kv, kD}));
    fstest::fill_uniform(bt.k.back(), rng, -1.0f, 1.0f);
    fstest::fill_uniform(bt.v.back(), rng, -1.0f, 1.0f);
  }
  const int64_t T = bt.T();
  HostTensor q = HostTensor::zeros(DType::f32, {T, H, kD}), sinks = HostTensor::zeros(DType::f32, {H});
  fstest::fill_uniform(q, rng, -1.0f, 1.0f);
  fstest::fill_uniform(sinks, rng, -1.0f, 2.0f);
  auto [key, value] = fstest::dcp_new_kv(bt, kD, DType::f32);  // the step's new K/V [T, H_kv, D]

  // One rank with every head over the whole cache.
  be::LayerSpec full;
  full.num_heads = H;
  full.num_kv_heads = c.H_kv;
  full.head_size = kD;
  full.dtype = DType::f32;
  if (c.sinks) full.sinks = sinks.ref;
  const Shard whole = make_shard(bt, 1, 0, 1, false, rng);
  be::MetadataBuilder mb(config_of(full, 1, 0));
  const be::AttentionLayer layer(full);
  std::vector<unsigned char> ws(layer.workspace_bytes(mb.config()));
  HostTensor ref = HostTensor::zeros(DType::f32, {T, H, kD});
  const be::KvCache whole_cache = whole.cache();
  layer.forward(mb.build(common_of(bt, whole)), q.ref, std::nullopt, std::nullopt, &whole_cache, ref,
                be::LayerWorkspace{ws.data(), ws.size()});

  // W ranks, each with its heads and its KV shard.
  std::vector<Shard> shards;
  std::vector<std::unique_ptr<be::MetadataBuilder>> builders;
  std::vector<const be::AttentionMetadata*> mds;
  std::vector<HostTensor> outs;
  std::vector<be::LayerSpec> specs;
  for (int r = 0; r < W; ++r) {
    be::LayerSpec s = full;
    s.num_heads = Hl;
    if (c.sinks) s.sinks = sinks.ref.slice(0, r * Hl, (r + 1) * Hl);
    specs.push_back(s);
    shards.push_back(make_shard(bt, W, r, c.interleave, true, rng));
    builders.push_back(std::make_unique<be::MetadataBuilder>(config_of(s, W, r, c.interleave, c.threshold)));
    outs.push_back(HostTensor::zeros(c.out, {T, Hl, kD}));
    fstest::poison_storage(outs.back());
  }
  for (int r = 0; r < W; ++r) mds.push_back(&builders[size_t(r)]->build(common_of(bt, shards[size_t(r)])));
  EXPECT_EQ(mds[0]->num_prefills, c.q_len > c.threshold ? bt.B() : 0);
  fstest::SimGroup group(W);
  group.run([&](fstest::SimComm& comm) {
    const int r = comm.rank();
    const be::DcpAttentionLayer dcp(specs[size_t(r)], comm);
    std::vector<unsigned char> rws(dcp.workspace_bytes(builders[size_t(r)]->config()));
    dcp.forward(*mds[size_t(r)], q.ref.slice(1, r * Hl, (r + 1) * Hl), key.ref, value.ref, shards[size_t(r)].cache(),
                outs[size_t(r)], be::LayerWorkspace{rws.data(), rws.size()});
  });
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    expect_close(outs[size_t(r)].ref, ref.ref.slice(1, r * Hl, (r + 1) * Hl), c.out == DType::f32 ? 2e-5 : 1e-2);
  }
}

// Cases: {world, heads per rank, H_kv, q_len, sinks, interleave, out dtype}; H_kv divides the
// gathered heads (world x heads per rank).
TEST(DecodeContextParallel, TwoRanksMatchOneRank) {
  run_case({2, 2, 2, 1, false});  // each rank's heads read one KV head
  run_case({2, 4, 1, 1, true});   // MQA
  run_case({2, 4, 4, 1, true});   // each rank's heads read two KV heads
}

TEST(DecodeContextParallel, FourRanksMatchOneRank) {
  run_case({4, 2, 2, 1, false});  // two ranks' heads share each KV head
  run_case({4, 2, 1, 1, true});
}

TEST(DecodeContextParallel, SpeculativeDecodeQueriesSeeTheirGlobalPositions) {
  run_case({2, 2, 2, 3, false});
  run_case({4, 4, 2, 2, true});
}

TEST(DecodeContextParallel, InterleavedShardsMatchOneRank) {
  run_case({2, 2, 2, 1, false, 4});
  run_case({3, 2, 3, 1, true, 16});   // interleave = block size
  run_case({3, 2, 2, 1, true, 16});   // 2 heads per rank, 3 per KV head: a call per KV head
  run_case({2, 4, 2, 3, false, 2});   // verify: causal across interleaved runs
  run_case({3, 2, 1, 4, true, 5});    // interleave not dividing the block size
  run_case({2, 2, 2, 2, false, 8, DType::bf16});  // bf16 out
}

TEST(DecodeContextParallel, ChunkedPrefillPartIsCausalAcrossRanks) {
  run_case({2, 2, 2, 5, false, 1, DType::f32, 1});
  run_case({3, 2, 1, 6, true, 4, DType::f32, 1});
}

TEST(DecodeContextParallel, LayoutFunctionsAgree) {
  for (int W : {1, 2, 3, 4})
    for (int64_t il : {1, 2, 3, 16})
      for (int r = 0; r < W; ++r) {
        int64_t count = 0;
        for (int64_t pos = 0; pos < 200; ++pos) {
          EXPECT_EQ(be::DcpAttentionLayer::local_len(pos, W, r, il), count) << W << " " << il << " " << r << " " << pos;
          if (be::DcpAttentionLayer::owner(pos, W, il) == r) {
            EXPECT_EQ(be::DcpAttentionLayer::local_index(pos, W, il), count);
            ++count;
          }
        }
      }
}

TEST(DecodeContextParallel, MetadataOfAnotherRankIsRejected) {
  be::LayerSpec s;
  s.num_heads = 2;
  s.num_kv_heads = 2;
  s.head_size = kD;
  s.dtype = DType::f32;
  be::MetadataBuilder mb(config_of(s, 2, 0));
  std::vector<int32_t> qsl{0, 1}, seq{5};
  HostTensor table = HostTensor::zeros(DType::i32, {1, 4}), slots = HostTensor::zeros(DType::i64, {1});
  be::CommonMetadata cm;
  cm.num_reqs = 1;
  cm.num_actual_tokens = 1;
  cm.max_query_len = 1;
  cm.max_seq_len = 5;
  cm.query_start_loc = qsl;
  cm.seq_lens = seq;
  cm.block_table = table;
  cm.slot_mapping = slots;
  const be::AttentionMetadata& md = mb.build(cm);
  const be::DcpAttentionLayer other(s, 2, 1);
  HostTensor q_all = HostTensor::zeros(DType::f32, {2, 1, 2, kD}), out_all = HostTensor::zeros(DType::f32, {2, 1, 2, kD});
  HostTensor lse = HostTensor::zeros(DType::f32, {4, 1});
  HostTensor kc = HostTensor::zeros(DType::f32, {4, kBs, 2, kD}), vc = HostTensor::zeros(DType::f32, {4, kBs, 2, kD});
  try {
    other.attend(md, q_all, be::KvCache{.key_cache = kc.ref, .value_cache = vc.ref}, out_all, lse, {});
    ADD_FAILURE() << "expected an error";
  } catch (const fs::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 of 2"), std::string::npos) << e.what();
  }
}

TEST(DecodeContextParallel, AFailingRankDoesNotHangTheOthers) {
  fstest::SimGroup group(3);
  HostTensor in = HostTensor::zeros(DType::f32, {4}), out = HostTensor::zeros(DType::f32, {3, 4});
  EXPECT_THROW(group.run([&](fstest::SimComm& comm) {
    if (comm.rank() == 1) throw fs::Error("rank 1 fails");
    comm.all_gather(in, out);
  }),
               fs::Error);
}

}  // namespace
