// Instantiations and launch of the decode kernel: one per entry of decode_config.hpp's
// kDecodeConfigs (KV storage dtype x head size), the one table of decode instantiations.
#include <cuda_runtime.h>

#include "kernels/attention/decode_launch.cuh"
#include "kernels/common/dispatch.hpp"
#include "kernels/common/env_switch.hpp"

namespace flashserve::kernels {

namespace {

using decode::kFmt;
using decode::launch_rows;

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
      if (p.decode_tma) return launch_decode_tma(p, true, stream);  // decode_fwd_tma.cu (decode_tma_form: its formats)
      return launch_rows<I, int(kDecodeWideRows), decode_wide_tiling(f, d), true>(p, stream);
    }
  }
  AttnParams q = p;  // 16-row CTAs: twice as many per 32-row CTA the plan counted
  if (p.rows_per_cta == kDecodeWideRows) q.row_ctas = 2 * p.row_ctas;
  if (shrt) return launch_rows<I, kDecodeRows, decode_short_tiling(f, d), false>(q, stream);
  if (p.decode_tma) return launch_decode_tma(q, false, stream);
  return launch_rows<I, kDecodeRows, decode_tiling(f), true>(q, stream);
}

}  // namespace

bool decode_tma_form(const AttnParams& p, const DeviceProps& dev) {
  static const int forced = env_digit<0, 1, -1>("FLASHSERVE_DECODE_TMA");
  if (!(forced >= 0 ? forced == 1 : kDecodeTmaDefault)) return false;
  if (!FLASHSERVE_SM90A || dev.cc_major != 9 || dev.cc_minor != 0) return false;
  if (p.v.dtype != p.k.dtype || p.head_dim != p.head_dim_v || !(is_half(p.k.dtype) || is_fp8(p.k.dtype)) ||
      !decode_has_tma(decode_kv(p.k.dtype), int(p.head_dim)))  // 16-bit or fp8 rows in 128-byte column blocks
    return false;
  if (p.paged && p.kv_dim1 % kDecodeTileKeys != 0) return false;  // a tile from a 16-aligned row: one page
  return tma_mappable(p.k, p.kv_dim0, p.kv_dim1, p.num_kv_heads, p.head_dim) &&
         tma_mappable(p.v, p.kv_dim0, p.kv_dim1, p.num_kv_heads, p.head_dim_v);
}

bool launch_decode_attention(const AttnParams& p, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  bool merged = false;
  if (!dispatch_built<kDecodeConfigs>([&](const DecodeConfig& c) { return decode::config_serves(c, p); },
                                      [&]<size_t I>() { merged = launch_config<I>(p, s); }))
    throw RuntimeError(detail::cat("decode attention: no instantiation for K ", dtype_name(p.k.dtype), ", V ",
                                   dtype_name(p.v.dtype), " and D ",
                                   p.head_dim));
  return merged;
}

}  // namespace flashserve::kernels
