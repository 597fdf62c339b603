// Plans: the work decomposition of an attention call, decided on the host from shapes alone.
// The same code sizes the workspace in a dry run and drives the call, so a plan is a typed
// struct, never an opaque integer vector.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "flashserve/tensor.hpp"

namespace flashserve {

// What the planner needs to know of the device.
struct DeviceProps {
  Device device{};
  int num_sms = 132;          // CPU: worker threads
  int cc_major = 9, cc_minor = 0;  // CPU: 0.0
  static DeviceProps cpu();   // num_sms = worker threads of the reference
  static DeviceProps h200() { return {Device{DeviceType::cuda, 0}, 132, 9, 0}; }
};

// The shape of an attention problem as the planner sees it (no tensor contents).
struct ProblemShape {
  int64_t batch = 0;
  int64_t max_seqlen_q = 0;   // per sequence (varlen: bound given by the caller)
  int64_t max_seqlen_k = 0;
  int64_t num_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0, head_dim_v = 0;
  int64_t total_q = 0;        // rows of q (varlen total_q, batched B * sq)
  int64_t page_size = 0;      // 0: contiguous KV
  bool causal = false;
  bool local = false;         // window or chunked local attention
  bool batch_invariant = false;  // AttentionParams::batch_invariant (plan.hpp: split_size)
  bool kv_8bit = false;       // a 1-byte K cache (fp8, int8): the kernels that serve it differ
  friend bool operator==(const ProblemShape&, const ProblemShape&) = default;
};

// A named sub-allocation of the workspace.
struct WorkspaceBuffer {
  std::string_view name;  // static storage ("o_partial", "lse_partial")
  size_t offset = 0;
  size_t bytes = 0;
};

inline constexpr size_t kWorkspaceAlign = 256;
inline constexpr int kMaxWorkspaceBuffers = 4;
inline constexpr int kMaxSplits = 128;

// Batch-invariant mode (AttentionParams::batch_invariant): a call whose max_seqlen_q is at most
// kBatchInvariantDecodeMaxQ (decode and verify steps) splits each sequence's KV at multiples of
// kBatchInvariantSplitKeys (a multiple of every kernel's KV tile and split granule: 16-128 keys),
// ceil(sk / size) splits for sk keys, whatever the rest of the batch; a longer call is not
// split. The reduction order of a row then depends on its own sequence only.
inline constexpr int64_t kBatchInvariantSplitKeys = 1024;
inline constexpr int64_t kBatchInvariantDecodeMaxQ = 16;

struct WorkspaceSpec {
  std::array<WorkspaceBuffer, kMaxWorkspaceBuffers> buffers{};
  int count = 0;
  size_t total_bytes = 0;
  // Appends an aligned buffer; returns its index.
  int add(std::string_view name, size_t bytes);
  const WorkspaceBuffer& get(std::string_view name) const;  // throws naming it if absent
};

struct Plan {
  ProblemShape shape;       // what it was made for; a call checks it matches
  int num_splits = 1;       // KV splits per (sequence, head) (flash-decoding), 1..kMaxSplits
  int split_granularity = 1;  // split boundaries are multiples of this many KV tokens
  // > 0 (batch-invariant mode): a sequence of sk keys has its own split count
  // seq_num_splits(sk, num_splits, split_size) = ceil(sk / split_size) (at least 1), split s
  // covering [s * split_size, (s + 1) * split_size) of its keys; num_splits is then the bound
  // of the call (ceil(max_seqlen_k / split_size)), the grid's extent, and sequences of one split
  // are written directly (no partial, no combine). 0: every sequence has num_splits splits.
  int64_t split_size = 0;
  WorkspaceSpec workspace;  // empty when num_splits == 1
};

// KV range [begin, end) of split `s` of `n` over `sk` keys, boundaries aligned to `g`.
// Splits past the end are empty (begin == end == sk). The reference and the kernels both use it.
struct KvRange { int64_t begin, end; };
constexpr KvRange split_kv_range(int64_t sk, int n, int s, int64_t g) {
  if (n <= 1) return {0, sk};
  const int64_t per = ((sk + n - 1) / n + g - 1) / g * g;
  const int64_t b = per * s < sk ? per * s : sk;
  const int64_t e = b + per < sk ? b + per : sk;
  return {b, e};
}

// A sequence's own split count: num_splits (split_size 0), else ceil(sk / split_size) clamped
// into [1, num_splits] (a sequence longer than the plan's max_seqlen_k is a caller's error).
constexpr int seq_num_splits(int64_t sk, int num_splits, int64_t split_size) {
  if (split_size <= 0) return num_splits;
  const int64_t n = (sk + split_size - 1) / split_size;
  return n < 1 ? 1 : (n > num_splits ? num_splits : int(n));
}
// KV range of split s of a sequence of sk keys under (num_splits, granularity g, split_size):
// split_kv_range when split_size is 0; else the fixed-size split (the last one of its own
// seq_num_splits taking the rest, so a clamped count still covers every key).
constexpr KvRange seq_split_range(int64_t sk, int num_splits, int s, int64_t g, int64_t split_size) {
  if (split_size <= 0) return split_kv_range(sk, num_splits, s, g);
  const int own = seq_num_splits(sk, num_splits, split_size);
  if (s >= own) return {sk, sk};
  const int64_t b = int64_t(s) * split_size < sk ? int64_t(s) * split_size : sk;
  const int64_t e = s + 1 == own ? sk : (b + split_size < sk ? b + split_size : sk);
  return {b, e};
}

// The split count for a shape: `requested` 0 = heuristic, 1 = none, >1 = forced (capped at
// kMaxSplits, at the number of granules of KV and, on CUDA, at max_split_rows / (total_q x H)).
int choose_num_splits(const ProblemShape& shape, const DeviceProps& dev, int requested);

// On CUDA, the most split partial rows (splits x total_q x H) a plan may hold: a bound on the
// split-KV workspace, (Dv + 1) x 4 bytes per row, independent of the batch capacity (the
// heuristic splits only small row counts: decode-like shapes up to 2 waves of resident CTAs of
// 16 packed rows; 2x that). H200: 16,896 rows, 8.7 MB at Dv = 128.
int64_t max_split_rows(const DeviceProps& dev);
// The bound in batch-invariant mode (its split count follows the KV length, not the shape):
// 8 x max_split_rows. A plan needing more throws, naming it, rather than splitting otherwise.
int64_t max_invariant_split_rows(const DeviceProps& dev);

// Plan for a shape: split count and workspace (split_workspace of splits x total_q x H rows).
// shape.batch_invariant: requested_splits 0 gives the fixed-size splits (split_size) when
// max_seqlen_q <= kBatchInvariantDecodeMaxQ, else none; 1 none; > 1 is an error. Throws when
// ceil(max_seqlen_k / split_size) exceeds kMaxSplits or, on CUDA, its partial rows exceed
// max_invariant_split_rows.
Plan make_plan(const ProblemShape& shape, const DeviceProps& dev, int requested_splits);

// The split-KV workspace of `partial_rows` (splits x rows x heads) partial states:
// o_partial fp32 [partial_rows, Dv], then lse_partial fp32 [partial_rows].
WorkspaceSpec split_workspace(int64_t partial_rows, int64_t head_dim_v);

// Streams, workspace and an optional precomputed plan for a call.
struct ExecContext {
  void* stream = nullptr;       // cudaStream_t for cuda tensors; ignored on cpu
  void* workspace = nullptr;    // device memory of at least plan.workspace.total_bytes
  size_t workspace_bytes = 0;
  const Plan* plan = nullptr;   // scheduler metadata; made for the call's shape (up to total_q:
                                // plan_varlen_attention(p, dev, given) is the plan that runs)
  bool validate_only = false;   // dry run: every check the call makes (CPU: contents too) and
                                // its plan, then return with nothing written
};

}  // namespace flashserve
