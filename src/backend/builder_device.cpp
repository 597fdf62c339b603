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

// The staging elements this mode's views (and device-side tables) read: the arena is laid out
// so each mode uses a prefix (split / cascade / encoder with advance_src, then local, then the
// tree's parts and (request, position) pairs; the tree's slot table and advance_slots are
// written on the device).
size_t used_prefix(const State& s) {
  const int32_t* end = nullptr;
  switch (s.decision.mode) {
    case Mode::split:
    case Mode::cascade:
    case Mode::encoder: end = s.advance_src.data() + s.advance_src.size(); break;
    case Mode::local: end = s.local_table.data() + s.local_table.size(); break;
    case Mode::tree: end = s.tree_src.data() + 2 * s.in.num_tokens * s.config.max_draft_depth; break;
  }
  return size_t(end - s.arena.host());
}

void rebase(const Arena& a, TensorRef& t) {
  if (t.data == nullptr || !a.holds(t.data)) return;
  t.data = a.on_device(static_cast<const int32_t*>(t.data));
  t.device = a.device();
}

void rebase(const Arena& a, PartMetadata& p) {
  for (TensorRef* t : {&p.cu_seqlens_q, &p.seqused_k, &p.cp_tot_seqused_k, &p.block_table}) rebase(a, *t);
}

// The engine's device block table of the stored inputs.
kernels::EngineTable engine_table(const State& s) {
  const TensorRef& t = s.in.block_table;
  return {static_cast<const int32_t*>(t.data), t.size(1), t.stride[0], s.config.block_size};
}

// Slots of n (request, position) pairs staged at `src` through the engine's device block table.
void slots_on_device(const State& s, const int32_t* src, int64_t n, int64_t empty, int32_t* out32, int64_t* out64) {
  kernels::TableSlots k;
  k.t = engine_table(s);
  k.req_pos = s.arena.on_device(src);
  k.n = n;
  k.empty = empty;
  k.out32 = out32;
  k.out64 = out64;
  kernels::table_slots(k, s.config.stream);
}

}  // namespace
#endif

int64_t* advance_slots_device(const State& s) {
#if FLASHSERVE_WITH_CUDA
  const Arena& a = s.arena;
  if (a.device_copy()) return reinterpret_cast<int64_t*>(a.on_device(s.advance_slots.data()));
#endif
  return nullptr;
}

void publish(State& s) {
  if (!s.in.on_device) return;
#if FLASHSERVE_WITH_CUDA
  const Arena& a = s.arena;
  void* stream = s.config.stream;
  kernels::metadata_upload(a.device_copy(), a.host(), used_prefix(s) * sizeof(int32_t), stream, a.event());
  AttentionMetadata& md = s.md;
  if (s.decision.mode == Mode::local) {
    kernels::LocalTableGather g;
    g.t = engine_table(s);
    g.k_start = a.on_device(s.local_k_start.data());
    g.request = a.on_device(s.local_request.data());
    g.num_virtual = md.local.part.num_reqs;
    g.width = s.local_width;
    g.out = a.on_device(s.local_table.data());
    kernels::gather_local_block_table(g, stream);
  }
  if (s.decision.mode == Mode::tree)
    slots_on_device(s, s.tree_src.data(), s.in.num_tokens * s.config.max_draft_depth, 0,
                    a.on_device(s.tree_table.data()), nullptr);
  if (s.advance_pending)
    slots_on_device(s, s.advance_src.data(), s.in.num_reqs, -1, nullptr, advance_slots_device(s));
  s.advance_pending = false;
  for (PartMetadata* p : {&md.decode, &md.prefill, &md.cascade.prefix, &md.cascade.suffix, &md.local.part,
                          &md.tree.prefix, &md.tree.tree})
    rebase(a, *p);
#endif
}

}  // namespace flashserve::backend::builder
