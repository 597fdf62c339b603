// Per-sequence reads of the batch metadata and the content checks a CPU call makes before
// any write: lengths within the tensors and bounds, block indices in range.
#include "common/check.hpp"
#include "common/cp_layout.hpp"
#include "api/validate_batch.hpp"

namespace flashserve::detail {

int64_t q_begin(const AttnProblem& pr, int64_t b) {
  return pr.batched ? 0 : read_index(*pr.cu_seqlens_q, b);
}

int64_t q_len(const AttnProblem& pr, int64_t b) {
  return pr.batched ? pr.q.size(1) : read_index(*pr.cu_seqlens_q, b + 1) - read_index(*pr.cu_seqlens_q, b);
}

int64_t k_len(const AttnProblem& pr, int64_t b) {
  if (pr.seqused_k) return read_index(*pr.seqused_k, b);
  if (pr.cu_seqlens_k) return read_index(*pr.cu_seqlens_k, b + 1) - read_index(*pr.cu_seqlens_k, b);
  return pr.k.size(1);  // batched contiguous cache
}

ProblemShape shape_of(const AttnProblem& pr) {
  const AttentionParams& p = *pr.params;
  ProblemShape s;
  s.batch = pr.batch;
  s.num_heads = pr.num_heads;
  s.num_kv_heads = pr.num_kv_heads;
  s.head_dim = pr.head_dim;
  s.head_dim_v = pr.head_dim_v;
  s.total_q = pr.total_q;
  s.page_size = pr.paged ? pr.block_size : 0;
  s.causal = p.causal;
  s.local = !p.window.unbounded() || p.chunk_size > 0;
  s.batch_invariant = p.batch_invariant;
  s.kv_8bit = dtype_size(pr.k.dtype) == 1;
  if (pr.batched) {
    s.max_seqlen_q = pr.q.size(1);
    s.max_seqlen_k = pr.paged ? pr.block_table->size(1) * pr.block_size : pr.k.size(1);
  } else {
    s.max_seqlen_q = p.max_seqlen_q;
    s.max_seqlen_k = p.max_seqlen_k;
  }
  return s;
}

namespace {

// cu_seqlens: starts at 0, non-decreasing, last entry within `limit`.
void check_cu_seqlens(const TensorRef& cu, const char* arg, int64_t limit, const char* what) {
  const int64_t n = cu.size(0);
  if (read_index(cu, 0) != 0) fail_arg(arg, cat(arg, "[0] == 0"), read_index(cu, 0));
  for (int64_t b = 1; b < n; ++b) {
    const int64_t prev = read_index(cu, b - 1), cur = read_index(cu, b);
    if (cur < prev) fail_arg(arg, "non-decreasing entries", cat(arg, "[", b, "]=", cur, " < ", arg, "[", b - 1, "]=", prev));
  }
  const int64_t last = read_index(cu, n - 1);
  if (last > limit) fail_arg(arg, cat("last entry <= ", limit, " (", what, ")"), last);
}

void check_k_lengths(const AttnProblem& pr, const AttentionParams& p) {
  const char* len_arg = pr.seqused_k ? "seqused_k" : "cu_seqlens_k";
  for (int64_t b = 0; b < pr.batch; ++b) {
    const int64_t kl = k_len(pr, b);
    if (kl < 0) fail_arg(len_arg, "lengths >= 0", cat(len_arg, "[", b, "]=", kl));
    if (!pr.batched && kl > p.max_seqlen_k)
      fail_arg("max_seqlen_k", cat(">= ", kl, " (KV length of sequence ", b, ")"), p.max_seqlen_k);
    if (pr.paged) {
      const int64_t cap = pr.block_table->size(1) * pr.block_size;
      if (kl > cap)
        fail_arg(len_arg, cat("<= ", cap, " (block_table holds ", pr.block_table->size(1), " blocks of ", pr.block_size, ")"),
                 cat(len_arg, "[", b, "]=", kl));
      if (pr.seqused_k && pr.cu_seqlens_k) {
        const int64_t seg = read_index(*pr.cu_seqlens_k, b + 1) - read_index(*pr.cu_seqlens_k, b);
        if (kl > seg) fail_arg("seqused_k", cat("<= ", seg, " (the segment of cu_seqlens_k)"), cat("seqused_k[", b, "]=", kl));
      }
      const int64_t used = (kl + pr.block_size - 1) / pr.block_size, nb = pr.k.size(0);
      for (int64_t i = 0; i < used; ++i) {
        const int64_t blk = read_index2(*pr.block_table, b, i);
        if (blk < 0 || blk >= nb)
          fail_arg("block_table", cat("block indices in [0, ", nb, ")"), cat("block_table[", b, "][", i, "]=", blk));
      }
    } else if (!pr.batched) {
      const int64_t seg = read_index(*pr.cu_seqlens_k, b + 1) - read_index(*pr.cu_seqlens_k, b);
      if (kl > seg) fail_arg("seqused_k", cat("<= ", seg, " (the segment of cu_seqlens_k)"), cat("seqused_k[", b, "]=", kl));
    } else {
      if (kl > pr.k.size(1)) fail_arg("seqused_k", cat("<= ", pr.k.size(1), " (the cache's length)"), cat("seqused_k[", b, "]=", kl));
      const int64_t row = pr.cache_batch_idx ? read_index(*pr.cache_batch_idx, b) : b;
      if (row < 0 || row >= pr.k.size(0))
        fail_arg("cache_batch_idx", cat("rows in [0, ", pr.k.size(0), ")"), cat("cache_batch_idx[", b, "]=", row));
    }
  }
}

}  // namespace

void check_batch_contents(AttnProblem& pr, const AttentionParams& p) {
  if (!pr.batched) {
    // <= rather than ==: rows past cu_seqlens_q[B] are padding (a batch padded for a CUDA
    // graph, as vLLM's model runner pads it), neither read nor written.
    check_cu_seqlens(*pr.cu_seqlens_q, "cu_seqlens_q", pr.total_q, "the rows of q");
    for (int64_t b = 0; b < pr.batch; ++b)
      if (q_len(pr, b) > p.max_seqlen_q)
        fail_arg("max_seqlen_q", cat(">= ", q_len(pr, b), " (query length of sequence ", b, ")"), p.max_seqlen_q);
  }
  if (pr.cu_seqlens_k)
    check_cu_seqlens(*pr.cu_seqlens_k, "cu_seqlens_k", pr.paged ? INT64_MAX : pr.k.size(1), "the rows of k");
  check_k_lengths(pr, p);
  if (pr.cp_tot_seqused_k) {
    // Rank r's share of the global positions (common/cp_layout.hpp): its local length follows
    // from the global one.
    const int64_t w = p.cp_world_size, r = p.cp_rank;
    for (int64_t b = 0; b < pr.batch; ++b) {
      const int64_t tot = read_index(*pr.cp_tot_seqused_k, b);
      const int64_t local = cp_local_len(tot, w, r, p.cp_interleave);
      if (tot < 0 || local != k_len(pr, b))
        fail_arg("cp_tot_seqused_k", cat("a global length whose share on rank ", r, " of ", w, " (interleave ",
                                         p.cp_interleave, ") is the local KV length ",
                                         k_len(pr, b)),
                 cat("cp_tot_seqused_k[", b, "]=", tot));
    }
  }
}

}  // namespace flashserve::detail
