// CUDA kernels of the layer-variant operations (variants_ops.hpp): differential_combine,
// lse_correct, gather_cache, as the CPU reference (src/reference/variants_ops.cpp). Elementwise
// fp32 math uses the _rn intrinsics in the reference's order (no contraction into FMAs), so only
// the reductions and the device's expf/logf can round differently.
#include "kernels/variants_ops.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/softmax_state.hpp"
#include "kernels/common/block_scan.cuh"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/token_rows.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/common/numeric.cuh"

namespace flashserve::kernels {

namespace {

constexpr int kRowWarps = 8;            // warps per block, one row at a time each
constexpr int kGroup = 8;               // elements per lane and access on the vector path
constexpr int64_t kDiffMaxGrid = 2048;  // differential_combine: each block computes λ once
constexpr int64_t kCopyMaxGrid = 4096;  // gather_cache rows; warps stop at the gathered total
constexpr int kScanThreads = 1024;      // gather_cache offsets: one block

// An fp32 vector [n] with a stride in elements.
struct F32Vec {
  const float* data;
  int64_t stride;
  __device__ float operator[](int64_t i) const { return data[i * stride]; }
};

F32Vec vec_of(const TensorRef& t) { return {static_cast<const float*>(t.data), t.stride[0]}; }


// ---- differential_combine

struct DiffArgs {
  int64_t tokens, pairs, head_dim;  // T, H / 2, D
  TokenRows a1, a2, out;                // [T, 2 * pairs, D]
  F32Vec q1, k1, q2, k2;            // [D]
  F32Vec weight;                    // [2D]
  float lambda_init, eps;
};

// Σ a[i] b[i] in index order, as reference::differential_lambda.
__device__ float dot_in_order(F32Vec a, F32Vec b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s = __fadd_rn(s, __fmul_rn(a[i], b[i]));
  return s;
}

// f(c, y, x) for the groups of G elements of pair p's row that this lane owns: c < 2D the row
// column, y the matching address in out, x[i] = a1 - λ a2 at columns c + i. The lane-to-element
// map is the same on every call, so a lane only rewrites elements it has read itself.
template <int G, class F>
__device__ void visit_pair_row(const DiffArgs& a, float lambda, int64_t t, int64_t p, int lane, F f) {
  const int64_t D = a.head_dim;
  const int64_t s1 = int64_t(dtype_size(a.a1.dtype)), s2 = int64_t(dtype_size(a.a2.dtype));
  const int64_t sy = int64_t(dtype_size(a.out.dtype));
  for (int half = 0; half < 2; ++half) {
    const char* x1 = a.a1.row(t, 2 * p + half);
    const char* x2 = a.a2.row(t, 2 * p + half);
    char* y = a.out.row(t, 2 * p + half);
    for (int64_t c = int64_t(lane) * G; c < D; c += kWarp * G) {
      float v1[G], v2[G], x[G];
      load_floats<G>(x1 + c * s1, a.a1.dtype, v1);
      load_floats<G>(x2 + c * s2, a.a2.dtype, v2);
#pragma unroll
      for (int i = 0; i < G; ++i) x[i] = __fsub_rn(v1[i], __fmul_rn(lambda, v2[i]));
      f(half * D + c, y + c * sy, x);
    }
  }
}

// One pair row by one warp: Σ x² (all of the row read), then out = x r weight (1 - λ_init).
template <int G>
__device__ void combine_pair_row(const DiffArgs& a, float lambda, int64_t t, int64_t p, int lane) {
  float ss = 0.0f;
  visit_pair_row<G>(a, lambda, t, p, lane, [&](int64_t, char*, const float(&x)[G]) {
#pragma unroll
    for (int i = 0; i < G; ++i) ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
  });
  ss = warp_sum(ss);  // every lane's reads are done before any lane writes
  const float width = float(2 * a.head_dim);
  const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, width), a.eps)));
  const float post = __fsub_rn(1.0f, a.lambda_init);
  visit_pair_row<G>(a, lambda, t, p, lane, [&](int64_t c, char* y, const float(&x)[G]) {
    float v[G];
#pragma unroll
    for (int i = 0; i < G; ++i) v[i] = __fmul_rn(__fmul_rn(__fmul_rn(x[i], r), a.weight[c + i]), post);
    store_floats<G>(y, a.out.dtype, v);
  });
}

