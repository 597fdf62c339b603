#include "naive/naive_attention.hpp"

#include <cmath>
#include <limits>

namespace fstest {

namespace {

// Floor division (c > 0): the aligned position i' may be negative.
int64_t floor_div(int64_t a, int64_t c) { return a >= 0 ? a / c : -((-a + c - 1) / c); }

}  // namespace

bool naive_visible(const NaiveFeatures& f, int64_t i, int64_t j, int64_t sq, int64_t sk) {
  const int64_t ip = i + sk - sq;
  if (f.causal && j > ip) return false;
  if (f.window_left >= 0 && j < ip - f.window_left) return false;
  if (f.window_right >= 0 && j > ip + f.window_right) return false;
  if (f.chunk > 0 && floor_div(j, f.chunk) != floor_div(ip, f.chunk)) return false;
  return true;
}

double naive_logit(const NaiveSequence& s, const NaiveFeatures& f, int64_t i, int64_t h, int64_t j) {
  const int64_t g = h / (s.H / s.H_kv);
  double dot = 0.0;
  for (int64_t d = 0; d < s.D; ++d) dot += s.q[size_t((i * s.H + h) * s.D + d)] * s.k[size_t((j * s.H_kv + g) * s.D + d)];
  if (!s.q_v.empty())
    for (int64_t d = 0; d < s.Dv; ++d)
      dot += s.q_v[size_t((i * s.H + h) * s.Dv + d)] * s.v[size_t((j * s.H_kv + g) * s.Dv + d)];
  double x = f.scale * dot;
  if (f.softcap > 0.0) x = f.softcap * std::tanh(x / f.softcap);
  if (!f.alibi.empty()) {
    const double dist = std::fabs(double(i + s.sk - s.sq - j));
    x -= f.alibi[size_t(h)] * (f.alibi_sqrt ? std::sqrt(dist) : dist);
  }
  return x;
}

NaiveResult naive_attention(const NaiveSequence& s, const NaiveFeatures& f) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  NaiveResult r;
  r.out.assign(size_t(s.sq * s.H * s.Dv), 0.0);
  r.lse.assign(size_t(s.H * s.sq), kNegInf);
  r.no_keys.assign(size_t(s.H * s.sq), 1);
  std::vector<double> logit(size_t(s.sk));
  std::vector<uint8_t> vis(size_t(s.sk));
  for (int64_t h = 0; h < s.H; ++h) {
    const int64_t g = h / (s.H / s.H_kv);
    const bool has_sink = !f.sinks.empty();
    const double sink = has_sink ? f.sinks[size_t(h)] : kNegInf;
    for (int64_t i = 0; i < s.sq; ++i) {
      double m = sink;
      bool any = false;
      for (int64_t j = 0; j < s.sk; ++j) {
        vis[size_t(j)] = naive_visible(f, i, j, s.sq, s.sk);
        if (!vis[size_t(j)]) continue;
        any = true;
        logit[size_t(j)] = naive_logit(s, f, i, h, j);
        if (logit[size_t(j)] > m) m = logit[size_t(j)];
      }
      const size_t row = size_t(h * s.sq + i);
      if (!any) {
        r.lse[row] = sink;  // out stays 0; -inf without a sink
        continue;
      }
      r.no_keys[row] = 0;
      double denom = has_sink ? std::exp(sink - m) : 0.0;
      double* o = &r.out[size_t((i * s.H + h) * s.Dv)];
      for (int64_t j = 0; j < s.sk; ++j) {
        if (!vis[size_t(j)]) continue;
        const double p = std::exp(logit[size_t(j)] - m);
        denom += p;
        const double* vj = &s.v[size_t((j * s.H_kv + g) * s.Dv)];
        for (int64_t d = 0; d < s.Dv; ++d) o[d] += p * vj[d];
      }
      for (int64_t d = 0; d < s.Dv; ++d) o[d] /= denom;
      r.lse[row] = m + std::log(denom);
    }
  }
  return r;
}

}  // namespace fstest
