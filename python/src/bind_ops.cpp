// Bindings of the operations (attention.hpp, cache.hpp, merge.hpp, variants_ops.hpp): each
// function converts its arguments and calls the C++ API once. The Python layer (flashserve/)
// allocates every output and the attention workspace; nothing is allocated here.
//
// Scheduler metadata: a Plan travels through Python as an int32 tensor of kPlanWords words
// (header, split count and granularity, the ProblemShape it was made for but its total_q). A
// call given one rebuilds the typed Plan from it and hands it to the API, which rejects a plan
// made for another shape and re-sizes it for the call's rows of q; the words are never
// interpreted anywhere else.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "convert.hpp"
#include "flashserve/attention.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/merge.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/status.hpp"
#include "flashserve/variants_ops.hpp"


namespace nb = nanobind;
using namespace nb::literals;

namespace flashserve::py {

namespace {

// ---------------------------------------------------------------- plans as int32 words

constexpr int32_t kPlanMagic = 0x46535032;  // "FSP2"
// 13 words: the shape's fields as int32, without total_q (a call re-sizes the plan for its rows
// of q: a batch planned, then padded for a CUDA graph). Engines copy the metadata into a
// persistent buffer sized for FlashAttention-3's: vLLM's holds 1 + 4 * round_up(max batch, 4)
// >= 17 words (older: max_num_seqs + 1).
enum PlanWord : int {
  kMagic, kDeviceType, kNumSplits, kGranularity, kFlags,
  kShape,                      // 8 fields of ProblemShape (shape_fields)
  kPlanWords = kShape + 8,
};

constexpr std::array<const char*, 8> kShapeFieldNames = {"batch", "max_seqlen_q", "max_seqlen_k", "num_heads",
                                                         "num_kv_heads", "head_dim", "head_dim_v", "page_size"};
std::array<int64_t*, 8> shape_fields(ProblemShape& s) {
  return {&s.batch, &s.max_seqlen_q, &s.max_seqlen_k, &s.num_heads, &s.num_kv_heads,
          &s.head_dim, &s.head_dim_v, &s.page_size};
}

std::vector<int32_t> encode_plan(Plan plan, DeviceType device) {
  std::vector<int32_t> w(kPlanWords, 0);
  w[kMagic] = kPlanMagic;
  w[kDeviceType] = int32_t(device);
  w[kNumSplits] = plan.num_splits;
  w[kGranularity] = plan.split_granularity;
  // bit 2: batch-invariant; bit 3: its fixed-size splits (plan.split_size > 0); bit 4: kv_8bit
  w[kFlags] = int32_t(plan.shape.causal) | int32_t(plan.shape.local) << 1 | int32_t(plan.shape.batch_invariant) << 2 |
              int32_t(plan.split_size > 0) << 3 | int32_t(plan.shape.kv_8bit) << 4;
  const auto f = shape_fields(plan.shape);
  for (size_t i = 0; i < f.size(); ++i) {
    if (*f[i] < 0 || *f[i] > INT32_MAX) fail_arg(kShapeFieldNames[i], "a value in [0, 2^31)", *f[i]);
    w[kShape + i] = int32_t(*f[i]);
  }
  return w;
}

// The Plan encoded in host words made by encode_plan, re-made for `dev` with its split count.
Plan decode_plan(const TensorRef& t, const DeviceProps& dev) {
  constexpr const char* arg = "scheduler_metadata";
  if (t.dtype != DType::i32 || t.ndim != 1 || t.size(0) < kPlanWords || t.device.type != DeviceType::cpu)
    fail_arg(arg, detail::cat("a host int32 [", int(kPlanWords), "] tensor from get_scheduler_metadata"),
             detail::cat(dtype_name(t.dtype), " ", t.shape_str(), " on ", to_string(t.device)));
  const auto word = [&](int i) { return *static_cast<const int32_t*>(t.at(i)); };
  if (word(kMagic) != kPlanMagic) fail_arg(arg, "metadata made by flashserve's get_scheduler_metadata", "other contents");
  if (word(kDeviceType) != int32_t(dev.device.type))
    fail_arg(arg, detail::cat("a plan made for a ", dev.device.type == DeviceType::cuda ? "cuda" : "cpu", " device"),
             "one made for another device type");
  ProblemShape s;  // total_q 0: the call's plan is re-sized for its rows (plan_varlen_attention)
  const auto f = shape_fields(s);
  for (size_t i = 0; i < f.size(); ++i) *f[i] = word(int(kShape + i));
  s.causal = word(kFlags) & 1;
  s.local = word(kFlags) & 2;
  s.batch_invariant = word(kFlags) & 4;
  s.kv_8bit = word(kFlags) & 16;
  const int splits = word(kNumSplits);
  if (splits < 1 || splits > kMaxSplits) fail_arg(arg, detail::cat("num_splits in [1, ", kMaxSplits, "]"), splits);
  // A batch-invariant plan is re-made from its shape (fixed-size splits, or none).
  Plan plan = make_plan(s, dev, s.batch_invariant ? ((word(kFlags) & 8) ? 0 : 1) : splits);
  if (plan.num_splits != splits || plan.split_granularity != word(kGranularity))
    fail_arg(arg, detail::cat("a plan of ", plan.num_splits, " splits of granularity ", plan.split_granularity),
             detail::cat(splits, " splits of granularity ", word(kGranularity)));
  return plan;
}

// get_scheduler_metadata: the plan for a shape given as numbers, as host words.
std::vector<int32_t> plan_for_shape(const std::string& device, int index, int64_t batch, int64_t max_seqlen_q,
                                    int64_t max_seqlen_k, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t head_dim_v, int64_t total_q, int64_t page_size, bool causal, bool local,
                                    int num_splits, bool batch_invariant, bool kv_8bit) {
  const Device d = parse_device(device, index);
  ProblemShape s{batch, max_seqlen_q, max_seqlen_k, num_heads, num_kv_heads, head_dim, head_dim_v, total_q,
                 page_size, causal, local, batch_invariant, kv_8bit};
  return encode_plan(make_plan(s, device_props(d), num_splits), d.type);
}

// ---------------------------------------------------------------- attention

enum class AttnMode : int { run, validate };

// Runs (or only validates) one call. The workspace comes from `alloc_workspace` (a Python
// callable: bytes -> tensor on q's device), asked only when the plan needs one.
nb::object run_attention(AttnMode mode, bool batched, const AttentionParams& p, nb::handle scheduler_metadata,
                         nb::handle alloc_workspace, nb::handle stream) {
  const DeviceProps dev = device_props(p.q.device);
  std::optional<Plan> plan;
  if (!scheduler_metadata.is_none()) {
    // The plan the call runs with: the decoded one, re-sized when q has more (padding) rows.
    const Plan given = decode_plan(tensor_arg(scheduler_metadata, "scheduler_metadata"), dev);
    plan = batched ? plan_kvcache_attention(p, dev, given) : plan_varlen_attention(p, dev, given);
  } else if (dev.device.type == DeviceType::cuda && p.num_splits != 1) {
    plan = batched ? plan_kvcache_attention(p, dev) : plan_varlen_attention(p, dev);
  }
  ExecContext ctx = stream_context(stream);
  ctx.validate_only = mode == AttnMode::validate;
  nb::object workspace;  // alive until the call returns
  if (plan) {
    ctx.plan = &*plan;
    if (const size_t bytes = plan->workspace.total_bytes; bytes > 0) {
      if (alloc_workspace.is_none()) fail_arg("workspace", detail::cat(bytes, " bytes"), "no allocator");
      workspace = alloc_workspace(bytes);
      const TensorRef w = tensor_arg(workspace, "workspace");
      ctx.workspace = w.data;
      ctx.workspace_bytes = size_t(w.numel()) * dtype_size(w.dtype);
    }
  }
  {
    nb::gil_scoped_release nogil;
    batched ? kvcache_attention(p, ctx) : varlen_attention(p, ctx);
  }
  return nb::none();
}

// Every AttentionParams field, in the struct's order; the Python layer passes them by position.
nb::object attention(int mode, bool batched,
                     nb::handle q, nb::handle q_v, nb::handle out, nb::handle lse,
                     nb::handle k, nb::handle v, bool kv_hnd,
                     nb::handle cu_seqlens_q, nb::handle cu_seqlens_k, nb::handle seqused_k, nb::handle block_table,
                     nb::handle cache_batch_idx, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     double softmax_scale, double softcap, nb::handle alibi_slopes, bool alibi_sqrt, bool causal,
                     int window_left, int window_right, int64_t chunk_size, nb::handle s_aux,
                     nb::handle q_descale, nb::handle k_descale, nb::handle v_descale,
                     nb::handle q_scale, nb::handle k_scale_cache, nb::handle v_scale,
                     int cp_world_size, int cp_rank, nb::handle cp_tot_seqused_k,
                     int num_splits, bool batch_invariant, nb::handle scheduler_metadata, nb::handle alloc_workspace,
                     nb::handle stream) {
  if (mode != int(AttnMode::run) && mode != int(AttnMode::validate)) fail_arg("mode", "0 (run) or 1 (validate)", mode);
  AttentionParams p;
  p.q = tensor_arg(q, "q");
  p.q_v = opt_tensor_arg(q_v, "q_v");
  p.out = tensor_arg(out, "out");
  p.lse = opt_tensor_arg(lse, "lse");
  p.k = tensor_arg(k, "k");
  p.v = tensor_arg(v, "v");
  p.kv_layout = kv_hnd ? KvLayout::hnd : KvLayout::nhd;
  p.cu_seqlens_q = opt_tensor_arg(cu_seqlens_q, "cu_seqlens_q");
  p.cu_seqlens_k = opt_tensor_arg(cu_seqlens_k, "cu_seqlens_k");
  p.seqused_k = opt_tensor_arg(seqused_k, "seqused_k");
  p.block_table = opt_tensor_arg(block_table, "block_table");
  p.cache_batch_idx = opt_tensor_arg(cache_batch_idx, "cache_batch_idx");
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_k = max_seqlen_k;
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  p.alibi_slopes = opt_tensor_arg(alibi_slopes, "alibi_slopes");
  p.alibi_sqrt = alibi_sqrt;
  p.causal = causal;
  p.window = Window{window_left, window_right};
  p.chunk_size = chunk_size;
  p.s_aux = opt_tensor_arg(s_aux, "s_aux");
  p.q_descale = opt_tensor_arg(q_descale, "q_descale");
  p.k_descale = opt_tensor_arg(k_descale, "k_descale");
  p.v_descale = opt_tensor_arg(v_descale, "v_descale");
  p.q_scale = opt_tensor_arg(q_scale, "q_scale");
  p.k_scale_cache = opt_tensor_arg(k_scale_cache, "k_scale_cache");
  p.v_scale = opt_tensor_arg(v_scale, "v_scale");
  p.cp_world_size = cp_world_size;
  p.cp_rank = cp_rank;
  p.cp_tot_seqused_k = opt_tensor_arg(cp_tot_seqused_k, "cp_tot_seqused_k");
  p.num_splits = num_splits;
  p.batch_invariant = batch_invariant;
  return run_attention(AttnMode(mode), batched, p, scheduler_metadata, alloc_workspace, stream);
}

void register_attention(nb::module_& m) {
  m.def("attention", &attention, "mode"_a, "batched"_a, "q"_a, "q_v"_a.none(), "out"_a, "lse"_a.none(), "k"_a,
        "v"_a, "kv_hnd"_a, "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), "seqused_k"_a.none(),
        "block_table"_a.none(), "cache_batch_idx"_a.none(), "max_seqlen_q"_a, "max_seqlen_k"_a,
        "softmax_scale"_a, "softcap"_a, "alibi_slopes"_a.none(), "alibi_sqrt"_a, "causal"_a, "window_left"_a,
        "window_right"_a, "chunk_size"_a, "s_aux"_a.none(), "q_descale"_a.none(), "k_descale"_a.none(),
        "v_descale"_a.none(), "q_scale"_a.none(), "k_scale_cache"_a.none(), "v_scale"_a.none(),
        "cp_world_size"_a, "cp_rank"_a, "cp_tot_seqused_k"_a.none(), "num_splits"_a,
        "batch_invariant"_a, "scheduler_metadata"_a.none(), "alloc_workspace"_a.none(), "stream"_a.none(),
        "varlen_attention / kvcache_attention (batched) over AttentionParams given field by field.\n"
        "mode: 0 run, 1 validate only.");
  m.attr("PLAN_WORDS") = int(kPlanWords);
  m.def("plan_for_shape", &plan_for_shape, "device"_a, "index"_a, "batch"_a, "max_seqlen_q"_a, "max_seqlen_k"_a,
        "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "head_dim_v"_a, "total_q"_a, "page_size"_a, "causal"_a,
        "local"_a, "num_splits"_a, "batch_invariant"_a = false, "kv_8bit"_a = false, "The plan (int32 words) for a problem shape: get_scheduler_metadata.");
}

// ---------------------------------------------------------------- cache, merge, variants

void reshape_and_cache_op(nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache,
                          nb::handle slot_mapping, const std::string& kv_cache_dtype, nb::handle k_scale,
                          nb::handle v_scale, nb::handle k_scale_cache, nb::handle key_scale, bool hnd,
                          nb::handle stream) {
  CacheWriteParams p;
  p.key = tensor_arg(key, "key");
  p.value = tensor_arg(value, "value");
  p.key_cache = tensor_arg(key_cache, "key_cache");
  p.value_cache = tensor_arg(value_cache, "value_cache");
  p.layout = hnd ? KvLayout::hnd : KvLayout::nhd;
  p.slot_mapping = tensor_arg(slot_mapping, "slot_mapping");
  p.cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  p.k_scale = opt_tensor_arg(k_scale, "k_scale");
  p.v_scale = opt_tensor_arg(v_scale, "v_scale");
  p.k_scale_cache = opt_tensor_arg(k_scale_cache, "k_scale_cache");
  p.key_scale = opt_tensor_arg(key_scale, "key_scale");
  call_on_stream(stream, reshape_and_cache, p);
}

void merge_op(nb::handle out, nb::handle out_lse, nb::handle a_out, nb::handle a_lse, nb::handle b_out,
              nb::handle b_lse, bool token_major, std::optional<int64_t> prefill_tokens_with_context,
              nb::handle output_scale, nb::handle stream) {
  MergeParams p;
  p.out = tensor_arg(out, "out");
  p.out_lse = opt_tensor_arg(out_lse, "out_lse");
  p.a_out = tensor_arg(a_out, "a_out");
  p.a_lse = tensor_arg(a_lse, "a_lse");
  p.b_out = tensor_arg(b_out, "b_out");
  p.b_lse = tensor_arg(b_lse, "b_lse");
  p.lse_layout = token_major ? LseLayout::token_major : LseLayout::head_major;
  p.prefill_tokens_with_context = prefill_tokens_with_context;
  p.output_scale = opt_tensor_arg(output_scale, "output_scale");
  call_on_stream(stream, merge_states, p);
}

void copy_blocks_op(const std::vector<nb::handle>& caches, nb::handle block_mapping, nb::handle stream) {
  std::vector<TensorRef> refs;
  refs.reserve(caches.size());
  for (size_t i = 0; i < caches.size(); ++i)
    refs.push_back(tensor_arg(caches[i], ("caches[" + std::to_string(i) + "]").c_str()));
  const TensorRef mapping = tensor_arg(block_mapping, "block_mapping");
  call_on_stream(stream, copy_blocks, refs, mapping);
}

void swap_blocks_op(nb::handle src, nb::handle dst, nb::handle block_mapping, nb::handle stream) {
  const TensorRef s = tensor_arg(src, "src"), d = tensor_arg(dst, "dst");
  const TensorRef mapping = tensor_arg(block_mapping, "block_mapping");
  call_on_stream(stream, swap_blocks, s, d, mapping);
}

void advance_step_op(int64_t num_seqs, int64_t num_queries, int64_t block_size, nb::handle input_tokens,
                     nb::handle sampled_token_ids, nb::handle input_positions, nb::handle seq_lens,
                     nb::handle slot_mapping, nb::handle block_tables, nb::handle stream) {
  AdvanceStepParams p;
  p.num_seqs = num_seqs;
  p.num_queries = num_queries;
  p.block_size = block_size;
  p.input_tokens = tensor_arg(input_tokens, "input_tokens");
  p.sampled_token_ids = tensor_arg(sampled_token_ids, "sampled_token_ids");
  p.input_positions = tensor_arg(input_positions, "input_positions");
  p.seq_lens = tensor_arg(seq_lens, "seq_lens");
  p.slot_mapping = tensor_arg(slot_mapping, "slot_mapping");
  p.block_tables = tensor_arg(block_tables, "block_tables");
  call_on_stream(stream, advance_step, p);
}

void quantize_int8_op(nb::handle x, nb::handle out, nb::handle scale, nb::handle stream) {
  const TensorRef xs = tensor_arg(x, "x"), o = tensor_arg(out, "out"), s = tensor_arg(scale, "scale");
  call_on_stream(stream, quantize_int8, xs, o, s);
}

void register_cache_merge(nb::module_& m) {
  m.def("reshape_and_cache", &reshape_and_cache_op, "key"_a, "value"_a, "key_cache"_a, "value_cache"_a,
        "slot_mapping"_a, "kv_cache_dtype"_a, "k_scale"_a.none(), "v_scale"_a.none(), "k_scale_cache"_a.none(),
        "key_scale"_a.none(), "hnd"_a, "stream"_a.none(),
        "reshape_and_cache: key/value rows into their cache slots (int8 keys: already quantized, their\n"
        "scales key_scale [num_tokens, H_kv] stored into k_scale_cache).");
  m.def("merge_states", &merge_op, "out"_a, "out_lse"_a.none(), "a_out"_a, "a_lse"_a, "b_out"_a, "b_lse"_a,
        "token_major"_a, "prefill_tokens_with_context"_a.none(),
        "output_scale"_a.none(), "stream"_a.none(), "merge_states: (o_a, lse_a) + (o_b, lse_b).");
  m.def("copy_blocks", &copy_blocks_op, "caches"_a, "block_mapping"_a, "stream"_a.none());
  m.def("swap_blocks", &swap_blocks_op, "src"_a, "dst"_a, "block_mapping"_a, "stream"_a.none());
  m.def("advance_step", &advance_step_op, "num_seqs"_a, "num_queries"_a, "block_size"_a, "input_tokens"_a,
        "sampled_token_ids"_a, "input_positions"_a, "seq_lens"_a, "slot_mapping"_a, "block_tables"_a,
        "stream"_a.none());
  m.def("quantize_int8", &quantize_int8_op, "x"_a, "out"_a, "scale"_a, "stream"_a.none());
}

void differential_combine_op(nb::handle a1, nb::handle a2, nb::handle lambda_q1, nb::handle lambda_k1,
                             nb::handle lambda_q2, nb::handle lambda_k2, nb::handle weight, double lambda_init,
                             double eps, nb::handle out, nb::handle stream) {
  DifferentialCombineParams p;
  p.a1 = tensor_arg(a1, "a1");
  p.a2 = tensor_arg(a2, "a2");
  p.lambda_q1 = tensor_arg(lambda_q1, "lambda_q1");
  p.lambda_k1 = tensor_arg(lambda_k1, "lambda_k1");
  p.lambda_q2 = tensor_arg(lambda_q2, "lambda_q2");
  p.lambda_k2 = tensor_arg(lambda_k2, "lambda_k2");
  p.weight = tensor_arg(weight, "weight");
  p.lambda_init = float(lambda_init);
  p.eps = float(eps);
  p.out = tensor_arg(out, "out");
  call_on_stream(stream, differential_combine, p);
}

void lse_correct_op(nb::handle out, nb::handle lse_all, int64_t rank, nb::handle lse_out, bool token_major,
                    nb::handle stream) {
  LseCorrectParams p;
  p.out = tensor_arg(out, "out");
  p.lse_all = tensor_arg(lse_all, "lse_all");
  p.rank = rank;
  p.lse_out = opt_tensor_arg(lse_out, "lse_out");
  p.lse_layout = token_major ? LseLayout::token_major : LseLayout::head_major;
  call_on_stream(stream, lse_correct, p);
}

void gather_cache_op(nb::handle cache, nb::handle block_table, nb::handle seqused_k, nb::handle cu_seqlens_q,
                     int64_t token_begin, std::optional<int64_t> token_end, nb::handle dst, nb::handle cu_seqlens_dst,
                     nb::handle stream) {
  GatherCacheParams p;
  p.cache = tensor_arg(cache, "cache");
  p.block_table = tensor_arg(block_table, "block_table");
  p.seqused_k = tensor_arg(seqused_k, "seqused_k");
  p.cu_seqlens_q = opt_tensor_arg(cu_seqlens_q, "cu_seqlens_q");
  p.token_begin = token_begin;
  if (token_end) p.token_end = *token_end;
  p.dst = tensor_arg(dst, "dst");
  p.cu_seqlens_dst = tensor_arg(cu_seqlens_dst, "cu_seqlens_dst");
  call_on_stream(stream, gather_cache, p);
}

void register_variants(nb::module_& m) {
  m.def("differential_combine", &differential_combine_op, "a1"_a, "a2"_a, "lambda_q1"_a, "lambda_k1"_a,
        "lambda_q2"_a, "lambda_k2"_a, "weight"_a, "lambda_init"_a, "eps"_a, "out"_a, "stream"_a.none());
  m.def("lse_correct", &lse_correct_op, "out"_a, "lse_all"_a, "rank"_a, "lse_out"_a.none(), "token_major"_a,
        "stream"_a.none());
  m.def("gather_cache", &gather_cache_op, "cache"_a, "block_table"_a, "seqused_k"_a, "cu_seqlens_q"_a.none(),
        "token_begin"_a, "token_end"_a.none(), "dst"_a, "cu_seqlens_dst"_a, "stream"_a.none());
}

}  // namespace

void register_ops(nb::module_& m) {
  register_attention(m);
  register_cache_merge(m);
  register_variants(m);
}

}  // namespace flashserve::py
