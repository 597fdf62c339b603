// try_decode: when the decode kernel (decode_fwd.cuh) serves a problem, and why not otherwise.
// Reads shapes, dtypes and pointer alignment only (never device memory).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "flashserve/status.hpp"
#include "kernels/attention/decode_config.hpp"
#include "kernels/attention/select.hpp"

namespace flashserve::kernels {

namespace {

// cp.async copies 16 bytes: the base and every stride of a dimension with more than one
// element must be 16-byte multiples.
bool chunk_aligned(const TensorRef& t) {
  const int64_t es = int64_t(dtype_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % kDecodeChunk != 0) return false;
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.shape[size_t(d)] > 1 && (t.stride[size_t(d)] * es) % kDecodeChunk != 0) return false;
  return t.ndim == 0 || t.shape[size_t(t.ndim - 1)] <= 1 || t.stride[size_t(t.ndim - 1)] == 1;
}

std::string dtype_reason(const detail::AttnProblem& pr) {
  const DType qt = pr.q.dtype, kt = pr.k.dtype;
  if (pr.q_v) return "no q_v";
  if (qt == DType::i8) {  // the int8 fork's K8V8 / K8V16 (validated: q_scale, k_scale_cache, v_scale)
    if (kt != DType::i8) return detail::cat("int8 q with an int8 k, got ", dtype_name(kt));
    if (!pr.q_scale || !pr.k_scale_cache) return "int8 q and k with q_scale and k_scale_cache";
    if (pr.v.dtype == DType::i8 ? !pr.v_scale : !is_half(pr.v.dtype) || pr.v_scale)
      return detail::cat("int8 v with v_scale (K8V8) or 16-bit v without (K8V16), got ", dtype_name(pr.v.dtype));
    if (pr.q_descale || pr.k_descale || pr.v_descale) return "no descales with int8 operands";
    return {};
  }
  if (!is_half(qt) && !is_fp8(qt)) return detail::cat("q float16/bfloat16, fp8 or int8, got ", dtype_name(qt));
  if (pr.k_scale_cache || pr.v_scale || pr.q_scale) return "int8 scales only with an int8 q";
  if (pr.v.dtype != kt) return detail::cat("k and v of one dtype, got ", dtype_name(kt), "/", dtype_name(pr.v.dtype));
  if (is_fp8(qt)) {  // fp8 q (q_descale): f16 operands against an fp8 cache
    if (!is_fp8(kt)) return detail::cat("fp8 q with an fp8 cache, got k/v ", dtype_name(kt));
  } else {
    if (pr.q_descale) return "no q descale for a 16-bit q";
    if (kt != qt && !is_fp8(kt)) return detail::cat("k/v of q's dtype or fp8, got ", dtype_name(kt));
  }
  return {};
}

// Packed query rows per (sequence, KV head) by the shape (varlen: the caller's max_seqlen_q).
int64_t packed_rows_bound(const detail::AttnProblem& pr) {
  const int64_t sq = pr.batched ? pr.q.size(1) : pr.params->max_seqlen_q;
  return sq * pr.group();
}

}  // namespace

std::string try_decode(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  if (dev.cc_major < 8)
    return detail::cat("decode kernel: compute capability >= 8.0, got ", dev.cc_major, ".", dev.cc_minor);
  if (std::string why = dtype_reason(pr); !why.empty()) return "decode kernel: " + why;
  if (pr.head_dim != pr.head_dim_v || !decode_config_built(pr.k.dtype, pr.head_dim, pr.v.dtype))
    return detail::cat("decode kernel: D == Dv with (k ", dtype_name(pr.k.dtype), ", v ", dtype_name(pr.v.dtype),
                       ", D) instantiated, got D=", pr.head_dim, " Dv=", pr.head_dim_v);
  const int64_t rows = packed_rows_bound(pr);
  // Batch-invariant decode-class calls (query length <= kBatchInvariantDecodeMaxQ) take the
  // decode kernel whatever the group (it loops over row groups): the kernel of a row must not
  // follow the batch's max_seqlen_q.
  const int64_t sq = pr.batched ? pr.q.size(1) : pr.params->max_seqlen_q;
  const bool invariant = pr.params->batch_invariant && sq <= kBatchInvariantDecodeMaxQ;
  const int64_t max_rows = decode_max_rows(kv_bytes(pr.k.dtype) == 1);
  if (!invariant && rows > max_rows)
    return detail::cat("decode kernel: q_len x group <= ", max_rows, ", got ", rows);
  if (!chunk_aligned(pr.k) || !chunk_aligned(pr.v))
    return "decode kernel: k/v base and strides multiples of 16 bytes";
  if (pr.k_scale_cache && reinterpret_cast<uintptr_t>(pr.k_scale_cache->data) % 4 != 0)
    return "decode kernel: k_scale_cache 4-byte aligned";  // 4-byte cp.async per key
  // The grid's x is B x row CTAs x H_kv (decode_fwd.cu: twice decode_row_ctas where 32-row CTAs
  // run as 16-row ones).
  const DecodeKv kvb = decode_kv(pr.k.dtype, pr.v.dtype);
  const int64_t row_ctas = 2 * decode_row_ctas(rows, kvb.kb == 1);
  if (pr.batch * row_ctas * pr.num_kv_heads > INT_MAX)
    return detail::cat("decode kernel: B x H_kv x row CTAs <= ", INT_MAX, ", got ", pr.batch, " x ", pr.num_kv_heads,
                       " x ", row_ctas);
  // Packed rows per CTA (decode_fwd.cu's launch_config reads it: 32-row CTAs where they serve,
  // whose launch may still take 16-row ones: short splits, fixed-size splits).
  const int rows_per_cta = int(decode_cta_rows(rows, kvb.kb == 1));
  const int d = int(pr.head_dim);
  const size_t smem = std::max(decode_smem_bytes(kvb, d, kDecodeRows),
                               rows_per_cta == kDecodeWideRows
                                   ? decode_smem_bytes(kvb, d, rows_per_cta, decode_wide_tiling(kvb, d))
                                   : size_t(0));
  if (smem > max_smem_per_block(dev))
    return detail::cat("decode kernel: ", smem, " bytes of shared memory per block, the device allows ",
                       max_smem_per_block(dev));
  c.kernel = AttnKernelId::decode;
  c.dv_bucket = int(pr.head_dim);
  c.rows_per_cta = rows_per_cta;
  c.heads_per_cta = int(pr.group());
  c.head_slices = 1;
  c.smem_bytes = smem;
  return {};
}

}  // namespace flashserve::kernels
