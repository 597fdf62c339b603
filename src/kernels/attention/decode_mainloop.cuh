// The decode kernel's body (included by decode_fwd.cuh, which documents the scheme): row-group
// setup, the per-warp cp.async key stream, the cross-warp merge and the epilogue.
#pragma once

#include <type_traits>

#include "kernels/attention/cluster_merge.cuh"
#include "kernels/attention/decode_mma.cuh"

namespace flashserve::kernels::decode {

// Packed row j of the group starting at packed index g0: query row i = (g0 + j) / group,
// head g * group + (g0 + j) % group.
struct PackedIdx {
  int64_t i, h;
};
FS_DEV PackedIdx packed_idx(const AttnParams& p, int64_t g, int64_t g0, int j) {
  return {(g0 + j) / p.group, g * p.group + (g0 + j) % p.group};
}

// Packed row j's aligned global position and its visible local keys within the split's range,
// bounded to the cache.
FS_DEV int64_t row_pos(const AttnParams& p, const DecodeSeq& s, int64_t g0, int j) {
  return (g0 + j) / p.group + s.sk_global - s.rows.sq();
}
FS_DEV KeyRange row_keys(const AttnParams& p, const DecodeSeq& s, int64_t pos) {
  const KeyRange vis = make_visibility(p)(pos, s.sk_global);
  return generic::bound_to_cache({imax(vis.lo, s.range.begin), imin(vis.hi, s.range.end)}, s.cache);
}

// The union of the keys of rows [0, nrows) of the group at g0, as rows_key_union over their
// RowMeta, computed without it: every thread, before q is staged. The packed rows of one query
// row share its keys, so the union runs over the query rows the group spans (one for a
// single-token decode, where it ran 64 times at the MLA kernels' 64 rows).
FS_DEV KeyRange group_key_union(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows) {
  if (nrows <= 0) return KeyRange{s.range.end, s.range.begin};
  const int64_t i0 = g0 / p.group, i1 = (g0 + nrows - 1) / p.group;
  return key_union(int(i1 - i0 + 1), s.range,
                   [&](int di) { return row_keys(p, s, i0 + di + s.sk_global - s.rows.sq()); });
}

// Packed row j's metadata (inactive when j >= nrows; qk_scale 1).
FS_DEV RowMeta row_meta(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, int j) {
  RowMeta m{0, 0, 0, 0.0f, 0, 1.0f};
  if (j >= nrows) return m;
  const PackedIdx pi = packed_idx(p, g, g0, j);
  m.active = 1;
  m.pos = row_pos(p, s, g0, j);
  const KeyRange k = row_keys(p, s, m.pos);
  m.lo = k.lo;
  m.hi = k.hi;
  if (p.alibi.data) m.slope = load_f32_2d(p.alibi, s.rows.b, pi.h, 0.0f);
  return m;
}

// Packed row pi's row in q's second dimension (and in q_scale's, out's).
FS_DEV int64_t packed_q_row(const AttnParams& p, const DecodeSeq& s, const PackedIdx& pi) {
  return s.rows.q_row(s.rows.row_begin + pi.i, p.batched);
}

// Element offset of packed row j's q (its channel 0).
FS_DEV int64_t q_offset(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int j) {
  const PackedIdx pi = packed_idx(p, g, g0, j);
  return s.rows.qb * p.q.stride[0] + packed_q_row(p, s, pi) * p.q.stride[1] + pi.h * p.q.stride[2];
}

// Element d of packed row j's q as float (0 past nrows).
FS_DEV float q_elem(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, int j, int d) {
  if (j >= nrows) return 0.0f;
  return load_as_float(p.q.data, q_offset(p, s, g, g0, j) + d, p.q.dtype);
}

// Eight consecutive elements of q from a 16-byte (16-bit q) or 8-byte (fp8, int8 q) chunk as
// floats (exact).
FS_DEV void q_chunk_floats(uint4 raw, DType t, float (&x)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t h = w[e / 2] >> (16 * (e % 2)), b = w[e / 4] >> (8 * (e % 4));
    if (t == DType::bf16) x[e] = __uint_as_float(h << 16);
    else if (t == DType::f16) x[e] = __half2float(__ushort_as_half(uint16_t(h)));
    else if (t == DType::i8) x[e] = float(int8_t(uint8_t(b)));
    else x[e] = fp8_to_float(uint8_t(b), t == DType::f8e4m3 ? __NV_E4M3 : __NV_E5M2);
  }
}

