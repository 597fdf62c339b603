// select_attention_kernel: the candidates in order and the reason each one declines.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <iterator>

#include "flashserve/status.hpp"
#include "kernels/attention/select.hpp"
#include "kernels/common/env_switch.hpp"

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

// Whether a strided operand suits 16-byte vector access: base and every stride of a dim
// longer than 1 a multiple of 16 bytes, last dim contiguous.
bool rows_16b_aligned(const TensorRef& t) {
  const int64_t es = int64_t(dtype_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0 || t.ndim < 1 || t.stride[size_t(t.ndim - 1)] != 1) return false;
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.size(d) > 1 && (t.stride[size_t(d)] * es) % 16 != 0) return false;
  return true;
}

// What every tensor-core prefill kernel (prefill_common.cuh's schedule) needs besides its
// dtypes: no q_v or int8 scales, ALiBi not with context parallelism, 16-byte aligned rows, a
// cache span and row-tile count in int32. "" when the problem is in scope, else the reason
// (prefixed by `what`).
std::string prefill_layout_scope(const detail::AttnProblem& pr, const char* what) {
  const AttentionParams& p = *pr.params;
  if (pr.q_v || pr.q_scale || pr.k_scale_cache || pr.v_scale) return detail::cat(what, "no q_v or int8 scales");
  if (pr.alibi_slopes && (p.cp_world_size > 1 || pr.cp_tot_seqused_k))  // AlibiBias: keys one position apart
    return detail::cat(what, "no ALiBi with context parallelism");
  if (!rows_16b_aligned(pr.q) || !rows_16b_aligned(pr.k) || !rows_16b_aligned(pr.v) || !rows_16b_aligned(pr.out))
    return detail::cat(what, "q, k, v, out with 16-byte aligned rows");
  const int64_t cols = pr.paged && pr.block_table ? pr.block_table->size(1) : 1;
  if (pr.k.size(1) > kPrefillMaxCacheTokens / std::max<int64_t>(cols, 1))
    return detail::cat(what, "a sequence's cache span (block_size x max_blocks or rows_k) <= ",
                       kPrefillMaxCacheTokens, " tokens, got ", pr.k.size(1), " x ", cols);
  static_assert(kPrefillRowsPerCta == kWgmmaRowsPerCta, "one row-tile grid");
  const int64_t tiles = pr.batched ? pr.batch * ceil_div(pr.q.size(1), kPrefillRowsPerCta)
                                   : pr.total_q / kPrefillRowsPerCta + pr.batch + 1;
  if (tiles > INT_MAX || pr.num_heads > 65535)
    return detail::cat(what, "at most ", INT_MAX, " row tiles and 65535 heads, got ", tiles, " and ", pr.num_heads);
  return {};
}

// The scope of the 16-bit tensor-core prefill kernels: f16/bf16 q/k/v of one dtype, out of
// that dtype (or fp32 with `f32_out`), causal / window / chunked local attention / soft-cap /
// ALiBi (linear or sqrt) / sinks, context parallelism (not with ALiBi), contiguous or paged KV
// (any block size), any split count; no q_v or quantization.
std::string prefill_scope(const detail::AttnProblem& pr, const char* what, bool f32_out) {
  const DType t = pr.q.dtype;
  if (t != DType::bf16 && t != DType::f16) return detail::cat(what, "q f16/bf16, got ", dtype_name(t));
  if (pr.k.dtype != t || pr.v.dtype != t) return detail::cat(what, "k and v of q's dtype");
  // fp32 out holds partial states merged later (cascade, MLA chunks): it keeps P to fp32
  // precision, which the wgmma kernel does (P V adds the residues of P's rounding) and the
  // mma.sync one does not.
  if (pr.out.dtype != t && !(f32_out && pr.out.dtype == DType::f32))
    return detail::cat(what, f32_out ? "out of q's dtype or fp32" : "out of q's dtype (fp32 out needs fp32 P)");
  if (pr.q_descale || pr.k_descale || pr.v_descale) return detail::cat(what, "no descales");
  return prefill_layout_scope(pr, what);
}

