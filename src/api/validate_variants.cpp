#include "api/validate_variants.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/check.hpp"
#include "flashserve/status.hpp"

namespace flashserve::detail {

namespace {

constexpr std::initializer_list<DType> kFloats = {DType::f16, DType::bf16, DType::f32};

// The layout checks every operand gets once its rank is known.
void check_layout(const TensorRef& t, Arg arg) {
  check_non_negative_strides(t, arg);
  check_last_contiguous(t, arg);
  check_data(t, arg);
}

// A [T, H, D] operand of differential_combine shaped as a1.
void check_pairs(const TensorRef& t, Arg arg, const TensorRef& a1) {
  check_dtype(t, arg, kFloats);
  check_rank(t, arg, 3, "[T, H, D]");
  check_shape(t, arg, {a1.size(0), a1.size(1), a1.size(2)}, "[T, H, D] as a1");
  check_layout(t, arg);
}

// An fp32 vector [n].
void check_vector(const TensorRef& t, Arg arg, int64_t n, const char* what) {
  check_dtype(t, arg, {DType::f32});
  check_rank(t, arg, 1);
  check_dim(t, arg, 0, n, what);
  check_non_negative_strides(t, arg);
  check_data(t, arg);
}

// An int32 index tensor of exactly `shape`.
void check_index(const TensorRef& t, Arg arg, std::initializer_list<int64_t> shape, std::string_view what) {
  check_dtype(t, arg, {DType::i32});
  check_shape(t, arg, shape, what);
  check_non_negative_strides(t, arg);
  check_data(t, arg);
}

// An fp32 LSE over (H, T) in `layout` with `lead` leading dims of any size (-1 each);
// returns the head-major view.
TensorRef lse_view(const TensorRef& t, Arg arg, LseLayout layout, bool lead, int64_t H, int64_t T) {
  check_dtype(t, arg, {DType::f32});
  const bool hm = layout == LseLayout::head_major;
  if (lead) {
    check_rank(t, arg, 3, hm ? "[W, H, T]" : "[W, T, H]");
    if (hm) check_shape(t, arg, {-1, H, T}, "[W, H, T] with H, T of out");
    else check_shape(t, arg, {-1, T, H}, "[W, T, H] with T, H of out");
  } else {
    check_rank(t, arg, 2, hm ? "[H, T]" : "[T, H]");
    if (hm) check_shape(t, arg, {H, T}, "[H, T] with H, T of out");
    else check_shape(t, arg, {T, H}, "[T, H] with T, H of out");
  }
  check_non_negative_strides(t, arg);
  check_data(t, arg);
  if (hm) return t;
  return lead ? t.permute({0, 2, 1}) : t.permute({1, 0});
}

}  // namespace

DifferentialProblem validate_differential_combine(const DifferentialCombineParams& p) {
  DifferentialProblem pr;
  pr.device = common_device({{"a1", &p.a1}, {"a2", &p.a2}, {"lambda_q1", &p.lambda_q1}, {"lambda_k1", &p.lambda_k1},
                             {"lambda_q2", &p.lambda_q2}, {"lambda_k2", &p.lambda_k2}, {"weight", &p.weight},
                             {"out", &p.out}});
  check_dtype(p.a1, "a1", kFloats);
  check_rank(p.a1, "a1", 3, "[T, H, D]");
  check_layout(p.a1, "a1");
  if (p.a1.size(1) % 2 != 0) fail_arg("a1", "an even head count H (interleaved pairs)", p.a1.shape_str());
  check_pairs(p.a2, "a2", p.a1);
  check_pairs(p.out, "out", p.a1);
  pr.tokens = p.a1.size(0);
  pr.pairs = p.a1.size(1) / 2;
  pr.head_dim = p.a1.size(2);
  check_vector(p.lambda_q1, "lambda_q1", pr.head_dim, "D");
  check_vector(p.lambda_k1, "lambda_k1", pr.head_dim, "D");
  check_vector(p.lambda_q2, "lambda_q2", pr.head_dim, "D");
  check_vector(p.lambda_k2, "lambda_k2", pr.head_dim, "D");
  check_vector(p.weight, "weight", 2 * pr.head_dim, "2 * D");
  if (!std::isfinite(p.lambda_init)) fail_arg("lambda_init", "a finite value", p.lambda_init);
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) fail_arg("eps", "a finite value >= 0", p.eps);
  pr.a1 = p.a1;
  pr.a2 = p.a2;
  pr.out = p.out;
  pr.lambda_q1 = p.lambda_q1;
  pr.lambda_k1 = p.lambda_k1;
  pr.lambda_q2 = p.lambda_q2;
  pr.lambda_k2 = p.lambda_k2;
  pr.weight = p.weight;
  pr.lambda_init = p.lambda_init;
  pr.eps = p.eps;
  return pr;
}