// The row group's q as 8-element chunks, for the 8-bit K stagings (which reorder channels): each
// row read by D/8 lanes, eight consecutive channels [8c, 8c + 8) each (one 16-byte load of 16-bit
// q, one 8-byte load of 8-bit q; element-wise where q's base or strides are not multiples of
// eight elements), 32 / (D/8) rows of a warp per pass, every load of the lane issued before any
// is used (the row's offset computed once per row).
template <class S>
struct QChunks {
  static constexpr int kLanesPerRow = S::kDim / 8, kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kPasses = S::kRows / (S::kWarps * kRowsPerPass);
  static_assert(32 % kLanesPerRow == 0 && kPasses * S::kWarps * kRowsPerPass == S::kRows, "whole rows per pass");
  int warp, c;  // the lane's warp and chunk
  bool vec;
  uint4 raw[kPasses];

  FS_DEV QChunks(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, int lane)
      : warp(int(threadIdx.x) / 32), c(lane % kLanesPerRow) {
    const int esize = kv_bytes(p.q.dtype);
    vec = reinterpret_cast<uintptr_t>(p.q.data) % (8 * esize) == 0 &&
          (p.q.stride[0] | p.q.stride[1] | p.q.stride[2]) % 8 == 0;
    const char* qg = static_cast<const char*>(p.q.data);
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      raw[i] = make_uint4(0u, 0u, 0u, 0u);
      const int j = row(i, lane);
      if (j >= nrows || !vec) continue;
      const char* at = qg + (q_offset(p, s, g, g0, j) + 8 * c) * esize;
      if (esize == 1) {
        const uint2 v = *reinterpret_cast<const uint2*>(at);
        raw[i].x = v.x;
        raw[i].y = v.y;
      } else {
        raw[i] = *reinterpret_cast<const uint4*>(at);
      }
    }
  }
  // The lane's row in pass i.
  FS_DEV int row(int i, int lane) const { return warp + (i * kRowsPerPass + lane / kLanesPerRow) * S::kWarps; }
  // f(i, j) for pass i = c and its row j, where c < kPasses: every row of the warp's passes once,
  // side by side in one SIMT pass (the row metadata: ~150 instructions of 64-bit index math,
  // which one lane per row group ran once per pass).
  template <class F>
  FS_DEV void per_row(int lane, F&& f) const {
    if (c < kPasses) f(c, row(c, lane));
  }
  // Pass i's chunk as floats (row j active).
  FS_DEV void floats(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int i, int j,
                     float (&x)[8]) const {
    if (vec) {
      q_chunk_floats(raw[i], p.q.dtype, x);
      return;
    }
    const int64_t off = q_offset(p, s, g, g0, j) + 8 * c;
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = load_as_float(p.q.data, off + e, p.q.dtype);
  }
};

// fp8 K/V: the row group's q as f16 in the channel order of decode_mma.cuh (fp8_q_column), read
// as QChunks. f16 and fp8 q convert exactly; a bf16 row is first multiplied by 2^e (e such that
// its largest |q| lands in [2^15, 2^16), which f16 holds with bf16's 8 significant bits: exact for
// every element down to 2^-32 of the row's largest, which keeps 2^-40 of it), and 2^-e joins the
// row's qk_scale with the descales. A lane's eight channels land as four f16 pairs (fp8_q_column
// maps channels 8c + {0, 1}, {2, 3}, ... to adjacent columns).
template <class S>
FS_DEV void stage_rows_fp8(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows,
                           unsigned char* q, RowMeta* meta) {
  const int lane = int(threadIdx.x) % 32;
  const DType qt = p.q.dtype;
  const float desc = s.kv.k_desc * (is_fp8(qt) ? load_f32_2d(p.q_descale, s.rows.b, g, 1.0f) : 1.0f);
  using Q = QChunks<S>;
  const Q ch(p, s, g, g0, nrows, lane);
  int shifts[Q::kPasses];  // pass i's row scale 2^shift (the same in every lane of its row group)
#pragma unroll
  for (int i = 0; i < Q::kPasses; ++i) {
    const int j = ch.row(i, lane);
    const bool act = j < nrows;  // an inactive row's q is left as it is (stale_rows_ok); its lanes
                                 // still take part in the row maxima's shuffles (whole warp)
    float x[8] = {};
    if (act) ch.floats(p, s, g, g0, i, j, x);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(x[e]));
    int shift = 0;
    if (qt == DType::bf16) {
#pragma unroll
      for (int o = Q::kLanesPerRow / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
      if (amax > 0.0f && amax < INFINITY) {
        const int e = int((__float_as_uint(amax) >> 23) & 0xffu) - 127;  // subnormal: -127 (clamped below)
        shift = int(imin(imax(15 - e, -126), 126));
      }
    }
    const float up = ldexpf(1.0f, shift);
    if (act) {
      __half* row = reinterpret_cast<__half*>(q + j * S::kQStride);
#pragma unroll
      for (int e = 0; e < 8; e += 2) {  // exact (see above); channel 8c + e + 1 lands at col + 1
        const int col = fp8_q_column<S>(8 * ch.c + e);
        *reinterpret_cast<__half2*>(row + col) = __floats2half2_rn(x[e] * up, x[e + 1] * up);
      }
    }
    shifts[i] = shift;
  }
  ch.per_row(lane, [&](int i, int j) {
    RowMeta m = row_meta(p, s, g, g0, nrows, j);
    int shift = shifts[0];
#pragma unroll
    for (int k = 1; k < Q::kPasses; ++k) shift = i == k ? shifts[k] : shift;  // pass i's, without local memory
    if (j < nrows) m.qk_scale = desc * ldexpf(1.0f, -shift);
    meta[j] = m;
  });
}

