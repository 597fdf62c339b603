// CUDA kernels of the KV-cache maintenance calls (cache_ops.hpp): reshape_and_cache,
// copy_blocks, swap_blocks, advance_step, quantize_int8 (and the int8 rows given already
// quantized, reshape_and_cache's int8_given form). Same results as the CPU reference
// (src/reference/cache_ops.cpp, quantize.cpp), bit for bit: IEEE divisions (__fdiv_rn, whatever the
// compiler's fast-math flags), round to nearest even, fp8 saturating.
#include "kernels/cache_ops.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/token_rows.cuh"
#include "kernels/common/warp_copy.cuh"
#include "kernels/common/numeric.cuh"

namespace flashserve::kernels {

namespace {

using detail::CacheWriteProblem;
using detail::StoreKind;

constexpr int kGroup = 8;              // elements per lane and access on the vector path

// ---- Rows moved by one warp (lane = 0..31)

// y[c] = f(c, x[c]) stored in `fmt`, for c < n: x of dtype t, both rows contiguous. Lanes take
// groups of kGroup elements when the row length and both addresses allow, else single ones.
template <class F>
__device__ void convert_row(char* y, DType fmt, const char* x, DType t, int64_t n, int lane, F f) {
  const int64_t xs = int64_t(dtype_size(t)), ys = int64_t(dtype_size(fmt));
  if (n % kGroup == 0 && aligned(x, group_alignment(kGroup, xs)) && aligned(y, group_alignment(kGroup, ys))) {
    for (int64_t c = int64_t(lane) * kGroup; c < n; c += kWarp * kGroup) {
      float v[kGroup];
      load_floats<kGroup>(x + c * xs, t, v);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) v[i] = f(c + i, v[i]);
      store_floats<kGroup>(y + c * ys, fmt, v);
    }
    return;
  }
  for (int64_t c = lane; c < n; c += kWarp) {
    float v[1];
    load_floats<1>(x + c * xs, t, v);
    v[0] = f(c, v[0]);
    store_floats<1>(y + c * ys, fmt, v);
  }
}

// max |x[c]| over the row, in every lane (NaN ignored, as std::max from 0 ignores it).
__device__ float row_absmax(const char* x, DType t, int64_t n, int lane) {
  const int64_t xs = int64_t(dtype_size(t));
  float m = 0.0f;
  if (n % kGroup == 0 && aligned(x, group_alignment(kGroup, xs))) {
    for (int64_t c = int64_t(lane) * kGroup; c < n; c += kWarp * kGroup) {
      float v[kGroup];
      load_floats<kGroup>(x + c * xs, t, v);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) m = fmaxf(m, fabsf(v[i]));
    }
  } else {
    for (int64_t c = lane; c < n; c += kWarp) {
      float v[1];
      load_floats<1>(x + c * xs, t, v);
      m = fmaxf(m, fabsf(v[0]));
    }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Dynamic int8 quantization of one row (reference::quantize_row_int8); returns the scale.
__device__ float quantize_row_int8(char* y, const char* x, DType t, int64_t n, int lane) {
  const float absmax = row_absmax(x, t, n, lane);
  const float scale = absmax > 0.0f ? __fdiv_rn(absmax, 127.0f) : 1.0f;
  convert_row(y, DType::i8, x, t, n, lane, [scale](int64_t, float v) { return __fdiv_rn(v, scale); });
  return scale;
}

// ---- reshape_and_cache

// How K (or V) goes from its rows into its cache. Strides in elements.
struct Side {
  const char* src;  // [>= num_tokens, H_kv, width]
  DType src_dtype;
  int64_t src_s_token, src_s_head;
  char* cache;      // NHD view [num_blocks, block_size, H_kv, width]
  DType format;     // stored element format (its size is the cache's element size)
  int64_t s_block, s_slot, s_head;
  int64_t width;    // D or Dv
  StoreKind kind;
  const float* scale;  // fp8: [H_kv] (stride 0 when shared); int8_static: [H_kv, width]; else null
  int64_t s_scale_head, s_scale_chan;
};

struct CacheWriteArgs {
  int64_t num_tokens, num_heads, block_size, capacity;  // capacity = num_blocks * block_size
  const int64_t* slots;  // [num_tokens]
  int64_t s_slots;
  Side k, v;
  float* k_scale_cache;  // int8: [num_blocks, block_size, H_kv]; else null
  int64_t ksc_s_block, ksc_s_slot, ksc_s_head;
  const float* key_scale;  // int8_given: [>= num_tokens, H_kv]; else null
  int64_t ks_s_token, ks_s_head;
};

__device__ void write_row(const CacheWriteArgs& a, const Side& s, int64_t tok, int64_t h, int64_t block,
                          int64_t off, int lane) {
  const char* x = s.src + (tok * s.src_s_token + h * s.src_s_head) * int64_t(dtype_size(s.src_dtype));
  char* y = s.cache + (block * s.s_block + off * s.s_slot + h * s.s_head) * int64_t(dtype_size(s.format));
  switch (s.kind) {
    case StoreKind::plain:
      warp_copy_bytes(y, x, s.width * int64_t(dtype_size(s.src_dtype)), lane);
      return;
    case StoreKind::fp8: {
      const float sc = s.scale[h * s.s_scale_head];
      convert_row(y, s.format, x, s.src_dtype, s.width, lane, [sc](int64_t, float v) { return __fdiv_rn(v, sc); });
      return;
    }
    case StoreKind::int8_dynamic: {
      const float sc = quantize_row_int8(y, x, s.src_dtype, s.width, lane);
      if (lane == 0) a.k_scale_cache[block * a.ksc_s_block + off * a.ksc_s_slot + h * a.ksc_s_head] = sc;
      return;
    }
    case StoreKind::int8_given:  // int8 key as given, its scale from key_scale
      warp_copy_bytes(y, x, s.width, lane);
      if (lane == 0)
        a.k_scale_cache[block * a.ksc_s_block + off * a.ksc_s_slot + h * a.ksc_s_head] =
            a.key_scale[tok * a.ks_s_token + h * a.ks_s_head];
      return;
    case StoreKind::int8_static: {
      const float* vs = s.scale + h * s.s_scale_head;  // [width], stride `step`
      const int64_t step = s.s_scale_chan;
      auto op = [vs, step](int64_t c, float v) { return __fdiv_rn(v, vs[c * step]); };
      convert_row(y, s.format, x, s.src_dtype, s.width, lane, op);
      return;
    }
  }
}

// Blocks over tokens; the warps of a block over the 2 * H_kv rows (K heads, then V heads).
__global__ void reshape_and_cache_kernel(const __grid_constant__ CacheWriteArgs a) {
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp, warps = int(blockDim.x) / kWarp;
  for (int64_t tok = blockIdx.x; tok < a.num_tokens; tok += gridDim.x) {
    const int64_t slot = a.slots[tok * a.s_slots];
    if (slot < 0 || slot >= a.capacity) continue;  // padding (-1), or out of range: never accessed
    const int64_t block = slot / a.block_size, off = slot % a.block_size;
    for (int64_t r = warp; r < 2 * a.num_heads; r += warps) {
      const bool key = r < a.num_heads;
      write_row(a, key ? a.k : a.v, tok, key ? r : r - a.num_heads, block, off, lane);
    }
  }
}

Side make_side(const TensorRef& src, const TensorRef& cache, StoreKind kind, DType format, const OptTensor& scale) {
  Side s{};
  s.src = static_cast<const char*>(src.data);
  s.src_dtype = src.dtype;
  s.src_s_token = src.stride[0];
  s.src_s_head = src.stride[1];
  s.cache = static_cast<char*>(cache.data);
  s.format = format;
  s.s_block = cache.stride[0];
  s.s_slot = cache.stride[1];
  s.s_head = cache.stride[2];
  s.width = src.shape[2];
  s.kind = kind;
  if (scale && (kind == StoreKind::fp8 || kind == StoreKind::int8_static)) {
    s.scale = static_cast<const float*>(scale->data);
    s.s_scale_head = scale->stride[0];
    s.s_scale_chan = scale->ndim > 1 ? scale->stride[1] : 0;
  }
  return s;
}

// ---- copy_blocks

constexpr int kCopyBatch = 256;            // caches per launch (2 x 126 layers), ~28 KB of arguments
constexpr int kBlockDims = kMaxDims - 1;   // dims of one block
constexpr int kCopyThreads = 256;

// One cache's blocks: block b at data + b * block_stride, made of contiguous runs of `run` bytes
// placed by up to kBlockDims outer dims. Sizes and strides in bytes.
struct BlockLayout {
  char* data;
  int64_t block_stride;
  int64_t run;
  int64_t size[kBlockDims], stride[kBlockDims];  // outermost first
  int32_t ndim;   // outer dims used
  int32_t width;  // access width (16, 8, 4, 2 or 1) dividing every address and the run
};

struct CopyBlocksArgs {
  const int64_t* mapping;  // [num_pairs, 2] rows of (src, dst)
  int64_t s_row, s_col;
  int64_t num_pairs, num_blocks;
  BlockLayout cache[kCopyBatch];  // gridDim.y of them in use
};
static_assert(sizeof(CopyBlocksArgs) <= 32764, "kernel arguments are limited to 32764 bytes (CUDA 12.1+, sm_70+)");

template <class U>
__device__ void copy_runs(const BlockLayout& c, const char* x, char* y) {
  const int64_t per_run = c.run / int64_t(sizeof(U));
  if (c.ndim == 0) {  // one contiguous run: the common case
    for (int64_t i = threadIdx.x; i < per_run; i += blockDim.x)
      reinterpret_cast<U*>(y)[i] = reinterpret_cast<const U*>(x)[i];
    return;
  }
  int64_t units = per_run;
  for (int d = 0; d < c.ndim; ++d) units *= c.size[d];
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
    int64_t o = i / per_run, off = (i % per_run) * int64_t(sizeof(U));
    for (int d = c.ndim - 1; d >= 0; --d) {
      off += (o % c.size[d]) * c.stride[d];
      o /= c.size[d];
    }
    *reinterpret_cast<U*>(y + off) = *reinterpret_cast<const U*>(x + off);
  }
}

// Blocks over (pair, cache).
__global__ void copy_blocks_kernel(const __grid_constant__ CopyBlocksArgs a) {
  const BlockLayout& c = a.cache[blockIdx.y];
  for (int64_t r = blockIdx.x; r < a.num_pairs; r += gridDim.x) {
    const int64_t s = a.mapping[r * a.s_row], d = a.mapping[r * a.s_row + a.s_col];
    if (s < 0 || s >= a.num_blocks || d < 0 || d >= a.num_blocks) continue;  // never accessed
    const char* x = c.data + s * c.block_stride;
    char* y = c.data + d * c.block_stride;
    switch (c.width) {
      case 16: copy_runs<uint4>(c, x, y); break;
      case 8: copy_runs<uint2>(c, x, y); break;
      case 4: copy_runs<uint32_t>(c, x, y); break;
      case 2: copy_runs<uint16_t>(c, x, y); break;
      default: copy_runs<uint8_t>(c, x, y); break;
    }
  }
}

// The dims of one block of `t` (dims 1..), in bytes, size-1 dims dropped and neighbours that
// are contiguous with each other merged. Returns the count.
int block_dims(const TensorRef& t, int64_t* size, int64_t* stride) {
  const int64_t es = int64_t(dtype_size(t.dtype));
  int n = 0;
  for (int d = 1; d < t.ndim; ++d) {
    if (t.shape[d] == 1) continue;
    const int64_t st = t.stride[d] * es;
    if (n > 0 && stride[n - 1] == st * t.shape[d]) {
      size[n - 1] *= t.shape[d];
      stride[n - 1] = st;
    } else {
      size[n] = t.shape[d];
      stride[n] = st;
      ++n;
    }
  }
  return n;
}

int access_width(uint64_t bits) {
  int w = 16;
  while (bits % uint64_t(w) != 0) w /= 2;
  return w;
}

bool empty_blocks(const TensorRef& t) {
  for (int d = 1; d < t.ndim; ++d)
    if (t.shape[d] == 0) return true;
  return false;
}

BlockLayout block_layout(const TensorRef& t) {
  BlockLayout L{};
  L.ndim = block_dims(t, L.size, L.stride);
  const int64_t es = int64_t(dtype_size(t.dtype));
  L.data = static_cast<char*>(t.data);
  L.block_stride = t.stride[0] * es;
  L.run = es;
  if (L.ndim > 0 && L.stride[L.ndim - 1] == es) L.run = L.size[--L.ndim] * es;
  uint64_t bits = reinterpret_cast<uintptr_t>(t.data) | uint64_t(std::llabs(L.block_stride)) | uint64_t(L.run);
  for (int d = 0; d < L.ndim; ++d) bits |= uint64_t(std::llabs(L.stride[d]));
  L.width = access_width(bits);
  return L;
}

void launch_copy_blocks(const CopyBlocksArgs& a, int count, cudaStream_t stream) {
  const dim3 grid(unsigned(std::min(a.num_pairs, kMaxGrid)), unsigned(count));
  copy_blocks_kernel<<<grid, kCopyThreads, 0, stream>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

// ---- swap_blocks

// A block's dims as src and dst see them (byte strides), merged where both allow.
struct SwapLayout {
  int64_t size[kBlockDims], s_src[kBlockDims], s_dst[kBlockDims];
  int ndim = 0;
  int64_t run = 0;  // contiguous bytes in both
};

SwapLayout swap_layout(const TensorRef& src, const TensorRef& dst) {
  const int64_t es = int64_t(dtype_size(src.dtype));
  SwapLayout L;
  int& n = L.ndim;
  for (int d = 1; d < src.ndim; ++d) {
    const int64_t sz = src.shape[d], ss = src.stride[d] * es, ds = dst.stride[d] * es;
    if (sz == 1) continue;
    if (n > 0 && L.s_src[n - 1] == ss * sz && L.s_dst[n - 1] == ds * sz) {
      L.size[n - 1] *= sz;
      L.s_src[n - 1] = ss;
      L.s_dst[n - 1] = ds;
    } else {
      L.size[n] = sz, L.s_src[n] = ss, L.s_dst[n] = ds;
      ++n;
    }
  }
  L.run = es;
  if (n > 0 && L.s_src[n - 1] == es && L.s_dst[n - 1] == es) {
    --n;
    L.run = L.size[n] * es;
  }
  return L;
}

// Copies the runs of dims [d, ndim) of one block: 2-D copies over the innermost outer dim.
void copy_block_async(const SwapLayout& L, int d, char* y, const char* x, cudaStream_t stream) {
  if (d == L.ndim) {
    FS_CUDA_CHECK(cudaMemcpyAsync(y, x, size_t(L.run), cudaMemcpyDefault, stream));
    return;
  }
  const bool innermost = d == L.ndim - 1;
  if (innermost && L.s_dst[d] >= L.run && L.s_src[d] >= L.run) {
    FS_CUDA_CHECK(cudaMemcpy2DAsync(y, size_t(L.s_dst[d]), x, size_t(L.s_src[d]), size_t(L.run),
                                    size_t(L.size[d]), cudaMemcpyDefault, stream));
    return;
  }
  for (int64_t i = 0; i < L.size[d]; ++i) copy_block_async(L, d + 1, y + i * L.s_dst[d], x + i * L.s_src[d], stream);
}

// ---- advance_step

struct AdvanceArgs {
  int64_t num_seqs, num_queries, block_size, max_blocks;
  int64_t* tokens;          // [>= num_seqs], written
  const int64_t* sampled;   // [>= num_queries, 1]
  int64_t* positions;       // [>= num_seqs], written
  int32_t* seq_lens;        // [>= num_seqs], read and written
  int64_t* slots;           // [>= num_seqs], written
  const int32_t* tables;    // [>= num_seqs, max_blocks], last dim contiguous
  int64_t s_tokens, s_sampled, s_positions, s_seq_lens, s_slots, s_tables;
};

// One thread per row. Padding rows, and rows whose next position has no block in the table
// (never read), get token 0, position 0, slot -1, seq_len untouched.
__global__ void advance_step_kernel(const AdvanceArgs a) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.num_seqs; i += step) {
    int64_t token = 0, pos = 0, slot = -1;
    if (i < a.num_queries) {
      const int32_t len = a.seq_lens[i * a.s_seq_lens];
      if (len >= 0 && len < INT32_MAX && len / a.block_size < a.max_blocks) {
        token = a.sampled[i * a.s_sampled];
        pos = len;
        a.seq_lens[i * a.s_seq_lens] = len + 1;
        slot = int64_t(a.tables[i * a.s_tables + pos / a.block_size]) * a.block_size + pos % a.block_size;
      }
    }
    a.tokens[i * a.s_tokens] = token;
    a.positions[i * a.s_positions] = pos;
    a.slots[i * a.s_slots] = slot;
  }
}

