// Paged KV-cache maintenance (SPEC.md §3, §5): writing new tokens, copying and swapping blocks,
// advancing decode metadata, dynamic int8 quantization.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "flashserve/attention.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve {

// How the cache stores values.
enum class KvCacheDType : uint8_t {
  auto_,      // the key's dtype (f16/bf16/f32)
  fp8_e4m3,   // "fp8", "fp8_e4m3": x / scale, saturated at ±448
  fp8_e5m2,   // "fp8_e5m2": x / scale, saturated at ±57344
  int8_k8v8,  // "int8": k int8 with dynamic per-(token, head) scale; v int8, static [H_kv, D] scale
  int8_k8v16, // "int8_k8v16": k as int8_k8v8, v in the key's f16/bf16
};

// Parses the engines' kv_cache_dtype strings; throws naming `arg` for an unknown one.
KvCacheDType parse_kv_cache_dtype(std::string_view s, std::string_view arg = "kv_cache_dtype");
std::string_view kv_cache_dtype_name(KvCacheDType t);

struct CacheWriteParams {
  TensorRef key;            // [>= num_tokens, H_kv, D]; token stride free, last dim contiguous
  TensorRef value;          // [>= num_tokens, H_kv, Dv]
  TensorRef key_cache;      // paged, see layout. fp8 caches may be typed u8 or f8*
  TensorRef value_cache;
  KvLayout layout = KvLayout::nhd;
  TensorRef slot_mapping;   // int64 [num_tokens]; slot = block * block_size + offset; < 0 skipped
  KvCacheDType cache_dtype = KvCacheDType::auto_;
  OptTensor k_scale;        // fp8: fp32 [] or [H_kv] (or [1])
  OptTensor v_scale;        // fp8: as k_scale; int8_k8v8: fp32 [H_kv, Dv] static
  OptTensor k_scale_cache;  // int8: fp32 [num_blocks, H_kv, block_size], written per token
  OptTensor key_scale;      // int8 key given already quantized: fp32 [>= num_tokens, H_kv], see below
};

// Writes key/value rows into their slots. num_tokens = slot_mapping's length; key/value may
// have more rows (padding). Every other slot is left untouched.
//
// Two forms for the int8 caches (cache_dtype int8_k8v8 / int8_k8v16):
// - key f16/bf16/f32: quantized on the way in (k per (token, head) dynamically, its scale
//   written to k_scale_cache; K8V8 v by the static v_scale);
// - key int8, already quantized (the int8 fork's reshape_and_cache_flash_int8 / _mix): rows
//   stored as given and key_scale[t, h] (each row's scale, fp32 [>= num_tokens, H_kv], any
//   strides) written to k_scale_cache; value int8 (K8V8, already quantized with the static
//   scale: v_scale must be absent) or f16/bf16 (K8V16), stored as given.
void reshape_and_cache(const CacheWriteParams& p, const ExecContext& ctx = {});

// Copy-on-write within caches: for each row (src, dst) of `block_mapping` (int64 [n, 2]), copy
// block src to block dst in every cache of `caches` (all of one shape and device). Block index
// is dim 0 of each cache.
void copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping,
                 const ExecContext& ctx = {});

// Between caches on different devices (device <-> host): block src of `src` to block dst of
// `dst`, for each row of `block_mapping` (int64 [n, 2], on the CPU). Same block shape and dtype.
void swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping,
                 const ExecContext& ctx = {});

// Decode metadata for the next step, in place, no host round trip (vLLM's advance_step_flashattn).
// For each query i < num_queries: input_tokens[i] = sampled_token_ids[i, 0];
// seq_lens[i] += 1; input_positions[i] = seq_lens[i] - 1;
// slot_mapping[i] = block_tables[i][pos / block_size] * block_size + pos % block_size.
// Padding rows num_queries <= i < num_seqs (CUDA-graph padding): input_tokens = 0,
// input_positions = 0, slot_mapping = -1, seq_lens untouched.
struct AdvanceStepParams {
  int64_t num_seqs = 0;        // rows of the tensors (>= num_queries)
  int64_t num_queries = 0;
  int64_t block_size = 0;
  TensorRef input_tokens;      // int64 [>= num_seqs], written
  TensorRef sampled_token_ids; // int64 [>= num_queries, 1]
  TensorRef input_positions;   // int64 [>= num_seqs], written
  TensorRef seq_lens;          // int32 [>= num_seqs], read and written
  TensorRef slot_mapping;      // int64 [>= num_seqs], written
  TensorRef block_tables;      // int32 [>= num_seqs, max_blocks]
};
void advance_step(const AdvanceStepParams& p, const ExecContext& ctx = {});

// Dynamic int8 quantization per (token, head): scale = absmax / 127 (1 when absmax is 0),
// out = round_half_even(x / scale) clamped to ±127.
// x [T, H, D] f16/bf16/f32; out int8 [T, H, D]; scale fp32 [T, H].
void quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale,
                   const ExecContext& ctx = {});

}  // namespace flashserve