// Whether pair p's six head rows take groups of kGroup elements.
__device__ bool pair_row_vectorizes(const DiffArgs& a, int64_t t, int64_t p) {
  if (a.head_dim % kGroup != 0) return false;
  for (int half = 0; half < 2; ++half) {
    const TokenRows* hs[] = {&a.a1, &a.a2, &a.out};
    for (const TokenRows* h : hs)
      if (!aligned(h->row(t, 2 * p + half), group_alignment(kGroup, int64_t(dtype_size(h->dtype))))) return false;
  }
  return true;
}

// Blocks over groups of kRowWarps (token, pair) rows; λ once per block (two threads, one dot each).
__global__ void differential_combine_kernel(const __grid_constant__ DiffArgs a) {
  __shared__ float dots[2];
  if (threadIdx.x == 0) dots[0] = dot_in_order(a.q1, a.k1, a.head_dim);
  if (threadIdx.x == kWarp) dots[1] = dot_in_order(a.q2, a.k2, a.head_dim);
  __syncthreads();
  const float lambda = __fadd_rn(__fsub_rn(expf(dots[0]), expf(dots[1])), a.lambda_init);
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t rows = a.tokens * a.pairs, step = int64_t(gridDim.x) * kRowWarps;
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; r < rows; r += step) {
    const int64_t t = r / a.pairs, p = r % a.pairs;
    if (pair_row_vectorizes(a, t, p)) combine_pair_row<kGroup>(a, lambda, t, p, lane);
    else combine_pair_row<1>(a, lambda, t, p, lane);
  }
}

// ---- lse_correct

struct LseArgs {
  int64_t slices, tokens, slice_heads, head_dim;  // S, T, H / S, Dv
  int64_t world, rank;
  char* out;  // [S, T, H / S, Dv]
  DType dtype;
  int64_t o_slice, o_token, o_head;
  const float* lse_all;  // [W, H, T]
  int64_t a_rank, a_head, a_token;
  float* lse_out;  // [H, T], may be null
  int64_t g_head, g_token;
  __device__ float lse(int64_t w, int64_t h, int64_t t) const {
    return normalize_lse(lse_all[w * a_rank + h * a_head + t * a_token]);
  }
};

// log Σ_w exp(lse[w, h, t]) in rank order, as the CPU (every lane computes it).
__device__ float global_lse(const LseArgs& a, int64_t h, int64_t t) {
  float m = -INFINITY;
  for (int64_t w = 0; w < a.world; ++w) m = fmaxf(m, a.lse(w, h, t));
  if (m == -INFINITY) return -INFINITY;
  float sum = 0.0f;
  for (int64_t w = 0; w < a.world; ++w) sum = __fadd_rn(sum, expf(__fsub_rn(a.lse(w, h, t), m)));
  return __fadd_rn(m, logf(sum));
}

// row[c] *= f for c < n, in groups of G; f == 0 stores zeros without reading.
template <int G>
__device__ void scale_row(char* row, DType t, int64_t n, float f, int lane) {
  const int64_t es = int64_t(dtype_size(t));
  for (int64_t c = int64_t(lane) * G; c < n; c += kWarp * G) {
    float v[G] = {};
    if (f != 0.0f) {
      load_floats<G>(row + c * es, t, v);
#pragma unroll
      for (int i = 0; i < G; ++i) v[i] = __fmul_rn(f, v[i]);
    }
    store_floats<G>(row + c * es, t, v);
  }
}

// Blocks over groups of kRowWarps (token, global head) rows.
__global__ void lse_correct_kernel(const __grid_constant__ LseArgs a) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t H = a.slices * a.slice_heads, rows = a.tokens * H, step = int64_t(gridDim.x) * kRowWarps;
  const int64_t es = int64_t(dtype_size(a.dtype));
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; r < rows; r += step) {
    const int64_t t = r / H, h = r % H;
    const float g = global_lse(a, h, t);
    const float local = a.lse(a.rank, h, t);
    const float f = local == -INFINITY ? 0.0f : expf(__fsub_rn(local, g));
    char* row = a.out + ((h / a.slice_heads) * a.o_slice + t * a.o_token + (h % a.slice_heads) * a.o_head) * es;
    if (a.head_dim % kGroup == 0 && aligned(row, group_alignment(kGroup, es))) scale_row<kGroup>(row, a.dtype, a.head_dim, f, lane);
    else scale_row<1>(row, a.dtype, a.head_dim, f, lane);
    if (a.lse_out && lane == 0) a.lse_out[h * a.g_head + t * a.g_token] = g;
  }
}

