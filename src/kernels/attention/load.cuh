// Device-side loads for the attention kernels: elements of any operand dtype as float
// (exact), stores of float to the output dtypes (round to nearest even, as numeric.hpp), int32
// metadata reads, and the location of a KV token in the cache.
//
// Out-of-range metadata never causes an out-of-bounds read: a KV token whose block index lies
// outside [0, num_blocks), whose block-table column lies past max_blocks, or whose cache row
// lies outside the contiguous cache is marked bad and enters the tile as NaN, so exactly the
// query rows that see it come out NaN (visible, never silent).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention/params.hpp"
#include "kernels/attention/select.hpp"

#define FS_DEV __device__ __forceinline__

namespace flashserve::kernels {

inline constexpr float kNegInf = -INFINITY;

FS_DEV float nan_value() { return __int_as_float(0x7fffffff); }

FS_DEV float fp8_to_float(uint8_t x, __nv_fp8_interpretation_t fmt) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(x, fmt);  // exact: fp8 values are halves
  return __half2float(__half(h));
}

// Element idx (elements, 64-bit) of an array of dtype t, as float. Dtypes the selection
// rejects read as NaN.
FS_DEV float load_as_float(const void* base, int64_t idx, DType t) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[idx];
    case DType::f16: return __half2float(static_cast<const __half*>(base)[idx]);
    case DType::bf16: return __uint_as_float(uint32_t(static_cast<const uint16_t*>(base)[idx]) << 16);
    case DType::f8e4m3: return fp8_to_float(static_cast<const uint8_t*>(base)[idx], __NV_E4M3);
    case DType::f8e5m2: return fp8_to_float(static_cast<const uint8_t*>(base)[idx], __NV_E5M2);
    case DType::i8: return float(static_cast<const int8_t*>(base)[idx]);
    default: return nan_value();
  }
}

// Stores x at element idx of an f32/f16/bf16 array (the output dtypes).
FS_DEV void store_from_float(void* base, int64_t idx, DType t, float x) {
  switch (t) {
    case DType::f16: static_cast<__half*>(base)[idx] = __float2half_rn(x); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(base)[idx] = x; break;
  }
}

// Elements idx and idx + 1 (store_from_float each): one 4-byte store of the pair for a 16-bit
// type at a 4-byte-aligned address, else two.
FS_DEV void store2_from_float(void* base, int64_t idx, DType t, float x0, float x1) {
  if (t == DType::f16 || t == DType::bf16) {
    uint16_t* at = static_cast<uint16_t*>(base) + idx;
    if (reinterpret_cast<uintptr_t>(at) % 4 == 0) {
      const auto bits = [&](float x) -> uint32_t {
        return t == DType::f16 ? __half_as_ushort(__float2half_rn(x)) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
      };
      *reinterpret_cast<uint32_t*>(at) = bits(x0) | (bits(x1) << 16);
      return;
    }
  }
  store_from_float(base, idx, t, x0);
  store_from_float(base, idx + 1, t, x1);
}

// Element i of a 1-D int32 tensor; element (i, j) of a 2-D one.
FS_DEV int64_t load_index(const StridedRef& r, int64_t i) {
  return static_cast<const int32_t*>(r.data)[i * r.stride[0]];
}
FS_DEV int64_t load_index2(const StridedRef& r, int64_t i, int64_t j) {
  return static_cast<const int32_t*>(r.data)[i * r.stride[0] + j * r.stride[1]];
}
// load_index2 for a value used much later (the decode's block-table read a tile ahead): an
// opaque load, so the compiler cannot widen it to 64 bits right after the read (which makes
// the next instruction wait for memory).
FS_DEV int32_t load_index2_deferred(const StridedRef& r, int64_t i, int64_t j) {
  const int32_t* at = static_cast<const int32_t*>(r.data) + i * r.stride[0] + j * r.stride[1];
  int32_t v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(at));
  return v;
}
// Element (i, j) of a 2-D f32 tensor, or `absent` when the tensor is absent.
FS_DEV float load_f32_2d(const StridedRef& r, int64_t i, int64_t j, float absent) {
  return r.data ? static_cast<const float*>(r.data)[i * r.stride[0] + j * r.stride[1]] : absent;
}

