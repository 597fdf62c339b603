// The backend layer (SPEC.md §6): what a serving engine calls once per step (build metadata)
// and once per layer (forward). Everything here is host orchestration over the operations of
// attention.hpp / cache.hpp / merge.hpp; the same code runs on the CPU reference and on CUDA.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::backend {

// ---------------------------------------------------------------- capabilities, cache spec

enum class AttnType : uint8_t {
  decoder,          // causal self-attention over the paged cache
  encoder,          // encoder self-attention of an encoder-decoder model: no cache, non-causal
  encoder_only,     // encoder-only model: no cache, non-causal
  encoder_decoder,  // cross-attention: decoder queries over a cache filled once from the encoder
};

// A layer's static description (the engine's AttentionImpl constructor arguments).
struct LayerSpec {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  int64_t head_size_v = 0;          // 0: head_size
  float scale = 0.0f;               // 0: head_size^-0.5
  AttnType type = AttnType::decoder;
  int64_t sliding_window = 0;       // 0: none. Window (w-1, 0) for decoders, (w-1, w-1) encoder-only
  int64_t attention_chunk_size = 0; // > 0: chunked local attention (virtual batches)
  float softcap = 0.0f;
  OptTensor alibi_slopes;           // fp32 [H]
  bool alibi_sqrt = false;          // ALiBi bias slope * sqrt(|i' - j|) (the int8 fork's sqrt_alibi)
  OptTensor sinks;                  // [H]
  KvCacheDType kv_cache_dtype = KvCacheDType::auto_;
  KvLayout kv_layout = KvLayout::nhd;
  DType dtype = DType::bf16;        // activations (q/k/v/out)
  bool writes_kv_cache = true;      // false: shares another layer's cache (KV sharing)
};

// The visibility window a layer uses (SPEC.md §6: decoders (w-1, 0), encoder-only (w-1, w-1)).
Window layer_window(const LayerSpec& spec);

struct Capabilities {
  static std::vector<int64_t> supported_head_sizes();  // multiples of 8 up to 256
  static bool supports_head_size(int64_t head_size, int64_t head_size_v = 0);  // + MLA pairs
  static std::vector<DType> supported_dtypes(const DeviceProps& dev);          // f16, bf16 (+ f32 on cpu)
  static std::vector<std::string> supported_kv_cache_dtypes();
  static bool supports_block_size(int64_t block_size);                         // any >= 1
  static bool supports_compute_capability(const DeviceProps& dev);             // cpu, or sm80+
  static bool supports_sinks() { return true; }
  // "" when supported, else the first reason ("head size 20: ...").
  static std::string unsupported_reason(const LayerSpec& spec, int64_t block_size, const DeviceProps& dev);
};

// vLLM's cache shape (2, num_blocks, block_size, H_kv, D) and the permutation from that
// logical shape to the physical layout, for NHD/HND, with or without a leading layers dim.
std::array<int64_t, 5> kv_cache_shape(int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                      int64_t head_size);
std::vector<int> kv_cache_stride_order(KvLayout layout, bool include_num_layers_dimension);

// One layer's paged cache as the forward sees it.
struct KvCache {
  TensorRef key_cache{};      // [num_blocks, block_size, H_kv, D] (NHD) or HND, per layout
  TensorRef value_cache{};    // as key_cache with Dv
  OptTensor k_scale{};        // fp8: fp32 [] / [H_kv]; int8 K8V8: unused for k
  OptTensor v_scale{};        // fp8: as k_scale; int8 K8V8: fp32 [H_kv, Dv]
  OptTensor k_scale_cache{};  // int8: fp32 [num_blocks, H_kv, block_size]
  OptTensor q_descale{};      // fp8 q (the engine quantized it; vLLM's layer._q_scale): fp32
                              // [] / [1] / [H_kv]; absent = 1.0. Given for a non-fp8 q: an error
};

// ---------------------------------------------------------------- metadata builder

// What the engine already computed for the step (vLLM's CommonAttentionMetadata). Host
// arrays are read by the builder; device tensors are only referenced by the metadata.
struct CommonMetadata {
  int64_t num_reqs = 0;
  int64_t num_actual_tokens = 0;             // sum of query lengths
  int64_t max_query_len = 0;
  int64_t max_seq_len = 0;
  std::span<const int32_t> query_start_loc;  // host [num_reqs + 1]
  std::span<const int32_t> seq_lens;         // host [num_reqs]: KV length after this step
  TensorRef block_table;                     // int32 [>= num_reqs, max_blocks] (row stride free)
  TensorRef slot_mapping;                    // int64 [>= num_actual_tokens]
  bool causal = true;
  std::span<const int32_t> encoder_seq_lens; // host [num_reqs], cross-attention only
};

