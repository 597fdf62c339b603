// Host entry points of the attention kernels (defined in the .cu files next to this); plain
// C++ so the launcher (launch.cu) stays free of kernel templates. Every launch goes on
// `stream` (a cudaStream_t), is checked with FS_CUDA_CHECK_LAUNCH, allocates nothing and
// never synchronizes, so CUDA graphs can capture it.
#pragma once

#include "kernels/attention/params.hpp"
#include "kernels/attention/select.hpp"

namespace flashserve::kernels {

// generic_fwd.cu: the generic kernel for choice.dv_bucket. Writes out/lse directly when
// p.num_splits == 1, else the partials in p.o_partial / p.lse_partial.
void launch_generic_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream);

// prefill_fwd.cu: the tensor-core prefill kernel for choice.dv_bucket (= D) and p.q.dtype.
// Writes out/lse directly when p.num_splits == 1, else the partials.
void launch_prefill_attention(const AttnParams& p, const AttnKernelChoice& choice, void* stream);

// prefill_wgmma.cu: the sm_90a wgmma prefill kernel for choice.dv_bucket (= D) and p.q.dtype.
// Writes out/lse directly when p.num_splits == 1, else the partials.
void launch_prefill_wgmma(const AttnParams& p, const AttnKernelChoice& choice, void* stream);

// prefill_tma.cu: the sm_90a warp-specialized prefill kernel (TMA producer, ping-pong
// consumers) for (p.q.dtype, D, Dv) in kPrefillTmaConfigs, contiguous K/V. As prefill_wgmma.
void launch_prefill_tma(const AttnParams& p, const AttnKernelChoice& choice, void* stream);

// prefill_fp8.cu: the sm_90a fp8 prefill kernel (q, k, v fp8 e4m3, kPrefillFp8Configs), out
// bf16 / f16 / fp32, contiguous K/V or paged caches of prefill_tma's block sizes. As prefill_wgmma.
void launch_prefill_fp8(const AttnParams& p, const AttnKernelChoice& choice, void* stream);

// decode_fwd.cu: the decode kernel for (p.k.dtype, p.head_dim) (decode_config.hpp). Writes
// out/lse directly when p.num_splits == 1, else the partials; returns true when it merged the
// splits itself (p.cluster_splits, where the layout allows: no combine needed).
bool launch_decode_attention(const AttnParams& p, void* stream);
// Whether the decode kernel's long splits take its TMA form (decode_config.hpp: decode_tma_tiling)
// for a call on `dev` (launch.cu sets p.decode_tma): where the device runs the build's sm_90a code,
// for 16-bit K and V at D = 64 or 128, or fp8 ones at D = 128 (decode_has_tma), of views TMA can
// map (common/tma_map.cuh), contiguous or in pages of a multiple of 16 keys; by default where
// kDecodeTmaDefault says. FLASHSERVE_DECODE_TMA=0 or 1 forces it off or on within those bounds
// (A/B runs; the GPU tests' tma. entries).
// kDecodeTmaDefault: false until the form has run on a GPU (bench/pending/README.md).
inline constexpr bool kDecodeTmaDefault = false;
bool decode_tma_form(const AttnParams& p, const DeviceProps& dev);

// decode_mla.cu: the MLA absorbed-decode kernel for (p.q.dtype, p.k.dtype) (decode_mla_config.hpp), with
// p.rows_per_cta packed rows per CTA and p.head_slices CTAs per sequence in y. Writes out/lse
// directly when p.num_splits == 1, else the partials.
void launch_decode_mla(const AttnParams& p, void* stream);
// decode_mla_wgmma.cu: the sm_90a MLA absorbed-decode kernels (16 or 64 rows, 16-bit latent
// cache); num_sms picks the 16-row kernel's shape (mla_heads_pair). Returns true when it merged
// the splits itself (p.cluster_splits on decode_mla_heads' cp.async shapes: no combine needed).
bool launch_decode_mla_wgmma(const AttnParams& p, int num_sms, void* stream);

// combine.cu: merges the p.num_splits partials of every covered (row, head) in split order,
// applies the sink once and writes out/lse. `dependent` (sm_90+: the forward kernel just launched
// on the stream): a programmatic dependent launch, staged while the forward kernel runs.
void launch_split_combine(const AttnParams& p, void* stream, bool dependent);

}  // namespace flashserve::kernels
