// Bindings for flashserve.sglang (SGLang's FlashAttentionBackend): the host planner's chunked
// local attention virtual batches (src/planner/local_batches.hpp), which SGLang builds with
// numpy on the host. Conversion only: the checks and the split are the planner's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <span>
#include <tuple>
#include <vector>

#include "convert.hpp"
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

}  // namespace

void register_sglang(nb::module_& m) {
  m.def("local_virtual_batches", &local_virtual_batches, "query_start_loc"_a, "seq_lens"_a, "attention_chunk_size"_a,
        "Chunked local attention as virtual requests (one per request and chunk touched by its queries), from host "
        "int32 query_start_loc [R+1] and seq_lens [R]: (cu_seqlens_q [V+1], seqused_k [V], k_start [V] (absolute "
        "position of the first key, a multiple of the chunk), request [V]) as lists.");
}

}  // namespace flashserve::py
