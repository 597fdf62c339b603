#include "api/validate_merge.hpp"

#include "api/validate_cache.hpp"
#include "flashserve/status.hpp"

namespace flashserve::detail {


namespace {

// A state's output [T, H, D] (or the merged one): rank, last dim, shape as a_out.
void check_rows(std::string_view name, const TensorRef& t, const TensorRef& a_out) {
  check_rank(t, name, 3, "[T, H, D]");
  check_last_contiguous(t, name);
  check_shape(t, name, {a_out.size(0), a_out.size(1), a_out.size(2)}, "[T, H, D] as a_out");
}

// An fp32 LSE in `layout`; returns its token-major [T, H] view.
TensorRef lse_view(std::string_view name, const TensorRef& t, LseLayout layout, int64_t T, int64_t H) {
  check_dtype(t, name, {DType::f32});
  if (layout == LseLayout::head_major) {
    check_shape(t, name, {H, T}, "[H, T]");
    return t.permute({1, 0});
  }
  check_shape(t, name, {T, H}, "[T, H]");
  return t;
}

// Sets the stored format of out and checks output_scale.
void resolve_out_format(const MergeParams& p, MergeProblem& pr) {
  if (!p.output_scale) {
    if (is_fp8(p.out.dtype) || p.out.dtype == DType::u8)
      fail_arg("out", "float16, bfloat16 or float32 (an fp8 out needs output_scale)", dtype_name(p.out.dtype));
    check_dtype(p.out, "out", {DType::f16, DType::bf16, DType::f32});
    pr.out_format = p.out.dtype;
    return;
  }
  check_dtype(*p.output_scale, "output_scale", {DType::f32});
  const bool one = p.output_scale->ndim == 0 || (p.output_scale->ndim == 1 && p.output_scale->size(0) == 1);
  if (!one) fail_arg("output_scale", "shape [] or [1]", p.output_scale->shape_str());
  check_dtype(p.out, "out", {DType::f8e4m3, DType::f8e5m2, DType::u8});
  pr.out_format = p.out.dtype == DType::u8 ? DType::f8e4m3 : p.out.dtype;
  pr.output_scale = p.output_scale;
}

}  // namespace

MergeProblem validate_merge(const MergeParams& p) {
  MergeProblem pr;
  pr.device = common_device({{"out", &p.out}, {"out_lse", p.out_lse ? &*p.out_lse : nullptr},
                             {"a_out", &p.a_out}, {"a_lse", &p.a_lse}, {"b_out", &p.b_out},
                             {"b_lse", &p.b_lse},
                             {"output_scale", p.output_scale ? &*p.output_scale : nullptr}});
  check_dtype(p.a_out, "a_out", {DType::f16, DType::bf16, DType::f32});
  check_rank(p.a_out, "a_out", 3, "[T, H, D]");
  check_last_contiguous(p.a_out, "a_out");
  check_dtype(p.b_out, "b_out", {DType::f16, DType::bf16, DType::f32});
  check_rows("b_out", p.b_out, p.a_out);
  check_rows("out", p.out, p.a_out);
  resolve_out_format(p, pr);

  pr.tokens = p.a_out.size(0);
  pr.heads = p.a_out.size(1);
  pr.head_dim = p.a_out.size(2);
  pr.a_lse = lse_view("a_lse", p.a_lse, p.lse_layout, pr.tokens, pr.heads);
  pr.b_lse = lse_view("b_lse", p.b_lse, p.lse_layout, pr.tokens, pr.heads);
  if (p.out_lse) pr.out_lse = lse_view("out_lse", *p.out_lse, p.lse_layout, pr.tokens, pr.heads);

  pr.merge_rows = pr.tokens;
  if (p.prefill_tokens_with_context) {
    const int64_t n = *p.prefill_tokens_with_context;
    if (n < 0 || n > pr.tokens) fail_arg("prefill_tokens_with_context", cat("a value in [0, ", pr.tokens, "] (T)"), n);
    pr.merge_rows = n;
  }
  pr.out = p.out;
  pr.a_out = p.a_out;
  pr.b_out = p.b_out;
  return pr;
}

}  // namespace flashserve::detail
