// CPU reference attention: per work item (sequence b, KV head g, block of packed rows), the
// packed rows are (query row i, head h of g's group); K/V are decoded tile by tile into float
// buffers, scores and the online softmax run in fp32, and split partials merge in order.
#include "reference/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "common/check.hpp"
#include "common/cp_layout.hpp"
#include "common/softmax_state.hpp"
#include "flashserve/numeric.hpp"
#include "flashserve/status.hpp"
#include "reference/attn_load.hpp"

namespace flashserve::reference {

namespace {

constexpr int64_t kTile = 32;          // keys per K/V tile
constexpr int64_t kMaxRows = 64;       // packed rows per work item
constexpr int64_t kRowFloats = 8192;   // floats of a per-item row buffer: rows * width
constexpr int64_t kMaxQkWidth = 768;   // D + Dv of q_v
constexpr int64_t kMaxDv = 512;

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per-call constants.
struct Call {
  const detail::AttnProblem& pr;
  OperandLoader load;
  int64_t group = 1;          // query heads per KV head
  int64_t width = 0;          // D (+ Dv with q_v): floats of a packed query row
  int64_t dv = 0;
  int64_t rows_per_item = 1;
  int num_splits = 1;
  int64_t split_size = 0;  // > 0: batch-invariant fixed-size splits (seq_split_range)
  int64_t granularity = 1;
  float scale = 1.0f, softcap = 0.0f;
  bool causal = false, alibi = false, alibi_sqrt = false;
  Window window{};
  int64_t chunk = 0;
  int64_t cp_world = 1, cp_rank = 0, cp_interleave = 1;  // context parallel (common/cp_layout.hpp)
};

// One packed row of a work item: query row i of the sequence, query head h.
struct Row {
  int64_t i = 0, h = 0;
  int64_t pos = 0;         // aligned position i' = i + sk - sq (global sk under context parallelism)
  int64_t lo = 0, hi = 0;  // visible local keys [lo, hi)
  float slope = 0.0f;      // ALiBi slope
  float m = 0.0f, l = 0.0f;  // online softmax state of the current split (max, sum)
  float lse = 0.0f;        // of the state merged over the splits so far
};

// First local key whose global position is >= g (g >= 0): the local keys below g.
int64_t local_from_global(const Call& c, int64_t g) {
  return cp_local_len(g, c.cp_world, c.cp_rank, c.cp_interleave);
}

// SPEC.md §2.4 as an interval: causal, window and chunk each bound [lo, hi) within [0, sk)
// in global positions; under context parallelism mapped to this rank's local keys.
void visible_keys(const Call& c, int64_t pos, int64_t sk, int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = sk;
  if (c.causal) hi = std::min(hi, pos + 1);
  if (c.window.left >= 0) lo = std::max(lo, pos - c.window.left);
  if (c.window.right >= 0) hi = std::min(hi, pos + c.window.right + 1);
  if (c.chunk > 0) {
    const int64_t start = floor_div(pos, c.chunk) * c.chunk;
    lo = std::max(lo, start);
    hi = std::min(hi, start + c.chunk);
  }
  hi = std::max(hi, lo);
  if (c.cp_world > 1) {
    lo = local_from_global(c, lo);
    hi = std::max(lo, local_from_global(c, hi));
  }
}

// s[t] = q · kt[:, t] for the kTile keys of a tile (kt [width, kTile]), summed over d in order.
void tile_dots(const float* q, int64_t width, const float* kt, float* s) {
  float acc[kTile] = {};
  for (int64_t d = 0; d < width; ++d) {
    const float qd = q[d];
    const float* kr = kt + d * kTile;
    for (int64_t t = 0; t < kTile; ++t) acc[t] += qd * kr[t];
  }
  for (int64_t t = 0; t < kTile; ++t) s[t] = acc[t];
}

// SPEC.md §2 steps 1-3 for keys [a, e) of the tile starting at key t0 (s is tile-relative).
void modify_scores(const Call& c, const Row& r, int64_t t0, int64_t a, int64_t e, float* s) {
  for (int64_t t = a; t < e; ++t) {
    float x = s[t - t0] * c.scale;
    if (c.softcap > 0.0f) x = c.softcap * std::tanh(x / c.softcap);
    if (c.alibi) {
      const float dist = float(std::llabs(r.pos - cp_global_pos(t, c.cp_world, c.cp_rank, c.cp_interleave)));
      x -= r.slope * (c.alibi_sqrt ? std::sqrt(dist) : dist);
    }
    s[t - t0] = x;
  }
}

// acc[c] += sum over t in [a, e), in order, of p[t] * vt[t, c]; W columns at a time held in
// registers (the order per element is the same for every W).
template <int64_t W>
int64_t add_pv_columns(const float* p, int64_t a, int64_t e, const float* vt, int64_t dv, int64_t c0, float* acc) {
  for (; c0 + W <= dv; c0 += W) {
    float x[W];
    for (int64_t j = 0; j < W; ++j) x[j] = acc[c0 + j];
    for (int64_t t = a; t < e; ++t) {
      const float pt = p[t];
      const float* v = vt + t * dv + c0;
      for (int64_t j = 0; j < W; ++j) x[j] += pt * v[j];
    }
    for (int64_t j = 0; j < W; ++j) acc[c0 + j] = x[j];
  }
  return c0;
}

// Online softmax over tile-relative keys [a, e): updates (r.m, r.l) and acc [Dv] += p v.
void absorb(Row& r, float* s, int64_t a, int64_t e, const float* vt, int64_t dv, float* acc) {
  float mx = r.m;
  for (int64_t t = a; t < e; ++t) mx = (s[t] > mx || s[t] != s[t]) ? s[t] : mx;  // a NaN sticks
  if (mx == -INFINITY) return;  // every score -inf: nothing to add
  const float alpha = std::exp(r.m - mx);
  float sum = 0.0f;
  for (int64_t t = a; t < e; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  r.l = r.l * alpha + sum;
  r.m = mx;
  if (alpha != 1.0f)
    for (int64_t c = 0; c < dv; ++c) acc[c] *= alpha;
  int64_t c0 = add_pv_columns<32>(s, a, e, vt, dv, 0, acc);
  c0 = add_pv_columns<8>(s, a, e, vt, dv, c0, acc);
  add_pv_columns<1>(s, a, e, vt, dv, c0, acc);
}

// The partial state of each row over keys `range` (without the sink): o in acc [np, Dv]
// (0 when empty), lse in part_lse [np] (-inf when empty).
void attend_range(const Call& c, const SeqKv& kv, int64_t b, int64_t g, KvRange range, Row* rows,
                  int64_t np, const float* q, float* acc, float* part_lse) {
  int64_t lo = range.end, hi = range.begin;  // union of the rows' visible keys in range
  for (int64_t r = 0; r < np; ++r) {
    rows[r].m = -INFINITY;
    rows[r].l = 0.0f;
    std::fill(acc + r * c.dv, acc + (r + 1) * c.dv, 0.0f);
    const int64_t a = std::max(range.begin, rows[r].lo), e = std::min(range.end, rows[r].hi);
    if (a < e) {
      lo = std::min(lo, a);
      hi = std::max(hi, e);
    }
  }
  if (lo < hi) {
    alignas(64) float kt[kMaxQkWidth * kTile];  // [width, kTile]
    alignas(64) float vt[kTile * kMaxDv];       // [kTile, Dv]
    alignas(64) float s[kTile];
    // Tiles stay aligned to the range's start, so a row's arithmetic never depends on the
    // other rows of its item.
    for (int64_t t0 = range.begin + (lo - range.begin) / kTile * kTile; t0 < hi; t0 += kTile) {
      const int64_t n = std::min(kTile, range.end - t0);
      c.load.load_kv_tile(kv, b, g, t0, n, kTile, kt, vt);
      for (int64_t r = 0; r < np; ++r) {
        const int64_t a = std::max(t0, rows[r].lo), e = std::min(t0 + n, rows[r].hi);
        if (a >= e) continue;
        tile_dots(q + r * c.width, c.width, kt, s);
        modify_scores(c, rows[r], t0, a, e, s);
        absorb(rows[r], s, a - t0, e - t0, vt, c.dv, acc + r * c.dv);
      }
    }
  }
  for (int64_t r = 0; r < np; ++r) {
    const float l = rows[r].l;
    if (l == 0.0f) {
      part_lse[r] = -INFINITY;
      continue;
    }
    part_lse[r] = rows[r].m + std::log(l);
    float* o = acc + r * c.dv;
    for (int64_t k = 0; k < c.dv; ++k) o[k] /= l;
  }
}

// run = merge(run, part) per row (SPEC.md §4).
void merge_into(const Call& c, Row* rows, int64_t np, float* run, const float* part, const float* part_lse) {
  for (int64_t r = 0; r < np; ++r) {
    const MergeWeights w = merge_lse(rows[r].lse, part_lse[r]);
    float* o = run + r * c.dv;
    const float* x = part + r * c.dv;
    for (int64_t k = 0; k < c.dv; ++k) o[k] = w.w_a * o[k] + w.w_b * x[k];
    rows[r].lse = w.lse;
  }
}

// Applies the sink (once, after the splits) and stores out [qb, row, h, :] and lse.
void finish_row(const Call& c, const Row& r, int64_t qb, int64_t row, float* o) {
  const detail::AttnProblem& pr = c.pr;
  float lse = r.lse;
  if (pr.s_aux) {
    const float sink = numeric::load_float(pr.s_aux->at(r.h), pr.s_aux->dtype);
    const MergeWeights w = merge_lse(lse, sink);  // the sink: a state with lse = sink, o = 0
    for (int64_t k = 0; k < c.dv; ++k) o[k] *= w.w_a;
    lse = w.lse;
  }
  char* dst = static_cast<char*>(pr.out.at(qb, row, r.h, 0));
  const DType t = pr.out.dtype;
  const int64_t es = int64_t(dtype_size(t));
  for (int64_t k = 0; k < c.dv; ++k) numeric::store_float(dst + k * es, t, o[k]);
  if (pr.lse) *static_cast<float*>(pr.lse->at(qb, r.h, row)) = lse;
}

// Work item: sequence b, KV head g, packed rows [blk * rows_per_item, ...) of the sequence's
// sq * group (query row, head) pairs, row-major over (i, head in group).
void run_item(const Call& c, int64_t b, int64_t g, int64_t blk) {
  const detail::AttnProblem& pr = c.pr;
  const int64_t sq = detail::q_len(pr, b);
  const int64_t p0 = blk * c.rows_per_item;
  const int64_t np = std::min(c.rows_per_item, sq * c.group - p0);
  if (np <= 0) return;
  const int64_t sk = detail::k_len(pr, b), qb = pr.batched ? b : 0, row0 = detail::q_begin(pr, b);
  const int64_t sk_global = pr.cp_tot_seqused_k ? detail::read_index(*pr.cp_tot_seqused_k, b) : sk;

  Row rows[kMaxRows];
  alignas(64) float q[kRowFloats];    // [np, width]
  alignas(64) float run[kRowFloats];  // [np, Dv]: merged output
  alignas(64) float part[kRowFloats]; // [np, Dv]: the current split's output
  float part_lse[kMaxRows];
  for (int64_t r = 0; r < np; ++r) {
    Row& w = rows[r];
    w.i = (p0 + r) / c.group;
    w.h = g * c.group + (p0 + r) % c.group;
    w.pos = w.i + sk_global - sq;
    visible_keys(c, w.pos, sk_global, w.lo, w.hi);
    if (c.alibi) w.slope = *static_cast<const float*>(pr.alibi_slopes->at(b, w.h));
    c.load.load_q(qb, row0 + w.i, b, w.h, g, q + r * c.width);
  }
  const SeqKv kv = seq_kv(pr, b);
  const int splits = seq_num_splits(sk, c.num_splits, c.split_size);  // the sequence's own
  for (int s = 0; s < splits; ++s) {
    const KvRange range = seq_split_range(sk, c.num_splits, s, c.granularity, c.split_size);
    if (s == 0) {
      attend_range(c, kv, b, g, range, rows, np, q, run, part_lse);
      for (int64_t r = 0; r < np; ++r) rows[r].lse = part_lse[r];
    } else {
      attend_range(c, kv, b, g, range, rows, np, q, part, part_lse);
      merge_into(c, rows, np, run, part, part_lse);
    }
  }
  for (int64_t r = 0; r < np; ++r) finish_row(c, rows[r], qb, row0 + rows[r].i, run + r * c.dv);
}

}  // namespace

void attention(const detail::AttnProblem& pr, const Plan& plan) {
  const AttentionParams& p = *pr.params;
  Call c{pr, OperandLoader(pr)};
  c.group = pr.group();
  c.width = c.load.qk_width();
  c.dv = pr.head_dim_v;
  if (c.width > kMaxQkWidth || c.dv > kMaxDv || c.width < 1 || c.dv < 1)
    fail_not_implemented("CPU reference attention with D=", pr.head_dim, ", Dv=", pr.head_dim_v,
                         pr.q_v ? " and q_v" : "", " (at most D + Dv(q_v) = ", kMaxQkWidth,
                         ", Dv = ", kMaxDv, ")");
  c.rows_per_item = std::max<int64_t>(1, std::min({kMaxRows, kRowFloats / c.width, kRowFloats / c.dv}));
  c.num_splits = std::max(1, plan.num_splits);
  c.granularity = std::max(1, plan.split_granularity);
  c.split_size = plan.split_size;
  c.scale = pr.softmax_scale;
  c.softcap = p.softcap;
  c.causal = p.causal;
  c.alibi = pr.alibi_slopes.has_value();
  c.alibi_sqrt = p.alibi_sqrt;
  c.window = p.window;
  c.chunk = p.chunk_size;
  c.cp_world = p.cp_world_size;
  c.cp_rank = p.cp_rank;
  c.cp_interleave = p.cp_interleave;

  int64_t max_rows = 0;  // packed rows of the longest sequence
  for (int64_t b = 0; b < pr.batch; ++b) max_rows = std::max(max_rows, detail::q_len(pr, b) * c.group);
  const int64_t blocks = ceil_div(max_rows, c.rows_per_item);
  const int64_t nb = pr.batch, nkv = pr.num_kv_heads;
#pragma omp parallel for collapse(3) schedule(dynamic, 1)
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t g = 0; g < nkv; ++g)
      for (int64_t blk = 0; blk < blocks; ++blk) run_item(c, b, g, blk);
}

}  // namespace flashserve::reference
