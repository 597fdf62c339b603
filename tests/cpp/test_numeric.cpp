// Scalar formats: exhaustive decode/encode round trips and nearest-value rounding checked
// against a brute-force search over every code.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "flashserve/numeric.hpp"
#include "support/host_tensor.hpp"

namespace nm = flashserve::numeric;
using flashserve::DType;

namespace {

// Nearest finite code by brute force (ties to the even mantissa), saturating at max.
template <class F>
uint32_t brute_nearest(float x, int ncodes) {
  uint32_t best = 0;
  double best_d = INFINITY;
  for (int c = 0; c < ncodes; ++c) {
    const float v = F::decode(uint32_t(c));
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(double(v) - double(x));
    const bool even = (c & 1) == 0;
    if (d < best_d || (d == best_d && even && (std::signbit(v) == std::signbit(x)))) {
      best = uint32_t(c);
      best_d = d;
    }
  }
  return best;
}

template <class F>
void check_format(int ncodes, float max_finite) {
  EXPECT_EQ(F::max_finite(), double(max_finite));
  for (int c = 0; c < ncodes; ++c) {
    const float v = F::decode(uint32_t(c));
    if (std::isnan(v)) continue;
    if (std::isinf(v)) continue;
    EXPECT_EQ(F::decode(F::encode(v, true)), v) << "code " << c;
  }
  auto rng = fstest::make_rng(ncodes);
  std::uniform_real_distribution<float> d(-1.2f * max_finite, 1.2f * max_finite);
  std::uniform_real_distribution<float> small(-4.0f, 4.0f);
  for (int i = 0; i < 4000; ++i) {
    const float x = (i % 2) ? d(rng) : small(rng) * std::pow(2.0f, float(int(i % 23) - 14));
    const float got = F::decode(F::encode(x, true));
    const float want = F::decode(brute_nearest<F>(x, ncodes));
    EXPECT_EQ(got, want) << "x=" << x;
  }
}

}  // namespace

TEST(Numeric, E4M3MatchesBruteForce) { check_format<nm::E4M3>(256, 448.0f); }
TEST(Numeric, E5M2MatchesBruteForce) { check_format<nm::E5M2>(256, 57344.0f); }

TEST(Numeric, E4M3SpecialValues) {
  EXPECT_TRUE(std::isnan(nm::E4M3::decode(0x7f)));
  EXPECT_TRUE(std::isnan(nm::E4M3::decode(0xff)));
  EXPECT_EQ(nm::E4M3::decode(0x7e), 448.0f);
  EXPECT_EQ(nm::E4M3::decode(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(nm::E4M3::encode(1e9f, true), 0x7eu);           // saturates
  EXPECT_EQ(nm::E4M3::encode(-INFINITY, true), 0xfeu);
  EXPECT_EQ(nm::fp8_to_float(0x38, DType::f8e4m3), 1.0f);
}

TEST(Numeric, E5M2SpecialValues) {
  EXPECT_TRUE(std::isinf(nm::E5M2::decode(0x7c)));
  EXPECT_EQ(nm::E5M2::decode(0x7b), 57344.0f);
  EXPECT_EQ(nm::E5M2::encode(1e9f, true), 0x7bu);
  EXPECT_EQ(nm::E5M2::encode(1e9f, false), 0x7cu);
  EXPECT_EQ(nm::fp8_to_float(0x3c, DType::f8e5m2), 1.0f);
}

TEST(Numeric, HalfRoundTripsEveryCode) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float v = nm::half_to_float(uint16_t(c));
    if (std::isnan(v)) continue;
    ASSERT_EQ(nm::float_to_half(v), c) << c;
  }
  EXPECT_EQ(nm::half_to_float(0x3c00), 1.0f);
  EXPECT_EQ(nm::half_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(nm::float_to_half(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(nm::float_to_half(1.0f + 1.0f / 2048.0f), 0x3c00);  // tie -> even
}

TEST(Numeric, Bf16RoundsToNearestEven) {
  EXPECT_EQ(nm::float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(nm::float_to_bf16(nm::float_of(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(nm::float_to_bf16(nm::float_of(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(nm::float_to_bf16(nm::float_of(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(nm::bf16_to_float(nm::float_to_bf16(NAN))));
}

TEST(Numeric, StoreAndLoadEveryDtype) {
  unsigned char buf[8];
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::f8e4m3, DType::f8e5m2,
                  DType::i8, DType::i32, DType::i64}) {
    nm::store_float(buf, t, 3.0f);
    EXPECT_EQ(nm::load_float(buf, t), 3.0f) << flashserve::dtype_name(t);
  }
  nm::store_float(buf, DType::i8, 300.0f);
  EXPECT_EQ(nm::load_float(buf, DType::i8), 127.0f);
}
