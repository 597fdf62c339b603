// Device properties for the planner (device_info.hpp), cached per device.
#include <array>
#include <mutex>
#include <optional>

#include "kernels/common/cuda_check.cuh"
#include "kernels/device_info.hpp"

namespace flashserve::kernels {

namespace {

constexpr int kMaxDevices = 64;

DeviceProps query_device(int index) {
  DeviceProps d;
  d.device = Device{DeviceType::cuda, index};
  FS_CUDA_CHECK(cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, index));
  FS_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, index));
  FS_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, index));
  return d;
}

}  // namespace

DeviceProps cuda_device_props(int device_index) {
  static std::mutex mutex;
  static std::array<std::optional<DeviceProps>, kMaxDevices> cache;
  static int device_count = -1;

  const std::lock_guard<std::mutex> lock(mutex);
  if (device_count < 0) {
    int n = 0;
    FS_CUDA_CHECK(cudaGetDeviceCount(&n));
    device_count = n;
  }
  const int limit = device_count < kMaxDevices ? device_count : kMaxDevices;
  FS_CHECK_ARG(device_index >= 0 && device_index < limit, "device",
               detail::cat("a CUDA device index in [0, ", limit, ")"), device_index);
  auto& slot = cache[size_t(device_index)];
  if (!slot) slot = query_device(device_index);
  return *slot;
}

}  // namespace flashserve::kernels
