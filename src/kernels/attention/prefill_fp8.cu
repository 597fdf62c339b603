// Instantiations and launch of the sm_90a fp8 prefill kernel (prefill_fp8.cuh): one per out
// dtype (bf16, f16, and fp32 for cascade / MLA partials) for the kPrefillFp8Configs entries;
// the tensor maps of q, k and v made here per call (host arithmetic only: nothing allocated or
// synchronized; a captured launch keeps them as kernel parameters).
#include <cuda_fp8.h>

#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_fp8.cuh"
#include "kernels/attention/prefill_launch.cuh"

namespace flashserve::kernels {

void launch_prefill_fp8(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  (void)choice;
  constexpr int kD = 128, kDv = 128;
  if (!prefill_fp8_config_built(p.q.dtype, p.head_dim, p.head_dim_v) || p.k.dtype != p.q.dtype ||
      p.v.dtype != p.q.dtype)
    throw RuntimeError(detail::cat("prefill_fp8: no instantiation for q ", dtype_name(p.q.dtype), ", k ",
                                   dtype_name(p.k.dtype), ", v ", dtype_name(p.v.dtype), " D=", p.head_dim,
                                   " Dv=", p.head_dim_v));
  const auto s = static_cast<cudaStream_t>(stream);
  const prefill::TmaAttnParams tp = prefill::tma_params<kD, kDv>(p);
  const size_t smem = prefill_fp8_smem_bytes(kD, kDv);
  constexpr int threads = prefill::kTmaThreads;
  using F8 = __nv_fp8_e4m3;
  switch (p.out.dtype) {
    case DType::bf16:
      launch_row_tiles<&prefill::prefill_fp8<F8, __nv_bfloat16, kD, kDv>>(p, smem, threads, s, &tp);
      break;
    case DType::f16: launch_row_tiles<&prefill::prefill_fp8<F8, __half, kD, kDv>>(p, smem, threads, s, &tp); break;
    case DType::f32: launch_row_tiles<&prefill::prefill_fp8<F8, float, kD, kDv>>(p, smem, threads, s, &tp); break;
    default: throw RuntimeError(detail::cat("prefill_fp8: no instantiation for out ", dtype_name(p.out.dtype)));
  }
}

}  // namespace flashserve::kernels