// int8 q and K: the row group's int8 q in the channel order of decode_mma.cuh (int8_q_column),
// read as QChunks; a lane's eight channels land as two 4-byte words (int8_q_column maps channels
// 8c + {0..3} and 8c + {4..7} to four adjacent bytes each). The row's q_scale is its qk_scale
// (the k scales are applied per key).
template <class S>
FS_DEV void stage_rows_int8(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows,
                            unsigned char* q, RowMeta* meta) {
  const int lane = int(threadIdx.x) % 32;
  using Q = QChunks<S>;
  const Q ch(p, s, g, g0, nrows, lane);
#pragma unroll
  for (int i = 0; i < Q::kPasses; ++i) {
    const int j = ch.row(i, lane);
    const bool act = j < nrows;  // an inactive row's q is left as it is (stale_rows_ok)
    if (act) {
      uint32_t w[2] = {ch.raw[i].x, ch.raw[i].y};
      if (!ch.vec) {  // element-wise: the values are int8 (exact)
        float x[8];
        ch.floats(p, s, g, g0, i, j, x);
        w[0] = w[1] = 0u;
#pragma unroll
        for (int e = 0; e < 8; ++e) w[e / 4] |= uint32_t(uint8_t(int8_t(x[e]))) << (8 * (e % 4));
      }
      unsigned char* row = q + j * S::kQStride;
      *reinterpret_cast<uint32_t*>(row + int8_q_column<S>(8 * ch.c)) = w[0];
      *reinterpret_cast<uint32_t*>(row + int8_q_column<S>(8 * ch.c + 4)) = w[1];
    }
  }
  ch.per_row(lane, [&](int, int j) {
    RowMeta m = row_meta(p, s, g, g0, nrows, j);
    if (j < nrows) {
      const PackedIdx pi = packed_idx(p, g, g0, j);
      const StridedRef& qs = p.q_scale;
      m.qk_scale = static_cast<const float*>(
          qs.data)[s.rows.qb * qs.stride[0] + packed_q_row(p, s, pi) * qs.stride[1] + pi.h * qs.stride[2]];
    }
    meta[j] = m;
  });
}

// 16-bit q (K/V of its type): 16-byte copies, all of a thread's loads issued before its stores
// (one global round trip for the setup, not one per element); element-wise when q's base or
// strides are not 16-byte multiples.
template <class S>
FS_DEV void stage_rows_16(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows,
                          unsigned char* q, RowMeta* meta) {
  if (int(threadIdx.x) < S::kRows) meta[threadIdx.x] = row_meta(p, s, g, g0, nrows, int(threadIdx.x));
  constexpr int kCh = S::kDim * 2 / kDecodeChunk;  // chunks per row
  constexpr int kPer = S::kRows * kCh / S::kThreads;
  static_assert(S::kRows * kCh % S::kThreads == 0, "whole chunks per thread");
  const bool vec = reinterpret_cast<uintptr_t>(p.q.data) % kDecodeChunk == 0 &&
                   (p.q.stride[0] | p.q.stride[1] | p.q.stride[2]) % (kDecodeChunk / 2) == 0;
  if (vec) {
    uint4 v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = int(threadIdx.x) + i * S::kThreads, j = idx / kCh, c = idx % kCh;
      v[i] = make_uint4(0u, 0u, 0u, 0u);
      if (j < nrows)
        v[i] = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.q.data) + q_offset(p, s, g, g0, j) +
                                               c * (kDecodeChunk / 2));
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = int(threadIdx.x) + i * S::kThreads, j = idx / kCh, c = idx % kCh;
      *reinterpret_cast<uint4*>(q + j * S::kQStride + c * kDecodeChunk) = v[i];
    }
    return;
  }
  for (int idx = int(threadIdx.x); idx < S::kRows * S::kDim; idx += S::kThreads) {
    const int j = idx / S::kDim, d = idx % S::kDim;
    store_from_float(q + j * S::kQStride, d, p.q.dtype, q_elem(p, s, g, g0, nrows, j, d));  // exact: q's own type
  }
}

