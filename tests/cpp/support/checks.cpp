#include "support/checks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>

namespace fstest {

uint64_t test_salt() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::hash<std::string>{}(std::string(info->test_suite_name()) + "." + info->name());
}

std::string seed_note() {
  return " (seed " + std::to_string(test_seed()) + ", rerun with FLASHSERVE_SEED=" + std::to_string(test_seed()) + ")";
}

int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

std::vector<char> view_bytes(const HostTensor& t) {
  std::vector<char> in(t.bytes->size(), 0);
  const size_t es = flashserve::dtype_size(t.ref.dtype);
  const auto base = static_cast<unsigned char*>(t.ref.data) - t.bytes->data();
  for_each_index(t.ref, [&](const std::vector<int64_t>&, int64_t off) {
    std::fill_n(in.begin() + base + off * int64_t(es), es, 1);
  });
  return in;
}

bool padding_untouched(const HostTensor& t) {
  const std::vector<char> in_view = view_bytes(t);
  for (size_t i = 0; i < in_view.size(); ++i)
    if (!in_view[i] && (*t.bytes)[i] != 0xFF) return false;
  return true;
}

void expect_rows_close(const HostTensor& got, const HostTensor& want, int64_t T, double atol, double rtol) {
  int64_t bad = 0;
  std::ostringstream first;
  const TensorRef& g = got.ref;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < g.size(1); ++h)
      for (int64_t c = 0; c < g.size(2); ++c) {
        const double x = got.getd({t, h, c}), y = want.getd({t, h, c});
        if (std::isfinite(x) && std::isfinite(y) && std::fabs(x - y) <= atol + rtol * std::fabs(y)) continue;
        if (bad++ < 5) first << " [" << t << "," << h << "," << c << "] got " << x << " want " << y << ";";
      }
  EXPECT_EQ(bad, 0) << "mismatches:" << first.str();
}

}  // namespace fstest
