// GPU attention test harness shared by test_gpu_attention.cpp and test_gpu_graph.cpp: an
// AttentionCase (tests/cpp/naive) mirrored to the device storage by storage (strides,
// padding, K/V interleaving and NaN-poisoned unused KV are kept), run there, copied back, and
// compared with the CPU reference run under the same plan.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/numeric.hpp"
#include "kernels/device_info.hpp"
#include "naive/attention_case.hpp"
#include "support/device_tensor.hpp"

namespace fsgpu {

namespace fs = flashserve;

// A D = 128 prefill configuration with LSE, one split, a spare KV row and block-table column,
// q/K/V/out of dtype t (the prefill tests' base; the fp8 one sets its quantization and out).
inline fstest::CaseConfig prefill_case_config(fstest::KvMode mode, std::vector<int64_t> q_lens,
                                              std::vector<int64_t> k_lens, int64_t H, int64_t H_kv,
                                              flashserve::DType t) {
  fstest::CaseConfig c;
  c.mode = mode;
  if (c.batched()) q_lens.assign(k_lens.size(), q_lens[0]);
  c.H = H, c.H_kv = H_kv, c.D = c.Dv = 128;
  c.q_dtype = c.kv_dtype = c.out_dtype = t;
  c.q_lens = std::move(q_lens);
  c.k_lens = std::move(k_lens);
  c.lse = true;
  c.num_splits = 1;
  c.extra_kv_rows = 1;
  c.extra_table_cols = 1;
  return c;
}

// A device copy of h's storage; an empty storage gets no allocation (and no CUDA call).
// 160 short sequences (1 to 200 query rows, every ninth empty; every fifth with up to 199 more
// keys than queries): a grid of many more prefill items than SMs, so that a persistent CTA walks
// many (prefill_persistent.cuh), inactive row tiles among them.
inline void many_short_sequences(std::vector<int64_t>& q, std::vector<int64_t>& k) {
  q.assign(160, 0);
  k.assign(160, 0);
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = i % 9 == 4 ? 0 : int64_t((i * 53) % 200) + 1;
    k[i] = q[i] + (i % 5 == 1 ? int64_t((i * 17) % 200) : 0);
  }
}

inline DeviceTensor mirror_storage(const fstest::HostTensor& h) {
  if (!h.bytes->empty()) return DeviceTensor::mirror(h);
  DeviceTensor d;
  d.ref = h.ref;
  d.ref.data = nullptr;
  d.ref.device = fs::Device{fs::DeviceType::cuda, 0};
  return d;
}

// Transfers and poisoning that skip empty storages.
inline void upload(const DeviceTensor& d, const fstest::HostTensor& h) {
  if (d.bytes) d.copy_from(h);
}
inline void download(const DeviceTensor& d, const fstest::HostTensor& h) {
  if (d.bytes) d.copy_to(h);
}
inline void poison_device(const DeviceTensor& d) {
  if (d.bytes) poison(d);
}

// The device side of a case: one mirror per host storage, and the params over the mirrors.
struct DeviceCase {
  std::vector<std::pair<const std::vector<unsigned char>*, DeviceTensor>> mirrors;
  fs::AttentionParams params;  // the case's params, every view rebased onto the device

  const DeviceTensor& mirror_of(const fstest::HostTensor& h) const {
    for (const auto& [bytes, d] : mirrors)
      if (bytes == h.bytes.get()) return d;
    throw std::runtime_error("no device mirror for this host tensor");
  }
  // Host -> device again for every storage (after the host side changed).
  void upload(const fstest::AttentionCase& ac) const {
    for (const fstest::HostTensor& h : ac.storage) fsgpu::upload(mirror_of(h), h);
    sync();  // a pageable upload may still be in flight when cudaMemcpy returns
  }
};

inline void rebase(const DeviceCase& dc, fs::TensorRef& r) {
  const char* p = static_cast<const char*>(r.data);
  for (const auto& [bytes, d] : dc.mirrors) {
    const char* lo = reinterpret_cast<const char*>(bytes->data());
    if (p >= lo && (p < lo + bytes->size() || p == lo)) {
      r.data = static_cast<char*>(d.storage.get()) + (p - lo);
      break;
    }
  }
  r.device = fs::Device{fs::DeviceType::cuda, 0};
}

inline void rebase(const DeviceCase& dc, fs::OptTensor& r) {
  if (r) rebase(dc, *r);
}

