// select_attention_kernel: the candidates in order and the reason each one declines.
#include <algorithm>
#include <climits>
#include <iterator>

#include "flashserve/status.hpp"
#include "kernels/attention/select.hpp"

namespace flashserve::kernels {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int smallest_bucket(int64_t dv) {
  for (int b : kGenericDvBuckets)
    if (dv <= b) return b;
  return 0;
}

// The generic kernel (generic_fwd.cuh): every validated dtype, layout and modifier. Declines
// only on resource limits. Fills `c` and returns "" when it applies.
std::string try_generic(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  if (dev.cc_major < 8)
    return detail::cat("generic kernel: compute capability >= 8.0, got ", dev.cc_major, ".", dev.cc_minor);
  const int64_t qv = pr.q_v ? pr.head_dim_v : 0;
  if (pr.head_dim + qv > kGenericMaxQkWidth)
    return detail::cat("generic kernel: D (+ Dv of q_v) <= ", kGenericMaxQkWidth, ", got ", pr.head_dim + qv);
  const int bucket = smallest_bucket(pr.head_dim_v);
  if (bucket == 0)
    return detail::cat("generic kernel: Dv <= ", kGenericDvBuckets[std::size(kGenericDvBuckets) - 1],
                       " (built accumulator widths), got ", pr.head_dim_v);
  const size_t smem = generic_smem_bytes(pr.head_dim, pr.head_dim_v, qv);
  if (smem > max_smem_per_block(dev))
    return detail::cat("generic kernel: ", smem, " bytes of shared memory per block, the device (sm_",
                       dev.cc_major, dev.cc_minor, ") allows ", max_smem_per_block(dev));
  const int64_t group = pr.group();
  const int64_t heads = std::min<int64_t>(group, kGenericPackedRows);
  const int64_t slices = ceil_div(group, heads);
  const int64_t rows = std::max<int64_t>(1, kGenericPackedRows / heads);
  if (pr.num_kv_heads * slices > 65535)
    return detail::cat("generic kernel: H_kv * ceil(group / ", heads, ") <= 65535 CTAs in y, got ",
                       pr.num_kv_heads * slices);
  if (ceil_div(pr.total_q, rows) > INT_MAX)
    return detail::cat("generic kernel: at most ", int64_t(INT_MAX) * rows, " query rows, got ", pr.total_q);
  c.kernel = AttnKernelId::generic;
  c.dv_bucket = bucket;
  c.rows_per_cta = int(rows);
  c.heads_per_cta = int(heads);
  c.head_slices = int(slices);
  c.smem_bytes = smem;
  return {};
}

}  // namespace

size_t generic_smem_bytes(int64_t d, int64_t dv, int64_t qv_dim) {
  const int64_t floats = kGenericPackedRows * (d + qv_dim) + kGenericTileKeys * (d + 1) + kGenericTileKeys * (dv + 1);
  return kGenericTileKeys * kGenericTokenLocBytes + size_t(floats) * sizeof(float);
}

size_t max_smem_per_block(const DeviceProps& dev) {
  const int cc = dev.cc_major * 10 + dev.cc_minor;
  if (cc == 80 || cc == 87) return 166912;  // A100, Orin: 163 KB
  if (cc == 90 || cc == 100 || cc == 103) return 232448;  // H100/H200, B200: 227 KB
  if (cc >= 80) return 101376;              // sm_86/89/12x: 99 KB
  return 49152;
}

AttnKernelChoice select_attention_kernel(const detail::AttnProblem& pr, const DeviceProps& dev) {
  AttnKernelChoice c;
  std::string why = try_generic(pr, dev, c);
  if (c.supported()) return c;
  c.why_not = "attention on CUDA: no kernel for this problem (" + why + ")";
  return c;
}

const char* kernel_name(AttnKernelId id) {
  switch (id) {
    case AttnKernelId::none: return "none";
    case AttnKernelId::generic: return "generic";
  }
  return "?";
}

}  // namespace flashserve::kernels
