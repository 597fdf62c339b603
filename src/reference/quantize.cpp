// Dynamic per-(token, head) int8 quantization (SPEC.md §5): scale = absmax / 127.
#include <algorithm>
#include <cmath>

#include "flashserve/numeric.hpp"
#include "reference/cache_ops.hpp"

namespace flashserve::reference {

int8_t round_to_int8(float x) {
  if (std::isnan(x)) return 0;
  const float r = std::nearbyint(x);  // default rounding mode: ties to even
  return int8_t(std::clamp(r, -127.0f, 127.0f));
}

float quantize_row_int8(const void* x, DType t, int64_t n, int8_t* out) {
  const char* p = static_cast<const char*>(x);
  const size_t es = dtype_size(t);
  float absmax = 0.0f;
  for (int64_t c = 0; c < n; ++c) absmax = std::max(absmax, std::fabs(numeric::load_float(p + c * es, t)));
  const float scale = absmax > 0.0f ? absmax / 127.0f : 1.0f;
  for (int64_t c = 0; c < n; ++c) out[c] = round_to_int8(numeric::load_float(p + c * es, t) / scale);
  return scale;
}

void quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
#pragma omp parallel for collapse(2) schedule(static) if (T * H * D > (1 << 16))
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      *static_cast<float*>(scale.at(t, h)) = quantize_row_int8(x.at(t, h, 0), x.dtype, D, static_cast<int8_t*>(out.at(t, h, 0)));
}

}  // namespace flashserve::reference
