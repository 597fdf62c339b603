// The decode kernel's body (included by decode_fwd.cuh, which documents the scheme): row-group
// setup, the per-warp cp.async key stream, the cross-warp merge and the epilogue.
#pragma once

namespace flashserve::kernels::decode {

// Packed row j of the group starting at packed index g0: query row i = (g0 + j) / group,
// head g * group + (g0 + j) % group.
struct PackedIdx {
  int64_t i, h;
};
FS_DEV PackedIdx packed_idx(const AttnParams& p, int64_t g, int64_t g0, int j) {
  return {(g0 + j) / p.group, g * p.group + (g0 + j) % p.group};
}

// Fills meta [kRows] and q [kRows, kD] (f32; zeros for inactive rows) of the row group; the
// union of the active rows' keys is returned (the same in every thread). Ends synchronized.
template <class S>
FS_DEV KeyRange setup_rows(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, float* q,
                           RowMeta* meta) {
  const int64_t sq = s.rows.sq();
  if (int(threadIdx.x) < S::kRows) {
    const int j = int(threadIdx.x);
    RowMeta m{0, 0, 0, 0.0f, 0};
    if (j < nrows) {
      const PackedIdx pi = packed_idx(p, g, g0, j);
      m.active = 1;
      m.pos = pi.i + s.sk_global - sq;
      const KeyRange vis = make_visibility(p)(m.pos, s.sk_global);
      const KeyRange k =
          generic::bound_to_cache({imax(vis.lo, s.range.begin), imin(vis.hi, s.range.end)}, s.cache);
      m.lo = k.lo;
      m.hi = k.hi;
      if (p.alibi.data) m.slope = load_f32_2d(p.alibi, s.rows.b, pi.h, 0.0f);
    }
    meta[j] = m;
  }
  for (int idx = int(threadIdx.x); idx < S::kRows * S::kDim; idx += S::kThreads) {
    const int j = idx / S::kDim, d = idx % S::kDim;
    float x = 0.0f;
    if (j < nrows) {
      const PackedIdx pi = packed_idx(p, g, g0, j);
      const int64_t q_row = s.rows.q_row(s.rows.row_begin + pi.i, p.batched);
      x = load_as_float(p.q.data, s.rows.qb * p.q.stride[0] + q_row * p.q.stride[1] + pi.h * p.q.stride[2] + d,
                        p.q.dtype);
    }
    q[idx] = x;
  }
  __syncthreads();
  KeyRange u{s.range.end, s.range.begin};
  for (int j = 0; j < nrows; ++j) {
    const RowMeta& m = meta[j];
    if (m.lo >= m.hi) continue;
    u.lo = imin(u.lo, m.lo);
    u.hi = imax(u.hi, m.hi);
  }
  return u;
}

// Where key t0 + lane % 16 of a tile lives, before its offsets: the block-table entry (paged)
// is read a tile ahead of the copies (stream_keys), so this dependent global load never stalls
// a tile's copy issue. state: kTokenSkip (outside [lo, hi): a zero row), kTokenBad (column past
// max_blocks) or kTokenValid (d0, d1 still to be bounds-checked by tile_loc).
struct TileKey {
  int64_t d0;  // cache block (paged: the raw table entry) or row
  int64_t d1;  // slot in the block or token in the row
  int32_t state;
};

// a / b and a % b for 0 <= a, 1 <= b, in 32 bits when both fit (the usual case).
FS_DEV void div_mod(int64_t a, int64_t b, int64_t& q, int64_t& r) {
  if (((a | b) >> 31) == 0) {
    const uint32_t q32 = uint32_t(a) / uint32_t(b);
    q = q32;
    r = uint32_t(a) - q32 * uint32_t(b);
  } else {
    q = a / b;
    r = a - q * b;
  }
}

FS_DEV TileKey tile_key(const AttnParams& p, const SeqKv& kv, int64_t t0, int64_t lo, int64_t hi, int lane) {
  const int64_t key = t0 + lane % kTile;
  TileKey k{0, 0, kTokenSkip};
  if (key < lo || key >= hi) return k;
  k.state = kTokenValid;
  if (!p.paged) {
    k.d0 = kv.kb;
    k.d1 = kv.k_begin + key;
    return k;
  }
  int64_t col;
  div_mod(key, p.kv_dim1, col, k.d1);
  if (col >= p.max_blocks) k.state = kTokenBad;
  else k.d0 = load_index2(p.block_table, kv.b, col);
  return k;
}

// The token's K/V element offsets (as load.cuh's locate_token; the decode kernel serves no int8
// scales, so k_scale stays unused): keys outside the cache are bad, never read.
FS_DEV TokenLoc tile_loc(const AttnParams& p, const SeqKv& kv, const TileKey& k) {
  TokenLoc L{0, 0, 0.0f, k.state};
  if (k.state != kTokenValid) return L;
  if (k.d0 < 0 || k.d0 >= p.kv_dim0 || k.d1 < 0 || k.d1 >= p.kv_dim1) {
    L.state = kTokenBad;
    return L;
  }
  L.k_off = k.d0 * p.k.stride[0] + k.d1 * p.k.stride[1] + kv.g * p.k.stride[2];
  L.v_off = k.d0 * p.v.stride[0] + k.d1 * p.v.stride[1] + kv.g * p.v.stride[2];
  return L;
}

// Issues the copies of a tile's 16 keys (located by `key`, this lane's key of the tile: lanes
// t and t + 16 hold the same) into stage st; skipped and bad keys become zero rows.
template <class S>
FS_DEV void issue_tile(const AttnParams& p, const SeqKv& kv, const Stage<S>& st, const TileKey& key, int lane) {
  const TokenLoc L = tile_loc(p, kv, key);
  if (lane < kTile) st.loc[lane] = L;
  __syncwarp();
  const char* kg = static_cast<const char*>(p.k.data);
  const char* vg = static_cast<const char*>(p.v.data);
  constexpr int kRowsPerStep = 32 / S::kChunks;
  const int c = lane % S::kChunks;
#pragma unroll 4
  for (int r = lane / S::kChunks; r < kTile; r += kRowsPerStep) {
    const TokenLoc& R = st.loc[r];
    unsigned char* dk = st.k + r * S::kKStride + c * kDecodeChunk;
    unsigned char* dv = st.v + r * S::kVStride + c * kDecodeChunk;
    if (R.state == kTokenValid) {
      cp_async16(dk, kg + R.k_off * S::kVb + c * kDecodeChunk);
      cp_async16(dv, vg + R.v_off * S::kVb + c * kDecodeChunk);
    } else {
      *reinterpret_cast<uint4*>(dk) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(dv) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Per-warp running state of the row group: online softmax and output channels
// [lane * kChan, (lane + 1) * kChan) of every row.
template <class S>
struct WarpAcc {
  RowState st[S::kRows];
  float acc[S::kRows][S::kChan];
  FS_DEV WarpAcc() {
#pragma unroll
    for (int j = 0; j < S::kRows; ++j)
#pragma unroll
      for (int k = 0; k < S::kChan; ++k) acc[j][k] = 0.0f;
  }
};

// q.k of key lane % 16 for every active row (rows in fours; q broadcast from shared memory):
// lane t sums K chunks [0, C/2), lane t + 16 chunks [C/2, C), one shuffle adds the halves
// (both lanes hold the score). A quarter warp reads 8 rows at the padded stride: no conflicts.
template <DType kKv, class S>
FS_DEV void tile_dots(const Stage<S>& st, const float* q, int nrows, int lane, float (&dots)[S::kRows]) {
#pragma unroll
  for (int j = 0; j < S::kRows; ++j) dots[j] = 0.0f;
  const int c0 = lane / kTile * S::kHalfChunks;
  const unsigned char* krow = st.k + (lane % kTile) * S::kKStride;
#pragma unroll 2
  for (int c = c0; c < c0 + S::kHalfChunks; ++c) {
    float kf[S::kElems];
    smem_to_float<kKv, S::kElems>(krow + c * kDecodeChunk, kf);
#pragma unroll
    for (int j4 = 0; j4 < S::kRows; j4 += 4) {
      if (j4 >= nrows) break;
#pragma unroll
      for (int j = j4; j < j4 + 4; ++j) {
        const float4* qj = reinterpret_cast<const float4*>(q + j * S::kDim + c * S::kElems);
#pragma unroll
        for (int e = 0; e < S::kElems / 4; ++e) {
          const float4 q4 = qj[e];
          dots[j] = fmaf(q4.x, kf[4 * e + 0], dots[j]);
          dots[j] = fmaf(q4.y, kf[4 * e + 1], dots[j]);
          dots[j] = fmaf(q4.z, kf[4 * e + 2], dots[j]);
          dots[j] = fmaf(q4.w, kf[4 * e + 3], dots[j]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < S::kRows; ++j) {
    if (j >= nrows) break;
    dots[j] += __shfl_xor_sync(kFullMask, dots[j], kTile);
  }
}

// Sum and max over the 16 keys of a tile (lanes t and t + 16 hold the same value).
FS_DEV float tile_sum(float x) {
#pragma unroll
  for (int o = kTile / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}
FS_DEV float tile_max_nan(float x) {
#pragma unroll
  for (int o = kTile / 2; o > 0; o >>= 1) x = nan_max(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// Online softmax of rows [j4, j4 + 4) over the tile (p into pbuf [kRows, 16]), in phases so the
// four rows' shuffle reductions interleave. A row that sees none of the tile's keys scores
// -inf everywhere: its max and sum leave its state and accumulator unchanged.
template <class S>
FS_DEV void tile_softmax4(const AttnParams& p, const RowMeta* meta, float* pbuf, int j4, int64_t key, bool bad,
                          float k_desc, int lane, const float (&dots)[S::kRows], WarpAcc<S>& w) {
  const ScoreTransform score = make_score_transform(p);
  float x[4], mx[4], pe[4], alpha[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const RowMeta& m = meta[j4 + i];
    const bool vis = key >= m.lo && key < m.hi;
    x[i] = !vis ? kNegInf : bad ? nan_value() : score(dots[j4 + i] * k_desc, m.pos, key, m.slope);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) mx[i] = tile_max_nan(x[i]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float new_m;
    const bool some = w.st[j4 + i].rescale(mx[i], new_m, alpha[i]);
    pe[i] = some && x[i] != kNegInf ? expf(x[i] - new_m) : 0.0f;
    mx[i] = some ? new_m : kNegInf;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float sum = tile_sum(pe[i]);
    if (mx[i] != kNegInf) {
      w.st[j4 + i].update(mx[i], alpha[i], sum);
      if (alpha[i] != 1.0f) {
#pragma unroll
        for (int k = 0; k < S::kChan; ++k) w.acc[j4 + i][k] *= alpha[i];
      }
    }
    if (lane < kTile) pbuf[(j4 + i) * kTile + lane] = pe[i];
  }
}

// One tile of the warp: scores, online softmax (p into pbuf [kRows, 16]) and p.v.
template <DType kKv, class S>
FS_DEV void consume_tile(const AttnParams& p, const Stage<S>& st, const float* q, const RowMeta* meta, float* pbuf,
                         int nrows, int64_t t0, int64_t lo, int64_t hi, float k_desc, int lane, WarpAcc<S>& w) {
  float dots[S::kRows];
  tile_dots<kKv, S>(st, q, nrows, lane, dots);
  const int64_t key = t0 + lane % kTile;
  const bool bad = st.loc[lane % kTile].state == kTokenBad;
#pragma unroll
  for (int j4 = 0; j4 < S::kRows; j4 += 4) {
    if (j4 >= nrows) break;
    tile_softmax4<S>(p, meta, pbuf, j4, key, bad, k_desc, lane, dots, w);
  }
  __syncwarp();
  const int ta = int(imax(lo, t0) - t0), te = int(imin(hi, t0 + kTile) - t0);
  const unsigned char* vcol = st.v + lane * S::kChan * S::kVb;
#pragma unroll 2
  for (int t = ta; t < te; ++t) {
    float vf[S::kChan];
    smem_to_float<kKv, S::kChan>(vcol + t * S::kVStride, vf);
#pragma unroll
    for (int j = 0; j < S::kRows; ++j) {
      if (j >= nrows) break;
      const float pj = pbuf[j * kTile + t];
#pragma unroll
      for (int k = 0; k < S::kChan; ++k) w.acc[j][k] = fmaf(pj, vf[k], w.acc[j][k]);
    }
  }
}

// The warp's tiles w, w + W, ... of keys [u.lo, u.hi) (tiles aligned to the split's start, as
// the CPU reference), through a kStages-deep ring of cp.async groups; the block-table entries
// of the tile after the one being issued wait in registers (`ahead`).
template <DType kKv, class S>
FS_DEV void stream_keys(const AttnParams& p, const DecodeSeq& s, unsigned char* warp_base, const float* q,
                        const RowMeta* meta, int nrows, KeyRange u, WarpAcc<S>& w) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float* pbuf = reinterpret_cast<float*>(warp_base + kStages * S::kStageBytes);
  const int64_t base = s.range.begin + (u.lo - s.range.begin) / kTile * kTile;
  const int64_t tiles = (u.hi - base + kTile - 1) / kTile;
  const int64_t mine = tiles > warp ? (tiles - warp + S::kWarps - 1) / S::kWarps : 0;
  auto tile_start = [&](int64_t k) { return base + (warp + k * S::kWarps) * kTile; };
  TileKey ahead = tile_key(p, s.kv, tile_start(0), u.lo, u.hi, lane);  // tile 0 (skipped if past u.hi)
  auto issue = [&](int64_t k) {  // tile k (its key is `ahead`), then read tile k + 1's entries
    issue_tile<S>(p, s.kv, Stage<S>(warp_base, int(k % kStages)), ahead, lane);
    if (k + 1 < mine) ahead = tile_key(p, s.kv, tile_start(k + 1), u.lo, u.hi, lane);
  };
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    if (k < mine) issue(k);
    cp_async_commit();
  }
  for (int64_t k = 0; k < mine; ++k) {
    if (k + kStages - 1 < mine) issue(k + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();
    consume_tile<kKv, S>(p, Stage<S>(warp_base, int(k % kStages)), q, meta, pbuf, nrows, tile_start(k), u.lo, u.hi,
                         s.kv.k_desc, lane, w);
    __syncwarp();  // the stage and pbuf are free for the next issue
  }
  cp_async_wait<0>();
}

// Merges the warps' states of each row (shared memory, reusing the warps' area) and writes
// out and LSE (num_splits == 1, the sink merged once) or the split partials.
template <class S>
FS_DEV void merge_and_store(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, int split,
                            unsigned char* warps_base, const WarpAcc<S>& w) {
  constexpr int kD = S::kDim;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float* mo = reinterpret_cast<float*>(warps_base);     // [kWarps, kRows, kD]
  float* ms = mo + S::kWarps * S::kRows * kD;           // [kWarps, kRows, 2]
  __syncthreads();  // every warp is done with its ring
#pragma unroll
  for (int j = 0; j < S::kRows; ++j) {
    if (j >= nrows) break;
#pragma unroll
    for (int k = 0; k < S::kChan; ++k) mo[(warp * S::kRows + j) * kD + lane * S::kChan + k] = w.acc[j][k];
    if (lane == 0) {
      ms[(warp * S::kRows + j) * 2] = w.st[j].m;
      ms[(warp * S::kRows + j) * 2 + 1] = w.st[j].l;
    }
  }
  __syncthreads();
  for (int j = warp; j < nrows; j += S::kWarps) {
    RowState st;
    for (int v = 0; v < S::kWarps; ++v) st.m = nan_max(st.m, ms[(v * S::kRows + j) * 2]);
    float o[S::kChan];
#pragma unroll
    for (int k = 0; k < S::kChan; ++k) o[k] = 0.0f;
    for (int v = 0; v < S::kWarps; ++v) {
      const float mv = ms[(v * S::kRows + j) * 2];
      if (mv == kNegInf) continue;  // an empty warp state adds nothing
      const float wt = expf(mv - st.m);
      st.l += ms[(v * S::kRows + j) * 2 + 1] * wt;
#pragma unroll
      for (int k = 0; k < S::kChan; ++k) o[k] += mo[(v * S::kRows + j) * kD + lane * S::kChan + k] * wt;
    }
    const PackedIdx pi = packed_idx(p, g, g0, j);
    const int64_t r = s.rows.row_begin + pi.i, q_row = s.rows.q_row(r, p.batched);
    float lse = st.lse();
    const float scale = st.empty() ? 0.0f : s.kv.v_desc / st.l;
    if (p.num_splits > 1) {
      const int64_t at = partial_index(p, split, r, pi.h);
#pragma unroll
      for (int k = 0; k < S::kChan; ++k) p.o_partial[at * kD + lane * S::kChan + k] = o[k] * scale;
      if (lane == 0) p.lse_partial[at] = lse;
      continue;
    }
    const float ws = apply_sink(p, pi.h, lse);
#pragma unroll
    for (int k = 0; k < S::kChan; ++k) store_out(p, s.rows.qb, q_row, pi.h, lane * S::kChan + k, o[k] * scale * ws);
    if (lane == 0) store_lse(p, s.rows.qb, q_row, pi.h, lse);
  }
}

// kRows <= 8: two CTAs per SM by shared memory (decode_config.hpp), so at most 255 registers.
template <DType kKv, int kD, int kRows>
__global__ void __launch_bounds__(32 * decode_warps(kD), kRows <= 8 ? 2 : 1)
    decode_fwd(const __grid_constant__ AttnParams p) {
  using S = Shape<kKv, kD, kRows>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* q = reinterpret_cast<float*>(smem_raw);                      // [kRows, kD]
  RowMeta* meta = reinterpret_cast<RowMeta*>(q + S::kRows * kD);     // [kRows]
  unsigned char* warps_base = reinterpret_cast<unsigned char*>(meta + S::kRows);
  unsigned char* warp_base = warps_base + size_t(threadIdx.x / 32) * S::kWarpBytes;
  const int64_t g = blockIdx.y;
  const int split = int(blockIdx.z);
  const DecodeSeq s = decode_sequence(p, blockIdx.x, g, split);
  const int64_t packed = s.rows.sq() * p.group;
  for (int64_t g0 = 0; g0 < packed; g0 += S::kRows) {
    const int nrows = int(imin(S::kRows, packed - g0));
    __syncthreads();  // the previous row group is done with shared memory
    const KeyRange u = setup_rows<S>(p, s, g, g0, nrows, q, meta);
    WarpAcc<S> w;
    if (u.lo < u.hi) stream_keys<kKv, S>(p, s, warp_base, q, meta, nrows, u, w);
    merge_and_store<S>(p, s, g, g0, nrows, split, warps_base, w);
  }
}

}  // namespace flashserve::kernels::decode