// Fills `c` for a prefill kernel of `smem` bytes and returns "", or the reason it does not fit.
std::string take_prefill(AttnKernelId id, size_t smem, const DeviceProps& dev, const char* what,
                         const detail::AttnProblem& pr, AttnKernelChoice& c) {
  if (smem > max_smem_per_block(dev))
    return detail::cat(what, smem, " bytes of shared memory per block, the device allows ", max_smem_per_block(dev));
  c.kernel = id;
  c.dv_bucket = int(pr.head_dim_v);
  c.rows_per_cta = kPrefillRowsPerCta;
  c.heads_per_cta = 1;
  c.head_slices = 1;
  c.smem_bytes = smem;
  return {};
}

// What every sm_90a kernel needs: not disabled (FLASHSERVE_DISABLE_KERNELS), a build with
// sm_90a code, a compute capability 9.0 device.
std::string sm90_gate(AttnKernelId kernel, const DeviceProps& dev, const char* what) {
  if (kernel_disabled(kernel)) return detail::cat(what, "disabled by FLASHSERVE_DISABLE_KERNELS");
  if (!FLASHSERVE_SM90A) return detail::cat(what, "a build with sm_90a code (FLASHSERVE_CUDA_ARCHS)");
  if (dev.cc_major != 9 || dev.cc_minor != 0)
    return detail::cat(what, "compute capability 9.0, got ", dev.cc_major, ".", dev.cc_minor);
  return {};
}

// The sm_90a wgmma prefill kernel (prefill_wgmma.cuh): the prefill scope with fp32 out too, on
// compute capability 9.0 in builds with sm_90a code, (D, Dv) in kPrefillWgmmaConfigs.
std::string try_prefill_wgmma(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  const char* what = "prefill_wgmma kernel: ";
  if (std::string why = sm90_gate(AttnKernelId::prefill_wgmma, dev, what); !why.empty()) return why;
  std::string why = prefill_scope(pr, what, true);
  if (!why.empty()) return why;
  if (pr.alibi_slopes && pr.out.dtype == DType::f32)  // not instantiated (prefill_wgmma.cu)
    return detail::cat(what, "no ALiBi with fp32 out");
  if (!prefill_wgmma_config_built(pr.q.dtype, pr.head_dim, pr.head_dim_v))
    return detail::cat(what, "D/Dv in the built configurations, got ", pr.head_dim, "/", pr.head_dim_v);
  return take_prefill(AttnKernelId::prefill_wgmma, prefill_wgmma_smem_bytes(pr.head_dim, pr.head_dim_v), dev, what,
                      pr, c);
}

