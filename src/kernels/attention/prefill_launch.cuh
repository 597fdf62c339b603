// Launch helpers the two prefill kernels share (prefill_fwd.cu, prefill_wgmma.cu): the dispatch
// of (dtype, D) over an instantiation table of select.hpp, and the (row tiles, heads, splits)
// grid of the CTA schedule in prefill_common.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "kernels/attention/params.hpp"
#include "kernels/attention/select.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

template <DType t>
using half_type = std::conditional_t<t == DType::bf16, __nv_bfloat16, __half>;

// Calls f.template operator()<T, D, Dv>() for the entry of kConfigs (PrefillConfig[]) matching
// (t, d, dv); false when none does.
template <const auto& kConfigs, class F>
bool with_prefill_config(DType t, int64_t d, int64_t dv, F&& f) {
  return dispatch_built<kConfigs>(
      [&](const PrefillConfig& c) { return c.dtype == t && c.head_dim == d && c.dv() == dv; },
      [&]<size_t I>() {
        f.template operator()<half_type<kConfigs[I].dtype>, kConfigs[I].head_dim, kConfigs[I].dv()>();
      });
}

// kKernel over the CTA schedule of prefill_common.cuh: kM-row tiles (varlen: total_q / kM +
// B + 1, enough for every sequence's ceil(sq_b / kM); batched: B * ceil(sq / kM)) x heads x
// splits; kM = 128 but for prefill_tma's three-warpgroup CTAs (192). All of the unified L1 as
// shared memory. `arg` is what the kernel takes (p itself, or a struct holding it: prefill_tma's).
template <auto kKernel, class Arg = AttnParams, int kM = 128>
void launch_row_tiles(const AttnParams& p, size_t smem, int threads, cudaStream_t stream, const Arg* arg = nullptr) {
  static_assert(kPrefillRowsPerCta == 128 && kWgmmaRowsPerCta == 128, "the default schedule");
  ensure_smem_limit<kKernel>(smem, true);
  const dim3 grid(unsigned(p.row_tiles(kM)), unsigned(p.num_heads), unsigned(p.num_splits));
  if constexpr (std::is_same_v<Arg, AttnParams>) kKernel<<<grid, threads, smem, stream>>>(p);
  else kKernel<<<grid, threads, smem, stream>>>(*arg);
  FS_CUDA_CHECK_LAUNCH();
}

// kKernel as a persistent grid over the same items (prefill_persistent.cuh): min(items,
// p.persistent_ctas) CTAs, CTA c taking item c, then the next untaken one
template <auto kKernel, class Arg, int kM>
void launch_row_tiles_persistent(const AttnParams& p, size_t smem, int threads, cudaStream_t stream, const Arg& arg) {
  ensure_smem_limit<kKernel>(smem, true);
  const int64_t items = p.row_tile_items(kM), ctas = items < p.persistent_ctas ? items : p.persistent_ctas;
  if (ctas <= 0) return;
  kKernel<<<unsigned(ctas), threads, smem, stream>>>(arg);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
