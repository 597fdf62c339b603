// Scalar formats: float16, bfloat16, float8 e4m3fn / e5m2, with exact round-to-nearest-even.
// One generic "small float" codec serves float16 and both fp8 formats; bfloat16 is the top half
// of a float32. Host-only today; kept free of library calls that CUDA device code lacks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "flashserve/tensor.hpp"

namespace flashserve::numeric {

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// A binary format with E exponent bits, M mantissa bits, bias 2^(E-1)-1.
// kIeee: the all-ones exponent holds inf/NaN (float16, e5m2). Otherwise (e4m3fn) only the
// all-ones code S.1111.111 is NaN and there is no infinity.
template <int E, int M, bool kIeee>
struct SmallFloat {
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr int kExpMax = (1 << E) - 1;
  static constexpr int kMinExp = 1 - kBias;  // exponent of the smallest normal
  // Largest finite value.
  static constexpr double max_finite() {
    const int top = kIeee ? kExpMax - 1 : kExpMax;
    const int mant = kIeee ? (1 << M) - 1 : (1 << M) - 2;
    double v = 1.0 + double(mant) / double(1 << M);
    for (int i = 0; i < top - kBias; ++i) v *= 2.0;
    return v;
  }
  static constexpr uint32_t kSign = 1u << (E + M);
  static constexpr uint32_t kNaN = kIeee ? ((uint32_t(kExpMax) << M) | (1u << (M - 1)))
                                         : ((uint32_t(kExpMax) << M) | ((1u << M) - 1));

  static float decode(uint32_t code) {
    const bool neg = code & kSign;
    const int e = int((code >> M) & kExpMax);
    const uint32_t m = code & ((1u << M) - 1);
    float v;
    if (kIeee && e == kExpMax) {
      v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    } else if (!kIeee && e == kExpMax && m == (1u << M) - 1) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = std::ldexp(float(m), kMinExp - M);
    } else {
      v = std::ldexp(float((1u << M) | m), e - kBias - M);
    }
    return neg ? -v : v;
  }

  // Round to nearest even. saturate: out-of-range values (and infinities) clamp to
  // ±max_finite; otherwise they become inf (IEEE formats) or NaN (e4m3fn).
  static uint32_t encode(float x, bool saturate) {
    if (std::isnan(x)) return kNaN;
    const uint32_t sign = std::signbit(x) ? kSign : 0u;
    double a = std::fabs(double(x));
    const double mx = max_finite();
    if (!std::isinf(a) && a != 0.0) {
      int e2;
      std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1): exponent of a is e2 - 1
      int e = e2 - 1;
      if (e < kMinExp) e = kMinExp;
      const double q = std::ldexp(1.0, e - M);    // spacing of representable values near a
      a = std::nearbyint(a / q) * q;              // default rounding mode: ties to even
    }
    if (a > mx) {
      if (saturate || !kIeee) {
        if (!saturate) return sign | kNaN;
        a = mx;
      } else {
        return sign | (uint32_t(kExpMax) << M);  // inf
      }
    }
    if (a == 0.0) return sign;
    int e2;
    std::frexp(a, &e2);
    const int e = e2 - 1;
    if (e < kMinExp) {  // subnormal: a = m * 2^(kMinExp - M)
      return sign | uint32_t(std::ldexp(a, M - kMinExp));
    }
    const uint32_t m = uint32_t(std::ldexp(a, M - e)) - (1u << M);
    return sign | (uint32_t(e + kBias) << M) | m;
  }
};

using Half = SmallFloat<5, 10, true>;
using E4M3 = SmallFloat<4, 3, false>;  // float8_e4m3fn: max 448
using E5M2 = SmallFloat<5, 2, true>;   // float8_e5m2: max 57344

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

inline float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }
inline uint16_t float_to_bf16(float x) {
  uint32_t u = bits_of(x);
  if (std::isnan(x)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);  // ties to even
  return uint16_t(u >> 16);
}

float half_to_float(uint16_t h);  // table lookup (numeric.cpp)
inline uint16_t float_to_half(float x) { return uint16_t(Half::encode(x, false)); }

// fp8 decode by table (numeric.cpp); encode saturating, as caches store them.
float fp8_to_float(uint8_t code, DType fmt);
inline uint8_t float_to_fp8(float x, DType fmt) {
  return uint8_t(fmt == DType::f8e4m3 ? E4M3::encode(x, true) : E5M2::encode(x, true));
}
inline float fp8_max(DType fmt) { return fmt == DType::f8e4m3 ? kE4M3Max : kE5M2Max; }

// Element load/store for the floating and integer dtypes, through float.
// The reference reads every operand through these.
float load_float(const void* p, DType t);
void store_float(void* p, DType t, float x);  // rounds to nearest even; fp8 saturates
double load_double(const void* p, DType t);   // exact for every dtype (f64 included)

}  // namespace flashserve::numeric
