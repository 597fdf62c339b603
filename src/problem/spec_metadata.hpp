// The validated forms of the tree-speculation metadata operations (spec_metadata.hpp): what
// validation (api/validate_spec_metadata) produces and what the CPU reference and the CUDA
// kernels consume.
#pragma once

#include <cstdint>

#include "flashserve/tensor.hpp"

namespace flashserve::detail {

// spec_draft_expand after validation.
struct DraftExpandProblem {
  int64_t rows = 0, decode_length = 0;  // R, columns written
  Device device{};
  TensorRef out_cache_loc;  // int32/int64 [R, num_steps]
  TensorRef page_table;     // int32 [R, >= decode_length]
  TensorRef cache_seqlens;  // int32 [R]
  TensorRef cu_seqlens_k;   // int32 [R + 1]
};

// spec_verify_expand after validation.
struct VerifyExpandProblem {
  int64_t batch = 0, drafts = 0, mask_rows = 0;  // B, n, draft rows reading their own mask
  Device device{};
  TensorRef custom_mask;       // u8/i8 [mask_len]
  TensorRef req_to_token;      // int32 [pool, max_context]
  TensorRef req_pool_indices;  // int32/int64 [B]
  TensorRef seq_lens;          // int32/int64 [B]
  TensorRef page_table;        // int32 [B * n, >= n]
  TensorRef cache_seqlens;     // int32 [B * n]
  TensorRef cu_seqlens_k;      // int32 [B * n + 1]
};

// spec_window_page_table after validation.
struct WindowPageTableProblem {
  int64_t batch = 0, drafts = 0;  // B, n
  Device device{};
  TensorRef page_table_a;   // int32 [B, LEN_A]
  TensorRef page_table_b;   // int32 [B * n, LEN_B]
  TensorRef seq_len_a;      // int32 [B]
  TensorRef seq_len_b;      // int32 [B * n]
  TensorRef page_table;     // int32 [B * n, width]
  TensorRef cache_seqlens;  // int32 [B * n]
  TensorRef cu_seqlens_k;   // int32 [B * n + 1]
};

}  // namespace flashserve::detail
