// Kernel selection for attention on CUDA: ONE function decides which kernel serves a problem
// (or why none can). The support query, the planner's dry run and the launch all call it, so
// "is it supported" and "what runs" never disagree. Plain C++ (no CUDA headers).
//
// Candidates are tried in order: fast paths first (decode_mla: MLA absorbed decode with q_v,
// decode_mla_wgmma its sm_90a form for 64 rows of a 16-bit cache;
// decode; prefill_tma: the sm_90a warp-specialized prefill, contiguous K/V and paged caches of
// block sizes 16 x 2^k; prefill_wgmma: the sm_90a prefill for other block sizes and what TMA
// cannot map; prefill_mma: the sm80+ one), each
// returning its own reason when it does not apply; the generic kernel stays the fallback for
// every validated problem. FLASHSERVE_DISABLE_KERNELS (comma-separated names of the
// tensor-core prefill kernels and the MLA decode ones, e.g. "prefill_tma,prefill_wgmma") takes them out
// of the selection, to test or compare the portable paths on a Hopper GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "problem/attention.hpp"
#include "kernels/attention/decode_config.hpp"
#include "kernels/attention/decode_mla_config.hpp"
#include "flashserve/plan.hpp"

namespace flashserve::kernels {

enum class AttnKernelId : uint8_t {
  none, generic, prefill_mma, prefill_wgmma, decode, decode_mla, prefill_tma, decode_mla_wgmma, prefill_fp8
};

// ---- the generic kernel's fixed shape (generic_fwd.cuh)
inline constexpr int kGenericWarps = 4;
inline constexpr int kGenericRowsPerWarp = 4;       // packed (query row, head) rows per warp
inline constexpr int kGenericThreads = 32 * kGenericWarps;
inline constexpr int kGenericPackedRows = kGenericWarps * kGenericRowsPerWarp;  // 16 per CTA
inline constexpr int kGenericTileKeys = 32;         // keys per KV tile: one per lane
inline constexpr size_t kGenericTokenLocBytes = 24; // sizeof(TokenLoc), checked in load.cuh
inline constexpr int64_t kGenericMaxQkWidth = 768;  // D (+ Dv of q_v)

// The instantiated accumulator widths (Dv rounded up to one of these): the one table of
// generic instantiations, read by the selection and by generic_fwd.cu's dispatch.
#if FLASHSERVE_DEV_CONFIGS
inline constexpr int kGenericDvBuckets[] = {128, 512};
#else
inline constexpr int kGenericDvBuckets[] = {64, 128, 256, 512};
#endif

constexpr bool generic_dv_bucket_built(int bucket) {
  for (int b : kGenericDvBuckets)
    if (b == bucket) return true;
  return false;
}

// Dynamic shared memory of the generic kernel: token locations, the CTA's packed query rows
// [16, D + Dv_qv], K tile [32, D + 1] and V tile [32, Dv + 1] in fp32 (+1: bank padding).
size_t generic_smem_bytes(int64_t d, int64_t dv, int64_t qv_dim);

// Largest dynamic shared memory per block on a device of this compute capability (opt-in).
size_t max_smem_per_block(const DeviceProps& dev);

// ---- the tensor-core prefill kernel (prefill_fwd.cuh): FlashAttention-2 on mma.sync (sm80+)
inline constexpr int kPrefillRowsPerCta = 128;  // 4 warps x 32 query rows (two m16 blocks)
inline constexpr int kPrefillTileKeys = 64;     // keys per KV tile (double-buffered)
inline constexpr int kPrefillWarps = 4;
inline constexpr int kPrefillThreads = 32 * kPrefillWarps;
inline constexpr int kPrefillCtasPerSm = 2;     // launch bounds: <= 255 registers per thread
// The prefill kernels keep a CTA's key offsets (within a sequence's cache span, plus a tile
// of slack) in int32: select.cu bounds the span (4 of the largest tile: 128 keys).
inline constexpr int64_t kPrefillMaxCacheTokens = (int64_t(1) << 31) - 4 * 128;

// The instantiated prefill configurations (q/k/v dtype, D, Dv: 0 for Dv == D): the one table
// read by the selection and by prefill_fwd.cu's dispatch (prefill_mma: D == Dv only).
struct PrefillConfig {
  DType dtype;
  int head_dim;
  int head_dim_v = 0;
  constexpr int dv() const { return head_dim_v ? head_dim_v : head_dim; }
};
#if FLASHSERVE_DEV_CONFIGS
inline constexpr PrefillConfig kPrefillConfigs[] = {{DType::bf16, 128}};
#else
inline constexpr PrefillConfig kPrefillConfigs[] = {
    {DType::bf16, 64}, {DType::bf16, 128}, {DType::f16, 64}, {DType::f16, 128}};
#endif

constexpr bool prefill_config_built(DType t, int64_t d) {
  for (const PrefillConfig& c : kPrefillConfigs)
    if (c.dtype == t && c.head_dim == d) return true;
  return false;
}

// Dynamic shared memory of the prefill kernel: Q [128, D] + K and V [2 stages, 64, D], 16-bit,
// then the rows' visible key ranges (int32 pairs [128]).
constexpr size_t prefill_smem_bytes(int64_t d) {
  return size_t(kPrefillRowsPerCta + 4 * kPrefillTileKeys) * size_t(d) * 2 + size_t(kPrefillRowsPerCta) * 8;
}

// ---- the wgmma prefill kernel (prefill_wgmma.cuh): sm_90a (H100/H200) only
#ifndef FLASHSERVE_SM90A
#define FLASHSERVE_SM90A 0  // the build compiles sm_90a code (cmake/cuda.cmake)
#endif
inline constexpr int kWgmmaRowsPerCta = 128;  // 2 warpgroups x 64 query rows
inline constexpr int kWgmmaWarps = 8;
inline constexpr int kWgmmaThreads = 32 * kWgmmaWarps;
// Keys per KV tile: 128, or 64 when D or Dv > 128 (registers: O [64, Dv] and S [64, N] per
// warpgroup; shared memory).
constexpr int wgmma_tile_keys(int64_t d, int64_t dv) { return d <= 128 && dv <= 128 ? 128 : 64; }
// Channels a swizzled tile of d channels spans: whole 64-channel column blocks (wgmma.cuh). The
// QK^T reduction reads D exactly (k16 steps); P V runs over the padded width (N-major operands
// of the 128-byte swizzle come in whole 64-channel atoms), whose extra channels are not stored.
constexpr int wgmma_tile_width(int64_t d) { return int((d + 63) / 64 * 64); }
// Bytes of a swizzled tile's row of d channels of es bytes each: whole 128-byte column blocks.
constexpr int tile_row_bytes(int64_t d, int64_t es) { return int((d * es + 127) / 128 * 128); }

// Whether a table of sm_90a instantiations (kPrefillWgmmaConfigs, ...) holds (t, D, Dv): never
// in a build without sm_90a code.
template <size_t N>
constexpr bool sm90_config_built(const PrefillConfig (&configs)[N], DType t, int64_t d, int64_t dv) {
  if (!FLASHSERVE_SM90A) return false;
  for (const PrefillConfig& c : configs)
    if (c.dtype == t && c.head_dim == d && c.dv() == dv) return true;
  return false;
}

// D 64/128/256 (the benchmark's), 96 and 192 (D = Dv), and MLA prefill's 192/128; the dev set
// (three instantiations each, ~3 s of nvcc apiece) is the bf16 half: every head size, no f16.
// prefill_tma serves contiguous caches and paged ones of its block sizes; this kernel the other
// paged ones (any block size) of every head size.
#if FLASHSERVE_DEV_CONFIGS
inline constexpr PrefillConfig kPrefillWgmmaConfigs[] = {{DType::bf16, 64},  {DType::bf16, 96},
                                                         {DType::bf16, 128}, {DType::bf16, 192},
                                                         {DType::bf16, 256}, {DType::bf16, 192, 128}};
#else
inline constexpr PrefillConfig kPrefillWgmmaConfigs[] = {
    {DType::bf16, 64}, {DType::bf16, 96}, {DType::bf16, 128}, {DType::bf16, 192}, {DType::bf16, 256},
    {DType::bf16, 192, 128},
    {DType::f16, 64},  {DType::f16, 96},  {DType::f16, 128},  {DType::f16, 192},  {DType::f16, 256},
    {DType::f16, 192, 128}};
#endif

constexpr bool prefill_wgmma_config_built(DType t, int64_t d, int64_t dv) {
  return sm90_config_built(kPrefillWgmmaConfigs, t, d, dv);
}

// Dynamic shared memory of the wgmma kernel: 1 KB of alignment slack (the swizzled tiles sit
// on 1024-byte boundaries), Q [128, D] + K [2 stages, N, D] + V [3 stages, N, Dv], 16-bit, D
// and Dv padded to whole 64-channel blocks, then the rows' visible key ranges (int32 pairs
// [128]). 194 KB at D = 96 and 128, 226 KB at 256, 170 KB at 192, 146 KB at 192/128.
constexpr size_t prefill_wgmma_smem_bytes(int64_t d, int64_t dv) {
  const int64_t n = wgmma_tile_keys(d, dv), wd = wgmma_tile_width(d), wdv = wgmma_tile_width(dv);
  return 1024 + size_t(kWgmmaRowsPerCta * wd + 2 * n * wd + 3 * n * wdv) * 2 + size_t(kWgmmaRowsPerCta) * 8;
}

// ---- the warp-specialized prefill kernel (prefill_tma.cuh): sm_90a, contiguous K/V or paged
// caches of prefill_tma_block_size_ok block sizes, TMA
// loads in 64-channel boxes (D = 96: the second box's channels past 96 load as zeros into the
// tile's padding, tma_map.cuh), 384 threads (a producer warpgroup), the wgmma kernel's tiles
// with two K and two V stages. The same head sizes as prefill_wgmma (dev set: bf16 only).
#if FLASHSERVE_DEV_CONFIGS
inline constexpr PrefillConfig kPrefillTmaConfigs[] = {{DType::bf16, 64},  {DType::bf16, 96},
                                                       {DType::bf16, 128}, {DType::bf16, 192},
                                                       {DType::bf16, 256}, {DType::bf16, 192, 128}};
#else
inline constexpr PrefillConfig kPrefillTmaConfigs[] = {
    {DType::bf16, 64}, {DType::bf16, 96}, {DType::bf16, 128}, {DType::bf16, 192}, {DType::bf16, 256},
    {DType::bf16, 192, 128},
    {DType::f16, 64},  {DType::f16, 96},  {DType::f16, 128},  {DType::f16, 192},  {DType::f16, 256},
    {DType::f16, 192, 128}};
#endif

// Whether TMA can map a dim of n elements, stride_elems apart, of elem_bytes each: 1 <= n <
// 2^31 and, for n > 1, a positive stride below 2^40 bytes that is a multiple of 16 bytes. The
// selection (select.cu) and the tensor maps (tma_map.cu) both ask it.
constexpr bool tma_dim_ok(int64_t n, int64_t stride_elems, int64_t elem_bytes) {
  if (n < 1 || n >= (int64_t(1) << 31)) return false;
  const int64_t bytes = stride_elems * elem_bytes;
  return n == 1 || (stride_elems > 0 && bytes < (int64_t(1) << 40) && bytes % 16 == 0);
}

constexpr bool prefill_tma_config_built(DType t, int64_t d, int64_t dv) {
  return sm90_config_built(kPrefillTmaConfigs, t, d, dv);
}

// Pages of P keys a TMA producer loads kn-key tiles from (prefill_tma, decode_mla_pp): a
// multiple of 16 that divides the tile (one box per page segment) or is divided by it.
constexpr bool tma_block_size_ok(int64_t kn, int64_t p) {
  return p >= 16 && p % 16 == 0 && (kn % p == 0 || p % kn == 0);
}
// The paged block sizes it serves: P a multiple of 16 (a page segment starts on a 2 KB, so
// 1024-byte aligned, row of the swizzled tile) that divides the kN-key tile or is divided by it
// (16, 32, 64, 128, 256, ...), so that a tile starting on a multiple of min(kN, P) keys is whole
// page segments. Other block sizes (1, 80, ...) stay on prefill_wgmma.
constexpr bool prefill_tma_block_size_ok(int64_t d, int64_t dv, int64_t p) {
  return tma_block_size_ok(wgmma_tile_keys(d, dv), p);
}
// Rows of its K/V TMA box: the whole kN-key tile (contiguous, or pages of at least kN keys), or
// one page of P < kN keys (tma_map.cu's box, prefill_tma.cuh's segments).
constexpr int prefill_tma_box_rows(int kn, bool paged, int64_t block_size) {
  return paged && block_size < kn ? int(block_size) : kn;
}

// The consumers' wait pins of the TMA kernels (prefill_tma.cuh: consume_tiles): a float per
// consumer thread (128 per warpgroup of 64 rows).
constexpr size_t wait_pin_bytes(int64_t rows) { return size_t(rows) * 2 * 4; }

// prefill_tma's consumer warpgroups (64 query rows each): up to three at D = Dv = 64
// (FlashAttention-3's 192-row tile there: a warpgroup's softmax takes about as long as its
// GEMMs, so with two the tensor pipe idles while each waits for the other's; with three, two
// softmaxes overlap one warpgroup's GEMMs), else two. fp32 out keeps two: its P residues need
// the registers. Where three are built, prefill_tma_rows picks per call.
constexpr int prefill_tma_max_consumer_wgs(int64_t d, int64_t dv, bool f32_out) {
  return d <= 64 && dv <= 64 && !f32_out ? 3 : 2;
}
// Query rows per prefill_tma CTA for sequences of up to max_q rows: 192 where three warpgroups
// are built and the rows padded to whole 192-row tiles are at most 15% more than to 128-row ones,
// 5% when causal (H200, D = 64, bench/RESULTS.md 2026-11-25 09:45: 192-row CTAs 3-16% faster at
// S >= 2k and 5% at S = 512 (12.5% more rows), but S = 512 causal 2.5% slower, where a taller
// tile also computes more of the masked triangle; S = 128 sequences 13% slower, a third of each
// tile empty), else 128.
constexpr int prefill_tma_rows(int64_t d, int64_t dv, bool f32_out, int64_t max_q, bool causal = false) {
  if (prefill_tma_max_consumer_wgs(d, dv, f32_out) < 3 || max_q <= 0) return 128;
  const int64_t pad192 = (max_q + 191) / 192 * 192, pad128 = (max_q + 127) / 128 * 128;
  return 100 * pad192 <= (causal ? 105 : 115) * pad128 ? 192 : 128;
}

// Its dynamic shared memory: 1 KB of alignment slack, Q [M, D] + K [2, N, D] + V [2, N, Dv]
// 16-bit (D and Dv padded to whole 64-channel blocks; M = prefill_tma_rows: 128 or 192), the
// rows' key ranges (int2 [M]), the wait pins and 9 mbarriers (prefill_tma.cuh: TmaSmem). 163 KB
// at D = 96 and 128, 195 KB at 256, 147 KB at 192, 131 KB at 192/128, 83 / 92 KB at 64.
constexpr size_t prefill_tma_smem_bytes(int64_t d, int64_t dv, int64_t m) {
  const int64_t n = wgmma_tile_keys(d, dv), wd = wgmma_tile_width(d), wdv = wgmma_tile_width(dv);
  return 1024 + size_t(m * wd + 2 * n * wd + 2 * n * wdv) * 2 + size_t(m) * 8 + wait_pin_bytes(m) + 9 * 8;
}

// ---- the fp8 prefill kernel (prefill_fp8.cuh): sm_90a, prefill_tma's CTA on fp8 wgmma; q, k
// and v fp8 e4m3 (descales), D = Dv = 128, contiguous K/V or paged caches of
// prefill_tma_block_size_ok block sizes.
inline constexpr PrefillConfig kPrefillFp8Configs[] = {{DType::f8e4m3, 128}};

constexpr bool prefill_fp8_config_built(DType t, int64_t d, int64_t dv) {
  return sm90_config_built(kPrefillFp8Configs, t, d, dv);
}

// Its dynamic shared memory: 1 KB of alignment slack, Q [128, D] + K [2, N, D] + V raw and V
// transposed [2 + 2, N, Dv] in bytes, the rows' key ranges (int2 [128]) and 13 mbarriers
// (prefill_fp8.cuh: Fp8Smem). 114 KB at D = 128.
constexpr size_t prefill_fp8_smem_bytes(int64_t d, int64_t dv) {
  const int64_t n = wgmma_tile_keys(d, dv);
  return 1024 + size_t(kWgmmaRowsPerCta * d + 2 * n * d + 4 * n * dv) + size_t(kWgmmaRowsPerCta) * 8 + 13 * 8;
}

// ---- the persistent forms of prefill_tma and prefill_fp8 (prefill_persistent.cuh): one CTA per
// SM walking the items, each item's start (metadata, Q, the first tiles) overlapping the previous
// item's end. Taken where a CTA's keys are at most kPrefillPersistentMaxKeys (short sequences:
// few tiles per CTA). 0: no call takes them unless FLASHSERVE_PREFILL_PERSISTENT=1. Timed against
// one CTA per item (bench/RESULTS.md 2026-12-07 22:10, an H100: the device lent no H200) they
// were slower on 23 of 27 rows (S = 512-8k, D = 64/128/256, paged, fp8: 1.03-1.70x the time),
// faster only at D = 64 causal S = 512 / 1k (0.93 / 0.96) and fp8 S = 8k (0.985); no key bound
// separates those, so none is set. That walk took items c, c + G, ...; with tickets
// (prefill_persistent.cuh) its SMs are as balanced as one CTA per item and the causal rows
// improved (D 256 S 2k 1.70 -> 1.22x, D 128 1.24 -> 1.05x), but 25 of 27 rows stay slower
// (1.01-1.31x): each item takes ~5% more active cycles (ncu, bench/RESULTS.md 2026-12-08 00:21).
inline constexpr int64_t kPrefillPersistentMaxKeys = 0;
inline constexpr size_t kTmaItemSlotBytes = 256;  // an item handed to the consumers (TmaItem)
// What a persistent form adds to its kernel's shared memory: 5 mbarriers, two item slots and two
// 8-byte ticket slots.
inline constexpr size_t kPersistentSmemBytes = 5 * 8 + 2 * kTmaItemSlotBytes + 2 * 8;
constexpr size_t prefill_tma_persistent_smem_bytes(int64_t d, int64_t dv, int64_t m) {
  return prefill_tma_smem_bytes(d, dv, m) + kPersistentSmemBytes;
}
constexpr size_t prefill_fp8_persistent_smem_bytes(int64_t d, int64_t dv) {
  return prefill_fp8_smem_bytes(d, dv) + kPersistentSmemBytes;
}
// The most keys one prefill CTA of `rows` query rows sees: its split's keys (split_keys; 0:
// unknown), bounded by a chunk (chunked local attention: a tile's rows see keys from the first
// row's chunk start to the last row, at most chunk + rows - 1) or a window (window_left + rows +
// the right extent: window_right, 0 when causal; -1 sides unbounded).
constexpr int64_t prefill_cta_keys(int64_t split_keys, int64_t rows, bool causal, int64_t chunk, int64_t window_left,
                                   int64_t window_right) {
  int64_t bound = chunk > 0 ? chunk + rows - 1 : -1;
  const int64_t right = causal ? 0 : window_right;
  if (window_left >= 0 && right >= 0) {
    const int64_t w = window_left + rows + right;
    bound = bound < 0 || w < bound ? w : bound;
  }
  if (bound < 0) return split_keys;
  return split_keys > 0 && split_keys < bound ? split_keys : bound;
}
static_assert(prefill_cta_keys(2048, 128, true, 0, -1, -1) == 2048 && prefill_cta_keys(0, 128, true, 0, -1, -1) == 0 &&
              prefill_cta_keys(8192, 128, true, 2048, -1, -1) == 2175 && prefill_cta_keys(8192, 128, true, 0, 511, -1) == 639 &&
              prefill_cta_keys(8192, 128, false, 0, 511, -1) == 8192 && prefill_cta_keys(8192, 128, false, 0, 511, 64) == 703 &&
              prefill_cta_keys(256, 128, true, 0, 511, 0) == 256 && prefill_cta_keys(0, 128, true, 512, 100, 0) == 228);
// The CTAs of the persistent form for a call whose CTAs see at most max_split_keys keys
// (launch.cu: prefill_cta_keys; 0: unknown) on num_sms SMs, or 0 for one CTA per item.
// FLASHSERVE_PREFILL_PERSISTENT=0 or 1 forces it off or on for every call (A/B runs, the GPU
// tests' persistent entries).
int prefill_tma_persistent_ctas(int64_t max_split_keys, int num_sms);

// ---- decode's splits merged in a cluster (cluster_merge.cuh: cluster_combine) instead of
// partials in the workspace and the combine launch (3.8-6 us per call, bench/RESULTS.md
// 2026-11-26): the decode kernel and decode_mla_heads' cp.async shapes, for calls of 2 to
// kDecodeClusterMaxSplits splits whose splits are the same for every sequence (not
// batch-invariant fixed-size ones), sm_90a. Timed (bench/RESULTS.md 2026-12-07 22:10, an H100):
// clusters of 2 gain 1-2% (bf16 B16 L8k 0.989x the time, MLA H16 B64 bf16 0.979x, fp8 B16 L8k
// 1.003x); larger ones lose (8 splits B4 L16k 1.31x, 16 splits B1 L32k 1.13x; MLA's fp8-latent
// shape 1.75x at 4 splits); again on 2026-12-08 00:21, 0.5% at 2 splits. The bound was 2 until
// a 1000-step graph replay differed from its eager step by 1 ulp (the cluster summed in rank
// order, the combine in its class tree; RESULTS.md 2026-12-08 00:21). The cluster now sums as
// the combine does, which no GPU has run yet: 0 (no cluster by default, FLASHSERVE_DECODE_CLUSTER=1
// forms them) until bench/pending/session27-verify.sh passes; then 2 again.
inline constexpr int kDecodeClusterMaxSplits = 0;
// The default bound for a kernel's calls: kDecodeClusterMaxSplits, 0 for MLA's 8-bit latent.
constexpr int decode_cluster_default_max(bool mla, bool kv_8bit) { return mla && kv_8bit ? 0 : kDecodeClusterMaxSplits; }
// Whether a decode call of num_splits splits (split_size > 0: fixed-size ones) on `dev` merges
// them in a cluster: only where the device runs the build's sm_90a code (compute capability 9.0),
// by default up to default_max splits (decode_cluster_default_max). FLASHSERVE_DECODE_CLUSTER=0
// or 1 forces it off or on (within kClusterMaxCtas) for every call.
bool decode_cluster_splits(int num_splits, int64_t split_size, int default_max, const DeviceProps& dev);

struct AttnKernelChoice {
  AttnKernelId kernel = AttnKernelId::none;
  int dv_bucket = 0;        // generic: accumulator channels per row (a built bucket >= Dv);
                            // prefill_mma / prefill_wgmma: Dv
  int rows_per_cta = 0;     // query rows per CTA
  int heads_per_cta = 0;    // query heads (of one KV head's group) per CTA
  int head_slices = 0;      // ceil(group / heads_per_cta); decode_mla: CTAs per sequence in y
                            // (ceil(q_len x H / rows_per_cta) packed rows of rows_per_cta each)
  size_t smem_bytes = 0;    // dynamic shared memory per CTA
  std::string why_not;      // kernel == none: every candidate's reason, "; "-separated
  bool supported() const { return kernel != AttnKernelId::none; }
  const char* name() const;  // kernel_name(kernel): "decode", "generic", ...
};

// The kernel for a validated problem on `dev`. Reads shapes and dtypes only (never device
// memory), allocates nothing when a kernel is found.
AttnKernelChoice select_attention_kernel(const detail::AttnProblem& pr, const DeviceProps& dev);

const char* kernel_name(AttnKernelId id);

// Whether FLASHSERVE_DISABLE_KERNELS takes `kernel` out of the selection.
bool kernel_disabled(AttnKernelId kernel);

}  // namespace flashserve::kernels
