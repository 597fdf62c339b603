// The MLA absorbed-decode kernel's fixed shape and its one table of instantiations, read by
// the selection (decode_mla_select.cu), the launcher (decode_mla.cu) and the shared-memory
// sizing. Plain C++ (no CUDA headers). The scheme: decode_mla.cuh; the mma.sync kernel's cost
// model: decode_mla_mma.cuh.
//
// Served (try_decode_mla): q_v present, D = 64 (rope) and Dv = 512 (latent), H_kv = 1, q, q_v
// and out of one 16-bit dtype (f16/bf16), k and v of that dtype or of one fp8 format (e4m3 /
// e5m2, with k_descale / v_descale [B, H_kv] or broadcasts, may be null) as an entry of
// kMlaConfigs, no other quantization scales (no q_descale: q is 16-bit), k/v/q/q_v
// rows 16-byte aligned (k and v may be two views of one latent cache [.., 576] or separate
// buffers: each is read once, with its own strides). Every score modifier of the decode kernel
// (causal / window / chunk, context parallelism, soft-cap, ALiBi, sinks), paged or contiguous
// KV, any split count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/common/sm_fit.hpp"
#include "problem/attention.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

struct AttnKernelChoice;

inline constexpr int kMlaD = 64;                   // rope channels (k, q)
inline constexpr int kMlaDv = 512;                 // latent channels (v, q_v, out)
inline constexpr int kMlaWidth = kMlaD + kMlaDv;   // 576: the q.k contraction
inline constexpr int kMlaTileKeys = 32;            // keys per compute tile (S, softmax, P V)
inline constexpr int kMlaStages = 2;               // cp.async stages of the KV load tile
inline constexpr int kMlaRowPad = 16;              // bytes per smem row: ldmatrix rows on distinct banks
// Packed (query row, head) rows per CTA: 16 (one m16 block: H = 16 decode, 4 warps) or 64
// (H = 128, or q_len x H > 16: 8 warps).
constexpr int mla_warps(int rows) { return rows == 16 ? 4 : 8; }
constexpr int mla_rows_for(int64_t packed) { return packed <= 16 ? 16 : 64; }

// KV bytes per element: 2 (16-bit latent) or 1 (fp8 latent).
// Keys per KV load tile (one cp.async stage): 32 16-bit keys or 64 fp8 keys (~37 KB either way,
// so the bytes in flight per SM match); an fp8 load tile is computed as two 32-key tiles.
constexpr int mla_load_keys(int kv_bytes) { return kv_bytes == 1 ? 64 : 32; }
// Bytes per KV row in shared memory: [k (64) | v (512)] + 16 B of padding (16-bit: 1168; fp8:
// 592, = 80 mod 128, so ldmatrix rows and fp8 V's per-lane 8/16-byte loads hit distinct banks).
constexpr size_t mla_kv_row_bytes(int kv_bytes) { return size_t(kMlaWidth) * size_t(kv_bytes) + 16; }

struct MlaConfig {
  DType dtype;  // q, q_v, out (16-bit)
  DType kv;     // k, v: dtype (16-bit) or an fp8 format (f16 operands; decode_mla.cuh)
};
#if FLASHSERVE_DEV_CONFIGS
inline constexpr MlaConfig kMlaConfigs[] = {{DType::bf16, DType::bf16}, {DType::bf16, DType::f8e4m3}};
#else
inline constexpr MlaConfig kMlaConfigs[] = {{DType::bf16, DType::bf16},   {DType::f16, DType::f16},
                                           {DType::bf16, DType::f8e4m3}, {DType::f16, DType::f8e4m3},
                                           {DType::bf16, DType::f8e5m2}, {DType::f16, DType::f8e5m2}};
#endif

constexpr bool mla_config_built(DType t, DType kv) {
  for (const MlaConfig& c : kMlaConfigs)
    if (c.dtype == t && c.kv == kv) return true;
  return false;
}
constexpr bool mla_config_built(DType t) { return mla_config_built(t, t); }