// ---- gather_cache

struct GatherArgs {
  int64_t batch, num_blocks, block_size, max_blocks;
  int64_t token_begin, token_end;
  const char* cache;  // [num_blocks, block_size, width]; strides in bytes
  int64_t c_block, c_slot;
  char* dst;  // [dst_rows, width]; row stride in bytes
  int64_t dst_rows, d_row;
  int64_t row_bytes;          // width * element size
  const int32_t* table;       // [B, max_blocks]
  int64_t t_row, t_col;
  const int32_t* seqused_k;   // [B]
  int64_t s_seqused;
  const int32_t* cu_q;        // [B + 1], may be null
  int64_t s_cu_q;
  int32_t* cu_dst;            // [B + 1]
  int64_t s_cu_dst;

  __device__ int64_t offset(int64_t b) const { return cu_dst[b * s_cu_dst]; }
};

// Tokens [lo, hi) of request b's context, as detail::gather_range.
struct Range {
  int64_t lo, hi;
};

__device__ Range gather_range(const GatherArgs& a, int64_t b) {
  const int64_t q_len = a.cu_q ? int64_t(a.cu_q[(b + 1) * a.s_cu_q]) - a.cu_q[b * a.s_cu_q] : 0;
  const int64_t context = max(int64_t(0), int64_t(a.seqused_k[b * a.s_seqused]) - q_len);
  Range r;
  r.lo = min(a.token_begin, context);
  r.hi = max(r.lo, min(a.token_end, context));
  return r;
}

// cu_seqlens_dst[b] = Σ_{i<b} (hi[i] - lo[i]), b <= B, chunk by chunk of kScanThreads requests.
__global__ void __launch_bounds__(kScanThreads) gather_offsets_kernel(const __grid_constant__ GatherArgs a) {
  int64_t carry = 0;
  for (int64_t base = 0; base < a.batch; base += kScanThreads) {
    const int64_t b = base + threadIdx.x;
    int64_t len = 0;
    if (b < a.batch) {
      const Range r = gather_range(a, b);
      len = r.hi - r.lo;
    }
    int64_t total;
    const int64_t inclusive = block_scan<kScanThreads>(len, total);
    if (b < a.batch) a.cu_dst[b * a.s_cu_dst] = int32_t(carry + inclusive - len);
    carry += total;
  }
  if (threadIdx.x == 0) a.cu_dst[a.batch * a.s_cu_dst] = int32_t(carry);
}


// The request whose rows hold destination row `row` < cu_dst[B]: the last b < B with
// cu_dst[b] <= row (cu_dst non-decreasing).
__device__ int64_t request_of(const GatherArgs& a, int64_t row) {
  int64_t lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (a.offset(mid) <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Blocks over groups of kRowWarps destination rows, each warp in increasing row order.
__global__ void gather_rows_kernel(const __grid_constant__ GatherArgs a) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t total = a.offset(a.batch), step = int64_t(gridDim.x) * kRowWarps;
  for (int64_t row = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; row < a.dst_rows; row += step) {
    if (row >= total) break;  // past the gathered rows: left untouched
    const int64_t b = request_of(a, row), start = a.offset(b);
    const Range r = gather_range(a, b);
    if (row < start || row - start >= r.hi - r.lo) continue;  // offsets that wrapped past int32
    const int64_t t = r.lo + (row - start), col = t / a.block_size;
    if (col >= a.max_blocks) continue;  // past the block-table row: never accessed
    const int64_t block = a.table[b * a.t_row + col * a.t_col];
    if (block < 0 || block >= a.num_blocks) continue;
    const char* x = a.cache + block * a.c_block + (t % a.block_size) * a.c_slot;
    warp_copy_bytes(a.dst + row * a.d_row, x, a.row_bytes, lane);
  }
}

const int32_t* i32_of(const TensorRef& t) { return static_cast<const int32_t*>(t.data); }

}  // namespace

