// Random attention cases: from one configuration, both the flashserve call (AttentionParams
// over owning host tensors, with strided views, paged caches, quantized operands) and the same
// problem as dense double data per sequence for the fp64 oracle. Dequantization here is
// independent of src/reference: stored value (numeric codecs) times its scale, in double.
// attention_case.cpp builds and runs a case, case_config.cpp draws and describes
// configurations, attention_check.cpp compares with the oracle.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashserve/attention.hpp"
#include "naive/naive_attention.hpp"
#include "support/host_tensor.hpp"

namespace fstest {

// How the batch and its KV are described.
enum class KvMode : uint8_t {
  varlen_contiguous,   // k [total_k, H_kv, D] + cu_seqlens_k (+ seqused_k with use_seqused)
  varlen_paged,        // block_table + seqused_k (cu_seqlens_k alone without use_seqused)
  batched_paged,       // q [B, sq, H, D], block_table + cache_seqlens
  batched_contiguous,  // k [B_cache, S_cache, H_kv, D] (+ cache_seqlens with use_seqused)
};

enum class QuantMode : uint8_t {
  none,        // q, k, v of one float dtype
  fp8_kv,      // fp8 k/v with k_descale/v_descale; q float
  fp8_qkv,     // fp8 q (q_descale) and k/v; out bf16
  int8_k8v8,   // q, k, v int8 with q_scale, k_scale_cache, v_scale
  int8_k8v16,  // q, k int8; v f16/bf16
};

struct CaseConfig {
  KvMode mode = KvMode::varlen_contiguous;
  flashserve::KvLayout layout = flashserve::KvLayout::nhd;
  int64_t block_size = 16;
  int64_t H = 1, H_kv = 1, D = 64, Dv = 64;
  bool has_qv = false;                  // q_v [.., H, Dv] (D = 64, Dv = 512)
  std::vector<int64_t> q_lens, k_lens;  // per sequence (batched: q_lens all equal)

  // Batch description variants.
  bool use_seqused = true;          // see KvMode
  bool use_cache_batch_idx = false; // batched contiguous
  int64_t max_seqlen_slack = 0;     // varlen: max_seqlen_q/k exceed the true maxima by this
  int64_t extra_kv_rows = 0;        // unused (poisoned) KV rows/blocks/cache rows around the data
  int64_t extra_table_cols = 0;     // block_table columns past the used ones

  // dtypes.
  QuantMode quant = QuantMode::none;
  flashserve::DType q_dtype = flashserve::DType::f16;   // float dtype of q (none, fp8_kv)
  flashserve::DType kv_dtype = flashserve::DType::f16;  // none: = q_dtype; fp8: the format
  flashserve::DType out_dtype = flashserve::DType::f16;
  flashserve::DType v16_dtype = flashserve::DType::f16; // K8V16: v's dtype
  flashserve::DType sink_dtype = flashserve::DType::f32;
  int descale_broadcast = 0;        // 0: [B, H_kv]; 1: stride 0 over B; 2: strides (0, 0)

  // Strided views.
  bool kv_interleaved = false;      // K and V share one buffer (per block / per token)
  bool kv_latent = false;           // MLA latent cache: per token and KV head one row [v (Dv) | k (D)],
                                    // k at channel Dv (DeepSeek's kv_c_and_k_pe); NHD; over kv_interleaved
  int64_t kv_pad = 0;               // extra elements per block (paged) or token (contiguous)
  int64_t table_row_pad = 0;        // block_table row stride = max_blocks + pad
  int64_t table_col_offset = 0;     // ... starting this many columns into the row
  int64_t q_pad = 0;                // q token stride = H * D + q_pad
  int64_t out_pad = 0;              // out token stride = H * Dv + out_pad
  bool random_block_ids = false;    // blocks in random order (else sequential)

  // Score modifiers and execution.
  float softmax_scale = 0.0f;       // 0: default
  float softcap = 0.0f;
  int alibi = 0;                    // 0 none, 1 [H], 2 [B, H]
  bool alibi_sqrt = false;
  bool causal = false;
  flashserve::Window window{};
  int64_t chunk = 0;
  bool sinks = false;
  bool lse = false;
  int num_splits = 0;

