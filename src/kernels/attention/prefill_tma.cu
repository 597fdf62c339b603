// Instantiations and launch of the sm_90a warp-specialized prefill kernel (prefill_tma.cuh):
// as prefill_wgmma's (out of q's dtype plain and with ALiBi, fp32 out) for the kPrefillTmaConfigs
// entries; the tensor maps of q, k and v made here per call (host arithmetic only: nothing is
// allocated or synchronized, and a captured launch keeps them as kernel parameters).
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_launch.cuh"
#include "kernels/attention/prefill_tma.cuh"

namespace flashserve::kernels {

void launch_prefill_tma(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  (void)choice;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool f32_out = p.out.dtype == DType::f32, alibi = p.alibi.data != nullptr;
  if (f32_out && alibi) throw RuntimeError("prefill_tma: no instantiation for ALiBi with fp32 out");
  const bool built = with_prefill_config<kPrefillTmaConfigs>(p.q.dtype, p.head_dim, p.head_dim_v,
                                                             [&]<class T, int kD, int kDv>() {
    const size_t smem = prefill::prefill_tma_smem_bytes_of<kD, kDv>();
    const prefill::TmaAttnParams tp = prefill::tma_params<kD, kDv>(p);
    constexpr int threads = prefill::kTmaThreads;
    if (f32_out) launch_row_tiles<&prefill::prefill_tma<T, kD, kDv, true, false>>(p, smem, threads, s, &tp);
    else if (alibi) launch_row_tiles<&prefill::prefill_tma<T, kD, kDv, false, true>>(p, smem, threads, s, &tp);
    else launch_row_tiles<&prefill::prefill_tma<T, kD, kDv, false, false>>(p, smem, threads, s, &tp);
  });
  if (!built)
    throw RuntimeError(detail::cat("prefill_tma: no instantiation for ", dtype_name(p.q.dtype), " D=", p.head_dim,
                                   " Dv=", p.head_dim_v));
}

}  // namespace flashserve::kernels
