// CUDA metadata of the builder (builder_state.hpp): the arena's memory and the upload after
// each compose. No CUDA headers here: the CUDA calls live in kernels/metadata_upload.*.
//
// The staging block is pinned and owned by the builder; the upload of one build must have read
// it before the next build rewrites it, so wait_upload synchronizes with the last upload's event
// (normally long done: the engine has waited on the previous step's results).
#include <cstring>

#include "backend/builder_state.hpp"
#include "flashserve/status.hpp"

#if FLASHSERVE_WITH_CUDA
#include "kernels/metadata_upload.hpp"
#endif

namespace flashserve::backend::builder {

bool arena_on_device(const BuilderConfig& c) {
  return FLASHSERVE_WITH_CUDA && c.device.device.type == DeviceType::cuda;
}

Arena::Arena(size_t elems, const Device& device) : device_at_(device), elems_(elems) {
#if FLASHSERVE_WITH_CUDA
  if (device.type == DeviceType::cuda) {
    const size_t bytes = elems * sizeof(int32_t);
    try {
      host_ = static_cast<int32_t*>(kernels::metadata_pinned_alloc(bytes));
      device_ = static_cast<int32_t*>(kernels::metadata_device_alloc(bytes, device.index));
      event_ = kernels::metadata_event_create(device.index);
    } catch (...) {
      kernels::metadata_device_free(device_, device.index);
      kernels::metadata_pinned_free(host_);
      throw;
    }
    if (host_) std::memset(host_, 0, bytes);
    return;
  }
#endif
  pageable_.assign(elems, 0);
  host_ = pageable_.data();
}

Arena::~Arena() {
#if FLASHSERVE_WITH_CUDA
  if (device_at_.type != DeviceType::cuda) return;
  if (event_) {
    try {
      kernels::metadata_upload_wait(event_);  // the copy still reading the staging must end first
    } catch (...) {
    }
  }
  kernels::metadata_event_destroy(event_, device_at_.index);
  kernels::metadata_device_free(device_, device_at_.index);
  kernels::metadata_pinned_free(host_);
#endif
}

std::span<int32_t> Arena::take(size_t n) {
  if (used_ + n > elems_)
    throw RuntimeError(detail::cat("metadata builder arena: ", used_ + n, " elements carved from ", elems_));
  const std::span<int32_t> s(host_ + used_, n);
  used_ += n;
  return s;
}

bool Arena::holds(const void* p) const {
  const auto* q = static_cast<const int32_t*>(p);
  return host_ && q >= host_ && q <= host_ + elems_;
}

void wait_upload(State& s) {
#if FLASHSERVE_WITH_CUDA
  if (s.arena.event()) kernels::metadata_upload_wait(s.arena.event());
#endif
}

#if FLASHSERVE_WITH_CUDA
namespace {

// The staging elements this mode's views can read: the arena is laid out so each mode uses a
// prefix (split / cascade / encoder, then local, then tree).
size_t used_prefix(const State& s) {
  const int32_t* end = nullptr;
  switch (s.decision.mode) {
    case Mode::split:
    case Mode::cascade:
    case Mode::encoder: end = s.cascade_suffix.seqused_global.data() + s.cascade_suffix.seqused_global.size(); break;
    case Mode::local: end = s.local_table.data() + s.local_table.size(); break;
    case Mode::tree: end = s.arena.host() + s.arena.elems(); break;
  }
  return size_t(end - s.arena.host());
}

void rebase(const Arena& a, TensorRef& t) {
  if (t.data == nullptr || !a.holds(t.data)) return;
  t.data = a.device_copy() + (static_cast<const int32_t*>(t.data) - a.host());
  t.device = a.device();
}

void rebase(const Arena& a, PartMetadata& p) {
  for (TensorRef* t : {&p.cu_seqlens_q, &p.seqused_k, &p.cp_tot_seqused_k, &p.block_table}) rebase(a, *t);
}

}  // namespace
#endif

void publish(State& s) {
  if (!s.in.on_device) return;
#if FLASHSERVE_WITH_CUDA
  const Arena& a = s.arena;
  void* stream = s.config.stream;
  kernels::metadata_upload(a.device_copy(), a.host(), used_prefix(s) * sizeof(int32_t), stream, a.event());
  AttentionMetadata& md = s.md;
  if (s.decision.mode == Mode::local) {
    const TensorRef& t = s.in.block_table;
    kernels::LocalTableGather g;
    g.table = static_cast<const int32_t*>(t.data);
    g.cols = t.size(1);
    g.row_stride = t.stride[0];
    g.block_size = s.config.block_size;
    g.k_start = a.device_copy() + (s.local_k_start.data() - a.host());
    g.request = a.device_copy() + (s.local_request.data() - a.host());
    g.num_virtual = md.local.part.num_reqs;
    g.width = s.local_width;
    g.out = a.device_copy() + (s.local_table.data() - a.host());
    kernels::gather_local_block_table(g, stream);
  }
  for (PartMetadata* p : {&md.decode, &md.prefill, &md.cascade.prefix, &md.cascade.suffix, &md.local.part,
                          &md.tree.prefix, &md.tree.tree})
    rebase(a, *p);
#endif
}

}  // namespace flashserve::backend::builder
