// Building blocks of the backend layers (backend.hpp, backend_variants.hpp): named workspace
// sub-buffers, views of a layer's KV cache, the query operand, and one attention pass of a
// layer over one part of the batch. Host orchestration only: every byte of math runs in the
// operations of attention.hpp / cache.hpp / merge.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "flashserve/backend.hpp"

namespace flashserve::backend::layer {

// ---------------------------------------------------------------- workspace

// Named sub-buffers carved in order from a LayerWorkspace, each aligned to kWorkspaceAlign.
// A dry run (default-constructed) hands out null views and only counts bytes, so
// workspace_bytes() and forward() share the code that carves. An overflow names the buffer.
class Carver {
 public:
  Carver() = default;
  explicit Carver(const LayerWorkspace& ws) : ws_(&ws) {}
  // A contiguous view of `dtype`, sized for elements of at least `sized_as` bytes (a state
  // sized as fp32 holds any activation dtype).
  TensorRef take(std::string_view name, DType dtype, std::initializer_list<int64_t> shape,
                 DType sized_as = DType::u8);
  void* take_bytes(std::string_view name, size_t bytes);
  // The rest of the workspace (aligned), for a nested layer's own carving.
  LayerWorkspace rest() const;
  size_t used() const { return used_; }

 private:
  const LayerWorkspace* ws_ = nullptr;
  size_t used_ = 0;
};

// A partial attention state of a varlen pass: o [T, H, Dv] and lse fp32 [H, T].
struct State {
  TensorRef o, lse;
};
// A partial state (o [T, H, Dv] of o_dtype, lse fp32 [H, T]) from the workspace: fp32 by
// default, so a merge of partial states loses nothing to the activation dtype.
State take_state(Carver& c, std::string_view o_name, std::string_view lse_name, int64_t T, int64_t H, int64_t Dv,
                 DType o_dtype = DType::f32);

// ---------------------------------------------------------------- operands

// What every pass of a layer hands to the attention call (SPEC.md §2 modifiers).
struct Modifiers {
  float scale = 0.0f;
  float softcap = 0.0f;
  OptTensor alibi_slopes;  // fp32 [H]
  bool alibi_sqrt = false;
  OptTensor sinks;         // [H]: enters one pass per merged output row
  Window window{};
};
Modifiers modifiers_of(const LayerSpec& spec);

// The query operand: q [T, H, D] as given, or (int8 caches) its dynamic int8 quantization.
struct Query {
  TensorRef q;
  OptTensor q_scale;  // fp32 [T, H] with an int8 q
};
bool is_int8(KvCacheDType t);
bool is_fp8(KvCacheDType t);
// Buffers "q_int8" [T, H, D] and "q_scale" fp32 [T, H], carved for int8 caches only.
struct QueryBuffers {
  OptTensor q8, scale;
};
QueryBuffers take_query_buffers(Carver& ws, KvCacheDType cache_dtype, int64_t T, int64_t H, int64_t D);
// Rows [0, T) of q, quantized into the buffers when they are present.
Query prepare_query(const TensorRef& q, int64_t T, const QueryBuffers& b, const ExecContext& ctx);

// A paged cache as the attention call reads it: physical layout, stored format, scales.
struct CacheView {
  TensorRef k, v;            // layout order; fp8 caches typed f8* (u8 storage retyped)
  KvLayout layout = KvLayout::nhd;
  KvCacheDType dtype = KvCacheDType::auto_;
  OptTensor k_scale, v_scale;  // fp8: fp32 [] / [1] / [H_kv]; int8 K8V8 v_scale [H_kv, Dv]
  OptTensor k_scale_cache;     // int8: fp32 [num_blocks, H_kv, block_size]
  OptTensor q_descale;         // fp8 q: fp32 [] / [1] / [H_kv]
  int64_t num_kv_heads() const { return layout == KvLayout::nhd ? k.size(2) : k.size(1); }
};
CacheView cache_view(const KvCache& cache, const LayerSpec& spec);
// KV heads [begin, end) of the cache and its per-head scales.
CacheView slice_kv_heads(const CacheView& c, int64_t begin, int64_t end);
// The same storage with block size 1, so a "block" index is a slot (block * block_size +
// offset). Needs evenly spaced slots (NHD with block stride = block_size * slot stride);
// otherwise NotImplemented naming the layout.
CacheView slot_view(const CacheView& c);

// Writes key/value of the tokens of md.slot_mapping into the cache (reshape_and_cache).
void write_cache(const KvCache& cache, const LayerSpec& spec, const TensorRef& key, const TensorRef& value,
                 const TensorRef& slot_mapping, const ExecContext& ctx);

// ---------------------------------------------------------------- one attention pass

// One varlen call over the rows [part.token_begin, + part.num_tokens) of q/out (and of lse's
// token dim). `sink`: pass the layer's sinks (once per output row over merged passes).
// The call runs on ctx's stream with ctx's workspace (the carved split-KV buffer) and the
// part's plan when the builder made it for this call's heads, head sizes and page size (a
// builder configured for the whole layer has no plan for a variant's head subset: that call
// plans itself); a plan of those dimensions that does not match the call is an error.
struct Pass {
  const PartMetadata* part = nullptr;
  bool causal = false;
  bool sink = true;
  TensorRef out;     // [T, H, Dv]: the whole batch's rows
  OptTensor lse;     // fp32 [H, T]
};

// Extra fields a pass may carry (decode context parallelism).
struct PassExtras {
  int cp_world_size = 1, cp_rank = 0;
  int64_t cp_interleave = 1;
  OptTensor cp_tot_seqused_k;  // int32 [num_reqs of the part]
};

// Over the paged cache with the part's block table and KV lengths.
void paged_pass(const Modifiers& m, const Query& q, const CacheView& cache, const Pass& pass,
                const ExecContext& ctx, const PassExtras& extras = {});
// Over contiguous key/value [T, H_kv, D] whose sequences are the part's query sequences
// (encoders: cu_seqlens_k = cu_seqlens_q).
void self_pass(const Modifiers& m, const Query& q, const TensorRef& key, const TensorRef& value, const Pass& pass,
               const ExecContext& ctx);

// The most split partial rows a call of up to config.max_num_tokens rows of H heads can plan
// on `dev`: max_num_splits x max_num_tokens x H, capped at max_split_rows(dev).
int64_t split_partial_rows(const BuilderConfig& config, int64_t H, const DeviceProps& dev);

// Upper bound on the split-KV workspace of one call of up to config.max_num_tokens rows (CUDA
// plans only; the CPU reference needs none).
size_t split_kv_bound(const BuilderConfig& config, int64_t H, int64_t Dv);

// The value head size of a layer: head_size_v, or head_size when it is 0.
inline int64_t head_size_v(const LayerSpec& s) { return s.head_size_v > 0 ? s.head_size_v : s.head_size; }

// Rejects CUDA tensors for the host-side steps of the variants (NotImplemented naming `what`).
void require_host(const TensorRef& t, std::string_view what);

}  // namespace flashserve::backend::layer
