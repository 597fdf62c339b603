// Instantiations and launch of the sm_90a warp-specialized prefill kernel (prefill_tma.cuh):
// as prefill_wgmma's (out of q's dtype plain and with ALiBi, fp32 out) for the kPrefillTmaConfigs
// entries; the tensor maps of q, k and v made here per call (host arithmetic only: nothing is
// allocated or synchronized, and a captured launch keeps them as kernel parameters).
#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_launch.cuh"
#include "kernels/attention/prefill_persistent.cuh"

namespace flashserve::kernels {

namespace {

// One instantiation over its row tiles (kWgs consumer warpgroups of 64 rows: 128 or 192 rows,
// select.hpp's prefill_tma_rows): the tensor maps' Q box and the shared memory of that many.
// p.persistent_ctas > 0: its persistent form (prefill_persistent.cuh).
template <class T, int kD, int kDv, bool kF32Out, bool kAlibi, int kWgs>
void launch_tma_rows(const AttnParams& p, cudaStream_t s) {
  constexpr int kM = 64 * kWgs;
  constexpr size_t smem = prefill::prefill_tma_smem_bytes_of<kD, kDv, kM>();
  static_assert(prefill_tma_smem_bytes(kD, kDv, kM) == smem, "select.hpp's size is the kernel's");
  constexpr size_t smem_persistent = prefill::prefill_persistent_smem_bytes_of<kD, kDv, kM>();
  static_assert(prefill_tma_persistent_smem_bytes(kD, kDv, kM) == smem_persistent, "select.hpp's size is the kernel's");
  const prefill::TmaAttnParams tp = prefill::tma_params<kD, kDv, kM>(p);
  if (p.persistent_ctas > 0)
    return launch_row_tiles_persistent<&prefill::prefill_tma_persistent<T, kD, kDv, kF32Out, kAlibi, kWgs>,
                                       prefill::TmaAttnParams, kM>(p, smem_persistent, prefill::tma_threads(kWgs), s,
                                                                   tp);
  launch_row_tiles<&prefill::prefill_tma<T, kD, kDv, kF32Out, kAlibi, kWgs>, prefill::TmaAttnParams, kM>(
      p, smem, prefill::tma_threads(kWgs), s, &tp);
}

// The instantiation of the selection's rows per CTA (AttnKernelChoice::rows_per_cta).
template <class T, int kD, int kDv, bool kF32Out, bool kAlibi>
void launch_tma(const AttnParams& p, cudaStream_t s) {
  if constexpr (prefill_tma_max_consumer_wgs(kD, kDv, kF32Out) == 3) {
    if (p.rows_per_cta == 192) return launch_tma_rows<T, kD, kDv, kF32Out, kAlibi, 3>(p, s);
  }
  if (p.rows_per_cta != 128)
    throw RuntimeError(detail::cat("prefill_tma: no instantiation of ", p.rows_per_cta, " rows per CTA for D=", kD,
                                   " Dv=", kDv, kF32Out ? " with fp32 out" : ""));
  launch_tma_rows<T, kD, kDv, kF32Out, kAlibi, 2>(p, s);
}

}  // namespace

void launch_prefill_tma(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  (void)choice;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool f32_out = p.out.dtype == DType::f32, alibi = p.alibi.data != nullptr;
  if (f32_out && alibi) throw RuntimeError("prefill_tma: no instantiation for ALiBi with fp32 out");
  const bool built = with_prefill_config<kPrefillTmaConfigs>(p.q.dtype, p.head_dim, p.head_dim_v,
                                                             [&]<class T, int kD, int kDv>() {
    if (f32_out) launch_tma<T, kD, kDv, true, false>(p, s);
    else if (alibi) launch_tma<T, kD, kDv, false, true>(p, s);
    else launch_tma<T, kD, kDv, false, false>(p, s);
  });
  if (!built)
    throw RuntimeError(detail::cat("prefill_tma: no instantiation for ", dtype_name(p.q.dtype), " D=", p.head_dim,
                                   " Dv=", p.head_dim_v));
}

}  // namespace flashserve::kernels
