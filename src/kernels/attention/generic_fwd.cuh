// The generic attention kernel: correct first, every validated feature, fp32 math.
//
// CTA (schedule.cuh): a tile of flat query rows x a slice of one KV head's query heads x one
// KV split; 4 warps, each owning 4 packed (query row, head) rows: 16 per CTA. The CTA walks
// its tile sequence by sequence ("segments"); per segment:
//   1. the packed query rows are dequantized into shared memory: q [16, D (+ Dv of q_v)];
//   2. over the split's KV range, tiles of 32 keys (aligned to the range's start, as the CPU
//      reference) are located (load.cuh: bad metadata -> NaN keys, never an OOB read),
//      dequantized into shared memory (K [32, D+1], V [32, Dv+1]; +1 pads banks);
//   3. each warp: lane t scores key t for its 4 rows (dot over d in order), applies the score
//      transform and visibility (masks.cuh), and folds the tile into the online softmax
//      (softmax.cuh); lane c accumulates output channels c, c+32, ... (kDvBucket / 32 each);
//   4. epilogue (epilogue.cuh): out = acc / l with the sink merged once, or, with splits,
//      the partial (acc / l, lse) into the workspace for combine.cu.
#pragma once

#include <cstdint>

#include "kernels/attention/epilogue.cuh"
#include "kernels/attention/load.cuh"
#include "kernels/attention/masks.cuh"
#include "kernels/attention/schedule.cuh"
#include "kernels/attention/softmax.cuh"

