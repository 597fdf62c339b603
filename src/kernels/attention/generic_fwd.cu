// Instantiations and launch of the generic attention kernel: one per built Dv bucket
// (select.hpp's kGenericDvBuckets, the one table of instantiations).
#include <cuda_runtime.h>

#include "kernels/attention/generic_fwd.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

namespace {

template <int kDvBucket>
void launch_bucket(const AttnParams& p, size_t smem, cudaStream_t stream) {
  constexpr auto kernel = &generic::attention_fwd<kDvBucket>;
  ensure_smem_limit<kernel>(smem);
  const int64_t tiles = (p.total_rows() + p.rows_per_cta - 1) / p.rows_per_cta;
  const dim3 grid(unsigned(tiles), unsigned(p.num_kv_heads * p.head_slices), unsigned(p.num_splits));
  kernel<<<grid, kGenericThreads, smem, stream>>>(p);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_generic_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (!dispatch_built<kGenericDvBuckets>([&](int bucket) { return bucket == choice.dv_bucket; },
                                         [&]<size_t I>() { launch_bucket<kGenericDvBuckets[I]>(p, choice.smem_bytes, s); }))
    throw RuntimeError(detail::cat("generic attention: no instantiation for the Dv bucket ", choice.dv_bucket));
}

}  // namespace flashserve::kernels
