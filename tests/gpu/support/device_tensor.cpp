#include "support/device_tensor.hpp"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace fsgpu {

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
}  // namespace

std::shared_ptr<void> device_alloc(size_t bytes) {
  if (bytes == 0) return {};
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

DeviceTensor DeviceTensor::mirror(const fstest::HostTensor& h) {
  DeviceTensor d;
  d.bytes = h.bytes->size();
  d.storage = device_alloc(d.bytes);
  check(cudaMemcpy(d.storage.get(), h.bytes->data(), d.bytes, cudaMemcpyHostToDevice), "mirror");
  d.ref = h.ref;
  const auto offset = static_cast<const char*>(h.ref.data) - reinterpret_cast<const char*>(h.bytes->data());
  d.ref.data = static_cast<char*>(d.storage.get()) + offset;
  d.ref.device = flashserve::Device{flashserve::DeviceType::cuda, 0};
  return d;
}

DeviceTensor DeviceTensor::poisoned_mirror(const fstest::HostTensor& h) {
  fstest::poison_storage(h);
  DeviceTensor d = mirror(h);
  poison(d);
  return d;
}

void DeviceTensor::copy_to(const fstest::HostTensor& h) const {
  check(cudaMemcpy(h.bytes->data(), storage.get(), bytes, cudaMemcpyDeviceToHost), "copy_to");
}

void DeviceTensor::copy_from(const fstest::HostTensor& h) const {
  check(cudaMemcpy(storage.get(), h.bytes->data(), bytes, cudaMemcpyHostToDevice), "copy_from");
}

fstest::HostTensor DeviceTensor::download(const fstest::HostTensor& like) const {
  fstest::HostTensor c = like.clone();
  copy_to(c);
  return c;
}

std::optional<DeviceTensor> mirror(const std::optional<fstest::HostTensor>& h) {
  if (!h) return std::nullopt;
  return DeviceTensor::mirror(*h);
}

void poison(const DeviceTensor& d) { check(cudaMemset(d.storage.get(), 0xFF, d.bytes), "poison"); }

void sync() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

}  // namespace fsgpu