void differential_combine(const detail::DifferentialProblem& pr, void* stream) {
  const int64_t rows = pr.tokens * pr.pairs;
  if (rows == 0) return;
  DiffArgs a{};
  a.tokens = pr.tokens;
  a.pairs = pr.pairs;
  a.head_dim = pr.head_dim;
  a.a1 = token_rows(pr.a1);
  a.a2 = token_rows(pr.a2);
  a.out = token_rows(pr.out);
  a.q1 = vec_of(pr.lambda_q1);
  a.k1 = vec_of(pr.lambda_k1);
  a.q2 = vec_of(pr.lambda_q2);
  a.k2 = vec_of(pr.lambda_k2);
  a.weight = vec_of(pr.weight);
  a.lambda_init = pr.lambda_init;
  a.eps = pr.eps;
  const int64_t blocks = grid_for(rows, kRowWarps, kDiffMaxGrid);
  differential_combine_kernel<<<unsigned(blocks), kRowWarps * kWarp, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

void lse_correct(const detail::LseCorrectProblem& pr, void* stream) {
  const int64_t rows = pr.tokens * pr.slices * pr.slice_heads;
  if (rows == 0) return;
  LseArgs a{};
  a.slices = pr.slices;
  a.tokens = pr.tokens;
  a.slice_heads = pr.slice_heads;
  a.head_dim = pr.head_dim;
  a.world = pr.world;
  a.rank = pr.rank;
  a.out = static_cast<char*>(pr.out.data);
  a.dtype = pr.out.dtype;
  a.o_slice = pr.out.stride[0];
  a.o_token = pr.out.stride[1];
  a.o_head = pr.out.stride[2];
  a.lse_all = static_cast<const float*>(pr.lse_all.data);
  a.a_rank = pr.lse_all.stride[0];
  a.a_head = pr.lse_all.stride[1];
  a.a_token = pr.lse_all.stride[2];
  if (pr.lse_out) {
    a.lse_out = static_cast<float*>(pr.lse_out->data);
    a.g_head = pr.lse_out->stride[0];
    a.g_token = pr.lse_out->stride[1];
  }
  lse_correct_kernel<<<unsigned(grid_for(rows, kRowWarps, kMaxGrid)), kRowWarps * kWarp, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

void gather_cache(const detail::GatherCacheProblem& pr, void* stream) {
  const int64_t es = int64_t(dtype_size(pr.cache.dtype));
  GatherArgs a{};
  a.batch = pr.batch;
  a.num_blocks = pr.num_blocks;
  a.block_size = pr.block_size;
  a.max_blocks = pr.block_table.size(1);
  a.token_begin = pr.token_begin;
  a.token_end = pr.token_end;
  a.cache = static_cast<const char*>(pr.cache.data);
  a.c_block = pr.cache.stride[0] * es;
  a.c_slot = pr.cache.stride[1] * es;
  a.dst = static_cast<char*>(pr.dst.data);
  a.dst_rows = pr.dst.size(0);
  a.d_row = pr.dst.stride[0] * es;
  a.row_bytes = pr.width * es;
  a.table = i32_of(pr.block_table);
  a.t_row = pr.block_table.stride[0];
  a.t_col = pr.block_table.stride[1];
  a.seqused_k = i32_of(pr.seqused_k);
  a.s_seqused = pr.seqused_k.stride[0];
  if (pr.cu_seqlens_q) {
    a.cu_q = i32_of(*pr.cu_seqlens_q);
    a.s_cu_q = pr.cu_seqlens_q->stride[0];
  }
  a.cu_dst = static_cast<int32_t*>(pr.cu_seqlens_dst.data);
  a.s_cu_dst = pr.cu_seqlens_dst.stride[0];
  gather_offsets_kernel<<<1, kScanThreads, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
  if (a.batch == 0 || a.dst_rows == 0 || a.row_bytes == 0) return;
  gather_rows_kernel<<<unsigned(grid_for(a.dst_rows, kRowWarps, kCopyMaxGrid)), kRowWarps * kWarp, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
