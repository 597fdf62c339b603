// Public entry points of variants_ops.hpp: validate, then dispatch by device (cpu -> reference,
// cuda -> kernels in CUDA builds). On CUDA gather_cache's contents stay on the device unchecked:
// the kernels skip out-of-range indices (kernels/variants_ops.hpp).
#include "api/run_cuda.hpp"
#include "api/validate_variants.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"
#include "kernels/variants_ops.hpp"
#include "reference/variants_ops.hpp"

namespace flashserve {

void differential_combine(const DifferentialCombineParams& p, const ExecContext& ctx) {
  const detail::DifferentialProblem pr = detail::validate_differential_combine(p);
  if (pr.device.type == DeviceType::cuda)
    return detail::run_cuda("differential_combine", ctx, [&] { kernels::differential_combine(pr, ctx.stream); });
  if (ctx.validate_only) return;
  reference::differential_combine(pr);
}

void lse_correct(const LseCorrectParams& p, const ExecContext& ctx) {
  const detail::LseCorrectProblem pr = detail::validate_lse_correct(p);
  if (pr.device.type == DeviceType::cuda)
    return detail::run_cuda("lse_correct", ctx, [&] { kernels::lse_correct(pr, ctx.stream); });
  if (ctx.validate_only) return;
  reference::lse_correct(pr);
}

void gather_cache(const GatherCacheParams& p, const ExecContext& ctx) {
  const detail::GatherCacheProblem pr = detail::validate_gather_cache(p);
  if (pr.device.type == DeviceType::cuda)
    return detail::run_cuda("gather_cache", ctx, [&] { kernels::gather_cache(pr, ctx.stream); });
  detail::check_gather_contents(pr);
  if (ctx.validate_only) return;
  reference::gather_cache(pr);
}

}  // namespace flashserve
