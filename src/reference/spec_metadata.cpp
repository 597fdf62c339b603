#include "reference/spec_metadata.hpp"

#include <cstdint>

#include "common/check.hpp"

namespace flashserve::reference {

namespace {

void put(const TensorRef& t, int64_t i, int64_t v) { *static_cast<int32_t*>(t.at(i)) = int32_t(v); }
void put2(const TensorRef& t, int64_t i, int64_t j, int64_t v) { *static_cast<int32_t*>(t.at(i, j)) = int32_t(v); }

// cu[0] = 0, cu[r + 1] = Σ_{r' <= r} lens[r'] (int32 lengths already written).
void offsets_of(const TensorRef& lens, const TensorRef& cu) {
  int64_t sum = 0;
  put(cu, 0, 0);
  for (int64_t r = 0; r < lens.size(0); ++r) {
    sum += detail::read_index(lens, r);
    put(cu, r + 1, sum);
  }
}

// The draft rows b * n .. b * n + n - 1 of request b, whose mask starts at custom_mask[mask_at]
// (rows past mask_rows read every bit from custom_mask[0]).
void verify_request(const detail::VerifyExpandProblem& pr, int64_t b, int64_t mask_at) {
  const int64_t n = pr.drafts, len = detail::read_index(pr.seq_lens, b);
  const int64_t req = detail::read_index(pr.req_pool_indices, b);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = b * n + i;
    const auto visible = [&](int64_t j) {
      const int64_t at = r < pr.mask_rows ? mask_at + i * (len + n) + len + j : 0;
      return *static_cast<const uint8_t*>(pr.custom_mask.at(at)) != 0;
    };
    int64_t k = 0;
    for (const bool shown : {true, false}) {  // the visible drafts, then the hidden ones
      for (int64_t j = 0; j < n; ++j)
        if (visible(j) == shown) put2(pr.page_table, r, k++, detail::read_index2(pr.req_to_token, req, len + j));
      if (shown) put(pr.cache_seqlens, r, k);
    }
  }
}

}  // namespace

void spec_draft_expand(const detail::DraftExpandProblem& pr) {
  for (int64_t r = 0; r < pr.rows; ++r) {
    for (int64_t c = 0; c < pr.decode_length; ++c)
      put2(pr.page_table, r, c, detail::read_index2(pr.out_cache_loc, r, c));
    put(pr.cache_seqlens, r, pr.decode_length);
  }
  for (int64_t r = 0; r <= pr.rows; ++r) put(pr.cu_seqlens_k, r, r * pr.decode_length);
}

void spec_verify_expand(const detail::VerifyExpandProblem& pr) {
  int64_t mask_at = 0;
  for (int64_t b = 0; b < pr.batch; ++b) {
    verify_request(pr, b, mask_at);
    mask_at += pr.drafts * (detail::read_index(pr.seq_lens, b) + pr.drafts);
  }
  offsets_of(pr.cache_seqlens, pr.cu_seqlens_k);
}

void spec_window_page_table(const detail::WindowPageTableProblem& pr) {
  const int64_t len_a = pr.page_table_a.size(1), len_b = pr.page_table_b.size(1);
  for (int64_t r = 0; r < pr.batch * pr.drafts; ++r) {
    const int64_t b = r / pr.drafts;
    const int64_t la = detail::read_index(pr.seq_len_a, b), lb = detail::read_index(pr.seq_len_b, r);
    for (int64_t c = 0; c < la; ++c) put2(pr.page_table, r, c, c < len_a ? detail::read_index2(pr.page_table_a, b, c) : 0);
    for (int64_t c = 0; c < lb; ++c) put2(pr.page_table, r, la + c, c < len_b ? detail::read_index2(pr.page_table_b, r, c) : 0);
    put(pr.cache_seqlens, r, la + lb);
  }
  offsets_of(pr.cache_seqlens, pr.cu_seqlens_k);
}

}  // namespace flashserve::reference
