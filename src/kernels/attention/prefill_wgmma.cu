// Instantiations and launch of the sm_90a wgmma prefill kernel: three per kPrefillWgmmaConfigs
// entry (select.hpp): out of q's dtype, plain and with ALiBi, and fp32 out (cascade and MLA
// partials, which no engine combines with ALiBi: select.cu declines that pair). Compiled for every architecture of the build; the kernel body exists only
// in the sm_90a image, and select.cu picks the kernel only on 9.0 devices of builds with it.
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_launch.cuh"
#include "kernels/attention/prefill_wgmma.cuh"

namespace flashserve::kernels {

void launch_prefill_wgmma(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const bool f32_out = p.out.dtype == DType::f32, alibi = p.alibi.data != nullptr;
  if (f32_out && alibi) throw RuntimeError("prefill_wgmma: no instantiation for ALiBi with fp32 out");
  const bool built = with_prefill_config<kPrefillWgmmaConfigs>(p.q.dtype, p.head_dim, p.head_dim_v,
                                                               [&]<class T, int kD, int kDv>() {
    const size_t smem = prefill_wgmma_smem_bytes(kD, kDv);
    if (f32_out) launch_row_tiles<&prefill::prefill_wgmma<T, kD, kDv, true, false>>(p, smem, kWgmmaThreads, s);
    else if (alibi) launch_row_tiles<&prefill::prefill_wgmma<T, kD, kDv, false, true>>(p, smem, kWgmmaThreads, s);
    else launch_row_tiles<&prefill::prefill_wgmma<T, kD, kDv, false, false>>(p, smem, kWgmmaThreads, s);
  });
  if (!built)
    throw RuntimeError(detail::cat("prefill_wgmma: no instantiation for ", dtype_name(p.q.dtype), " D=", p.head_dim,
                                   " Dv=", p.head_dim_v));
}

}  // namespace flashserve::kernels