struct BuilderConfig {
  LayerSpec layer;                   // the layer group's shape (heads, sizes, window, chunk, alibi)
  int64_t block_size = 16;
  int reorder_batch_threshold = 1;   // decode part: query_len <= this (spec-decode: 1 + num_spec)
  bool enable_cascade = true;
  DeviceProps device{};
  // CUDA-graph mode: fixed-capacity buffers for the largest captured batch; replay updates in place.
  int64_t max_num_reqs = 256;
  int64_t max_num_tokens = 8192;
  int64_t max_blocks_per_req = 2048;
  int max_num_splits = 32;           // bound so the split-KV workspace is preallocated
  // 0: each part's split count from the heuristic (capped at max_num_splits). > 0: every part
  // asks for this many (capped at max_num_splits and at the keys' granules), independent of
  // the batch: CUDA graphs capture a fixed split count, and eager steps then split alike.
  int num_splits = 0;
  // Decode context parallelism: this rank's share of the KV (seq_lens stay global). Position t
  // lives on rank (t / dcp_interleave) % dcp_world_size (vLLM's cp_kv_cache_interleave_size;
  // see DcpAttentionLayer); the engine's slot_mapping gives -1 for positions of other ranks.
  int dcp_world_size = 1;
  int dcp_rank = 0;
  int64_t dcp_interleave = 1;
  int64_t max_draft_depth = 32;      // tree verify: longest draft path (width of the tree pass's slot table)
  // CUDA metadata (a CUDA `device` and the engine's block_table / slot_mapping on it): the
  // cudaStream_t (null = the default stream) of the one async host-to-device copy per build.
  // The builder stages in pinned memory it owns; the next build waits for that copy to finish
  // before rewriting the staging buffer.
  void* stream = nullptr;
  // Batch-invariant mode (AttentionParams::batch_invariant): every part's calls are planned with
  // it (fixed-size splits for the decode part, none for longer queries: the prefill part's
  // max_seqlen_q bound is raised past kBatchInvariantDecodeMaxQ so its class never follows the
  // batch), cascade is off (its prefix depends on the batch); num_splits 0 or 1,
  // reorder_batch_threshold <= kBatchInvariantDecodeMaxQ; the workspace bound is
  // max_invariant_split_rows. vLLM's VLLM_BATCH_INVARIANT, SGLang's
  // enable_deterministic_inference.
  bool batch_invariant = false;
};

// One varlen attention call over a contiguous run of (reordered) requests.
struct PartMetadata {
  int64_t req_begin = 0, num_reqs = 0;       // requests [req_begin, req_begin + num_reqs)
  int64_t token_begin = 0, num_tokens = 0;   // query rows [token_begin, token_begin + num_tokens)
  int64_t max_query_len = 0, max_seq_len = 0;
  TensorRef cu_seqlens_q;                    // int32 [num_reqs + 1], relative to token_begin
  TensorRef seqused_k;                       // int32 [num_reqs]
  TensorRef cp_tot_seqused_k;                // int32 [num_reqs], DCP only: global KV lengths; else ndim 0
  TensorRef block_table;                     // int32 [num_reqs, max_blocks] (view)
  bool causal = true;
  Plan plan;                                 // split-KV plan for this call
  bool empty() const { return num_reqs == 0; }
};

// Shared-prefix (cascade) attention: prefix pass (all tokens of the batch against the
// common prefix blocks, non-causal, one "request") ⊕ suffix pass (each request against its
// own remaining blocks, causal), merged with merge_states.
struct CascadeMetadata {
  bool enabled = false;
  int64_t common_prefix_len = 0;   // tokens, a multiple of block_size
  PartMetadata prefix;             // 1 request of num_actual_tokens queries
  PartMetadata suffix;
};

// Chunked local attention as virtual requests, one per (request, chunk) touched by queries.
struct LocalMetadata {
  bool enabled = false;
  PartMetadata part;               // virtual batch: cu_seqlens_q, seqused_k, block_table
};

// Speculative verify with a draft tree (top-k > 1): committed-prefix pass (each draft token
// sees every committed token) ⊕ tree pass (each draft token a request of one query whose KV is
// its ancestor path in the tree, itself included), merged.
struct TreeMetadata {
  bool enabled = false;
  PartMetadata prefix;             // requests: draft queries vs committed KV, non-causal
  PartMetadata tree;               // one request per draft token, block size 1 table of slots
};

struct AttentionMetadata {
  int64_t num_actual_tokens = 0;
  int64_t num_reqs = 0;
  int64_t num_decodes = 0, num_decode_tokens = 0;
  int64_t num_prefills = 0, num_prefill_tokens = 0;
  TensorRef slot_mapping;          // int64 [num_actual_tokens]
  PartMetadata decode;             // requests [0, num_decodes)
  PartMetadata prefill;            // requests [num_decodes, num_reqs)
  CascadeMetadata cascade;         // when taken, replaces decode + prefill
  LocalMetadata local;             // when the layer is chunked-local, replaces decode + prefill
  TreeMetadata tree;
  int dcp_world_size = 1, dcp_rank = 0;  // the builder's decode-context-parallel config
  int64_t dcp_interleave = 1;
};

