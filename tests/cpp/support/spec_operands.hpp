// Test support for the tree-speculation metadata operations (spec_metadata.hpp), shared by the
// CPU and GPU tests: random cases with padded (strided) tables, outputs poisoned (page tables
// over a wider, padded buffer so that untouched columns show), and loop oracles written from
// SGLang's torch formulation (sort keys, repeat_interleave, concatenation by length).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "flashserve/spec_metadata.hpp"
#include "support/host_tensor.hpp"

namespace fstest {

// The three outputs of every operation.
struct SpecOutputs {
  HostTensor page_table, cache_seqlens, cu_seqlens_k;
};
// page_table int32 [rows, cols] over a padded buffer, lengths [rows], offsets [rows + 1]; all
// poisoned (-1).
SpecOutputs spec_outputs(int64_t rows, int64_t cols);

struct DraftExpandCase {
  HostTensor out_cache_loc;  // [R, num_steps], int32 or int64, padded rows
  int64_t decode_length = 1;
  SpecOutputs out;
  flashserve::SpecDraftExpandParams params() const;
};
DraftExpandCase make_draft_expand(std::mt19937_64& rng, int64_t rows, int64_t steps, DType loc_dtype);

struct VerifyExpandCase {
  HostTensor custom_mask;  // u8, exactly as long as the rows read
  HostTensor req_to_token, req_pool_indices, seq_lens;
  int64_t drafts = 1;
  std::optional<int64_t> mask_rows;
  SpecOutputs out;
  flashserve::SpecVerifyExpandParams params() const;
};
// B requests of n drafts; with `padded`, mask_rows < B * n (a padded graph batch) at random.
VerifyExpandCase make_verify_expand(std::mt19937_64& rng, int64_t batch, int64_t drafts, DType index_dtype,
                                    bool padded);

struct WindowCase {
  HostTensor page_table_a, page_table_b, seq_len_a, seq_len_b;
  int64_t drafts = 1;
  SpecOutputs out;
  flashserve::SpecWindowPageTableParams params() const;
};
// Lengths up to two past each source table's width (those entries read 0), a page table wide
// enough for every row.
WindowCase make_window(std::mt19937_64& rng, int64_t batch, int64_t drafts, int64_t len_a, int64_t len_b);

// The oracles: expected outputs as int32 rows, -1 where the column stays untouched.
struct SpecExpected {
  std::vector<std::vector<int32_t>> page_table;
  std::vector<int32_t> cache_seqlens, cu_seqlens_k;
};
SpecExpected oracle(const DraftExpandCase& c);
SpecExpected oracle(const VerifyExpandCase& c);
SpecExpected oracle(const WindowCase& c);

// Number of differences between the outputs and `want` (the page table over its full width:
// untouched columns must still hold the poison), with the first described in `first`.
int64_t compare_outputs(const SpecOutputs& got, const SpecExpected& want, std::string& first);

}  // namespace fstest
