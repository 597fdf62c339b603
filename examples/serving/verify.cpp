// Step verification (verify.hpp).
#include "verify.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/numeric.hpp"

namespace serving {

namespace fs = flashserve;

namespace {

// One reference sequence: `nq` query rows at positions q_pos .. q_pos + nq - 1 (out rows
// out_row ..), keys at positions [0, context) followed by `path` (a draft's ancestors and
// itself). Causal with bottom-right alignment: the queries are the last keys.
struct RefSeq {
  const OrderedEntry* entry = nullptr;
  int64_t out_row = 0, q_pos = 0;
  int32_t nq = 0;
  int64_t context = 0;
  std::vector<int64_t> path;
  int64_t num_keys() const { return context + int64_t(path.size()); }
};

// The reference sequences of one request: its last `max_rows` query rows in one causal
// sequence, or on a tree step the committed tip and each draft as single-query sequences.
void add_sequences(const OrderedEntry& o, int64_t max_rows, std::vector<RefSeq>& seqs) {
  const BatchEntry& e = *o.entry;
  if (e.parents.empty()) {
    const int32_t m = int32_t(std::min<int64_t>(e.query_len, max_rows)), skip = e.query_len - m;
    seqs.push_back({&o, o.token_begin + skip, e.first_pos + skip, m, e.first_pos + e.query_len, {}});
    return;
  }
  const int64_t tip = e.first_pos;
  seqs.push_back({&o, o.token_begin, tip, 1, tip + 1, {}});
  for (int32_t d = 0; d < e.num_drafts; ++d) {
    RefSeq s{&o, o.token_begin + 1 + d, tip + 1 + d, 1, tip + 1, {}};
    for (int32_t a = d; a >= 0; a = e.parents[size_t(a)]) s.path.push_back(tip + 1 + a);
    std::reverse(s.path.begin(), s.path.end());
    seqs.push_back(std::move(s));
  }
}

// Rows [begin, begin + n) of t become what an fp8_e4m3 cache with `scale` gives back.
void round_through_fp8(const fs::TensorRef& t, int64_t begin, int64_t n, float scale) {
  for (int64_t r = begin; r < begin + n; ++r)
    for (int64_t h = 0; h < t.size(1); ++h)
      for (int64_t d = 0; d < t.size(2); ++d) {
        void* p = t.at(r, h, d);
        const uint8_t code = fs::numeric::float_to_fp8(fs::numeric::load_float(p, t.dtype) / scale, fs::DType::f8e4m3);
        fs::numeric::store_float(p, t.dtype, fs::numeric::fp8_to_float(code, fs::DType::f8e4m3) * scale);
      }
}

int64_t key_pos(const RefSeq& s, int64_t j) { return j < s.context ? j : s.path[size_t(j - s.context)]; }

// Compares the engine's rows with the reference's, accumulating into r.
void compare(const RefSeq& s, const fs::TensorRef& out, const fs::TensorRef& ref, int64_t ref_row, int layer,
             Tolerance tol, VerifyResult& r) {
  for (int32_t i = 0; i < s.nq; ++i) {
    bool bad = false;
    double worst = 0;
    for (int64_t h = 0; h < out.size(1); ++h)
      for (int64_t d = 0; d < out.size(2); ++d) {
        const double a = fs::numeric::load_float(out.at(s.out_row + i, h, d), out.dtype);
        const double b = fs::numeric::load_float(ref.at(ref_row + i, h, d), ref.dtype);
        const double diff = std::fabs(a - b), ratio = diff / (tol.atol + tol.rtol * std::fabs(b));
        if (!(ratio <= 1.0)) bad = true;
        worst = std::max(worst, std::isnan(ratio) ? INFINITY : ratio);
        r.max_abs = std::max(r.max_abs, std::isnan(diff) ? INFINITY : diff);
      }
    r.max_ratio = std::max(r.max_ratio, worst);
    ++r.rows;
    if (!bad) continue;
    if (r.bad_rows++ == 0) {
      std::ostringstream m;
      m << "request " << s.entry->entry->req->spec.id << ", layer " << layer << ", position " << s.q_pos + i
        << ": max |out - ref| / tol = " << worst;
      r.first_failure = m.str();
    }
  }
}

}  // namespace

Tolerance tolerance_for(fs::DType dtype, bool cuda) {
  switch (dtype) {
    case fs::DType::f32: return {1e-5, 1e-4};
    case fs::DType::f16: return cuda ? Tolerance{4e-3, 4e-3} : Tolerance{2e-3, 2e-3};
    default: return cuda ? Tolerance{5e-3, 2e-2} : Tolerance{2e-3, 8e-3};  // bf16: out rounds to 8 bits (2 ulp; 5 on CUDA)
  }
}

VerifyResult verify_step(Engine& engine, const VerifyLimits& limits) {
  VerifyResult res;
  const std::vector<OrderedEntry>& batch = engine.batch();
  const int64_t R = int64_t(batch.size()), n = std::min(R, limits.max_requests);
  std::vector<RefSeq> seqs;
  for (int64_t i = 0; i < n; ++i) add_sequences(batch[size_t(i * R / n)], limits.max_rows, seqs);
  res.requests = n;
  if (seqs.empty()) return res;

  const ModelConfig& c = engine.config();
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t max_q = 0, max_k = 0;
  for (const RefSeq& s : seqs) {
    cu_q.push_back(cu_q.back() + s.nq);
    cu_k.push_back(int32_t(cu_k.back() + s.num_keys()));
    max_q = std::max<int64_t>(max_q, s.nq);
    max_k = std::max(max_k, s.num_keys());
  }
  const int64_t TQ = cu_q.back(), TK = cu_k.back();
  HostBuffer q(c.dtype, {TQ, c.num_heads, c.head_size}), out(c.dtype, {TQ, c.num_heads, c.head_size});
  HostBuffer k(c.dtype, {TK, c.num_kv_heads, c.head_size}), v(c.dtype, {TK, c.num_kv_heads, c.head_size});
  const Tolerance tol = tolerance_for(c.dtype, engine.runtime().is_cuda());
  const Activations& act = engine.activations();
  for (int layer = 0; layer < std::min(c.num_layers, limits.max_layers); ++layer) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      const RefSeq& s = seqs[i];
      const TokenOwner owner = TokenOwner::of(s.entry->entry->req->spec);
      for (int32_t t = 0; t < s.nq; ++t) act.fill(Operand::q, owner, s.q_pos + t, layer, q.ref(), cu_q[i] + t);
      for (int64_t j = 0; j < s.num_keys(); ++j) {
        act.fill(Operand::k, owner, key_pos(s, j), layer, k.ref(), cu_k[i] + j);
        act.fill(Operand::v, owner, key_pos(s, j), layer, v.ref(), cu_k[i] + j);
      }
      if (c.fp8_cache())
        for (const HostBuffer* t : {&k, &v}) round_through_fp8(t->ref(), cu_k[i], s.num_keys(), c.kv_scale);
    }
    fs::AttentionParams p;
    p.q = q.ref();
    p.k = k.ref();
    p.v = v.ref();
    p.out = out.ref();
    const auto cq = fs::TensorRef::contiguous(cu_q.data(), fs::DType::i32, {int64_t(cu_q.size())});
    const auto ck = fs::TensorRef::contiguous(cu_k.data(), fs::DType::i32, {int64_t(cu_k.size())});
    p.cu_seqlens_q = cq;
    p.cu_seqlens_k = ck;
    p.max_seqlen_q = max_q;
    p.max_seqlen_k = max_k;
    p.causal = true;
    p.num_splits = 1;
    fs::varlen_attention(p);
    const fs::TensorRef eout = engine.fetch_out(layer);
    for (size_t i = 0; i < seqs.size(); ++i) compare(seqs[i], eout, out.ref(), cu_q[i], layer, tol, res);
  }
  return res;
}

}  // namespace serving