// Fills meta [kRows] and q [kRows, kD] (q's 16-bit type, f16 for fp8 K/V, int8 for int8 K;
// rows kQStride bytes apart) of the row group. Ends synchronized. stale_rows_ok: the q rows of
// inactive rows (j >= nrows) may hold anything (16-bit: zeros; fp8 and int8 leave them, which
// saves the conversion of 12 of the 16 rows of a GQA-4 decode): an mma output row depends on
// its own q row only, and the softmax gives an inactive row (lo = hi) -inf scores, p = 0,
// before its scores are looked at; its output is never stored.
template <class S>
FS_DEV void setup_rows(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows,
                           unsigned char* q, RowMeta* meta) {
  if constexpr (S::kInt8) {
    stage_rows_int8<S>(p, s, g, g0, nrows, q, meta);
  } else if constexpr (S::kKb == 1) {
    stage_rows_fp8<S>(p, s, g, g0, nrows, q, meta);
  } else {
    stage_rows_16<S>(p, s, g, g0, nrows, q, meta);
  }
  __syncthreads();
}

// Where key t0 + lane % 16 of a tile lives, before its offsets: the block-table entry (paged)
// is read a tile ahead of the copies (stream_keys), so this dependent global load never stalls
// a tile's copy issue. state: kTokenSkip (outside [lo, hi): a zero row), kTokenBad (column past
// max_blocks) or kTokenValid (d0, d1 still to be bounds-checked by tile_loc).
struct TileKey {
  int64_t d1;     // slot in the block or token in the row
  int32_t d0;     // cache block (paged: the raw table entry) or row; int32 until tile_loc widens
                  // it, a tile later (widened at the load, the next instruction waited for the
                  // read: 27% of the bf16 decode's stall samples on the H200)
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

template <int kTileKeys>
FS_DEV TileKey tile_key(const AttnParams& p, const SeqKv& kv, int64_t t0, int64_t lo, int64_t hi, int lane) {
  const int64_t key = t0 + lane % kTileKeys;
  TileKey k{0, 0, kTokenSkip};
  if (key < lo || key >= hi) return k;
  k.state = kTokenValid;
  if (!p.paged) {
    k.d0 = int32_t(kv.kb);  // a batch index or cache_batch_idx entry (int32)
    k.d1 = kv.k_begin + key;
    return k;
  }
  int64_t col;
  div_mod(key, p.kv_dim1, col, k.d1);
  if (col >= p.max_blocks) k.state = kTokenBad;
  else k.d0 = load_index2_deferred(p.block_table, kv.b, col);
  return k;
}

// The token's K/V element offsets (as load.cuh's locate_token; k_scale stays unused: int8 k
// scales are copied by issue_tile from the key's d0/d1): keys outside the cache are bad, never read.
FS_DEV TokenLoc tile_loc(const AttnParams& p, const SeqKv& kv, const TileKey& k) {
  TokenLoc L{0, 0, 0.0f, k.state};
  if (k.state != kTokenValid) return L;
  const int64_t d0 = k.d0;
  if (d0 < 0 || d0 >= p.kv_dim0 || k.d1 < 0 || k.d1 >= p.kv_dim1) {
    L.state = kTokenBad;
    return L;
  }
  L.k_off = d0 * p.k.stride[0] + k.d1 * p.k.stride[1] + kv.g * p.k.stride[2];
  L.v_off = d0 * p.v.stride[0] + k.d1 * p.v.stride[1] + kv.g * p.v.stride[2];
  return L;
}

// A warp's ring in the TMA form: its stages' full barriers (`bars`: stage i's at bars + 8 i,
// 32 arrivals a phase), the parity each waits for next (bit i) and the stages whose last fill was
// cp.async (bit i), kept across row groups (warp-uniform).
struct WarpRing {
  const CUtensorMap* maps;  // K's and V's tensor maps (the TMA form), else null
  uint32_t bars;
  uint32_t phases;
  uint32_t cp_filled;
  FS_DEV uint32_t full(int stage) const { return bars + 8u * uint32_t(stage); }
};

// The TMA form (decode_config.hpp: decode_tma_tiling): loads the tile by TMA when every key of it
// is valid (inside every bound; tile_loc) and each 16 of its rows are one box: contiguous rows,
// or paged rows from a 16-aligned row of a page (the launch's block size a multiple of 16:
// launchers.hpp's decode_tma_form), segment s's block id and row those of lane 16 s's key;
// returns whether it did (warp-uniform). Lane i < 2 x kSegs x kBlocks issues box i (operand
// i / (kSegs kBlocks): K, then V; segment; 128-byte column block); lane 0 expects the tile's
// bytes on `full` and the other lanes arrive (the phase cannot complete before lane 0's arrival).
template <class S>
FS_DEV bool issue_tma(const AttnParams& p, WarpRing& ring, const SeqKv& kv, const Stage<S>& st, int stage,
                      const TokenLoc& L, const TileKey& key, int lane) {
  constexpr int kBlocks = S::kDim * S::kKb / 128, kSegs = S::kTile / 16, kBoxes = 2 * kSegs * kBlocks;
  static_assert(kBoxes <= 32, "a box per lane");
  const int seg = (lane / kBlocks) % kSegs;
  const int row = __shfl_sync(kFullMask, int(key.d1), 16 * seg), blk = __shfl_sync(kFullMask, key.d0, 16 * seg);
  if (!__all_sync(kFullMask, L.state == kTokenValid && (!p.paged || (row & 15) == 0))) return false;
  const uint32_t full = ring.full(stage);
  if (ring.cp_filled >> stage & 1u) {  // the stage's last fill was cp.async: its writes before the boxes'
    fence_proxy_async_shared();
    __syncwarp();
    ring.cp_filled &= ~(1u << stage);
  }
  if (lane == 0) {
    *st.bad = 0u;
    mbar_arrive_expect_tx(full, uint32_t(S::kStageBytes));  // K and V
  } else {
    mbar_arrive(full);
  }
  if (lane < kBoxes) {
    const int v = lane / (kSegs * kBlocks), c = lane % kBlocks;
    tma_load_4d(smem_u32(v ? st.v : st.k) + uint32_t(c) * S::Swz::kBlockBytes + uint32_t(seg * 16 * 128),
                ring.maps + v, full, c * (128 / S::kKb), int(kv.g), row, blk);
  }
  return true;
}

// Issues the copies of a tile's 16 keys (located by `key`, this lane's key of the tile: lanes
// t and t + 16 hold the same) into stage st, whole rows per copy step (coalesced); skipped and
// bad keys become zero rows. The locations pass through the warp's scratch `loc` [16]; the
// stage's bad mask gets bit k set when key k is bad. The TMA form: by TMA where issue_tma can,
// else the copies as here, each lane arriving on the stage's `full` once its copies completed.
template <class S>
FS_DEV void issue_tile(const AttnParams& p, WarpRing& ring, const SeqKv& kv, const Stage<S>& st, int stage,
                       TokenLoc* loc, const TileKey& key, int lane) {
  const TokenLoc L = tile_loc(p, kv, key);
  if constexpr (S::kTma) {
    if (issue_tma<S>(p, ring, kv, st, stage, L, key, lane)) return;
    ring.cp_filled |= 1u << stage;
  }
  const uint32_t bad = __ballot_sync(kFullMask, lane < S::kTile && L.state == kTokenBad);
  if (lane == 0) *st.bad = bad;
  if (lane < S::kTile) loc[lane] = L;
  if constexpr (S::kInt8) {  // the keys' scales, 4-byte copies (zeros for keys not loaded)
    if (lane < S::kTile) {
      const StridedRef& ks = p.k_scale_cache;
      const bool ok = L.state == kTokenValid;
      const int64_t off = ok ? int64_t(key.d0) * ks.stride[0] + key.d1 * ks.stride[1] + kv.g * ks.stride[2] : 0;
      cp_async_4(smem_u32(st.kscale + lane), static_cast<const float*>(ks.data) + off, ok);
    }
  }
  __syncwarp();
  const char* kg = static_cast<const char*>(p.k.data);
  const char* vg = static_cast<const char*>(p.v.data);
  // 8-bit K: chunk c of row r lands at c ^ (r & 1) (decode_config.hpp); r & 1 is the same for all
  // of the lane's rows (an even number of rows per copy step).
  constexpr int kRowsPerStep = 32 / S::kChunks, kVRowsPerStep = 32 / S::kVChunks;
  static_assert(S::kKb != 1 || kRowsPerStep % 2 == 0, "8-bit K swizzle: one row parity per lane");
  const int c = lane % S::kChunks;
  const int ck = S::kKb == 1 ? c ^ ((lane / S::kChunks) & 1) : c;
  // Destinations: row r's chunk at dk + r x kKStride (dv, kVStride), the TMA form's swizzled.
  const uint32_t dk = smem_u32(st.k + (S::kTma ? 0 : ck * kDecodeChunk));
  auto k_dst = [&](int r) { return S::kTma ? dk + S::Swz::at(r, c) : dk + uint32_t(r * S::kKStride); };
  if constexpr (S::kChunks == S::kVChunks) {  // K and V rows of one width: one pass
    const uint32_t dv = smem_u32(st.v + (S::kTma ? 0 : c * kDecodeChunk));
    auto v_dst = [&](int r) { return S::kTma ? dv + S::Swz::at(r, c) : dv + uint32_t(r * S::kVStride); };
    // Every row's location first: ptxas keeps a shared-memory read after an earlier cp.async (it
    // may alias the copy's destination), so read one by one they made each step wait for its read.
    constexpr int kSteps = S::kTile / kRowsPerStep;
    TokenLoc R[kSteps];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) R[i] = loc[lane / S::kChunks + i * kRowsPerStep];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = lane / S::kChunks + i * kRowsPerStep;
      const bool ok = R[i].state == kTokenValid;  // else 16 zero bytes (offsets 0: an in-bounds address)
      cp_async_16(k_dst(r), kg + R[i].k_off * S::kKb + c * kDecodeChunk, ok);
      cp_async_16(v_dst(r), vg + R[i].v_off * S::kVb + c * kDecodeChunk, ok);
    }
  } else {  // K8V16: K rows half V's width
#pragma unroll
    for (int i = 0; i < S::kTile / kRowsPerStep; ++i) {
      const int r = lane / S::kChunks + i * kRowsPerStep;
      const TokenLoc R = loc[r];
      cp_async_16(k_dst(r), kg + R.k_off * S::kKb + c * kDecodeChunk, R.state == kTokenValid);
    }
    const int cv = lane % S::kVChunks;
    const uint32_t dv = smem_u32(st.v + cv * kDecodeChunk);  // (no TMA form: 8-bit K)
#pragma unroll
    for (int i = 0; i < S::kTile / kVRowsPerStep; ++i) {
      const int r = lane / S::kVChunks + i * kVRowsPerStep;
      const TokenLoc R = loc[r];
      cp_async_16(dv + r * S::kVStride, vg + R.v_off * S::kVb + cv * kDecodeChunk, R.state == kTokenValid);
    }
  }
  if constexpr (S::kTma) cp_async_mbar_arrive_noinc(ring.full(stage));
  __syncwarp();  // loc is rewritten by the next issue
}

