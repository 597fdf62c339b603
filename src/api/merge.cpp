// Public entry point of merge.hpp: validate, then dispatch by device (cpu -> reference, cuda ->
// kernel in CUDA builds).
#include "api/validate_merge.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/status.hpp"
#include "kernels/merge.hpp"
#include "reference/merge.hpp"

namespace flashserve {

void merge_states(const MergeParams& p, const ExecContext& ctx) {
  const detail::MergeProblem pr = detail::validate_merge(p);
  if (pr.device.type == DeviceType::cuda) {
#if FLASHSERVE_WITH_CUDA
    if (!ctx.validate_only) kernels::merge_states(pr, ctx.stream);
    return;
#else
    fail_not_implemented("merge_states on CUDA tensors (the CUDA kernels are not built yet)");
#endif
  }
  if (ctx.validate_only) return;
  reference::merge_states(pr);
}

}  // namespace flashserve
