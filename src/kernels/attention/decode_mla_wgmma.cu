// Instantiations and launch of the sm_90a MLA absorbed-decode kernels (decode_mla_pp.cuh for 64
// rows of a 16-bit latent cache TMA can load, decode_mla_wgmma.cuh for the other 64-row ones,
// decode_mla_heads.cuh for 16 rows of a 16-bit or fp8 one): per entry
// of kMlaConfigs. Compiled for every
// architecture of the build; the kernel bodies exist only in the sm_90a image, and try_decode_mla
// picks them only on 9.0 devices of builds with it.
#include <cuda_runtime.h>

#include <cstdlib>

#include "kernels/attention/decode_mla_heads.cuh"
#include "kernels/attention/decode_mla_pp.cuh"
#include "kernels/attention/decode_mla_wgmma.cuh"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/smem_limit.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels {

namespace {

template <DType kDt, DType kKv, int kWgs, int kStages>
void launch_heads(const AttnParams& p, dim3 grid, cudaStream_t s) {
  constexpr auto kernel = &mla::decode_mla_heads<kDt, kKv, kWgs, kStages>;
  constexpr size_t smem = mla_heads_smem_bytes(kWgs, kStages, is_fp8(kKv) && kWgs == 1);
  ensure_smem_limit<kernel>(smem, /*max_carveout=*/true);
  kernel<<<grid, 128 * kWgs, smem, s>>>(p);
}

template <auto kKernel>
void launch_pp(const AttnParams& p, dim3 grid, cudaStream_t s) {
  ensure_smem_limit<kKernel>(mla_pp_smem_bytes(), /*max_carveout=*/true);
  kKernel<<<grid, 384, mla_pp_smem_bytes(), s>>>(mla::pp_params(p));
}

// FLASHSERVE_MLA_HEADS_CTAS_PER_SM=1 or 2: the 16-row kernel's shape forced whatever the grid
// (the GPU tests' "pair." entries run every case on the two-CTA shape); otherwise 0.
int forced_heads_ctas() {
  static const int forced = [] {
    const char* env = std::getenv("FLASHSERVE_MLA_HEADS_CTAS_PER_SM");
    return env && (env[0] == '1' || env[0] == '2') && env[1] == '\0' ? env[0] - '0' : 0;
  }();
  return forced;
}

// FLASHSERVE_MLA_PP=0: 64 rows of a 16-bit cache stay on decode_mla_wgmma (A/B runs).
bool pp_disabled() {
  static const bool off = [] {
    const char* env = std::getenv("FLASHSERVE_MLA_PP");
    return env && env[0] == '0' && env[1] == '\0';
  }();
  return off;
}

// decode_mla_pp's scope within the 64-row 16-bit shape: k and v views TMA can map, and pages of
// P = 16 x 2^i keys (a 64-key tile is one box, or 64 / P page segments of 16-row multiples).
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
void launch_decode_mla_wgmma(const AttnParams& p, int num_sms, void* stream) {
  mla::require_mla_problem(p, "decode_mla_wgmma");
  if (p.rows_per_cta != 64 && p.rows_per_cta != kMlaHeadsRows)
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: 64 or ", kMlaHeadsRows, " rows per CTA, got ",
                                   p.rows_per_cta));
  const dim3 grid(unsigned(p.batch), unsigned(p.head_slices), unsigned(p.num_splits));
  const int forced = forced_heads_ctas();
  const bool pair = forced ? forced == 2 : mla_heads_pair(int64_t(grid.x) * grid.y * grid.z, num_sms);
  const auto s = static_cast<cudaStream_t>(stream);
  if (is_fp8(p.k.dtype) && p.rows_per_cta != kMlaHeadsRows)
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: an fp8 latent cache takes ", kMlaHeadsRows,
                                   " rows per CTA, got ", p.rows_per_cta));
  if (!dispatch_built<kMlaConfigs>(
          [&](const MlaConfig& c) { return c.dtype == p.q.dtype && c.kv == p.k.dtype && c.kv == p.v.dtype; },
          [&]<size_t I>() {
            constexpr DType kDt = kMlaConfigs[I].dtype, kKv = kMlaConfigs[I].kv;
            if constexpr (is_fp8(kKv)) {
              if (pair) launch_heads<kDt, kKv, 1, 2>(p, grid, s);  // the RS shape, two CTAs per SM
              else launch_heads<kDt, kKv, 2, 2>(p, grid, s);
            } else if (p.rows_per_cta == 64 && pp_fits(p)) {
              if (p.paged && p.kv_dim1 < kMlaPpKeys) launch_pp<mla::decode_mla_pp<kDt, true>>(p, grid, s);
              else launch_pp<mla::decode_mla_pp<kDt, false>>(p, grid, s);
            } else if (p.rows_per_cta == 64) {
              constexpr auto kernel = &mla::decode_mla_wgmma<kDt>;
              ensure_smem_limit<kernel>(mla_wgmma_smem_bytes(), /*max_carveout=*/true);
              kernel<<<grid, 256, mla_wgmma_smem_bytes(), s>>>(p);
            } else if (pair) {
              launch_heads<kDt, kKv, 1, 1>(p, grid, s);
            } else {
              launch_heads<kDt, kKv, 2, 2>(p, grid, s);
            }
            FS_CUDA_CHECK_LAUNCH();
          }))
    throw RuntimeError(detail::cat("decode_mla_wgmma attention: no instantiation for q ", dtype_name(p.q.dtype),
                                   ", k/v ", dtype_name(p.k.dtype), "/", dtype_name(p.v.dtype)));
}

}  // namespace flashserve::kernels
