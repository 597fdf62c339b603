#include "support/sim_comm.hpp"

#include <cstring>
#include <thread>

#include "flashserve/numeric.hpp"
#include "flashserve/status.hpp"
#include "support/host_tensor.hpp"

namespace fstest {

namespace fs = flashserve;

namespace {

// Byte offset of index `idx` in t.
int64_t offset_of(const fs::TensorRef& t, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (int d = 0; d < t.ndim; ++d) off += idx[size_t(d)] * t.stride[size_t(d)];
  return off * int64_t(fs::dtype_size(t.dtype));
}

// `out` must be [world, ...in's shape]; throws naming the mismatch.
void check_stacked(const fs::TensorRef& stacked, const fs::TensorRef& one, int world, const char* what) {
  bool ok = stacked.ndim == one.ndim + 1 && stacked.size(0) == world && stacked.dtype == one.dtype;
  for (int d = 0; ok && d < one.ndim; ++d) ok = stacked.size(d + 1) == one.size(d);
  if (!ok)
    fs::fail_arg(what, fs::detail::cat("[", world, ", ", one.shape_str().substr(1), " of ", fs::dtype_name(one.dtype)),
                 fs::detail::cat(stacked.shape_str(), " of ", fs::dtype_name(stacked.dtype)));
}

}  // namespace

int SimComm::world_size() const { return group_->world_size(); }

void SimComm::all_gather(const fs::TensorRef& in, const fs::TensorRef& out, void*) {
  check_stacked(out, in, world_size(), "all_gather out");
  if (!out.is_contiguous()) fs::fail_arg("all_gather out", "a contiguous tensor", describe(out));
  group_->meet(rank_, &in);
  const size_t es = fs::dtype_size(in.dtype);
  for (int p = 0; p < world_size(); ++p) {
    const fs::TensorRef& src = *group_->inputs_[size_t(p)];
    const fs::TensorRef dst = out.select(0, p);
    for_each_index(src, [&](const std::vector<int64_t>& idx, int64_t off) {
      std::memcpy(static_cast<char*>(dst.data) + offset_of(dst, idx),
                  static_cast<const char*>(src.data) + off * int64_t(es), es);
    });
  }
  group_->leave();
}

void SimComm::reduce_scatter(const fs::TensorRef& in, const fs::TensorRef& out, void*) {
  check_stacked(in, out, world_size(), "reduce_scatter in");
  group_->meet(rank_, &in);
  const size_t es = fs::dtype_size(out.dtype);
  for_each_index(out, [&](const std::vector<int64_t>& idx, int64_t off) {
    double sum = 0.0;
    for (int p = 0; p < world_size(); ++p) {
      const fs::TensorRef src = group_->inputs_[size_t(p)]->select(0, rank_);
      sum += fs::numeric::load_double(static_cast<const char*>(src.data) + offset_of(src, idx), src.dtype);
    }
    fs::numeric::store_float(static_cast<char*>(out.data) + off * int64_t(es), out.dtype, float(sum));
  });
  group_->leave();
}

SimGroup::SimGroup(int world) : world_(world), inputs_(size_t(world), nullptr) {}

void SimGroup::run(const std::function<void(SimComm&)>& fn) {
  barrier_ = std::make_unique<std::barrier<>>(world_);
  failed_ = false;
  error_ = nullptr;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_; ++r) {
    threads.emplace_back([this, r, &fn] {
      SimComm comm(*this, r);
      try {
        fn(comm);
      } catch (...) {
        fail(std::current_exception());
        barrier_->arrive_and_drop();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (error_) std::rethrow_exception(error_);
}

void SimGroup::meet(int rank, const fs::TensorRef* in) {
  inputs_[size_t(rank)] = in;
  barrier_->arrive_and_wait();
  if (failed_) throw fs::RuntimeError("sim_comm: another rank failed");
}

void SimGroup::leave() {
  barrier_->arrive_and_wait();
  if (failed_) throw fs::RuntimeError("sim_comm: another rank failed");
}

void SimGroup::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) error_ = e;
  failed_ = true;
}

}  // namespace fstest
