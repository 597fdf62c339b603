// Tile scheduling of the attention kernels. A CTA owns a tile of flat query rows (rows of the
// normalized q over all Bq, so a varlen tile may span several sequences), a slice of one KV
// head's query heads and one KV split:
//
//   grid = (ceil(Bq * rows / rows_per_cta), H_kv * head_slices, num_splits)
//
// and finds each row's sequence in the device metadata (a binary search over cu_seqlens_q),
// so correctness never depends on max_seqlen_q / max_seqlen_k, which the host cannot check
// without a sync. A row that no sequence covers (cu_seqlens_q[B] < total_q, or inconsistent
// metadata) is neither read nor written.
#pragma once

#include <cstdint>

#include "kernels/attention/load.cuh"
#include "kernels/attention/masks.cuh"

namespace flashserve::kernels {

struct CtaTile {
  int64_t r_begin = 0, r_end = 0;  // flat query rows [r_begin, r_end)
  int64_t g = 0;                   // KV head
  int64_t h0 = 0;                  // first head of the slice, within g's group
  int split = 0;
};

FS_DEV CtaTile cta_tile(const AttnParams& p) {
  CtaTile t;
  t.r_begin = int64_t(blockIdx.x) * p.rows_per_cta;
  t.r_end = imin(p.total_rows(), t.r_begin + p.rows_per_cta);
  t.g = blockIdx.y / p.head_slices;
  t.h0 = int64_t(blockIdx.y % p.head_slices) * p.heads_per_cta;
  t.split = int(blockIdx.z);
  return t;
}

// The query rows of one sequence.
struct SeqRows {
  int64_t b = -1;                      // -1: no sequence
  int64_t row_begin = 0, row_end = 0;  // flat rows [row_begin, row_end)
  int64_t qb = 0;                      // index into the normalized q's dim 0
  FS_DEV bool covers(int64_t r) const { return b >= 0 && r >= row_begin && r < row_end; }
  FS_DEV int64_t sq() const { return row_end - row_begin; }
  // Index of flat row r into the normalized view's dim 1.
  FS_DEV int64_t q_row(int64_t r, bool batched) const { return batched ? r - row_begin : r; }
};

// The sequence owning flat row r: batched, r / sq; varlen, the last b in [0, B) with
// cu_seqlens_q[b] <= r (zero-length sequences share a start with the next one).
FS_DEV SeqRows find_sequence(const AttnParams& p, int64_t r) {
  SeqRows s;
  if (p.batched) {
    s.b = r / p.q_rows;
    s.qb = s.b;
    s.row_begin = s.b * p.q_rows;
    s.row_end = s.row_begin + p.q_rows;
    return s;
  }
  int64_t lo = 0, hi = p.batch;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (load_index(p.cu_seqlens_q, mid) <= r) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0) return s;
  s.b = lo - 1;
  s.row_begin = load_index(p.cu_seqlens_q, s.b);
  s.row_end = load_index(p.cu_seqlens_q, s.b + 1);
  return s;
}

// KV length of sequence b (local to this rank), clamped at 0: seqused_k, else the
// cu_seqlens_k difference, else the contiguous cache's rows.
FS_DEV int64_t kv_len(const AttnParams& p, int64_t b) {
  int64_t n;
  if (p.seqused_k.data) n = load_index(p.seqused_k, b);
  else if (p.cu_seqlens_k.data) n = load_index(p.cu_seqlens_k, b + 1) - load_index(p.cu_seqlens_k, b);
  else n = p.kv_dim1;
  return n < 0 ? 0 : n;
}

// The global KV length that aligns query positions (context parallelism), else kv_len.
FS_DEV int64_t kv_len_global(const AttnParams& p, int64_t b, int64_t local) {
  return p.cp_tot_seqused_k.data ? load_index(p.cp_tot_seqused_k, b) : local;
}

}  // namespace flashserve::kernels
