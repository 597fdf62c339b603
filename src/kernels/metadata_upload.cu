// The metadata builder's device buffers, upload and local block-table gather
// (metadata_upload.hpp).
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/device_guard.cuh"
#include "kernels/metadata_upload.hpp"

namespace flashserve::kernels {

namespace {

// Runs f with `device` current, then restores the previous one; never throws (releases).
template <class F>
void on_device_quietly(int device, F&& f) noexcept {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  (void)cudaSetDevice(device);
  f();
  (void)cudaSetDevice(previous);
}

// Entry j (< cols) of row r of the engine's table.
__device__ __forceinline__ int32_t table_at(const EngineTable& t, int64_t r, int64_t j) {
  return t.table[r * t.row_stride + j];
}

// One thread per (virtual request, column).
__global__ void gather_local_kernel(LocalTableGather g) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= g.num_virtual * g.width) return;
  const int64_t v = i / g.width, j = i % g.width;
  const int64_t col = g.k_start[v] / g.t.block_size + j;
  g.out[i] = col < g.t.cols ? table_at(g.t, g.request[v], col) : 0;
}

// One thread per pair.
__global__ void table_slots_kernel(TableSlots k) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= k.n) return;
  const int64_t r = k.req_pos[2 * i], pos = k.req_pos[2 * i + 1], bs = k.t.block_size;
  int64_t slot = k.empty;
  if (r >= 0) slot = pos < 0 || pos / bs >= k.t.cols ? -1 : int64_t(table_at(k.t, r, pos / bs)) * bs + pos % bs;
  if (k.out32) k.out32[i] = slot > INT32_MAX || slot < INT32_MIN ? -1 : int32_t(slot);
  else k.out64[i] = slot;
}

}  // namespace

void* metadata_device_alloc(size_t bytes, int device) {
  if (bytes == 0) return nullptr;
  DeviceGuard guard(device);
  void* p = nullptr;
  FS_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

void metadata_device_free(void* p, int device) noexcept {
  if (p) on_device_quietly(device, [p] { (void)cudaFree(p); });
}

void* metadata_pinned_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  FS_CUDA_CHECK(cudaMallocHost(&p, bytes));
  return p;
}

void metadata_pinned_free(void* p) noexcept {
  if (p) (void)cudaFreeHost(p);
}

void* metadata_event_create(int device) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  FS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void metadata_event_destroy(void* event, int device) noexcept {
  if (event) on_device_quietly(device, [event] { (void)cudaEventDestroy(static_cast<cudaEvent_t>(event)); });
}

void metadata_upload_wait(void* event) { FS_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

void metadata_upload(void* dst, const void* src, size_t bytes, void* stream, void* event) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (bytes > 0) FS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FS_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  if (capture == cudaStreamCaptureStatusNone) FS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), s));
}

void gather_local_block_table(const LocalTableGather& g, void* stream) {
  const int64_t n = g.num_virtual * g.width;
  if (n == 0) return;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  gather_local_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(g);
  FS_CUDA_CHECK_LAUNCH();
}

void table_slots(const TableSlots& t, void* stream) {
  if (t.n == 0) return;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((t.n + kThreads - 1) / kThreads);
  table_slots_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(t);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
