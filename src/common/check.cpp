#include "common/check.hpp"

#include <cstdint>

namespace flashserve::detail {

std::string dtype_list(std::initializer_list<DType> allowed) {
  std::string s;
  size_t i = 0;
  for (DType t : allowed) {
    if (i) s += (i + 1 == allowed.size()) ? " or " : ", ";
    s += dtype_name(t);
    ++i;
  }
  return s;
}

void check_rank(const TensorRef& t, Arg arg, int ndim, std::string_view dims) {
  if (t.ndim != ndim) fail_arg(arg, cat(ndim, " dims", dims.empty() ? "" : " ", dims), cat(t.ndim, " dims ", t.shape_str()));
}

void check_dtype_as(const TensorRef& t, Arg arg, DType want, std::string_view why) {
  if (t.dtype != want) fail_arg(arg, cat(dtype_name(want), " (", why, ")"), dtype_name(t.dtype));
}

void check_shape(const TensorRef& t, Arg arg, std::initializer_list<int64_t> shape, std::string_view what) {
  bool ok = t.ndim == int(shape.size());
  std::string want = "[";
  int d = 0;
  for (int64_t s : shape) {
    want += (d > 0 ? ", " : "") + (s < 0 ? std::string("*") : std::to_string(s));
    if (ok && s >= 0 && t.shape[size_t(d)] != s) ok = false;
    ++d;
  }
  want += "]";
  if (!ok) fail_arg(arg, cat(want, " (", what, ")"), t.shape_str());
}

Device common_device(std::initializer_list<NamedTensor> args) {
  const NamedTensor* first = nullptr;
  for (const NamedTensor& a : args) {
    if (a.t == nullptr) continue;
    if (first == nullptr) first = &a;
    else if (!(a.t->device == first->t->device))
      fail_arg(a.name, cat("device ", to_string(first->t->device), " (as ", first->name, ")"), to_string(a.t->device));
  }
  return first ? first->t->device : Device{};
}

void check_rank_in(const TensorRef& t, Arg arg, int lo, int hi) {
  if (t.ndim < lo || t.ndim > hi) fail_arg(arg, cat(lo, " to ", hi, " dims"), cat(t.ndim, " dims ", t.shape_str()));
}

void check_dtype(const TensorRef& t, Arg arg, std::initializer_list<DType> allowed) {
  for (DType a : allowed)
    if (t.dtype == a) return;
  fail_arg(arg, dtype_list(allowed), dtype_name(t.dtype));
}

void check_dim(const TensorRef& t, Arg arg, int d, int64_t expected, const char* what) {
  const int dd = d < 0 ? d + t.ndim : d;
  if (t.shape[size_t(dd)] != expected)
    fail_arg(arg, cat("size ", expected, " in dim ", dd, " (", what, ")"), cat("shape ", t.shape_str()));
}

void check_last_contiguous(const TensorRef& t, Arg arg) {
  if (!t.last_dim_contiguous())
    fail_arg(arg, "a contiguous last dimension (stride 1)", cat("stride ", t.stride[size_t(t.ndim - 1)]));
}

void check_non_negative_strides(const TensorRef& t, Arg arg) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.stride[size_t(d)] < 0) fail_arg(arg, "non-negative strides", cat("stride ", t.stride[size_t(d)], " in dim ", d));
}

void check_device(const TensorRef& t, Arg arg, Device dev, Arg ref_arg) {
  if (!(t.device == dev)) fail_arg(arg, cat("device ", to_string(dev), " (that of ", ref_arg, ")"), to_string(t.device));
}

void check_data(const TensorRef& t, Arg arg) {
  if (t.data == nullptr && t.numel() > 0) fail_arg(arg, "non-null data", "a null pointer");
}

void check_operand(const TensorRef& t, Arg arg, int ndim, std::initializer_list<DType> allowed,
                   Device dev, Arg ref_arg) {
  check_rank(t, arg, ndim);
  check_dtype(t, arg, allowed);
  check_device(t, arg, dev, ref_arg);
  check_non_negative_strides(t, arg);
  check_last_contiguous(t, arg);
  check_data(t, arg);
}

int64_t read_index(const TensorRef& t, int64_t i) {
  const void* p = t.at(i);
  return t.dtype == DType::i64 ? *static_cast<const int64_t*>(p) : int64_t(*static_cast<const int32_t*>(p));
}

int64_t read_index2(const TensorRef& t, int64_t i, int64_t j) {
  const void* p = t.at(i, j);
  return t.dtype == DType::i64 ? *static_cast<const int64_t*>(p) : int64_t(*static_cast<const int32_t*>(p));
}

}  // namespace flashserve::detail
