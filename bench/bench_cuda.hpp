// attn_bench's CUDA plumbing (one translation unit uses it; a header to keep the program's
// file to one role): CUDA error checks, an owned device buffer, and the timing of queued calls
// behind a host-released gate (CUDA events around each call, median of the runs).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashserve/status.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::bench {

// ---------------------------------------------------------------- CUDA helpers

struct CudaFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaFailure(std::string(what) + ": " + cudaGetErrorString(e));
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) cuda_ok(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// ---------------------------------------------------------------- timing

struct TimingOptions {
  int warmup = 3;
  int min_iters = 20;
  int max_iters = 100;     // queued behind the gate at once: keeps well under the launch queue
  double target_s = 0.5;   // timed GPU time to aim for per row (more runs for short kernels)
  double row_budget_s = 6; // fewer than min_iters runs only when min_iters would exceed this
};

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int runs = 0;
  std::string note;
};

// Holds a stream until the host has queued the timed calls (host function on the stream).
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  bool timed_out = false;
};

inline void CUDART_CB gate_wait(void* arg) {
  auto* g = static_cast<Gate*>(arg);
  std::unique_lock<std::mutex> lock(g->m);
  if (!g->cv.wait_for(lock, std::chrono::seconds(30), [g] { return g->open; })) g->timed_out = true;
}

inline double timed_once(const std::function<void(int)>& call, int set, cudaStream_t s) {
  cudaEvent_t a, b;
  cuda_ok(cudaEventCreate(&a), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&b), "cudaEventCreate");
  cuda_ok(cudaEventRecord(a, s), "cudaEventRecord");
  call(set);
  cuda_ok(cudaEventRecord(b, s), "cudaEventRecord");
  cuda_ok(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  cuda_ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

inline Timing time_calls(const std::function<void(int)>& call, int nsets, cudaStream_t s, const TimingOptions& o) {
  call(0);  // first call: module load, first-touch
  cuda_ok(cudaStreamSynchronize(s), "warm-up");
  const double est = timed_once(call, 1 % nsets, s);
  Timing t;
  const bool slow = est * o.min_iters > o.row_budget_s * 1e3;
  for (int i = 1; i < o.warmup && !slow; ++i) call(i % nsets);
  int iters = std::clamp(int(std::ceil(o.target_s * 1e3 / std::max(est, 1e-3))), o.min_iters, o.max_iters);
  if (slow) {
    iters = std::max(3, int(o.row_budget_s * 1e3 / est));
    t.note = detail::cat(iters, " runs, fewer than ", o.min_iters, ": one run takes ", est, " ms");
  }
  std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * iters));
  for (auto& e : ev) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  Gate gate;
  auto open_gate = [&] {
    {
      std::lock_guard<std::mutex> lock(gate.m);
      gate.open = true;
    }
    gate.cv.notify_all();
  };
  cuda_ok(cudaLaunchHostFunc(s, gate_wait, &gate), "cudaLaunchHostFunc");
  try {
    for (int i = 0; i < iters; ++i) {
      cuda_ok(cudaEventRecord(ev[size_t(2 * i)], s), "cudaEventRecord");
      call(i % nsets);
      cuda_ok(cudaEventRecord(ev[size_t(2 * i + 1)], s), "cudaEventRecord");
    }
  } catch (...) {  // the host function holds `gate`: release it before it goes out of scope
    open_gate();
    cudaStreamSynchronize(s);
    for (auto& e : ev) cudaEventDestroy(e);
    throw;
  }
  open_gate();
  cuda_ok(cudaStreamSynchronize(s), "timed runs");
  if (gate.timed_out) t.note += std::string(t.note.empty() ? "" : "; ") + "gate timed out: a call waits on the host";
  std::vector<double> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    float x = 0;
    cuda_ok(cudaEventElapsedTime(&x, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]), "cudaEventElapsedTime");
    ms[size_t(i)] = x;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  t.runs = iters;
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  t.median_ms = iters % 2 ? ms[size_t(iters / 2)] : 0.5 * (ms[size_t(iters / 2 - 1)] + ms[size_t(iters / 2)]);
  return t;
}

// "ok", or what is wrong with a bf16 output (non-finite values, all zeros).
inline std::string check_output(const TensorRef& out) {
  std::vector<uint16_t> h(static_cast<size_t>(out.numel()));
  cuda_ok(cudaMemcpy(h.data(), out.data, h.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy (output)");
  int64_t nonfinite = 0, zeros = 0;
  for (uint16_t u : h) {
    nonfinite += (u & 0x7F80u) == 0x7F80u;
    zeros += (u & 0x7FFFu) == 0;
  }
  if (nonfinite) return detail::cat(nonfinite, " non-finite values");
  if (zeros == int64_t(h.size())) return "all zeros";
  return "ok";
}

}  // namespace flashserve::bench
