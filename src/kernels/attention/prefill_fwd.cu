// Instantiations and launch of the tensor-core prefill kernel: one per kPrefillConfigs entry
// (select.hpp, the one table of prefill instantiations).
#include <cuda_runtime.h>

#include <iterator>
#include <utility>

#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_fwd.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

namespace {

template <class T, int kD>
void launch_config(const AttnParams& p, cudaStream_t stream) {
  constexpr auto kernel = &prefill::prefill_fwd<T, kD>;
  constexpr size_t smem = prefill_smem_bytes(kD);
  // All of the unified L1/shared memory as shared: kPrefillCtasPerSm CTAs fit side by side.
  ensure_smem_limit<kernel>(smem, true);
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