// ---- quantize_int8

struct QuantizeArgs {
  int64_t tokens, heads, width;
  const char* x;  // [T, H, D]
  DType dtype;
  int64_t x_s_token, x_s_head;
  int8_t* out;    // [T, H, D]
  int64_t out_s_token, out_s_head;
  float* scale;   // [T, H]
  int64_t scale_s_token, scale_s_head;
};

constexpr int kRowWarps = 4;  // warps per block of the one-warp-per-row kernels

__global__ void quantize_int8_kernel(const QuantizeArgs a) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t rows = a.tokens * a.heads, step = int64_t(gridDim.x) * kRowWarps;
  for (int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp; r < rows; r += step) {
    const int64_t t = r / a.heads, h = r % a.heads;
    const char* x = a.x + (t * a.x_s_token + h * a.x_s_head) * int64_t(dtype_size(a.dtype));
    char* y = reinterpret_cast<char*>(a.out + t * a.out_s_token + h * a.out_s_head);
    const float sc = quantize_row_int8(y, x, a.dtype, a.width, lane);
    if (lane == 0) a.scale[t * a.scale_s_token + h * a.scale_s_head] = sc;
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteProblem& pr, void* stream) {
  if (pr.num_tokens == 0 || pr.num_kv_heads == 0) return;
  CacheWriteArgs a{};
  a.num_tokens = pr.num_tokens;
  a.num_heads = pr.num_kv_heads;
  a.block_size = pr.block_size;
  a.capacity = pr.num_blocks * pr.block_size;
  a.slots = static_cast<const int64_t*>(pr.slot_mapping.data);
  a.s_slots = pr.slot_mapping.stride[0];
  a.k = make_side(pr.key, pr.key_cache, pr.k_kind, pr.k_format, pr.k_scale);
  a.v = make_side(pr.value, pr.value_cache, pr.v_kind, pr.v_format, pr.v_scale);
  if (pr.k_scale_cache) {
    a.k_scale_cache = static_cast<float*>(pr.k_scale_cache->data);
    a.ksc_s_block = pr.k_scale_cache->stride[0];
    a.ksc_s_slot = pr.k_scale_cache->stride[1];
    a.ksc_s_head = pr.k_scale_cache->stride[2];
  }
  if (pr.key_scale) {
    a.key_scale = static_cast<const float*>(pr.key_scale->data);
    a.ks_s_token = pr.key_scale->stride[0];
    a.ks_s_head = pr.key_scale->stride[1];
  }
  const int warps = int(std::min<int64_t>(8, 2 * pr.num_kv_heads));
  reshape_and_cache_kernel<<<unsigned(std::min(pr.num_tokens, kMaxGrid)), warps * kWarp, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

void copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping, void* stream) {
  if (caches.empty() || block_mapping.size(0) == 0) return;
  CopyBlocksArgs a{};
  a.mapping = static_cast<const int64_t*>(block_mapping.data);
  a.s_row = block_mapping.stride[0];
  a.s_col = block_mapping.stride[1];
  a.num_pairs = block_mapping.size(0);
  a.num_blocks = caches[0].size(0);
  int count = 0;
  for (const TensorRef& c : caches) {
    if (empty_blocks(c)) continue;
    a.cache[count++] = block_layout(c);
    if (count == kCopyBatch) {
      launch_copy_blocks(a, count, as_stream(stream));
      count = 0;
    }
  }
  if (count > 0) launch_copy_blocks(a, count, as_stream(stream));
}

void swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping, void* stream) {
  if (empty_blocks(src)) return;
  const SwapLayout L = swap_layout(src, dst);
  const int64_t es = int64_t(dtype_size(src.dtype));
  for (int64_t r = 0; r < block_mapping.size(0); ++r) {
    const int64_t s = *static_cast<const int64_t*>(block_mapping.at(r, 0));
    const int64_t d = *static_cast<const int64_t*>(block_mapping.at(r, 1));
    copy_block_async(L, 0, static_cast<char*>(dst.data) + d * dst.stride[0] * es,
                     static_cast<const char*>(src.data) + s * src.stride[0] * es, as_stream(stream));
  }
}

void advance_step(const AdvanceStepParams& p, void* stream) {
  if (p.num_seqs == 0) return;
  AdvanceArgs a{};
  a.num_seqs = p.num_seqs;
  a.num_queries = p.num_queries;
  a.block_size = p.block_size;
  a.max_blocks = p.block_tables.size(1);
  a.tokens = static_cast<int64_t*>(p.input_tokens.data);
  a.sampled = static_cast<const int64_t*>(p.sampled_token_ids.data);
  a.positions = static_cast<int64_t*>(p.input_positions.data);
  a.seq_lens = static_cast<int32_t*>(p.seq_lens.data);
  a.slots = static_cast<int64_t*>(p.slot_mapping.data);
  a.tables = static_cast<const int32_t*>(p.block_tables.data);
  a.s_tokens = p.input_tokens.stride[0];
  a.s_sampled = p.sampled_token_ids.stride[0];
  a.s_positions = p.input_positions.stride[0];
  a.s_seq_lens = p.seq_lens.stride[0];
  a.s_slots = p.slot_mapping.stride[0];
  a.s_tables = p.block_tables.stride[0];
  constexpr int kThreads = 256;
  advance_step_kernel<<<unsigned(grid_for(p.num_seqs, kThreads)), kThreads, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

void quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale, void* stream) {
  QuantizeArgs a{};
  a.tokens = x.shape[0];
  a.heads = x.shape[1];
  a.width = x.shape[2];
  if (a.tokens * a.heads == 0) return;
  a.x = static_cast<const char*>(x.data);
  a.dtype = x.dtype;
  a.x_s_token = x.stride[0];
  a.x_s_head = x.stride[1];
  a.out = static_cast<int8_t*>(out.data);
  a.out_s_token = out.stride[0];
  a.out_s_head = out.stride[1];
  a.scale = static_cast<float*>(scale.data);
  a.scale_s_token = scale.stride[0];
  a.scale_s_head = scale.stride[1];
  const unsigned blocks = unsigned(grid_for(a.tokens * a.heads, kRowWarps));
  quantize_int8_kernel<<<blocks, kRowWarps * kWarp, 0, as_stream(stream)>>>(a);
  FS_CUDA_CHECK_LAUNCH();
}

}  // namespace flashserve::kernels