// Draft tree of a speculative verify step: for each request, its draft tokens' parents.
struct DraftTree {
  std::span<const int32_t> parents;     // host [num_draft_tokens total]: index of the parent
                                        // within the request's drafts, -1 = the committed tip
  std::span<const int32_t> num_drafts;  // host [num_reqs]
};

// Builds per-step metadata into buffers it owns (sized once from the config: no allocation
// per step). In graph mode the buffers are the captured ones and build() rewrites them in
// place. Not thread-safe; one per KV-cache group. With CUDA tensors (and a CUDA config) the
// metadata's own tensors live in a device buffer the builder owns, filled by one async copy per
// build on BuilderConfig::stream (encoder layers, which have no block table: when their
// optional slot_mapping is a CUDA tensor); tree verify's and advance_decode_step's slots are
// computed on the device from the engine's block table (the same slots slot_mapping holds).
class MetadataBuilder {
 public:
  explicit MetadataBuilder(const BuilderConfig& config);
  ~MetadataBuilder();
  MetadataBuilder(const MetadataBuilder&) = delete;
  MetadataBuilder& operator=(const MetadataBuilder&) = delete;

  // `common_prefix_len`: tokens shared by every request (the scheduler's count; the builder
  // rounds down to whole blocks and decides on cascade). Requests must be reordered with the
  // decode part first (see reorder_decodes_first).
  const AttentionMetadata& build(const CommonMetadata& common, int64_t common_prefix_len = 0,
                                 const DraftTree* tree = nullptr);
  // Reuse the last metadata for a layer group with another block table (same shapes).
  const AttentionMetadata& update_block_table(const TensorRef& block_table);
  // Multi-step decode: advance the last decode-only metadata by one token per request
  // (seq_lens + 1; slot_mapping from the block table into the builder's own buffer).
  const AttentionMetadata& advance_decode_step();
  const BuilderConfig& config() const;
  // Bytes of split-KV workspace the largest batch of the config can need.
  size_t max_workspace_bytes() const;

 private:
  struct State;
  State* state_;
};

// Permutation that puts requests with query_len <= threshold first (stable); the engine
// applies it to its batch. Returns the new order as indices into the old.
std::vector<int32_t> reorder_decodes_first(std::span<const int32_t> query_lens, int threshold);

// The cascade decision (SPEC.md §6): prefix >= 256 tokens, >= 8 requests, no ALiBi, window,
// local attention or context parallelism, and the cost model (parameterized by SM count)
// predicts cascade faster than split-KV decode.
bool use_cascade(int64_t common_prefix_len, std::span<const int32_t> query_lens, const LayerSpec& layer,
                 int dcp_world_size, const DeviceProps& dev);

// ---------------------------------------------------------------- layer forward

// Decode-context-parallel communication (NcclCommunicator in flashserve/nccl.hpp, or
// simulated ranks in tests). Collectives are enqueued on `stream` (the layer's ExecContext
// stream; null on the CPU) and every rank calls the same ones in the same order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // out[r] = in of rank r: out is [world, ...in's shape] (contiguous). `in` may be out[rank]
  // itself (in place).
  virtual void all_gather(const TensorRef& in, const TensorRef& out, void* stream) = 0;
  // out = sum over ranks of in[rank's slice r]: in is [world, ...out's shape] (contiguous).
  virtual void reduce_scatter(const TensorRef& in, const TensorRef& out, void* stream) = 0;
};

// Scratch the forward needs (fp32 partial outputs and LSEs for cascade/tree/DCP merges, and
// the split-KV workspace), preallocated by the engine: size from AttentionLayer::workspace_bytes.
struct LayerWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
  Device device{};
};

class AttentionLayer {
 public:
  explicit AttentionLayer(const LayerSpec& spec);
  const LayerSpec& spec() const { return spec_; }
  // Workspace for batches up to the builder's capacities.
  size_t workspace_bytes(const BuilderConfig& config) const;

  // q [T, H, D]; key/value [T, H_kv, D(v)] (new tokens, written to the cache unless the layer
  // shares another layer's cache; absent for cross-attention after the first step); out
  // [T, H, Dv]. Encoder types take no cache: key/value are the whole sequences and the
  // metadata's query_start_loc describes both. Never allocates, never waits on the device.
  void forward(const AttentionMetadata& md, const TensorRef& q, const OptTensor& key, const OptTensor& value,
               const KvCache* cache, const TensorRef& out, const LayerWorkspace& ws,
               const ExecContext& ctx = {}) const;

  // Writes key/value [>= n, H_kv, D(v)] at slot_mapping int64 [n] into the cache (vLLM's
  // do_kv_cache_update, for a forward that does not write: spec.writes_kv_cache = false). The
  // cache format and layout are the spec's; encoder types have no cache (an error).
  void update_kv_cache(const TensorRef& key, const TensorRef& value, const KvCache& cache,
                       const TensorRef& slot_mapping, const ExecContext& ctx = {}) const;

 private:
  LayerSpec spec_;
};

}  // namespace flashserve::backend