// The warp's tiles w, w + W, ... of keys [u.lo, u.hi) (tiles aligned to the split's start, as
// the CPU reference), through an S::kStages-deep ring of cp.async groups (the TMA form: of
// stages completing full barriers, `ring`). The first
// kStages - 1 tiles are issued before anything else (their block-table entries read together),
// then setup() runs (the row group's q and meta: a global round trip that overlaps the copies;
// H200: 1-4% faster at B=64..256) and returns the consumer. The block-table entries of the tile
// after the one being issued wait in registers (`ahead`). consume(c, stage, t0) takes each tile
// once its copies have landed; the consumer is returned.
template <class S, class Setup, class Consume>
FS_DEV auto stream_keys(const AttnParams& p, const DecodeSeq& s, unsigned char* warp_base, WarpRing& ring, KeyRange u,
                        Setup&& setup, Consume&& consume) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  constexpr int kTile = S::kTile, kAhead = S::kStages - 1;
  TokenLoc* loc = reinterpret_cast<TokenLoc*>(warp_base + S::kLocOffset);
  const int64_t base = s.range.begin + (u.lo - s.range.begin) / kTile * kTile;
  const int64_t tiles = u.lo < u.hi ? (u.hi - base + kTile - 1) / kTile : 0;
  const int64_t mine = tiles > warp ? (tiles - warp + S::kWarps - 1) / S::kWarps : 0;
  auto tile_start = [&](int64_t k) { return base + (warp + k * S::kWarps) * kTile; };
  int issue_stage = 0, consume_stage = 0;  // ring positions of the next issue / consume
  auto issue_key = [&](const TileKey& key) {
    issue_tile<S>(p, ring, s.kv, Stage<S>(warp_base, issue_stage), issue_stage, loc, key, lane);
    issue_stage = issue_stage + 1 == S::kStages ? 0 : issue_stage + 1;
  };
  TileKey first[kAhead];  // the prologue's tiles (skipped past u.hi)
