// The validated, normalized form of a KV-cache write (reshape_and_cache): what validation
// (api/validate_cache) produces and what the CPU reference and the CUDA kernels consume.
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::detail {

// How one of K or V is stored into its cache.
enum class StoreKind : uint8_t {
  plain,         // store_float in the cache's own dtype (auto_, and v of int8_k8v16)
  fp8,           // encode(x / scale[h]) saturated, format k_format / v_format
  int8_dynamic,  // per (token, head) absmax / 127 scale, written to k_scale_cache
  int8_static,   // nearbyint(x / v_scale[h][c]) clamped to ±127
  int8_given,    // int8 rows stored as given, key_scale[t, h] written to k_scale_cache
};

// reshape_and_cache after validation. Views are normalized to NHD.
struct CacheWriteProblem {
  int64_t num_tokens = 0, num_kv_heads = 0, head_dim = 0, head_dim_v = 0;
  int64_t num_blocks = 0, block_size = 0;
  Device device{};
  TensorRef key, value;              // [>= num_tokens, H_kv, D | Dv]
  TensorRef key_cache, value_cache;  // [num_blocks, block_size, H_kv, D | Dv]
  TensorRef slot_mapping;            // int64 [num_tokens]
  StoreKind k_kind = StoreKind::plain, v_kind = StoreKind::plain;
  DType k_format = DType::f32, v_format = DType::f32;  // stored element format (fp8: the f8 format)
  OptTensor k_scale;                 // fp8 k: fp32 [H_kv] (stride 0 for a single scale)
  OptTensor v_scale;                 // fp8 v: fp32 [H_kv]; int8_static: fp32 [H_kv, Dv]
  OptTensor k_scale_cache;           // int8 k: fp32 [num_blocks, block_size, H_kv]
  OptTensor key_scale;               // int8_given k: fp32 [>= num_tokens, H_kv]
};

}  // namespace flashserve::detail
