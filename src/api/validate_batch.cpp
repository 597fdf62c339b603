#include "api/validate_batch.hpp"

#include "common/check.hpp"

namespace flashserve::detail {

namespace {

// An int32 index tensor of the given rank on q's device.
void check_meta(const TensorRef& t, const char* arg, int rank, Device dev) {
  check_rank(t, arg, rank);
  check_dtype(t, arg, {DType::i32});
  check_device(t, arg, dev, "q");
  check_non_negative_strides(t, arg);
  check_data(t, arg);
}

void check_absent(const OptTensor& t, const char* arg, const char* why) {
  if (t) fail_arg(arg, cat("absent ", why), cat("a tensor ", t->shape_str()));
}

void check_paged_meta(AttnProblem& pr, const AttentionParams& p, Device dev) {
  const TensorRef& bt = *p.block_table;
  check_meta(bt, "block_table", 2, dev);
  check_last_contiguous(bt, "block_table");
  check_dim(bt, "block_table", 0, pr.batch, "B");
  check_absent(p.cache_batch_idx, "cache_batch_idx", "with a block_table");
  if (!p.seqused_k && (pr.batched || !p.cu_seqlens_k))
    fail_arg("seqused_k", "an int32 [B] tensor of KV lengths with a block_table", "none");
  pr.block_table = bt;
}

// Contiguous KV: varlen needs cu_seqlens_k; batched caches are [B_cache, S_cache, H_kv, D].
void check_contiguous_meta(AttnProblem& pr, const AttentionParams& p, Device dev) {
  if (!pr.batched) {
    if (!p.cu_seqlens_k) fail_arg("cu_seqlens_k", "an int32 [B+1] tensor for contiguous KV (or a block_table)", "none");
    check_absent(p.cache_batch_idx, "cache_batch_idx", "in a varlen call");
    return;
  }
  if (p.cache_batch_idx) {
    check_meta(*p.cache_batch_idx, "cache_batch_idx", 1, dev);
    check_dim(*p.cache_batch_idx, "cache_batch_idx", 0, pr.batch, "B");
    pr.cache_batch_idx = p.cache_batch_idx;
  } else if (pr.k.size(0) < pr.batch) {
    fail_arg("k", cat("a cache of at least B=", pr.batch, " rows (or cache_batch_idx)"), p.k.shape_str());
  }
}

}  // namespace

void check_batch(AttnProblem& pr, const AttentionParams& p) {
  const Device dev = p.q.device;
  if (pr.batched) {
    pr.batch = pr.q.size(0);
    check_absent(p.cu_seqlens_q, "cu_seqlens_q", "in a batched call (q is [B, sq, H, D])");
    check_absent(p.cu_seqlens_k, "cu_seqlens_k", "in a batched call (use seqused_k)");
  } else {
    if (!p.cu_seqlens_q) fail_arg("cu_seqlens_q", "an int32 [B+1] tensor for a varlen call", "none");
    check_meta(*p.cu_seqlens_q, "cu_seqlens_q", 1, dev);
    if (p.cu_seqlens_q->size(0) < 1) fail_arg("cu_seqlens_q", "at least 1 entry", p.cu_seqlens_q->shape_str());
    pr.batch = p.cu_seqlens_q->size(0) - 1;
    pr.cu_seqlens_q = p.cu_seqlens_q;
    if (p.max_seqlen_q < 0) fail_arg("max_seqlen_q", ">= 0", p.max_seqlen_q);
    if (p.max_seqlen_k < 0) fail_arg("max_seqlen_k", ">= 0", p.max_seqlen_k);
  }
  if (p.cu_seqlens_k) {
    check_meta(*p.cu_seqlens_k, "cu_seqlens_k", 1, dev);
    check_dim(*p.cu_seqlens_k, "cu_seqlens_k", 0, pr.batch + 1, "B+1");
    pr.cu_seqlens_k = p.cu_seqlens_k;
  }
  if (p.seqused_k) {
    check_meta(*p.seqused_k, "seqused_k", 1, dev);
    check_dim(*p.seqused_k, "seqused_k", 0, pr.batch, "B");
    pr.seqused_k = p.seqused_k;
  }
  if (pr.paged) check_paged_meta(pr, p, dev);
  else check_contiguous_meta(pr, p, dev);
}

void check_int8_scales(AttnProblem& pr, const AttentionParams& p) {
  const Device dev = p.q.device;
  if (!p.q_scale) fail_arg("q_scale", "an fp32 per-(token, head) scale for an int8 q", "none");
  // any non-negative strides: the int8 fork passes its head-major [H, total_q] scales transposed
  check_rank(*p.q_scale, "q_scale", pr.batched ? 3 : 2);
  check_dtype(*p.q_scale, "q_scale", {DType::f32});
  check_device(*p.q_scale, "q_scale", dev, "q");
  check_non_negative_strides(*p.q_scale, "q_scale");
  check_data(*p.q_scale, "q_scale");
  pr.q_scale = pr.batched ? *p.q_scale : p.q_scale->unsqueeze(0);
  for (int d = 0; d < 3; ++d)
    if (pr.q_scale->size(d) != pr.q.size(d))
      fail_arg("q_scale", pr.batched ? "[B, sq, H] like q" : "[total_q, H] like q", p.q_scale->shape_str());

  if (!p.k_scale_cache) fail_arg("k_scale_cache", "an fp32 per-(token, KV head) scale for an int8 k", "none");
  const TensorRef& ks = *p.k_scale_cache;
  check_dtype(ks, "k_scale_cache", {DType::f32});
  check_device(ks, "k_scale_cache", dev, "q");
  check_non_negative_strides(ks, "k_scale_cache");
  check_data(ks, "k_scale_cache");
  if (pr.paged) {
    check_rank(ks, "k_scale_cache", 3);
    pr.k_scale_cache = ks.permute({0, 2, 1});  // [num_blocks, block_size, H_kv]
  } else {
    check_rank(ks, "k_scale_cache", pr.batched ? 3 : 2);
    pr.k_scale_cache = pr.batched ? ks : ks.unsqueeze(0);
  }
  for (int d = 0; d < 3; ++d)
    if (pr.k_scale_cache->size(d) != pr.k.size(d))
      fail_arg("k_scale_cache", pr.paged ? "[num_blocks, H_kv, block_size] matching k" : "k's shape without D",
               ks.shape_str());

  if (p.v.dtype == DType::i8) {
    if (!p.v_scale) fail_arg("v_scale", "an fp32 [H_kv, Dv] scale for an int8 v (K8V8)", "none");
    check_operand(*p.v_scale, "v_scale", 2, {DType::f32}, dev, "q");
    if (p.v_scale->size(0) != pr.num_kv_heads || p.v_scale->size(1) != pr.head_dim_v)
      fail_arg("v_scale", cat("[H_kv, Dv] = [", pr.num_kv_heads, ", ", pr.head_dim_v, "]"), p.v_scale->shape_str());
    pr.v_scale = p.v_scale;
  } else {
    check_absent(p.v_scale, "v_scale", "with a float16/bfloat16 v (K8V16)");
  }
}

}  // namespace flashserve::detail
