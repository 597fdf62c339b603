#include "support/spec_operands.hpp"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <string>

#include "support/checks.hpp"

namespace fstest {

namespace {

void* at(const HostTensor& t, std::initializer_list<int64_t> idx) {
  const int64_t* i = idx.begin();
  return idx.size() == 1 ? t.ref.at(i[0]) : t.ref.at(i[0], i[1]);
}
int64_t get_i(const HostTensor& t, std::initializer_list<int64_t> idx) {
  const void* p = at(t, idx);
  return t.ref.dtype == DType::i64 ? *static_cast<const int64_t*>(p) : int64_t(*static_cast<const int32_t*>(p));
}
void set_i(const HostTensor& t, std::initializer_list<int64_t> idx, int64_t v) {
  void* p = at(t, idx);
  if (t.ref.dtype == DType::i64) *static_cast<int64_t*>(p) = v;
  else *static_cast<int32_t*>(p) = int32_t(v);
}

// An index tensor [n] (int32 or int64) holding `v`.
HostTensor index_vector(const std::vector<int64_t>& v, DType dtype) {
  HostTensor t = HostTensor::zeros(dtype, {int64_t(v.size())});
  for (size_t i = 0; i < v.size(); ++i) set_i(t, {int64_t(i)}, v[i]);
  return t;
}

// An int32 [rows, cols] table over a padded buffer, random values in [0, hi].
HostTensor random_table(std::mt19937_64& rng, int64_t rows, int64_t cols, int64_t hi, DType dtype = DType::i32) {
  HostTensor t = padded_poisoned(dtype, {rows, cols});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) set_i(t, {r, c}, uniform_int(rng, 0, hi));
  return t;
}

std::vector<int32_t> running_sum(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t r = 0; r < lens.size(); ++r) cu[r + 1] = cu[r] + lens[r];
  return cu;
}

}  // namespace

SpecOutputs spec_outputs(int64_t rows, int64_t cols) {
  SpecOutputs o;
  o.page_table = padded_poisoned(DType::i32, {rows, cols + 2});  // two untouched columns past the view
  o.page_table.ref = o.page_table.ref.slice(1, 0, cols);
  o.cache_seqlens = padded_poisoned(DType::i32, {rows});
  o.cu_seqlens_k = padded_poisoned(DType::i32, {rows + 1});
  return o;
}

flashserve::SpecDraftExpandParams DraftExpandCase::params() const {
  flashserve::SpecDraftExpandParams p;
  p.out_cache_loc = out_cache_loc, p.decode_length = decode_length;
  p.page_table = out.page_table, p.cache_seqlens = out.cache_seqlens, p.cu_seqlens_k = out.cu_seqlens_k;
  return p;
}

DraftExpandCase make_draft_expand(std::mt19937_64& rng, int64_t rows, int64_t steps, DType loc_dtype) {
  DraftExpandCase c;
  c.out_cache_loc = random_table(rng, rows, steps, 1 << 30, loc_dtype);
  c.decode_length = uniform_int(rng, 1, steps);
  c.out = spec_outputs(rows, c.decode_length + uniform_int(rng, 0, 2));
  return c;
}

flashserve::SpecVerifyExpandParams VerifyExpandCase::params() const {
  flashserve::SpecVerifyExpandParams p;
  p.custom_mask = custom_mask, p.req_to_token = req_to_token, p.req_pool_indices = req_pool_indices;
  p.seq_lens = seq_lens, p.num_draft_tokens = drafts, p.mask_rows = mask_rows;
  p.page_table = out.page_table, p.cache_seqlens = out.cache_seqlens, p.cu_seqlens_k = out.cu_seqlens_k;
  return p;
}

VerifyExpandCase make_verify_expand(std::mt19937_64& rng, int64_t batch, int64_t drafts, DType index_dtype,
                                    bool padded) {
  VerifyExpandCase c;
  c.drafts = drafts;
  const int64_t pool = batch + 3, max_len = 24, cols = max_len + drafts + uniform_int(rng, 0, 3);
  c.req_to_token = random_table(rng, pool, cols, 1 << 20);
  std::vector<int64_t> rows_of(static_cast<size_t>(pool)), lens(static_cast<size_t>(batch));
  std::iota(rows_of.begin(), rows_of.end(), 0);
  std::shuffle(rows_of.begin(), rows_of.end(), rng);
  rows_of.resize(size_t(batch));
  for (int64_t& l : lens) l = uniform_int(rng, 0, max_len);
  c.req_pool_indices = index_vector(rows_of, index_dtype);
  c.seq_lens = index_vector(lens, index_dtype);
  const int64_t rows = batch * drafts;
  if (padded) c.mask_rows = uniform_int(rng, 0, rows);
  const int64_t own = c.mask_rows.value_or(rows);
  int64_t at = 0, end = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t mine = std::clamp<int64_t>(own - b * drafts, 0, drafts);
    if (mine > 0) end = at + mine * (lens[size_t(b)] + drafts);
    at += drafts * (lens[size_t(b)] + drafts);
  }
  c.custom_mask = HostTensor::zeros(DType::u8, {std::max<int64_t>(end, 1)});
  for (int64_t i = 0; i < c.custom_mask.ref.numel(); ++i)
    static_cast<uint8_t*>(c.custom_mask.ref.data)[i] = uint8_t(uniform_int(rng, 0, 2) != 0);  // 2/3 shown
  c.out = spec_outputs(rows, drafts + uniform_int(rng, 0, 2));
  return c;
}

