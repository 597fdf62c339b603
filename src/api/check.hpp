// Small argument checks shared by the validators. Each throws flashserve::Error whose message
// starts with the argument's name: "<arg>: expected <what>, got <what>".
#pragma once

#include <initializer_list>
#include <string>

#include "flashserve/status.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::detail {

std::string dtype_list(std::initializer_list<DType> allowed);  // "float16 or bfloat16"

void check_rank(const TensorRef& t, const char* arg, int ndim);
void check_rank_in(const TensorRef& t, const char* arg, int lo, int hi);
void check_dtype(const TensorRef& t, const char* arg, std::initializer_list<DType> allowed);
void check_dim(const TensorRef& t, const char* arg, int d, int64_t expected, const char* what);
void check_last_contiguous(const TensorRef& t, const char* arg);
void check_non_negative_strides(const TensorRef& t, const char* arg);
// The tensor must live on `dev` (that of `ref_arg`).
void check_device(const TensorRef& t, const char* arg, Device dev, const char* ref_arg);
// Non-null data unless the tensor is empty.
void check_data(const TensorRef& t, const char* arg);

// All checks a plain operand needs: rank, dtype, last dim contiguous, device, data.
void check_operand(const TensorRef& t, const char* arg, int ndim, std::initializer_list<DType> allowed,
                   Device dev, const char* ref_arg);

// Host read of element i of a 1-D int32/int64 tensor (CPU only).
int64_t read_index(const TensorRef& t, int64_t i);
int64_t read_index2(const TensorRef& t, int64_t i, int64_t j);

}  // namespace flashserve::detail