inline DeviceCase mirror_case(const fstest::AttentionCase& ac) {
  DeviceCase dc;
  std::vector<fstest::HostTensor> hosts = ac.storage;
  hosts.push_back(ac.out);
  if (ac.cfg.lse) hosts.push_back(ac.lse);
  for (const fstest::HostTensor& h : hosts) {
    bool seen = false;
    for (const auto& m : dc.mirrors) seen |= m.first == h.bytes.get();
    if (!seen) dc.mirrors.emplace_back(h.bytes.get(), mirror_storage(h));
  }
  fs::AttentionParams& p = dc.params = ac.params;
  for (fs::TensorRef* t : {&p.q, &p.out, &p.k, &p.v}) rebase(dc, *t);
  for (fs::OptTensor* t : {&p.q_v, &p.lse, &p.cu_seqlens_q, &p.cu_seqlens_k, &p.seqused_k, &p.block_table,
                           &p.cache_batch_idx, &p.alibi_slopes, &p.s_aux, &p.q_descale, &p.k_descale, &p.v_descale,
                           &p.q_scale, &p.k_scale_cache, &p.v_scale, &p.cp_tot_seqused_k})
    rebase(dc, *t);
  return dc;
}

inline fs::Plan plan_case(const fstest::AttentionCase& ac, const fs::AttentionParams& p) {
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  return ac.cfg.batched() ? fs::plan_kvcache_attention(p, dev) : fs::plan_varlen_attention(p, dev);
}

inline void call(const fstest::AttentionCase& ac, const fs::AttentionParams& p, const fs::ExecContext& ctx) {
  if (ac.cfg.batched()) fs::kvcache_attention(p, ctx);
  else fs::varlen_attention(p, ctx);
}

// A deep copy of a host tensor (its own storage, same view).
inline fstest::HostTensor clone(const fstest::HostTensor& h) {
  fstest::HostTensor c = h;
  if (!h.bytes) return c;
  c.bytes = std::make_shared<std::vector<unsigned char>>(*h.bytes);
  c.ref.data = c.bytes->data() + (static_cast<const unsigned char*>(h.ref.data) - h.bytes->data());
  return c;
}

// The CPU reference under `plan` (same split structure as the GPU run); returns (out, lse).
inline std::pair<fstest::HostTensor, fstest::HostTensor> run_cpu(fstest::AttentionCase& ac, const fs::Plan& plan) {
  fstest::poison_storage(ac.out);
  if (ac.cfg.lse) fstest::poison_storage(ac.lse);
  fs::ExecContext ctx;
  ctx.plan = &plan;
  call(ac, ac.params, ctx);
  return {clone(ac.out), ac.cfg.lse ? clone(ac.lse) : fstest::HostTensor{}};
}

// Poisons the device out/lse, runs on the device (ctx.stream), synchronizes and copies out and
// lse back into the case's host tensors.
inline void run_gpu(fstest::AttentionCase& ac, const DeviceCase& dc, const fs::ExecContext& ctx) {
  poison_device(dc.mirror_of(ac.out));
  if (ac.cfg.lse) poison_device(dc.mirror_of(ac.lse));
  sync();  // the poison (null stream) before a call on a non-blocking ctx.stream
  call(ac, dc.params, ctx);
  sync();
  download(dc.mirror_of(ac.out), ac.out);
  if (ac.cfg.lse) download(dc.mirror_of(ac.lse), ac.lse);
}

// run_gpu under `plan` (ctx.plan) with a workspace of the plan's size.
inline void run_gpu_planned(fstest::AttentionCase& ac, const DeviceCase& dc, const fs::Plan& plan) {
  const auto ws = device_alloc(plan.workspace.total_bytes);
  fs::ExecContext ctx;
  ctx.workspace = ws.get();
  ctx.workspace_bytes = plan.workspace.total_bytes;
  ctx.plan = &plan;
  run_gpu(ac, dc, ctx);
}

// Context parallelism on the case (before mirror_case): rank `rank` of `world` with interleave
// `il`, the global KV lengths `global` in an i32 tensor the case keeps (cp_tot_seqused_k).
inline void set_context_parallel(fstest::AttentionCase& ac, const std::vector<int64_t>& global, int world, int rank,
                                 int64_t il = 1) {
  const fstest::HostTensor tot = fstest::HostTensor::zeros(fs::DType::i32, {int64_t(global.size())});
  for (size_t b = 0; b < global.size(); ++b) tot.ref.ptr<int32_t>()[b] = int32_t(global[b]);
  ac.storage.push_back(tot);
  ac.params.cp_world_size = world;
  ac.params.cp_rank = rank;
  ac.params.cp_interleave = il;
  ac.params.cp_tot_seqused_k = tot.ref;
}

