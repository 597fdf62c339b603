// Instantiations and launch of the sm_90a MLA absorbed-decode kernel (decode_mla_wgmma.cuh): one
// per 16-bit entry of kMlaConfigs. Compiled for every architecture of the build; the kernel body
// exists only in the sm_90a image, and try_decode_mla picks it only on 9.0 devices of builds
// with it.
#include <cuda_runtime.h>

#include "kernels/attention/decode_mla_wgmma.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

void launch_decode_mla_wgmma(const AttnParams& p, void* stream) {
  mla::require_mla_problem(p, "decode_mla_wgmma");
  if (p.rows_per_cta != 64)
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: 64 rows per CTA, got ", p.rows_per_cta));
  if (!dispatch_built<kMlaConfigs>(
          [&](const MlaConfig& c) { return c.dtype == c.kv && c.dtype == p.q.dtype && c.kv == p.k.dtype && c.kv == p.v.dtype; },
          [&]<size_t I>() {
            constexpr auto kernel = &mla::decode_mla_wgmma<kMlaConfigs[I].dtype>;
            ensure_smem_limit<kernel>(mla_wgmma_smem_bytes(), /*max_carveout=*/true);
            const dim3 grid(unsigned(p.batch), unsigned(p.head_slices), unsigned(p.num_splits));
            kernel<<<grid, 256, mla_wgmma_smem_bytes(), static_cast<cudaStream_t>(stream)>>>(p);
            FS_CUDA_CHECK_LAUNCH();
          }))
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: no instantiation for q ", dtype_name(p.q.dtype),
                                   ", k/v ", dtype_name(p.k.dtype), "/", dtype_name(p.v.dtype)));
}

}  // namespace flashserve::kernels