namespace flashserve::kernels::generic {

constexpr int kRpw = kGenericRowsPerWarp;
constexpr int kTile = kGenericTileKeys;
constexpr int kPacked = kGenericPackedRows;
constexpr int kThreads = kGenericThreads;
static_assert(kTile == 32, "one key per lane");

// Dynamic shared memory, laid out as generic_smem_bytes (select.cu) sizes it.
struct Smem {
  TokenLoc* loc;   // [kTile]
  float* q;        // [kPacked, qw]: packed query rows (q, then q_v), dequantized
  float* k;        // [kTile, kw]
  float* v;        // [kTile, vw]
  int64_t qw, kw, vw;
};

FS_DEV Smem carve_smem(void* base, const AttnParams& p) {
  Smem s;
  s.qw = p.head_dim + p.qv_dim;
  s.kw = p.head_dim + 1;
  s.vw = p.head_dim_v + 1;
  s.loc = static_cast<TokenLoc*>(base);
  s.q = reinterpret_cast<float*>(s.loc + kTile);
  s.k = s.q + kPacked * s.qw;
  s.v = s.k + kTile * s.kw;
  return s;
}

// The sequence and KV range a CTA is working on.
struct Segment {
  SeqRows seq;
  SeqKv kv;
  int64_t sk = 0, sk_global = 0;   // local and global KV lengths
  KvRange range{0, 0};             // this split's local keys
  KeyRange cache{0, 0};            // tokens the metadata places inside the cache (see below)
  int64_t r_begin = 0, r_end = 0;  // flat rows of the tile in this sequence
};

// Tokens [lo, hi) of a sequence that can lie inside the cache: paged, the block table's
// columns; contiguous, the cache rows (none when the cache row kb is out of range).
FS_DEV KeyRange cache_tokens(const AttnParams& p, const SeqKv& kv) {
  if (p.paged) return {0, p.max_blocks * p.kv_dim1};
  if (kv.kb < 0 || kv.kb >= p.kv_dim0) return {0, 0};
  const int64_t lo = imax(0, -kv.k_begin);
  return {lo, imax(lo, p.kv_dim1 - kv.k_begin)};
}

// Bounds a row's keys when metadata places some outside the cache: one bad key already makes
// the row NaN, so it stops at its first one (a garbage length never means a long walk).
FS_DEV KeyRange bound_to_cache(KeyRange k, const KeyRange& cache) {
  if (k.lo >= k.hi) return k;
  if (k.lo < cache.lo || k.lo >= cache.hi) return {k.lo, k.lo + 1};
  return {k.lo, imin(k.hi, cache.hi + 1)};
}

FS_DEV Segment make_segment(const AttnParams& p, const CtaTile& tile, const SeqRows& seq, int64_t r0, int64_t r1) {
  Segment s;
  s.seq = seq;
  s.kv = seq_kv(p, seq.b, tile.g);
  s.sk = kv_len(p, seq.b);
  s.sk_global = kv_len_global(p, seq.b, s.sk);
  s.range = split_kv_range(s.sk, p.num_splits, tile.split, p.split_granularity);
  s.cache = cache_tokens(p, s.kv);
  s.r_begin = r0;
  s.r_end = r1;
  return s;
}

// Packed row idx of the CTA: flat row r_begin + idx / heads_per_cta, head h0 + idx %
// heads_per_cta of the group. Inactive outside the segment or past the group.
struct PackedRow {
  bool active = false;
  int64_t r = 0, q_row = 0, h = 0;  // flat row, its index in the normalized view, query head
  int64_t pos = 0;                  // aligned global position i + sk_global - sq
  KeyRange keys{0, 0};              // visible local keys within the split's range
  float slope = 0.0f;               // ALiBi
};

FS_DEV PackedRow packed_row(const AttnParams& p, const CtaTile& tile, const Segment& s, int idx) {
  PackedRow pr;
  const int64_t ri = idx / p.heads_per_cta, hg = tile.h0 + idx % p.heads_per_cta;
  pr.r = tile.r_begin + ri;
  if (ri >= p.rows_per_cta || hg >= p.group || pr.r < s.r_begin || pr.r >= s.r_end) return pr;
  pr.active = true;
  pr.h = tile.g * p.group + hg;
  pr.q_row = s.seq.q_row(pr.r, p.batched);
  pr.pos = (pr.r - s.seq.row_begin) + s.sk_global - s.seq.sq();
  const KeyRange k = make_visibility(p)(pr.pos, s.sk_global);
  pr.keys = bound_to_cache({imax(k.lo, s.range.begin), imin(k.hi, s.range.end)}, s.cache);
  return pr;
}

// Union of the active rows' visible keys (the same in every thread).
FS_DEV KeyRange keys_of_rows(const AttnParams& p, const CtaTile& tile, const Segment& s) {
  KeyRange u{s.range.end, s.range.begin};
  for (int idx = 0; idx < kPacked; ++idx) {
    const PackedRow r = packed_row(p, tile, s, idx);
    if (!r.active || r.keys.lo >= r.keys.hi) continue;
    u.lo = imin(u.lo, r.keys.lo);
    u.hi = imax(u.hi, r.keys.hi);
  }
  return u;
}

// Step 1: q [kPacked, qw] = dequantized q (then q_v) of the active packed rows.
FS_DEV void load_queries(const AttnParams& p, const Smem& sm, const CtaTile& tile, const Segment& s) {
  const int64_t D = p.head_dim;
  for (int64_t idx = threadIdx.x; idx < kPacked * sm.qw; idx += kThreads) {
    const int pi = int(idx / sm.qw);
    const int64_t d = idx % sm.qw;
    const PackedRow r = packed_row(p, tile, s, pi);
    if (!r.active) continue;
    float scale = 1.0f;
    if (is_fp8(p.q.dtype)) scale = load_f32_2d(p.q_descale, s.seq.b, tile.g, 1.0f);
    if (p.q.dtype == DType::i8) {
      const StridedRef& qs = p.q_scale;
      scale = static_cast<const float*>(qs.data)[s.seq.qb * qs.stride[0] + r.q_row * qs.stride[1] + r.h * qs.stride[2]];
    }
    const StridedRef& src = d < D ? p.q : p.q_v;
    const int64_t off = s.seq.qb * src.stride[0] + r.q_row * src.stride[1] + r.h * src.stride[2] + (d < D ? d : d - D);
    sm.q[pi * sm.qw + d] = load_as_float(src.data, off, src.dtype) * scale;
  }
}

// Step 2: tokens [t0, t0 + n) of the segment into K/V shared memory; ends synchronized.
FS_DEV void load_kv_tile(const AttnParams& p, const Smem& sm, const SeqKv& kv, int64_t t0, int n) {
  if (int(threadIdx.x) < n) sm.loc[threadIdx.x] = locate_token(p, kv, t0 + threadIdx.x);
  __syncthreads();
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  for (int64_t idx = threadIdx.x; idx < n * D; idx += kThreads) {
    const int64_t t = idx / D, d = idx % D;
    sm.k[t * sm.kw + d] = load_k(p, sm.loc[t], d);
  }
  for (int64_t idx = threadIdx.x; idx < n * Dv; idx += kThreads) {
    const int64_t t = idx / Dv, c = idx % Dv;
    sm.v[t * sm.vw + c] = load_v(p, kv, sm.loc[t], c);
  }
  __syncthreads();
}

// Step 3a: dots[j] = q_j . k_lane (+ q_v_j . v_lane) for the warp's rows, summed over d in order.
FS_DEV void tile_dots(const AttnParams& p, const Smem& sm, int warp, int lane, int n, float (&dots)[kRpw]) {
#pragma unroll
  for (int j = 0; j < kRpw; ++j) dots[j] = 0.0f;
  if (lane >= n) return;
  const float* q = sm.q + int64_t(warp) * kRpw * sm.qw;
  const float* k = sm.k + lane * sm.kw;
  for (int64_t d = 0; d < p.head_dim; ++d) {
    const float kd = k[d];
#pragma unroll
    for (int j = 0; j < kRpw; ++j) dots[j] += q[j * sm.qw + d] * kd;
  }
  const float* v = sm.v + lane * sm.vw;
  for (int64_t c = 0; c < p.qv_dim; ++c) {
    const float vc = v[c];
#pragma unroll
    for (int j = 0; j < kRpw; ++j) dots[j] += q[j * sm.qw + p.head_dim + c] * vc;
  }
}

// Step 3b: folds tile keys [ta, te) (tile-relative; x = this lane's logit, -inf when not
// visible) into one row's state and accumulator.
template <int kChan>
FS_DEV void absorb(const Smem& sm, int64_t dv, int lane, float x, bool visible, int ta, int te, RowState& st,
                   float (&acc)[kChan]) {
  float new_m, alpha;
  if (!st.rescale(warp_max_nan(x), new_m, alpha)) return;
  const float pe = visible ? expf(x - new_m) : 0.0f;
  st.update(new_m, alpha, warp_sum(pe));
  if (alpha != 1.0f) {
#pragma unroll
    for (int k = 0; k < kChan; ++k) acc[k] *= alpha;
  }
  for (int t = ta; t < te; ++t) {
    const float pt = __shfl_sync(kFullMask, pe, t);
    const float* v = sm.v + t * sm.vw;
#pragma unroll
    for (int k = 0; k < kChan; ++k) {
      const int64_t c = lane + 32 * k;
      if (c < dv) acc[k] += pt * v[c];
    }
  }
}

// Step 4: the row's output (or split partial) and LSE.
template <int kChan>
FS_DEV void finish_row(const AttnParams& p, const Segment& s, int split, const PackedRow& r, const RowState& st,
                       const float (&acc)[kChan], int lane) {
  float lse = st.lse();
  const int64_t dv = p.head_dim_v;
  if (p.num_splits > 1) {
    const int64_t at = partial_index(p, split, r.r, r.h);
#pragma unroll
    for (int k = 0; k < kChan; ++k) {
      const int64_t c = lane + 32 * k;
      if (c < dv) p.o_partial[at * dv + c] = st.empty() ? 0.0f : acc[k] / st.l;
    }
    if (lane == 0) p.lse_partial[at] = lse;
    return;
  }
  const float w = apply_sink(p, r.h, lse);
#pragma unroll
  for (int k = 0; k < kChan; ++k) {
    const int64_t c = lane + 32 * k;
    if (c < dv) store_out(p, s.seq.qb, r.q_row, r.h, c, (st.empty() ? 0.0f : acc[k] / st.l) * w);
  }
  if (lane == 0) store_lse(p, s.seq.qb, r.q_row, r.h, lse);
}

// One segment: flat rows [r0, r1) of sequence `seq` within the CTA's tile.
template <int kDvBucket>
FS_DEV void attend_segment(const AttnParams& p, const Smem& sm, const CtaTile& tile, const SeqRows& seq, int64_t r0,
                           int64_t r1) {
  constexpr int kChan = kDvBucket / 32;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const Segment s = make_segment(p, tile, seq, r0, r1);
  const ScoreTransform score = make_score_transform(p);
  __syncthreads();  // the previous segment is done with shared memory
  load_queries(p, sm, tile, s);
  const KeyRange keys = keys_of_rows(p, tile, s);

  PackedRow row[kRpw];
  RowState st[kRpw];
  float acc[kRpw][kChan];
#pragma unroll
  for (int j = 0; j < kRpw; ++j) {
    row[j] = packed_row(p, tile, s, warp * kRpw + j);
    if (row[j].active && p.alibi.data) row[j].slope = load_f32_2d(p.alibi, seq.b, row[j].h, 0.0f);
#pragma unroll
    for (int k = 0; k < kChan; ++k) acc[j][k] = 0.0f;
  }
  if (keys.lo < keys.hi) {
    for (int64_t t0 = s.range.begin + (keys.lo - s.range.begin) / kTile * kTile; t0 < keys.hi; t0 += kTile) {
      const int n = int(imin(kTile, s.range.end - t0));
      __syncthreads();  // the previous tile is consumed
      load_kv_tile(p, sm, s.kv, t0, n);
      float dots[kRpw];
      tile_dots(p, sm, warp, lane, n, dots);
#pragma unroll
      for (int j = 0; j < kRpw; ++j) {
        if (!row[j].active) continue;
        const int64_t a = imax(t0, row[j].keys.lo), e = imin(t0 + n, row[j].keys.hi);
        if (a >= e) continue;
        const int64_t key = t0 + lane;
        const bool visible = key >= a && key < e;
        const float x = visible ? score(dots[j], row[j].pos, key, row[j].slope) : kNegInf;
        absorb<kChan>(sm, p.head_dim_v, lane, x, visible, int(a - t0), int(e - t0), st[j], acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kRpw; ++j)
    if (row[j].active) finish_row<kChan>(p, s, tile.split, row[j], st[j], acc[j], lane);
}

template <int kDvBucket>
__global__ void __launch_bounds__(kThreads) attention_fwd(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem sm = carve_smem(smem_raw, p);
  const CtaTile tile = cta_tile(p);
  for (int64_t r = tile.r_begin; r < tile.r_end;) {
    const SeqRows seq = find_sequence(p, r);
    if (!seq.covers(r)) {
      ++r;
      continue;
    }
    const int64_t end = imin(tile.r_end, seq.row_end);
    attend_segment<kDvBucket>(p, sm, tile, seq, r, end);
    r = end;
  }
}

}  // namespace flashserve::kernels::generic
