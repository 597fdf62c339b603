// Instantiations and launch of the sm_90a warp-specialized prefill kernel (prefill_tma.cuh):
// as prefill_wgmma's (out of q's dtype plain and with ALiBi, fp32 out) for the kPrefillTmaConfigs
// entries; the tensor maps of q, k and v made here per call (host arithmetic only: nothing is
// allocated or synchronized, and a captured launch keeps them as kernel parameters).
#include <atomic>
#include <climits>
#include <cstdlib>

#include "kernels/attention/launchers.hpp"
#include "kernels/attention/prefill_launch.cuh"
#include "kernels/attention/prefill_tma.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels {

namespace {

template <int kD, int kDv>
prefill::TmaAttnParams tma_params(const AttnParams& p) {
  constexpr int kN = wgmma_tile_keys(kD, kDv);
  prefill::TmaAttnParams tp;
  tp.p = p;
  tp.row_tiles = row_tile_count(p);
  tp.items = tp.row_tiles * p.num_heads * p.num_splits;
  static std::atomic<uint32_t> launches{0};  // launches in flight rarely share a slot (64)
  tp.sched_slot = launches.fetch_add(1, std::memory_order_relaxed) % prefill::kTmaSchedSlots;
  tp.q = make_tma_map(p.q, p.q_batches, p.q_rows, p.num_heads, kD, kWgmmaRowsPerCta, "q");
  tp.k = make_tma_map(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kD, kN, "k");
  tp.v = make_tma_map(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kDv, kN, "v");
  return tp;
}

}  // namespace

// The persistent grid: one CTA per SM (choice.persistent_ctas), at most one per item; or one
// item per CTA (the hardware's dispatch) where the epilogue stages O in Q's rows (D = 256:
// persistent measured 7% slower at S = 2k causal, Q's load waiting for the epilogue), or with
// FLASHSERVE_TMA_ONE_ITEM_PER_CTA set (an A/B switch for benchmarks), unless the items overflow
// a grid's x.
template <auto kKernel, bool kSeparateO>
void launch_persistent(prefill::TmaAttnParams tp, const AttnKernelChoice& choice, size_t smem, cudaStream_t stream) {
  ensure_smem_limit<kKernel>(smem, true);
  static const bool one_item = std::getenv("FLASHSERVE_TMA_ONE_ITEM_PER_CTA") != nullptr;
  const int64_t persistent = std::min<int64_t>(choice.persistent_ctas, prefill::kTmaMaxPersistentCtas);
  tp.persistent = persistent > 0 && tp.items > persistent && ((kSeparateO && !one_item) || tp.items > INT_MAX);
  const int64_t ctas = tp.persistent ? persistent : tp.items;
  kKernel<<<unsigned(ctas), prefill::kTmaThreads, smem, stream>>>(tp);
  FS_CUDA_CHECK_LAUNCH();
}

void launch_prefill_tma(const AttnParams& p, const AttnKernelChoice& choice, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const bool f32_out = p.out.dtype == DType::f32, alibi = p.alibi.data != nullptr;
  if (f32_out && alibi) throw RuntimeError("prefill_tma: no instantiation for ALiBi with fp32 out");
  const bool built = with_prefill_config<kPrefillTmaConfigs>(p.q.dtype, p.head_dim, p.head_dim_v,
                                                             [&]<class T, int kD, int kDv>() {
    const size_t smem = prefill::prefill_tma_smem_bytes_of<kD, kDv>();
    constexpr bool sep = prefill_tma_separate_o(kD, kDv);
    const prefill::TmaAttnParams tp = tma_params<kD, kDv>(p);
    if (f32_out) launch_persistent<&prefill::prefill_tma<T, kD, kDv, true, false>, sep>(tp, choice, smem, s);
    else if (alibi) launch_persistent<&prefill::prefill_tma<T, kD, kDv, false, true>, sep>(tp, choice, smem, s);
    else launch_persistent<&prefill::prefill_tma<T, kD, kDv, false, false>, sep>(tp, choice, smem, s);
  });
  if (!built)
    throw RuntimeError(detail::cat("prefill_tma: no instantiation for ", dtype_name(p.q.dtype), " D=", p.head_dim,
                                   " Dv=", p.head_dim_v));
}

}  // namespace flashserve::kernels
