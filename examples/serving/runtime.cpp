// The runtime a --device name selects (runtime.hpp).
#include "flashserve/status.hpp"
#include "runtime.hpp"

namespace serving {

std::unique_ptr<Runtime> make_runtime(const std::string& device, int max_marks) {
#if FLASHSERVE_WITH_CUDA
  if (device == "cuda" || (device == "auto" && cuda_device_present())) return make_cuda_runtime(max_marks);
#else
  if (device == "cuda")
    throw flashserve::NotImplemented("--device cuda: this build has no CUDA (configure the cuda preset: "
                                     "FLASHSERVE_CUDA=ON), use --device cpu");
#endif
  return make_host_runtime(max_marks);
}

}  // namespace serving
