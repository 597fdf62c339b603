// The tree-speculation metadata operations on CUDA (spec_metadata.hpp) against the CPU
// reference, on device mirrors of the same host operands (outputs poisoned on both sides, page
// tables with untouched columns and padded rows, compared byte for byte over their whole
// storage): random batches past one block of requests / rows (the single-block scans loop),
// int32 and int64 indices, padded graph batches; out-of-range contents read as 0 on the device;
// validate_only writes nothing; a CUDA-graph capture of all three equals eager runs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flashserve/spec_metadata.hpp"
#include "flashserve/status.hpp"
#include "support/captured_graph.hpp"
#include "support/checks.hpp"
#include "support/device_tensor.hpp"
#include "support/spec_operands.hpp"

namespace {

namespace fs = flashserve;
using fs::DType;
using fsgpu::DeviceTensor;
using fstest::HostTensor;
using fstest::seed_note;
using fstest::uniform_int;

std::vector<HostTensor*> inputs_of(fstest::DraftExpandCase& c) { return {&c.out_cache_loc}; }
std::vector<HostTensor*> inputs_of(fstest::VerifyExpandCase& c) {
  return {&c.custom_mask, &c.req_to_token, &c.req_pool_indices, &c.seq_lens};
}
std::vector<HostTensor*> inputs_of(fstest::WindowCase& c) {
  return {&c.page_table_a, &c.page_table_b, &c.seq_len_a, &c.seq_len_b};
}

// A host case and its device twin (every view rebased onto a device mirror).
template <class Case>
struct DeviceCase {
  Case host, dev;
  std::vector<DeviceTensor> inputs;
  DeviceTensor page, lens, cu;

