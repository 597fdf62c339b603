// Compares an attention case's outputs with the fp64 oracle. Tolerances are relative to the
// error a low-precision naive computation makes (STYLE.md): per element of out,
//   |out - ref| <= 2 |round_to_out_dtype(ref) - ref| + 4 eps_out max|v| + 1e-5 max|v|,
// max|v| over the sequence's values of the row's KV head; lse within 1e-4 + 1e-5 |ref|; plus,
// for a result whose soft-cap used tanh.approx, that approximation's bound (approx_tanh_*).
// Rows with no visible key must be exactly 0 with lse -inf (or exactly the sink's lse).
#include <algorithm>
#include <cmath>
#include <sstream>

#include "flashserve/numeric.hpp"
#include "naive/attention_case.hpp"

namespace fstest {

using flashserve::DType;
namespace nm = flashserve::numeric;

namespace {

double unit_roundoff(DType t) {
  switch (t) {
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

double round_to(double x, DType t) {
  unsigned char buf[8];
  nm::store_float(buf, t, float(x));
  return nm::load_double(buf, t);
}

struct Mismatches {
  int64_t count = 0;
  std::ostringstream first;
  template <class... A>
  void add(const A&... parts) {
    if (count++ < 8) {
      first << "  ";
      (first << ... << parts);
      first << "\n";
    }
  }
};

// Every storage element of `t` outside its view must still hold the poison (0xFF bytes).
void check_untouched_padding(const HostTensor& t, const char* name, Mismatches& mm) {
  const int64_t es = int64_t(flashserve::dtype_size(t.ref.dtype));
  const int64_t n = int64_t(t.bytes->size()) / es;
  std::vector<uint8_t> in_view(size_t(n), 0);
  for_each_index(t.ref, [&](const std::vector<int64_t>&, int64_t off) { in_view[size_t(off)] = 1; });
  for (int64_t e = 0; e < n; ++e) {
    if (in_view[size_t(e)]) continue;
    for (int64_t k = 0; k < es; ++k)
      if ((*t.bytes)[size_t(e * es + k)] != 0xFF) {
        mm.add(name, ": element ", e, " of the storage, outside the view, was written");
        return;
      }
  }
}

void check_sequence(const AttentionCase& ac, int64_t b, const KernelError& err, Mismatches& mm) {
  const CaseConfig& c = ac.cfg;
  const NaiveSequence& s = ac.seqs[size_t(b)];
  const NaiveResult ref = naive_attention(s, ac.feats[size_t(b)]);
  const DType ot = c.out_dtype;
  const double eps = unit_roundoff(ot);
  const int64_t group = s.H / s.H_kv, row0 = ac.q_row0[size_t(b)];
  std::vector<double> maxv(size_t(s.H_kv), 0.0);
  for (int64_t t = 0; t < s.sk; ++t)
    for (int64_t g = 0; g < s.H_kv; ++g)
      for (int64_t d = 0; d < s.Dv; ++d)
        maxv[size_t(g)] = std::max(maxv[size_t(g)], std::fabs(s.v[size_t((t * s.H_kv + g) * s.Dv + d)]));
  for (int64_t i = 0; i < s.sq; ++i)
    for (int64_t h = 0; h < s.H; ++h) {
      const size_t r = size_t(h * s.sq + i);
      const double mv = maxv[size_t(h / group)];
      const double tanh_err = ref.no_keys[r] ? 0.0
                              : (err.approx_tanh ? approx_tanh_logit_err(ac, b, h, i) : 0.0) +
                                    (err.qk_rel > 0.0 ? qk_logit_err(ac, b, h, i, err.qk_rel) : 0.0);
      const void* orow = c.batched() ? ac.out.ref.at(b, i, h, 0) : ac.out.ref.at(row0 + i, h, 0);
      for (int64_t d = 0; d < s.Dv; ++d) {
        const double got = nm::load_double(static_cast<const char*>(orow) + d * int64_t(flashserve::dtype_size(ot)), ot);
        const double want = ref.out[size_t((i * s.H + h) * s.Dv + d)];
        const double tol =
            2.0 * std::fabs(round_to(want, ot) - want) +
            (4.0 * eps + 1e-5 + err.p_round + approx_tanh_out_err(tanh_err)) * mv;
        const bool bad = !std::isfinite(got) || (ref.no_keys[r] ? got != 0.0 : std::fabs(got - want) > tol);
        if (bad)
          mm.add("out b=", b, " i=", i, " h=", h, " d=", d, ": got ", got, ", want ", want, ", tol ", tol,
                 ref.no_keys[r] ? " (row sees no key: must be exactly 0)" : "");
      }
      if (!c.lse) continue;
      const double got = double(*static_cast<const float*>(c.batched() ? ac.lse.ref.at(b, h, i) : ac.lse.ref.at(h, row0 + i)));
      const double want = ref.lse[r];
      const double lse_tol = 1e-4 + 1e-5 * std::fabs(want) + tanh_err;
      const bool bad = std::isinf(want) ? got != want : !std::isfinite(got) || std::fabs(got - want) > lse_tol;
      if (bad) mm.add("lse b=", b, " i=", i, " h=", h, ": got ", got, ", want ", want);
    }
}

}  // namespace

double approx_tanh_logit_err(const AttentionCase& ac, int64_t b, int64_t h, int64_t i) {
  if (!(ac.feats[size_t(b)].softcap > 0.0)) return 0.0;
  const NaiveSequence& s = ac.seqs[size_t(b)];
  NaiveFeatures capped = ac.feats[size_t(b)];
  capped.alibi.clear();  // the bias is added after the cap, exactly
  double top = 0.0;  // over every key, visible or not: a bound whatever the masking (or context parallelism)
  for (int64_t j = 0; j < s.sk; ++j) top = std::max(top, std::fabs(naive_logit(s, capped, i, h, j)));
  return std::ldexp(top, -11);
}

double qk_logit_err(const AttentionCase& ac, int64_t b, int64_t h, int64_t i, double qk_rel) {
  const NaiveSequence& s = ac.seqs[size_t(b)];
  const int64_t g = h / (s.H / s.H_kv);
  double top = 0.0;
  for (int64_t j = 0; j < s.sk; ++j) {
    double sum = 0.0;
    for (int64_t d = 0; d < s.D; ++d)
      sum += std::fabs(s.q[size_t((i * s.H + h) * s.D + d)] * s.k[size_t((j * s.H_kv + g) * s.D + d)]);
    top = std::max(top, sum);
  }
  return qk_rel * std::fabs(ac.feats[size_t(b)].scale) * top;
}

std::string check_case(const AttentionCase& ac, const KernelError& err) {
  Mismatches mm;
  for (int64_t b = 0; b < ac.cfg.batch(); ++b) check_sequence(ac, b, err, mm);
  check_untouched_padding(ac.out, "out", mm);
  if (mm.count == 0) return {};
  std::ostringstream os;
  os << mm.count << " mismatches against the fp64 oracle; first ones:\n" << mm.first.str();
  return os.str();
}

}  // namespace fstest
