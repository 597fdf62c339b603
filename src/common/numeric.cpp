#include "flashserve/numeric.hpp"

#include <array>

namespace flashserve::numeric {

namespace {
struct Tables {
  std::array<float, 65536> half{};
  std::array<float, 256> e4m3{}, e5m2{};
  Tables() {
    for (uint32_t c = 0; c < 65536; ++c) half[c] = Half::decode(c);
    for (uint32_t c = 0; c < 256; ++c) {
      e4m3[c] = E4M3::decode(c);
      e5m2[c] = E5M2::decode(c);
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}
}  // namespace

float half_to_float(uint16_t h) { return tables().half[h]; }

float fp8_to_float(uint8_t code, DType fmt) {
  return fmt == DType::f8e4m3 ? tables().e4m3[code] : tables().e5m2[code];
}

float load_float(const void* p, DType t) {
  switch (t) {
    case DType::f32: return *static_cast<const float*>(p);
    case DType::f64: return float(*static_cast<const double*>(p));
    case DType::f16: return half_to_float(*static_cast<const uint16_t*>(p));
    case DType::bf16: return bf16_to_float(*static_cast<const uint16_t*>(p));
    case DType::f8e4m3: case DType::f8e5m2: return fp8_to_float(*static_cast<const uint8_t*>(p), t);
    case DType::i8: return float(*static_cast<const int8_t*>(p));
    case DType::u8: return float(*static_cast<const uint8_t*>(p));
    case DType::i32: return float(*static_cast<const int32_t*>(p));
    case DType::i64: return float(*static_cast<const int64_t*>(p));
  }
  return 0.0f;
}

double load_double(const void* p, DType t) {
  switch (t) {
    case DType::f64: return *static_cast<const double*>(p);
    case DType::i32: return double(*static_cast<const int32_t*>(p));
    case DType::i64: return double(*static_cast<const int64_t*>(p));
    default: return double(load_float(p, t));
  }
}

void store_float(void* p, DType t, float x) {
  switch (t) {
    case DType::f32: *static_cast<float*>(p) = x; break;
    case DType::f64: *static_cast<double*>(p) = x; break;
    case DType::f16: *static_cast<uint16_t*>(p) = float_to_half(x); break;
    case DType::bf16: *static_cast<uint16_t*>(p) = float_to_bf16(x); break;
    case DType::f8e4m3: case DType::f8e5m2: *static_cast<uint8_t*>(p) = float_to_fp8(x, t); break;
    case DType::i8: {
      const float r = std::nearbyint(x);
      *static_cast<int8_t*>(p) = int8_t(r > 127.f ? 127.f : (r < -128.f ? -128.f : r));
      break;
    }
    case DType::u8: *static_cast<uint8_t*>(p) = uint8_t(x); break;
    case DType::i32: *static_cast<int32_t*>(p) = int32_t(x); break;
    case DType::i64: *static_cast<int64_t*>(p) = int64_t(x); break;
  }
}

}  // namespace flashserve::numeric
