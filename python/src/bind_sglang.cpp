// Bindings for flashserve.sglang (SGLang's FlashAttentionBackend): the host planner's chunked
// local attention virtual batches (src/planner/local_batches.hpp), which SGLang builds with
// numpy on the host, and the tree-speculation metadata operations (spec_metadata.hpp), which
// it builds with torch ops. Conversion only: the checks and the work are the library's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "convert.hpp"
#include "flashserve/spec_metadata.hpp"
#include "flashserve/status.hpp"
#include "planner/local_batches.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace flashserve::py {

namespace {

using I32 = std::vector<int32_t>;

std::tuple<I32, I32, I32, I32> local_virtual_batches(nb::handle query_start_loc, nb::handle seq_lens, int64_t chunk) {
  const auto qsl = host_i32_arg(query_start_loc, "query_start_loc");
  const auto lens = host_i32_arg(seq_lens, "seq_lens");
  const int64_t v = planner::count_local_virtual_requests(qsl, lens, chunk);
  const auto n = static_cast<size_t>(v);
  I32 cu(n + 1), used(n), start(n), req(n);
  planner::make_local_virtual_batch(qsl, lens, chunk, planner::LocalVirtualBatch{cu, used, start, req});
  return {std::move(cu), std::move(used), std::move(start), std::move(req)};
}

void spec_draft_expand_op(nb::handle out_cache_loc, int64_t decode_length, nb::handle page_table,
                          nb::handle cache_seqlens, nb::handle cu_seqlens_k, nb::handle stream) {
  SpecDraftExpandParams p;
  p.out_cache_loc = tensor_arg(out_cache_loc, "out_cache_loc");
  p.decode_length = decode_length;
  p.page_table = tensor_arg(page_table, "page_table");
  p.cache_seqlens = tensor_arg(cache_seqlens, "cache_seqlens");
  p.cu_seqlens_k = tensor_arg(cu_seqlens_k, "cu_seqlens_k");
  call_on_stream(stream, spec_draft_expand, p);
}

void spec_verify_expand_op(nb::handle custom_mask, nb::handle req_to_token, nb::handle req_pool_indices,
                           nb::handle seq_lens, int64_t num_draft_tokens, std::optional<int64_t> mask_rows,
                           nb::handle page_table, nb::handle cache_seqlens, nb::handle cu_seqlens_k,
                           nb::handle stream) {
  SpecVerifyExpandParams p;
  p.custom_mask = tensor_arg(custom_mask, "custom_mask");
  p.req_to_token = tensor_arg(req_to_token, "req_to_token");
  p.req_pool_indices = tensor_arg(req_pool_indices, "req_pool_indices");
  p.seq_lens = tensor_arg(seq_lens, "seq_lens");
  p.num_draft_tokens = num_draft_tokens;
  p.mask_rows = mask_rows;
  p.page_table = tensor_arg(page_table, "page_table");
  p.cache_seqlens = tensor_arg(cache_seqlens, "cache_seqlens");
  p.cu_seqlens_k = tensor_arg(cu_seqlens_k, "cu_seqlens_k");
  call_on_stream(stream, spec_verify_expand, p);
}

void spec_window_page_table_op(nb::handle page_table_a, nb::handle page_table_b, nb::handle seq_len_a,
                               nb::handle seq_len_b, int64_t num_draft_tokens, nb::handle page_table,
                               nb::handle cache_seqlens, nb::handle cu_seqlens_k, nb::handle stream) {
  SpecWindowPageTableParams p;
  p.page_table_a = tensor_arg(page_table_a, "page_table_a");
  p.page_table_b = tensor_arg(page_table_b, "page_table_b");
  p.seq_len_a = tensor_arg(seq_len_a, "seq_len_a");
  p.seq_len_b = tensor_arg(seq_len_b, "seq_len_b");
  p.num_draft_tokens = num_draft_tokens;
  p.page_table = tensor_arg(page_table, "page_table");
  p.cache_seqlens = tensor_arg(cache_seqlens, "cache_seqlens");
  p.cu_seqlens_k = tensor_arg(cu_seqlens_k, "cu_seqlens_k");
  call_on_stream(stream, spec_window_page_table, p);
}

}  // namespace

void register_sglang(nb::module_& m) {
  m.def("local_virtual_batches", &local_virtual_batches, "query_start_loc"_a, "seq_lens"_a, "attention_chunk_size"_a,
        "Chunked local attention as virtual requests (one per request and chunk touched by its queries), from host "
        "int32 query_start_loc [R+1] and seq_lens [R]: (cu_seqlens_q [V+1], seqused_k [V], k_start [V] (absolute "
        "position of the first key, a multiple of the chunk), request [V]) as lists.");
  m.def("spec_draft_expand", &spec_draft_expand_op, "out_cache_loc"_a, "decode_length"_a, "page_table"_a,
        "cache_seqlens"_a, "cu_seqlens_k"_a, "stream"_a.none(),
        "Tree draft decode's expand metadata: page_table[r, :decode_length] = out_cache_loc[r, :decode_length], "
        "cache_seqlens = decode_length, cu_seqlens_k = r * decode_length.");
  m.def("spec_verify_expand", &spec_verify_expand_op, "custom_mask"_a, "req_to_token"_a, "req_pool_indices"_a,
        "seq_lens"_a, "num_draft_tokens"_a, "mask_rows"_a.none(), "page_table"_a, "cache_seqlens"_a,
        "cu_seqlens_k"_a, "stream"_a.none(),
        "Tree verify's expand metadata: per draft row the slots of the drafts its mask shows (then the hidden "
        "ones), their count and its running sum.");
  m.def("spec_window_page_table", &spec_window_page_table_op, "page_table_a"_a, "page_table_b"_a, "seq_len_a"_a,
        "seq_len_b"_a, "num_draft_tokens"_a, "page_table"_a, "cache_seqlens"_a, "cu_seqlens_k"_a, "stream"_a.none(),
        "Sliding-window tree verify: per draft row the prefix row then the expand row, concatenated by length; "
        "cache_seqlens and cu_seqlens_k of the concatenation.");
}

}  // namespace flashserve::py
