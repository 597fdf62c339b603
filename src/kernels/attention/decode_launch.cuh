// The decode kernel's launch of one instantiation (launch_rows), shared by decode_fwd.cu (the
// cp.async forms) and decode_fwd_tma.cu (the TMA form, its own translation unit: instantiated
// beside the others it changed their code through the shared out-of-line device functions,
// ptxas's allocation of the fp8 kernels among them).
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/decode_fwd.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cluster_launch.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/smem_limit.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels::decode {

template <size_t I>
constexpr DecodeKv kFmt = decode_kv(kDecodeConfigs[I].kv, kDecodeConfigs[I].v);
// Whether configuration c is the instantiation for p's (K, V, D).
inline bool config_serves(const DecodeConfig& c, const AttnParams& p) {
  return c.kv == p.k.dtype && c.v == p.v.dtype && c.d == p.head_dim;
}

// kHeadsInX: the grid's x is (sequence x row CTA) x KV head, the head fastest, so the CTAs of one
// sequence's heads start together and read the same pages (a token's heads lie side by side) at
// about the same time: long splits B = 64 L = 4k bf16 -0.7%, fp8 -2.1%, int8 -1.3% (bench/
// RESULTS.md 22:40); short splits keep the heads in y (+0.8% at B = 256 L = 64 in x).
// decode_fwd reads the order from gridDim.y.
// p.cluster_splits: each (sequence x row CTA, KV head)'s splits run as one cluster (1, 1,
// num_splits) that merges them (cluster_merge.cuh), where the layout's shared memory holds the
// CTA's partial rows beside the merge area and such a cluster fits on the device. Returns
// whether it did (no partials in the workspace, no combine).
// kTl.tma: the TMA form (decode_fwd_tma), its tensor maps made here (boxes of 16 keys).
template <size_t I, int kRows, DecodeTiling kTl, bool kHeadsInX>
bool launch_rows(const AttnParams& p, cudaStream_t stream) {
  constexpr DecodeConfig c = kDecodeConfigs[I];
  constexpr size_t smem = decode_smem_bytes(kFmt<I>, c.d, kRows, kTl);
  static_assert(sm90_ctas_fit(smem, kTl.ctas), "the launch bounds' CTAs per SM fit in shared memory");
  constexpr int kWarps = decode_warps(c.d);
  const unsigned x = unsigned(p.batch * p.row_ctas), hkv = unsigned(p.num_kv_heads), z = unsigned(p.num_splits);
  const dim3 grid = kHeadsInX ? dim3(x * hkv, 1, z) : dim3(x, hkv, z);
  constexpr bool kClusterFits = decode_cluster_merge_fits(kFmt<I>, c.d, kRows, kTl);
  auto launch = [&]<auto kKernel>(const auto& args) {
    ensure_smem_limit<kKernel>(smem, /*max_carveout=*/true);  // 2-3 CTAs per SM need ~228 KB
    if (kClusterFits && p.cluster_splits &&
        launch_split_cluster<kKernel>(grid, dim3(32 * kWarps), smem, stream, args))
      return true;
    kKernel<<<grid, 32 * kWarps, smem, stream>>>(args);
    FS_CUDA_CHECK_LAUNCH();
    return false;
  };
  if constexpr (kTl.tma) {
    DecodeTmaParams tp;
    tp.p = p;
    tp.k = make_tma_map(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, c.d, 16, "k");  // 16-row page segments
    tp.v = make_tma_map(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, c.d, 16, "v");
    return launch.template operator()<&decode_fwd_tma<c.kv, c.v, c.d, kRows, kTl.keys, kTl.stages, kTl.ctas>>(
        tp);
  } else {
    return launch.template operator()<&decode_fwd<c.kv, c.v, c.d, kRows, kTl.keys, kTl.stages, kTl.ctas>>(p);
  }
}

}  // namespace flashserve::kernels::decode

namespace flashserve::kernels {
// decode_fwd_tma.cu: the TMA form's launch for p's (K, V, D), 16-row CTAs or (wide) 32-row ones
// (launch_rows' return).
bool launch_decode_tma(const AttnParams& p, bool wide, cudaStream_t stream);
}  // namespace flashserve::kernels
