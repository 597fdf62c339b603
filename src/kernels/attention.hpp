// The CUDA attention entry point behind varlen_attention / kvcache_attention (api/attention.cpp
// dispatches here for cuda tensors). Plain C++: no CUDA headers. Defined only in CUDA builds.
#pragma once

#include "problem/attention.hpp"
#include "flashserve/plan.hpp"

namespace flashserve::kernels {

// Runs a validated problem with `plan` on ctx.stream: selects the kernel
// (attention/select.hpp), launches it, and with plan.num_splits > 1 the split combine over
// ctx.workspace. The caller has checked the plan against the problem and the workspace size.
// No allocation, no host synchronization (CUDA-graph capturable). Throws NotImplemented when
// no kernel serves the problem, RuntimeError on a CUDA error.
void attention(const detail::AttnProblem& pr, const Plan& plan, const ExecContext& ctx);

}  // namespace flashserve::kernels
