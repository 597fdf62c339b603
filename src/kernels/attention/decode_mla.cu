// Instantiations and launch of the MLA absorbed-decode kernel (decode_mla_mma.cuh): one per entry of
// decode_mla_config.hpp's kMlaConfigs (q dtype, KV dtype) x rows per CTA (16, 64).
#include <cuda_runtime.h>

#include "kernels/attention/decode_mla_mma.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

namespace {

template <DType kDt, DType kKv, int kRows>
void launch_rows(const AttnParams& p, cudaStream_t stream) {
  constexpr size_t smem = mla_smem_bytes(kRows, kv_bytes(kKv));
  constexpr auto kernel = &mla::decode_mla_fwd<kDt, kKv, kRows>;
  ensure_smem_limit<kernel>(smem, /*max_carveout=*/true);
  const dim3 grid(unsigned(p.batch), unsigned(p.head_slices), unsigned(p.num_splits));
  kernel<<<grid, 32 * mla_warps(kRows), smem, stream>>>(p);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_decode_mla(const AttnParams& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  mla::require_mla_problem(p, "decode_mla");
  if (!dispatch_built<kMlaConfigs>(
          [&](const MlaConfig& c) { return c.dtype == p.q.dtype && c.kv == p.k.dtype && c.kv == p.v.dtype; },
          [&]<size_t I>() {
            constexpr MlaConfig c = kMlaConfigs[I];
            if (p.rows_per_cta == 16) launch_rows<c.dtype, c.kv, 16>(p, s);
            else launch_rows<c.dtype, c.kv, 64>(p, s);
          }))
    throw RuntimeError(detail::cat("decode_mla attention: no instantiation for q ", dtype_name(p.q.dtype), ", k/v ",
                                   dtype_name(p.k.dtype), "/", dtype_name(p.v.dtype)));
}

}  // namespace flashserve::kernels
