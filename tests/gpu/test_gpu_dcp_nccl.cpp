// Decode context parallelism over NCCL (backend::NcclCommunicator), one thread per GPU (needs
// >= 2 GPUs and a FLASHSERVE_NCCL build; skipped otherwise): W ranks, each holding the KV
// positions t with (t / I) % W == r and H / W query heads, writing their share of the step's
// K/V, give the CPU single-device layer's result (every head over the whole cache), and the
// same bits on a second run (num_splits = 1). The queries are head slices of one [T, H, D]
// tensor, so the all-gather packs strided rows.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <thread>
#include <vector>

#include "flashserve/backend_variants.hpp"
#include "flashserve/nccl.hpp"
#include "flashserve/status.hpp"
#include "kernels/device_info.hpp"
#include "support/checks.hpp"
#include "support/device_tensor.hpp"
#include "support/dcp_shard.hpp"
#include "support/host_tensor.hpp"

#if FLASHSERVE_WITH_NCCL
#include <nccl.h>
#endif

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using fsgpu::DeviceTensor;
using fstest::HostTensor;

constexpr int64_t kBs = 16, kD = 128;
constexpr DType kAct = DType::bf16;

using Batch = fstest::DcpBatch;
using Shard = fstest::DcpShard;

// Rank r of W's shard in the activation dtype (support/dcp_shard).
Shard make_shard(const Batch& bt, int W, int r, int64_t il, bool context_only, std::mt19937_64& rng) {
  return fstest::make_dcp_shard(bt, W, r, il, context_only, rng, {kBs, kD, kAct, false});
}

be::BuilderConfig config_of(const be::LayerSpec& spec, int W, int r, int64_t il, const fs::DeviceProps& dev,
                            void* stream) {
  be::BuilderConfig c = fstest::dcp_builder_config(spec, W, r, il, kBs, 192, 4);
  c.num_splits = 1;
  c.device = dev;
  c.stream = stream;
  return c;
}

be::CommonMetadata common_of(const Batch& bt, const TensorRef& table, const TensorRef& slots) {
  be::CommonMetadata cm;
  cm.num_reqs = bt.B();
  cm.num_actual_tokens = bt.T();
  cm.max_query_len = bt.q_len;
  cm.max_seq_len = *std::max_element(bt.seq_lens.begin(), bt.seq_lens.end());
  cm.query_start_loc = bt.qsl;
  cm.seq_lens = bt.seq_lens;
  cm.block_table = table;
  cm.slot_mapping = slots;
  return cm;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw fs::RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}

// A mirror of h on GPU `dev` (the current device must be dev).
DeviceTensor on(const HostTensor& h, int dev) {
  DeviceTensor d = DeviceTensor::mirror(h);
  d.ref.device = fs::Device{fs::DeviceType::cuda, dev};
  return d;
}

struct NcclCase {
  int64_t heads_per_rank = 2, H_kv = 2, q_len = 1, interleave = 1;
};

