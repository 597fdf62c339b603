// Instantiations and launch of the decode kernel: one per entry of decode_config.hpp's
// kDecodeConfigs (KV storage dtype x head size), the one table of decode instantiations.
#include <cuda_runtime.h>

#include "kernels/attention/decode_fwd.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cluster_launch.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"

namespace flashserve::kernels {

namespace {

template <size_t I>
constexpr DecodeKv kFmt = decode_kv(kDecodeConfigs[I].kv, kDecodeConfigs[I].v);

// kHeadsInX: the grid's x is (sequence x row CTA) x KV head, the head fastest, so the CTAs of one
// sequence's heads start together and read the same pages (a token's heads lie side by side) at
// about the same time: long splits B = 64 L = 4k bf16 -0.7%, fp8 -2.1%, int8 -1.3% (bench/
// RESULTS.md 22:40); short splits keep the heads in y (+0.8% at B = 256 L = 64 in x).
// decode_fwd reads the order from gridDim.y.
// p.cluster_splits: each (sequence x row CTA, KV head)'s splits run as one cluster (1, 1,
// num_splits) that merges them (cluster_merge.cuh), where the layout's shared memory holds the
// CTA's partial rows beside the merge area and such a cluster fits on the device. Returns
// whether it did (no partials in the workspace, no combine).
template <size_t I, int kRows, DecodeTiling kTl, bool kHeadsInX>
bool launch_rows(const AttnParams& p, cudaStream_t stream) {
  constexpr DecodeConfig c = kDecodeConfigs[I];
  constexpr size_t smem = decode_smem_bytes(kFmt<I>, c.d, kRows, kTl);
  static_assert(sm90_ctas_fit(smem, kTl.ctas), "the launch bounds' CTAs per SM fit in shared memory");
  constexpr int kWarps = decode_warps(c.d);
  constexpr auto kernel = &decode::decode_fwd<c.kv, c.v, c.d, kRows, kTl.keys, kTl.stages, kTl.ctas>;
  ensure_smem_limit<kernel>(smem, /*max_carveout=*/true);  // 2-3 CTAs per SM need ~228 KB
  const unsigned x = unsigned(p.batch * p.row_ctas), hkv = unsigned(p.num_kv_heads), z = unsigned(p.num_splits);
  const dim3 grid = kHeadsInX ? dim3(x * hkv, 1, z) : dim3(x, hkv, z);
  constexpr bool kClusterFits = decode_cluster_merge_fits(kFmt<I>, c.d, kRows, kTl);
  if (kClusterFits && p.cluster_splits &&
      launch_split_cluster<kernel>(grid, dim3(32 * kWarps), smem, stream, p))
    return true;
  kernel<<<grid, 32 * kWarps, smem, stream>>>(p);
  FS_CUDA_CHECK_LAUNCH();
  return false;
}

// The instantiations of configuration I: the short tiling (decode_config.hpp) by the split's key
// span, 16 rows per CTA; else the long tiling, 32 rows per CTA (two passes per tile: a 16-bit
// cache's verify step past 16 rows, the selection's rows_per_cta, common/decode_rows.hpp) or 16.
// Batch-invariant calls (fixed-size splits) take their tiling from the split size alone, never
// the batch's span, and 16 rows.
template <size_t I>
bool launch_config(const AttnParams& p, cudaStream_t stream) {
  constexpr DecodeKv f = kFmt<I>;
  constexpr int d = kDecodeConfigs[I].d;
  const bool invariant = p.split_size > 0;
  const int64_t span = invariant ? p.split_size : p.paged ? p.max_blocks * p.kv_dim1 : p.kv_dim1;
  const bool shrt = decode_launch_short(d, span, invariant ? 1 : p.num_splits);
  if constexpr (decode_has_wide(f)) {
    if (p.rows_per_cta == kDecodeWideRows && !shrt && !invariant) {
      return launch_rows<I, int(kDecodeWideRows), decode_wide_tiling(f, d), true>(p, stream);
    }
  }
  AttnParams q = p;  // 16-row CTAs: twice as many per 32-row CTA the plan counted
  if (p.rows_per_cta == kDecodeWideRows) q.row_ctas = 2 * p.row_ctas;
  if (shrt) return launch_rows<I, kDecodeRows, decode_short_tiling(f, d), false>(q, stream);
  return launch_rows<I, kDecodeRows, decode_tiling(f), true>(q, stream);
}

}  // namespace

bool launch_decode_attention(const AttnParams& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  bool merged = false;
  if (!dispatch_built<kDecodeConfigs>([&](const DecodeConfig& c) {
                                        return c.kv == p.k.dtype && c.v == p.v.dtype && c.d == p.head_dim;
                                      },
                                      [&]<size_t I>() { merged = launch_config<I>(p, s); }))
    throw RuntimeError(detail::cat("decode attention: no instantiation for K ", dtype_name(p.k.dtype), ", V ",
                                   dtype_name(p.v.dtype), " and D ",
                                   p.head_dim));
  return merged;
}

}  // namespace flashserve::kernels
