// try_decode_mla: when the MLA absorbed-decode kernel (decode_mla.cuh) serves a problem, and
// why not otherwise. Reads shapes, dtypes and pointer alignment only (never device memory).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "flashserve/status.hpp"
#include "kernels/attention/decode_mla_config.hpp"
#include "kernels/attention/select.hpp"

namespace flashserve::kernels {

namespace {

// cp.async copies 16 bytes: the base and every stride of a dimension with more than one
// element 16-byte multiples, the last dim contiguous.
bool rows_aligned_16(const TensorRef& t) {
  const int64_t es = int64_t(dtype_size(t.dtype));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.shape[size_t(d)] > 1 && (t.stride[size_t(d)] * es) % 16 != 0) return false;
  return t.ndim == 0 || t.shape[size_t(t.ndim - 1)] <= 1 || t.stride[size_t(t.ndim - 1)] == 1;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string try_decode_mla(const detail::AttnProblem& pr, const DeviceProps& dev, AttnKernelChoice& c) {
  const char* what = "decode_mla kernel: ";
  if (kernel_disabled(AttnKernelId::decode_mla)) return detail::cat(what, "disabled by FLASHSERVE_DISABLE_KERNELS");
  if (!pr.q_v) return detail::cat(what, "q_v (MLA absorbed decode)");
  if (dev.cc_major < 8) return detail::cat(what, "compute capability >= 8.0, got ", dev.cc_major, ".", dev.cc_minor);
  if (pr.head_dim != kMlaD || pr.head_dim_v != kMlaDv)
    return detail::cat(what, "D = ", kMlaD, " and Dv = ", kMlaDv, ", got ", pr.head_dim, "/", pr.head_dim_v);
  if (pr.num_kv_heads != 1) return detail::cat(what, "H_kv = 1, got ", pr.num_kv_heads);
  const DType t = pr.q.dtype;
  if (t != DType::bf16 && t != DType::f16) return detail::cat(what, "q float16/bfloat16, got ", dtype_name(t));
  if (pr.q_v->dtype != t) return detail::cat(what, "q_v of q's dtype (", dtype_name(t), "), got ", dtype_name(pr.q_v->dtype));
  // out in q's dtype, or fp32 (the DCP step's partial outputs before lse_correct): the epilogue
  // and the split combine store through store_from_float.
  if (pr.out.dtype != t && pr.out.dtype != DType::f32)
    return detail::cat(what, "out of q's dtype (", dtype_name(t), ") or float32, got ", dtype_name(pr.out.dtype));
  const DType kv = pr.k.dtype;
  const bool fp8 = is_fp8(kv);
  if ((kv != t && !fp8) || pr.v.dtype != kv)
    return detail::cat(what, "k and v of q's dtype (", dtype_name(t), ") or of one fp8 format, got ", dtype_name(kv), "/",
                       dtype_name(pr.v.dtype));
  if (!mla_config_built(t, kv))
    return detail::cat(what, "q ", dtype_name(t), " with k/v ", dtype_name(kv), " instantiated (kMlaConfigs)");
  if (pr.q_scale || pr.k_scale_cache || pr.v_scale || pr.q_descale)
    return detail::cat(what, "no quantization scales and no q_descale (q is 16-bit)");
  if (!fp8 && (pr.k_descale || pr.v_descale)) return detail::cat(what, "k_descale / v_descale only with fp8 k/v");
  if (!rows_aligned_16(pr.q) || !rows_aligned_16(*pr.q_v) || !rows_aligned_16(pr.k) || !rows_aligned_16(pr.v))
    return detail::cat(what, "q, q_v, k, v: base and strides multiples of 16 bytes, rows contiguous");
  const int64_t sq = pr.batched ? pr.q.size(1) : pr.params->max_seqlen_q;
  const int64_t packed = std::max<int64_t>(1, sq) * pr.num_heads;
  const int rows = mla_rows_for(packed);
  const int64_t slices = ceil_div(packed, rows);
  if (slices > 65535 || pr.batch > INT_MAX)
    return detail::cat(what, "ceil(q_len x H / ", rows, ") <= 65535 and B <= ", INT_MAX, ", got ", slices, "/",
                       pr.batch);
  const size_t smem = mla_smem_bytes(rows, int(dtype_size(kv)));
  if (smem > max_smem_per_block(dev))
    return detail::cat(what, smem, " bytes of shared memory per block, the device (sm_", dev.cc_major, dev.cc_minor,
                       ") allows ", max_smem_per_block(dev));
  c.kernel = AttnKernelId::decode_mla;
  c.dv_bucket = kMlaDv;
  c.rows_per_cta = rows;
  c.heads_per_cta = int(pr.num_heads);
  c.head_slices = int(slices);
  c.smem_bytes = smem;
  // On an H100/H200 in a build with sm_90a: the wgmma kernels (64 rows of a 16-bit latent
  // cache: decode_mla_pp.cuh where TMA can load the tiles, else decode_mla_wgmma.cuh; 16 rows of
  // a 16-bit or fp8 one: decode_mla_heads.cuh (decode_mla_heads_tma.cuh where TMA can load a
  // 16-bit cache), whose launcher picks one of two shapes by the grid: smem_bytes is the largest). Their shared memory
  // fits a 9.0 device (decode_mla_config.hpp's static_asserts).
  if ((!fp8 || rows == kMlaHeadsRows) && FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0 &&
      !kernel_disabled(AttnKernelId::decode_mla_wgmma)) {
    c.kernel = AttnKernelId::decode_mla_wgmma;
    c.smem_bytes = rows == 64 ? mla_rows64_smem_bytes() : mla_rows16_smem_bytes(fp8);
  }
  return {};
}

}  // namespace flashserve::kernels
