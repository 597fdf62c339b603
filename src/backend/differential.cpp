// Differential attention (SPEC.md §6): four half-width attention passes through AttentionLayer
// over the two half caches, then out = RMSNorm(a1 - λ a2) * (1 - λ_init), re-interleaved.
//
//   q1/k1/v1 = even heads, q2/k2/v2 = odd heads (views with doubled head stride, no copies)
//   a1 = [attn(q1, k1, v1) | attn(q1, k1, v2)]  written straight into out's even | odd heads
//   a2 = [attn(q2, k2, v1) | attn(q2, k2, v2)]  into the workspace buffer "diff_a2" [T, H, D],
//                                               the same pair layout
//   out = differential_combine(a1 = out, a2): RMSNorm(a1 - λ a2) * (1 - λ_init) in place
#include <cmath>

#include "common/check.hpp"
#include "backend/layer_ops.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"

namespace flashserve::backend {

using namespace layer;

namespace {

constexpr int64_t kMaxHeadSize = 256;  // the attention calls' limit

// Even (half 0) or odd (half 1) heads of x [T, H, D] as [T, H/2, D].
TensorRef half_heads(const TensorRef& x, int half) {
  TensorRef v = x.slice(1, half, x.size(1));
  v.shape[1] = x.size(1) / 2;
  v.stride[1] *= 2;
  return v;
}

OptTensor half_heads(const OptTensor& x, int half) {
  if (!x) return std::nullopt;
  return half_heads(*x, half);
}

// The layer one half runs: half the heads, and it never writes the caches (forward does).
LayerSpec half_spec(const LayerSpec& base) {
  LayerSpec s = base;
  s.num_heads = base.num_heads / 2;
  s.num_kv_heads = base.num_kv_heads / 2;
  s.writes_kv_cache = false;
  return s;
}

TensorRef take_a2(Carver& ws, DType act, int64_t T, int64_t H, int64_t D) {
  return ws.take("diff_a2", act, {T, H, D}, DType::f32);
}

float dot(const TensorRef& a, const TensorRef& b) {
  float s = 0.0f;
  for (int64_t i = 0; i < a.size(0); ++i)
    s += *static_cast<const float*>(a.at(i)) * *static_cast<const float*>(b.at(i));
  return s;
}

void check_vector(const TensorRef& t, const char* arg, int64_t n, const char* what) {
  detail::check_rank(t, arg, 1);
  detail::check_dtype(t, arg, {DType::f32});
  detail::check_dim(t, arg, 0, n, what);
  detail::check_data(t, arg);
}

}  // namespace

DifferentialAttentionLayer::DifferentialAttentionLayer(const DifferentialSpec& spec) : spec_(spec) {
  const LayerSpec& b = spec.base;
  if (b.num_heads < 2 || b.num_heads % 2 != 0) fail_arg("num_heads", "an even count (interleaved pairs)", b.num_heads);
  if (b.num_kv_heads < 2 || b.num_kv_heads % 2 != 0)
    fail_arg("num_kv_heads", "an even count (interleaved pairs)", b.num_kv_heads);
  if (b.head_size < 1 || b.head_size > kMaxHeadSize) fail_arg("head_size", detail::cat("1 to ", kMaxHeadSize), b.head_size);
  if (b.head_size_v != 0 && b.head_size_v != b.head_size)
    fail_arg("head_size_v", detail::cat("0 or head_size=", b.head_size), b.head_size_v);
  if (b.alibi_slopes || b.sinks) fail_not_implemented("differential attention with ALiBi or sinks");
  const int64_t D = b.head_size;
  check_vector(spec.lambda_q1, "lambda_q1", D, "head_size");
  check_vector(spec.lambda_k1, "lambda_k1", D, "head_size");
  check_vector(spec.lambda_q2, "lambda_q2", D, "head_size");
  check_vector(spec.lambda_k2, "lambda_k2", D, "head_size");
  check_vector(spec.subln_weight, "subln_weight", 2 * D, "2 * head_size");
}

float DifferentialAttentionLayer::lambda_full() const {
  for (const TensorRef* v : {&spec_.lambda_q1, &spec_.lambda_k1, &spec_.lambda_q2, &spec_.lambda_k2})
    require_host(*v, "lambda_full (a host query; forward computes λ in differential_combine)");
  return std::exp(dot(spec_.lambda_q1, spec_.lambda_k1)) - std::exp(dot(spec_.lambda_q2, spec_.lambda_k2)) +
         spec_.lambda_init;
}

size_t DifferentialAttentionLayer::workspace_bytes(const BuilderConfig& config) const {
  Carver dry;
  take_a2(dry, spec_.base.dtype, config.max_num_tokens, spec_.base.num_heads, spec_.base.head_size);
  const size_t own = (dry.used() + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  return own + AttentionLayer(half_spec(spec_.base)).workspace_bytes(config);
}

void DifferentialAttentionLayer::forward(const AttentionMetadata& md, const TensorRef& q, const OptTensor& key,
                                         const OptTensor& value, const DifferentialCache& cache,
                                         const TensorRef& out, const LayerWorkspace& ws,
                                         const ExecContext& ctx) const {
  const LayerSpec& b = spec_.base;
  const int64_t T = md.num_actual_tokens, D = b.head_size;
  detail::check_rank(out, "out", 3);
  detail::check_dim(out, "out", 1, b.num_heads, "num_heads");
  detail::check_dim(out, "out", 2, D, "head_size");
  const bool encoder = b.type == AttnType::encoder || b.type == AttnType::encoder_only;
  if (!encoder && b.writes_kv_cache && key && value) {
    write_cache(cache.half1, b, half_heads(*key, 0), half_heads(*value, 0), md.slot_mapping, ctx);
    write_cache(cache.half2, b, half_heads(*key, 1), half_heads(*value, 1), md.slot_mapping, ctx);
  }
  Carver carver(ws);
  const TensorRef a2 = take_a2(carver, out.dtype, T, b.num_heads, D);
  const LayerWorkspace rest = carver.rest();
  const AttentionLayer half(half_spec(b));
  const KvCache* halves[2] = {&cache.half1, &cache.half2};
  for (int qh = 0; qh < 2; ++qh) {
    for (int vh = 0; vh < 2; ++vh) {
      const KvCache& kc = *halves[qh];
      const KvCache& vc = *halves[vh];
      const KvCache mixed{.key_cache = kc.key_cache, .value_cache = vc.value_cache, .k_scale = kc.k_scale,
                          .v_scale = vc.v_scale, .k_scale_cache = kc.k_scale_cache, .q_descale = kc.q_descale};
      const TensorRef dst = half_heads(qh == 0 ? out : a2, vh);
      half.forward(md, half_heads(q, qh), half_heads(key, qh), half_heads(value, vh), encoder ? nullptr : &mixed,
                   dst, rest, ctx);
    }
  }
  DifferentialCombineParams cp;
  cp.a1 = out.slice(0, 0, T);
  cp.a2 = a2;
  cp.lambda_q1 = spec_.lambda_q1;
  cp.lambda_k1 = spec_.lambda_k1;
  cp.lambda_q2 = spec_.lambda_q2;
  cp.lambda_k2 = spec_.lambda_k2;
  cp.weight = spec_.subln_weight;
  cp.lambda_init = spec_.lambda_init;
  cp.eps = spec_.rms_eps;
  cp.out = cp.a1;
  differential_combine(cp, ctx);
}

}  // namespace flashserve::backend