#pragma unroll
  for (int k = 0; k < kAhead; ++k) first[k] = tile_key<kTile>(p, s.kv, tile_start(k), u.lo, u.hi, lane);
#pragma unroll
  for (int k = 0; k < kAhead; ++k) {
    if (k < mine) issue_key(first[k]);
    if constexpr (!S::kTma) cp_async_commit();
  }
  TileKey ahead = tile_key<kTile>(p, s.kv, tile_start(kAhead), u.lo, u.hi, lane);
  auto c = setup();
  for (int64_t k = 0; k < mine; ++k) {
    if (k + kAhead < mine) {  // tile k + kAhead (its key is `ahead`), then read the next one's entries
      issue_key(ahead);
      if (k + kAhead + 1 < mine) ahead = tile_key<kTile>(p, s.kv, tile_start(k + kAhead + 1), u.lo, u.hi, lane);
    }
    if constexpr (S::kTma) {  // tile k's phase of its stage's barrier
      mbar_wait(ring.full(consume_stage), (ring.phases >> consume_stage) & 1u);
      ring.phases ^= 1u << consume_stage;
    } else {
      cp_async_commit();
      cp_async_wait<S::kStages - 1>();
    }
    __syncwarp();
    consume(c, Stage<S>(warp_base, consume_stage), tile_start(k));
    consume_stage = consume_stage + 1 == S::kStages ? 0 : consume_stage + 1;
    __syncwarp();  // the stage is free for the next issue
  }
  if constexpr (!S::kTma) cp_async_wait<0>();  // (the TMA form waited for every tile it issued)
  return c;
}

