// The current CUDA device set for a scope (launches on a tensor's device), then restored.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

// Makes `device` current for its lifetime, restoring the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FS_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) {
      FS_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

}  // namespace flashserve::kernels