// One unit in the last place of x in an output dtype (0 for f32).
inline double out_ulp(double x, fs::DType t) {
  const int bits = t == fs::DType::f16 ? 10 : t == fs::DType::bf16 ? 7 : -1;
  if (bits < 0 || x == 0.0 || !std::isfinite(x)) return t == fs::DType::f16 ? std::ldexp(1.0, -24) : 0.0;
  int e;
  std::frexp(std::fabs(x), &e);
  return std::ldexp(1.0, std::max(e - 1, t == fs::DType::f16 ? -14 : -126) - bits);
}

// Whether `kernel` (attention_kernel_name) rounds P to a 16-bit type before P·V: the tensor-core
// kernels (prefill_mma, prefill_wgmma except for fp32 outputs; decode, whose q.k and p.v run on
// mma.sync, except for fp32 outputs, where it adds the rounding residue in a second mma;
// decode_mla and decode_mla_wgmma, fp32 outputs included). The
// type is q's for 16-bit K/V, f16 for fp8 K/V and int8 K8V8, V's for int8 K8V16 (p_round_eps).
inline bool kernel_rounds_p(const std::string& kernel, const fstest::CaseConfig& c) {
  if (kernel == "prefill_wgmma" || kernel == "prefill_tma") return c.out_dtype != fs::DType::f32;  // fp32 out: P hi + lo
  if (kernel == "decode_mla" || kernel == "decode_mla_wgmma") return true;  // P in q's type whatever out's dtype
  return kernel == "prefill_mma" || (kernel == "decode" && c.out_dtype != fs::DType::f32);
}

// The relative rounding of P by a kernel that rounds it (kernel_rounds_p): f16 operands for fp8
// K/V and int8 K8V8 (the decode kernel converts the cache to f16), V's 16-bit type for int8
// K8V16, else q's 16-bit type.
inline double p_round_eps(const fstest::CaseConfig& c) {
  if (c.quant == fstest::QuantMode::int8_k8v16)
    return std::ldexp(1.0, c.v16_dtype == fs::DType::bf16 ? -8 : -11);
  if (fs::is_fp8(c.kv_dtype) || c.quant == fstest::QuantMode::int8_k8v8 || c.q_dtype == fs::DType::f16)
    return std::ldexp(1.0, -11);
  return c.q_dtype == fs::DType::bf16 ? std::ldexp(1.0, -8) : 0.0;
}

// The fp8 prefill kernel's P in e4m3 after a 2^8 shift (prefill_fp8.cuh): relative rounding
// 2^-4, and subnormals 2^-10 apart at most per key against a row max of 2^8.
inline double fp8_p_round(const fstest::CaseConfig& c) {
  int64_t sk = 0;
  for (int64_t k : c.k_lens) sk = std::max(sk, k);
  return std::ldexp(1.0, -4) + double(sk) * std::ldexp(1.0, -18);
}

// Whether `kernel` computes the soft-cap's tanh with tanh.approx.f32 (relative error <= 2^-11,
// PTX ISA; the CPU reference and the oracle use an accurate tanh): the tensor-core prefill
// kernels (prefill_common.cuh: ScoreLog2). Their soft-capped rows are checked within that
// error's bound (fstest::approx_tanh_logit_err, approx_tanh_out_err).
inline bool kernel_approximates_tanh(const std::string& kernel) {
  return kernel == "prefill_mma" || kernel == "prefill_wgmma" || kernel == "prefill_tma" || kernel == "prefill_fp8";
}

// What the checks allow `kernel` beyond fp32 arithmetic and the 16-bit P of kernel_rounds_p:
// the soft-cap's tanh.approx, and prefill_fp8's e4m3 P (fp8_p_round) and fp8 q.k accumulation
// (2^-10 of sum |q_d k_d|: Hopper's fp8 wgmma adds k32 products with fewer than fp32's
// mantissa bits).
inline fstest::KernelError kernel_error(const std::string& kernel, const fstest::CaseConfig& c) {
  fstest::KernelError e;
  e.approx_tanh = kernel_approximates_tanh(kernel);
  if (kernel == "prefill_fp8") {
    e.p_round = fp8_p_round(c);
    e.qk_rel = std::ldexp(1.0, -10);
  }
  return e;
}

