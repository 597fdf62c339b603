// The decode kernel's TMA form (decode_config.hpp: decode_tma_tiling, decode_wide_tma_tiling): its
// instantiations for the entries of kDecodeConfigs it serves (16-row CTAs; 32-row ones for 16-bit
// caches), in a translation unit of their own (decode_launch.cuh).
#include "kernels/attention/decode_launch.cuh"
#include "kernels/common/dispatch.hpp"

namespace flashserve::kernels {

bool launch_decode_tma(const AttnParams& p, bool wide, cudaStream_t stream) {
  bool merged = false;
  if (!dispatch_built<kDecodeConfigs>(
          [&](const DecodeConfig& c) { return decode::config_serves(c, p); },
          [&]<size_t I>() {
            constexpr DecodeKv f = decode::kFmt<I>;
            constexpr int d = kDecodeConfigs[I].d;
            if constexpr (decode_has_tma(f, d) && decode_has_wide(f)) {
              if (wide) {
                merged = decode::launch_rows<I, int(kDecodeWideRows), decode_wide_tma_tiling(f, d), true>(p, stream);
                return;
              }
            }
            if constexpr (decode_has_tma(f, d))
              merged = decode::launch_rows<I, kDecodeRows, decode_tma_tiling(f), true>(p, stream);
            else
              throw RuntimeError(detail::cat("decode attention: no TMA form for K ", dtype_name(p.k.dtype)));
          }))
    throw RuntimeError(detail::cat("decode attention: no TMA form for K ", dtype_name(p.k.dtype), ", V ",
                                   dtype_name(p.v.dtype), " and D ", p.head_dim));
  return merged;
}

}  // namespace flashserve::kernels