// Whether TMA can map an operand: tma_dim_ok for every dim (tma_map.cu asks the same of the
// kernel's normalized view; alignment is prefill_scope's).
bool tma_sizes_ok(const TensorRef& t) {
  const int64_t es = int64_t(dtype_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (!tma_dim_ok(t.size(d), t.stride[size_t(d)], es)) return false;
  const int64_t channels = t.ndim > 0 ? t.size(t.ndim - 1) : 0;  // contiguous (prefill_scope)
  return channels >= 1 && channels < (int64_t(1) << 31);
}

// What the TMA kernels need of the operands: paged block sizes prefill_tma_block_size_ok
// takes, coordinates in int32, and maps TMA can make.
std::string tma_scope(const detail::AttnProblem& pr, const char* what) {
  if (pr.paged && !prefill_tma_block_size_ok(pr.head_dim, pr.head_dim_v, pr.k.size(1)))
    return detail::cat(what, "contiguous K/V or a paged block size that is a multiple of 16 dividing the ",
                       wgmma_tile_keys(pr.head_dim, pr.head_dim_v), "-key tile or divided by it, got ", pr.k.size(1),
                       " (other block sizes: prefill_wgmma)");
  const int64_t rows_k = pr.k.size(1), n_tiles = rows_k + 4 * 128;
  if (pr.q.size(1) >= INT_MAX - 256 || n_tiles >= INT_MAX || pr.k.size(0) >= INT_MAX || pr.q.size(0) >= INT_MAX)
    return detail::cat(what, "TMA coordinates in int32");
  if (!tma_sizes_ok(pr.q) || !tma_sizes_ok(pr.k) || !tma_sizes_ok(pr.v))
    return detail::cat(what, "q, k, v TMA can map (non-empty dims, strides below 2^40 bytes)");
  return {};
}

// The sm_90a warp-specialized prefill kernel (prefill_tma.cuh): prefill_wgmma's scope for
// contiguous K/V and paged caches of prefill_tma_block_size_ok block sizes (NHD or HND: the
// normalized view's strides), whose operands TMA can map ((D, Dv) in kPrefillTmaConfigs;
// 16-byte strides).
std::string try_prefill_tma(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  const char* what = "prefill_tma kernel: ";
  if (std::string why = sm90_gate(AttnKernelId::prefill_tma, dev, what); !why.empty()) return why;
  std::string why = prefill_scope(pr, what, true);
  if (!why.empty()) return why;
  if (pr.alibi_slopes && pr.out.dtype == DType::f32) return detail::cat(what, "no ALiBi with fp32 out");
  if (!prefill_tma_config_built(pr.q.dtype, pr.head_dim, pr.head_dim_v))
    return detail::cat(what, "D/Dv in the built configurations, got ", pr.head_dim, "/", pr.head_dim_v);
  if (std::string why_tma = tma_scope(pr, what); !why_tma.empty()) return why_tma;
  const int64_t max_q = pr.batched ? pr.q.size(1) : (pr.params->max_seqlen_q > 0 ? pr.params->max_seqlen_q : pr.total_q);
  const int rows = prefill_tma_rows(pr.head_dim, pr.head_dim_v, pr.out.dtype == DType::f32, max_q, pr.params->causal);
  why = take_prefill(AttnKernelId::prefill_tma, prefill_tma_smem_bytes(pr.head_dim, pr.head_dim_v, rows), dev, what,
                     pr, c);
  if (why.empty()) c.rows_per_cta = rows;
  return why;
}

// The sm_90a fp8 prefill kernel (prefill_fp8.cuh): q, k, v fp8 e4m3 with descales, out
// f16/bf16/fp32, prefill_tma's operands and modifiers but ALiBi, (D, Dv) in kPrefillFp8Configs.
std::string try_prefill_fp8(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  const char* what = "prefill_fp8 kernel: ";
  if (std::string why = sm90_gate(AttnKernelId::prefill_fp8, dev, what); !why.empty()) return why;
  if (pr.q.dtype != DType::f8e4m3 || pr.k.dtype != DType::f8e4m3 || pr.v.dtype != DType::f8e4m3)
    return detail::cat(what, "q, k and v fp8 e4m3, got ", dtype_name(pr.q.dtype), "/", dtype_name(pr.k.dtype), "/",
                       dtype_name(pr.v.dtype));
  const DType ot = pr.out.dtype;
  if (ot != DType::bf16 && ot != DType::f16 && ot != DType::f32)
    return detail::cat(what, "out bf16, f16 or fp32, got ", dtype_name(ot));
  if (pr.alibi_slopes) return detail::cat(what, "no ALiBi");
  if (std::string why = prefill_layout_scope(pr, what); !why.empty()) return why;
  if (!prefill_fp8_config_built(pr.q.dtype, pr.head_dim, pr.head_dim_v))
    return detail::cat(what, "D/Dv in the built configurations (128/128), got ", pr.head_dim, "/", pr.head_dim_v);
  if (std::string why = tma_scope(pr, what); !why.empty()) return why;
  return take_prefill(AttnKernelId::prefill_fp8, prefill_fp8_smem_bytes(pr.head_dim, pr.head_dim_v), dev, what, pr, c);
}

// The sm80+ mma.sync prefill kernel (prefill_fwd.cuh): the prefill scope, D == Dv in kPrefillConfigs.
std::string try_prefill_mma(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  const char* what = "prefill_mma kernel: ";
  if (kernel_disabled(AttnKernelId::prefill_mma)) return detail::cat(what, "disabled by FLASHSERVE_DISABLE_KERNELS");
  if (dev.cc_major < 8) return detail::cat(what, "compute capability >= 8.0, got ", dev.cc_major, ".", dev.cc_minor);
  std::string why = prefill_scope(pr, what, false);
  if (!why.empty()) return why;
  if (pr.head_dim != pr.head_dim_v) return detail::cat(what, "D == Dv, got ", pr.head_dim, "/", pr.head_dim_v);
  if (!prefill_config_built(pr.q.dtype, pr.head_dim))
    return detail::cat(what, "D in the built configurations, got ", pr.head_dim);
  return take_prefill(AttnKernelId::prefill_mma, prefill_smem_bytes(pr.head_dim), dev, what, pr, c);
}

}  // namespace

