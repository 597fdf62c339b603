#include "reference/variants_ops.hpp"

#include <cmath>
#include <cstring>

#include "common/check.hpp"
#include "common/softmax_state.hpp"
#include "flashserve/numeric.hpp"

namespace flashserve::reference {

namespace {

float f32_at(const TensorRef& t, int64_t i) { return *static_cast<const float*>(t.at(i)); }

float dot(const TensorRef& a, const TensorRef& b) {
  float s = 0.0f;
  for (int64_t i = 0; i < a.size(0); ++i) s += f32_at(a, i) * f32_at(b, i);
  return s;
}

// Element c < 2D of pair h's row of a [T, H, D] operand: head 2h + c / D, column c % D.
void* pair_at(const TensorRef& x, int64_t t, int64_t h, int64_t c, int64_t D) {
  return x.at(t, 2 * h + c / D, c % D);
}

// log Σ_r exp(lse_all[r, h, t]) with +inf counting as -inf; -inf when every rank is empty.
float global_lse(const TensorRef& lse_all, int64_t W, int64_t h, int64_t t) {
  float m = -INFINITY;
  for (int64_t r = 0; r < W; ++r) m = std::fmax(m, normalize_lse(*static_cast<const float*>(lse_all.at(r, h, t))));
  if (m == -INFINITY) return -INFINITY;
  float sum = 0.0f;
  for (int64_t r = 0; r < W; ++r) sum += std::exp(normalize_lse(*static_cast<const float*>(lse_all.at(r, h, t))) - m);
  return m + std::log(sum);
}

}  // namespace

float differential_lambda(const TensorRef& q1, const TensorRef& k1, const TensorRef& q2, const TensorRef& k2,
                          float lambda_init) {
  return std::exp(dot(q1, k1)) - std::exp(dot(q2, k2)) + lambda_init;
}

void differential_combine(const detail::DifferentialProblem& pr) {
  const float lambda = differential_lambda(pr.lambda_q1, pr.lambda_k1, pr.lambda_q2, pr.lambda_k2, pr.lambda_init);
  const float post = 1.0f - pr.lambda_init;
  const int64_t D = pr.head_dim, W = 2 * D;
  const TensorRef &a1 = pr.a1, &a2 = pr.a2, &out = pr.out;
  auto x_at = [&](int64_t t, int64_t h, int64_t c) {  // a1 - λ a2
    const float x1 = numeric::load_float(pair_at(a1, t, h, c, D), a1.dtype);
    return x1 - lambda * numeric::load_float(pair_at(a2, t, h, c, D), a2.dtype);
  };
#pragma omp parallel for collapse(2) schedule(static) if (pr.tokens * pr.pairs * W > (1 << 14))
  for (int64_t t = 0; t < pr.tokens; ++t) {
    for (int64_t h = 0; h < pr.pairs; ++h) {
      float ss = 0.0f;
      for (int64_t c = 0; c < W; ++c) {
        const float x = x_at(t, h, c);
        ss += x * x;
      }
      const float r = 1.0f / std::sqrt(ss / float(W) + pr.eps);
      for (int64_t c = 0; c < W; ++c)
        numeric::store_float(pair_at(out, t, h, c, D), out.dtype, x_at(t, h, c) * r * f32_at(pr.weight, c) * post);
    }
  }
}

void lse_correct(const detail::LseCorrectProblem& pr) {
  const int64_t Hs = pr.slice_heads, Dv = pr.head_dim;
  const int64_t es = int64_t(dtype_size(pr.out.dtype));
  const int64_t rows = pr.slices * Hs;
#pragma omp parallel for collapse(2) schedule(static) if (rows * pr.tokens * (Dv + pr.world) > (1 << 14))
  for (int64_t h = 0; h < rows; ++h) {
    for (int64_t t = 0; t < pr.tokens; ++t) {
      const float g = global_lse(pr.lse_all, pr.world, h, t);
      const float local = normalize_lse(*static_cast<const float*>(pr.lse_all.at(pr.rank, h, t)));
      const float f = local == -INFINITY ? 0.0f : std::exp(local - g);
      char* row = static_cast<char*>(pr.out.at(h / Hs, t, h % Hs, 0));
      for (int64_t c = 0; c < Dv; ++c) {
        const float x = f == 0.0f ? 0.0f : f * numeric::load_float(row + c * es, pr.out.dtype);
        numeric::store_float(row + c * es, pr.out.dtype, x);
      }
      if (pr.lse_out) *static_cast<float*>(pr.lse_out->at(h, t)) = g;
    }
  }
}

void gather_cache(const detail::GatherCacheProblem& pr) {
  int64_t row = 0;
  for (int64_t b = 0; b < pr.batch; ++b) {
    *static_cast<int32_t*>(pr.cu_seqlens_dst.at(b)) = int32_t(row);
    const detail::TokenRange r = detail::gather_range(pr, b);
    row += r.hi - r.lo;
  }
  *static_cast<int32_t*>(pr.cu_seqlens_dst.at(pr.batch)) = int32_t(row);

  const size_t row_bytes = size_t(pr.width) * dtype_size(pr.cache.dtype);
  const int64_t bs = pr.block_size;
#pragma omp parallel for schedule(dynamic) if (row * pr.width > (1 << 16))
  for (int64_t b = 0; b < pr.batch; ++b) {
    const detail::TokenRange r = detail::gather_range(pr, b);
    int64_t dst_row = *static_cast<const int32_t*>(pr.cu_seqlens_dst.at(b));
    for (int64_t t = r.lo; t < r.hi; ++t, ++dst_row) {
      const int64_t block = detail::read_index2(pr.block_table, b, t / bs);
      std::memcpy(pr.dst.at(dst_row, 0), pr.cache.at(block, t % bs, 0), row_bytes);
    }
  }
}

}  // namespace flashserve::reference
