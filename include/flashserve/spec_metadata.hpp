// The metadata of speculative decoding with a draft tree (top-k > 1 branches per request), for
// the two-pass attention of SPEC.md §6: a pass over each request's committed prefix through its
// page table, and an "expand" pass in which every draft query attends to its own branch's draft
// tokens through a page table of token slots (page size 1), the two merged by LSE.
//
// Each operation fills caller-owned int32 buffers (a CUDA graph's fixed buffers, updated in
// place on replay): on CUDA one short launch sequence on ctx.stream, no allocation, no host
// synchronization. Each validates shapes, dtypes and devices first (flashserve::Error naming
// the argument, nothing written); on the CPU the contents that index memory are checked too.
// On CUDA those contents stay on the device: an index out of range reads as 0 (a mask bit as
// false), never accessed.
#pragma once

#include <cstdint>
#include <optional>

#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve {

// ---------------------------------------------------------------- draft decode, expand pass
// Draft step `decode_length - 1` of R = batch * topk branches, each having written one draft
// token per earlier step: branch r attends to the first decode_length slots of its row.
//   page_table[r][c] = int32(out_cache_loc[r][c])  for c < decode_length (other columns untouched)
//   cache_seqlens[r] = decode_length;  cu_seqlens_k[r] = r * decode_length  (r <= R)
struct SpecDraftExpandParams {
  TensorRef out_cache_loc;  // int32/int64 [R, num_steps]: each branch's draft slots, step order
  int64_t decode_length = 1;  // in [1, num_steps]
  TensorRef page_table;     // int32 [R, >= decode_length] (row stride free), written
  TensorRef cache_seqlens;  // int32 [R], written
  TensorRef cu_seqlens_k;   // int32 [R + 1], written
};
void spec_draft_expand(const SpecDraftExpandParams& p, const ExecContext& ctx = {});

// ---------------------------------------------------------------- target verify, expand pass
// Request b verifies n draft tokens at positions L_b .. L_b + n - 1 (L_b = seq_lens[b]); its
// tree mask is row-major [n, L_b + n] (bool bytes), requests' masks concatenated in order.
// Draft row r = b * n + i keeps the draft tokens its mask row shows, in draft order, then the
// hidden ones (so the first cache_seqlens[r] entries are the visible ones):
//   visible(j) = custom_mask[M_b + i (L_b + n) + L_b + j] != 0,  M_b = Σ_{b' < b} n (L_b' + n)
//   page_table[r][k] = req_to_token[req_pool_indices[b]][L_b + j_k],  k < n (other columns
//     untouched), j_0 < j_1 < .. the visible j, then the hidden j
//   cache_seqlens[r] = #visible;  cu_seqlens_k = [0, cumsum(cache_seqlens)]
// A padded CUDA-graph batch sets mask_rows: draft rows r >= mask_rows (the padding) read every
// mask bit from custom_mask[0] (their masks are absent); M_b still counts every request.
struct SpecVerifyExpandParams {
  TensorRef custom_mask;       // u8/i8 [>= Σ n (L_b + n)]: the requests' tree masks, flattened
  TensorRef req_to_token;      // int32 [pool, max_context] (row stride free): token slots
  TensorRef req_pool_indices;  // int32/int64 [B]
  TensorRef seq_lens;          // int32/int64 [B]: committed tokens before the drafts
  int64_t num_draft_tokens = 1;              // n >= 1
  std::optional<int64_t> mask_rows;          // in [0, B * n]; absent: B * n
  TensorRef page_table;        // int32 [B * n, >= n] (row stride free), written
  TensorRef cache_seqlens;     // int32 [B * n], written
  TensorRef cu_seqlens_k;      // int32 [B * n + 1], written
};
void spec_verify_expand(const SpecVerifyExpandParams& p, const ExecContext& ctx = {});

// ---------------------------------------------------------------- sliding window, verify
// Sliding-window layers under tree verify attend, per draft row r = b * n + i, to the prefix
// then the row's visible draft tokens as one causal sequence: the prefix row of request b,
// then the expand row r, concatenated by their lengths (la = seq_len_a[b], lb = seq_len_b[r]):
//   page_table[r][c] = c < la      ? (c < LEN_A ? page_table_a[b][c] : 0)
//                    : c < la + lb ? (c - la < LEN_B ? page_table_b[r][c - la] : 0)
//   for c < la + lb (the other columns untouched; la + lb must fit page_table's width)
//   cache_seqlens[r] = la + lb;  cu_seqlens_k = [0, cumsum(cache_seqlens)]
struct SpecWindowPageTableParams {
  TensorRef page_table_a;   // int32 [B, LEN_A] (row stride free): the prefix pass's page table
  TensorRef page_table_b;   // int32 [B * n, LEN_B] (row stride free): the expand pass's
  TensorRef seq_len_a;      // int32 [B]
  TensorRef seq_len_b;      // int32 [B * n]
  int64_t num_draft_tokens = 1;  // n >= 1
  TensorRef page_table;     // int32 [B * n, width] (row stride free), written
  TensorRef cache_seqlens;  // int32 [B * n], written
  TensorRef cu_seqlens_k;   // int32 [B * n + 1], written
};
void spec_window_page_table(const SpecWindowPageTableParams& p, const ExecContext& ctx = {});

}  // namespace flashserve
