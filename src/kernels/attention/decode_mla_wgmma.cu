// Instantiations and launch of the sm_90a MLA absorbed-decode kernels (decode_mla_pp.cuh for 64
// rows of a 16-bit latent cache TMA can load, decode_mla_wgmma.cuh for the other 64-row ones,
// decode_mla_heads.cuh for 16 rows of a 16-bit or fp8 one): per entry
// of kMlaConfigs. Compiled for every
// architecture of the build; the kernel bodies exist only in the sm_90a image, and try_decode_mla
// picks them only on 9.0 devices of builds with it.
#include <cuda_runtime.h>

#include "kernels/attention/decode_mla_heads_tma.cuh"
#include "kernels/attention/decode_mla_pp.cuh"
#include "kernels/attention/decode_mla_wgmma.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cluster_launch.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/env_switch.hpp"
#include "kernels/common/smem_limit.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels {

namespace {

// p.cluster_splits: the splits as one cluster (1, 1, num_splits) that merges them
// (cluster_merge.cuh, finish_cols), where such a cluster fits on the device. Returns whether it
// did (no partials, no combine).
template <DType kDt, DType kKv, int kWgs, int kStages>
bool launch_heads(const AttnParams& p, dim3 grid, cudaStream_t s) {
  constexpr auto kernel = &mla::decode_mla_heads<kDt, kKv, kWgs, kStages>;
  constexpr size_t smem = mla_heads_smem_bytes(kWgs, kStages, is_fp8(kKv) && kWgs == 1);
  ensure_smem_limit<kernel>(smem, /*max_carveout=*/true);
  if (p.cluster_splits && launch_split_cluster<kernel>(grid, dim3(128 * kWgs), smem, s, p)) return true;
  kernel<<<grid, 128 * kWgs, smem, s>>>(p);
  return false;
}

template <DType kDt>
void launch_heads_tma(const AttnParams& p, dim3 grid, cudaStream_t s) {
  constexpr auto kernel = &mla::decode_mla_heads_tma<kDt>;
  constexpr size_t smem = mla_heads_smem_bytes(2, 2, false, true);
  ensure_smem_limit<kernel>(smem, /*max_carveout=*/true);
  kernel<<<grid, mla::HeadsTmaShape<kDt>::kCtaThreads, smem, s>>>(mla::pp_params(p));
}

template <auto kKernel>
void launch_pp(const AttnParams& p, dim3 grid, cudaStream_t s) {
  ensure_smem_limit<kKernel>(mla_pp_smem_bytes(), /*max_carveout=*/true);
  kKernel<<<grid, 384, mla_pp_smem_bytes(), s>>>(mla::pp_params(p));
}

// FLASHSERVE_MLA_HEADS_CTAS_PER_SM=1 or 2: the 16-row kernel's shape forced whatever the grid
// (the GPU tests' "pair." entries run every case on the two-CTA shape); otherwise 0.
int forced_heads_ctas() {
  static const int forced = env_digit<1, 2, 0>("FLASHSERVE_MLA_HEADS_CTAS_PER_SM");
  return forced;
}

// FLASHSERVE_MLA_PP=0: the TMA-producer kernels off (A/B runs, the GPU tests' wg32. entries): 64
// rows of a 16-bit cache stay on decode_mla_wgmma, 16 rows on decode_mla_heads' cp.async copies.
bool pp_disabled() {
  static const bool off = env_digit<0, 0, -1>("FLASHSERVE_MLA_PP") == 0;
  return off;
}

// FLASHSERVE_MLA_HEADS_TMA=0 or 1: decode_mla_heads_tma declined or taken wherever it fits
// (A/B runs, the GPU tests); otherwise -1: heads_tma_pays decides.
int forced_heads_tma() {
  static const int forced = env_digit<0, 1, -1>("FLASHSERVE_MLA_HEADS_TMA");
  return forced;
}

// Where the 16-row 2 x 2 shape takes decode_mla_heads_tma over its cp.async copies: where a
// CTA's chain binds, not HBM: grids under 3/4 of the SMs, or CTAs of at most 8 tiles (a split's
// prologue and first loads in the chain). Measured (H200, H = 16, bf16, us, cp.async -> TMA):
// B = 64 L = 4k one split (64 CTAs, 64 tiles each) 152.5 -> 110.6, B = 1 L = 32k (128 splits of
// 4 tiles) 29.3 -> 27.7; but where 128 CTAs stream long splits, HBM binds and the TMA shape
// streams slower (the cause not isolated: its boxes read 128-byte columns of 64 key rows, the
// threads' copies whole rows): B = 64 L = 4k 2 splits (32 tiles) 92.7 -> 93.7, B = 128 L = 8k
// (128 tiles) 299.1 -> 311.2.
bool heads_tma_pays(const AttnParams& p, int64_t ctas, int num_sms) {
  if (forced_heads_tma() >= 0) return forced_heads_tma() == 1;
  const int64_t tiles = (p.max_split_keys + kMlaHeadsTileKeys - 1) / kMlaHeadsTileKeys;
  return 4 * ctas < 3 * int64_t(num_sms) || (p.max_split_keys > 0 && tiles <= 8);
}

// The TMA-producer kernels' scope (decode_mla_pp, decode_mla_heads_tma) within the 16-bit shapes:
// k and v views TMA can map, and pages of P = 16 x 2^i keys (a 64-key tile is one box, or 64 / P
// page segments of 16-row multiples).
bool pp_fits(const AttnParams& p) {
  if (pp_disabled()) return false;
  if (p.paged && !tma_block_size_ok(kMlaPpKeys, p.kv_dim1)) return false;
  return tma_mappable(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kMlaD) &&
         tma_mappable(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, kMlaDv);
}

}  // namespace