// Where one KV token of a tile lives (element offsets into k and v for KV head g).
enum TokenState : int32_t { kTokenValid = 0, kTokenBad = 1 };
struct TokenLoc {
  int64_t k_off, v_off;
  float k_scale;     // int8 k: the token's scale; otherwise the k descale
  int32_t state;     // TokenState
};
static_assert(sizeof(TokenLoc) == kGenericTokenLocBytes, "select.hpp sizes shared memory with it");

// Sequence b's KV in the normalized k/v views (problem/attention.hpp).
struct SeqKv {
  int64_t b = 0, g = 0;       // sequence, KV head
  int64_t kb = 0;             // contiguous: cache row (batched) or 0 (varlen)
  int64_t k_begin = 0;        // contiguous varlen: cu_seqlens_k[b]
  float k_desc = 1.0f, v_desc = 1.0f;  // fp8 descales of (b, g)
};

FS_DEV SeqKv seq_kv(const AttnParams& p, int64_t b, int64_t g) {
  SeqKv s;
  s.b = b;
  s.g = g;
  if (!p.paged) {
    if (p.batched) s.kb = p.cache_batch_idx.data ? load_index(p.cache_batch_idx, b) : b;
    else s.k_begin = load_index(p.cu_seqlens_k, b);
  }
  s.k_desc = load_f32_2d(p.k_descale, b, g, 1.0f);
  s.v_desc = load_f32_2d(p.v_descale, b, g, 1.0f);
  return s;
}

// Token t (local, 0 <= t < the sequence's KV length) of sequence s.
FS_DEV TokenLoc locate_token(const AttnParams& p, const SeqKv& s, int64_t t) {
  TokenLoc L{0, 0, 0.0f, kTokenBad};
  int64_t d0, d1;
  if (p.paged) {
    const int64_t col = t / p.kv_dim1;
    if (col >= p.max_blocks) return L;
    d0 = load_index2(p.block_table, s.b, col);
    d1 = t % p.kv_dim1;
  } else {
    d0 = s.kb;
    d1 = s.k_begin + t;
  }
  if (d0 < 0 || d0 >= p.kv_dim0 || d1 < 0 || d1 >= p.kv_dim1) return L;
  L.k_off = d0 * p.k.stride[0] + d1 * p.k.stride[1] + s.g * p.k.stride[2];
  L.v_off = d0 * p.v.stride[0] + d1 * p.v.stride[1] + s.g * p.v.stride[2];
  const StridedRef& ks = p.k_scale_cache;
  L.k_scale = ks.data ? static_cast<const float*>(ks.data)[d0 * ks.stride[0] + d1 * ks.stride[1] + s.g * ks.stride[2]]
                      : s.k_desc;
  L.state = kTokenValid;
  return L;
}

// Dequantized K element d of a located token (SPEC.md §5): x * (token scale or descale).
FS_DEV float load_k(const AttnParams& p, const TokenLoc& L, int64_t d) {
  if (L.state != kTokenValid) return nan_value();
  return load_as_float(p.k.data, L.k_off + d, p.k.dtype) * L.k_scale;
}

// Dequantized V element c: x * descale (* v_scale[g, c] for int8 v).
FS_DEV float load_v(const AttnParams& p, const SeqKv& s, const TokenLoc& L, int64_t c) {
  if (L.state != kTokenValid) return nan_value();
  const float x = load_as_float(p.v.data, L.v_off + c, p.v.dtype) * s.v_desc;
  return p.v_scale.data ? x * load_f32_2d(p.v_scale, s.g, c, 1.0f) : x;
}

}  // namespace flashserve::kernels
