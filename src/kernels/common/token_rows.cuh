// A [T, H, width] tensor seen as rows (token t, head h), the last dim contiguous. Shared by the
// row-wise kernels (merge, variant ops).
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

inline constexpr int kWarp = 32;

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
