// The CPU reference of attention (SPEC.md §2): the oracle that every kernel is tested against,
// and the implementation that serves CPU tensors.
#pragma once

#include "problem/attention.hpp"
#include "flashserve/plan.hpp"

namespace flashserve::reference {

// Runs a validated problem on the CPU, writing pr.out (and pr.lse when present).
//
// Split-KV exactly as the kernels do it: sequence b's keys [0, sk) are cut into
// plan.num_splits ranges by split_kv_range(sk, n, s, plan.split_granularity); each range gets
// an fp32 online softmax without the sink, the partial (o, lse) states merge in split order
// through merge_lse, and the sink (s_aux) enters once at the end. With num_splits == 1 the
// result is bitwise reproducible and batch-invariant: a row depends only on its own
// sequence's data, never on the thread count or the rest of the batch.
// Batch-invariant plans (plan.split_size > 0) cut each sequence at multiples of split_size
// (seq_split_range: its own ceil(sk / split_size) splits), so it is invariant with splits too.
//
// OpenMP over (sequence, KV head, block of packed (query row, head) rows); no heap
// allocation: fp32 accumulators and K/V tiles live on the stack (about 260 KiB per thread).
void attention(const detail::AttnProblem& pr, const Plan& plan);

}  // namespace flashserve::reference
