// An owning, 64-byte aligned host allocation with a contiguous TensorRef view over it.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>

#include "flashserve/tensor.hpp"

namespace serving {

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(flashserve::DType dtype, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const size_t bytes = (size_t(n) * flashserve::dtype_size(dtype) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes ? bytes : 64);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    mem_.reset(p);
    bytes_ = bytes;
    ref_ = flashserve::TensorRef::contiguous(p, dtype, shape);
  }
  const flashserve::TensorRef& ref() const { return ref_; }
  template <class T>
  T* data() const { return static_cast<T*>(ref_.data); }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> mem_;
  size_t bytes_ = 0;
  flashserve::TensorRef ref_;
};

}  // namespace serving
