// A [T, H, width] tensor seen as rows (token t, head h), the last dim contiguous, and the launch
// arithmetic of the row-wise kernels (cache ops, merge, variant ops), which loop past the grid.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

inline constexpr int kWarp = 32;
inline constexpr int64_t kMaxGrid = 1 << 20;  // blocks per launch; the kernels loop past it

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Blocks for `work` items at `per_block` a block, at most `cap`.
inline int64_t grid_for(int64_t work, int64_t per_block, int64_t cap = kMaxGrid) {
  return std::min((work + per_block - 1) / per_block, cap);
}

struct TokenRows {
  char* data;
  DType dtype;              // element format of the rows (may differ from the tensor's label)
  int64_t s_token, s_head;  // strides in elements
  __device__ char* row(int64_t t, int64_t h) const {
    return data + (t * s_token + h * s_head) * int64_t(dtype_size(dtype));
  }
};

inline TokenRows token_rows(const TensorRef& t, DType dtype) {
  return {static_cast<char*>(t.data), dtype, t.stride[0], t.stride[1]};
}
inline TokenRows token_rows(const TensorRef& t) { return token_rows(t, t.dtype); }

}  // namespace flashserve::kernels
