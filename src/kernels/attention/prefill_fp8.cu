// Instantiations and launch of the sm_90a fp8 prefill kernel (prefill_fp8.cuh): one per out
// dtype (bf16, f16, and fp32 for cascade / MLA partials) for the kPrefillFp8Configs entries;
// the tensor maps of q, k and v made here per call (host arithmetic only: nothing allocated or
// synchronized; a captured launch keeps them as kernel parameters).
#include <cuda_fp8.h>

#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_persistent.cuh"
#include "kernels/attention/prefill_launch.cuh"

namespace flashserve::kernels {

namespace {

// The kernel of out type TOut: its persistent form when p.persistent_ctas > 0.
template <class TOut>
void launch_out(const AttnParams& p, const prefill::TmaAttnParams& tp, cudaStream_t s) {
  constexpr int kD = 128, kDv = 128, threads = prefill::kTmaThreads;
  using F8 = __nv_fp8_e4m3;
  constexpr size_t smem_persistent = prefill::prefill_fp8_persistent_smem_bytes_of<kD, kDv>();
  static_assert(prefill_fp8_persistent_smem_bytes(kD, kDv) == smem_persistent, "select.hpp's size is the kernel's");
  if (p.persistent_ctas > 0)
    return launch_row_tiles_persistent<&prefill::prefill_fp8_persistent<F8, TOut, kD, kDv>, prefill::TmaAttnParams,
                                       kWgmmaRowsPerCta>(p, smem_persistent, threads, s, tp);
  launch_row_tiles<&prefill::prefill_fp8<F8, TOut, kD, kDv>>(p, prefill_fp8_smem_bytes(kD, kDv), threads, s, &tp);
}

}  // namespace

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
  switch (p.out.dtype) {
    case DType::bf16: return launch_out<__nv_bfloat16>(p, tp, s);
    case DType::f16: return launch_out<__half>(p, tp, s);
    case DType::f32: return launch_out<float>(p, tp, s);
    default: throw RuntimeError(detail::cat("prefill_fp8: no instantiation for out ", dtype_name(p.out.dtype)));
  }
}

}  // namespace flashserve::kernels
