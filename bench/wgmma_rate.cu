// wgmma_rate: clocks per warpgroup MMA on one H100/H200 SM, by N, operand source (both from
// shared memory, or A from registers), accumulator chains and warpgroups. The MLA decode kernels
// run long chains of small-N wgmma (decode_mla_heads: m64n16k16, 36 for S and 32 for P V per
// 64-key tile; decode_mla_wgmma: m64n32k16) measured at ~50 clk each in the kernel where the
// tensor pipe would take 8: this separates the instruction's own cost (issue, operand fetch:
// A 2 KB + B N x 32 bytes from shared memory per k16 step) from the kernels' chains.
//   wgmma_rate             (sm_90a; prints one row per configuration)
// Each row: one CTA, `wgs` warpgroups each issuing kIters wgmma (bf16, fp32 accumulators) over
// zeroed shared tiles into `accs` accumulators in turn, committed in groups of `group`, timed
// with clock64 around the issue and the final wait (fully unrolled: no loop for ptxas to fence). clk/wgmma is per warpgroup; MAC/clk is the
// SM's (wgs x 64 x N x 16 per wgmma time); dense bf16 peak is 2048 MAC/clk/SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "kernels/common/wgmma.cuh"

namespace fk = flashserve::kernels;

namespace {

constexpr int kMaxWgs = 2;
constexpr int kIters = 144;  // wgmma per warpgroup per launch (4 x 36)
constexpr size_t kTileBytes = 64 * 128;  // one 64-row, 128-byte column block (8 KB)
// A tiles (kMaxWgs x 8 KB), then B tiles (kMaxWgs x N rows x 128 bytes, N <= 256): 80 KB.
constexpr size_t kSmemBytes = kMaxWgs * kTileBytes + kMaxWgs * 256 * 128 + 1024;

template <int N, int kAccs, bool kRs, int kGroup>
__global__ void __launch_bounds__(128 * kMaxWgs, 1) rate(long long* clocks, float* sink, int wgs) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = fk::align_1024(smem_raw);
  for (size_t i = threadIdx.x; i < (kSmemBytes - 1024) / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(sm)[i] = make_uint4(0u, 0u, 0u, 0u);
  fk::fence_proxy_async_shared();
  __syncthreads();
  const int wg = int(fk::warp_uniform(threadIdx.x / 128));
  if (wg >= wgs) return;
  const uint32_t a = fk::smem_u32(sm) + uint32_t(wg) * uint32_t(kTileBytes);
  const uint32_t b = fk::smem_u32(sm) + uint32_t(kMaxWgs * kTileBytes) + uint32_t(wg) * 256u * 128u;
  const uint64_t da = fk::desc_k_major<64>(a, 0, 0);
  // RS: B [16 (K), N] N-major, a SwizzledTile<16> of N / 64 column blocks (2 KB apart; N as the
  // tile's rows put N = 256's blocks 32 KB apart, past the warpgroup's B area: the illegal
  // address of the first run's last rows)
  const uint64_t db = kRs ? fk::desc_n_major<16>(b, 0) : fk::desc_k_major<N>(b, 0, 0);
  float acc[kAccs][N / 8][4];
#pragma unroll
  for (int j = 0; j < kAccs; ++j)
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][n][e] = 0.0f;
  uint32_t ra[4];  // RS: A from registers (zeros, loaded: constants would not be registers)
#pragma unroll
  for (int e = 0; e < 4; ++e) ra[e] = reinterpret_cast<const uint32_t*>(sm)[threadIdx.x % 128 * 4 + e];
  const long long t0 = clock64();
  fk::wgmma_fence();
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const uint32_t step = uint32_t(i & 3) * 32u;  // the k16 steps of a column block
    if constexpr (kRs) fk::wgmma_rs<__nv_bfloat16, N>(acc[i % kAccs], ra, db, 1);
    else fk::wgmma_ss<__nv_bfloat16, N>(acc[i % kAccs], fk::desc_plus(da, step), fk::desc_plus(db, step), 1);
    if ((i + 1) % kGroup == 0) fk::wgmma_commit();
  }
  fk::wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < kAccs; ++j) fk::fence_operands(acc[j]);
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kAccs; ++j)
#pragma unroll
    for (int n = 0; n < N / 8; ++n) s += acc[j][n][0];
  if (s != 0.0f) sink[threadIdx.x] = s;  // never: keeps the MMAs
  if (threadIdx.x % 128 == 0) clocks[wg] = t1 - t0;
#endif
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "wgmma_rate: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <int N, int kAccs, bool kRs, int kGroup>
void row(long long* clocks, float* sink, int wgs) {
  const auto kernel = &rate<N, kAccs, kRs, kGroup>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)), "smem limit");
  long long best = -1;
  for (int rep = 0; rep < 5; ++rep) {  // the least of 5 (the first warms the instruction cache)
    kernel<<<1, 128 * kMaxWgs, kSmemBytes>>>(clocks, sink, wgs);
    check(cudaGetLastError(), "launch");
    long long host[kMaxWgs] = {0, 0};
    check(cudaMemcpy(host, clocks, sizeof(host), cudaMemcpyDeviceToHost), "copy");
    long long worst = 0;
    for (int w = 0; w < wgs; ++w) worst = host[w] > worst ? host[w] : worst;
    if (best < 0 || worst < best) best = worst;
  }
  const double per = double(best) / kIters;
  std::printf("%-4s N=%-4d accs=%d group=%-3d wgs=%d  %8.1f clk/wgmma  %7.0f MAC/clk/SM\n", kRs ? "RS" : "SS", N, kAccs,
              kGroup, wgs, per, wgs * 64.0 * N * 16.0 / per);
}

template <int N, int kAccs>
void rows(long long* clocks, float* sink) {
  for (int wgs = 1; wgs <= kMaxWgs; ++wgs) {
    row<N, kAccs, false, 4>(clocks, sink, wgs);
    row<N, kAccs, false, 36>(clocks, sink, wgs);
    row<N, kAccs, true, 4>(clocks, sink, wgs);
  }
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  if (prop.major != 9) {
    std::printf("wgmma_rate: needs an sm_90 device (found sm_%d%d)\n", prop.major, prop.minor);
    return 0;
  }
  std::printf("wgmma_rate: %s, %d wgmma per warpgroup per row (least of 5 launches)\n", prop.name, kIters);
  long long* clocks = nullptr;
  float* sink = nullptr;
  check(cudaMalloc(&clocks, kMaxWgs * sizeof(long long)), "malloc");
  check(cudaMalloc(&sink, 128 * kMaxWgs * sizeof(float)), "malloc");
  rows<16, 1>(clocks, sink);
  rows<16, 4>(clocks, sink);
  rows<32, 1>(clocks, sink);
  rows<32, 4>(clocks, sink);
  rows<64, 1>(clocks, sink);
  rows<64, 2>(clocks, sink);
  rows<128, 1>(clocks, sink);
  rows<256, 1>(clocks, sink);
  cudaFree(clocks);
  cudaFree(sink);
  return 0;
}
