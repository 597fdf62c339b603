#include "support/captured_graph.hpp"

#include <stdexcept>
#include <string>

namespace fsgpu {

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
}  // namespace

CapturedGraph::CapturedGraph(cudaStream_t stream, const std::function<void()>& fn) : stream_(stream) {
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  try {
    fn();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph_);  // leave the stream usable, then report
    if (graph_) cudaGraphDestroy(graph_);
    throw;
  }
  check(cudaStreamEndCapture(stream, &graph_), "cudaStreamEndCapture");
  check(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate");
}

CapturedGraph::~CapturedGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
}

void CapturedGraph::replay() const {
  check(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

}  // namespace fsgpu
