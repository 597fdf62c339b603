// What the backend supports (SPEC.md §6) and vLLM's KV-cache shape and stride orders.
#include <string>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/status.hpp"

namespace flashserve::backend {

namespace {

constexpr int64_t kMaxHeadSize = 256;

// MLA (D, Dv) pairs: prefill 192/128; absorbed decode 64 (rope part) with q_v of width 512,
// which engines also report as the latent cache width 576/512.
constexpr int64_t kMlaPairs[][2] = {{192, 128}, {64, 512}, {576, 512}};

bool plain_head_size(int64_t d) { return d >= 8 && d <= kMaxHeadSize && d % 8 == 0; }

std::string head_size_reason(const LayerSpec& spec) {
  if (Capabilities::supports_head_size(spec.head_size, spec.head_size_v)) return "";
  const std::string sizes = spec.head_size_v == 0 || spec.head_size_v == spec.head_size
                                ? detail::cat("head size ", spec.head_size)
                                : detail::cat("head sizes ", spec.head_size, "/", spec.head_size_v);
  return sizes + ": expected a multiple of 8 in [8, 256] (V the same) or an MLA pair 192/128, 64/512, 576/512";
}

std::string dtype_reason(DType t, const DeviceProps& dev) {
  for (DType s : Capabilities::supported_dtypes(dev))
    if (s == t) return "";
  return detail::cat("dtype ", dtype_name(t), ": expected float16 or bfloat16",
                     dev.device.type == DeviceType::cpu ? " or float32" : "", " on ", to_string(dev.device));
}

std::string heads_reason(const LayerSpec& spec) {
  if (spec.num_heads < 1) return detail::cat("num_heads ", spec.num_heads, ": expected >= 1");
  if (spec.num_kv_heads < 1 || spec.num_heads % spec.num_kv_heads != 0)
    return detail::cat("num_kv_heads ", spec.num_kv_heads, ": expected a divisor of num_heads ", spec.num_heads);
  return "";
}

}  // namespace

Window layer_window(const LayerSpec& spec) {
  if (spec.sliding_window <= 0) return {};
  const int left = int(spec.sliding_window - 1);
  const bool bidirectional = spec.type == AttnType::encoder || spec.type == AttnType::encoder_only;
  return {left, bidirectional ? left : 0};
}

std::vector<int64_t> Capabilities::supported_head_sizes() {
  std::vector<int64_t> sizes;
  for (int64_t d = 8; d <= kMaxHeadSize; d += 8) sizes.push_back(d);
  return sizes;
}

bool Capabilities::supports_head_size(int64_t head_size, int64_t head_size_v) {
  if (head_size_v == 0 || head_size_v == head_size) return plain_head_size(head_size);
  for (const auto& p : kMlaPairs)
    if (p[0] == head_size && p[1] == head_size_v) return true;
  return false;
}

std::vector<DType> Capabilities::supported_dtypes(const DeviceProps& dev) {
  if (dev.device.type == DeviceType::cpu) return {DType::f16, DType::bf16, DType::f32};
  return {DType::f16, DType::bf16};
}

std::vector<std::string> Capabilities::supported_kv_cache_dtypes() {
  return {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int8_k8v16"};
}

bool Capabilities::supports_block_size(int64_t block_size) { return block_size >= 1; }

bool Capabilities::supports_compute_capability(const DeviceProps& dev) {
  return dev.device.type == DeviceType::cpu || dev.cc_major >= 8;
}

std::string Capabilities::unsupported_reason(const LayerSpec& spec, int64_t block_size, const DeviceProps& dev) {
  if (std::string r = head_size_reason(spec); !r.empty()) return r;
  if (std::string r = heads_reason(spec); !r.empty()) return r;
  if (std::string r = dtype_reason(spec.dtype, dev); !r.empty()) return r;
  if (!supports_block_size(block_size)) return detail::cat("block size ", block_size, ": expected >= 1");
  if (!supports_compute_capability(dev))
    return detail::cat("compute capability ", dev.cc_major, ".", dev.cc_minor, ": expected sm80 or newer (or the CPU)");
  return "";
}

std::array<int64_t, 5> kv_cache_shape(int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                      int64_t head_size) {
  return {2, num_blocks, block_size, num_kv_heads, head_size};
}

// Logical (2, num_blocks, block_size, H_kv, D), or (num_layers, 2, ...) with layers.
// physical[i] = logical[order[i]]:
//   NHD (2, nb, bs, H, D)            HND (2, nb, H, bs, D)
//   NHD, layers (nb, L, 2, bs, H, D) HND, layers (nb, H, L, 2, bs, D)
std::vector<int> kv_cache_stride_order(KvLayout layout, bool include_num_layers_dimension) {
  if (include_num_layers_dimension)
    return layout == KvLayout::nhd ? std::vector<int>{2, 0, 1, 3, 4, 5} : std::vector<int>{2, 4, 0, 1, 3, 5};
  return layout == KvLayout::nhd ? std::vector<int>{0, 1, 2, 3, 4} : std::vector<int>{0, 1, 3, 2, 4};
}

}  // namespace flashserve::backend
