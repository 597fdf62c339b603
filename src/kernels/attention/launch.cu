// kernels::attention: the normalized problem and plan become AttnParams, then the selected
// kernel (and the split combine) run on the caller's stream.
#include <cuda_runtime.h>

#include <algorithm>

#include "flashserve/status.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention/launchers.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/device_guard.cuh"
#include "kernels/device_info.hpp"

namespace flashserve::kernels {

namespace {

StridedRef strided(const TensorRef& t) {
  StridedRef r;
  r.data = t.data;
  r.dtype = t.dtype;
  for (int d = 0; d < t.ndim && d < 4; ++d) r.stride[d] = t.stride[size_t(d)];
  return r;
}

StridedRef strided(const OptTensor& t) { return t ? strided(*t) : StridedRef{}; }

void set_operands(AttnParams& a, const detail::AttnProblem& pr) {
  a.q = strided(pr.q);
  a.q_v = strided(pr.q_v);
  a.q_scale = strided(pr.q_scale);
  a.q_descale = strided(pr.q_descale);
  a.out = strided(pr.out);
  a.lse = strided(pr.lse);
  a.k = strided(pr.k);
  a.v = strided(pr.v);
  a.k_scale_cache = strided(pr.k_scale_cache);
  a.v_scale = strided(pr.v_scale);
  a.k_descale = strided(pr.k_descale);
  a.v_descale = strided(pr.v_descale);
  a.cu_seqlens_q = strided(pr.cu_seqlens_q);
  a.cu_seqlens_k = strided(pr.cu_seqlens_k);
  a.seqused_k = strided(pr.seqused_k);
  a.block_table = strided(pr.block_table);
  a.cache_batch_idx = strided(pr.cache_batch_idx);
  a.cp_tot_seqused_k = strided(pr.cp_tot_seqused_k);
  a.alibi = strided(pr.alibi_slopes);
  a.s_aux = strided(pr.s_aux);
}

void set_sizes(AttnParams& a, const detail::AttnProblem& pr) {
  const AttentionParams& p = *pr.params;
  a.batch = pr.batch;
  a.q_batches = pr.q.size(0);
  a.q_rows = pr.q.size(1);
  a.num_heads = pr.num_heads;
  a.num_kv_heads = pr.num_kv_heads;
  a.group = pr.group();
  a.head_dim = pr.head_dim;
  a.head_dim_v = pr.head_dim_v;
  a.qv_dim = pr.q_v ? pr.head_dim_v : 0;
  a.kv_dim0 = pr.k.size(0);
  a.kv_dim1 = pr.k.size(1);
  a.max_blocks = pr.block_table ? pr.block_table->size(1) : 0;
  a.batched = pr.batched;
  a.paged = pr.paged;
  a.softmax_scale = pr.softmax_scale;
  a.softcap = p.softcap;
  a.causal = p.causal;
  a.alibi_sqrt = p.alibi_sqrt;
  a.window_left = p.window.left;
  a.window_right = p.window.right;
  a.chunk = p.chunk_size;
  a.cp_world = p.cp_world_size;
  a.cp_rank = p.cp_rank;
  a.cp_interleave = p.cp_interleave;
}

// Split partials in the caller's workspace, at the plan's named buffers.
// Batch-invariant fixed-size splits (plan.split_size) run on the decode kernel; another kernel
// chosen for such a call (a feature decode lacks: the choice depends on the call's operands
// only) runs it unsplit, which is as invariant.
void set_splits(AttnParams& a, const Plan& plan, const ExecContext& ctx, AttnKernelId kernel) {
  const bool unsplit = plan.split_size > 0 && kernel != AttnKernelId::decode;
  a.num_splits = unsplit ? 1 : plan.num_splits;
  a.split_granularity = plan.split_granularity;
  a.split_size = unsplit ? 0 : plan.split_size;
  const int64_t sk = plan.shape.max_seqlen_k;  // the longest sequence's first split is its longest
  const int64_t g = std::max<int64_t>(1, a.split_granularity);
  a.max_split_keys = a.split_size > 0 ? std::min(sk, a.split_size) : split_kv_range(sk, a.num_splits, 0, g).end;
  if (a.num_splits <= 1) return;
  const WorkspaceBuffer& o = plan.workspace.get("o_partial");
  const WorkspaceBuffer& l = plan.workspace.get("lse_partial");
  const size_t rows = size_t(a.total_rows()) * size_t(a.num_heads) * size_t(plan.num_splits);
  if (o.bytes < rows * size_t(a.head_dim_v) * sizeof(float) || l.bytes < rows * sizeof(float))
    throw RuntimeError(detail::cat("attention on CUDA: the plan's o_partial/lse_partial (", o.bytes, "/", l.bytes,
                                   " bytes) are smaller than ", plan.num_splits, " splits need"));
  char* base = static_cast<char*>(ctx.workspace);
  a.o_partial = reinterpret_cast<float*>(base + o.offset);
  a.lse_partial = reinterpret_cast<float*>(base + l.offset);
}

}  // namespace

void attention(const detail::AttnProblem& pr, const Plan& plan, const ExecContext& ctx) {
  const DeviceProps dev = cuda_device_props(pr.q.device.index);
  const AttnKernelChoice choice = select_attention_kernel(pr, dev);
  if (!choice.supported()) throw NotImplemented(choice.why_not);
  AttnParams a;
  set_operands(a, pr);
  set_sizes(a, pr);
  set_splits(a, plan, ctx, choice.kernel);
  a.rows_per_cta = choice.rows_per_cta;
  a.heads_per_cta = choice.heads_per_cta;
  a.head_slices = choice.head_slices;
  if (choice.kernel == AttnKernelId::prefill_tma || choice.kernel == AttnKernelId::prefill_fp8)
    a.persistent_ctas = prefill_tma_persistent_ctas(
        prefill_cta_keys(a.max_split_keys, choice.rows_per_cta, a.causal, a.chunk, a.window_left, a.window_right),
        dev.num_sms);
  if (choice.kernel == AttnKernelId::decode) {
    a.row_ctas = decode_row_ctas(plan.shape.max_seqlen_q * a.group, plan.shape.kv_8bit);
    a.decode_tma = decode_tma_form(a, dev);
  }
  if (choice.kernel == AttnKernelId::decode || choice.kernel == AttnKernelId::decode_mla_wgmma)
    a.cluster_splits = decode_cluster_splits(
        a.num_splits, a.split_size,
        decode_cluster_default_max(choice.kernel == AttnKernelId::decode_mla_wgmma, plan.shape.kv_8bit), dev);
  if (a.batch == 0 || a.total_rows() == 0) return;
  const DeviceGuard guard(pr.q.device.index);
  bool merged = false;  // the kernel merged the splits itself
  if (choice.kernel == AttnKernelId::decode_mla) launch_decode_mla(a, ctx.stream);
  else if (choice.kernel == AttnKernelId::decode_mla_wgmma) merged = launch_decode_mla_wgmma(a, dev.num_sms, ctx.stream);
  else if (choice.kernel == AttnKernelId::decode) merged = launch_decode_attention(a, ctx.stream);
  else if (choice.kernel == AttnKernelId::prefill_mma) launch_prefill_attention(a, choice, ctx.stream);
  else if (choice.kernel == AttnKernelId::prefill_wgmma) launch_prefill_wgmma(a, choice, ctx.stream);
  else if (choice.kernel == AttnKernelId::prefill_tma) launch_prefill_tma(a, choice, ctx.stream);
  else if (choice.kernel == AttnKernelId::prefill_fp8) launch_prefill_fp8(a, choice, ctx.stream);
  else launch_generic_attention(a, choice, ctx.stream);
  if (a.num_splits > 1 && !merged) launch_split_combine(a, ctx.stream, dev.cc_major >= 9);
}

}  // namespace flashserve::kernels
