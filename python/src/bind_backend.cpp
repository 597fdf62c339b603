// The backend layer's bindings (backend.hpp, SPEC.md §6): the layer spec, device properties,
// the metadata builder and its metadata (an opaque handle with a few counts), the attention
// layer, capabilities and vLLM's cache shape / stride order. Conversion only: every check and
// decision is the C++ API's.
//
// Lifetimes: the metadata a build returns is the builder's own (its buffers are rewritten in
// place by the next build), so it keeps the builder alive (reference_internal). The builder
// keeps the engine's block_table / slot_mapping tensors of its last build alive, and specs
// keep their alibi_slopes / sinks tensors alive.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "convert.hpp"
#include "flashserve/backend.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace flashserve::py {

namespace {

using namespace flashserve::backend;

// ---------------------------------------------------------------- enums from strings

constexpr std::pair<std::string_view, AttnType> kAttnTypes[] = {
    {"decoder", AttnType::decoder},
    {"encoder", AttnType::encoder},
    {"encoder_only", AttnType::encoder_only},
    {"encoder_decoder", AttnType::encoder_decoder},
};

AttnType attn_type_arg(std::string_view s) {
  for (const auto& [name, t] : kAttnTypes)
    if (name == s) return t;
  fail_arg("attn_type", "one of decoder, encoder, encoder_only, encoder_decoder", detail::cat("'", s, "'"));
}

KvLayout layout_arg(std::string_view s, const char* arg) {
  if (s == "NHD" || s == "nhd") return KvLayout::nhd;
  if (s == "HND" || s == "hnd") return KvLayout::hnd;
  fail_arg(arg, "NHD or HND", detail::cat("'", s, "'"));
}

DType activation_dtype_arg(std::string_view s) {
  for (DType t : {DType::f16, DType::bf16, DType::f32})
    if (dtype_name(t) == s) return t;
  fail_arg("dtype", "float16, bfloat16 or float32", detail::cat("'", s, "'"));
}

// ---------------------------------------------------------------- arguments

TensorRef tensor_or_none(nb::handle obj, const char* name) { return opt_tensor_arg(obj, name).value_or(TensorRef{}); }

// ---------------------------------------------------------------- owning wrappers

// A LayerSpec with the Python tensors its OptTensors reference.
struct PyLayerSpec {
  LayerSpec spec;
  nb::object alibi_slopes, sinks;
};

struct PyBuilder {
  MetadataBuilder builder;
  nb::object spec;                       // the PyLayerSpec the config copied
  nb::object block_table, slot_mapping;  // the engine's tensors the metadata references
  PyBuilder(const BuilderConfig& c, nb::object s) : builder(c), spec(std::move(s)) {}
};

struct PyLayer {
  AttentionLayer layer;
  nb::object spec;
  PyLayer(const LayerSpec& s, nb::object keep) : layer(s), spec(std::move(keep)) {}
};

void init_spec(PyLayerSpec* self, int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t head_size_v,
               float scale, std::string_view attn_type, int64_t sliding_window, int64_t attention_chunk_size,
               float softcap, nb::handle alibi_slopes, nb::handle sinks, std::string_view kv_cache_dtype,
               std::string_view kv_layout, std::string_view dtype, bool writes_kv_cache, bool alibi_sqrt) {
  LayerSpec s;
  s.num_heads = num_heads;
  s.num_kv_heads = num_kv_heads;
  s.head_size = head_size;
  s.head_size_v = head_size_v;
  s.scale = scale;
  s.type = attn_type_arg(attn_type);
  s.sliding_window = sliding_window;
  s.attention_chunk_size = attention_chunk_size;
  s.softcap = softcap;
  s.alibi_slopes = opt_tensor_arg(alibi_slopes, "alibi_slopes");
  s.sinks = opt_tensor_arg(sinks, "sinks");
  s.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  s.kv_layout = layout_arg(kv_layout, "kv_layout");
  s.dtype = activation_dtype_arg(dtype);
  s.writes_kv_cache = writes_kv_cache;
  s.alibi_sqrt = alibi_sqrt;
  new (self) PyLayerSpec{s, nb::borrow(alibi_slopes), nb::borrow(sinks)};
}

void init_builder(PyBuilder* self, nb::object spec, int64_t block_size, int reorder_batch_threshold,
                  bool enable_cascade, const DeviceProps& device, int64_t max_num_reqs, int64_t max_num_tokens,
                  int64_t max_blocks_per_req, int max_num_splits, int num_splits, int dcp_world_size, int dcp_rank,
                  int64_t max_draft_depth, nb::handle stream, int64_t dcp_interleave, bool batch_invariant) {
  BuilderConfig c;
  c.layer = nb::cast<const PyLayerSpec&>(spec).spec;
  c.block_size = block_size;
  c.reorder_batch_threshold = reorder_batch_threshold;
  c.enable_cascade = enable_cascade;
  c.device = device;
  c.max_num_reqs = max_num_reqs;
  c.max_num_tokens = max_num_tokens;
  c.max_blocks_per_req = max_blocks_per_req;
  c.max_num_splits = max_num_splits;
  c.num_splits = num_splits;
  c.batch_invariant = batch_invariant;
  c.dcp_world_size = dcp_world_size;
  c.dcp_rank = dcp_rank;
  c.dcp_interleave = dcp_interleave;
  c.max_draft_depth = max_draft_depth;
  c.stream = stream_arg(stream);
  new (self) PyBuilder(c, std::move(spec));
}

const AttentionMetadata& build(PyBuilder& b, nb::handle query_start_loc, nb::handle seq_lens, nb::handle block_table,
                               nb::handle slot_mapping, int64_t num_reqs, int64_t num_actual_tokens,
                               int64_t max_query_len, int64_t max_seq_len, bool causal, int64_t common_prefix_len,
                               nb::handle encoder_seq_lens, nb::handle draft_parents, nb::handle num_drafts) {
  CommonMetadata cm;
  cm.num_reqs = num_reqs;
  cm.num_actual_tokens = num_actual_tokens;
  cm.max_query_len = max_query_len;
  cm.max_seq_len = max_seq_len;
  cm.query_start_loc = opt_host_i32_arg(query_start_loc, "query_start_loc");
  cm.seq_lens = opt_host_i32_arg(seq_lens, "seq_lens");
  cm.block_table = tensor_or_none(block_table, "block_table");
  cm.slot_mapping = tensor_or_none(slot_mapping, "slot_mapping");
  cm.causal = causal;
  cm.encoder_seq_lens = opt_host_i32_arg(encoder_seq_lens, "encoder_seq_lens");
  if (draft_parents.is_none() != num_drafts.is_none())
    fail_arg(draft_parents.is_none() ? "draft_parents" : "num_drafts", "given together with the other", "None");
  const DraftTree tree{opt_host_i32_arg(draft_parents, "draft_parents"), opt_host_i32_arg(num_drafts, "num_drafts")};
  const AttentionMetadata& md = b.builder.build(cm, common_prefix_len, draft_parents.is_none() ? nullptr : &tree);
  b.block_table = nb::borrow(block_table);
  b.slot_mapping = nb::borrow(slot_mapping);
  return md;
}

const AttentionMetadata& update_block_table(PyBuilder& b, nb::handle block_table) {
  const AttentionMetadata& md = b.builder.update_block_table(tensor_arg(block_table, "block_table"));
  b.block_table = nb::borrow(block_table);
  return md;
}

KvCache kv_cache_arg(nb::handle key_cache, nb::handle value_cache, nb::handle k_scale, nb::handle v_scale,
                     nb::handle k_scale_cache, nb::handle q_descale) {
  KvCache cache;
  cache.key_cache = tensor_arg(key_cache, "key_cache");
  cache.value_cache = tensor_arg(value_cache, "value_cache");
  cache.k_scale = opt_tensor_arg(k_scale, "k_scale");
  cache.v_scale = opt_tensor_arg(v_scale, "v_scale");
  cache.k_scale_cache = opt_tensor_arg(k_scale_cache, "k_scale_cache");
  cache.q_descale = opt_tensor_arg(q_descale, "q_descale");
  return cache;
}

LayerWorkspace workspace_arg(nb::handle workspace) {
  if (workspace.is_none()) return {};
  const TensorRef w = tensor_arg(workspace, "workspace");
  if (!w.is_contiguous()) fail_arg("workspace", "a contiguous tensor", w.shape_str());
  return LayerWorkspace{w.data, size_t(w.numel()) * dtype_size(w.dtype), w.device};
}

void forward(const PyLayer& l, const AttentionMetadata& md, nb::handle q, nb::handle key, nb::handle value,
             nb::handle key_cache, nb::handle value_cache, nb::handle out, nb::handle workspace, nb::handle k_scale,
             nb::handle v_scale, nb::handle k_scale_cache, nb::handle q_descale, nb::handle stream) {
  KvCache cache;
  const bool cached = !key_cache.is_none() || !value_cache.is_none();
  if (cached) cache = kv_cache_arg(key_cache, value_cache, k_scale, v_scale, k_scale_cache, q_descale);
  else if (!q_descale.is_none()) fail_arg("q_descale", "None for a layer without a KV cache", "a tensor");
  ExecContext ctx = stream_context(stream);
  l.layer.forward(md, tensor_arg(q, "q"), opt_tensor_arg(key, "key"), opt_tensor_arg(value, "value"),
                  cached ? &cache : nullptr, tensor_arg(out, "out"), workspace_arg(workspace), ctx);
}

void update_kv_cache(const PyLayer& l, nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache,
                     nb::handle slot_mapping, nb::handle k_scale, nb::handle v_scale, nb::handle k_scale_cache,
                     nb::handle stream) {
  const KvCache cache = kv_cache_arg(key_cache, value_cache, k_scale, v_scale, k_scale_cache, nb::none());
  l.layer.update_kv_cache(tensor_arg(key, "key"), tensor_arg(value, "value"), cache,
                          tensor_arg(slot_mapping, "slot_mapping"), stream_context(stream));
}

// ---------------------------------------------------------------- variants

struct PyDifferential {
  DifferentialAttentionLayer layer;
  nb::object spec, tensors;  // the PyLayerSpec and the λ / RMSNorm tensors the spec references
  PyDifferential(const DifferentialSpec& s, nb::object sp, nb::object t)
      : layer(s), spec(std::move(sp)), tensors(std::move(t)) {}
};

void init_differential(PyDifferential* self, nb::object spec, nb::handle lambda_q1, nb::handle lambda_k1,
                       nb::handle lambda_q2, nb::handle lambda_k2, nb::handle subln_weight, float lambda_init,
                       float rms_eps) {
  DifferentialSpec s;
  s.base = nb::cast<const PyLayerSpec&>(spec).spec;
  s.lambda_q1 = tensor_arg(lambda_q1, "lambda_q1");
  s.lambda_k1 = tensor_arg(lambda_k1, "lambda_k1");
  s.lambda_q2 = tensor_arg(lambda_q2, "lambda_q2");
  s.lambda_k2 = tensor_arg(lambda_k2, "lambda_k2");
  s.subln_weight = tensor_arg(subln_weight, "subln_weight");
  s.lambda_init = lambda_init;
  s.rms_eps = rms_eps;
  nb::tuple keep = nb::make_tuple(lambda_q1, lambda_k1, lambda_q2, lambda_k2, subln_weight);
  new (self) PyDifferential(s, std::move(spec), std::move(keep));
}

void differential_forward(const PyDifferential& l, const AttentionMetadata& md, nb::handle q, nb::handle key,
                          nb::handle value, nb::handle key_cache1, nb::handle value_cache1, nb::handle key_cache2,
                          nb::handle value_cache2, nb::handle out, nb::handle workspace, nb::handle k_scale,
                          nb::handle v_scale, nb::handle stream) {
  DifferentialCache cache;
  const bool cached = !key_cache1.is_none();
  if (cached) {
    cache.half1 = kv_cache_arg(key_cache1, value_cache1, k_scale, v_scale, nb::none(), nb::none());
    cache.half2 = kv_cache_arg(key_cache2, value_cache2, k_scale, v_scale, nb::none(), nb::none());
  }
  l.layer.forward(md, tensor_arg(q, "q"), opt_tensor_arg(key, "key"), opt_tensor_arg(value, "value"), cache,
                  tensor_arg(out, "out"), workspace_arg(workspace), stream_context(stream));
}

// Decode context parallelism: the phases of DcpAttentionLayer, for an engine that runs the
// collectives itself (flashserve.dcp over torch.distributed).
struct PyDcp {
  DcpAttentionLayer layer;
  nb::object spec;
  PyDcp(const LayerSpec& s, int world, int rank, nb::object keep) : layer(s, world, rank), spec(std::move(keep)) {}
};

void dcp_write_kv(const PyDcp& l, const AttentionMetadata& md, nb::handle key, nb::handle value, nb::handle key_cache,
                  nb::handle value_cache, nb::handle k_scale, nb::handle v_scale, nb::handle k_scale_cache,
                  nb::handle stream) {
  const KvCache cache = kv_cache_arg(key_cache, value_cache, k_scale, v_scale, k_scale_cache, nb::none());
  l.layer.write_kv(md, tensor_arg(key, "key"), tensor_arg(value, "value"), cache, stream_context(stream));
}

void dcp_attend(const PyDcp& l, const AttentionMetadata& md, nb::handle q_all, nb::handle key_cache,
                nb::handle value_cache, nb::handle out_all, nb::handle lse_local, nb::handle workspace,
                nb::handle k_scale, nb::handle v_scale, nb::handle k_scale_cache, nb::handle q_descale,
                nb::handle stream) {
  const KvCache cache = kv_cache_arg(key_cache, value_cache, k_scale, v_scale, k_scale_cache, q_descale);
  l.layer.attend(md, tensor_arg(q_all, "q_all"), cache, tensor_arg(out_all, "out_all"),
                 tensor_arg(lse_local, "lse_local"), workspace_arg(workspace), stream_context(stream));
}

void dcp_correct(const PyDcp& l, nb::handle out_all, nb::handle lse_all, nb::handle stream) {
  l.layer.correct(tensor_arg(out_all, "out_all"), tensor_arg(lse_all, "lse_all"), stream_context(stream));
}

// The MLA prefill's part: the prefill requests of cu_seqlens_q (device int32 [B + 1]) over q's rows.
PartMetadata mla_part(const TensorRef& q, nb::handle cu_seqlens_q, int64_t max_query_len) {
  PartMetadata part;
  part.cu_seqlens_q = tensor_arg(cu_seqlens_q, "cu_seqlens_q");
  if (part.cu_seqlens_q.ndim != 1 || part.cu_seqlens_q.size(0) < 1)
    fail_arg("cu_seqlens_q", "int32 [num_prefills + 1]", part.cu_seqlens_q.shape_str());
  part.num_reqs = part.cu_seqlens_q.size(0) - 1;
  part.num_tokens = q.ndim > 0 ? q.size(0) : 0;
  part.max_query_len = max_query_len;
  part.causal = true;
  return part;
}

void mla_prefill(const MlaLayer& l, nb::handle q, nb::handle k, nb::handle v, nb::handle cu_seqlens_q,
                 int64_t max_query_len, nb::list context, nb::handle out, nb::handle workspace, nb::handle stream) {
  const TensorRef qt = tensor_arg(q, "q");
  const PartMetadata part = mla_part(qt, cu_seqlens_q, max_query_len);
  std::vector<MlaContextChunk> chunks;
  for (nb::handle item : context) {
    nb::tuple t = nb::cast<nb::tuple>(item);
    if (t.size() != 4) fail_arg("context", "(k, v, cu_seqlens_k, max_seqlen_k) tuples", detail::cat(t.size(), "-tuple"));
    chunks.push_back(MlaContextChunk{tensor_arg(t[0], "context k"), tensor_arg(t[1], "context v"),
                                     tensor_arg(t[2], "context cu_seqlens_k"), nb::cast<int64_t>(t[3])});
  }
  l.prefill(part, qt, tensor_arg(k, "k"), tensor_arg(v, "v"), chunks, tensor_arg(out, "out"), workspace_arg(workspace),
            stream_context(stream));
}

nb::tuple int_tuple(const auto& values) {
  nb::list l;
  for (auto v : values) l.append(int64_t(v));
  return nb::tuple(l);
}

std::vector<int32_t> reorder(nb::handle query_lens, int threshold) {
  return reorder_decodes_first(opt_host_i32_arg(query_lens, "query_lens"), threshold);
}

// ---------------------------------------------------------------- registration

void register_spec(nb::module_& m) {
  nb::class_<PyLayerSpec>(m, "LayerSpec", "A layer's static description (backend::LayerSpec).")
      .def("__init__", &init_spec, "num_heads"_a, "num_kv_heads"_a, "head_size"_a, nb::kw_only(), "head_size_v"_a = 0,
           "scale"_a = 0.0f, "attn_type"_a = "decoder", "sliding_window"_a = 0, "attention_chunk_size"_a = 0,
           "softcap"_a = 0.0f, "alibi_slopes"_a = nb::none(), "sinks"_a = nb::none(), "kv_cache_dtype"_a = "auto",
           "kv_layout"_a = "NHD", "dtype"_a = "bfloat16", "writes_kv_cache"_a = true, "alibi_sqrt"_a = false)
      .def_prop_ro("num_heads", [](const PyLayerSpec& s) { return s.spec.num_heads; })
      .def_prop_ro("num_kv_heads", [](const PyLayerSpec& s) { return s.spec.num_kv_heads; })
      .def_prop_ro("head_size", [](const PyLayerSpec& s) { return s.spec.head_size; })
      .def_prop_ro("kv_cache_dtype",
                   [](const PyLayerSpec& s) { return std::string(kv_cache_dtype_name(s.spec.kv_cache_dtype)); });

  nb::class_<DeviceProps>(m, "DeviceProps", "What the planner knows of a device (num_sms, compute capability).")
      .def_static("cpu", &DeviceProps::cpu)
      .def_static(
          "cuda",
          [](int index, int num_sms, int cc_major, int cc_minor) {
            return DeviceProps{Device{DeviceType::cuda, index}, num_sms, cc_major, cc_minor};
          },
          "index"_a, "num_sms"_a, "cc_major"_a, "cc_minor"_a)
      .def_prop_ro("device", [](const DeviceProps& d) { return to_string(d.device); })
      .def_ro("num_sms", &DeviceProps::num_sms)
      .def_ro("cc_major", &DeviceProps::cc_major)
      .def_ro("cc_minor", &DeviceProps::cc_minor);
}

void register_metadata(nb::module_& m) {
  nb::class_<AttentionMetadata>(m, "AttentionMetadata",
                                "A build's metadata: the builder's own, valid until its next build.")
      .def_ro("num_actual_tokens", &AttentionMetadata::num_actual_tokens)
      .def_ro("num_reqs", &AttentionMetadata::num_reqs)
      .def_ro("num_decodes", &AttentionMetadata::num_decodes)
      .def_ro("num_decode_tokens", &AttentionMetadata::num_decode_tokens)
      .def_ro("num_prefills", &AttentionMetadata::num_prefills)
      .def_ro("num_prefill_tokens", &AttentionMetadata::num_prefill_tokens)
      .def_prop_ro("use_cascade", [](const AttentionMetadata& md) { return md.cascade.enabled; })
      .def_prop_ro("common_prefix_len", [](const AttentionMetadata& md) { return md.cascade.common_prefix_len; })
      .def_prop_ro("use_local", [](const AttentionMetadata& md) { return md.local.enabled; })
      .def_prop_ro("num_local_reqs", [](const AttentionMetadata& md) { return md.local.part.num_reqs; })
      .def_prop_ro("use_tree", [](const AttentionMetadata& md) { return md.tree.enabled; })
      .def_ro("dcp_world_size", &AttentionMetadata::dcp_world_size)
      .def_ro("dcp_rank", &AttentionMetadata::dcp_rank)
      .def_ro("dcp_interleave", &AttentionMetadata::dcp_interleave)
      .def_prop_ro("decode_num_splits", [](const AttentionMetadata& md) { return md.decode.plan.num_splits; })
      .def_prop_ro("prefill_num_splits", [](const AttentionMetadata& md) { return md.prefill.plan.num_splits; });

  nb::class_<PyBuilder>(m, "MetadataBuilder", "Per-step metadata into fixed buffers (backend::MetadataBuilder).")
      .def("__init__", &init_builder, "spec"_a, nb::kw_only(), "block_size"_a = 16, "reorder_batch_threshold"_a = 1,
           "enable_cascade"_a = true, "device"_a = DeviceProps::cpu(), "max_num_reqs"_a = 256,
           "max_num_tokens"_a = 8192, "max_blocks_per_req"_a = 2048, "max_num_splits"_a = 32, "num_splits"_a = 0, "dcp_world_size"_a = 1,
           "dcp_rank"_a = 0, "max_draft_depth"_a = 32, "stream"_a = nb::none(), "dcp_interleave"_a = 1,
           "batch_invariant"_a = false)
      .def("build", &build, nb::rv_policy::reference_internal, "query_start_loc"_a, "seq_lens"_a.none(),
           "block_table"_a.none(), "slot_mapping"_a.none(), nb::kw_only(), "num_reqs"_a, "num_actual_tokens"_a,
           "max_query_len"_a, "max_seq_len"_a, "causal"_a = true, "common_prefix_len"_a = 0,
           "encoder_seq_lens"_a = nb::none(), "draft_parents"_a = nb::none(), "num_drafts"_a = nb::none())
      .def("update_block_table", &update_block_table, nb::rv_policy::reference_internal, "block_table"_a)
      .def(
          "advance_decode_step",
          [](PyBuilder& b) -> const AttentionMetadata& { return b.builder.advance_decode_step(); },
          nb::rv_policy::reference_internal)
      .def("max_workspace_bytes", [](const PyBuilder& b) { return b.builder.max_workspace_bytes(); });
}

void register_layer(nb::module_& m) {
  nb::class_<PyLayer>(m, "AttentionLayer", "One layer's forward over the metadata (backend::AttentionLayer).")
      .def(
          "__init__",
          [](PyLayer* self, nb::object spec) {
            const LayerSpec& s = nb::cast<const PyLayerSpec&>(spec).spec;
            new (self) PyLayer(s, std::move(spec));
          },
          "spec"_a)
      .def(
          "workspace_bytes",
          [](const PyLayer& l, const PyBuilder& b) { return l.layer.workspace_bytes(b.builder.config()); }, "builder"_a)
      .def("forward", &forward, "metadata"_a, "q"_a, "key"_a.none(), "value"_a.none(), "key_cache"_a.none(),
           "value_cache"_a.none(), "out"_a, "workspace"_a.none(), nb::kw_only(), "k_scale"_a = nb::none(),
           "v_scale"_a = nb::none(), "k_scale_cache"_a = nb::none(), "q_descale"_a = nb::none(),
           "stream"_a = nb::none())
      .def("update_kv_cache", &update_kv_cache, "key"_a, "value"_a, "key_cache"_a, "value_cache"_a, "slot_mapping"_a,
           nb::kw_only(), "k_scale"_a = nb::none(), "v_scale"_a = nb::none(), "k_scale_cache"_a = nb::none(),
           "stream"_a = nb::none());
}

void register_variants(nb::module_& m) {
  nb::class_<PyDifferential>(m, "DifferentialAttentionLayer",
                             "Differential attention over two half caches (backend::DifferentialAttentionLayer).")
      .def("__init__", &init_differential, "spec"_a, nb::kw_only(), "lambda_q1"_a, "lambda_k1"_a, "lambda_q2"_a,
           "lambda_k2"_a, "subln_weight"_a, "lambda_init"_a = 0.8f, "rms_eps"_a = 1e-5f)
      .def("lambda_full", [](const PyDifferential& l) { return l.layer.lambda_full(); })
      .def(
          "workspace_bytes",
          [](const PyDifferential& l, const PyBuilder& b) { return l.layer.workspace_bytes(b.builder.config()); },
          "builder"_a)
      .def("forward", &differential_forward, "metadata"_a, "q"_a, "key"_a.none(), "value"_a.none(),
           "key_cache1"_a.none(), "value_cache1"_a.none(), "key_cache2"_a.none(), "value_cache2"_a.none(), "out"_a,
           "workspace"_a.none(), nb::kw_only(), "k_scale"_a = nb::none(), "v_scale"_a = nb::none(),
           "stream"_a = nb::none());

  nb::class_<PyDcp>(m, "DcpAttentionLayer",
                    "Decode context parallelism's per-rank phases (backend::DcpAttentionLayer): write_kv, "
                    "attend (all-gathered queries over the local KV shard, with LSE), correct (by every rank's LSE).")
      .def(
          "__init__",
          [](PyDcp* self, nb::object spec, int world_size, int rank) {
            const LayerSpec& s = nb::cast<const PyLayerSpec&>(spec).spec;
            new (self) PyDcp(s, world_size, rank, std::move(spec));
          },
          "spec"_a, nb::kw_only(), "world_size"_a, "rank"_a)
      .def_prop_ro("world_size", [](const PyDcp& l) { return l.layer.world_size(); })
      .def_prop_ro("rank", [](const PyDcp& l) { return l.layer.rank(); })
      .def(
          "attend_workspace_bytes",
          [](const PyDcp& l, const PyBuilder& b) { return l.layer.attend_workspace_bytes(b.builder.config()); },
          "builder"_a)
      .def("write_kv", &dcp_write_kv, "metadata"_a, "key"_a, "value"_a, "key_cache"_a, "value_cache"_a, nb::kw_only(),
           "k_scale"_a = nb::none(), "v_scale"_a = nb::none(), "k_scale_cache"_a = nb::none(),
           "stream"_a = nb::none())
      .def("attend", &dcp_attend, "metadata"_a, "q_all"_a, "key_cache"_a, "value_cache"_a, "out_all"_a, "lse_local"_a,
           "workspace"_a.none(), nb::kw_only(), "k_scale"_a = nb::none(), "v_scale"_a = nb::none(),
           "k_scale_cache"_a = nb::none(), "q_descale"_a = nb::none(), "stream"_a = nb::none())
      .def("correct", &dcp_correct, "out_all"_a, "lse_all"_a, nb::kw_only(), "stream"_a = nb::none())
      .def_static("local_len", &DcpAttentionLayer::local_len, "global_len"_a, "world_size"_a, "rank"_a,
                  "interleave"_a = 1)
      .def_static("owner", &DcpAttentionLayer::owner, "pos"_a, "world_size"_a, "interleave"_a = 1)
      .def_static("local_index", &DcpAttentionLayer::local_index, "pos"_a, "world_size"_a, "interleave"_a = 1);

  nb::class_<MlaLayer>(m, "MlaLayer", "MLA prefill (new tokens causal, context chunks merged by LSE) (backend::MlaLayer).")
      .def(
          "__init__",
          [](MlaLayer* self, int64_t num_heads, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
             int64_t qk_nope_head_dim, int64_t v_head_dim, float scale) {
            MlaSpec s;
            s.num_heads = num_heads;
            s.kv_lora_rank = kv_lora_rank;
            s.qk_rope_head_dim = qk_rope_head_dim;
            s.qk_nope_head_dim = qk_nope_head_dim;
            s.v_head_dim = v_head_dim;
            s.scale = scale;
            new (self) MlaLayer(s);
          },
          "num_heads"_a, nb::kw_only(), "kv_lora_rank"_a = 512, "qk_rope_head_dim"_a = 64, "qk_nope_head_dim"_a = 128,
          "v_head_dim"_a = 128, "scale"_a = 0.0f)
      .def(
          "workspace_bytes",
          [](const MlaLayer& l, int64_t max_num_tokens) {
            BuilderConfig c;
            c.max_num_tokens = max_num_tokens;
            return l.workspace_bytes(c);
          },
          "max_num_tokens"_a)
      .def("prefill", &mla_prefill, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "max_query_len"_a, "context"_a, "out"_a,
           "workspace"_a.none(), nb::kw_only(), "stream"_a = nb::none());
}

void register_capabilities(nb::module_& m) {
  nb::class_<Capabilities>(m, "Capabilities", "What the backend supports (backend::Capabilities).")
      .def_static("supported_head_sizes", &Capabilities::supported_head_sizes)
      .def_static("supports_head_size", &Capabilities::supports_head_size, "head_size"_a, "head_size_v"_a = 0)
      .def_static(
          "supported_dtypes",
          [](const DeviceProps& d) {
            std::vector<std::string> names;
            for (DType t : Capabilities::supported_dtypes(d)) names.emplace_back(dtype_name(t));
            return names;
          },
          "device"_a)
      .def_static("supported_kv_cache_dtypes", &Capabilities::supported_kv_cache_dtypes)
      .def_static("supports_block_size", &Capabilities::supports_block_size, "block_size"_a)
      .def_static("supports_compute_capability", &Capabilities::supports_compute_capability, "device"_a)
      .def_static("supports_sinks", &Capabilities::supports_sinks)
      .def_static(
          "unsupported_reason",
          [](const PyLayerSpec& s, int64_t block_size, const DeviceProps& d) {
            return Capabilities::unsupported_reason(s.spec, block_size, d);
          },
          "spec"_a, "block_size"_a, "device"_a);

  m.def(
      "kv_cache_shape",
      [](int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_size) {
        return int_tuple(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size));
      },
      "num_blocks"_a, "block_size"_a, "num_kv_heads"_a, "head_size"_a);
  m.def(
      "kv_cache_stride_order",
      [](std::string_view layout, bool include_num_layers_dimension) {
        return int_tuple(kv_cache_stride_order(layout_arg(layout, "layout"), include_num_layers_dimension));
      },
      "layout"_a = "NHD", "include_num_layers_dimension"_a = false);
  m.def("reorder_decodes_first", &reorder, "query_lens"_a, "threshold"_a = 1);
  m.def(
      "use_cascade",
      [](int64_t common_prefix_len, nb::handle query_lens, const PyLayerSpec& s, int dcp_world_size,
         const DeviceProps& d) {
        return use_cascade(common_prefix_len, opt_host_i32_arg(query_lens, "query_lens"), s.spec, dcp_world_size, d);
      },
      "common_prefix_len"_a, "query_lens"_a, "spec"_a, "dcp_world_size"_a = 1, "device"_a = DeviceProps::cpu());
}

}  // namespace

void register_backend(nb::module_& m) {
  register_spec(m);
  register_metadata(m);
  register_layer(m);
  register_variants(m);
  register_capabilities(m);
}

}  // namespace flashserve::py
