// Builds an attention case from a configuration: the flashserve operands (strided, paged,
// quantized) and, element by element as they are stored, the dequantized double data of
// each sequence for the oracle.
#include "naive/attention_case.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "flashserve/numeric.hpp"

namespace fstest {

using flashserve::DType;
using flashserve::KvLayout;
using flashserve::TensorRef;
namespace nm = flashserve::numeric;

namespace {

TensorRef view(DType t, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride) {
  return TensorRef::strided(nullptr, t, shape, stride);
}
TensorRef dense(DType t, std::initializer_list<int64_t> shape) { return TensorRef::contiguous(nullptr, t, shape); }

// Owning storage of `elems` elements (every byte 0xFF) with `v` at its start.
HostTensor alloc(TensorRef v, int64_t elems) {
  HostTensor h = HostTensor::with_view(v, elems);
  poison_storage(h);
  return h;
}

// Another view into the storage of `base`, `offset` elements in.
HostTensor alias(const HostTensor& base, TensorRef v, int64_t offset) {
  HostTensor h;
  h.bytes = base.bytes;
  v.data = base.bytes->data() + offset * int64_t(flashserve::dtype_size(v.dtype));
  h.ref = v;
  return h;
}

// Address of an element, 64-bit offsets.
void* addr(const TensorRef& t, std::initializer_list<int64_t> idx) {
  int64_t off = 0;
  size_t d = 0;
  for (int64_t i : idx) off += i * t.stride[d++];
  return static_cast<char*>(t.data) + off * int64_t(flashserve::dtype_size(t.dtype));
}
void* step(void* p, DType t, int64_t n) { return static_cast<char*>(p) + n * int64_t(flashserve::dtype_size(t)); }

// Stores x rounded to t; returns the stored value, exactly, in double.
double put(void* p, DType t, double x) {
  nm::store_float(p, t, float(x));
  return nm::load_double(p, t);
}
double get(const void* p, DType t) { return nm::load_double(p, t); }

HostTensor int32_tensor(const std::vector<int64_t>& xs) {
  HostTensor h = alloc(dense(DType::i32, {int64_t(xs.size())}), int64_t(xs.size()));
  for (size_t i = 0; i < xs.size(); ++i) h.ref.ptr<int32_t>()[i] = int32_t(xs[i]);
  return h;
}

struct Builder {
  const CaseConfig& c;
  std::mt19937_64& g;
  AttentionCase& ac;
  int64_t B = 0, group = 1;
  std::vector<int64_t> k_len;                // effective KV length per sequence
  std::vector<int64_t> k_row0, cache_row;    // contiguous KV: first row / cache row of b
  std::vector<std::vector<int64_t>> blocks;  // paged: block ids of sequence b

  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  // A raw stored value: floats U(-1, 1), fp8 U(-3, 3), int8 integers in [-127, 127].
  double raw(DType t) {
    if (t == DType::i8) return double(integer(-127, 127));
    return flashserve::is_fp8(t) ? uniform(-3.0, 3.0) : uniform(-1.0, 1.0);
  }
  HostTensor keep(HostTensor h) {
    ac.storage.push_back(h);
    return h;
  }

  // Per-sequence row addressing of q-shaped ([.., H, x]) and scale ([.., H]) tensors.
  void* q_at(const TensorRef& t, int64_t b, int64_t i, int64_t h) const {
    return c.batched() ? addr(t, {b, i, h, 0}) : addr(t, {ac.q_row0[size_t(b)] + i, h, 0});
  }
  void* qs_at(const TensorRef& t, int64_t b, int64_t i, int64_t h) const {
    return c.batched() ? addr(t, {b, i, h}) : addr(t, {ac.q_row0[size_t(b)] + i, h});
  }
  // Start of KV token tok's row for KV head kh (k or v view), and its int8 k scale.
  void* kv_at(const TensorRef& t, int64_t b, int64_t tok, int64_t kh) const {
    if (c.paged()) {
      const int64_t blk = blocks[size_t(b)][size_t(tok / c.block_size)], slot = tok % c.block_size;
      return c.layout == KvLayout::hnd ? addr(t, {blk, kh, slot, 0}) : addr(t, {blk, slot, kh, 0});
    }
    if (c.batched()) return addr(t, {cache_row[size_t(b)], tok, kh, 0});
    return addr(t, {k_row0[size_t(b)] + tok, kh, 0});
  }
  void* ks_at(const TensorRef& t, int64_t b, int64_t tok, int64_t kh) const {
    if (c.paged()) return addr(t, {blocks[size_t(b)][size_t(tok / c.block_size)], kh, tok % c.block_size});
    if (c.batched()) return addr(t, {cache_row[size_t(b)], tok, kh});
    return addr(t, {k_row0[size_t(b)] + tok, kh});
  }