LseCorrectProblem validate_lse_correct(const LseCorrectParams& p) {
  LseCorrectProblem pr;
  pr.device = common_device({{"out", &p.out}, {"lse_all", &p.lse_all}, {"lse_out", p.lse_out ? &*p.lse_out : nullptr}});
  check_dtype(p.out, "out", kFloats);
  if (p.out.ndim != 3 && p.out.ndim != 4)
    fail_arg("out", "3 dims [T, H, Dv] or 4 dims [S, T, H/S, Dv]", cat(p.out.ndim, " dims ", p.out.shape_str()));
  check_layout(p.out, "out");
  pr.out = p.out.ndim == 3 ? p.out.unsqueeze(0) : p.out;
  pr.slices = pr.out.size(0);
  pr.tokens = pr.out.size(1);
  pr.slice_heads = pr.out.size(2);
  pr.head_dim = pr.out.size(3);
  const int64_t H = pr.slices * pr.slice_heads, T = pr.tokens;
  pr.lse_all = lse_view(p.lse_all, "lse_all", p.lse_layout, true, H, T);
  pr.world = p.lse_all.size(0);
  if (p.rank < 0 || p.rank >= pr.world)
    fail_arg("rank", cat("a rank in [0, ", pr.world, ") (W = lse_all's dim 0)"), p.rank);
  pr.rank = p.rank;
  if (p.lse_out) pr.lse_out = lse_view(*p.lse_out, "lse_out", p.lse_layout, false, H, T);
  return pr;
}

GatherCacheProblem validate_gather_cache(const GatherCacheParams& p) {
  GatherCacheProblem pr;
  pr.device = common_device({{"cache", &p.cache}, {"block_table", &p.block_table}, {"seqused_k", &p.seqused_k},
                             {"cu_seqlens_q", p.cu_seqlens_q ? &*p.cu_seqlens_q : nullptr}, {"dst", &p.dst},
                             {"cu_seqlens_dst", &p.cu_seqlens_dst}});
  check_rank(p.cache, "cache", 3, "[num_blocks, block_size, width]");
  check_layout(p.cache, "cache");
  pr.num_blocks = p.cache.size(0);
  pr.block_size = p.cache.size(1);
  pr.width = p.cache.size(2);
  if (pr.block_size < 1) fail_arg("cache", "block_size >= 1 in dim 1", p.cache.shape_str());

  check_dtype(p.block_table, "block_table", {DType::i32});
  check_rank(p.block_table, "block_table", 2, "[B, max_blocks]");
  check_non_negative_strides(p.block_table, "block_table");
  check_data(p.block_table, "block_table");
  pr.batch = p.block_table.size(0);
  check_index(p.seqused_k, "seqused_k", {pr.batch}, "[B] as block_table");
  if (p.cu_seqlens_q) check_index(*p.cu_seqlens_q, "cu_seqlens_q", {pr.batch + 1}, "[B + 1] as block_table");

  check_dtype_as(p.dst, "dst", p.cache.dtype, "as cache");
  check_rank(p.dst, "dst", 2, "[rows, width]");
  check_dim(p.dst, "dst", 1, pr.width, "width of cache");
  check_layout(p.dst, "dst");
  check_index(p.cu_seqlens_dst, "cu_seqlens_dst", {pr.batch + 1}, "[B + 1] as block_table");

  if (p.token_begin < 0) fail_arg("token_begin", "a value >= 0", p.token_begin);
  if (p.token_end < p.token_begin) fail_arg("token_end", cat("a value >= token_begin=", p.token_begin), p.token_end);
  pr.token_begin = p.token_begin;
  pr.token_end = p.token_end;
  pr.cache = p.cache;
  pr.block_table = p.block_table;
  pr.seqused_k = p.seqused_k;
  pr.cu_seqlens_q = p.cu_seqlens_q;
  pr.dst = p.dst;
  pr.cu_seqlens_dst = p.cu_seqlens_dst;
  return pr;
}

void check_gather_contents(const GatherCacheProblem& pr) {
  const int64_t max_blocks = pr.block_table.size(1), bs = pr.block_size;
  int64_t total = 0;
  for (int64_t b = 0; b < pr.batch; ++b) {
    const int64_t len = read_index(pr.seqused_k, b);
    if (len < 0) fail_arg("seqused_k", "lengths >= 0", cat(len, " at index ", b));
    if (pr.cu_seqlens_q && read_index(*pr.cu_seqlens_q, b + 1) < read_index(*pr.cu_seqlens_q, b))
      fail_arg("cu_seqlens_q", "non-decreasing offsets",
               cat(read_index(*pr.cu_seqlens_q, b), " then ", read_index(*pr.cu_seqlens_q, b + 1), " at index ", b));
    const TokenRange r = gather_range(pr, b);
    if (r.hi == r.lo) continue;
    const int64_t last = (r.hi - 1) / bs;
    if (last >= max_blocks)
      fail_arg("block_table", cat("at least ", last + 1, " columns (request ", b, " reads token ", r.hi - 1, ")"),
               pr.block_table.shape_str());
    for (int64_t i = r.lo / bs; i <= last; ++i) {
      const int64_t block = read_index2(pr.block_table, b, i);
      if (block < 0 || block >= pr.num_blocks)
        fail_arg("block_table", cat("block indices in [0, ", pr.num_blocks, ")"),
                 cat("block_table[", b, "][", i, "]=", block));
    }
    total += r.hi - r.lo;
  }
  if (pr.dst.size(0) < total)
    fail_arg("dst", cat("at least ", total, " rows (the gathered tokens)"), pr.dst.shape_str());
  if (total > std::numeric_limits<int32_t>::max())
    fail_arg("cu_seqlens_dst", "int32 row offsets", cat(total, " rows in all"));
}

}  // namespace flashserve::detail
