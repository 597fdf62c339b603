// CUDA graphs: a paged decode varlen_attention with split-KV (> 1 split, preallocated
// workspace, a precomputed plan) captured once, then replayed over changing batches: new
// seqused_k and block_table contents written into the same device buffers (same shapes and
// capacities). Each replay must equal an eager run bit for bit, and the CPU reference under
// the same plan within rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_attention_case.hpp"

using flashserve::DType;
namespace fs = flashserve;

namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

constexpr int64_t kBatch = 8, kCapacity = 1024, kBlock = 16;

fstest::CaseConfig decode_config() {
  fstest::CaseConfig c;
  c.mode = fstest::KvMode::varlen_paged;
  c.block_size = kBlock;
  c.H = 8, c.H_kv = 2, c.D = c.Dv = 128;
  c.q_dtype = c.kv_dtype = c.out_dtype = DType::bf16;
  c.q_lens.assign(kBatch, 1);
  c.k_lens.assign(kBatch, kCapacity);  // full capacity: every table entry a data block
  c.random_block_ids = true;
  c.table_row_pad = 3;
  c.lse = true;
  c.sinks = true;
  c.num_splits = 4;
  return c;
}

// A new batch in the same buffers: lengths in [0, capacity], the data blocks dealt anew.
void new_batch(fstest::AttentionCase& ac, std::mt19937_64& rng, const std::vector<int32_t>& data_blocks) {
  std::vector<int32_t> ids = data_blocks;
  std::shuffle(ids.begin(), ids.end(), rng);
  const int64_t cols = kCapacity / kBlock;
  size_t next = 0;
  for (int64_t b = 0; b < kBatch; ++b) {
    const int64_t len = b == 0 ? 0 : std::uniform_int_distribution<int64_t>(0, kCapacity)(rng);
    *static_cast<int32_t*>(ac.params.seqused_k->at(b)) = int32_t(len);
    ac.seqs[size_t(b)].sk = len;  // the reference comparison reads lengths from here
    for (int64_t j = 0; j < cols; ++j) *static_cast<int32_t*>(ac.params.block_table->at(b, j)) = ids[next++];
  }
}

std::vector<unsigned char> bytes_of(const fstest::HostTensor& h) { return *h.bytes; }

}  // namespace

TEST(GpuGraph, SplitKvDecodeReplaysMatchEagerRuns) {
  auto rng = fstest::make_rng(0x67a9400d);
  fstest::AttentionCase ac = fstest::build_case(decode_config(), rng);
  std::vector<int32_t> data_blocks;
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t j = 0; j < kCapacity / kBlock; ++j)
      data_blocks.push_back(*static_cast<const int32_t*>(ac.params.block_table->at(b, j)));
  const fsgpu::DeviceCase dc = fsgpu::mirror_case(ac);
  const fs::Plan plan = fsgpu::plan_case(ac, dc.params);
  ASSERT_GT(plan.num_splits, 1) << "the graph must capture the split-KV path";
  const auto ws = fsgpu::device_alloc(plan.workspace.total_bytes);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fs::ExecContext ctx;
  ctx.stream = stream;
  ctx.workspace = ws.get();
  ctx.workspace_bytes = plan.workspace.total_bytes;
  ctx.plan = &plan;
  const std::string kernel = fs::attention_kernel_name(dc.params, false, fs::kernels::cuda_device_props(0));
  fs::varlen_attention(dc.params, ctx);  // warm-up: device properties, module load
  CUDA_OK(cudaStreamSynchronize(stream));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    fs::varlen_attention(dc.params, ctx);
  } catch (const std::exception& e) {
    cudaStreamEndCapture(stream, &graph);
    FAIL() << "varlen_attention threw during capture: " << e.what();
  }
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 6; ++replay) {
    new_batch(ac, rng, data_blocks);
    dc.upload(ac);
    const auto cpu = fsgpu::run_cpu(ac, plan);

    fsgpu::poison(dc.mirror_of(ac.out));
    fsgpu::poison(dc.mirror_of(ac.lse));
    fsgpu::sync();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    dc.mirror_of(ac.out).copy_to(ac.out);
    dc.mirror_of(ac.lse).copy_to(ac.lse);
    const auto graph_out = bytes_of(ac.out), graph_lse = bytes_of(ac.lse);
    EXPECT_EQ(fsgpu::compare_with_cpu(ac, cpu.first, cpu.second, fsgpu::kernel_rounds_p(kernel, ac.cfg),
                                      fsgpu::kernel_error(kernel, ac.cfg)),
              "")
        << "replay " << replay;

    fsgpu::run_gpu(ac, dc, ctx);  // eager, same buffers
    EXPECT_TRUE(graph_out == bytes_of(ac.out)) << "replay " << replay << ": out differs from the eager run";
    EXPECT_TRUE(graph_lse == bytes_of(ac.lse)) << "replay " << replay << ": lse differs from the eager run";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}