  explicit DeviceCase(const Case& c) : host(c), dev(c) {
    for (HostTensor* t : inputs_of(dev)) {
      inputs.push_back(DeviceTensor::mirror(*t));
      t->ref = inputs.back().ref;
    }
    page = DeviceTensor::mirror(host.out.page_table), dev.out.page_table.ref = page.ref;
    lens = DeviceTensor::mirror(host.out.cache_seqlens), dev.out.cache_seqlens.ref = lens.ref;
    cu = DeviceTensor::mirror(host.out.cu_seqlens_k), dev.out.cu_seqlens_k.ref = cu.ref;
  }
  fstest::SpecOutputs download() const {
    return {page.download(host.out.page_table), lens.download(host.out.cache_seqlens), cu.download(host.out.cu_seqlens_k)};
  }
};

void run(const fstest::DraftExpandCase& c, const fs::ExecContext& ctx = {}) { fs::spec_draft_expand(c.params(), ctx); }
void run(const fstest::VerifyExpandCase& c, const fs::ExecContext& ctx = {}) { fs::spec_verify_expand(c.params(), ctx); }
void run(const fstest::WindowCase& c, const fs::ExecContext& ctx = {}) { fs::spec_window_page_table(c.params(), ctx); }

// Every storage byte of the CUDA outputs equals the CPU's (both started poisoned alike).
void expect_same(const fstest::SpecOutputs& cpu, const fstest::SpecOutputs& gpu, const std::string& label) {
  EXPECT_TRUE(fstest::same_bytes(cpu.page_table, *gpu.page_table.bytes)) << label << ": page_table" << seed_note();
  EXPECT_TRUE(fstest::same_bytes(cpu.cache_seqlens, *gpu.cache_seqlens.bytes)) << label << ": cache_seqlens" << seed_note();
  EXPECT_TRUE(fstest::same_bytes(cpu.cu_seqlens_k, *gpu.cu_seqlens_k.bytes)) << label << ": cu_seqlens_k" << seed_note();
}

template <class Case>
void expect_matches_cpu(const Case& c, const std::string& label) {
  DeviceCase<Case> d(c);
  run(d.host);
  run(d.dev);
  fsgpu::sync();
  expect_same(d.host.out, d.download(), label);
}

TEST(GpuSpecMetadata, DraftExpandMatchesCpu) {
  auto rng = fstest::make_rng(fstest::test_salt());
  for (int i = 0; i < 12; ++i) {
    const int64_t rows = i < 2 ? i : uniform_int(rng, 1, 5000), steps = uniform_int(rng, 1, 8);
    expect_matches_cpu(fstest::make_draft_expand(rng, rows, steps, i % 2 ? DType::i64 : DType::i32),
                       "case " + std::to_string(i) + " R=" + std::to_string(rows));
  }
}

TEST(GpuSpecMetadata, VerifyExpandMatchesCpu) {
  auto rng = fstest::make_rng(fstest::test_salt());
  for (int i = 0; i < 16; ++i) {
    const int64_t batch = i < 2 ? i : uniform_int(rng, 1, i % 4 == 0 ? 2500 : 40), drafts = uniform_int(rng, 1, 16);
    expect_matches_cpu(fstest::make_verify_expand(rng, batch, drafts, i % 2 ? DType::i64 : DType::i32, i % 3 == 0),
                       "case " + std::to_string(i) + " B=" + std::to_string(batch) + " n=" + std::to_string(drafts));
  }
}

TEST(GpuSpecMetadata, WindowPageTableMatchesCpu) {
  auto rng = fstest::make_rng(fstest::test_salt());
  for (int i = 0; i < 12; ++i) {
    const int64_t batch = i < 2 ? i : uniform_int(rng, 1, i % 3 == 0 ? 700 : 20), drafts = uniform_int(rng, 1, 8);
    expect_matches_cpu(fstest::make_window(rng, batch, drafts, uniform_int(rng, 0, 600), uniform_int(rng, 0, 16)),
                       "case " + std::to_string(i) + " B=" + std::to_string(batch));
  }
}

// A pool index past req_to_token (which the CPU rejects) reads slots as 0 on the device; the
// other requests' rows and every length are as the CPU computes them for the valid batch.
TEST(GpuSpecMetadata, VerifyExpandOutOfRangeReadsZero) {
  auto rng = fstest::make_rng(fstest::test_salt());
  DeviceCase<fstest::VerifyExpandCase> d(fstest::make_verify_expand(rng, 3, 4, DType::i32, false));
  run(d.host);
  HostTensor bad_index = d.host.req_pool_indices.clone();
  *static_cast<int32_t*>(bad_index.ref.at(0)) = int32_t(d.host.req_to_token.ref.size(0) + 7);
  d.inputs[2].copy_from(bad_index);
  run(d.dev);
  fsgpu::sync();
  const fstest::SpecOutputs got = d.download();
  for (int64_t r = 0; r < 12; ++r)
    for (int64_t k = 0; k < 4; ++k) {
      const int32_t want = r < 4 ? 0 : *static_cast<const int32_t*>(d.host.out.page_table.ref.at(r, k));
      EXPECT_EQ(*static_cast<const int32_t*>(got.page_table.ref.at(r, k)), want) << "row " << r << " col " << k;
    }
  EXPECT_TRUE(fstest::same_bytes(d.host.out.cache_seqlens, *got.cache_seqlens.bytes));
  EXPECT_TRUE(fstest::same_bytes(d.host.out.cu_seqlens_k, *got.cu_seqlens_k.bytes));
}

TEST(GpuSpecMetadata, ValidateOnlyWritesNothing) {
  auto rng = fstest::make_rng(fstest::test_salt());
  DeviceCase<fstest::VerifyExpandCase> v(fstest::make_verify_expand(rng, 5, 3, DType::i64, true));
  DeviceCase<fstest::WindowCase> w(fstest::make_window(rng, 4, 2, 30, 4));
  DeviceCase<fstest::DraftExpandCase> e(fstest::make_draft_expand(rng, 9, 4, DType::i64));
  fs::ExecContext dry;
  dry.validate_only = true;
  run(v.dev, dry), run(w.dev, dry), run(e.dev, dry);
  fsgpu::sync();
  for (const fstest::SpecOutputs& o : {v.download(), w.download(), e.download()})
    for (const HostTensor* t : {&o.page_table, &o.cache_seqlens, &o.cu_seqlens_k}) {
      const std::vector<unsigned char>& bytes = *t->bytes;
      bool poisoned = true;
      for (unsigned char b : bytes) poisoned = poisoned && b == 0xFF;
      EXPECT_TRUE(poisoned) << "written under validate_only";
    }
}

// The three ops captured on a stream and replayed equal eager runs on the same inputs.
TEST(GpuSpecMetadata, GraphReplayEqualsEager) {
  auto rng = fstest::make_rng(fstest::test_salt());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  fs::ExecContext ctx;
  ctx.stream = stream;
  DeviceCase<fstest::DraftExpandCase> e(fstest::make_draft_expand(rng, 300, 5, DType::i64));
  DeviceCase<fstest::VerifyExpandCase> v(fstest::make_verify_expand(rng, 1100, 6, DType::i32, true));
  DeviceCase<fstest::WindowCase> w(fstest::make_window(rng, 200, 4, 100, 6));
  auto all = [&] { run(e.dev, ctx), run(v.dev, ctx), run(w.dev, ctx); };
  fsgpu::CapturedGraph(stream, all).replay();
  const fstest::SpecOutputs replayed[] = {e.download(), v.download(), w.download()};
  for (const DeviceTensor* t : {&e.page, &e.lens, &e.cu, &v.page, &v.lens, &v.cu, &w.page, &w.lens, &w.cu})
    fsgpu::poison(*t);
  fsgpu::sync();
  all();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_same(replayed[0], e.download(), "draft expand: graph vs eager");
  expect_same(replayed[1], v.download(), "verify expand: graph vs eager");
  expect_same(replayed[2], w.download(), "window: graph vs eager");
  run(v.host);  // and the eager CUDA run equals the CPU
  expect_same(v.host.out, v.download(), "verify expand: CUDA vs CPU");
  cudaStreamDestroy(stream);
}

}  // namespace
