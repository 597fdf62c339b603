// Chunked local attention as virtual batches (SPEC.md §6): a request whose queries span
// several chunks of absolute positions becomes one virtual request per chunk touched, each
// causal over its own chunk only. Pure functions on host arrays; the metadata builder calls
// them into its fixed buffers.
//
// Request r has q = q_len(r) queries at absolute positions [k - q, k), k = seq_lens[r]. The
// virtual request of chunk c (touched by some query) covers
//   keys    [c * C, min((c + 1) * C, k))                   -> k_start, seqused_k
//   queries max(c * C, k - q) .. min((c + 1) * C, k) - 1   -> cu_seqlens_q
// so its queries are the last ones of its keys (bottom-right causal alignment holds), and
// query position p sees exactly keys [p / C * C, p]: the chunked-local mask.
//
// Example (SPEC.md §6), C = 4, q lens [4, 10, 5], k lens [6, 17, 9]:
//   local q lens [2, 2, 1, 4, 4, 1, 4, 1], local k lens [4, 2, 4, 4, 4, 1, 4, 1],
//   k starts [0, 4, 4, 8, 12, 16, 4, 8].
#pragma once

#include <cstdint>
#include <span>

namespace flashserve::planner {

// Number of virtual requests: one per (request, chunk) holding at least one query.
// query_start_loc [R + 1], seq_lens [R]; throws Error naming seq_lens when a KV length is
// shorter than its query length, attention_chunk_size when chunk < 1.
int64_t count_local_virtual_requests(std::span<const int32_t> query_start_loc,
                                     std::span<const int32_t> seq_lens, int64_t chunk);

// Output arrays of make_local_virtual_batch, each with room for the virtual requests.
struct LocalVirtualBatch {
  std::span<int32_t> cu_seqlens_q;  // [V + 1], over the batch's query rows (starts at 0)
  std::span<int32_t> seqused_k;     // [V]: keys of the virtual request
  std::span<int32_t> k_start;       // [V]: absolute position of its first key (a multiple of C)
  std::span<int32_t> request;       // [V]: the request it came from
};

// Writes the virtual batch and returns V. Validates first (as count_local_virtual_requests,
// and that the outputs can hold V: Error naming the output), then writes.
int64_t make_local_virtual_batch(std::span<const int32_t> query_start_loc, std::span<const int32_t> seq_lens,
                                 int64_t chunk, const LocalVirtualBatch& out);

// A host int32 block table [rows, cols] with a free row stride.
struct HostBlockTable {
  const int32_t* data = nullptr;
  int64_t rows = 0, cols = 0, row_stride = 0;
};

// The virtual block table [V, width] (row stride `width`): row v is row request[v] of `table`
// from column k_start[v] / block_size on; columns past the source row's end are 0. Requires
// every k_start to be a multiple of block_size (chunk % block_size == 0).
void gather_local_block_table(const HostBlockTable& table, int64_t block_size, std::span<const int32_t> k_start,
                              std::span<const int32_t> request, int64_t num_virtual, std::span<int32_t> out,
                              int64_t width);

}  // namespace flashserve::planner