  // fp32 [B, H_kv] descale, possibly a stride-0 broadcast view.
  HostTensor descale() {
    const int64_t n = c.descale_broadcast == 0 ? B * c.H_kv : c.descale_broadcast == 1 ? c.H_kv : 1;
    const TensorRef v = c.descale_broadcast == 0 ? dense(DType::f32, {B, c.H_kv})
                      : view(DType::f32, {B, c.H_kv}, {0, c.descale_broadcast == 1 ? 1 : 0});
    HostTensor h = keep(alloc(v, n));
    for (int64_t i = 0; i < n; ++i) h.ref.ptr<float>()[i] = float(uniform(0.1, 0.6));
    return h;
  }
  static double at2(const HostTensor& h, int64_t a, int64_t b) { return get(addr(h.ref, {a, b}), DType::f32); }

  void build_q();
  void layout_kv(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks);
  void layout_paged(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks);
  void layout_cache_rows(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks);
  void layout_varlen_rows(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks);
  void build_kv();
  void build_out();
  void build_features();
};

void Builder::build_q() {
  auto& p = ac.params;
  const DType qt = c.q_dtype;
  const int64_t H = c.H, D = c.D, Dv = c.Dv, sq = c.q_lens.empty() ? 0 : c.q_lens[0];
  int64_t total_q = 0;
  for (int64_t b = 0; b < B; ++b) ac.q_row0.push_back(c.batched() ? 0 : total_q), total_q += c.q_lens[size_t(b)];
  const int64_t ts = H * D + c.q_pad, rows = c.batched() ? B * sq : total_q;
  const HostTensor q = keep(alloc(c.batched() ? view(qt, {B, sq, H, D}, {sq * ts, ts, D, 1})
                                               : view(qt, {total_q, H, D}, {ts, D, 1}), rows * ts));
  p.q = q.ref;
  HostTensor qs, qd, qv;
  if (qt == DType::i8) {
    // varlen with a padded q: scales head-major ([H, total_q] storage read transposed, as the
    // int8 fork passes them); else dense [total_q, H] / [B, sq, H]
    const bool head_major = !c.batched() && c.q_pad % 2 == 1;
    qs = keep(alloc(c.batched() ? dense(DType::f32, {B, sq, H})
                    : head_major ? view(DType::f32, {total_q, H}, {1, total_q}) : dense(DType::f32, {total_q, H}),
                    rows * H));
    p.q_scale = qs.ref;
  }
  if (flashserve::is_fp8(qt)) p.q_descale = (qd = descale()).ref;
  if (c.has_qv) {
    qv = keep(alloc(c.batched() ? dense(qt, {B, sq, H, Dv}) : dense(qt, {total_q, H, Dv}), rows * H * Dv));
    p.q_v = qv.ref;
  }
  for (int64_t b = 0; b < B; ++b) {
    NaiveSequence& s = ac.seqs[size_t(b)];
    s.q.resize(size_t(s.sq * H * D));
    if (c.has_qv) s.q_v.resize(size_t(s.sq * H * Dv));
    for (int64_t i = 0; i < s.sq; ++i)
      for (int64_t h = 0; h < H; ++h) {
        double f = 1.0;
        if (qt == DType::i8) f = put(qs_at(qs.ref, b, i, h), DType::f32, uniform(0.5, 1.5) / 127.0);
        if (flashserve::is_fp8(qt)) f = at2(qd, b, h / group);
        void* row = q_at(q.ref, b, i, h);
        for (int64_t d = 0; d < D; ++d) s.q[size_t((i * H + h) * D + d)] = put(step(row, qt, d), qt, raw(qt)) * f;
        if (!c.has_qv) continue;
        row = q_at(qv.ref, b, i, h);
        for (int64_t d = 0; d < Dv; ++d) s.q_v[size_t((i * H + h) * Dv + d)] = put(step(row, qt, d), qt, raw(qt));
      }
  }
}

// Lays out k/v (and the int8 k scale cache) for the mode, with every element poisoned, and
// sets the batch metadata. Interleaved: K and V share one buffer per block or token.
void Builder::layout_kv(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks) {
  if (c.paged()) layout_paged(kt, vt, k, v, ks);
  else if (c.batched()) layout_cache_rows(kt, vt, k, v, ks);
  else layout_varlen_rows(kt, vt, k, v, ks);
}

// Paged: blocks in sequence or random order, one poison block for the unused table entries.
void Builder::layout_paged(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks) {
  auto& p = ac.params;
  const int64_t Hk = c.H_kv, D = c.D, Dv = c.Dv;
  const bool inter = c.kv_interleaved && kt == vt;
  const int64_t bs = c.block_size;
  int64_t used = 0, max_blocks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = (k_len[size_t(b)] + bs - 1) / bs;
    used += n, max_blocks = std::max(max_blocks, n);
  }
  const int64_t nb = used + 1 + c.extra_kv_rows;  // + a poison block for unused table entries
  std::vector<int64_t> ids(static_cast<size_t>(nb));
  std::iota(ids.begin(), ids.end(), 0);
  if (c.random_block_ids) std::shuffle(ids.begin(), ids.end(), g);
  size_t next = 0;
  blocks.assign(size_t(B), {});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < (k_len[size_t(b)] + bs - 1) / bs; ++j) blocks[size_t(b)].push_back(ids[next++]);
  const int64_t poison_block = ids[next];
  const int64_t kblk = bs * Hk * D, vblk = bs * Hk * Dv;
  const int64_t kst = (inter ? kblk + vblk : kblk) + c.kv_pad, vst = inter ? kst : vblk + c.kv_pad;
  auto paged = [&](DType t, int64_t hd, int64_t st) {
    return c.layout == KvLayout::hnd ? view(t, {nb, Hk, bs, hd}, {st, bs * hd, hd, 1})
                                     : view(t, {nb, bs, Hk, hd}, {st, Hk * hd, hd, 1});
  };
  if (c.kv_latent && kt == vt) {  // [nb, bs, Hk, v | k]
    const int64_t w = D + Dv, st = bs * Hk * w + c.kv_pad;
    v = keep(alloc(view(vt, {nb, bs, Hk, Dv}, {st, Hk * w, w, 1}), nb * st));
    k = keep(alias(v, view(kt, {nb, bs, Hk, D}, {st, Hk * w, w, 1}), Dv));
    p.kv_layout = KvLayout::nhd;
  } else {
    k = keep(alloc(paged(kt, D, kst), nb * kst));
    v = inter ? keep(alias(k, paged(vt, Dv, vst), kblk)) : keep(alloc(paged(vt, Dv, vst), nb * vst));
    p.kv_layout = c.layout;
  }
  if (kt == DType::i8) ks = keep(alloc(dense(DType::f32, {nb, Hk, bs}), nb * Hk * bs));
  // block_table: a [B, max_blocks] slice of [B, rs] rows, unused entries -> the poison block.
  const int64_t mb = max_blocks + c.extra_table_cols, rs = mb + c.table_row_pad;
  const HostTensor base = keep(alloc(dense(DType::i32, {B * rs}), B * rs));
  std::fill_n(base.ref.ptr<int32_t>(), B * rs, int32_t(poison_block));
  const HostTensor bt = keep(alias(base, view(DType::i32, {B, mb}, {rs, 1}), c.table_col_offset));
  for (int64_t b = 0; b < B; ++b)
    for (size_t j = 0; j < blocks[size_t(b)].size(); ++j)
      *static_cast<int32_t*>(addr(bt.ref, {b, int64_t(j)})) = int32_t(blocks[size_t(b)][j]);
  p.block_table = bt.ref;
  if (!c.use_seqused && !c.batched()) {
    std::vector<int64_t> cu{0};
    for (int64_t b = 0; b < B; ++b) cu.push_back(cu.back() + k_len[size_t(b)]);
    p.cu_seqlens_k = keep(int32_tensor(cu)).ref;
  }
}

