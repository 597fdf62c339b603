#include "reference/merge.hpp"

#include "common/softmax_state.hpp"
#include "flashserve/numeric.hpp"

namespace flashserve::reference {

namespace {

float lse_at(const TensorRef& t, int64_t tok, int64_t h) { return *static_cast<const float*>(t.at(tok, h)); }

// Stores x into element c of a row of out.
struct OutRow {
  char* p;
  DType dtype, format;
  float scale;  // fp8: stores x / scale; otherwise unused
  void store(int64_t c, float x) const {
    if (is_fp8(format)) {
      reinterpret_cast<uint8_t*>(p)[c] = numeric::float_to_fp8(x / scale, format);
    } else {
      numeric::store_float(p + c * int64_t(dtype_size(dtype)), dtype, x);
    }
  }
};

}  // namespace

void merge_states(const detail::MergeProblem& pr) {
  const float scale = pr.output_scale ? *static_cast<const float*>(pr.output_scale->data) : 1.0f;
  const int64_t D = pr.head_dim;
  const size_t as = dtype_size(pr.a_out.dtype), bs = dtype_size(pr.b_out.dtype);
#pragma omp parallel for collapse(2) schedule(static) if (pr.tokens * pr.heads * D > (1 << 16))
  for (int64_t t = 0; t < pr.tokens; ++t) {
    for (int64_t h = 0; h < pr.heads; ++h) {
      const char* a = static_cast<const char*>(pr.a_out.at(t, h, 0));
      const char* b = static_cast<const char*>(pr.b_out.at(t, h, 0));
      const OutRow out{static_cast<char*>(pr.out.at(t, h, 0)), pr.out.dtype, pr.out_format, scale};
      float lse;
      if (t < pr.merge_rows) {
        const MergeWeights w = merge_lse(lse_at(pr.a_lse, t, h), lse_at(pr.b_lse, t, h));
        for (int64_t c = 0; c < D; ++c) {
          const float xa = w.w_a != 0.0f ? w.w_a * numeric::load_float(a + c * as, pr.a_out.dtype) : 0.0f;
          const float xb = w.w_b != 0.0f ? w.w_b * numeric::load_float(b + c * bs, pr.b_out.dtype) : 0.0f;
          out.store(c, xa + xb);
        }
        lse = w.lse;
      } else {
        for (int64_t c = 0; c < D; ++c) out.store(c, numeric::load_float(b + c * bs, pr.b_out.dtype));
        lse = lse_at(pr.b_lse, t, h);
      }
      if (pr.out_lse) *static_cast<float*>(pr.out_lse->at(t, h)) = lse;
    }
  }
}

}  // namespace flashserve::reference
