// The CUDA runtime (runtime.hpp): device 0, one stream, memory from cudaMalloc
// (zeroed once), async uploads on the stream, cudaEvent marks. Every CUDA call is checked.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "qkv_fill.hpp"
#include "runtime.hpp"

namespace serving {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
#define SERVING_CUDA_CHECK(call) check((call), #call)

class CudaRuntime final : public Runtime {
 public:
  explicit CudaRuntime(int max_marks) : events_(size_t(max_marks)) {
    SERVING_CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp p{};
    SERVING_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    name_ = std::string("cuda:0 ") + p.name;
    props_ = {flashserve::Device{flashserve::DeviceType::cuda, 0}, p.multiProcessorCount, p.major, p.minor};
    SERVING_CUDA_CHECK(cudaStreamCreate(&stream_));  // ordered after the default stream (the zeroing memsets)
    for (cudaEvent_t& e : events_) SERVING_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~CudaRuntime() override {
    for (cudaEvent_t e : events_)
      if (e) cudaEventDestroy(e);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return name_; }
  bool is_cuda() const override { return true; }
  flashserve::DeviceProps props() const override { return props_; }
  void* stream() const override { return stream_; }
  size_t free_bytes() const override {
    size_t free = 0, total = 0;
    SERVING_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }

  Buffer alloc(flashserve::DType dtype, std::initializer_list<int64_t> shape) override {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const size_t bytes = (size_t(n) * flashserve::dtype_size(dtype) + 255) / 256 * 256;
    void* p = nullptr;
    SERVING_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 256));
    std::shared_ptr<void> mem(p, [](void* q) { cudaFree(q); });
    SERVING_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return Buffer{mem, bytes,
                  flashserve::TensorRef::contiguous(p, dtype, shape, flashserve::Device{flashserve::DeviceType::cuda, 0})};
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) SERVING_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes) SERVING_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    SERVING_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void fill_qkv(const QkvFill& f) override { fill_qkv_cuda(f, stream_); }

  void mark(int i) override { SERVING_CUDA_CHECK(cudaEventRecord(events_.at(size_t(i)), stream_)); }
  double elapsed_ms(int from, int to) override {
    SERVING_CUDA_CHECK(cudaEventSynchronize(events_.at(size_t(to))));
    float ms = 0;
    SERVING_CUDA_CHECK(cudaEventElapsedTime(&ms, events_.at(size_t(from)), events_.at(size_t(to))));
    return double(ms);
  }

 private:
  std::string name_;
  flashserve::DeviceProps props_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

bool cuda_device_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the error, answer no
    return false;
  }
  return n > 0;
}

std::unique_ptr<Runtime> make_cuda_runtime(int max_marks) { return std::make_unique<CudaRuntime>(max_marks); }

}  // namespace serving
