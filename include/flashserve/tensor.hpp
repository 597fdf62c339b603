// Non-owning tensor references: the only tensor type of the public API.
// Shapes and strides are in elements, 64-bit; the last dimension of every attention operand
// must be contiguous, other strides are free (block-table row slices, K/V interleaved per
// block, caches over 2^31 bytes).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace flashserve {

enum class DType : uint8_t { f32, f16, bf16, f8e4m3, f8e5m2, i8, u8, i32, i64, f64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    default: return 1;
  }
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f8e4m3: return "float8_e4m3fn";
    case DType::f8e5m2: return "float8_e5m2";
    case DType::i8: return "int8";
    case DType::u8: return "uint8";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::f64: return "float64";
  }
  return "?";
}

constexpr bool is_fp8(DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; }
constexpr bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};

std::string to_string(Device d);

inline constexpr int kMaxDims = 6;

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // elements

  // Row-major contiguous view.
  static TensorRef contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                              Device device = {});
  // Explicit strides (elements), same length as shape.
  static TensorRef strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           std::initializer_list<int64_t> stride, Device device = {});

  // Negative d counts from the end, as in Python.
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t strides(int d) const { return stride[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  bool last_dim_contiguous() const { return ndim == 0 || shape[ndim - 1] <= 1 || stride[ndim - 1] == 1; }
  // Largest element offset reachable + 1 (0 when empty); the extent the view spans.
  int64_t span_elements() const;

  // Views.
  TensorRef select(int d, int64_t i) const;                      // drops dim d
  TensorRef slice(int d, int64_t begin, int64_t end) const;      // keeps dim d
  TensorRef permute(std::initializer_list<int> order) const;
  TensorRef unsqueeze(int d) const;                              // size-1 dim at d

  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
  // Address of the element at the given index (64-bit offset arithmetic).
  template <class... I>
  void* at(I... idx) const {
    const int64_t ix[] = {static_cast<int64_t>(idx)...};
    int64_t off = 0;
    for (size_t d = 0; d < sizeof...(I); ++d) off += ix[d] * stride[d];
    return static_cast<char*>(data) + off * static_cast<int64_t>(dtype_size(dtype));
  }

  std::string shape_str() const;  // "[2, 3, 4]"
};

using OptTensor = std::optional<TensorRef>;

}  // namespace flashserve