  bool batched() const { return mode == KvMode::batched_paged || mode == KvMode::batched_contiguous; }
  bool paged() const { return mode == KvMode::varlen_paged || mode == KvMode::batched_paged; }
  int64_t batch() const { return int64_t(q_lens.size()); }
};

std::string describe(const CaseConfig& c);
// Feature tags the configuration covers ("paged_hnd", "bs=1", "softcap", ...), for coverage.
std::vector<std::string> coverage_tags(const CaseConfig& c);

// A random valid configuration (lengths kept small; see the budget in the .cpp).
CaseConfig random_case_config(std::mt19937_64& rng);

// Every KvMode, for hand-written cases run in each.
inline constexpr KvMode kAllKvModes[] = {KvMode::varlen_contiguous, KvMode::varlen_paged, KvMode::batched_paged,
                                         KvMode::batched_contiguous};
// A small fp32 configuration for hand-written cases: H 4, H_kv 2, D = Dv = 32, lse, one unused
// KV row and block-table column. Batched modes take q_lens[0] for every sequence.
CaseConfig small_case_config(KvMode mode, std::vector<int64_t> q_lens, std::vector<int64_t> k_lens);

// The built case: the call's params over owning storage, and the oracle's view.
struct AttentionCase {
  CaseConfig cfg;
  flashserve::AttentionParams params;
  std::vector<HostTensor> storage;      // everything params views (keeps it alive)
  HostTensor out;                       // the out tensor (whole storage poisoned before a run)
  HostTensor lse;                       // valid when cfg.lse
  std::vector<int64_t> q_row0;          // varlen: first row of sequence b; batched: 0
  std::vector<NaiveSequence> seqs;      // per sequence, dequantized
  std::vector<NaiveFeatures> feats;     // per sequence (ALiBi [B, H] differs per sequence)
};

// Builds the case; values and scales are drawn from rng. Every KV element outside the used
// tokens (seqused tails, unused blocks and slots, padding) is poisoned (NaN for float codes).
AttentionCase build_case(const CaseConfig& c, std::mt19937_64& rng);

// Poisons out and lse, then calls varlen_attention or kvcache_attention.
void run_case(AttentionCase& ac);

// The bound on the logit error (natural-log units) of row (i, head h) of sequence b when the
// soft-cap's tanh is computed with a relative error of at most 2^-11 (PTX tanh.approx.f32, the
// tensor-core prefill kernels): 2^-11 max |softcap tanh(scale q.k / softcap)| over the
// sequence's keys (the ALiBi bias, added after the cap, is exact). 0 without a soft-cap.
double approx_tanh_logit_err(const AttentionCase& ac, int64_t b, int64_t h, int64_t i);

// The output error those logit errors (each within e) allow: every weight p_j moves by a factor
// within [exp(-2e), exp(2e)] after normalization, so sum |p'_j - p_j| <= expm1(2e) and
// |out' - out| <= expm1(2e) max|v|; the lse moves by at most e.
inline double approx_tanh_out_err(double e) { return std::expm1(2.0 * e); }

// Compares the result with the oracle. Empty when it agrees; otherwise a description of the
// first mismatches. Checks: no NaN anywhere in out, lse -inf rows agree, rows with no visible
// key exactly 0, out padding untouched, values within tolerance. `approx_tanh`: the result was
// computed with tanh.approx for the soft-cap; the tolerances of soft-capped rows widen by its
// error bound (approx_tanh_logit_err, approx_tanh_out_err).
// How a kernel's arithmetic departs from fp32 beyond the output's rounding, which the checks
// allow for:
// - approx_tanh: the soft-cap's tanh.approx (approx_tanh_logit_err);
// - p_round: the weights P rounded before P V, each within p_round of itself or of the row's
//   largest weight (fp8 P: 2^-4 for e4m3's 3 mantissa bits, plus the subnormals' absolute
//   spacing per key); out moves by up to p_round max|v|;
// - qk_rel: q.k accumulated with an error of up to qk_rel sum_d |q_d k_d| (fp8 wgmma), a logit
//   error like the tanh's (qk_logit_err).
struct KernelError {
  bool approx_tanh = false;
  double p_round = 0.0;
  double qk_rel = 0.0;
};

// The bound on row (i, h)'s logit error from q.k's accumulation: qk_rel scale max_j
// sum_d |q_d k_d| (over every key of the sequence; the soft-cap's tanh only shrinks it).
double qk_logit_err(const AttentionCase& ac, int64_t b, int64_t h, int64_t i, double qk_rel);

std::string check_case(const AttentionCase& ac, const KernelError& err);
inline std::string check_case(const AttentionCase& ac, bool approx_tanh = false) {
  return check_case(ac, KernelError{approx_tanh});
}

}  // namespace fstest