// Batched contiguous: a [B_cache, S_cache, H_kv, D] cache, rows picked by cache_batch_idx.
void Builder::layout_cache_rows(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks) {
  auto& p = ac.params;
  const int64_t Hk = c.H_kv, D = c.D, Dv = c.Dv;
  const bool inter = c.kv_interleaved && kt == vt;
  const int64_t kts = (inter ? Hk * (D + Dv) : Hk * D) + c.kv_pad, vts = inter ? kts : Hk * Dv + c.kv_pad;
  const int64_t S = *std::max_element(k_len.begin(), k_len.end()) + (c.use_seqused ? c.extra_kv_rows : 0);
  const int64_t Bc = B + c.extra_kv_rows;
  std::vector<int64_t> rows(static_cast<size_t>(Bc));
  std::iota(rows.begin(), rows.end(), 0);
  if (c.use_cache_batch_idx) std::shuffle(rows.begin(), rows.end(), g);
  cache_row.assign(rows.begin(), rows.begin() + B);
  if (c.kv_latent && kt == vt) {  // [Bc, S, Hk, v | k]
    const int64_t w = D + Dv, tok = Hk * w + c.kv_pad;
    v = keep(alloc(view(vt, {Bc, S, Hk, Dv}, {S * tok, tok, w, 1}), Bc * S * tok));
    k = keep(alias(v, view(kt, {Bc, S, Hk, D}, {S * tok, tok, w, 1}), Dv));
  } else {
    k = keep(alloc(view(kt, {Bc, S, Hk, D}, {S * kts, kts, D, 1}), Bc * S * kts));
    v = inter ? keep(alias(k, view(vt, {Bc, S, Hk, Dv}, {S * vts, vts, Dv, 1}), Hk * D))
              : keep(alloc(view(vt, {Bc, S, Hk, Dv}, {S * vts, vts, Dv, 1}), Bc * S * vts));
  }
  if (kt == DType::i8) ks = keep(alloc(dense(DType::f32, {Bc, S, Hk}), Bc * S * Hk));
  if (c.use_cache_batch_idx) p.cache_batch_idx = keep(int32_tensor(cache_row)).ref;
}

