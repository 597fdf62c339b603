// Public entry points of spec_metadata.hpp: validate, then dispatch by device (cpu -> reference
// after the content checks, cuda -> kernels in CUDA builds, contents unchecked on the device).
#include "flashserve/spec_metadata.hpp"

#include "api/run_cuda.hpp"
#include "api/validate_spec_metadata.hpp"
#include "kernels/spec_metadata.hpp"
#include "reference/spec_metadata.hpp"

namespace flashserve {

void spec_draft_expand(const SpecDraftExpandParams& p, const ExecContext& ctx) {
  const detail::DraftExpandProblem pr = detail::validate_spec_draft_expand(p);
  if (pr.device.type == DeviceType::cuda)
    return detail::run_cuda("spec_draft_expand", ctx, [&] { kernels::spec_draft_expand(pr, ctx.stream); });
  if (ctx.validate_only) return;
  reference::spec_draft_expand(pr);
}

void spec_verify_expand(const SpecVerifyExpandParams& p, const ExecContext& ctx) {
  const detail::VerifyExpandProblem pr = detail::validate_spec_verify_expand(p);
  if (pr.device.type == DeviceType::cuda)
    return detail::run_cuda("spec_verify_expand", ctx, [&] { kernels::spec_verify_expand(pr, ctx.stream); });
  detail::check_verify_expand_contents(pr);
  if (ctx.validate_only) return;
  reference::spec_verify_expand(pr);
}

void spec_window_page_table(const SpecWindowPageTableParams& p, const ExecContext& ctx) {
  const detail::WindowPageTableProblem pr = detail::validate_spec_window_page_table(p);
  if (pr.device.type == DeviceType::cuda)
    return detail::run_cuda("spec_window_page_table", ctx, [&] { kernels::spec_window_page_table(pr, ctx.stream); });
  detail::check_window_contents(pr);
  if (ctx.validate_only) return;
  reference::spec_window_page_table(pr);
}

}  // namespace flashserve
