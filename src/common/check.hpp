// Small argument checks shared by the validators. Each throws flashserve::Error whose message
// starts with the argument's name: "<arg>: expected <what>, got <what>".
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "flashserve/status.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::detail {

std::string dtype_list(std::initializer_list<DType> allowed);  // "float16 or bfloat16"

using Arg = std::string_view;  // an argument's name

// "key: expected 3 dims [num_tokens, H_kv, D], got [4, 8]" (dims may be empty)
void check_rank(const TensorRef& t, Arg arg, int ndim, std::string_view dims = {});
void check_rank_in(const TensorRef& t, Arg arg, int lo, int hi);
void check_dtype(const TensorRef& t, Arg arg, std::initializer_list<DType> allowed);
// "value: expected float16 (as key), got bfloat16"
void check_dtype_as(const TensorRef& t, Arg arg, DType want, std::string_view why);
void check_dim(const TensorRef& t, Arg arg, int d, int64_t expected, const char* what);
// Exact shape; -1 entries match anything; `what` names the dims in the message.
void check_shape(const TensorRef& t, Arg arg, std::initializer_list<int64_t> shape, std::string_view what);
void check_last_contiguous(const TensorRef& t, Arg arg);
void check_non_negative_strides(const TensorRef& t, Arg arg);
// The tensor must live on `dev` (that of `ref_arg`).
void check_device(const TensorRef& t, Arg arg, Device dev, Arg ref_arg);
// Non-null data unless the tensor is empty.
void check_data(const TensorRef& t, Arg arg);

// All checks a plain operand needs: rank, dtype, last dim contiguous, device, data.
void check_operand(const TensorRef& t, Arg arg, int ndim, std::initializer_list<DType> allowed,
                   Device dev, Arg ref_arg);

// The device all present tensors share; throws naming the first one that differs from the
// first present one ("value_cache: expected device cpu (as key), got cuda:0").
struct NamedTensor {
  Arg name;
  const TensorRef* t;  // nullptr: absent optional
};
Device common_device(std::initializer_list<NamedTensor> args);

// Host read of element i of a 1-D int32/int64 tensor (CPU only).
int64_t read_index(const TensorRef& t, int64_t i);
int64_t read_index2(const TensorRef& t, int64_t i, int64_t j);

}  // namespace flashserve::detail