void run_case(int W, const NcclCase& c) {
#if FLASHSERVE_WITH_NCCL
  SCOPED_TRACE(::testing::Message() << "world " << W << " H_local " << c.heads_per_rank << " H_kv " << c.H_kv
                                    << " q_len " << c.q_len << " interleave " << c.interleave);
  auto rng = fstest::make_rng(fstest::test_salt() + uint64_t(W * 1000 + c.q_len * 10 + c.interleave));
  const int64_t Hl = c.heads_per_rank, H = W * Hl;
  Batch bt;
  bt.q_len = c.q_len;
  bt.H_kv = c.H_kv;
  bt.seq_lens = {37, int32_t(c.q_len), 1000, 64, 5 + int32_t(c.q_len), 2049};
  for (int32_t len : bt.seq_lens) {
    bt.qsl.push_back(bt.qsl.back() + int32_t(c.q_len));
    bt.k.push_back(HostTensor::zeros(kAct, {len, c.H_kv, kD}));
    bt.v.push_back(HostTensor::zeros(kAct, {len, c.H_kv, kD}));
    fstest::fill_uniform(bt.k.back(), rng, -1.0f, 1.0f);
    fstest::fill_uniform(bt.v.back(), rng, -1.0f, 1.0f);
  }
  const int64_t T = bt.T();
  HostTensor q = HostTensor::zeros(kAct, {T, H, kD});
  fstest::fill_uniform(q, rng, -1.0f, 1.0f);
  auto [key, value] = fstest::dcp_new_kv(bt, kD, kAct);  // the step's new K/V [T, H_kv, D]

  // The single-device result on the CPU: every head over the whole cache.
  be::LayerSpec full;
  full.num_heads = H;
  full.num_kv_heads = c.H_kv;
  full.head_size = kD;
  full.dtype = kAct;
  const Shard whole = make_shard(bt, 1, 0, 1, false, rng);
  be::MetadataBuilder mb(config_of(full, 1, 0, 1, fs::DeviceProps::cpu(), nullptr));
  const be::AttentionLayer layer(full);
  std::vector<unsigned char> ws(layer.workspace_bytes(mb.config()));
  HostTensor ref = HostTensor::zeros(kAct, {T, H, kD});
  const be::KvCache whole_cache{whole.kc.ref, whole.vc.ref, {}, {}, {}, {}};
  layer.forward(mb.build(common_of(bt, whole.table, whole.slots)), q.ref, std::nullopt, std::nullopt, &whole_cache,
                ref, be::LayerWorkspace{ws.data(), ws.size()});

  std::vector<Shard> shards;
  for (int r = 0; r < W; ++r) shards.push_back(make_shard(bt, W, r, c.interleave, true, rng));
  std::vector<ncclComm_t> comms(static_cast<size_t>(W));
  std::vector<int> devs(static_cast<size_t>(W));
  std::iota(devs.begin(), devs.end(), 0);
  ASSERT_EQ(ncclCommInitAll(comms.data(), W, devs.data()), ncclSuccess);
  std::vector<HostTensor> outs, outs2;
  for (int r = 0; r < W; ++r) {
    outs.push_back(HostTensor::zeros(kAct, {T, Hl, kD}));
    outs2.push_back(HostTensor::zeros(kAct, {T, Hl, kD}));
  }
  std::vector<std::string> errors(static_cast<size_t>(W));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      try {
        check_cuda(cudaSetDevice(r), "cudaSetDevice");
        cudaStream_t stream;
        check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
        be::NcclCommunicator comm(comms[size_t(r)], true);
        be::LayerSpec spec = full;
        spec.num_heads = Hl;
        const Shard& sh = shards[size_t(r)];
        be::MetadataBuilder builder(config_of(spec, W, r, c.interleave, fs::kernels::cuda_device_props(r), stream));
        const DeviceTensor table = on(sh.table, r), slots = on(sh.slots, r), dq = on(q, r), dk = on(key, r),
                           dv = on(value, r);
        const be::AttentionMetadata& md = builder.build(common_of(bt, table.ref, slots.ref));
        const be::DcpAttentionLayer dcp(spec, comm);
        const auto wsp = fsgpu::device_alloc(dcp.workspace_bytes(builder.config()));
        const be::LayerWorkspace lws{wsp.get(), dcp.workspace_bytes(builder.config()), fs::Device{fs::DeviceType::cuda, r}};
        fs::ExecContext ctx;
        ctx.stream = stream;
        for (HostTensor* dst : {&outs[size_t(r)], &outs2[size_t(r)]}) {
          const DeviceTensor kc = on(sh.kc, r), vc = on(sh.vc, r);  // a fresh shard per run
          DeviceTensor out = on(*dst, r);
          fsgpu::poison(out);
          dcp.forward(md, dq.ref.slice(1, r * Hl, (r + 1) * Hl), dk.ref, dv.ref, be::KvCache{.key_cache = kc.ref, .value_cache = vc.ref},
                      out.ref, lws, ctx);
          check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
          out.copy_to(*dst);
        }
        check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < W; ++r) ASSERT_EQ(errors[size_t(r)], "") << "rank " << r;
  for (int r = 0; r < W; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    int64_t bad = 0, differ = 0;
    std::ostringstream first;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hl; ++h)
        for (int64_t d = 0; d < kD; ++d) {
          const double x = outs[size_t(r)].get({t, h, d}), y = ref.get({t, r * Hl + h, d});
          differ += std::memcmp(outs[size_t(r)].ref.at(t, h, d), outs2[size_t(r)].ref.at(t, h, d), 2) != 0;
          if (std::isfinite(x) && std::fabs(x - y) <= 2e-2) continue;
          if (bad++ < 5) first << " [" << t << "," << h << "," << d << "] got " << x << " want " << y << ";";
        }
    EXPECT_EQ(bad, 0) << "mismatches:" << first.str();
    EXPECT_EQ(differ, 0) << "two runs differ";
  }
#else
  (void)W;
  (void)c;
#endif
}

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

TEST(GpuDcpNccl, RanksMatchOneDevice) {
  if (!FLASHSERVE_WITH_NCCL) GTEST_SKIP() << "built without NCCL (FLASHSERVE_NCCL=ON)";
  const int n = visible_gpus();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  for (int W : {2, 4, 8}) {
    if (W > n) break;
    run_case(W, {2, 2, 1, 1});
    run_case(W, {4, 8, 1, 16});  // every rank holds all 8 KV heads (GQA 32/8 layout at W = 8)
    run_case(W, {2, 1, 3, 4});   // verify steps, interleaved shards
  }
}

}  // namespace
