// Public entry points of variants_ops.hpp: validate, then dispatch by device (cpu -> reference;
// cuda -> NotImplemented until the kernels exist).
#include <string_view>

#include "api/validate_variants.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"
#include "reference/variants_ops.hpp"

namespace flashserve {

namespace {

// A call on CUDA tensors, validate_only or not. The kernel pass replaces this with the launch
// (skipped under validate_only).
[[noreturn]] void fail_cuda(std::string_view op) {
#if FLASHSERVE_WITH_CUDA
  fail_not_implemented(op, " on CUDA tensors (the CUDA kernel is not written yet)");
#else
  fail_not_implemented(op, " on CUDA tensors (this build has no CUDA: FLASHSERVE_WITH_CUDA=0)");
#endif
}

}  // namespace

void differential_combine(const DifferentialCombineParams& p, const ExecContext& ctx) {
  const detail::DifferentialProblem pr = detail::validate_differential_combine(p);
  if (pr.device.type == DeviceType::cuda) fail_cuda("differential_combine");
  if (ctx.validate_only) return;
  reference::differential_combine(pr);
}

void lse_correct(const LseCorrectParams& p, const ExecContext& ctx) {
  const detail::LseCorrectProblem pr = detail::validate_lse_correct(p);
  if (pr.device.type == DeviceType::cuda) fail_cuda("lse_correct");
  if (ctx.validate_only) return;
  reference::lse_correct(pr);
}

void gather_cache(const GatherCacheParams& p, const ExecContext& ctx) {
  const detail::GatherCacheProblem pr = detail::validate_gather_cache(p);
  if (pr.device.type == DeviceType::cuda) fail_cuda("gather_cache");
  detail::check_gather_contents(pr);
  if (ctx.validate_only) return;
  reference::gather_cache(pr);
}

}  // namespace flashserve