// Row j's out (o: the sum over keys of p x v, relative to st.m) and LSE, the sink merged once.
template <class S>
FS_DEV void store_row(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int j, const RowState& st,
                      const float (&o)[S::kChan], int lane) {
  const PackedIdx pi = packed_idx(p, g, g0, j);
  const int64_t q_row = s.rows.q_row(s.rows.row_begin + pi.i, p.batched);
  float lse = st.lse();
  const float ws = apply_sink(p, pi.h, lse), scale = st.empty() ? 0.0f : s.kv.v_desc / st.l;
#pragma unroll
  for (int k = 0; k < S::kChan; ++k) store_out(p, s.rows.qb, q_row, pi.h, lane * S::kChan + k, o[k] * scale * ws);
  if (lane == 0) store_lse(p, s.rows.qb, q_row, pi.h, lse);
}

// Merges the warps' states of each row (shared memory, reusing the warps' area) and writes
// out and LSE (num_splits == 1, the sink merged once) or the split partials: to the workspace,
// or, with the splits in one cluster (decode_fwd.cu), into shared memory after the merge area,
// where cluster_combine merges them.
template <class S, class Acc>
FS_DEV void merge_and_store(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, int split,
                            unsigned char* warps_base, Acc& w) {
  constexpr int kD = S::kDim;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float* mo = reinterpret_cast<float*>(warps_base);     // [kWarps, kRows, kD]
  float* ms = mo + S::kWarps * S::kRows * kD;           // [kWarps, kRows, 2]
  float* xo = ms + S::kWarps * S::kRows * 2;            // clustered splits: the partials [kRows, kD],
  float* xl = xo + S::kRows * kD;                       // their LSEs [kRows]
  float* scratch = xl + S::kRows;                       // and cluster_combine's scratch
  const bool clustered = s.splits > 1 && cluster_ctas() > 1;  // the same in the cluster's CTAs
  static_assert((S::kWarps * S::kRows * (kD + 2)) % 4 == 0 && kD % 4 == 0, "xo's rows: float4-aligned");
  __syncthreads();  // every warp is done with its ring
  w.spill(mo, ms, warp, nrows, lane);
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
    if constexpr (S::kInt8 && S::kVb == 1) {  // K8V8: v's per-channel scale factors out of the sum over keys
#pragma unroll
      for (int k = 0; k < S::kChan; ++k) o[k] *= load_f32_2d(p.v_scale, g, lane * S::kChan + k, 1.0f);
    }
    if (s.splits > 1) {  // fixed-size splits: a sequence of one split is written directly
      // the partial row: row j of the CTA's own (clustered) or the workspace's
      int64_t at = j;
      if (!clustered) {
        const PackedIdx pi = packed_idx(p, g, g0, j);
        at = partial_index(p, split, s.rows.row_begin + pi.i, pi.h);
      }
      float* po = (clustered ? xo : p.o_partial) + at * kD;
      const float scale = st.empty() ? 0.0f : s.kv.v_desc / st.l;
#pragma unroll
      for (int k = 0; k < S::kChan; ++k) po[lane * S::kChan + k] = o[k] * scale;
      if (lane == 0) (clustered ? xl : p.lse_partial)[at] = st.lse();
    } else {
      store_row<S>(p, s, g, g0, j, st, o, lane);
    }
  }
  if (clustered)
    cluster_combine<S::kRows, kD, S::kThreads>(p, xo, xl, scratch, nrows, [&](int j) {
      const PackedIdx pi = packed_idx(p, g, g0, j);
      return RowDest{s.rows.qb, s.rows.q_row(s.rows.row_begin + pi.i, p.batched), pi.h};
    });
}

// One row group on the tensor cores (decode_mma.cuh: 16-bit, fp8 and int8 K/V), then the
// cross-warp merge.
template <DType kKv, class S>
FS_DEV void run_row_group(const AttnParams& p, const DecodeSeq& s, int64_t g, int64_t g0, int nrows, int split,
                          unsigned char* q, RowMeta* meta, unsigned char* warps_base, WarpRing& ring) {
  const int lane = int(threadIdx.x) % 32;
  unsigned char* warp_base = warps_base + size_t(threadIdx.x / 32) * S::kWarpBytes;
  const KeyRange u = group_key_union(p, s, g0, nrows);
  // The main loop once per P rounding (fp32 outputs split P, MmaWarp::accumulate): a CTA-uniform
  // choice outside the loop, so neither copy carries the other's instructions or registers.
  auto run = [&](auto split_p) {
    MmaWarp<kKv, S> w = stream_keys<S>(
        p, s, warp_base, ring, u,
        [&] {
          setup_rows<S>(p, s, g, g0, nrows, q, meta);
          return MmaWarp<kKv, S>(q, meta, lane);
        },
        [&](MmaWarp<kKv, S>& c, const Stage<S>& st, int64_t t0) {
          c.template consume<decltype(split_p)::value>(p, st, t0, lane);
        });
    merge_and_store<S>(p, s, g, g0, nrows, split, warps_base, w);
  };
  if (p.out.dtype == DType::f32) run(std::true_type{});
  else run(std::false_type{});
}

