// Device-side scalar formats: float16, bfloat16, float8 e4m3fn / e5m2 and the caches' int8, bit
// for bit as the host codecs of flashserve/numeric.hpp (round to nearest even; fp8 saturates at
// ±448 / ±57344, infinities included; NaN codes as the host writes them: float16 0x7e00,
// bfloat16 the input's top half | 0x40, e4m3 0x7f, e5m2 0x7e). Loads decode NaN to the host's
// canonical quiet NaN, so a NaN stored back gets the host's code too.
//
// load_floats / store_floats move G consecutive elements with one vector access (G * size bytes,
// at most 16 per access); the pointer must be aligned to min(16, G * size) bytes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

__device__ __forceinline__ float canonical_nan() { return __int_as_float(0x7fc00000); }

__device__ __forceinline__ float half_to_float(uint16_t h) {
  if ((h & 0x7fffu) > 0x7c00u) return canonical_nan();
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}

__device__ __forceinline__ float bf16_to_float(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ __forceinline__ __nv_fp8_interpretation_t fp8_kind(DType fmt) {
  return fmt == DType::f8e4m3 ? __NV_E4M3 : __NV_E5M2;
}

// Every fp8 value is exact in float16.
__device__ __forceinline__ float fp8_to_float(uint8_t code, DType fmt) {
  return half_to_float(__nv_cvt_fp8_to_halfraw(code, fp8_kind(fmt)).x);
}

__device__ __forceinline__ uint16_t float_to_half(float x) {
  if (isnan(x)) return 0x7e00u;
  return __half_as_ushort(__float2half_rn(x));  // overflow -> inf, as the host
}

__device__ __forceinline__ uint16_t float_to_bf16(float x) {
  uint32_t u = __float_as_uint(x);
  if (isnan(x)) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);  // ties to even
  return uint16_t(u >> 16);
}

// Saturating: out-of-range values and infinities become ±max finite.
__device__ __forceinline__ uint8_t float_to_fp8(float x, DType fmt) {
  if (isnan(x)) return fmt == DType::f8e4m3 ? 0x7fu : 0x7eu;
  return uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, fp8_kind(fmt)));
}

// Nearest integer (ties to even) clamped to ±127; NaN -> 0 (the caches' int8).
__device__ __forceinline__ int8_t round_to_int8(float x) {
  if (isnan(x)) return 0;
  return int8_t(fminf(fmaxf(rintf(x), -127.0f), 127.0f));
}

// G elements of T, aligned for one access of up to 16 bytes (two or more when wider).
template <class T, int G>
struct alignas(sizeof(T) * G < 16 ? sizeof(T) * G : 16) Vec {
  T v[G];
};

// The words a vector of B bytes moves in: 16-byte words, or one word of B bytes.
template <int B> struct Words { using W = uint4; static constexpr int n = B / 16; };
template <> struct Words<8> { using W = uint2; static constexpr int n = 1; };
template <> struct Words<4> { using W = uint32_t; static constexpr int n = 1; };
template <> struct Words<2> { using W = uint16_t; static constexpr int n = 1; };
template <> struct Words<1> { using W = uint8_t; static constexpr int n = 1; };

template <class T, int G>
union VecWords {
  using Ws = Words<int(sizeof(T)) * G>;
  typename Ws::W w[Ws::n];
  Vec<T, G> v;
};

template <class T, int G>
__device__ __forceinline__ Vec<T, G> load_vec(const void* p) {
  VecWords<T, G> u;
  using W = typename VecWords<T, G>::Ws::W;
#pragma unroll
  for (int i = 0; i < VecWords<T, G>::Ws::n; ++i) u.w[i] = static_cast<const W*>(p)[i];
  return u.v;
}

template <class T, int G>
__device__ __forceinline__ void store_vec(void* p, const Vec<T, G>& v) {
  VecWords<T, G> u;
  u.v = v;
  using W = typename VecWords<T, G>::Ws::W;
#pragma unroll
  for (int i = 0; i < VecWords<T, G>::Ws::n; ++i) static_cast<W*>(p)[i] = u.w[i];
}

// x[i] = element i at p, of dtype t (f32, f16, bf16, f8e4m3, f8e5m2, i8).
template <int G>
__device__ __forceinline__ void load_floats(const void* p, DType t, float (&x)[G]) {
  switch (t) {
    case DType::f32: {
      const auto v = load_vec<float, G>(p);
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = v.v[i];
      return;
    }
    case DType::f16: {
      const auto v = load_vec<uint16_t, G>(p);
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = half_to_float(v.v[i]);
      return;
    }
    case DType::bf16: {
      const auto v = load_vec<uint16_t, G>(p);
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = bf16_to_float(v.v[i]);
      return;
    }
    case DType::f8e4m3:
    case DType::f8e5m2: {
      const auto v = load_vec<uint8_t, G>(p);
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = fp8_to_float(v.v[i], t);
      return;
    }
    default: {  // i8
      const auto v = load_vec<int8_t, G>(p);
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = float(v.v[i]);
      return;
    }
  }
}

// Stores x[i] as element i at p in format fmt: f32, f16, bf16, f8e4m3 / f8e5m2 (saturating),
// i8 (round_to_int8).
template <int G>
__device__ __forceinline__ void store_floats(void* p, DType fmt, const float (&x)[G]) {
  switch (fmt) {
    case DType::f32: {
      Vec<float, G> v;
#pragma unroll
      for (int i = 0; i < G; ++i) v.v[i] = x[i];
      store_vec<float, G>(p, v);
      return;
    }
    case DType::f16:
    case DType::bf16: {
      Vec<uint16_t, G> v;
#pragma unroll
      for (int i = 0; i < G; ++i) v.v[i] = fmt == DType::f16 ? float_to_half(x[i]) : float_to_bf16(x[i]);
      store_vec<uint16_t, G>(p, v);
      return;
    }
    case DType::f8e4m3:
    case DType::f8e5m2: {
      Vec<uint8_t, G> v;
#pragma unroll
      for (int i = 0; i < G; ++i) v.v[i] = float_to_fp8(x[i], fmt);
      store_vec<uint8_t, G>(p, v);
      return;
    }
    default: {  // i8
      Vec<int8_t, G> v;
#pragma unroll
      for (int i = 0; i < G; ++i) v.v[i] = round_to_int8(x[i]);
      store_vec<int8_t, G>(p, v);
      return;
    }
  }
}

// Whether p is aligned to `bytes` (a power of two).
__device__ __forceinline__ bool aligned(const void* p, int64_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & uintptr_t(bytes - 1)) == 0;
}

// The alignment a group of g elements of `size` bytes needs (at most 16).
__host__ __device__ constexpr int64_t group_alignment(int64_t g, int64_t size) {
  return g * size < 16 ? g * size : 16;
}

}  // namespace flashserve::kernels
