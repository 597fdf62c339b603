// Validation of an attention call's operands: ranks, dtypes, head counts and sizes,
// quantization modes, score modifiers. Batch metadata is in validate_batch.cpp.
#include <cmath>

#include "common/check.hpp"
#include "problem/attention.hpp"
#include "api/validate_batch.hpp"

namespace flashserve::detail {

namespace {

constexpr std::initializer_list<DType> kFloat = {DType::f32, DType::f16, DType::bf16};
constexpr std::initializer_list<DType> kQTypes = {DType::f32, DType::f16, DType::bf16,
                                                  DType::f8e4m3, DType::f8e5m2, DType::i8};
constexpr std::initializer_list<DType> kKvTypes = {DType::f32, DType::f16, DType::bf16,
                                                   DType::f8e4m3, DType::f8e5m2, DType::i8};

// Supported (D, Dv) pairs: D = Dv, a multiple of 8 up to 256; MLA 192/128; 64 + q_v 512.
void check_head_sizes(int64_t d, int64_t dv, bool has_qv) {
  const bool plain = d == dv && d % 8 == 0 && d >= 8 && d <= 256 && !has_qv;
  const bool mla_prefill = d == 192 && dv == 128 && !has_qv;
  const bool mla_decode = d == 64 && dv == 512 && has_qv;
  if (plain || mla_prefill || mla_decode) return;
  fail_not_implemented("head size D=", d, ", Dv=", dv, has_qv ? " with q_v" : "",
                       " (supported: D = Dv, a multiple of 8 up to 256; D=192/Dv=128; "
                       "D=64 with q_v and Dv=512)");
}

// Paged caches become NHD [num_blocks, block_size, H_kv, D]; varlen contiguous KV gets a
// leading dim of 1.
TensorRef normalize_kv(const TensorRef& t, const char* arg, bool paged, bool batched, KvLayout layout) {
  if (paged || batched) {
    check_rank(t, arg, 4);
    return (paged && layout == KvLayout::hnd) ? t.permute({0, 2, 1, 3}) : t;
  }
  check_rank(t, arg, 3);
  return t.unsqueeze(0);
}

void check_kv(AttnProblem& pr, const AttentionParams& p) {
  const Device dev = p.q.device;
  pr.k = normalize_kv(p.k, "k", pr.paged, pr.batched, p.kv_layout);
  pr.v = normalize_kv(p.v, "v", pr.paged, pr.batched, p.kv_layout);
  for (auto [t, arg] : {std::pair{&p.k, "k"}, std::pair{&p.v, "v"}}) {
    check_dtype(*t, arg, kKvTypes);
    check_device(*t, arg, dev, "q");
    check_non_negative_strides(*t, arg);
    check_last_contiguous(*t, arg);
    check_data(*t, arg);
  }
  pr.num_kv_heads = pr.k.size(2);
  pr.head_dim_v = pr.v.size(3);
  check_dim(p.k, "k", -1, pr.head_dim, "head size of q");
  if (pr.num_kv_heads < 1 || pr.num_heads % pr.num_kv_heads != 0)
    fail_arg("k", cat("a number of KV heads dividing H=", pr.num_heads), pr.num_kv_heads);
  for (int d = 0; d < 3; ++d)
    if (pr.v.size(d) != pr.k.size(d))
      fail_arg("v", cat("the leading dims of k (", p.k.shape_str(), ") with its own head size"), p.v.shape_str());
  if (pr.paged) pr.block_size = pr.k.size(1);
  if (pr.paged && pr.block_size < 1) fail_arg("k", "a block size >= 1", pr.block_size);
}

// q/out/q_v/lse: shapes follow q; out's dtype follows q (f16/bf16 for quantized q).
void check_q_out(AttnProblem& pr, const AttentionParams& p) {
  const Device dev = p.q.device;
  const int qrank = pr.batched ? 4 : 3;
  check_operand(p.q, "q", qrank, kQTypes, dev, "q");
  pr.q = pr.batched ? p.q : p.q.unsqueeze(0);
  pr.num_heads = pr.q.size(2);
  pr.head_dim = pr.q.size(3);
  pr.total_q = pr.q.size(0) * pr.q.size(1);
  if (pr.num_heads < 1) fail_arg("q", "at least one head", p.q.shape_str());
  const bool q_quant = is_fp8(p.q.dtype) || p.q.dtype == DType::i8;
  // fp32 out is accepted for any q: partial states (cascade, MLA chunks, DCP) merge in fp32.
  if (q_quant) check_operand(p.out, "out", qrank, {DType::bf16, DType::f16, DType::f32}, dev, "q");
  else check_operand(p.out, "out", qrank, {p.q.dtype, DType::f32}, dev, "q");
  pr.out = pr.batched ? p.out : p.out.unsqueeze(0);
  for (int d = 0; d < 3; ++d)
    if (pr.out.size(d) != pr.q.size(d))
      fail_arg("out", cat("the leading dims of q ", p.q.shape_str()), p.out.shape_str());
  if (p.q_v) {
    if (p.q.dtype == DType::i8) fail_not_implemented("q_v with an int8 q");
    check_operand(*p.q_v, "q_v", qrank, {p.q.dtype}, dev, "q");
    pr.q_v = pr.batched ? *p.q_v : p.q_v->unsqueeze(0);
    for (int d = 0; d < 3; ++d)
      if (pr.q_v->size(d) != pr.q.size(d)) fail_arg("q_v", cat("the leading dims of q ", p.q.shape_str()), p.q_v->shape_str());
  }
}

void check_lse(AttnProblem& pr, const AttentionParams& p) {
  if (!p.lse) return;
  const TensorRef& l = *p.lse;
  check_dtype(l, "lse", {DType::f32});
  check_device(l, "lse", p.q.device, "q");
  check_non_negative_strides(l, "lse");
  check_data(l, "lse");
  if (pr.batched) {
    check_rank(l, "lse", 3);
    if (l.size(0) != pr.q.size(0) || l.size(1) != pr.num_heads || l.size(2) != pr.q.size(1))
      fail_arg("lse", cat("[B, H, sq] = [", pr.q.size(0), ", ", pr.num_heads, ", ", pr.q.size(1), "]"), l.shape_str());
    pr.lse = l;
  } else {
    check_rank(l, "lse", 2);
    if (l.size(0) != pr.num_heads || l.size(1) != pr.total_q)
      fail_arg("lse", cat("[H, total_q] = [", pr.num_heads, ", ", pr.total_q, "]"), l.shape_str());
    pr.lse = l.unsqueeze(0);
  }
}

// A per-(batch, KV head) fp32 descale: [B, H_kv], stride-0 broadcasts allowed. Used for an
// fp8 operand. For a 16-bit (or fp32) operand it is accepted and left unused, as FlashAttention
// does (vLLM passes its layer's scales, expanded to [B, H_kv], whatever the dtype), after the
// same checks; int8 operands take their own scales (q_scale, k_scale_cache, v_scale).
void check_descale(const OptTensor& t, const char* arg, const AttnProblem& pr, DType operand,
                   Device dev, OptTensor& dst) {
  if (!t) return;
  if (operand == DType::i8)
    fail_arg(arg, "no descale for an int8 operand (int8 scales: q_scale, k_scale_cache, v_scale)", "a descale tensor");
  check_rank(*t, arg, 2);
  check_dtype(*t, arg, {DType::f32});
  check_device(*t, arg, dev, "q");
  check_non_negative_strides(*t, arg);
  check_data(*t, arg);
  if (t->size(0) != pr.batch || t->size(1) != pr.num_kv_heads)
    fail_arg(arg, cat("[B, H_kv] = [", pr.batch, ", ", pr.num_kv_heads, "]"), t->shape_str());
  if (is_fp8(operand)) dst = *t;
}

void check_modifiers(AttnProblem& pr, const AttentionParams& p) {
  const Device dev = p.q.device;
  if (!std::isfinite(p.softmax_scale)) fail_arg("softmax_scale", "a finite value", p.softmax_scale);
  if (!(p.softcap >= 0.0f) || !std::isfinite(p.softcap)) fail_arg("softcap", "a finite value >= 0", p.softcap);
  if (p.window.left < -1 || p.window.right < -1)
    fail_arg("window", "left and right >= -1", cat("(", p.window.left, ", ", p.window.right, ")"));
  if (p.chunk_size < 0) fail_arg("chunk_size", ">= 0", p.chunk_size);
  if (p.num_splits < 0) fail_arg("num_splits", ">= 0", p.num_splits);
  if (p.cp_world_size < 1) fail_arg("cp_world_size", ">= 1", p.cp_world_size);
  if (p.cp_rank < 0 || p.cp_rank >= p.cp_world_size)
    fail_arg("cp_rank", cat("a rank in [0, ", p.cp_world_size, ")"), p.cp_rank);
  if (p.cp_interleave < 1) fail_arg("cp_interleave", ">= 1", p.cp_interleave);
  if (p.cp_world_size > 1) {
    if (!p.cp_tot_seqused_k) fail_arg("cp_tot_seqused_k", "an int32 [B] tensor of global KV lengths", "none");
    check_operand(*p.cp_tot_seqused_k, "cp_tot_seqused_k", 1, {DType::i32}, dev, "q");
    check_dim(*p.cp_tot_seqused_k, "cp_tot_seqused_k", 0, pr.batch, "B");
    pr.cp_tot_seqused_k = p.cp_tot_seqused_k;
  } else if (p.cp_tot_seqused_k) {
    fail_arg("cp_tot_seqused_k", "absent when cp_world_size is 1", "a tensor");
  }
  if (p.alibi_slopes) {
    const TensorRef& a = *p.alibi_slopes;
    check_rank_in(a, "alibi_slopes", 1, 2);
    check_dtype(a, "alibi_slopes", {DType::f32});
    check_device(a, "alibi_slopes", dev, "q");
    check_non_negative_strides(a, "alibi_slopes");
    check_data(a, "alibi_slopes");
    if (a.size(-1) != pr.num_heads || (a.ndim == 2 && a.size(0) != pr.batch))
      fail_arg("alibi_slopes", cat("[H] or [B, H] with H=", pr.num_heads, ", B=", pr.batch), a.shape_str());
    TensorRef n = a.ndim == 2 ? a : a.unsqueeze(0);
    if (a.ndim == 1) {
      n.shape[0] = pr.batch;
      n.stride[0] = 0;
    }
    pr.alibi_slopes = n;
  }
  if (p.s_aux) {
    check_operand(*p.s_aux, "s_aux", 1, kFloat, dev, "q");
    check_dim(*p.s_aux, "s_aux", 0, pr.num_heads, "H");
    pr.s_aux = p.s_aux;
  }
  const float d_total = float(pr.head_dim + (pr.q_v ? pr.head_dim_v : 0));
  pr.softmax_scale = p.softmax_scale != 0.0f ? p.softmax_scale : 1.0f / std::sqrt(d_total);
}

void check_quantization(AttnProblem& pr, const AttentionParams& p) {
  const Device dev = p.q.device;
  const DType qt = p.q.dtype, kt = p.k.dtype, vt = p.v.dtype;
  const bool int8_mode = qt == DType::i8 || kt == DType::i8 || vt == DType::i8;
  if (int8_mode) {
    if (qt != DType::i8) fail_arg("q", "int8 with an int8 KV cache (K8V8/K8V16)", dtype_name(qt));
    if (kt != DType::i8) fail_arg("k", "int8 with an int8 q (K8V8/K8V16)", dtype_name(kt));
    check_dtype(p.v, "v", {DType::i8, DType::f16, DType::bf16});
    check_int8_scales(pr, p);  // validate_batch.cpp: q_scale, k_scale_cache, v_scale
  } else {
    for (auto [t, arg] : {std::pair{&p.q_scale, "q_scale"}, std::pair{&p.k_scale_cache, "k_scale_cache"},
                          std::pair{&p.v_scale, "v_scale"}})
      if (*t) fail_arg(arg, "absent without int8 operands", "a tensor");
    if (is_fp8(kt) || is_fp8(vt)) {
      if (kt != vt) fail_arg("v", cat("the dtype of k (", dtype_name(kt), ")"), dtype_name(vt));
    } else {
      if (kt != vt) fail_arg("v", cat("the dtype of k (", dtype_name(kt), ")"), dtype_name(vt));
      if (!is_fp8(qt) && kt != qt) fail_arg("k", cat("the dtype of q (", dtype_name(qt), ")"), dtype_name(kt));
      if (is_fp8(qt)) fail_arg("k", "an fp8 cache with an fp8 q", dtype_name(kt));
    }
  }
  check_descale(p.q_descale, "q_descale", pr, qt, dev, pr.q_descale);
  check_descale(p.k_descale, "k_descale", pr, kt, dev, pr.k_descale);
  check_descale(p.v_descale, "v_descale", pr, vt, dev, pr.v_descale);
}

}  // namespace

AttnProblem validate_attention(const AttentionParams& p, bool batched) {
  AttnProblem pr;
  pr.params = &p;
  pr.batched = batched;
  pr.paged = p.block_table.has_value();
  check_q_out(pr, p);
  check_kv(pr, p);
  check_head_sizes(pr.head_dim, pr.head_dim_v, p.q_v.has_value());
  if (p.q_v) check_dim(*p.q_v, "q_v", -1, pr.head_dim_v, "Dv, the head size of v");
  check_dim(p.out, "out", -1, pr.head_dim_v, "Dv, the head size of v");
  check_batch(pr, p);  // sets batch; validate_batch.cpp
  check_lse(pr, p);
  check_quantization(pr, p);
  check_modifiers(pr, p);
  if (p.q.device.type == DeviceType::cpu) check_batch_contents(pr, p);
  return pr;
}

}  // namespace flashserve::detail
