// Instantiations and launch of the generic attention kernel: one per built Dv bucket
// (select.hpp's kGenericDvBuckets, the one table of instantiations).
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <iterator>
#include <mutex>
#include <utility>

#include "kernels/attention/generic_fwd.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kMaxDevices = 64;

// Raises (never lowers) a kernel's dynamic shared memory limit on the current device to
// `smem`: lowering it could fail another thread's launch of a larger configuration. The
// record is per instantiation (`Tag`): every bucket's kernel has the same function type.
template <int Tag, class Kernel>
void raise_smem_limit(Kernel* kernel, size_t smem) {
  static std::array<std::atomic<size_t>, kMaxDevices> granted{};
  static std::mutex mutex;
  int device = 0;
  FS_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) {
    FS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return;
  }
  std::atomic<size_t>& g = granted[size_t(device)];
  if (smem <= g.load()) return;
  const std::lock_guard<std::mutex> lock(mutex);
  if (smem <= g.load()) return;
  FS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  g.store(smem);
}

template <int kDvBucket>
void launch_bucket(const AttnParams& p, size_t smem, cudaStream_t stream) {
  auto* kernel = &generic::attention_fwd<kDvBucket>;
  raise_smem_limit<kDvBucket>(kernel, smem);
  const int64_t tiles = (p.total_rows() + p.rows_per_cta - 1) / p.rows_per_cta;
  const dim3 grid(unsigned(tiles), unsigned(p.num_kv_heads * p.head_slices), unsigned(p.num_splits));
  kernel<<<grid, kGenericThreads, smem, stream>>>(p);
  FS_CUDA_CHECK_LAUNCH();
}

template <size_t... I>
bool launch_built_bucket(const AttnParams& p, const AttnKernelChoice& c, cudaStream_t stream,
                         std::index_sequence<I...>) {
  return ((c.dv_bucket == kGenericDvBuckets[I] ? (launch_bucket<kGenericDvBuckets[I]>(p, c.smem_bytes, stream), true)
                                               : false) || ...);
}

}  // namespace

void launch_generic_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (!launch_built_bucket(p, choice, s, std::make_index_sequence<std::size(kGenericDvBuckets)>{}))
    throw RuntimeError(detail::cat("generic attention: no instantiation for the Dv bucket ", choice.dv_bucket));
}

}  // namespace flashserve::kernels
