#include "flashserve/tensor.hpp"


#include "flashserve/status.hpp"

namespace flashserve {

std::string to_string(Device d) {
  if (d.type == DeviceType::cpu) return d.index == 0 ? std::string("cpu") : "cpu:" + std::to_string(d.index);
  return "cuda:" + std::to_string(d.index);
}

namespace {
template <class L>
int fill_dims(std::array<int64_t, kMaxDims>& dst, const L& src, const char* what) {
  if (src.size() > size_t(kMaxDims)) throw Error(detail::cat(what, ": expected at most ", kMaxDims, " dims, got ", src.size()));
  int n = 0;
  for (int64_t x : src) dst[n++] = x;
  return n;
}
}  // namespace

TensorRef TensorRef::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = fill_dims(t.shape, shape, "shape");
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = s;
    s *= t.shape[d];
  }
  return t;
}

TensorRef TensorRef::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> stride, Device device) {
  if (shape.size() != stride.size()) throw Error(detail::cat("stride: expected ", shape.size(), " entries, got ", stride.size()));
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = fill_dims(t.shape, shape, "shape");
  fill_dims(t.stride, stride, "stride");
  return t;
}

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorRef::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

int64_t TensorRef::span_elements() const {
  if (numel() == 0) return 0;
  int64_t hi = 0;
  for (int d = 0; d < ndim; ++d) hi += (shape[d] - 1) * (stride[d] > 0 ? stride[d] : 0);
  return hi + 1;
}

TensorRef TensorRef::select(int d, int64_t i) const {
  d = d < 0 ? d + ndim : d;
  TensorRef t = *this;
  t.data = static_cast<char*>(data) + i * stride[d] * int64_t(dtype_size(dtype));
  for (int e = d; e + 1 < ndim; ++e) {
    t.shape[e] = shape[e + 1];
    t.stride[e] = stride[e + 1];
  }
  t.ndim = ndim - 1;
  return t;
}

TensorRef TensorRef::slice(int d, int64_t begin, int64_t end) const {
  d = d < 0 ? d + ndim : d;
  TensorRef t = *this;
  t.data = static_cast<char*>(data) + begin * stride[d] * int64_t(dtype_size(dtype));
  t.shape[d] = end - begin;
  return t;
}

TensorRef TensorRef::permute(std::initializer_list<int> order) const {
  if (int(order.size()) != ndim) throw Error(detail::cat("permute: expected ", ndim, " dims, got ", order.size()));
  TensorRef t = *this;
  int e = 0;
  for (int d : order) {
    t.shape[e] = shape[d];
    t.stride[e] = stride[d];
    ++e;
  }
  return t;
}

TensorRef TensorRef::unsqueeze(int d) const {
  d = d < 0 ? d + ndim + 1 : d;
  if (ndim >= kMaxDims) throw Error(detail::cat("unsqueeze: expected fewer than ", kMaxDims, " dims, got ", ndim));
  TensorRef t = *this;
  for (int e = ndim; e > d; --e) {
    t.shape[e] = shape[e - 1];
    t.stride[e] = stride[e - 1];
  }
  t.shape[d] = 1;
  t.stride[d] = d < ndim ? shape[d] * stride[d] : 1;  // any value serves a size-1 dim
  t.ndim = ndim + 1;
  return t;
}

std::string TensorRef::shape_str() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += detail::cat(d ? ", " : "", shape[d]);
  return s + "]";
}

}  // namespace flashserve
