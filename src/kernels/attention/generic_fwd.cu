// Instantiations and launch of the generic attention kernel: one per built Dv bucket
// (select.hpp's kGenericDvBuckets, the one table of instantiations).
#include <cuda_runtime.h>

#include <iterator>
#include <utility>

#include "kernels/attention/generic_fwd.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
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

template <size_t... I>
bool launch_built_bucket(const AttnParams& p, const AttnKernelChoice& c, cudaStream_t stream,
                         std::index_sequence<I...>) {
  return ((c.dv_bucket == kGenericDvBuckets[I] ? (launch_bucket<kGenericDvBuckets[I]>(p, c.smem_bytes, stream), true)
                                               : false) || ...);
}

}  // namespace

void launch_generic_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (!launch_built_bucket(p, choice, s, std::make_index_sequence<std::size(kGenericDvBuckets)>{}))
    throw RuntimeError(detail::cat("generic attention: no instantiation for the Dv bucket ", choice.dv_bucket));
}

}  // namespace flashserve::kernels
