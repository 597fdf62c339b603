// Device q/k/v generation (qkv_fill.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "activation_hash.hpp"
#include "qkv_fill.hpp"

namespace serving {

namespace {

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

// One CTA per token row: each thread derives the row's three streams once, then writes every
// blockDim-th element of the row (q's heads, then k's, then v's).
template <class T>
__global__ void fill_qkv_kernel(FillArgs a) {
  const TokenRow t = a.rows[blockIdx.x];
  uint64_t stream[3];
  for (int op = 0; op < 3; ++op) stream[op] = hash::stream_seed(a.seed, op, a.layer, t.identity, t.pos);
  for (int op = 0; op < 3; ++op) {
    const int64_t n = a.heads[op] * a.head_size;
    T* row = static_cast<T*>(a.out[op]) + int64_t(blockIdx.x) * n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      row[i] = from_float<T>(hash::element(stream[op], i, hash::range_of(op)));
  }
}

}  // namespace

void fill_qkv_cuda(const QkvFill& f, void* stream) {
  if (f.rows.empty()) return;
  const flashserve::DType dt = f.q.dtype;
  FillArgs a{f.device_rows, int64_t(f.rows.size()), f.act->seed(), f.layer,
             {f.q.size(1), f.k.size(1), f.v.size(1)}, f.q.size(2), {f.q.data, f.k.data, f.v.data}};
  if (a.num_rows > INT_MAX) throw std::invalid_argument("fill_qkv_cuda: at most INT_MAX rows");
  const unsigned blocks = unsigned(a.num_rows), threads = 256;
  auto s = static_cast<cudaStream_t>(stream);
  if (dt == flashserve::DType::bf16) fill_qkv_kernel<__nv_bfloat16><<<blocks, threads, 0, s>>>(a);
  else if (dt == flashserve::DType::f16) fill_qkv_kernel<__half><<<blocks, threads, 0, s>>>(a);
  else throw std::invalid_argument("fill_qkv_cuda: activations f16 or bf16, got " + std::string(flashserve::dtype_name(dt)));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("fill_qkv_kernel launch: ") + cudaGetErrorString(e));
}

}  // namespace serving
