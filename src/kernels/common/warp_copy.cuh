// Copies a byte range with one warp, using the widest accesses (up to 16 bytes) that the
// addresses and the length allow.
#pragma once

#include <cstdint>

namespace flashserve::kernels {

template <class U>
__device__ __forceinline__ void warp_copy_units(char* y, const char* x, int64_t units, int lane) {
  for (int64_t u = lane; u < units; u += 32) reinterpret_cast<U*>(y)[u] = reinterpret_cast<const U*>(x)[u];
}

// y[0, bytes) = x[0, bytes); lane = 0..31 of the copying warp.
__device__ __forceinline__ void warp_copy_bytes(char* y, const char* x, int64_t bytes, int lane) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) | uintptr_t(bytes);
  if (bits % 16 == 0) return warp_copy_units<uint4>(y, x, bytes / 16, lane);
  if (bits % 8 == 0) return warp_copy_units<uint2>(y, x, bytes / 8, lane);
  if (bits % 4 == 0) return warp_copy_units<uint32_t>(y, x, bytes / 4, lane);
  if (bits % 2 == 0) return warp_copy_units<uint16_t>(y, x, bytes / 2, lane);
  warp_copy_units<uint8_t>(y, x, bytes, lane);
}

}  // namespace flashserve::kernels
