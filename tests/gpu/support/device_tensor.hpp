// GPU test support: mirrors of host test tensors on the device. A mirror copies the host
// tensor's whole storage (so strided views, interleaved caches and padding keep their layout)
// and rebases the view onto the device copy.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "flashserve/tensor.hpp"
#include "support/host_tensor.hpp"

namespace fsgpu {

using flashserve::TensorRef;

struct DeviceTensor {
  std::shared_ptr<void> storage;  // cudaFree on release
  size_t bytes = 0;
  TensorRef ref;                  // the host view's shape/strides over the device storage

  // Copies `h`'s storage to the device; ref keeps h's view (device = cuda:0).
  static DeviceTensor mirror(const fstest::HostTensor& h);
  // Poisons h's whole storage, then mirrors it (device storage poisoned alike).
  static DeviceTensor poisoned_mirror(const fstest::HostTensor& h);
  // Device copy of the storage back into h's storage (whole storage, including padding).
  void copy_to(const fstest::HostTensor& h) const;
  // Host copy -> device (re-upload after the host side changed).
  void copy_from(const fstest::HostTensor& h) const;
  // The device storage as a new host tensor laid out as `like`.
  fstest::HostTensor download(const fstest::HostTensor& like) const;
};

// A mirror of an optional host tensor (empty when absent).
std::optional<DeviceTensor> mirror(const std::optional<fstest::HostTensor>& h);

// Device memory for a workspace of `bytes` (null for 0).
std::shared_ptr<void> device_alloc(size_t bytes);

// Fills every byte of the device storage with 0xFF (NaN / -1 poison).
void poison(const DeviceTensor& d);

void sync();  // cudaDeviceSynchronize with a check

}  // namespace fsgpu
