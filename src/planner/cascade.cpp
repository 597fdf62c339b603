// The cascade (shared-prefix) decision of SPEC.md §6: the eligibility rules, then a cost model
// of the shared prefix read by split-KV decode versus one cascade prefix pass.
#include <algorithm>
#include <cstdint>
#include <span>

#include "flashserve/backend.hpp"
#include "planner/cta_shapes.hpp"

namespace flashserve::backend {

namespace {

constexpr int64_t kMinCommonPrefix = 256;  // tokens
constexpr int64_t kMinRequests = 8;

// ---- cost model, in "tile steps": one CTA processing one KV tile for one block of query rows.
// Only the shared prefix is modeled: the per-request suffixes cost the same either way (the
// decode kernel walks them, the cascade suffix pass walks them).
//
// Split-KV decode: every request re-reads the prefix. A CTA holds one request's queries of one
// KV head packed with its GQA group (q_len * group rows, kDecodeRows at a time):
//   ctas = num_reqs * H_kv * ceil(group * max_q_len / kDecodeRows), each walking P tiles.
// Cascade: one prefix pass where all N query tokens of the batch form one request, packed per
// KV head into blocks of kPrefixRows rows:
//   ctas = H_kv * ceil(N * group / kPrefixRows), each walking P tiles,
// plus a fixed cost for the second launch and the merge of the two partial states.
//
// Both passes may split the KV range (flash-decoding), so a pass takes
//   max(ctas * tiles / num_sms, max(1, tiles / kMaxSplits))
// steps: its work in (fractional) waves over the SMs, the split count filling the last wave,
// bounded below by the critical path of one CTA's share of the tiles at the largest split
// count. Fractional waves keep the decision monotone: more SMs never favour cascade (the floor
// binds the decode side first), while a longer prefix or more requests never favour decode
// (decode's work grows at least as fast as cascade's).
// The prefix pass's CTAs are counted as GQA-packed rows per KV head; the prefill kernels take
// one head per CTA (plan.cpp's split heuristic counts those): the same count when N is a
// multiple of 128, up to `group` times fewer otherwise, so for small N the model underrates the
// prefix pass and leans towards cascade.
constexpr int64_t kKvTile = planner::kKvTileKeys;
constexpr int64_t kDecodeRows = planner::kDecodePackedRows;
constexpr int64_t kPrefixRows = planner::kPrefillRowsPerCta;
constexpr double kCascadeFixedSteps = 2.0;  // second launch + merge_states

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

double pass_steps(int64_t ctas, int64_t tiles, int sms) {
  const double critical = std::max(1.0, double(tiles) / kMaxSplits);
  return std::max(double(ctas) * double(tiles) / double(std::max(1, sms)), critical);
}

bool cascade_cheaper(int64_t prefix_len, std::span<const int32_t> query_lens, const LayerSpec& layer,
                     const DeviceProps& dev) {
  const int64_t kv_heads = std::max<int64_t>(1, layer.num_kv_heads);
  const int64_t group = std::max<int64_t>(1, layer.num_heads / kv_heads);
  const int64_t tiles = ceil_div(prefix_len, kKvTile);
  int64_t tokens = 0, max_q = 1;
  for (int32_t q : query_lens) {
    tokens += q;
    max_q = std::max<int64_t>(max_q, q);
  }
  const int64_t reqs = int64_t(query_lens.size());
  const int64_t decode_ctas = reqs * kv_heads * ceil_div(group * max_q, kDecodeRows);
  const int64_t prefix_ctas = kv_heads * ceil_div(tokens * group, kPrefixRows);
  const double decode = pass_steps(decode_ctas, tiles, dev.num_sms);
  const double cascade = pass_steps(prefix_ctas, tiles, dev.num_sms) + kCascadeFixedSteps;
  return cascade < decode;
}

}  // namespace

bool use_cascade(int64_t common_prefix_len, std::span<const int32_t> query_lens, const LayerSpec& layer,
                 int dcp_world_size, const DeviceProps& dev) {
  if (common_prefix_len < kMinCommonPrefix) return false;
  if (int64_t(query_lens.size()) < kMinRequests) return false;
  if (layer.alibi_slopes.has_value() || layer.sliding_window > 0 || layer.attention_chunk_size > 0) return false;
  if (dcp_world_size != 1) return false;
  // With prefills in the batch, split-KV decode is not the alternative: each prefill would
  // re-read the prefix with its own queries, which the single prefix pass always beats.
  const bool all_decode = std::all_of(query_lens.begin(), query_lens.end(), [](int32_t q) { return q <= 1; });
  if (!all_decode) return true;
  return cascade_cheaper(common_prefix_len, query_lens, layer, dev);
}

}  // namespace flashserve::backend
