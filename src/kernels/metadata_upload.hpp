// The metadata builder's device side (backend.hpp, MetadataBuilder with CUDA metadata): its
// fixed buffers (pinned host staging + device copy), the one host-to-device copy per build, and
// the gather of the chunked-local block table from the engine's device table. A plain C++
// header: src/backend includes it without CUDA headers. Defined only in CUDA builds
// (FLASHSERVE_WITH_CUDA=1); every CUDA error becomes flashserve::RuntimeError.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashserve::kernels {

// Device memory on device `device` (the current device is restored); null for 0 bytes.
void* metadata_device_alloc(size_t bytes, int device);
void metadata_device_free(void* p, int device) noexcept;
// Page-locked host memory, so the copy is truly asynchronous (and a captured copy re-reads it
// on every graph replay); null for 0 bytes.
void* metadata_pinned_alloc(size_t bytes);
void metadata_pinned_free(void* p) noexcept;
// An event (timing disabled) on device `device`, marking the end of the last upload.
void* metadata_event_create(int device);
void metadata_event_destroy(void* event, int device) noexcept;

// Waits until the upload recorded on `event` has read its staging buffer (returns at once when
// none was recorded), so the host may rewrite the staging buffer.
void metadata_upload_wait(void* event);
// dst (device) <- src (pinned host), `bytes`, on `stream` (a cudaStream_t; null = the default
// stream), then records `event` on the stream unless the stream is capturing a graph. `src`
// must stay unchanged until the copy ran: metadata_upload_wait(event) before rewriting it.
void metadata_upload(void* dst, const void* src, size_t bytes, void* stream, void* event);

// out[v][j] = table[request[v]][k_start[v] / block_size + j] for j < width, 0 past the source
// row's end (the device twin of planner::gather_local_block_table). Every pointer is device
// memory; table int32 [rows, cols] with row stride `row_stride`; out int32 [num_virtual, width].
struct LocalTableGather {
  const int32_t* table = nullptr;
  int64_t cols = 0, row_stride = 0;
  int64_t block_size = 1;
  const int32_t* k_start = nullptr;  // [num_virtual]
  const int32_t* request = nullptr;  // [num_virtual]
  int64_t num_virtual = 0, width = 0;
  int32_t* out = nullptr;            // [num_virtual, width]
};
void gather_local_block_table(const LocalTableGather& g, void* stream);

}  // namespace flashserve::kernels
