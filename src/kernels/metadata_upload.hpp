// The metadata builder's device side (backend.hpp, MetadataBuilder with CUDA metadata): its
// fixed buffers (pinned host staging + device copy), the one host-to-device copy per build, the
// gather of the chunked-local block table and the slot tables from the engine's device table. A plain C++
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

// The engine's device block table: int32 [rows, cols], row stride `row_stride`, of blocks of
// `block_size` tokens.
struct EngineTable {
  const int32_t* table = nullptr;
  int64_t cols = 0, row_stride = 0;
  int64_t block_size = 1;
};

// out[v][j] = table[request[v]][k_start[v] / block_size + j] for j < width, 0 past the source
// row's end (the device twin of planner::gather_local_block_table). Every pointer is device
// memory; out int32 [num_virtual, width].
struct LocalTableGather {
  EngineTable t;
  const int32_t* k_start = nullptr;  // [num_virtual]
  const int32_t* request = nullptr;  // [num_virtual]
  int64_t num_virtual = 0, width = 0;
  int32_t* out = nullptr;            // [num_virtual, width]
};
void gather_local_block_table(const LocalTableGather& g, void* stream);

// Slots through the engine's device block table, for the builder's device-side slot tables
// (tree verify's per-draft slot rows, advance_decode_step's new slot_mapping): for each pair
// (request, position) of req_pos [n][2], table[request][position / block_size] * block_size +
// position % block_size; `empty` when request < 0; -1 when the column lies past the table or
// the slot past the output type (a bad slot: attention gives NaN rows, cache writes skip it).
// Exactly one of out32 / out64 [n] is set.
struct TableSlots {
  EngineTable t;
  const int32_t* req_pos = nullptr;  // [n][2]
  int64_t n = 0;
  int64_t empty = 0;
  int32_t* out32 = nullptr;
  int64_t* out64 = nullptr;
};
void table_slots(const TableSlots& t, void* stream);

}  // namespace flashserve::kernels
