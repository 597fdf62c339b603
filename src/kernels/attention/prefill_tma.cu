// Instantiations and launch of the sm_90a warp-specialized prefill kernel (prefill_tma.cuh):
// as prefill_wgmma's (out of q's dtype plain and with ALiBi, fp32 out) for the kPrefillTmaConfigs
// entries; the tensor maps of q, k and v made here per call (host arithmetic only: nothing is
// allocated or synchronized, and a captured launch keeps them as kernel parameters).
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_launch.cuh"
#include "kernels/attention/prefill_tma.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels {

namespace {

template <int kD, int kDv>
prefill::TmaAttnParams tma_params(const AttnParams& p) {
  // K/V boxes: a tile of kN keys, or one page of a paged cache with fewer keys (the kernel
  // loads a tile as its page segments); paged, dim 0 is the block id and dim 1 the row in it.
  const int box = prefill_tma_box_rows(wgmma_tile_keys(kD, kDv), p.paged, p.kv_dim1);
  prefill::TmaAttnParams tp;
  tp.p = p;
  tp.q = make_tma_map(p.q, p.q_batches, p.q_rows, p.num_heads, kD, kWgmmaRowsPerCta, "q");
  tp.k = make_tma_map(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kD, box, "k");
  tp.v = make_tma_map(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kDv, box, "v");
  return tp;
}

}  // namespace

void launch_prefill_tma(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  (void)choice;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool f32_out = p.out.dtype == DType::f32, alibi = p.alibi.data != nullptr;
  if (f32_out && alibi) throw RuntimeError("prefill_tma: no instantiation for ALiBi with fp32 out");
  const bool built = with_prefill_config<kPrefillTmaConfigs>(p.q.dtype, p.head_dim, p.head_dim_v,
                                                             [&]<class T, int kD, int kDv>() {
    const size_t smem = prefill::prefill_tma_smem_bytes_of<kD, kDv>();
    const prefill::TmaAttnParams tp = tma_params<kD, kDv>(p);
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
