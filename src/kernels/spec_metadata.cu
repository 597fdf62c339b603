// CUDA kernels of the tree-speculation metadata operations (spec_metadata.hpp), as the CPU
// reference (src/reference/spec_metadata.cpp).
#include "kernels/spec_metadata.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/block_scan.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/token_rows.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kThreads = 256;      // elementwise and per-row kernels
constexpr int kScanThreads = 1024;  // the single-block kernels

// A read-only int32/int64 matrix [rows, cols] (a vector: cols = 1, s1 unused) with strides.
struct Index {
  const void* data;
  bool wide;  // int64
  int64_t rows, cols, s0, s1;
  __device__ int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t off = i * s0 + j * s1;
    return wide ? static_cast<const int64_t*>(data)[off] : int64_t(static_cast<const int32_t*>(data)[off]);
  }
  // 0 outside [0, rows) x [0, cols): never accessed.
  __device__ int64_t guarded(int64_t i, int64_t j) const {
    return i >= 0 && i < rows && j >= 0 && j < cols ? (*this)(i, j) : 0;
  }
};

// A written int32 matrix (a vector: s1 unused).
struct Out {
  int32_t* data;
  int64_t s0, s1;
  __device__ int32_t& operator()(int64_t i, int64_t j = 0) const { return data[i * s0 + j * s1]; }
};

Index index_of(const TensorRef& t) {
  return {t.data, t.dtype == DType::i64, t.size(0), t.ndim > 1 ? t.size(1) : 1, t.stride[0],
          t.ndim > 1 ? t.stride[1] : 0};
}
Out out_of(const TensorRef& t) { return {static_cast<int32_t*>(t.data), t.stride[0], t.ndim > 1 ? t.stride[1] : 0}; }

// ---- spec_draft_expand

struct DraftArgs {
  int64_t rows, decode_length;
  Index loc;  // [R, num_steps]
  Out page, lens, cu;
};

__global__ void __launch_bounds__(kThreads) draft_expand_kernel(const __grid_constant__ DraftArgs a) {
  const int64_t entries = a.rows * a.decode_length, work = max(entries, a.rows + 1);
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < work; e += int64_t(gridDim.x) * blockDim.x) {
    if (e < entries) {
      const int64_t r = e / a.decode_length, c = e % a.decode_length;
      a.page(r, c) = int32_t(a.loc(r, c));
      if (c == 0) a.lens(r) = int32_t(a.decode_length);
    }
    if (e <= a.rows) a.cu(e) = int32_t(e * a.decode_length);
  }
}

// ---- spec_verify_expand

struct VerifyArgs {
  int64_t batch, n, mask_rows;
  const uint8_t* mask;
  int64_t mask_len, s_mask;
  Index req_to_token, pool_index, seq_lens;
  Out page, lens, cu;

  __device__ bool visible(int64_t at) const { return at >= 0 && at < mask_len && mask[at * s_mask] != 0; }
};

// Draft row i of request b, whose mask starts at element mask_at (rows past mask_rows read
// every bit from element 0): its page-table row (visible drafts, then hidden ones) and length;
// returns the length.
__device__ int64_t verify_row(const VerifyArgs& a, int64_t b, int64_t i, int64_t mask_at) {
  const int64_t n = a.n, len = a.seq_lens(b), req = a.pool_index(b), r = b * n + i;
  const bool own = r < a.mask_rows;
  const int64_t first = own ? mask_at + i * (len + n) + len : 0, step = own ? 1 : 0;
  int64_t k = 0, shown_count = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t j = 0; j < n; ++j)
      if (a.visible(first + j * step) == (pass == 0)) a.page(r, k++) = int32_t(a.req_to_token.guarded(req, len + j));
    if (pass == 0) shown_count = k;
  }
  a.lens(r) = int32_t(shown_count);
  return shown_count;
}

