// Instantiations and launch of the tensor-core prefill kernel: one per kPrefillConfigs entry
// (select.hpp, the one table of prefill instantiations).
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <iterator>
#include <utility>

#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_fwd.cuh"
#include "kernels/common/cuda_check.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kMaxDevices = 64;

// Raises an instantiation's dynamic shared memory limit to its fixed size, once per device
// (a repeated call sets the same value, so a race between threads is harmless).
template <class Kernel>
void allow_smem(Kernel* kernel, size_t smem) {
  static std::array<std::atomic<bool>, kMaxDevices> done{};
  int device = 0;
  FS_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices && done[size_t(device)].load()) return;
  FS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  // All of the unified L1/shared memory as shared: kPrefillCtasPerSm CTAs fit side by side.
  FS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
  if (device < kMaxDevices) done[size_t(device)].store(true);
}

template <class T, int kD>
void launch_config(const AttnParams& p, cudaStream_t stream) {
  auto* kernel = &prefill::prefill_fwd<T, kD>;
  constexpr size_t smem = prefill_smem_bytes(kD);
  allow_smem(kernel, smem);
  constexpr int64_t m = kPrefillRowsPerCta;
  const int64_t tiles = p.batched ? p.batch * ((p.q_rows + m - 1) / m) : p.q_rows / m + p.batch + 1;
  const dim3 grid(unsigned(tiles), unsigned(p.num_heads), unsigned(p.num_splits));
  kernel<<<grid, kPrefillThreads, smem, stream>>>(p);
  FS_CUDA_CHECK_LAUNCH();
}

template <size_t I>
bool launch_if(const AttnParams& p, const AttnKernelChoice& c, cudaStream_t stream) {
  constexpr PrefillConfig cfg = kPrefillConfigs[I];
  if (p.q.dtype != cfg.dtype || c.dv_bucket != cfg.head_dim) return false;
  if constexpr (cfg.dtype == DType::bf16) launch_config<__nv_bfloat16, cfg.head_dim>(p, stream);
  else launch_config<__half, cfg.head_dim>(p, stream);
  return true;
}

template <size_t... I>
bool launch_built(const AttnParams& p, const AttnKernelChoice& c, cudaStream_t stream, std::index_sequence<I...>) {
  return (launch_if<I>(p, c, stream) || ...);
}

}  // namespace

void launch_prefill_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (!launch_built(p, choice, s, std::make_index_sequence<std::size(kPrefillConfigs)>{}))
    throw RuntimeError(detail::cat("prefill attention: no instantiation for ", dtype_name(p.q.dtype), " D=",
                                   choice.dv_bucket));
}

}  // namespace flashserve::kernels
