// Chunked local attention: virtual requests per (request, chunk), see local_batches.hpp.
#include "planner/local_batches.hpp"

#include <algorithm>

#include "flashserve/status.hpp"

namespace flashserve::planner {

namespace {

// Queries of request r at absolute positions [first, end): first = k - q, end = k.
struct RequestSpan {
  int64_t first, end;
};

RequestSpan request_span(std::span<const int32_t> qsl, std::span<const int32_t> seq_lens, size_t r) {
  const int64_t q = int64_t(qsl[r + 1]) - qsl[r];
  const int64_t k = seq_lens[r];
  if (q < 0)
    fail_arg("query_start_loc", "non-decreasing entries",
             detail::cat("query_start_loc[", r + 1, "]=", qsl[r + 1], " < query_start_loc[", r, "]=", qsl[r]));
  if (k < q)
    fail_arg("seq_lens", detail::cat(">= the query length ", q, " of request ", r), detail::cat("seq_lens[", r, "]=", k));
  return {k - q, k};
}

void check_inputs(std::span<const int32_t> qsl, std::span<const int32_t> seq_lens, int64_t chunk) {
  if (chunk < 1) fail_arg("attention_chunk_size", ">= 1", chunk);
  if (qsl.size() != seq_lens.size() + 1)
    fail_arg("query_start_loc", detail::cat(seq_lens.size() + 1, " entries (num_reqs + 1)"), qsl.size());
}

// Chunks touched by queries [first, end): floor(first / C) .. floor((end - 1) / C).
int64_t chunks_touched(const RequestSpan& s, int64_t chunk) {
  return s.end > s.first ? (s.end - 1) / chunk - s.first / chunk + 1 : 0;
}

}  // namespace

int64_t count_local_virtual_requests(std::span<const int32_t> query_start_loc, std::span<const int32_t> seq_lens,
                                     int64_t chunk) {
  check_inputs(query_start_loc, seq_lens, chunk);
  int64_t v = 0;
  for (size_t r = 0; r < seq_lens.size(); ++r) v += chunks_touched(request_span(query_start_loc, seq_lens, r), chunk);
  return v;
}

int64_t make_local_virtual_batch(std::span<const int32_t> query_start_loc, std::span<const int32_t> seq_lens,
                                 int64_t chunk, const LocalVirtualBatch& out) {
  const int64_t nv = count_local_virtual_requests(query_start_loc, seq_lens, chunk);
  auto need = [&](std::span<int32_t> s, const char* name, int64_t n) {
    if (int64_t(s.size()) < n)
      fail_arg(name, detail::cat("room for ", n, " entries"), detail::cat(s.size(), " entries"));
  };
  need(out.cu_seqlens_q, "cu_seqlens_q", nv + 1);
  need(out.seqused_k, "seqused_k", nv);
  need(out.k_start, "k_start", nv);
  need(out.request, "request", nv);

  int64_t v = 0;
  out.cu_seqlens_q[0] = 0;
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    const RequestSpan s = request_span(query_start_loc, seq_lens, r);
    const int64_t n = chunks_touched(s, chunk);
    for (int64_t c = s.first / chunk, i = 0; i < n; ++c, ++i, ++v) {
      const int64_t k_begin = c * chunk;
      const int64_t k_end = std::min(k_begin + chunk, s.end);
      const int64_t q_first = std::max(k_begin, s.first);
      out.cu_seqlens_q[size_t(v) + 1] = int32_t(out.cu_seqlens_q[size_t(v)] + (k_end - q_first));
      out.seqused_k[size_t(v)] = int32_t(k_end - k_begin);
      out.k_start[size_t(v)] = int32_t(k_begin);
      out.request[size_t(v)] = int32_t(r);
    }
  }
  return nv;
}

void gather_local_block_table(const HostBlockTable& table, int64_t block_size, std::span<const int32_t> k_start,
                              std::span<const int32_t> request, int64_t num_virtual, std::span<int32_t> out,
                              int64_t width) {
  if (int64_t(out.size()) < num_virtual * width)
    fail_arg("block_table", detail::cat("room for ", num_virtual, " x ", width, " entries"), out.size());
  for (int64_t v = 0; v < num_virtual; ++v) {
    if (k_start[size_t(v)] % block_size != 0)
      fail_arg("attention_chunk_size", detail::cat("chunk starts at multiples of block_size ", block_size),
               detail::cat("a chunk starting at ", k_start[size_t(v)]));
    if (request[size_t(v)] < 0 || request[size_t(v)] >= table.rows)
      fail_arg("block_table", detail::cat("a row for request ", request[size_t(v)]), detail::cat(table.rows, " rows"));
  }
  for (int64_t v = 0; v < num_virtual; ++v) {
    const int64_t r = request[size_t(v)];
    const int64_t col0 = k_start[size_t(v)] / block_size;
    const int32_t* src = table.data + r * table.row_stride;
    int32_t* dst = out.data() + v * width;
    const int64_t copy = std::clamp<int64_t>(table.cols - col0, 0, width);
    std::copy(src + col0, src + col0 + copy, dst);
    std::fill(dst + copy, dst + width, 0);
  }
}

}  // namespace flashserve::planner
