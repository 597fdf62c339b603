// Split-KV planning: how many KV splits per (sequence, head) and the workspace they need.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "common/decode_rows.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/status.hpp"
#include "planner/cta_shapes.hpp"

namespace flashserve {

DeviceProps DeviceProps::cpu() {
  DeviceProps d;
  d.device = Device{DeviceType::cpu, 0};
  d.num_sms = std::max(1, omp_get_max_threads());
  d.cc_major = d.cc_minor = 0;
  return d;
}

int WorkspaceSpec::add(std::string_view name, size_t bytes) {
  if (count == kMaxWorkspaceBuffers)
    throw RuntimeError(detail::cat("workspace: more than ", kMaxWorkspaceBuffers, " buffers (adding ", name, ")"));
  const size_t offset = (total_bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  buffers[count] = WorkspaceBuffer{name, offset, bytes};
  total_bytes = offset + bytes;
  return count++;
}

const WorkspaceBuffer& WorkspaceSpec::get(std::string_view name) const {
  for (int i = 0; i < count; ++i)
    if (buffers[i].name == name) return buffers[i];
  throw RuntimeError(detail::cat("workspace: no buffer named ", name));
}

namespace {
// KV tokens per split granule: the kernels' KV tile on the GPU; finer on the CPU so small
// problems can still be split (tests exercise every split count).
int64_t split_granularity(const DeviceProps& dev) {
  return dev.device.type == DeviceType::cuda ? planner::kKvTileKeys : 16;
}
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// n splits that differ from n - 1 in the granules each split gets (others repeat a shape).
bool eligible(int64_t granules, int64_t n) { return n == 1 || ceil_div(granules, n) != ceil_div(granules, n - 1); }

// Decode-like shapes on a GPU (at most kStreamRows packed query rows per (sequence, KV head))
// are memory streams: a unit reads its KV once with little arithmetic per byte, so an SM runs
// several at once (kStreamSlotsPerSm resident units) and only keeps HBM busy with many bytes
// in flight. They split until units x splits fill one wave of resident slots (a short tail),
// each split keeping at least kStreamMinSplitKeys keys. A CTA's fixed costs (row setup,
// pipeline fill, the cross-warp merge, its share of the combine) favour few long splits: on an
// H200 (bf16 decode, GQA 32/8) 2 waves and 1024 keys beat 4 waves and 512 keys at every batch
// size measured (B=64 L=4k 3.39 -> 3.64 TB/s, B=16 L=8k 2.87 -> 3.17, B=1 L=32k 1.07 -> 1.82);
// 256 keys halved B=1. Re-checked after the combine was parallelized (B=1 L=32k, GB/s): 1024
// keys 2433, 512 keys 1986 (4 waves: 1987, and B=64 3635 -> 3382), 2048 keys 1712. One wave
// against two (2026-11-25, every split count of GQA 4/8/16 x (B, L) = (1, 32k), (4, 16k),
// (16, 8k), (64, 4k); bench/RESULTS.md): one wave is as fast or faster everywhere, GQA 8 B=64
// 161.1 -> 148.1 us (1 split, not 2), GQA 16 B=64 104.8 -> 97.0 (2, not 4), GQA 8 B=16
// 91.5 -> 86.8, GQA 4 B=4 L=16k 87.3 -> 84.5; the rest within 1%. MLA's absorbed decode
// already aimed at one wave (H = 16 B = 64 L = 4k: 126 us in 4 splits, 140 us in 8).
constexpr int64_t kStreamRows = 16;
// Packed rows up to which a GQA shape runs on the decode kernel (verify steps in row groups,
// common/decode_rows.hpp): a stream whatever its pass count; MLA's absorbed decode up to 16.
int64_t stream_rows_bound(const ProblemShape& s) {
  return planner::is_mla_decode(s.head_dim, s.head_dim_v) ? kStreamRows : decode_max_rows(s.kv_8bit);
}
constexpr int64_t kStreamSlotsPerSm = 2;
constexpr int64_t kStreamWaves = 1;
constexpr int64_t kStreamMinSplitKeys = 1024;
// max_split_rows: the workspace bound (split partial rows) counts 4 waves of slots' rows.
constexpr int64_t kSplitRowsBoundWaves = 4;

// The least keys per split of a decode-like shape: kStreamMinSplitKeys, measured for GQA with
// D = Dv = 128 (256 K and V elements per key and KV head). MLA's absorbed decode (Dv > D: one
// latent row of D + Dv elements per key serves all heads, k and v being views of it) on its
// 16-row kernel (decode_mla_heads: 64-key tiles) takes kMlaMinSplitKeys.
constexpr int64_t kMlaMinSplitKeys = 256;
int64_t stream_min_split_keys(const ProblemShape& s, int64_t g) {
  if (!planner::is_mla_decode(s.head_dim, s.head_dim_v)) return kStreamMinSplitKeys;
  return std::max(g, (kMlaMinSplitKeys + g - 1) / g * g);
}

// Resident CTAs per SM the split count aims at (kStreamSlotsPerSm), and whether it stops at one
// wave of them. MLA's 16-row decode with a 16-bit latent runs one CTA per SM (its 2 x 2 shape)
// up to 1.5 CTAs per SM and two (1 x 1) beyond, whose one stage is slower: one CTA per SM and
// splits that stop at one wave (H200, H = 16, bf16, us: B = 1 L = 32k 128 splits 31.4 vs 64
// 35.4; B = 16 L = 4k 8 splits 39.1 vs 16 46.0; B = 64 L = 4k 2 splits 100.9 vs 4 105.0;
// B = 128 L = 8k 1 split 300.4 vs 2 318.7). An fp8 latent's two-CTA shape (RS: two raw stages)
// is the fast one, so it keeps two slots (B = 64 4 splits 100.6 vs 2 130.7, B = 128 2 splits
// 302.1 vs 1 413.8; B = 1 L = 32k 128 splits 33.8 vs 64 43.1). bench/RESULTS.md 2026-11-25.
struct StreamSlots {
  int64_t per_sm = kStreamSlotsPerSm;
  bool one_wave = false;
};
StreamSlots stream_slots(const ProblemShape& s) {
  if (planner::is_mla_decode(s.head_dim, s.head_dim_v) && !s.kv_8bit) return {1, true};
  return {};
}

// Splits of units (sequence, KV head) for a decode-like shape: of the eligible counts up to
// the cap, the first within 5% of the best score, score = wave efficiency x target filled.
int stream_splits(int64_t units, int64_t granules, int64_t cap, int64_t g, int64_t sms, int64_t min_keys,
                  StreamSlots per) {
  const int64_t slots = per.per_sm * sms, target = kStreamWaves * slots;
  int64_t max_s = std::min(cap, std::max<int64_t>(1, granules * g / min_keys));
  if (per.one_wave) max_s = std::min(max_s, std::max<int64_t>(1, slots / std::max<int64_t>(1, units)));
  if (units >= target || max_s < 2) return 1;
  std::array<double, kMaxSplits + 1> score{};
  double best = 0.0;
  for (int64_t n = 1; n <= max_s; ++n) {
    if (!eligible(granules, n)) continue;
    const double waves = double(units * n) / double(slots);
    score[n] = waves / std::ceil(waves) * std::min(1.0, double(units * n) / double(target));
    best = std::max(best, score[n]);
  }
  for (int64_t n = 1; n <= max_s; ++n)
    if (eligible(granules, n) && score[n] >= 0.95 * best) return int(n);
  return 1;
}
}  // namespace

int64_t max_split_rows(const DeviceProps& dev) {
  return kSplitRowsBoundWaves * kStreamSlotsPerSm * std::max(1, dev.num_sms) * kStreamRows;
}

int64_t max_invariant_split_rows(const DeviceProps& dev) { return 8 * max_split_rows(dev); }

namespace {
int choose_unbounded(const ProblemShape& s, const DeviceProps& dev, int requested);
}  // namespace

int choose_num_splits(const ProblemShape& s, const DeviceProps& dev, int requested) {
  if (requested < 0) fail_arg("num_splits", ">= 0", requested);
  const int n = choose_unbounded(s, dev, requested);
  if (n <= 1 || dev.device.type != DeviceType::cuda) return n;
  // The workspace bound (max_split_rows): a plan never holds more split partial rows.
  const int64_t rows = std::max<int64_t>(1, s.total_q * s.num_heads);
  return int(std::clamp<int64_t>(max_split_rows(dev) / rows, 1, n));
}

namespace {
int choose_unbounded(const ProblemShape& s, const DeviceProps& dev, int requested) {
  const int64_t g = split_granularity(dev);
  const int64_t granules = std::max<int64_t>(1, ceil_div(s.max_seqlen_k, g));
  const int64_t cap = std::min<int64_t>(kMaxSplits, granules);
  if (requested >= 1) return int(std::min<int64_t>(requested, cap));

  // Heuristic (wave efficiency, as flash-decoding): split only when the kernel's CTAs leave SMs
  // idle, or, for decode-like shapes on a GPU, when they are too few to keep memory busy
  // (stream_splits). Work units are the CTAs of the kernel that serves the shape: (sequence, KV
  // head, packed query rows) for decode-like shapes and MLA's absorbed decode (64 rows, Dv > D);
  // (sequence, head, 128 query rows) for the prefill kernels, which do not pack GQA heads (the
  // cascade prefix pass of 256 decodes over a shared prefix, GQA 32/8: 64 CTAs, not 128).
  const int64_t group = s.num_kv_heads > 0 ? s.num_heads / s.num_kv_heads : 1;
  const int64_t packed = std::max<int64_t>(1, s.max_seqlen_q) * group;
  const int64_t sms = std::max(1, dev.num_sms);
  if (s.batch * s.num_kv_heads == 0 || granules < 2) return 1;
  if (dev.device.type == DeviceType::cuda && packed <= stream_rows_bound(s))
    return stream_splits(s.batch * s.num_kv_heads * decode_row_ctas(packed, s.kv_8bit), granules, cap, g, sms,
                         stream_min_split_keys(s, g), stream_slots(s));
  const bool packs_heads = packed <= kStreamRows || planner::is_mla_decode(s.head_dim, s.head_dim_v);
  const int64_t units =
      packs_heads ? s.batch * s.num_kv_heads * ceil_div(packed, planner::kDecodePackedRows)
                  : s.batch * s.num_heads * ceil_div(std::max<int64_t>(1, s.max_seqlen_q), planner::kPrefillRowsPerCta);
  if (units * 10 >= sms * 8) return 1;
  const int64_t max_s = std::min<int64_t>(cap, 2 * sms);
  double best = 0.0;
  std::array<double, kMaxSplits + 1> eff{};
  for (int64_t n = 1; n <= max_s; ++n) {
    if (!eligible(granules, n)) continue;
    const double waves = double(units * n) / double(sms);
    eff[n] = waves / std::ceil(waves);
    best = std::max(best, eff[n]);
  }
  for (int64_t n = 1; n <= max_s; ++n)
    if (eligible(granules, n) && eff[n] >= 0.85 * best) return int(n);
  return 1;
}

}  // namespace

namespace {
// Batch-invariant mode: fixed-size splits for decode-like calls (plan.hpp), never a count
// chosen from the shape; a bound that would change the order is an error naming it.
Plan make_invariant_plan(const ProblemShape& shape, const DeviceProps& dev, int requested) {
  if (requested < 0 || requested > 1)
    fail_arg("num_splits", "0 (fixed-size splits) or 1 (none) with batch_invariant", requested);
  Plan plan;
  plan.shape = shape;
  plan.split_granularity = int(split_granularity(dev));
  if (requested == 1 || shape.max_seqlen_q > kBatchInvariantDecodeMaxQ) return plan;
  plan.split_size = kBatchInvariantSplitKeys;
  const int64_t n = std::max<int64_t>(1, ceil_div(shape.max_seqlen_k, kBatchInvariantSplitKeys));
  if (n > kMaxSplits)
    fail_arg("max_seqlen_k",
             detail::cat("at most ", kMaxSplits * kBatchInvariantSplitKeys, " keys with batch_invariant (kMaxSplits ",
                         kMaxSplits, " splits of kBatchInvariantSplitKeys ", kBatchInvariantSplitKeys, ")"),
             shape.max_seqlen_k);
  plan.num_splits = int(n);
  if (n > 1 && dev.device.type == DeviceType::cuda) {
    const int64_t rows = n * shape.total_q * shape.num_heads;
    if (rows > max_invariant_split_rows(dev))
      fail_arg("batch_invariant",
               detail::cat("at most max_invariant_split_rows = ", max_invariant_split_rows(dev),
                           " split partial rows (ceil(max_seqlen_k / ", kBatchInvariantSplitKeys,
                           ") x total_q x H); a smaller batch or a shorter max_seqlen_k"),
               detail::cat(n, " x ", shape.total_q, " x ", shape.num_heads, " = ", rows));
    plan.workspace = split_workspace(rows, shape.head_dim_v);
  }
  return plan;
}
}  // namespace

Plan make_plan(const ProblemShape& shape, const DeviceProps& dev, int requested_splits) {
  if (shape.batch_invariant) return make_invariant_plan(shape, dev, requested_splits);
  Plan plan;
  plan.shape = shape;
  plan.num_splits = choose_num_splits(shape, dev, requested_splits);
  plan.split_granularity = int(split_granularity(dev));
  if (plan.num_splits > 1 && dev.device.type == DeviceType::cuda) {
    // The CPU reference merges splits in registers; the kernels combine through these.
    plan.workspace = split_workspace(int64_t(plan.num_splits) * shape.total_q * shape.num_heads, shape.head_dim_v);
  }
  return plan;
}

WorkspaceSpec split_workspace(int64_t partial_rows, int64_t head_dim_v) {
  WorkspaceSpec ws;
  ws.add("o_partial", size_t(partial_rows) * size_t(head_dim_v) * sizeof(float));
  ws.add("lse_partial", size_t(partial_rows) * sizeof(float));
  return ws;
}

}  // namespace flashserve
