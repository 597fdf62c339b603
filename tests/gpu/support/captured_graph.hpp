// GPU test support: a CUDA graph captured from a closure on a stream, instantiated, replayed
// and destroyed with the object (throws std::runtime_error naming the failed call).
#pragma once

#include <cuda_runtime.h>

#include <functional>

namespace fsgpu {

class CapturedGraph {
 public:
  // Captures fn()'s work on `stream` (global capture mode) and instantiates it.
  CapturedGraph(cudaStream_t stream, const std::function<void()>& fn);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  // One replay on the stream, waited for.
  void replay() const;

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace fsgpu
