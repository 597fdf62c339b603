// Instantiations and launch of the mma.sync prefill kernel: two per kPrefillConfigs entry
// (select.hpp, the one table of its instantiations): plain and with ALiBi.
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_fwd.cuh"
#include "kernels/attention/prefill_launch.cuh"

namespace flashserve::kernels {

void launch_prefill_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const bool built = with_prefill_config<kPrefillConfigs>(p.q.dtype, p.head_dim, p.head_dim_v, [&]<class T, int kD, int kDv>() {
    static_assert(kD == kDv, "prefill_mma: D == Dv");
    if (p.alibi.data) launch_row_tiles<&prefill::prefill_fwd<T, kD, true>>(p, prefill_smem_bytes(kD), kPrefillThreads, s);
    else launch_row_tiles<&prefill::prefill_fwd<T, kD, false>>(p, prefill_smem_bytes(kD), kPrefillThreads, s);
  });
  if (!built)
    throw RuntimeError(detail::cat("prefill attention: no instantiation for ", dtype_name(p.q.dtype), " D=",
                                   p.head_dim, " Dv=", p.head_dim_v));
}

}  // namespace flashserve::kernels