// Varlen contiguous: [total_k, H_kv, D] rows by cu_seqlens_k; with seqused_k each segment
// may hold unused (poisoned) rows after the sequence's tokens.
void Builder::layout_varlen_rows(DType kt, DType vt, HostTensor& k, HostTensor& v, HostTensor& ks) {
  auto& p = ac.params;
  const int64_t Hk = c.H_kv, D = c.D, Dv = c.Dv;
  const bool inter = c.kv_interleaved && kt == vt;
  const int64_t kts = (inter ? Hk * (D + Dv) : Hk * D) + c.kv_pad, vts = inter ? kts : Hk * Dv + c.kv_pad;
  std::vector<int64_t> cu{0};
  for (int64_t b = 0; b < B; ++b) {
    k_row0.push_back(cu.back());
    cu.push_back(cu.back() + k_len[size_t(b)] + (c.use_seqused ? integer(0, c.extra_kv_rows) : 0));
  }
  const int64_t rows = cu.back() + c.extra_kv_rows;
  if (c.kv_latent && kt == vt) {  // [rows, Hk, v | k]
    const int64_t w = D + Dv, tok = Hk * w + c.kv_pad;
    v = keep(alloc(view(vt, {rows, Hk, Dv}, {tok, w, 1}), rows * tok));
    k = keep(alias(v, view(kt, {rows, Hk, D}, {tok, w, 1}), Dv));
  } else {
    k = keep(alloc(view(kt, {rows, Hk, D}, {kts, D, 1}), rows * kts));
    v = inter ? keep(alias(k, view(vt, {rows, Hk, Dv}, {vts, Dv, 1}), Hk * D))
              : keep(alloc(view(vt, {rows, Hk, Dv}, {vts, Dv, 1}), rows * vts));
  }
  if (kt == DType::i8) ks = keep(alloc(dense(DType::f32, {rows, Hk}), rows * Hk));
  p.cu_seqlens_k = keep(int32_tensor(cu)).ref;
}

