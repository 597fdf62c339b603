// backend::NcclCommunicator (flashserve/nccl.hpp): compiled only with FLASHSERVE_NCCL=ON
// (cmake/nccl.cmake), never in a CPU build.
#include "flashserve/nccl.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "common/check.hpp"
#include "flashserve/status.hpp"

namespace flashserve::backend {

namespace {

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw RuntimeError(detail::cat("NCCL ", what, ": ", ncclGetErrorString(r)));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(detail::cat("CUDA ", what, ": ", cudaGetErrorString(e)));
}

ncclDataType_t sum_type(DType t, const char* arg) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    default: fail_arg(arg, "f32, f16, bf16, i32 or i64 (a sum)", dtype_name(t));
  }
}

void check_cuda_tensor(const TensorRef& t, const char* arg) {
  if (t.device.type != DeviceType::cuda) fail_arg(arg, "a CUDA tensor", to_string(t.device));
}

// A view whose dims after the first are contiguous (rows of `row` elements, any row stride).
bool rows_packable(const TensorRef& t, int64_t& row) {
  row = 1;
  for (int d = t.ndim - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride[size_t(d)] != row) return false;
    row *= t.size(d);
  }
  return true;
}

}  // namespace

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  static_assert(sizeof(id) == sizeof(NcclUniqueId::bytes), "ncclUniqueId is 128 bytes");
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(const NcclUniqueId& id, int world_size, int rank)
    : owned_(true), rank_(rank), world_(world_size) {
  if (world_size < 1) fail_arg("world_size", ">= 1", world_size);
  if (rank < 0 || rank >= world_size) fail_arg("rank", detail::cat("a rank in [0, ", world_size, ")"), rank);
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, world_size, nid, rank), "ncclCommInitRank");
  comm_ = comm;
}

NcclCommunicator::NcclCommunicator(void* nccl_comm, bool owned) : comm_(nccl_comm), owned_(owned) {
  if (nccl_comm == nullptr) fail_arg("nccl_comm", "an ncclComm_t", "null");
  ncclComm_t comm = static_cast<ncclComm_t>(nccl_comm);
  check_nccl(ncclCommUserRank(comm, &rank_), "ncclCommUserRank");
  check_nccl(ncclCommCount(comm, &world_), "ncclCommCount");
}

NcclCommunicator::~NcclCommunicator() {
  if (owned_ && comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

void NcclCommunicator::all_gather(const TensorRef& in, const TensorRef& out, void* stream) {
  check_cuda_tensor(in, "all_gather in");
  check_cuda_tensor(out, "all_gather out");
  if (out.dtype != in.dtype) fail_arg("all_gather out", detail::cat(dtype_name(in.dtype), " (in's dtype)"),
                                      dtype_name(out.dtype));
  if (!out.is_contiguous()) fail_arg("all_gather out", "a contiguous tensor", out.shape_str());
  if (out.ndim < 1 || out.size(0) != world_ || out.numel() != in.numel() * world_)
    fail_arg("all_gather out", detail::cat("[", world_, ", ...in's shape ", in.shape_str(), "]"), out.shape_str());
  const size_t es = dtype_size(in.dtype), bytes = size_t(in.numel()) * es;
  if (bytes == 0) return;
  char* slot = static_cast<char*>(out.data) + size_t(rank_) * bytes;
  const void* send = in.data;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (!in.is_contiguous()) {
    int64_t row = 0;
    if (in.ndim < 2 || !rows_packable(in, row))
      fail_not_implemented("all_gather of a view that is not rows of contiguous elements (", in.shape_str(), ")");
    check_cuda(cudaMemcpy2DAsync(slot, size_t(row) * es, in.data, size_t(in.stride[0]) * es, size_t(row) * es,
                                 size_t(in.size(0)), cudaMemcpyDeviceToDevice, s),
               "cudaMemcpy2DAsync (packing all_gather in)");
    send = slot;
  }
  // Bytes: any dtype gathers alike; in place when send is out[rank].
  check_nccl(ncclAllGather(send, out.data, bytes, ncclUint8, static_cast<ncclComm_t>(comm_), s), "ncclAllGather");
}

void NcclCommunicator::reduce_scatter(const TensorRef& in, const TensorRef& out, void* stream) {
  check_cuda_tensor(in, "reduce_scatter in");
  check_cuda_tensor(out, "reduce_scatter out");
  if (out.dtype != in.dtype) fail_arg("reduce_scatter out", detail::cat(dtype_name(in.dtype), " (in's dtype)"),
                                      dtype_name(out.dtype));
  if (!in.is_contiguous() || !out.is_contiguous())
    fail_arg(in.is_contiguous() ? "reduce_scatter out" : "reduce_scatter in", "a contiguous tensor",
             (in.is_contiguous() ? out : in).shape_str());
  if (in.ndim < 1 || in.size(0) != world_ || in.numel() != out.numel() * world_)
    fail_arg("reduce_scatter in", detail::cat("[", world_, ", ...out's shape ", out.shape_str(), "]"), in.shape_str());
  if (out.numel() == 0) return;
  check_nccl(ncclReduceScatter(in.data, out.data, size_t(out.numel()), sum_type(in.dtype, "reduce_scatter in"),
                               ncclSum, static_cast<ncclComm_t>(comm_), static_cast<cudaStream_t>(stream)),
             "ncclReduceScatter");
}

}  // namespace flashserve::backend
