// Launches whose grid's z (the split-KV splits) is one thread-block cluster (1, 1, z): the
// splits of a work unit merged in the kernel through distributed shared memory
// (attention/cluster_merge.cuh). Clusters past 8 CTAs need a per-kernel attribute (the
// non-portable size, up to 16 on sm_90), set once per (kernel, device).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

template <auto kKernel, class... Args>
void launch_split_cluster(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Args&... args) {
  if (grid.z > 8) {
    constexpr int kMaxDevices = 64;
    static std::array<std::atomic<bool>, kMaxDevices> allowed{};
    int device = 0;
    FS_CUDA_CHECK(cudaGetDevice(&device));
    if (device >= kMaxDevices || !allowed[size_t(device)].load()) {
      FS_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      if (device < kMaxDevices) allowed[size_t(device)].store(true);
    }
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 1;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = grid.z;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  FS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kKernel, args...));
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