void Builder::build_kv() {
  auto& p = ac.params;
  const DType kt = c.quant == QuantMode::none ? c.q_dtype : c.kv_dtype;
  const DType vt = c.quant == QuantMode::int8_k8v16 ? c.v16_dtype : kt;
  const int64_t Hk = c.H_kv, D = c.D, Dv = c.Dv;
  HostTensor k, v, ks, kd, vd, vs;
  layout_kv(kt, vt, k, v, ks);
  p.k = k.ref, p.v = v.ref;
  if (ks.bytes) p.k_scale_cache = ks.ref;
  if (flashserve::is_fp8(kt)) p.k_descale = (kd = descale()).ref, p.v_descale = (vd = descale()).ref;
  if (vt == DType::i8) {
    vs = keep(alloc(dense(DType::f32, {Hk, Dv}), Hk * Dv));
    for (int64_t i = 0; i < Hk * Dv; ++i) vs.ref.ptr<float>()[i] = float(uniform(0.5, 1.5) / 127.0);
    p.v_scale = vs.ref;
  }
  if (c.use_seqused) p.seqused_k = keep(int32_tensor(k_len)).ref;
  for (int64_t b = 0; b < B; ++b) {
    NaiveSequence& s = ac.seqs[size_t(b)];
    s.k.resize(size_t(s.sk * Hk * D));
    s.v.resize(size_t(s.sk * Hk * Dv));
    for (int64_t t = 0; t < s.sk; ++t)
      for (int64_t kh = 0; kh < Hk; ++kh) {
        double kf = 1.0;
        if (kd.bytes) kf = at2(kd, b, kh);
        if (ks.bytes) kf = put(ks_at(ks.ref, b, t, kh), DType::f32, uniform(0.5, 1.5) / 127.0);
        void* kr = kv_at(k.ref, b, t, kh);
        for (int64_t d = 0; d < D; ++d) s.k[size_t((t * Hk + kh) * D + d)] = put(step(kr, kt, d), kt, raw(kt)) * kf;
        void* vr = kv_at(v.ref, b, t, kh);
        for (int64_t d = 0; d < Dv; ++d) {
          const double vf = vd.bytes ? at2(vd, b, kh) : vs.bytes ? at2(vs, kh, d) : 1.0;
          s.v[size_t((t * Hk + kh) * Dv + d)] = put(step(vr, vt, d), vt, raw(vt)) * vf;
        }
      }
  }
}

