// The MLA absorbed-decode kernel's fixed shape and its one table of instantiations, read by
// the selection (decode_mla_select.cu), the launcher (decode_mla.cu) and the shared-memory
// sizing. Plain C++ (no CUDA headers). The scheme and its cost model: decode_mla.cuh.
//
// Served (try_decode_mla): q_v present, D = 64 (rope) and Dv = 512 (latent), H_kv = 1, q, q_v,
// k, v and out of one 16-bit dtype (f16/bf16) in kMlaConfigs, no quantization scales, k/v/q/q_v
// rows 16-byte aligned (k and v may be two views of one latent cache [.., 576] or separate
// buffers: each is read once, with its own strides). Every score modifier of the decode kernel
// (causal / window / chunk, context parallelism, soft-cap, ALiBi, sinks), paged or contiguous
// KV, any split count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "problem/attention.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::kernels {

struct AttnKernelChoice;

inline constexpr int kMlaD = 64;                   // rope channels (k, q)
inline constexpr int kMlaDv = 512;                 // latent channels (v, q_v, out)
inline constexpr int kMlaWidth = kMlaD + kMlaDv;   // 576: the q.k contraction
inline constexpr int kMlaTileKeys = 32;            // keys per CTA tile (K and V loaded once)
inline constexpr int kMlaStages = 2;               // cp.async stages of the KV tile
inline constexpr int kMlaRowPad = 16;              // bytes per smem row: ldmatrix rows on distinct banks
// Packed (query row, head) rows per CTA: 16 (one m16 block: H = 16 decode, 4 warps) or 64
// (H = 128, or q_len x H > 16: 8 warps).
constexpr int mla_warps(int rows) { return rows == 16 ? 4 : 8; }
constexpr int mla_rows_for(int64_t packed) { return packed <= 16 ? 16 : 64; }

struct MlaConfig {
  DType dtype;  // q, q_v, k, v, out
};
#if FLASHSERVE_DEV_CONFIGS
inline constexpr MlaConfig kMlaConfigs[] = {{DType::bf16}};
#else
inline constexpr MlaConfig kMlaConfigs[] = {{DType::bf16}, {DType::f16}};
#endif

constexpr bool mla_config_built(DType t) {
  for (const MlaConfig& c : kMlaConfigs)
    if (c.dtype == t) return true;
  return false;
}

// Shared memory, in bytes (decode_mla.cuh carves it the same way), 16-bit elements:
//   Q [rows, 576] (+16 B per row) | KV [stages, 32 keys, 576] (+16 B per row) |
//   S [rows, 32 + 4] fp32 (P, 16-bit, overwrites each row's S in place) |
//   RowMeta [rows] (40 B) | row scale [rows] fp32 | TokenLoc [32] (24 B) | bad-key masks [4] u32.
// 64 rows: 162.5 KB (fits the A100's 163 KB, one CTA per SM); 16 rows: 97.3 KB (two per SM on
// the H200).
inline constexpr size_t kMlaRowBytes = size_t(kMlaWidth) * 2 + kMlaRowPad;  // 1168
inline constexpr size_t kMlaSStride = size_t(kMlaTileKeys + 4) * 4;         // 144: S / P row bytes
inline constexpr size_t kMlaRowMetaBytes = 40;                              // decode::RowMeta
constexpr size_t mla_smem_bytes(int rows) {
  return size_t(rows) * kMlaRowBytes + size_t(kMlaStages) * kMlaTileKeys * kMlaRowBytes + size_t(rows) * kMlaSStride +
         size_t(rows) * (kMlaRowMetaBytes + 4) + size_t(kMlaTileKeys) * 24 + 16;
}
static_assert(mla_smem_bytes(64) <= 166912, "the 64-row shape fits the A100's opt-in shared memory");
static_assert(2 * (mla_smem_bytes(16) + 1024) <= 228 * 1024, "two 16-row CTAs per H200 SM");

// The MLA decode candidate of select_attention_kernel (decode_mla_select.cu): fills `c` (kernel
// decode_mla; rows_per_cta 16/64; head_slices = CTAs per sequence in y, each looping over the
// row groups y, y + gridDim.y, ...) and returns "" when it serves the problem, else the reason.
std::string try_decode_mla(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c);

}  // namespace flashserve::kernels
