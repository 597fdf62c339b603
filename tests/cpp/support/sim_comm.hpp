// Simulated decode-context-parallel ranks for tests: each rank is a thread of one process and
// every collective meets at a barrier. All ranks must call the same collectives in the same
// order (as with NCCL). When a rank throws, the others stop at their next collective.
#pragma once

#include <atomic>
#include <barrier>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "flashserve/backend.hpp"

namespace fstest {

class SimGroup;

// One rank's handle on the group (the Communicator the layer sees).
class SimComm final : public flashserve::backend::Communicator {
 public:
  SimComm(SimGroup& group, int rank) : group_(&group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override;
  // out [world, ...in's shape] (contiguous, in's dtype) = every rank's in, in rank order.
  void all_gather(const flashserve::TensorRef& in, const flashserve::TensorRef& out, void* stream = nullptr) override;
  // out = sum over ranks r (in rank order, in double) of in_r[rank]; in is [world, ...out's shape].
  void reduce_scatter(const flashserve::TensorRef& in, const flashserve::TensorRef& out, void* stream = nullptr) override;

 private:
  SimGroup* group_;
  int rank_;
};

class SimGroup {
 public:
  explicit SimGroup(int world);
  int world_size() const { return world_; }
  // Runs fn(comm) on one thread per rank and joins them; rethrows the first exception.
  void run(const std::function<void(SimComm&)>& fn);

 private:
  friend class SimComm;
  // Publishes this rank's input and waits for every rank's; throws if a rank has failed.
  void meet(int rank, const flashserve::TensorRef* in);
  // Waits until every rank has read the inputs of this collective.
  void leave();
  void fail(std::exception_ptr e);

  int world_;
  std::unique_ptr<std::barrier<>> barrier_;  // one per run (a failed rank drops out of it)
  std::vector<const flashserve::TensorRef*> inputs_;
  std::mutex mu_;
  std::exception_ptr error_;
  std::atomic<bool> failed_ = false;
};

}  // namespace fstest