void Builder::build_out() {
  auto& p = ac.params;
  const DType ot = c.out_dtype;
  const int64_t H = c.H, Dv = c.Dv, sq = c.q_lens.empty() ? 0 : c.q_lens[0];
  const int64_t total_q = c.batched() ? B * sq : ac.q_row0.empty() ? 0 : ac.q_row0.back() + c.q_lens.back();
  const int64_t ts = H * Dv + c.out_pad, rows = c.batched() ? B * sq : total_q;
  ac.out = alloc(c.batched() ? view(ot, {B, sq, H, Dv}, {sq * ts, ts, Dv, 1}) : view(ot, {total_q, H, Dv}, {ts, Dv, 1}),
                 rows * ts);
  p.out = ac.out.ref;
  if (c.lse) {
    ac.lse = alloc(c.batched() ? dense(DType::f32, {B, H, sq}) : dense(DType::f32, {H, total_q}), H * rows);
    p.lse = ac.lse.ref;
  }
  if (!c.batched()) {
    std::vector<int64_t> cu{0};
    int64_t mq = 0, mk = 0;
    for (int64_t b = 0; b < B; ++b) {
      cu.push_back(cu.back() + c.q_lens[size_t(b)]);
      mq = std::max(mq, c.q_lens[size_t(b)]), mk = std::max(mk, k_len[size_t(b)]);
    }
    p.cu_seqlens_q = keep(int32_tensor(cu)).ref;
    p.max_seqlen_q = mq + c.max_seqlen_slack;
    p.max_seqlen_k = mk + c.max_seqlen_slack;
  }
}

void Builder::build_features() {
  auto& p = ac.params;
  const int64_t H = c.H;
  NaiveFeatures f;
  p.softmax_scale = c.softmax_scale;
  f.scale = c.softmax_scale != 0.0f ? double(c.softmax_scale) : 1.0 / std::sqrt(double(c.D + (c.has_qv ? c.Dv : 0)));
  p.softcap = c.softcap;
  f.softcap = double(c.softcap);
  p.causal = f.causal = c.causal;
  p.window = c.window;
  f.window_left = c.window.left, f.window_right = c.window.right;
  p.chunk_size = f.chunk = c.chunk;
  p.num_splits = c.num_splits;
  p.alibi_sqrt = f.alibi_sqrt = c.alibi_sqrt;
  HostTensor sinks, alibi;
  if (c.sinks) {
    sinks = keep(alloc(dense(c.sink_dtype, {H}), H));
    for (int64_t h = 0; h < H; ++h) f.sinks.push_back(put(addr(sinks.ref, {h}), c.sink_dtype, uniform(-1.0, 3.0)));
    p.s_aux = sinks.ref;
  }
  if (c.alibi) {
    alibi = keep(alloc(c.alibi == 1 ? dense(DType::f32, {H}) : dense(DType::f32, {B, H}), c.alibi == 1 ? H : B * H));
    for (int64_t i = 0; i < alibi.ref.numel(); ++i) alibi.ref.ptr<float>()[i] = float(uniform(0.0, 0.25));
    p.alibi_slopes = alibi.ref;
  }
  for (int64_t b = 0; b < B; ++b) {
    NaiveFeatures fb = f;
    for (int64_t h = 0; h < H && c.alibi; ++h)
      fb.alibi.push_back(double(alibi.ref.ptr<float>()[c.alibi == 1 ? h : b * H + h]));
    ac.feats.push_back(std::move(fb));
  }
}

}  // namespace

AttentionCase build_case(const CaseConfig& c, std::mt19937_64& rng) {
  AttentionCase ac;
  ac.cfg = c;
  Builder bl{c, rng, ac};
  bl.B = c.batch();
  bl.group = c.H / c.H_kv;
  bl.k_len = c.k_lens;
  ac.seqs.resize(size_t(bl.B));
  for (int64_t b = 0; b < bl.B; ++b) {
    NaiveSequence& s = ac.seqs[size_t(b)];
    s.sq = c.q_lens[size_t(b)], s.sk = c.k_lens[size_t(b)];
    s.H = c.H, s.H_kv = c.H_kv, s.D = c.D, s.Dv = c.Dv;
  }
  bl.build_q();
  bl.build_kv();
  bl.build_out();
  bl.build_features();
  return ac;
}

void run_case(AttentionCase& ac) {
  poison_storage(ac.out);
  if (ac.cfg.lse) poison_storage(ac.lse);
  if (ac.cfg.batched()) flashserve::kvcache_attention(ac.params);
  else flashserve::varlen_attention(ac.params);
}

}  // namespace fstest
