// Public entry points of cache.hpp: validate, then dispatch by device (cpu -> reference, cuda ->
// kernels in CUDA builds). On CUDA the contents that index memory stay on the device unchecked:
// the kernels skip out-of-range indices (kernels/cache_ops.hpp).
#include <array>
#include <utility>

#include "api/validate_cache.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/status.hpp"
#include "kernels/cache_ops.hpp"
#include "reference/cache_ops.hpp"

namespace flashserve {

namespace {

constexpr std::array<std::pair<std::string_view, KvCacheDType>, 7> kCacheDTypeNames = {{
    {"auto", KvCacheDType::auto_},
    {"fp8", KvCacheDType::fp8_e4m3},
    {"fp8_e4m3", KvCacheDType::fp8_e4m3},
    {"fp8_e5m2", KvCacheDType::fp8_e5m2},
    {"int8", KvCacheDType::int8_k8v8},
    {"int8_k8v8", KvCacheDType::int8_k8v8},
    {"int8_k8v16", KvCacheDType::int8_k8v16},
}};

// A call on CUDA tensors: in CUDA builds runs `launch` (unless validate_only); in CPU-only builds
// throws NotImplemented, validate_only or not. `launch` is never called (nor emitted) there.
template <class F>
void run_cuda(std::string_view op, const ExecContext& ctx, F&& launch) {
#if FLASHSERVE_WITH_CUDA
  if (!ctx.validate_only) launch();
#else
  fail_not_implemented(op, " on CUDA tensors (the CUDA kernels are not built yet)");
#endif
}

}  // namespace

KvCacheDType parse_kv_cache_dtype(std::string_view s, std::string_view arg) {
  for (const auto& [name, t] : kCacheDTypeNames)
    if (name == s) return t;
  throw Error(detail::cat(arg, ": expected one of auto, fp8, fp8_e4m3, fp8_e5m2, int8, int8_k8v16, got '", s, "'"));
}

std::string_view kv_cache_dtype_name(KvCacheDType t) {
  switch (t) {
    case KvCacheDType::auto_: return "auto";
    case KvCacheDType::fp8_e4m3: return "fp8_e4m3";
    case KvCacheDType::fp8_e5m2: return "fp8_e5m2";
    case KvCacheDType::int8_k8v8: return "int8_k8v8";
    case KvCacheDType::int8_k8v16: return "int8_k8v16";
  }
  return "?";
}

void reshape_and_cache(const CacheWriteParams& p, const ExecContext& ctx) {
  const detail::CacheWriteProblem pr = detail::validate_cache_write(p);
  if (pr.device.type == DeviceType::cuda)
    return run_cuda("reshape_and_cache", ctx, [&] { kernels::reshape_and_cache(pr, ctx.stream); });
  detail::check_cache_write_contents(pr);
  if (ctx.validate_only) return;
  reference::reshape_and_cache(pr);
}

void copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping, const ExecContext& ctx) {
  const Device dev = detail::validate_copy_blocks(caches, block_mapping);
  if (dev.type == DeviceType::cuda)
    return run_cuda("copy_blocks", ctx, [&] { kernels::copy_blocks(caches, block_mapping, ctx.stream); });
  detail::check_block_mapping(block_mapping, caches.empty() ? 0 : caches[0].size(0),
                              caches.empty() ? 0 : caches[0].size(0));
  if (ctx.validate_only) return;
  reference::copy_blocks(caches, block_mapping);
}

void swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping, const ExecContext& ctx) {
  const bool cuda = detail::validate_swap_blocks(src, dst, block_mapping);
#if !FLASHSERVE_WITH_CUDA
  if (cuda) fail_not_implemented("swap_blocks with a cache on a CUDA device (the CUDA copies are not built yet)");
#endif
  detail::check_block_mapping(block_mapping, src.size(0), dst.size(0));  // on the CPU either way
  if (cuda) return run_cuda("swap_blocks", ctx, [&] { kernels::swap_blocks(src, dst, block_mapping, ctx.stream); });
  if (ctx.validate_only) return;
  reference::swap_blocks(src, dst, block_mapping);
}

void advance_step(const AdvanceStepParams& p, const ExecContext& ctx) {
  if (detail::validate_advance_step(p).type == DeviceType::cuda)
    return run_cuda("advance_step", ctx, [&] { kernels::advance_step(p, ctx.stream); });
  detail::check_advance_step_contents(p);
  if (ctx.validate_only) return;
  reference::advance_step(p);
}

void quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale, const ExecContext& ctx) {
  if (detail::validate_quantize_int8(x, out, scale).type == DeviceType::cuda)
    return run_cuda("quantize_int8", ctx, [&] { kernels::quantize_int8(x, out, scale, ctx.stream); });
  if (ctx.validate_only) return;
  reference::quantize_int8(x, out, scale);
}

}  // namespace flashserve
