// Launches whose grid's z (the split-KV splits) is one thread-block cluster (1, 1, z): the
// splits of a work unit merged in the kernel through distributed shared memory
// (attention/cluster_merge.cuh). Clusters past 8 CTAs need a per-kernel attribute (the
// non-portable size, up to 16 on sm_90).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/env_switch.hpp"
#include "kernels/common/sm_fit.hpp"

namespace flashserve::kernels {

// The clusters' placement on a GPC's SMs (cudaClusterSchedulingPolicy): the driver's default
// (0), spread over the SMs (1) or load-balanced (2). FLASHSERVE_DECODE_CLUSTER_POLICY=1/2 sets it
// (an A/B: clusters of 8-16 splits ran 13-31% slower than the combine with the default,
// bench/RESULTS.md 2026-12-07 22:10, perhaps packed two CTAs per SM on half a GPC's SMs).
inline cudaClusterSchedulingPolicy cluster_policy() {
  static const int policy = env_digit<0, 2, 0>("FLASHSERVE_DECODE_CLUSTER_POLICY");
  return cudaClusterSchedulingPolicy(policy);
}

// Launches kKernel over `grid` with the cluster (1, 1, grid.z), or returns false without
// launching when no such cluster fits on the device (cudaOccupancyMaxActiveClusters: a cluster
// must be resident on one GPC at once, e.g. 16 CTAs of one per SM on a GPU whose GPCs have
// fewer SMs); the caller then launches unclustered. Both the attribute and the fit are looked up
// once per (kernel, device, cluster size).
template <auto kKernel, class... Args>
bool launch_split_cluster(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Args&... args) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices * (kClusterMaxCtas + 1)> fits{};  // 0 unknown, 1 yes, 2 no
  if (grid.z < 2 || grid.z > unsigned(kClusterMaxCtas)) return false;
  int device = 0;
  FS_CUDA_CHECK(cudaGetDevice(&device));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 1;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = grid.z;
  attrs[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  attrs[1].val.clusterSchedulingPolicyPreference = cluster_policy();
  cfg.attrs = attrs;
  cfg.numAttrs = attrs[1].val.clusterSchedulingPolicyPreference == cudaClusterSchedulingPolicyDefault ? 1 : 2;
  std::atomic<int>* known = device < kMaxDevices ? &fits[size_t(device) * (kClusterMaxCtas + 1) + grid.z] : nullptr;
  int state = known ? known->load() : 0;
  if (state == 0) {
    if (grid.z > 8)  // past the portable cluster size
      FS_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int clusters = 0;
    FS_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kKernel, &cfg));
    state = clusters > 0 ? 1 : 2;
    if (known) known->store(state);
  }
  if (state != 1) return false;
  FS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kKernel, args...));
  FS_CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace flashserve::kernels
