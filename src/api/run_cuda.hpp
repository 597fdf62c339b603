// The CUDA branch of the public entry points (src/api/*.cpp): after validation, a call on CUDA
// tensors runs its launch in CUDA builds, or is NotImplemented in CPU-only ones.
#pragma once

#include <string_view>

#include "flashserve/plan.hpp"
#include "flashserve/status.hpp"

namespace flashserve::detail {

// In CUDA builds runs `launch` (unless validate_only); in CPU-only builds throws NotImplemented,
// validate_only or not. `launch` is never called (nor emitted) there.
template <class F>
void run_cuda(std::string_view op, const ExecContext& ctx, F&& launch) {
#if FLASHSERVE_WITH_CUDA
  if (!ctx.validate_only) launch();
#else
  fail_not_implemented(op, " on CUDA tensors (this build has no CUDA: FLASHSERVE_WITH_CUDA=0)");
#endif
}

}  // namespace flashserve::detail
