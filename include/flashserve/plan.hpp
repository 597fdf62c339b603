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

// The split count for a shape: `requested` 0 = heuristic, 1 = none, >1 = forced (capped at
// kMaxSplits, at the number of granules of KV and, on CUDA, at max_split_rows / (total_q x H)).
int choose_num_splits(const ProblemShape& shape, const DeviceProps& dev, int requested);

// On CUDA, the most split partial rows (splits x total_q x H) a plan may hold: a bound on the
// split-KV workspace, (Dv + 1) x 4 bytes per row, independent of the batch capacity (the
// heuristic splits only small row counts: decode-like shapes up to 2 waves of resident CTAs of
// 16 packed rows; 2x that). H200: 16,896 rows, 8.7 MB at Dv = 128.
int64_t max_split_rows(const DeviceProps& dev);

// Plan for a shape: split count and workspace (split_workspace of splits x total_q x H rows).
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
