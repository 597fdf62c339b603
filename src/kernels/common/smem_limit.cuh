// Dynamic shared memory above the default 48 KB needs a per-kernel attribute. The record of
// what was granted is kept per kernel (the kernel itself is the template argument): kernels of
// one signature must never share it, or the second one launches without its limit.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <mutex>

#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

// Raises (never lowers) kKernel's dynamic shared memory limit on the current device to at
// least `smem`; with `max_carveout`, also prefers all of L1 as shared memory (several CTAs per
// SM). Thread-safe; the attribute calls happen once per (kernel, device, larger size).
template <auto kKernel>
void ensure_smem_limit(size_t smem, bool max_carveout = false) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<size_t>, kMaxDevices> granted{};
  static std::mutex mutex;
  int device = 0;
  FS_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<size_t>* g = device < kMaxDevices ? &granted[size_t(device)] : nullptr;
  if (g && smem <= g->load()) return;
  const std::lock_guard<std::mutex> lock(mutex);
  if (g && smem <= g->load()) return;
  FS_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  if (max_carveout)
    FS_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       int(cudaSharedmemCarveoutMaxShared)));
  if (g) g->store(smem);
}

}  // namespace flashserve::kernels
