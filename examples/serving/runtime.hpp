// Where the engine's tensors live and how its attention time is measured: the host (the CPU
// reference backend, wall clock) or a CUDA device (cudaMalloc'ed memory, one stream, cudaEvent
// timing). The engine allocates everything once through this interface and moves only step
// inputs (block table rows, slots, copy-on-write pairs, token rows) per step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>

#include "activations.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace serving {

// Memory owned by a runtime with a contiguous view over it (device: the runtime's).
struct Buffer {
  std::shared_ptr<void> mem;
  size_t bytes = 0;
  flashserve::TensorRef ref;
  template <class T>
  T* data() const { return static_cast<T*>(ref.data); }
};

// The q/k/v rows of one layer in one step: row r of q/k/v ([>= rows, heads, D], contiguous)
// is the token of rows[r] (host) / device_rows[r] (the same rows in the runtime's memory).
struct QkvFill {
  const Activations* act = nullptr;
  std::span<const TokenRow> rows;
  const TokenRow* device_rows = nullptr;
  int layer = 0;
  flashserve::TensorRef q, k, v;
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual std::string name() const = 0;                  // "cpu (reference backend)", "cuda:0 NVIDIA H200"
  virtual bool is_cuda() const = 0;
  virtual flashserve::DeviceProps props() const = 0;     // for the metadata builder
  virtual void* stream() const { return nullptr; }       // cudaStream_t of every call
  virtual size_t free_bytes() const = 0;                 // memory left for the KV pool
  // Zero-filled memory of `shape` in the runtime's memory.
  virtual Buffer alloc(flashserve::DType dtype, std::initializer_list<int64_t> shape) = 0;
  // dst (runtime memory) <- src (host), ordered on the stream; src may be reused on return.
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  // dst (host) <- src (runtime memory), after the work queued so far.
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill_qkv(const QkvFill& f) = 0;
  // Timing marks 0 .. max_marks - 1: mark(i) records now (in stream order); elapsed_ms waits
  // for mark `to` and returns the time between the two.
  virtual void mark(int i) = 0;
  virtual double elapsed_ms(int from, int to) = 0;
};

// device: "cpu", "cuda" or "auto" (cuda when the build has CUDA and a device answers).
// Throws flashserve::NotImplemented for cuda in a CPU-only build.
std::unique_ptr<Runtime> make_runtime(const std::string& device, int max_marks);
std::unique_ptr<Runtime> make_host_runtime(int max_marks);
#if FLASHSERVE_WITH_CUDA
bool cuda_device_present();
std::unique_ptr<Runtime> make_cuda_runtime(int max_marks);
#endif

}  // namespace serving