// The CTA's body: shared memory carved as decode_config.hpp lays it out (the TMA form: the full
// barriers after the rows' metadata, initialized here, the warps' area 1 KB aligned), then its
// row groups.
template <DType kKv, class S>
FS_DEV void decode_cta(const AttnParams& p, const CUtensorMap* maps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* q = smem_raw;                                                   // [kRows, kQStride]
  RowMeta* meta = reinterpret_cast<RowMeta*>(q + S::kRows * S::kQStride);       // [kRows]
  unsigned char* warps_base = reinterpret_cast<unsigned char*>(meta + S::kRows);
  WarpRing ring{maps, 0u, 0u, 0u};
  // The grid's order (decode_fwd.cu): long splits x = (sequence x row CTA) x KV head, the head
  // fastest (gridDim.y == 1); short splits x = sequence x row CTA, y = KV head.
  const unsigned hkv = gridDim.y == 1 ? unsigned(p.num_kv_heads) : 1u, br = blockIdx.x / hkv;
  const int64_t g = gridDim.y == 1 ? int64_t(blockIdx.x - br * hkv) : int64_t(blockIdx.y);
  const int split = int(blockIdx.z), r = int(br % unsigned(p.row_ctas));
  const DecodeSeq s = decode_sequence(p, br / unsigned(p.row_ctas), g, split);
  if (split >= s.splits) return;  // fixed-size splits: past this sequence's own (the whole CTA)
  if constexpr (S::kTma) {  // each warp's barriers, by its lane 0, for its own ring
    const uint32_t bars = smem_u32(warps_base);
    ring.bars = bars + uint32_t(int(threadIdx.x) / 32 * S::kStages * 8);
    const uint32_t area = (bars + uint32_t(S::kWarps * S::kStages * 8) + 1023u) & ~1023u;
    warps_base += area - bars;
    if (threadIdx.x % 32 == 0) {
      for (int i = 0; i < S::kStages; ++i) mbar_init(ring.full(i), 32u);
      mbar_init_fence();
    }
    __syncwarp();
  }
  const int64_t packed = s.rows.sq() * p.group;
  for (int64_t g0 = int64_t(r) * S::kRows; g0 < packed; g0 += int64_t(p.row_ctas) * S::kRows) {
    const int nrows = int(imin(S::kRows, packed - g0));
    __syncthreads();  // the previous row group is done with shared memory
    run_row_group<kKv, S>(p, s, g, g0, nrows, split, q, meta, warps_base, ring);
    // The TMA form: the merge's writes over the stages, ordered before the next row group's boxes
    // (each thread's here, every thread's by the loop's barrier).
    if constexpr (S::kTma) fence_proxy_async_shared();
  }
}

// The tiling (decode_config.hpp's DecodeTiling as its fields, as a kernel's template arguments
// must be for nvcc's host stubs): long splits two CTAs per SM, at most 255 registers; short
// splits three, at most 168; picked by the launcher (decode_fwd.cu).
template <DType kKv, DType kV, int kD, int kRows, int kTileKeys, int kStages, int kCtas>
__global__ void __launch_bounds__(32 * decode_warps(kD), kCtas)
    decode_fwd(const __grid_constant__ AttnParams p) {
  decode_cta<kKv, Shape<kKv, kV, kD, kRows, DecodeTiling{kTileKeys, kStages, kCtas}>>(p, nullptr);
}
// The TMA form (sm_90a; decode_tma_tiling's fields): its tensor maps beside the parameters.
template <DType kKv, DType kV, int kD, int kRows, int kTileKeys, int kStages, int kCtas>
__global__ void __launch_bounds__(32 * decode_warps(kD), kCtas)
    decode_fwd_tma(const __grid_constant__ DecodeTmaParams tp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  decode_cta<kKv, Shape<kKv, kV, kD, kRows, DecodeTiling{kTileKeys, kStages, kCtas, true}>>(tp.p, &tp.k);
#else
  __trap();  // launched on sm_90 devices only (select.hpp: decode_tma_form)
#endif
}

}  // namespace flashserve::kernels::decode