// The 16-row shapes by the grid (mla_heads_pair). An fp8 latent cache runs on decode_mla_heads:
// for grids under 1.5 CTAs per SM its 2 x 2 shape (tile k + 1 converted into its f16 stage under
// S of tile k), ~30% faster than decode_mla (H200, H = 16: B = 1 L = 32k 45.7 vs 64.2 us; the RS
// shape there 1.18x slower); for larger grids its RS shape: one warpgroup, two raw fp8 stages
// (101 KB: two CTAs per SM), the MMAs' A operands converted in registers (S: ldmatrix on the key
// rows, q permuted; P V: ldmatrix.trans, prmt, O^T's rows permuted): B = 64 L = 4k 100.2 us
// (decode_mla 142.2, bf16 105.6), B = 128 L = 8k 302.3 (393.2, bf16 318.1). bench/RESULTS.md.
bool launch_decode_mla_wgmma(const AttnParams& p, int num_sms, void* stream) {
  mla::require_mla_problem(p, "decode_mla_wgmma");
  if (p.rows_per_cta != 64 && p.rows_per_cta != kMlaHeadsRows)
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: 64 or ", kMlaHeadsRows, " rows per CTA, got ",
                                   p.rows_per_cta));
  const dim3 grid(unsigned(p.batch), unsigned(p.head_slices), unsigned(p.num_splits));
  const int forced = forced_heads_ctas();
  const bool pair = forced ? forced == 2 : mla_heads_pair(int64_t(grid.x) * grid.y * grid.z, num_sms);
  const auto s = static_cast<cudaStream_t>(stream);
  bool merged = false;  // the splits merged in a cluster (launch_heads)
  if (is_fp8(p.k.dtype) && p.rows_per_cta != kMlaHeadsRows)
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: an fp8 latent cache takes ", kMlaHeadsRows,
                                   " rows per CTA, got ", p.rows_per_cta));
  if (!dispatch_built<kMlaConfigs>(
          [&](const MlaConfig& c) { return c.dtype == p.q.dtype && c.kv == p.k.dtype && c.kv == p.v.dtype; },
          [&]<size_t I>() {
            constexpr DType kDt = kMlaConfigs[I].dtype, kKv = kMlaConfigs[I].kv;
            if constexpr (is_fp8(kKv)) {
              if (pair) merged = launch_heads<kDt, kKv, 1, 2>(p, grid, s);  // the RS shape, two CTAs per SM
              else merged = launch_heads<kDt, kKv, 2, 2>(p, grid, s);
            } else if (p.rows_per_cta == 64 && pp_fits(p)) {
              if (p.paged && p.kv_dim1 < kMlaPpKeys) launch_pp<mla::decode_mla_pp<kDt, true>>(p, grid, s);
              else launch_pp<mla::decode_mla_pp<kDt, false>>(p, grid, s);
            } else if (p.rows_per_cta == 64) {
              constexpr auto kernel = &mla::decode_mla_wgmma<kDt>;
              ensure_smem_limit<kernel>(mla_wgmma_smem_bytes(), /*max_carveout=*/true);
              kernel<<<grid, 256, mla_wgmma_smem_bytes(), s>>>(p);
            } else if (pair) {
              merged = launch_heads<kDt, kKv, 1, 1>(p, grid, s);
            } else if (pp_fits(p) && heads_tma_pays(p, int64_t(grid.x) * grid.y * grid.z, num_sms)) {
              launch_heads_tma<kDt>(p, grid, s);
            } else {
              merged = launch_heads<kDt, kKv, 2, 2>(p, grid, s);
            }
            FS_CUDA_CHECK_LAUNCH();
          }))
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: no instantiation for q ", dtype_name(p.q.dtype),
                                   ", k/v ", dtype_name(p.k.dtype), "/", dtype_name(p.v.dtype)));
  return merged;
}

}  // namespace flashserve::kernels