// Shared memory, in bytes (decode_mla.cuh carves it the same way):
//   Q [rows, 576] 16-bit (+16 B per row) | KV [stages, load keys, mla_kv_row_bytes] |
//   S [rows, 32 + 4] fp32 (P, 16-bit, overwrites each row's S in place) |
//   RowMeta [rows] (40 B) | row scale [rows] fp32 | TokenLoc [load keys] (24 B) | bad-key masks [4] u32.
// 16-bit KV: 64 rows 162.5 KB (fits the A100's 163 KB, one CTA per SM); 16 rows 97.3 KB (two
// per SM on the H200). fp8 KV (64-key load tiles): 64 rows 160.3 KB, 16 rows 96.7 KB.
inline constexpr size_t kMlaRowBytes = size_t(kMlaWidth) * 2 + kMlaRowPad;  // 1168: Q rows (16-bit KV rows)
inline constexpr size_t kMlaSStride = size_t(kMlaTileKeys + 4) * 4;         // 144: S / P row bytes
inline constexpr size_t kMlaRowMetaBytes = 40;                              // decode::RowMeta
constexpr size_t mla_smem_bytes(int rows, int kv_bytes = 2) {
  const size_t keys = size_t(mla_load_keys(kv_bytes));
  return size_t(rows) * kMlaRowBytes + size_t(kMlaStages) * keys * mla_kv_row_bytes(kv_bytes) +
         size_t(rows) * kMlaSStride + size_t(rows) * (kMlaRowMetaBytes + 4) + keys * 24 + 16;
}
static_assert(mla_kv_row_bytes(2) == kMlaRowBytes && mla_kv_row_bytes(1) % 128 == 80, "the bank arguments above");
static_assert(mla_smem_bytes(64) <= 166912 && mla_smem_bytes(64, 1) <= 166912,
              "the 64-row shape fits the A100's opt-in shared memory");
static_assert(sm90_ctas_fit(mla_smem_bytes(16), 2) && sm90_ctas_fit(mla_smem_bytes(16, 1), 2),
              "two 16-row CTAs per H200 SM");

// The sm_90a wgmma kernel (decode_mla_wgmma.cuh) for 64 rows and 16-bit KV: Q [64, 576] and
// kMlaWgStages KV stages [32, 576] in 128-byte-swizzled tiles (no padding), two partial S
// buffers [64, 36] fp32 (one per warpgroup's half of the contraction), RowMeta / alpha [64],
// TokenLoc 2 x [32], bad masks; plus 1024 bytes to align the swizzled tiles. 203.3 KB.
inline constexpr int kMlaWgStages = 3;
constexpr size_t mla_wgmma_smem_bytes() {
  return size_t(64 + kMlaWgStages * kMlaTileKeys) * kMlaWidth * 2 + 2 * 64 * kMlaSStride +
         64 * (kMlaRowMetaBytes + 4) + 2 * kMlaTileKeys * 24 + 16 + 1024;
}
static_assert(mla_wgmma_smem_bytes() <= 232448, "one CTA per H100/H200 SM");

// The sm_90a 64-row kernel in FlashMLA's shape (decode_mla_pp.cuh; the launcher takes it over
// decode_mla_wgmma where the k / v views suit TMA and pages hold 16 * 2^i keys): Q [64, 576] | 2
// stages [64 keys, 576] | P [64, 64] (16-bit, 128-byte-swizzled tiles) | m, alpha [64] | l [2, 64]
// fp32 | mbarriers (a full one per stage and column block, three empty ones per stage: k and the two
// latent halves, a hand-over one per warpgroup); plus 1024
// bytes to align the tiles. 226 KB.
inline constexpr int kMlaPpKeys = 64;
constexpr size_t mla_pp_smem_bytes() {
  return size_t(3) * 64 * kMlaWidth * 2 + size_t(64) * kMlaPpKeys * 2 + 4 * 64 * 4 + (2 * kMlaWidth / 64 + 8) * 8 + 1024;
}
static_assert(mla_pp_smem_bytes() <= 232448, "one CTA per H100/H200 SM");
// The sm_90a 64-row kernel's shared memory as the selection reports it: the larger of the two
// the launcher may pick.
constexpr size_t mla_rows64_smem_bytes() {
  return mla_pp_smem_bytes() > mla_wgmma_smem_bytes() ? mla_pp_smem_bytes() : mla_wgmma_smem_bytes();
}