// GPU result (in ac.out / ac.lse) against the CPU reference's: the same -inf / NaN LSE rows;
// values within fp32 rounding (1e-5 of the head's max |v| and of the value), plus one output
// ulp for f16/bf16 outputs. Empty when they agree.
// `p_rounded`: the kernel rounds the softmax weights P to a 16-bit type before P·V (FlashAttention-2
// style tensor-core kernels; p_round_eps); each weight then carries up to half an ulp of it, so the
// output may move by up to eps(q) / 2 * max|v| from the fp32-weighted reference.
// `err` (kernel_error): with approx_tanh the kernel's soft-cap uses tanh.approx; a soft-capped
// row's logits then carry up to e = approx_tanh_logit_err each (plus qk_logit_err with qk_rel),
// which moves out by up to approx_tanh_out_err(e) max|v| and lse by up to e; p_round adds
// p_round max|v|.
inline std::string compare_with_cpu(const fstest::AttentionCase& ac, const fstest::HostTensor& cpu_out,
                                    const fstest::HostTensor& cpu_lse, bool p_rounded = false,
                                    const fstest::KernelError& err = {}) {
  const fstest::CaseConfig& c = ac.cfg;
  const double p_eps = (p_rounded ? p_round_eps(c) : 0.0) + err.p_round;
  const fs::DType ot = c.out_dtype;
  const int64_t es = int64_t(fs::dtype_size(ot));
  std::ostringstream first;
  int64_t bad = 0;
  auto report = [&](auto&&... parts) {
    if (bad++ < 8) ((first << "  ") << ... << parts) << "\n";
  };
  for (int64_t b = 0; b < c.batch(); ++b) {
    const fstest::NaiveSequence& s = ac.seqs[size_t(b)];
    const int64_t row0 = ac.q_row0[size_t(b)];
    for (int64_t h = 0; h < s.H; ++h) {
      double maxv = 0.0;
      const int64_t g = h / (s.H / s.H_kv);
      for (int64_t t = 0; t < s.sk; ++t)
        for (int64_t d = 0; d < s.Dv; ++d) maxv = std::max(maxv, std::fabs(s.v[size_t((t * s.H_kv + g) * s.Dv + d)]));
      for (int64_t i = 0; i < s.sq; ++i) {
        const double tanh_err = (err.approx_tanh ? fstest::approx_tanh_logit_err(ac, b, h, i) : 0.0) +
                                (err.qk_rel > 0.0 ? fstest::qk_logit_err(ac, b, h, i, err.qk_rel) : 0.0);
        const char* go = static_cast<const char*>(c.batched() ? ac.out.ref.at(b, i, h, 0) : ac.out.ref.at(row0 + i, h, 0));
        const char* co = static_cast<const char*>(c.batched() ? cpu_out.ref.at(b, i, h, 0) : cpu_out.ref.at(row0 + i, h, 0));
        for (int64_t d = 0; d < s.Dv; ++d) {
          const double x = fs::numeric::load_double(go + d * es, ot), y = fs::numeric::load_double(co + d * es, ot);
          const double tol = out_ulp(std::max(std::fabs(x), std::fabs(y)), ot) +
                             (1e-5 + p_eps + fstest::approx_tanh_out_err(tanh_err)) * maxv + 1e-5 * std::fabs(y);
          if (std::isnan(x) != std::isnan(y) || std::fabs(x - y) > tol)
            report("out b=", b, " i=", i, " h=", h, " d=", d, ": gpu ", x, ", cpu ", y, ", tol ", tol);
        }
        if (!c.lse) continue;
        const float x = *static_cast<const float*>(c.batched() ? ac.lse.ref.at(b, h, i) : ac.lse.ref.at(h, row0 + i));
        const float y = *static_cast<const float*>(c.batched() ? cpu_lse.ref.at(b, h, i) : cpu_lse.ref.at(h, row0 + i));
        const bool same_class = std::isnan(x) == std::isnan(y) && std::isinf(x) == std::isinf(y);
        const double lse_tol = 1e-5 * std::max(1.0, std::fabs(double(y))) + tanh_err;
        if (!same_class || (std::isinf(x) && x != y) || (std::isfinite(x) && std::fabs(double(x) - double(y)) > lse_tol))
          report("lse b=", b, " i=", i, " h=", h, ": gpu ", x, ", cpu ", y);
      }
    }
  }
  if (bad == 0) return {};
  std::ostringstream os;
  os << bad << " mismatches against the CPU reference (same plan); first ones:\n" << first.str();
  return os.str();
}

