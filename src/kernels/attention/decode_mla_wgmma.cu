// Instantiations and launch of the sm_90a MLA absorbed-decode kernels (decode_mla_wgmma.cuh for 64
// rows, decode_mla_heads.cuh for 16): one each per 16-bit entry of kMlaConfigs. Compiled for every
// architecture of the build; the kernel bodies exist only in the sm_90a image, and try_decode_mla
// picks them only on 9.0 devices of builds with it.
#include <cuda_runtime.h>

#include "kernels/attention/decode_mla_heads.cuh"
#include "kernels/attention/decode_mla_wgmma.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

void launch_decode_mla_wgmma(const AttnParams& p, void* stream) {
  mla::require_mla_problem(p, "decode_mla_wgmma");
  if (p.rows_per_cta != 64 && p.rows_per_cta != kMlaHeadsRows)
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: 64 or ", kMlaHeadsRows, " rows per CTA, got ",
                                   p.rows_per_cta));
  if (!dispatch_built<kMlaConfigs>(
          [&](const MlaConfig& c) { return c.dtype == c.kv && c.dtype == p.q.dtype && c.kv == p.k.dtype && c.kv == p.v.dtype; },
          [&]<size_t I>() {
            const dim3 grid(unsigned(p.batch), unsigned(p.head_slices), unsigned(p.num_splits));
            const auto s = static_cast<cudaStream_t>(stream);
            if (p.rows_per_cta == 64) {
              constexpr auto kernel = &mla::decode_mla_wgmma<kMlaConfigs[I].dtype>;
              ensure_smem_limit<kernel>(mla_wgmma_smem_bytes(), /*max_carveout=*/true);
              kernel<<<grid, 256, mla_wgmma_smem_bytes(), s>>>(p);
            } else {
              constexpr auto kernel = &mla::decode_mla_heads<kMlaConfigs[I].dtype>;
              ensure_smem_limit<kernel>(mla_heads_smem_bytes(), /*max_carveout=*/true);
              kernel<<<grid, 256, mla_heads_smem_bytes(), s>>>(p);
            }
            FS_CUDA_CHECK_LAUNCH();
          }))
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: no instantiation for q ", dtype_name(p.q.dtype),
                                   ", k/v ", dtype_name(p.k.dtype), "/", dtype_name(p.v.dtype)));
}

}  // namespace flashserve::kernels
