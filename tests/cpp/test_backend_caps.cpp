// Backend capabilities (SPEC.md §6): head sizes, dtypes, KV-cache dtypes, block sizes,
// compute capability, the first failing property; vLLM's cache shape and stride orders
// applied to real layouts; layer windows; the decode-first reorder.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/status.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using be::Capabilities;
using fs::DType;
using fs::TensorRef;

fs::DeviceProps cuda_props(int major, int minor) {
  fs::DeviceProps d;
  d.device = fs::Device{fs::DeviceType::cuda, 0};
  d.cc_major = major;
  d.cc_minor = minor;
  return d;
}

be::LayerSpec good_spec() {
  be::LayerSpec s;
  s.num_heads = 8;
  s.num_kv_heads = 2;
  s.head_size = 128;
  s.dtype = DType::bf16;
  return s;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

TEST(BackendCaps, HeadSizes) {
  const std::vector<int64_t> sizes = Capabilities::supported_head_sizes();
  ASSERT_EQ(sizes.size(), 32u);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(sizes[i], int64_t(8 * (i + 1)));
  for (int64_t d = -8; d <= 272; ++d) {
    const bool want = d >= 8 && d <= 256 && d % 8 == 0;
    EXPECT_EQ(Capabilities::supports_head_size(d), want) << d;
    EXPECT_EQ(Capabilities::supports_head_size(d, d), want) << d;
  }
  EXPECT_TRUE(Capabilities::supports_head_size(192, 128));  // MLA prefill
  EXPECT_TRUE(Capabilities::supports_head_size(64, 512));   // MLA absorbed decode (q_v)
  EXPECT_TRUE(Capabilities::supports_head_size(576, 512));  // the same, as the latent width
  EXPECT_FALSE(Capabilities::supports_head_size(128, 64));
  EXPECT_FALSE(Capabilities::supports_head_size(128, 192));
  EXPECT_FALSE(Capabilities::supports_head_size(576));
}

TEST(BackendCaps, DtypesBlockSizesComputeCapability) {
  const auto cpu = Capabilities::supported_dtypes(fs::DeviceProps::cpu());
  const auto gpu = Capabilities::supported_dtypes(cuda_props(9, 0));
  auto has = [](const std::vector<DType>& v, DType t) { return std::find(v.begin(), v.end(), t) != v.end(); };
  EXPECT_TRUE(has(cpu, DType::f16) && has(cpu, DType::bf16) && has(cpu, DType::f32));
  EXPECT_TRUE(has(gpu, DType::f16) && has(gpu, DType::bf16));
  EXPECT_FALSE(has(gpu, DType::f32));
  EXPECT_FALSE(has(cpu, DType::f8e4m3));

  const std::vector<std::string> want{"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int8_k8v16"};
  EXPECT_EQ(Capabilities::supported_kv_cache_dtypes(), want);
  for (const std::string& s : want) EXPECT_NO_THROW(fs::parse_kv_cache_dtype(s)) << s;

  EXPECT_FALSE(Capabilities::supports_block_size(0));
  EXPECT_FALSE(Capabilities::supports_block_size(-16));
  for (int64_t bs : {1, 3, 16, 32, 64, 128, 1000}) EXPECT_TRUE(Capabilities::supports_block_size(bs)) << bs;

  EXPECT_TRUE(Capabilities::supports_compute_capability(fs::DeviceProps::cpu()));
  EXPECT_FALSE(Capabilities::supports_compute_capability(cuda_props(7, 5)));
  EXPECT_TRUE(Capabilities::supports_compute_capability(cuda_props(8, 0)));
  EXPECT_TRUE(Capabilities::supports_compute_capability(cuda_props(9, 0)));
  EXPECT_TRUE(Capabilities::supports_compute_capability(cuda_props(10, 0)));
  EXPECT_TRUE(Capabilities::supports_sinks());
}

TEST(BackendCaps, UnsupportedReasonNamesTheFirstFailingProperty) {
  const auto h200 = cuda_props(9, 0);
  EXPECT_EQ(Capabilities::unsupported_reason(good_spec(), 16, h200), "");
  EXPECT_EQ(Capabilities::unsupported_reason(good_spec(), 1, fs::DeviceProps::cpu()), "");

  be::LayerSpec s = good_spec();
  s.head_size = 20;
  s.dtype = DType::f32;  // also bad on CUDA, but the head size comes first
  EXPECT_TRUE(starts_with(Capabilities::unsupported_reason(s, 0, cuda_props(7, 0)), "head size 20:"));
  s.head_size = 192;
  s.head_size_v = 64;
  EXPECT_TRUE(starts_with(Capabilities::unsupported_reason(s, 16, h200), "head sizes 192/64:"));
  s.head_size_v = 128;
  s.dtype = DType::bf16;
  EXPECT_EQ(Capabilities::unsupported_reason(s, 16, h200), "");

  s = good_spec();
  s.num_kv_heads = 3;
  EXPECT_TRUE(starts_with(Capabilities::unsupported_reason(s, 16, h200), "num_kv_heads 3:"));

  s = good_spec();
  s.dtype = DType::f32;
  EXPECT_TRUE(starts_with(Capabilities::unsupported_reason(s, 0, h200), "dtype float32:"));
  EXPECT_TRUE(starts_with(Capabilities::unsupported_reason(s, 0, fs::DeviceProps::cpu()), "block size 0:"));
  EXPECT_EQ(Capabilities::unsupported_reason(s, 16, fs::DeviceProps::cpu()), "");

  EXPECT_TRUE(
      starts_with(Capabilities::unsupported_reason(good_spec(), 16, cuda_props(7, 5)), "compute capability 7.5:"));
}

TEST(BackendCaps, KvCacheShape) {
  const auto shape = be::kv_cache_shape(100, 16, 4, 128);
  EXPECT_EQ(shape, (std::array<int64_t, 5>{2, 100, 16, 4, 128}));
}

// The physical layout is the logical shape permuted by the order: physical[i] =
// logical[order[i]]. Allocate the physical layout contiguously, view it back in the logical
// order, and check each element's address against the layout's own formula.
TEST(BackendCaps, StrideOrderGivesThePhysicalLayout) {
  const int64_t L = 3, nb = 5, bs = 4, H = 2, D = 8;
  for (fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
    for (bool layers : {false, true}) {
      const std::vector<int> order = be::kv_cache_stride_order(layout, layers);
      std::vector<int64_t> logical{2, nb, bs, H, D};
      if (layers) logical.insert(logical.begin(), L);
      ASSERT_EQ(order.size(), logical.size());
      std::vector<int> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      for (size_t i = 0; i < sorted.size(); ++i) ASSERT_EQ(sorted[i], int(i));

      // Contiguous strides of the physical shape, mapped back to the logical dims.
      std::vector<int64_t> stride(logical.size());
      int64_t s = 1;
      for (int i = int(order.size()) - 1; i >= 0; --i) {
        stride[size_t(order[size_t(i)])] = s;
        s *= logical[size_t(order[size_t(i)])];
      }
      for (int64_t l = 0; l < (layers ? L : 1); ++l)
        for (int64_t kv = 0; kv < 2; ++kv)
          for (int64_t b = 0; b < nb; ++b)
            for (int64_t t = 0; t < bs; ++t)
              for (int64_t h = 0; h < H; ++h)
                for (int64_t d = 0; d < D; d += 3) {
                  std::vector<int64_t> idx{kv, b, t, h, d};
                  if (layers) idx.insert(idx.begin(), l);
                  int64_t off = 0;
                  for (size_t i = 0; i < idx.size(); ++i) off += idx[i] * stride[i];
                  int64_t want;
                  const bool nhd = layout == fs::KvLayout::nhd;
                  if (!layers)  // (2, nb, bs, H, D) or (2, nb, H, bs, D)
                    want = nhd ? (((kv * nb + b) * bs + t) * H + h) * D + d
                               : (((kv * nb + b) * H + h) * bs + t) * D + d;
                  else  // (nb, L, 2, bs, H, D) or (nb, H, L, 2, bs, D)
                    want = nhd ? ((((b * L + l) * 2 + kv) * bs + t) * H + h) * D + d
                               : ((((b * H + h) * L + l) * 2 + kv) * bs + t) * D + d;
                  ASSERT_EQ(off, want) << "layout " << int(layout) << " layers " << layers;
                }
    }
  }
  EXPECT_EQ(be::kv_cache_stride_order(fs::KvLayout::nhd, false), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(be::kv_cache_stride_order(fs::KvLayout::hnd, false), (std::vector<int>{0, 1, 3, 2, 4}));
  EXPECT_EQ(be::kv_cache_stride_order(fs::KvLayout::nhd, true), (std::vector<int>{2, 0, 1, 3, 4, 5}));
  EXPECT_EQ(be::kv_cache_stride_order(fs::KvLayout::hnd, true), (std::vector<int>{2, 4, 0, 1, 3, 5}));
}

TEST(BackendCaps, LayerWindow) {
  be::LayerSpec s = good_spec();
  for (be::AttnType t : {be::AttnType::decoder, be::AttnType::encoder, be::AttnType::encoder_only,
                         be::AttnType::encoder_decoder}) {
    s.type = t;
    s.sliding_window = 0;
    EXPECT_TRUE(be::layer_window(s).unbounded());
    EXPECT_EQ(be::layer_window(s).left, -1);
    EXPECT_EQ(be::layer_window(s).right, -1);
    s.sliding_window = 4096;
    const fs::Window w = be::layer_window(s);
    const bool bidirectional = t == be::AttnType::encoder || t == be::AttnType::encoder_only;
    EXPECT_EQ(w.left, 4095);
    EXPECT_EQ(w.right, bidirectional ? 4095 : 0);
  }
  s.type = be::AttnType::decoder;
  s.sliding_window = 1;
  EXPECT_EQ(be::layer_window(s).left, 0);
  EXPECT_EQ(be::layer_window(s).right, 0);
}

TEST(BackendCaps, ReorderDecodesFirst) {
  const std::vector<int32_t> q{3, 1, 1, 5, 1, 2};
  EXPECT_EQ(be::reorder_decodes_first(q, 1), (std::vector<int32_t>{1, 2, 4, 0, 3, 5}));
  EXPECT_EQ(be::reorder_decodes_first(q, 2), (std::vector<int32_t>{1, 2, 4, 5, 0, 3}));
  EXPECT_EQ(be::reorder_decodes_first(q, 0), (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(be::reorder_decodes_first({}, 1).empty());

  auto rng = fstest::make_rng(0xca95);
  for (int it = 0; it < 200; ++it) {
    const int n = int(rng() % 40);
    const int thr = int(rng() % 4);
    std::vector<int32_t> lens(static_cast<size_t>(n));
    for (auto& x : lens) x = int32_t(rng() % 6);
    const std::vector<int32_t> order = be::reorder_decodes_first(lens, thr);
    std::vector<int32_t> want;  // brute force: a stable sort on (query_len > threshold)
    for (int i = 0; i < n; ++i) want.push_back(i);
    std::stable_sort(want.begin(), want.end(),
                     [&](int a, int b) { return (lens[size_t(a)] > thr) < (lens[size_t(b)] > thr); });
    ASSERT_EQ(order, want);
  }
}