// The kernel attention_kernel_name picks for p on device 0, or "(threw: ...)".
inline std::string served(const fs::AttentionParams& p, bool batched) {
  try {
    return fs::attention_kernel_name(p, batched, fs::kernels::cuda_device_props(0));
  } catch (const std::exception& e) {
    return std::string("(threw: ") + e.what() + ")";
  }
}

// ||gpu - cpu|| / ||cpu|| over every output element (a non-finite GPU value: infinity).
inline double relative_error(const fstest::AttentionCase& ac, const fstest::HostTensor& cpu) {
  const fstest::CaseConfig& c = ac.cfg;
  double num = 0.0, den = 0.0;
  for (int64_t b = 0; b < c.batch(); ++b) {
    const fstest::NaiveSequence& s = ac.seqs[size_t(b)];
    const int64_t row0 = ac.q_row0[size_t(b)];
    for (int64_t i = 0; i < s.sq; ++i)
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t d = 0; d < s.Dv; ++d) {
          const double x = c.batched() ? ac.out.get({b, i, h, d}) : ac.out.get({row0 + i, h, d});
          const double y = c.batched() ? cpu.get({b, i, h, d}) : cpu.get({row0 + i, h, d});
          if (!std::isfinite(x)) return INFINITY;
          num += (x - y) * (x - y);
          den += y * y;
        }
  }
  return den == 0.0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The prefill kernels' check: the case on the CPU reference and the GPU under one plan (a
// positive `split_granularity` replaces the plan's), the result against the fp64 oracle with
// the serving kernel's error model (kernel_error), with `cpu_compare` element by element against
// the reference too (compare_with_cpu), and ||gpu - cpu|| / ||cpu|| below `rel_limit`. `kernel`
// receives the kernel that served it; "" when every check passes.
inline std::string check_prefill_case(fstest::AttentionCase& ac, std::string& kernel, double rel_limit,
                                      bool cpu_compare, int split_granularity = 0) {
  DeviceCase dc = mirror_case(ac);
  kernel = served(dc.params, ac.cfg.batched());
  fs::Plan plan = plan_case(ac, dc.params);
  if (split_granularity > 0) plan.split_granularity = split_granularity;
  const auto cpu = run_cpu(ac, plan);
  run_gpu_planned(ac, dc, plan);
  const fstest::KernelError err = kernel_error(kernel, ac.cfg);
  std::string out = fstest::check_case(ac, err);
  if (cpu_compare) out += compare_with_cpu(ac, cpu.first, cpu.second, kernel_rounds_p(kernel, ac.cfg), err);
  const double rel = relative_error(ac, cpu.first);
  if (!(rel < rel_limit)) out += "relative error against the CPU reference " + std::to_string(rel) + "\n";
  return out.empty() ? out : "kernel " + kernel + ", splits " + std::to_string(plan.num_splits) + "\n" + out;
}

// A paged varlen case `c` (q_lens == k_lens, causal) with entry (1, col) of its block table set to
// `bad_id` (outside the cache) for the GPU run, the CPU reference run on the good table under the
// same plan: exactly the rows of sequence 1 at positions >= col x block_size must be NaN (some
// must be), every other output within rel_tol (1 + |ref|) of the reference. `kernel` receives
// the kernel that served the case; "" or the first failure.
inline std::string check_bad_block_nan_rows(const fstest::CaseConfig& c, uint64_t salt, int col, int32_t bad_id,
                                            double rel_tol, std::string& kernel) {
  auto rng = fstest::make_rng(salt);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  DeviceCase dc = mirror_case(ac);
  const fs::Plan plan = plan_case(ac, dc.params);
  const auto cpu = run_cpu(ac, plan);
  kernel = served(dc.params, false);
  int32_t* entry = static_cast<int32_t*>(ac.params.block_table->at(1, col));
  const int32_t good_id = *entry;
  *entry = bad_id;
  dc.upload(ac);
  run_gpu_planned(ac, dc, plan);
  *entry = good_id;
  int64_t nan_rows = 0;
  for (int64_t b = 0; b < c.batch(); ++b)
    for (int64_t i = 0; i < c.q_lens[size_t(b)]; ++i)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t d = 0; d < c.Dv; ++d) {
          const int64_t r = ac.q_row0[size_t(b)] + i;
          const float x = ac.out.get({r, h, d}), y = cpu.first.get({r, h, d});
          const bool want_nan = b == 1 && i >= col * c.block_size;
          nan_rows += want_nan && d == 0;
          std::ostringstream where;
          if (want_nan ? !std::isnan(x) : !(std::fabs(x - y) <= rel_tol * (1.0 + std::fabs(y)))) {
            where << (want_nan ? "want NaN" : "mismatch") << " at b=" << b << " i=" << i << " h=" << h << " d=" << d
                  << ": gpu " << x << ", cpu " << y;
            return where.str();
          }
        }
  return nan_rows > 0 ? "" : "no NaN row";
}

