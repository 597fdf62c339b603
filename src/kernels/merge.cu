// CUDA kernel of merge_states (merge.hpp): (o_a, lse_a) ⊕ (o_b, lse_b) per (token, head) row, as
// the CPU reference (src/reference/merge.cpp).
#include "kernels/merge.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/softmax_state.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/token_rows.cuh"
#include "kernels/common/numeric.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kRowWarps = 4;           // warps per block, one row each
constexpr int kGroup = 8;              // elements per lane and access on the vector path


// fp32 [T, H] (token-major view of either layout).
struct Lse {
  float* data;  // may be null (out_lse absent)
  int64_t s_token, s_head;
  __device__ float& at(int64_t t, int64_t h) const { return data[t * s_token + h * s_head]; }
};

struct MergeArgs {
  int64_t tokens, heads, width;
  int64_t merge_rows;          // rows t >= merge_rows copy b
  TokenRows a, b;
  TokenRows out;                    // written; dtype = the stored format (u8 out: f8e4m3)
  Lse a_lse, b_lse, out_lse;   // out_lse.data may be null
  const float* output_scale;   // fp8 out: one fp32; else null
};

// What one row does: merged = w_a o_a + w_b o_b (a side of weight 0 is not read), or a copy of
// o_b; then / scale for an fp8 out.
struct RowOp {
  float w_a, w_b;
  bool copy;
  bool scaled;
  float scale;
  __device__ float operator()(float xa, float xb) const {
    float r = xb;
    if (!copy) r = __fadd_rn(w_a != 0.0f ? __fmul_rn(w_a, xa) : 0.0f, w_b != 0.0f ? __fmul_rn(w_b, xb) : 0.0f);
    return scaled ? __fdiv_rn(r, scale) : r;
  }
};

template <int G>
__device__ void merge_group(const RowOp& op, const char* a, DType ta, const char* b, DType tb, char* y, DType ty) {
  float xa[G] = {}, xb[G] = {}, v[G];
  if (!op.copy && op.w_a != 0.0f) load_floats<G>(a, ta, xa);
  if (op.copy || op.w_b != 0.0f) load_floats<G>(b, tb, xb);
#pragma unroll
  for (int i = 0; i < G; ++i) v[i] = op(xa[i], xb[i]);
  store_floats<G>(y, ty, v);
}

// One row of `width` elements by one warp: groups of kGroup per lane when the length and the
// three addresses allow, else single elements.
__device__ void merge_row(const MergeArgs& m, const RowOp& op, int64_t t, int64_t h, int lane) {
  const char* a = m.a.row(t, h);
  const char* b = m.b.row(t, h);
  char* y = m.out.row(t, h);
  const int64_t as = int64_t(dtype_size(m.a.dtype)), bs = int64_t(dtype_size(m.b.dtype));
  const int64_t ys = int64_t(dtype_size(m.out.dtype));
  const bool vec = m.width % kGroup == 0 && aligned(a, group_alignment(kGroup, as)) &&
                   aligned(b, group_alignment(kGroup, bs)) && aligned(y, group_alignment(kGroup, ys));
  if (vec) {
    for (int64_t c = int64_t(lane) * kGroup; c < m.width; c += kWarp * kGroup)
      merge_group<kGroup>(op, a + c * as, m.a.dtype, b + c * bs, m.b.dtype, y + c * ys, m.out.dtype);
    return;
  }
  for (int64_t c = lane; c < m.width; c += kWarp)
    merge_group<1>(op, a + c * as, m.a.dtype, b + c * bs, m.b.dtype, y + c * ys, m.out.dtype);
}

__global__ void merge_states_kernel(const __grid_constant__ MergeArgs m) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t rows = m.tokens * m.heads, step = int64_t(gridDim.x) * kRowWarps;
  const bool scaled = m.output_scale != nullptr;
  const float scale = scaled ? *m.output_scale : 1.0f;
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; r < rows; r += step) {
    const int64_t t = r / m.heads, h = r % m.heads;
    RowOp op{0.0f, 1.0f, t >= m.merge_rows, scaled, scale};
    float lse = m.b_lse.at(t, h);  // copied rows keep b's LSE as given
    if (!op.copy) {
      const MergeWeights w = merge_lse(m.a_lse.at(t, h), lse);
      op.w_a = w.w_a;
      op.w_b = w.w_b;
      lse = w.lse;
    }
    merge_row(m, op, t, h, lane);
    if (m.out_lse.data && lane == 0) m.out_lse.at(t, h) = lse;
  }
}

Lse lse_of(const TensorRef& t) { return {static_cast<float*>(t.data), t.stride[0], t.stride[1]}; }

}  // namespace

void merge_states(const detail::MergeProblem& pr, void* stream) {
  const int64_t rows = pr.tokens * pr.heads;
  if (rows == 0) return;
  MergeArgs m{};
  m.tokens = pr.tokens;
  m.heads = pr.heads;
  m.width = pr.head_dim;
  m.merge_rows = pr.merge_rows;
  m.a = token_rows(pr.a_out, pr.a_out.dtype);
  m.b = token_rows(pr.b_out, pr.b_out.dtype);
  m.out = token_rows(pr.out, pr.out_format);
  m.a_lse = lse_of(pr.a_lse);
  m.b_lse = lse_of(pr.b_lse);
  if (pr.out_lse) m.out_lse = lse_of(*pr.out_lse);
  if (pr.output_scale) m.output_scale = static_cast<const float*>(pr.output_scale->data);
  const int64_t blocks = grid_for(rows, kRowWarps);
  merge_states_kernel<<<unsigned(blocks), kRowWarps * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(m);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