flashserve::SpecWindowPageTableParams WindowCase::params() const {
  flashserve::SpecWindowPageTableParams p;
  p.page_table_a = page_table_a, p.page_table_b = page_table_b, p.seq_len_a = seq_len_a, p.seq_len_b = seq_len_b;
  p.num_draft_tokens = drafts;
  p.page_table = out.page_table, p.cache_seqlens = out.cache_seqlens, p.cu_seqlens_k = out.cu_seqlens_k;
  return p;
}

WindowCase make_window(std::mt19937_64& rng, int64_t batch, int64_t drafts, int64_t len_a, int64_t len_b) {
  WindowCase c;
  c.drafts = drafts;
  const int64_t rows = batch * drafts;
  c.page_table_a = random_table(rng, batch, len_a, 1 << 20);
  c.page_table_b = random_table(rng, rows, len_b, 1 << 20);
  std::vector<int64_t> la(static_cast<size_t>(batch)), lb(static_cast<size_t>(rows));
  for (int64_t& l : la) l = uniform_int(rng, 0, len_a + 2);
  for (int64_t& l : lb) l = uniform_int(rng, 0, len_b + 2);
  c.seq_len_a = index_vector(la, DType::i32);
  c.seq_len_b = index_vector(lb, DType::i32);
  c.out = spec_outputs(rows, len_a + len_b + 4);
  return c;
}

SpecExpected oracle(const DraftExpandCase& c) {
  const int64_t rows = c.out_cache_loc.ref.size(0), cols = c.out.page_table.ref.size(1);
  SpecExpected e;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> row(static_cast<size_t>(cols), -1);
    for (int64_t k = 0; k < c.decode_length; ++k) row[size_t(k)] = int32_t(get_i(c.out_cache_loc, {r, k}));
    e.page_table.push_back(row);
    e.cache_seqlens.push_back(int32_t(c.decode_length));
  }
  e.cu_seqlens_k = running_sum(e.cache_seqlens);
  return e;
}

// SGLang's formulation: cum_len over the draft rows of (seq_len + n), mask indices
// cols + cum_len (zeroed from mask_rows on), sort keys j or j + n, gather of the sorted order.
SpecExpected oracle(const VerifyExpandCase& c) {
  const int64_t n = c.drafts, batch = c.seq_lens.ref.size(0), rows = batch * n;
  const int64_t cols = c.out.page_table.ref.size(1), own = c.mask_rows.value_or(rows);
  SpecExpected e;
  int64_t cum_len = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / n, len = get_i(c.seq_lens, {b}), req = get_i(c.req_pool_indices, {b});
    std::vector<int64_t> keys(static_cast<size_t>(n)), order(static_cast<size_t>(n));
    int32_t shown = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t idx = r < own ? len + j + cum_len : 0;
      const bool m = static_cast<const uint8_t*>(c.custom_mask.ref.data)[idx] != 0;
      keys[size_t(j)] = m ? j : j + n;
      shown += m;
    }
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return keys[size_t(x)] < keys[size_t(y)]; });
    std::vector<int32_t> row(static_cast<size_t>(cols), -1);
    for (int64_t k = 0; k < n; ++k) row[size_t(k)] = int32_t(get_i(c.req_to_token, {req, len + order[size_t(k)]}));
    e.page_table.push_back(row);
    e.cache_seqlens.push_back(shown);
    cum_len += len + n;
  }
  e.cu_seqlens_k = running_sum(e.cache_seqlens);
  return e;
}

// The Triton kernel's formulation: per column, a masked load from a (c < la) or b.
SpecExpected oracle(const WindowCase& c) {
  const int64_t n = c.drafts, rows = c.seq_len_b.ref.size(0), cols = c.out.page_table.ref.size(1);
  const int64_t len_a = c.page_table_a.ref.size(1), len_b = c.page_table_b.ref.size(1);
  SpecExpected e;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t la = get_i(c.seq_len_a, {r / n}), lb = get_i(c.seq_len_b, {r});
    std::vector<int32_t> row(static_cast<size_t>(cols), -1);
    for (int64_t k = 0; k < la + lb; ++k) {
      const bool in_a = k < la;
      const bool loads = in_a ? k < len_a : k - la < len_b;
      row[size_t(k)] = !loads ? 0 : int32_t(in_a ? get_i(c.page_table_a, {r / n, k}) : get_i(c.page_table_b, {r, k - la}));
    }
    e.page_table.push_back(row);
    e.cache_seqlens.push_back(int32_t(la + lb));
  }
  e.cu_seqlens_k = running_sum(e.cache_seqlens);
  return e;
}

int64_t compare_outputs(const SpecOutputs& got, const SpecExpected& want, std::string& first) {
  Mismatches m;
  const auto check = [&](const char* what, int64_t i, int64_t j, int64_t g, int64_t w) {
    std::ostringstream os;
    os << what << "[" << i << "]" << (j >= 0 ? "[" + std::to_string(j) + "]" : "") << " = " << g << ", want " << w;
    m.check(g == w, os.str());
  };
  for (size_t r = 0; r < want.page_table.size(); ++r)
    for (size_t k = 0; k < want.page_table[r].size(); ++k)
      check("page_table", int64_t(r), int64_t(k), get_i(got.page_table, {int64_t(r), int64_t(k)}), want.page_table[r][k]);
  for (size_t r = 0; r < want.cache_seqlens.size(); ++r)
    check("cache_seqlens", int64_t(r), -1, get_i(got.cache_seqlens, {int64_t(r)}), want.cache_seqlens[r]);
  for (size_t r = 0; r < want.cu_seqlens_k.size(); ++r)
    check("cu_seqlens_k", int64_t(r), -1, get_i(got.cu_seqlens_k, {int64_t(r)}), want.cu_seqlens_k[r]);
  first = m.first;
  return m.count;
}

}  // namespace fstest
