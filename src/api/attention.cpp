// The attention entry points: validate, plan (or check the caller's plan), dispatch by device.
#include "flashserve/attention.hpp"

#include "problem/attention.hpp"
#include "flashserve/status.hpp"
#include "reference/attention.hpp"

#if FLASHSERVE_WITH_CUDA
#include "kernels/attention.hpp"
#include "kernels/attention/select.hpp"
#include "kernels/device_info.hpp"
#endif

namespace flashserve {

namespace {

// "batch=2 max_seqlen_q=7 max_seqlen_k=300 heads=8/2 head_dim=128/128 paged(16) causal" (not
// total_q: a plan serves any number of rows of q)
std::string shape_summary(const ProblemShape& s) {
  return detail::cat("batch=", s.batch, " max_seqlen_q=", s.max_seqlen_q, " max_seqlen_k=", s.max_seqlen_k,
                     " heads=", s.num_heads, "/", s.num_kv_heads, " head_dim=", s.head_dim, "/", s.head_dim_v,
                     s.page_size ? detail::cat(" paged(", s.page_size, ")") : std::string(" contiguous"),
                     s.causal ? " causal" : "", s.local ? " local" : "", s.batch_invariant ? " batch_invariant" : "", s.kv_8bit ? " kv_8bit" : "");
}

// The plan a call runs with, given the caller's (scheduler metadata): one made for this shape,
// up to the rows of q. A plan does not depend on which rows are padding, and engines plan a
// batch before padding it for a CUDA graph (vLLM: total_q = cu_seqlens_q[B] then, the padded
// rows at the call), so a plan for another row count serves with its split count and a
// workspace re-sized for the call's rows (make_plan with that count: the same split count
// unless the workspace bound caps it, which changes rounding only). Nor does a plan's cache
// width have to match (FlashAttention-3 runs metadata made with another qkv_dtype): its split
// count serves any.
Plan resolve_plan(const Plan& plan, const ProblemShape& shape, const DeviceProps& dev) {
  ProblemShape rows_as_call = plan.shape;
  rows_as_call.total_q = shape.total_q;
  rows_as_call.kv_8bit = shape.kv_8bit;
  if (!(rows_as_call == shape))
    fail_arg("scheduler_metadata", "a plan made for " + shape_summary(shape),
             "one made for " + shape_summary(plan.shape));
  if (plan.num_splits < 1 || plan.num_splits > kMaxSplits)
    fail_arg("scheduler_metadata", detail::cat("num_splits in [1, ", kMaxSplits, "]"), plan.num_splits);
  if (plan.split_granularity < 1)
    fail_arg("scheduler_metadata", "split_granularity >= 1", plan.split_granularity);
  if (plan.shape.total_q == shape.total_q && plan.shape.kv_8bit == shape.kv_8bit) return plan;
  // Batch-invariant plans follow the shape alone (split_size > 0: fixed-size splits).
  if (shape.batch_invariant) return make_plan(shape, dev, plan.split_size > 0 ? 0 : 1);
  return make_plan(shape, dev, plan.num_splits);
}

#if FLASHSERVE_WITH_CUDA
// The CUDA kernel for the problem on `dev`, or NotImplemented naming why there is none.
void require_cuda_kernel(const detail::AttnProblem& pr, const DeviceProps& dev) {
  const kernels::AttnKernelChoice choice = kernels::select_attention_kernel(pr, dev);
  if (!choice.supported()) throw NotImplemented(choice.why_not);
}

// A CUDA call needs a plan made for a CUDA device (named split buffers) and a workspace of
// at least its size; checked before anything runs.
void check_cuda_workspace(const Plan& plan, const ExecContext& ctx) {
  if (plan.num_splits > 1) {
    bool named = false;
    for (int i = 0; i < plan.workspace.count; ++i) named |= plan.workspace.buffers[size_t(i)].name == "o_partial";
    if (!named)
      fail_arg("scheduler_metadata", "a plan made for a CUDA device (o_partial, lse_partial workspace buffers)",
               detail::cat("a plan with ", plan.num_splits, " splits and no workspace buffers"));
  }
  const size_t need = plan.workspace.total_bytes;
  if (ctx.workspace_bytes < need)
    fail_arg("workspace", detail::cat("at least ", need, " bytes (o_partial, lse_partial)"), ctx.workspace_bytes);
  if (need > 0 && !ctx.workspace) fail_arg("workspace", "a device pointer", "null");
}

void run_cuda(const detail::AttnProblem& pr, const ProblemShape& shape, const ExecContext& ctx) {
  const DeviceProps dev = kernels::cuda_device_props(pr.q.device.index);
  require_cuda_kernel(pr, dev);
  const Plan plan = ctx.plan ? resolve_plan(*ctx.plan, shape, dev) : make_plan(shape, dev, pr.params->num_splits);
  check_cuda_workspace(plan, ctx);
  if (ctx.validate_only) return;
  kernels::attention(pr, plan, ctx);
}
#else
[[noreturn]] void fail_cuda() {
  fail_not_implemented("attention on CUDA (this build has no CUDA: FLASHSERVE_WITH_CUDA=0)");
}
#endif

void run_attention(const AttentionParams& p, bool batched, const ExecContext& ctx) {
  const detail::AttnProblem pr = detail::validate_attention(p, batched);
  const ProblemShape shape = detail::shape_of(pr);
  if (pr.q.device.type == DeviceType::cuda) {
#if FLASHSERVE_WITH_CUDA
    run_cuda(pr, shape, ctx);
    return;
#else
    fail_cuda();
#endif
  }
  const DeviceProps cpu = DeviceProps::cpu();
  const Plan plan = ctx.plan ? resolve_plan(*ctx.plan, shape, cpu) : make_plan(shape, cpu, p.num_splits);
  if (ctx.validate_only) return;
  reference::attention(pr, plan);
}

Plan plan_attention(const AttentionParams& p, bool batched, const DeviceProps& dev, const Plan* given) {
  const detail::AttnProblem pr = detail::validate_attention(p, batched);
#if FLASHSERVE_WITH_CUDA
  if (dev.device.type == DeviceType::cuda) require_cuda_kernel(pr, dev);
#endif
  const ProblemShape shape = detail::shape_of(pr);
  return given ? resolve_plan(*given, shape, dev) : make_plan(shape, dev, p.num_splits);
}

}  // namespace

void varlen_attention(const AttentionParams& p, const ExecContext& ctx) { run_attention(p, false, ctx); }

void kvcache_attention(const AttentionParams& p, const ExecContext& ctx) { run_attention(p, true, ctx); }

Plan plan_varlen_attention(const AttentionParams& p, const DeviceProps& dev) {
  return plan_attention(p, false, dev, nullptr);
}

Plan plan_kvcache_attention(const AttentionParams& p, const DeviceProps& dev) {
  return plan_attention(p, true, dev, nullptr);
}

Plan plan_varlen_attention(const AttentionParams& p, const DeviceProps& dev, const Plan& given) {
  return plan_attention(p, false, dev, &given);
}

Plan plan_kvcache_attention(const AttentionParams& p, const DeviceProps& dev, const Plan& given) {
  return plan_attention(p, true, dev, &given);
}

std::string attention_unsupported_reason(const AttentionParams& p, bool batched, const DeviceProps& dev) {
  try {
    const detail::AttnProblem pr = detail::validate_attention(p, batched);
    make_plan(detail::shape_of(pr), dev, p.num_splits);
    if (pr.q.device.type == DeviceType::cuda || dev.device.type == DeviceType::cuda) {
#if FLASHSERVE_WITH_CUDA
      require_cuda_kernel(pr, dev.device.type == DeviceType::cuda ? dev : kernels::cuda_device_props(pr.q.device.index));
#else
      fail_cuda();
#endif
    }
  } catch (const Error& e) {
    return e.what();
  } catch (const NotImplemented& e) {
    return e.what();
  }
  return "";
}

std::string attention_kernel_name(const AttentionParams& p, bool batched, const DeviceProps& dev) {
  const detail::AttnProblem pr = detail::validate_attention(p, batched);
  if (pr.q.device.type != DeviceType::cuda && dev.device.type != DeviceType::cuda) return "reference";
#if FLASHSERVE_WITH_CUDA
  const DeviceProps cuda = dev.device.type == DeviceType::cuda ? dev : kernels::cuda_device_props(pr.q.device.index);
  const kernels::AttnKernelChoice choice = kernels::select_attention_kernel(pr, cuda);
  if (!choice.supported()) throw NotImplemented(choice.why_not);
  return choice.name();
#else
  fail_cuda();
#endif
}

}  // namespace flashserve
