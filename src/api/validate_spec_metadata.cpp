#include "api/validate_spec_metadata.hpp"

#include <algorithm>
#include <limits>
#include <string_view>

#include "common/check.hpp"
#include "flashserve/status.hpp"

namespace flashserve::detail {

namespace {

constexpr std::initializer_list<DType> kIndex = {DType::i32, DType::i64};

// A 1-D or 2-D operand of `dtypes` shaped `shape` (-1: any), non-negative strides, data.
void check_table(const TensorRef& t, Arg arg, std::initializer_list<DType> dtypes,
                 std::initializer_list<int64_t> shape, std::string_view what) {
  check_dtype(t, arg, dtypes);
  check_rank(t, arg, int(shape.size()), what);
  check_shape(t, arg, shape, what);
  check_non_negative_strides(t, arg);
  check_data(t, arg);
}

// The three outputs every operation here writes, checked and taken into its problem: an int32
// page table [rows, >= min_cols] (`table_shape` describes it), int32 lengths [rows] and their
// int32 offsets [rows + 1].
template <class Params, class Problem>
void take_outputs(const Params& p, Problem& pr, int64_t rows, int64_t min_cols, std::string_view table_shape,
                  std::string_view rows_name) {
  check_table(p.page_table, "page_table", {DType::i32}, {rows, -1}, table_shape);
  if (p.page_table.size(1) < min_cols)
    fail_arg("page_table", cat("at least ", min_cols, " columns (", table_shape, ")"), p.page_table.shape_str());
  check_table(p.cache_seqlens, "cache_seqlens", {DType::i32}, {rows}, cat("[", rows_name, "]"));
  check_table(p.cu_seqlens_k, "cu_seqlens_k", {DType::i32}, {rows + 1}, cat("[", rows_name, " + 1]"));
  pr.page_table = p.page_table;
  pr.cache_seqlens = p.cache_seqlens;
  pr.cu_seqlens_k = p.cu_seqlens_k;
}

void check_draft_count(int64_t n) {
  if (n < 1) fail_arg("num_draft_tokens", "a value >= 1", n);
}

}  // namespace

DraftExpandProblem validate_spec_draft_expand(const SpecDraftExpandParams& p) {
  DraftExpandProblem pr;
  pr.device = common_device({{"out_cache_loc", &p.out_cache_loc}, {"page_table", &p.page_table},
                             {"cache_seqlens", &p.cache_seqlens}, {"cu_seqlens_k", &p.cu_seqlens_k}});
  check_table(p.out_cache_loc, "out_cache_loc", kIndex, {-1, -1}, "[R, num_steps]");
  pr.rows = p.out_cache_loc.size(0);
  const int64_t steps = p.out_cache_loc.size(1);
  if (p.decode_length < 1 || p.decode_length > steps)
    fail_arg("decode_length", cat("a value in [1, ", steps, "] (num_steps = out_cache_loc's dim 1)"), p.decode_length);
  pr.decode_length = p.decode_length;
  take_outputs(p, pr, pr.rows, pr.decode_length, "[R, >= decode_length] with R of out_cache_loc", "R");
  pr.out_cache_loc = p.out_cache_loc;
  return pr;
}

VerifyExpandProblem validate_spec_verify_expand(const SpecVerifyExpandParams& p) {
  VerifyExpandProblem pr;
  pr.device = common_device({{"custom_mask", &p.custom_mask}, {"req_to_token", &p.req_to_token},
                             {"req_pool_indices", &p.req_pool_indices}, {"seq_lens", &p.seq_lens},
                             {"page_table", &p.page_table}, {"cache_seqlens", &p.cache_seqlens},
                             {"cu_seqlens_k", &p.cu_seqlens_k}});
  check_table(p.custom_mask, "custom_mask", {DType::u8, DType::i8}, {-1}, "[mask_len] (bool bytes)");
  check_table(p.req_to_token, "req_to_token", {DType::i32}, {-1, -1}, "[pool, max_context]");
  check_table(p.req_pool_indices, "req_pool_indices", kIndex, {-1}, "[B]");
  pr.batch = p.req_pool_indices.size(0);
  check_table(p.seq_lens, "seq_lens", kIndex, {pr.batch}, "[B] as req_pool_indices");
  check_draft_count(p.num_draft_tokens);
  pr.drafts = p.num_draft_tokens;
  const int64_t rows = pr.batch * pr.drafts;
  pr.mask_rows = p.mask_rows.value_or(rows);
  if (pr.mask_rows < 0 || pr.mask_rows > rows) fail_arg("mask_rows", cat("a value in [0, ", rows, "] (B * n)"), pr.mask_rows);
  take_outputs(p, pr, rows, pr.drafts, "[B * n, >= n]", "B * n");
  pr.custom_mask = p.custom_mask;
  pr.req_to_token = p.req_to_token;
  pr.req_pool_indices = p.req_pool_indices;
  pr.seq_lens = p.seq_lens;
  return pr;
}

void check_verify_expand_contents(const VerifyExpandProblem& pr) {
  const int64_t n = pr.drafts, pool = pr.req_to_token.size(0), cols = pr.req_to_token.size(1);
  const int64_t mask_len = pr.custom_mask.size(0);
  int64_t mask_at = 0, mask_end = 0;  // M_b; one past the last element read
  for (int64_t b = 0; b < pr.batch; ++b) {
    const int64_t req = read_index(pr.req_pool_indices, b), len = read_index(pr.seq_lens, b);
    if (req < 0 || req >= pool)
      fail_arg("req_pool_indices", cat("indices in [0, ", pool, ") (rows of req_to_token)"), cat(req, " at index ", b));
    if (len < 0 || len + n > cols)
      fail_arg("seq_lens", cat("lengths in [0, ", cols - n, "] (the drafts inside req_to_token's ", cols, " columns)"),
               cat(len, " at index ", b));
    const int64_t own_rows = std::clamp<int64_t>(pr.mask_rows - b * n, 0, n);
    if (own_rows > 0) mask_end = mask_at + own_rows * (len + n);
    mask_at += n * (len + n);
  }
  const bool reads_first = pr.mask_rows < pr.batch * n;
  if (mask_len < mask_end || (reads_first && mask_len < 1))
    fail_arg("custom_mask", cat("at least ", reads_first ? std::max<int64_t>(mask_end, 1) : mask_end,
                                " elements (n * (seq_len + n) per request)"), pr.custom_mask.shape_str());
}

WindowPageTableProblem validate_spec_window_page_table(const SpecWindowPageTableParams& p) {
  WindowPageTableProblem pr;
  pr.device = common_device({{"page_table_a", &p.page_table_a}, {"page_table_b", &p.page_table_b},
                             {"seq_len_a", &p.seq_len_a}, {"seq_len_b", &p.seq_len_b}, {"page_table", &p.page_table},
                             {"cache_seqlens", &p.cache_seqlens}, {"cu_seqlens_k", &p.cu_seqlens_k}});
  check_table(p.seq_len_a, "seq_len_a", {DType::i32}, {-1}, "[B]");
  pr.batch = p.seq_len_a.size(0);
  check_draft_count(p.num_draft_tokens);
  pr.drafts = p.num_draft_tokens;
  const int64_t rows = pr.batch * pr.drafts;
  check_table(p.seq_len_b, "seq_len_b", {DType::i32}, {rows}, "[B * n] with B of seq_len_a");
  check_table(p.page_table_a, "page_table_a", {DType::i32}, {pr.batch, -1}, "[B, LEN_A] with B of seq_len_a");
  check_table(p.page_table_b, "page_table_b", {DType::i32}, {rows, -1}, "[B * n, LEN_B]");
  take_outputs(p, pr, rows, 0, "[B * n, width]", "B * n");
  pr.page_table_a = p.page_table_a;
  pr.page_table_b = p.page_table_b;
  pr.seq_len_a = p.seq_len_a;
  pr.seq_len_b = p.seq_len_b;
  return pr;
}

void check_window_contents(const WindowPageTableProblem& pr) {
  const int64_t width = pr.page_table.size(1);
  int64_t total = 0;
  for (int64_t r = 0; r < pr.batch * pr.drafts; ++r) {
    const int64_t b = r / pr.drafts;
    const int64_t la = read_index(pr.seq_len_a, b), lb = read_index(pr.seq_len_b, r);
    if (la < 0) fail_arg("seq_len_a", "lengths >= 0", cat(la, " at index ", b));
    if (lb < 0) fail_arg("seq_len_b", "lengths >= 0", cat(lb, " at index ", r));
    if (la + lb > width)
      fail_arg("page_table", cat("at least ", la + lb, " columns (row ", r, ": seq_len_a ", la, " + seq_len_b ", lb, ")"),
               pr.page_table.shape_str());
    total += la + lb;
  }
  if (total > std::numeric_limits<int32_t>::max())
    fail_arg("cu_seqlens_k", "int32 offsets", cat(total, " keys in all"));
}

}  // namespace flashserve::detail