// The case (context parallelism set, say) against the CPU reference alone under the same plan,
// for what the fp64 oracle does not model: `kernel` gets the kernel that served it, `cpu_out`
// (optional) the reference's out; returns compare_with_cpu's mismatches ("" when it matches).
inline std::string match_cpu_reference(fstest::AttentionCase& ac, std::string& kernel,
                                       fstest::HostTensor* cpu_out = nullptr) {
  const DeviceCase dc = mirror_case(ac);
  kernel = served(dc.params, ac.cfg.batched());
  const fs::Plan plan = plan_case(ac, dc.params);
  const auto cpu = run_cpu(ac, plan);
  run_gpu_planned(ac, dc, plan);
  if (cpu_out) *cpu_out = cpu.first;
  return compare_with_cpu(ac, cpu.first, cpu.second, kernel_rounds_p(kernel, ac.cfg), kernel_error(kernel, ac.cfg));
}

struct Outcome {
  std::string kernel;  // the kernel that served the GPU call
  std::string error;   // "" when the GPU agrees with the oracle and the reference
};

// Plan (forced splits from the config), CPU reference under it, GPU run, both comparisons.
// `gpu_params_edit` changes only the GPU call's params (after the plan is made).
template <class Edit>
Outcome run_and_compare(fstest::AttentionCase& ac, Edit gpu_params_edit) {
  DeviceCase dc = mirror_case(ac);
  const fs::Plan plan = plan_case(ac, dc.params);
  const auto cpu = run_cpu(ac, plan);
  gpu_params_edit(dc.params);
  Outcome o;
  o.kernel = served(dc.params, ac.cfg.batched());
  const auto ws = device_alloc(plan.workspace.total_bytes);
  fs::ExecContext ctx;
  ctx.workspace = ws.get();
  ctx.workspace_bytes = plan.workspace.total_bytes;
  ctx.plan = &plan;
  if (!(dc.params.max_seqlen_q == ac.params.max_seqlen_q)) ctx.plan = nullptr;  // its own (same) plan
  try {
    run_gpu(ac, dc, ctx);
  } catch (const std::exception& e) {
    o.error = std::string("the CUDA call threw: ") + e.what();
    return o;
  }
  const fstest::KernelError err = kernel_error(o.kernel, ac.cfg);
  o.error = fstest::check_case(ac, err) + compare_with_cpu(ac, cpu.first, cpu.second, kernel_rounds_p(o.kernel, ac.cfg), err);
  return o;
}

// Entry (1, col) of the case's block table replaced by `bad_id` (outside the cache), for col 1
// (a block no row of sequence 1 sees: the case's window) and col 3 (one it sees): the GPU never
// reads it, exactly sequence 1's rows are NaN when col 3 is bad, every other output matches the
// CPU reference. The case (batched paged, 3 sequences, q_len 1) must select `kernel`.
inline void expect_bad_block_nan_rows(fstest::AttentionCase& ac, const std::string& kernel, int bad_id, int splits) {
  DeviceCase dc = mirror_case(ac);
  const fs::Plan plan = plan_case(ac, dc.params);
  const auto cpu = run_cpu(ac, plan);
  ASSERT_EQ(served(dc.params, true), kernel);
  const fstest::CaseConfig& c = ac.cfg;
  for (int col : {1, 3}) {
    int32_t* entry = static_cast<int32_t*>(ac.params.block_table->at(1, col));
    const int32_t good_id = *entry;
    *entry = bad_id;
    dc.upload(ac);
    run_gpu_planned(ac, dc, plan);
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t d = 0; d < c.Dv; ++d) {
          const float x = ac.out.get({b, 0, h, d}), y = cpu.first.get({b, 0, h, d});
          const bool want_nan = b == 1 && col == 3;
          if (want_nan) ASSERT_TRUE(std::isnan(x)) << "b=1 h=" << h << " d=" << d << " splits " << splits;
          else ASSERT_NEAR(x, y, 1e-2 * (1.0 + std::fabs(y))) << "b=" << b << " h=" << h << " col " << col;
        }
    *entry = good_id;
  }
}

}  // namespace fsgpu