// The sm_90a kernel for 16 rows (decode_mla_heads.cuh: the rows as wgmma's N, 64-key tiles as its
// M), in two shapes the launcher picks by the grid (mla_heads_pair): two warpgroups and two KV
// stages, one CTA per SM (177.3 KB), for grids under 1.5 CTAs per SM; one warpgroup and one
// stage, two CTAs per SM (97.0 KB each: one CTA's softmax and copies run under the other's MMAs),
// for larger ones. An fp8 latent cache takes the first only (its 16-bit stages filled from
// registers; larger grids run decode_mla: decode_mla_wgmma.cu). Layout: Q [16, 576] | stages x KV
// [64, 576] | P^T [16, 64] (128-byte-swizzled tiles) | partial S^T [2, 64 x 16] fp32 (two
// warpgroups) | column partials [warpgroups, 5, 16] fp32 | RowMeta / scale [16] | TokenLoc 2 x
// [64] | bad masks; plus 1024 bytes to align the tiles.
// raw_fp8 (one warpgroup, fp8 latent): the stages hold the raw fp8 rows, padded to
// kMlaHeadsRawRow bytes (= 80 mod 128: ldmatrix's 8 rows on distinct banks), and the MMAs read
// them through registers (decode_mla_heads.cuh: the RS shape).
inline constexpr int kMlaHeadsRows = 16;
inline constexpr int kMlaHeadsTileKeys = 64;
inline constexpr int kMlaHeadsRawRow = kMlaWidth + 16;
constexpr size_t mla_heads_stage_bytes(bool raw_fp8) {
  return size_t(kMlaHeadsTileKeys) * (raw_fp8 ? size_t(kMlaHeadsRawRow) : size_t(kMlaWidth) * 2);
}
constexpr size_t mla_heads_smem_bytes(int wgs, int stages, bool raw_fp8 = false, bool tma = false) {
  return size_t(kMlaHeadsRows) * kMlaWidth * 2 + size_t(stages) * mla_heads_stage_bytes(raw_fp8) + kMlaHeadsRows * 128 +
         (wgs > 1 ? size_t(wgs) * kMlaHeadsTileKeys * kMlaHeadsRows * 4 : 0) + size_t(wgs) * 5 * kMlaHeadsRows * 4 +
         kMlaHeadsRows * (kMlaRowMetaBytes + 4) + 2 * kMlaHeadsTileKeys * 24 + 4 * (kMlaHeadsTileKeys / 32) * 4 +
         (tma ? size_t(stages) * (kMlaWidth / 64 + 1) * 8 : 0) + 1024;
}
// CTAs per SM: two when two fit in shared memory (with the 1 KB reserved per CTA) and registers
// (one warpgroup).
constexpr int mla_heads_ctas_per_sm(int wgs, int stages, bool raw_fp8 = false) {
  return wgs == 1 && sm90_ctas_fit(mla_heads_smem_bytes(wgs, stages, raw_fp8), 2) ? 2 : 1;
}
static_assert(mla_heads_smem_bytes(2, 2) <= 232448 && mla_heads_ctas_per_sm(1, 1) == 2 &&
                  mla_heads_ctas_per_sm(1, 2, true) == 2 && mla_heads_stage_bytes(true) % 1024 == 0,
              "the shapes' occupancy");
// The 16-row kernels' shared memory as the selection reports it: the largest the launcher may
// pick (a 16-bit cache: the 2 x 2 shape with TMA's barriers; fp8: the 2 x 2 shape).
constexpr size_t mla_rows16_smem_bytes(bool fp8) {
  return fp8 ? mla_heads_smem_bytes(2, 2) : mla_heads_smem_bytes(2, 2, false, true);
}
static_assert(mla_heads_smem_bytes(2, 2, false, true) <= 232448 &&
                  mla_heads_smem_bytes(2, 2, false, true) >= mla_heads_smem_bytes(1, 1),
              "the 16-bit 16-row shapes' largest: one CTA per H100/H200 SM");
// The launcher's pick: the two-CTA shape (1 warpgroup, 1 stage) for grids of at least 1.5 CTAs
// per SM (measured, H=16 B=64 L=4k: 256 CTAs 106.5 us vs 116.5; 128 CTAs 137.1 vs 107.9).
constexpr bool mla_heads_pair(int64_t ctas, int sms) { return 2 * ctas >= 3 * int64_t(sms); }

// The MLA decode candidate of select_attention_kernel (decode_mla_select.cu): fills `c` (kernel
// decode_mla, or decode_mla_wgmma for 64 rows of 16-bit KV on sm_90a; rows_per_cta 16/64; head_slices = CTAs per sequence in y, each looping over the
// row groups y, y + gridDim.y, ...) and returns "" when it serves the problem, else the reason.
std::string try_decode_mla(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c);

}  // namespace flashserve::kernels
