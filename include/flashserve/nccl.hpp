// A Communicator over NCCL for decode context parallelism (backend::DcpAttentionLayer), in
// builds configured with FLASHSERVE_NCCL=ON (and FLASHSERVE_CUDA=ON) where NCCL was found:
// flashserve_WITH_NCCL / FLASHSERVE_WITH_NCCL says so. No NCCL or CUDA headers here.
//
// One communicator per rank (one process per GPU, or one thread per GPU of a process). The
// collectives are enqueued on the layer's ExecContext stream and never synchronize, so a
// DcpAttentionLayer::forward captures in a CUDA graph with them (NCCL >= 2.9 supports capture).
#pragma once

#include <array>

#include "flashserve/backend.hpp"

#if !defined(FLASHSERVE_WITH_NCCL)
#define FLASHSERVE_WITH_NCCL 0
#endif

#if FLASHSERVE_WITH_NCCL

namespace flashserve::backend {

// ncclUniqueId's bytes: made by one rank (nccl_unique_id) and sent to the others by the engine's
// own bootstrap (a socket, torch.distributed's store, MPI, ...).
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};
NcclUniqueId nccl_unique_id();

class NcclCommunicator final : public Communicator {
 public:
  // ncclCommInitRank on the current CUDA device: every rank of the group calls it with the same
  // id (blocking until all have). The communicator is destroyed with this object.
  NcclCommunicator(const NcclUniqueId& id, int world_size, int rank);
  // An existing ncclComm_t (e.g. from ncclCommInitAll, or the engine's own); `owned`: destroy it
  // with this object.
  NcclCommunicator(void* nccl_comm, bool owned);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  void* nccl_comm() const { return comm_; }  // the ncclComm_t

  // ncclAllGather. `in` contiguous, or rows of a 2-D packable view (dims after the first
  // contiguous, e.g. q [T, H, D] sliced from a wider qkv row): then packed into out[rank] by one
  // cudaMemcpy2DAsync and gathered in place. out contiguous, in's dtype.
  void all_gather(const TensorRef& in, const TensorRef& out, void* stream) override;
  // ncclReduceScatter (sum) over in [world, ...out's shape], both contiguous, one dtype
  // (f32 / f16 / bf16 / i32 / i64).
  void reduce_scatter(const TensorRef& in, const TensorRef& out, void* stream) override;

 private:
  void* comm_ = nullptr;
  bool owned_ = false;
  int rank_ = 0, world_ = 1;
};

}  // namespace flashserve::backend

#endif  // FLASHSERVE_WITH_NCCL
