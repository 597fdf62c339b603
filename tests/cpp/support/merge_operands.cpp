#include "support/merge_operands.hpp"

#include <cmath>
#include <sstream>

namespace fstest {

namespace fs = flashserve;
using fs::DType;
using fs::LseLayout;

std::string MergeCase::str() const {
  std::ostringstream os;
  os << fs::dtype_name(a_dtype) << "+" << fs::dtype_name(b_dtype) << "->" << fs::dtype_name(out_dtype)
     << (layout == LseLayout::head_major ? " head_major" : " token_major") << (with_out_lse ? " out_lse" : "")
     << (prefill ? " prefill" : "") << (dense ? " dense" : " padded") << (scalar_scale ? " scalar scale" : "");
  return os.str();
}

bool MergeCase::fp8() const { return fs::is_fp8(out_dtype) || out_dtype == DType::u8; }
DType MergeCase::format() const { return out_dtype == DType::u8 ? DType::f8e4m3 : out_dtype; }

HostTensor merge_rows(DType t, bool dense, int64_t T, int64_t H, int64_t D) {
  return dense ? HostTensor::zeros(t, {T, H, D}) : HostTensor::strided(t, {T, H, D}, {H * (D + 3) + 1, D + 3, 1});
}

HostTensor lse_tensor(LseLayout layout, int64_t T, int64_t H) {
  return layout == LseLayout::head_major ? HostTensor::strided(DType::f32, {H, T}, {T + 2, 1})
                                         : HostTensor::strided(DType::f32, {T, H}, {H + 1, 1});
}

float* lse_at(const HostTensor& l, LseLayout layout, int64_t t, int64_t h) {
  return static_cast<float*>(layout == LseLayout::head_major ? l.ref.at(h, t) : l.ref.at(t, h));
}

void fill_lse(std::mt19937_64& rng, const HostTensor& a, const HostTensor& b, LseLayout layout, int64_t T, int64_t H) {
  std::uniform_real_distribution<float> d(-6.0f, 6.0f);
  const float special[] = {-INFINITY, INFINITY};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float la = d(rng), lb = d(rng);
      switch (rng() % 10) {
        case 0: la = special[rng() % 2]; break;
        case 1: lb = special[rng() % 2]; break;
        case 2: la = special[rng() % 2], lb = special[rng() % 2]; break;
        case 3: la = lb + 40.0f; break;  // b's weight underflows in fp32
        default: break;
      }
      *lse_at(a, layout, t, h) = la;
      *lse_at(b, layout, t, h) = lb;
    }
}

}  // namespace fstest
