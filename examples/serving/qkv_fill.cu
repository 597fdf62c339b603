// Device q/k/v generation (qkv_fill.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "activation_hash.hpp"
#include "qkv_fill.hpp"

namespace serving {

namespace {

// One token row is H + 2 H_kv heads of D elements: q's heads, then k's, then v's.
struct FillArgs {
  const TokenRow* rows;
  int64_t num_rows;
  uint64_t seed;
  int layer;
  int64_t heads[3];  // q, k, v
  int64_t head_size;
  void* out[3];      // [>= num_rows, heads[op], head_size]
};

template <class T>
__device__ T from_float(float x);
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <class T>
__global__ void fill_qkv_kernel(FillArgs a) {
  const int64_t width = (a.heads[0] + a.heads[1] + a.heads[2]) * a.head_size;
  const int64_t total = a.num_rows * width;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / width;
    int64_t i = idx - r * width;
    int op = 0;
    while (i >= a.heads[op] * a.head_size) i -= a.heads[op++] * a.head_size;
    const TokenRow t = a.rows[r];
    const uint64_t stream = hash::stream_seed(a.seed, op, a.layer, t.identity, t.pos);
    static_cast<T*>(a.out[op])[r * a.heads[op] * a.head_size + i] =
        from_float<T>(hash::element(stream, i, hash::range_of(op)));
  }
}

}  // namespace

void fill_qkv_cuda(const QkvFill& f, void* stream) {
  if (f.rows.empty()) return;
  const flashserve::DType dt = f.q.dtype;
  FillArgs a{f.device_rows, int64_t(f.rows.size()), f.act->seed(), f.layer,
             {f.q.size(1), f.k.size(1), f.v.size(1)}, f.q.size(2), {f.q.data, f.k.data, f.v.data}};
  const int64_t total = a.num_rows * (a.heads[0] + a.heads[1] + a.heads[2]) * a.head_size;
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((total + threads - 1) / threads, 132 * 32));
  auto s = static_cast<cudaStream_t>(stream);
  if (dt == flashserve::DType::bf16) fill_qkv_kernel<__nv_bfloat16><<<blocks, threads, 0, s>>>(a);
  else if (dt == flashserve::DType::f16) fill_qkv_kernel<__half><<<blocks, threads, 0, s>>>(a);
  else throw std::invalid_argument("fill_qkv_cuda: activations f16 or bf16, got " + std::string(flashserve::dtype_name(dt)));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("fill_qkv_kernel launch: ") + cudaGetErrorString(e));
}

}  // namespace serving