// Whether FLASHSERVE_DISABLE_KERNELS (comma-separated kernel names) names `kernel`. The list
// is parsed once into a bit per kernel: the selection runs on every forward call.
bool kernel_disabled(AttnKernelId kernel) {
  static const uint32_t mask = [] {
    const char* env = std::getenv("FLASHSERVE_DISABLE_KERNELS");
    const std::string list = "," + std::string(env ? env : "") + ",";
    uint32_t m = 0;
    for (AttnKernelId id : {AttnKernelId::prefill_mma, AttnKernelId::prefill_wgmma, AttnKernelId::decode_mla,
                            AttnKernelId::prefill_tma, AttnKernelId::decode_mla_wgmma, AttnKernelId::prefill_fp8})  // the ones it can take out
      if (list.find(std::string(",") + kernel_name(id) + ",") != std::string::npos) m |= 1u << unsigned(id);
    return m;
  }();
  return (mask >> unsigned(kernel)) & 1u;
}

int prefill_tma_persistent_ctas(int64_t max_split_keys, int num_sms) {
  static const int forced = env_digit<0, 1, -1>("FLASHSERVE_PREFILL_PERSISTENT");
  const bool on = forced >= 0 ? forced == 1 : max_split_keys > 0 && max_split_keys <= kPrefillPersistentMaxKeys;
  return on ? num_sms : 0;
}

bool decode_cluster_splits(int num_splits, int64_t split_size, int default_max, const DeviceProps& dev) {
  static const int forced = env_digit<0, 1, -1>("FLASHSERVE_DECODE_CLUSTER");
  // The merge exists in the sm_90a image only (cluster_merge.cuh): any other image the device
  // would run (sm_80 code, or its PTX JIT-compiled for a newer GPU) writes the partials instead.
  if (!FLASHSERVE_SM90A || dev.cc_major != 9 || dev.cc_minor != 0) return false;
  if (num_splits < 2 || split_size > 0 || num_splits > kClusterMaxCtas) return false;
  return forced >= 0 ? forced == 1 : num_splits <= default_max;
}

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
  const std::string why_mla = try_decode_mla(pr, dev, c);  // decode_mla_select.cu
  if (c.supported()) return c;
  const std::string why_decode = try_decode(pr, dev, c);  // decode_select.cu
  if (c.supported()) return c;
  const std::string why_fp8 = try_prefill_fp8(pr, dev, c);
  if (c.supported()) return c;
  const std::string why_tma = try_prefill_tma(pr, dev, c);
  if (c.supported()) return c;
  const std::string why_wgmma = try_prefill_wgmma(pr, dev, c);
  if (c.supported()) return c;
  const std::string why_prefill = try_prefill_mma(pr, dev, c);
  if (c.supported()) return c;
  std::string why = try_generic(pr, dev, c);
  if (c.supported()) return c;
  c.why_not = "attention on CUDA: no kernel for this problem (" + why_mla + "; " + why_decode + "; " + why_fp8 + "; " +
              why_tma + "; " +
              why_wgmma + "; " + why_prefill + "; " + why + ")";
  return c;
}

const char* kernel_name(AttnKernelId id) {
  switch (id) {
    case AttnKernelId::none: return "none";
    case AttnKernelId::generic: return "generic";
    case AttnKernelId::prefill_mma: return "prefill_mma";
    case AttnKernelId::prefill_wgmma: return "prefill_wgmma";
    case AttnKernelId::prefill_tma: return "prefill_tma";
    case AttnKernelId::decode: return "decode";
    case AttnKernelId::decode_mla: return "decode_mla";
    case AttnKernelId::decode_mla_wgmma: return "decode_mla_wgmma";
    case AttnKernelId::prefill_fp8: return "prefill_fp8";
  }
  return "?";
}

const char* AttnKernelChoice::name() const { return kernel_name(kernel); }

}  // namespace flashserve::kernels
