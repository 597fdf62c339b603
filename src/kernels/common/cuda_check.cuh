// Turning CUDA runtime errors into flashserve::RuntimeError (status.hpp), with the failing
// expression, the CUDA error name and string, and the source location.
//
//   FS_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));
//   kernel<<<grid, block, smem, stream>>>(params);
//   FS_CUDA_CHECK_LAUNCH();
#pragma once

#include <cuda_runtime.h>

#include "flashserve/status.hpp"

namespace flashserve::kernels {

// Clears the runtime's last-error state first, so that a later FS_CUDA_CHECK_LAUNCH does not
// report this (already thrown) error again; sticky errors stay sticky.
[[noreturn]] inline void cuda_fail(cudaError_t err, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();
  throw RuntimeError(detail::cat("CUDA error ", cudaGetErrorName(err), " (",
                                 cudaGetErrorString(err), ") in ", expr, " at ", file, ":", line));
}

}  // namespace flashserve::kernels

// Evaluates a cudaError_t expression once; throws flashserve::RuntimeError unless cudaSuccess.
#define FS_CUDA_CHECK(expr)                                                       \
  do {                                                                            \
    const cudaError_t fs_cuda_err_ = (expr);                                      \
    if (fs_cuda_err_ != cudaSuccess)                                              \
      ::flashserve::kernels::cuda_fail(fs_cuda_err_, #expr, __FILE__, __LINE__);  \
  } while (0)

// After a kernel launch: reports a bad launch configuration (not errors of the running kernel,
// which surface at the next synchronizing call).
#define FS_CUDA_CHECK_LAUNCH() FS_CUDA_CHECK(cudaGetLastError())