// Requests in chunks of kScanThreads: mask offsets scanned (one request a thread), then the
// chunk's draft rows kScanThreads at a time with their lengths scanned into cu.
__global__ void __launch_bounds__(kScanThreads) verify_expand_kernel(const __grid_constant__ VerifyArgs a) {
  __shared__ int64_t mask_at[kScanThreads];
  int64_t mask_carry = 0, key_carry = 0, total = 0;
  for (int64_t base = 0; base < a.batch; base += kScanThreads) {
    const int64_t b = base + threadIdx.x;
    const int64_t size = b < a.batch ? a.n * (a.seq_lens(b) + a.n) : 0;
    const int64_t end = block_scan<kScanThreads>(size, total);
    mask_at[threadIdx.x] = mask_carry + end - size;
    mask_carry += total;
    __syncthreads();
    const int64_t rows = min(int64_t(kScanThreads), a.batch - base) * a.n;
    for (int64_t first = 0; first < rows; first += kScanThreads) {
      const int64_t local = first + threadIdx.x;
      const int64_t count = local < rows ? verify_row(a, base + local / a.n, local % a.n, mask_at[local / a.n]) : 0;
      const int64_t keys = block_scan<kScanThreads>(count, total);
      if (local < rows) a.cu(base * a.n + local + 1) = int32_t(key_carry + keys);
      key_carry += total;
    }
    __syncthreads();  // mask_at is rewritten by the next chunk
  }
  if (threadIdx.x == 0) a.cu(0) = 0;
}

// ---- spec_window_page_table

struct WindowArgs {
  int64_t rows, n, width;
  Index table_a, table_b, len_a, len_b;  // [B, LEN_A], [B * n, LEN_B], [B], [B * n]
  Out page, lens, cu;

  __device__ int64_t length(int64_t r) const { return len_a(r / n) + len_b(r); }
};

__global__ void __launch_bounds__(kThreads) window_rows_kernel(const __grid_constant__ WindowArgs a) {
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int64_t b = r / a.n, la = a.len_a(b), end = min(la + a.len_b(r), a.width);
    for (int64_t c = threadIdx.x; c < end; c += blockDim.x)
      a.page(r, c) = int32_t(c < la ? a.table_a.guarded(b, c) : a.table_b.guarded(r, c - la));
    if (threadIdx.x == 0) a.lens(r) = int32_t(a.length(r));
  }
}

__global__ void __launch_bounds__(kScanThreads) window_offsets_kernel(const __grid_constant__ WindowArgs a) {
  int64_t carry = 0, total = 0;
  for (int64_t base = 0; base < a.rows; base += kScanThreads) {
    const int64_t r = base + threadIdx.x;
    const int64_t len = r < a.rows ? a.length(r) : 0;
    const int64_t end = block_scan<kScanThreads>(len, total);
    if (r < a.rows) a.cu(r + 1) = int32_t(carry + end);
    carry += total;
  }
  if (threadIdx.x == 0) a.cu(0) = 0;
}

}  // namespace

void spec_draft_expand(const detail::DraftExpandProblem& pr, void* stream) {
  const DraftArgs a{pr.rows, pr.decode_length, index_of(pr.out_cache_loc), out_of(pr.page_table),
                    out_of(pr.cache_seqlens), out_of(pr.cu_seqlens_k)};
  const int64_t work = std::max(pr.rows * pr.decode_length, pr.rows + 1);
  draft_expand_kernel<<<unsigned(grid_for(work, kThreads)), kThreads, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

void spec_verify_expand(const detail::VerifyExpandProblem& pr, void* stream) {
  const VerifyArgs a{pr.batch, pr.drafts, pr.mask_rows, static_cast<const uint8_t*>(pr.custom_mask.data),
                     pr.custom_mask.size(0), pr.custom_mask.stride[0], index_of(pr.req_to_token),
                     index_of(pr.req_pool_indices), index_of(pr.seq_lens), out_of(pr.page_table),
                     out_of(pr.cache_seqlens), out_of(pr.cu_seqlens_k)};
  verify_expand_kernel<<<1, kScanThreads, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

void spec_window_page_table(const detail::WindowPageTableProblem& pr, void* stream) {
  const WindowArgs a{pr.batch * pr.drafts, pr.drafts, pr.page_table.size(1), index_of(pr.page_table_a),
                     index_of(pr.page_table_b), index_of(pr.seq_len_a), index_of(pr.seq_len_b),
                     out_of(pr.page_table), out_of(pr.cache_seqlens), out_of(pr.cu_seqlens_k)};
  if (a.rows > 0) {
    window_rows_kernel<<<unsigned(std::min<int64_t>(a.rows, kMaxGrid)), kThreads, 0, as_stream(stream)>>>(a);
    FS_CUDA_CHECK_LAUNCH();
  }
  window_offsets_kernel<<<1, kScanThreads, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
