// make_tma_map: cuTensorMapEncodeTiled over a normalized operand (tma_map.cuh).
#include <cudaTypedefs.h>

#include "flashserve/status.hpp"
#include "kernels/attention/select.hpp"
#include "kernels/common/cuda_check.cuh"
#include "kernels/common/tma_map.cuh"

namespace flashserve::kernels {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    FS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !f)
      throw RuntimeError("TMA: the driver has no cuTensorMapEncodeTiled (a CUDA 12 driver is needed)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A stride in bytes TMA accepts for a dim of size n: the stride itself, or for n == 1 (never
// stepped) the channels' span.
uint64_t stride_bytes(int64_t stride, int64_t n, int64_t channels, int64_t es) {
  return uint64_t(n > 1 ? stride : channels) * uint64_t(es);
}

int64_t elem_bytes(const StridedRef& ref) { return int64_t(dtype_size(ref.dtype)); }

}  // namespace

bool tma_mappable(const StridedRef& ref, int64_t n0, int64_t n1, int64_t heads, int64_t channels) {
  if (!ref.data || reinterpret_cast<uintptr_t>(ref.data) % 16 != 0 || ref.stride[3] != 1 || channels < 1 ||
      channels >= (int64_t(1) << 31))
    return false;
  const int64_t sizes[3] = {n0, n1, heads};
  for (int d = 0; d < 3; ++d)
    if (!tma_dim_ok(sizes[d], ref.stride[d], elem_bytes(ref))) return false;
  return true;
}

CUtensorMap make_tma_map(const StridedRef& ref, int64_t n0, int64_t n1, int64_t heads, int64_t channels,
                         int box_rows, const char* what) {
  if (!tma_mappable(ref, n0, n1, heads, channels))
    throw RuntimeError(detail::cat("TMA: ", what, " cannot be mapped (alignment, strides or sizes)"));
  CUtensorMap map;
  const cuuint64_t dims[4] = {cuuint64_t(channels), cuuint64_t(heads), cuuint64_t(n1), cuuint64_t(n0)};
  const int64_t es = elem_bytes(ref);
  const cuuint64_t strides[3] = {stride_bytes(ref.stride[2], heads, channels, es),
                                 stride_bytes(ref.stride[1], n1, channels, es),
                                 stride_bytes(ref.stride[0], n0, channels, es)};
  const cuuint32_t box[4] = {cuuint32_t(128 / es), 1, cuuint32_t(box_rows), 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dt = es == 1                     ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                 : ref.dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode_fn()(&map, dt, 4, const_cast<void*>(ref.data), dims, strides, box, elem,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw RuntimeError(detail::cat("TMA: cuTensorMapEncodeTiled failed for ", what, " (", int(r), ")"));
  return map;
}

}  // namespace flashserve::kernels
