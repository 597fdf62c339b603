// The tensor-core prefill kernel: FlashAttention-2 structure on mma.sync m16n8k16 (sm80+).
// Serves f16/bf16 q/k/v (one dtype), D == Dv in kPrefillConfigs, causal / window / soft-cap,
// contiguous or paged KV (any block size: every KV row is located on its own), GQA and any
// split count; select.cu declines everything else (the generic kernel serves it).
//
// CTA: 128 query rows of one sequence x one query head x one KV split; 8 warps, 16 rows each.
//   grid = (total_q / 128 + B + 1 (varlen) | B * ceil(sq / 128) (batched), H, num_splits)
// A varlen CTA finds its sequence by a binary search over base(b) = cu_seqlens_q[b] / 128 + b
// (non-decreasing; sequence b's tiles are base(b) .. base(b) + ceil(sq_b / 128) - 1), so
// correctness never depends on max_seqlen_q. Rows outside their sequence are never written.
//
// Per CTA: Q [128, D] -> shared (cp.async) -> registers (ldmatrix, A fragments) once; KV tiles
// of 64 keys, K and V double-buffered in shared memory with cp.async; per tile each warp
// computes S = Q K^T (fp32), applies scale (log2 units), soft-cap and the mask (only on tiles
// that are not fully visible), the online softmax in registers, and O += P V with P rounded
// to the operand dtype. KV rows past the CTA's last visible key are zero-filled; rows whose
// metadata points outside the cache get NaN keys and zero values, so exactly the query rows
// that see them come out NaN (load.cuh), never an out-of-bounds read.
//
// Work and expected time (H200, bf16, D = 128, H = 16 (H * D = 2048), 16k tokens as B = 2 x
// S = 8k): 4 * B * H * S^2 * D = 1.10e12 FLOP non-causal, 0.55e12 causal. mma.sync peaks near
// 2/3 of the 990 TFLOP/s dense rate, and ldmatrix traffic (K and V read once per warp per
// tile: 32 KB per 4.2 MFLOP tile) bounds this shape near 450 TFLOP/s; expected 250-350
// TFLOP/s: 3.1-4.4 ms non-causal, 1.7-2.5 ms causal (the generic kernel: ~370 ms).
#pragma once

#include <cstdint>

#include "flashserve/plan.hpp"
#include "kernels/attention/generic_fwd.cuh"
#include "kernels/attention/prefill_mma.cuh"

namespace flashserve::kernels::prefill {

constexpr int kM = kPrefillRowsPerCta;  // query rows per CTA
constexpr int kN = kPrefillTileKeys;    // keys per KV tile
constexpr int kWarps = kPrefillWarps;
constexpr int kThreads = kPrefillThreads;
static_assert(kM == 16 * kWarps && kThreads == 32 * kWarps, "one m16 row block per warp");
static_assert(kN == 64, "the softmax and PV loops assume 8 n8 tiles per KV tile");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared memory [Q | K stage 0 | K stage 1 | V stage 0 | V stage 1], each tile row-major in
// 16-byte chunks; chunk c of row r is stored at chunk c ^ (r % 8), so the 8 rows an ldmatrix
// reads (and cp.async writes) hit 8 distinct bank groups. Byte offsets.
template <int kD>
struct Smem {
  static constexpr int kChunks = kD / 8;
  static_assert(kChunks >= 8, "the swizzle needs D >= 64");
  static constexpr uint32_t kQBytes = kM * kD * 2, kTileBytes = kN * kD * 2;
  uint32_t q;
  FS_DEV explicit Smem(const void* base) : q(smem_u32(base)) {}
  // Stage j % 2 (arithmetic, not an indexed array: that would live in local memory).
  FS_DEV uint32_t k(int j) const { return q + kQBytes + uint32_t(j & 1) * kTileBytes; }
  FS_DEV uint32_t v(int j) const { return q + kQBytes + uint32_t(2 + (j & 1)) * kTileBytes; }
  static FS_DEV uint32_t at(int row, int chunk) { return uint32_t(row * kChunks + (chunk ^ (row & 7))) * 16u; }
};

// The query rows of one CTA: tile rows [0, rows) are sequence rows i0 .. i0 + rows - 1.
struct CtaWork {
  bool active = false;
  int64_t b = 0, qb = 0;  // sequence; index into the normalized q's dim 0
  int64_t row0 = 0;       // flat row of tile row 0
  int64_t q_row0 = 0;     // its index into the normalized view's dim 1
  int64_t i0 = 0, sq = 0;
  int rows = 0;
};

FS_DEV int64_t tile_base(const AttnParams& p, int64_t b) { return floor_div(load_index(p.cu_seqlens_q, b), kM) + b; }

FS_DEV CtaWork cta_work(const AttnParams& p, int64_t t) {
  CtaWork w;
  if (p.batched) {
    const int64_t per = (p.q_rows + kM - 1) / kM;
    w.b = w.qb = t / per;
    if (w.b >= p.batch) return w;
    w.i0 = t % per * kM;
    w.sq = p.q_rows;
    w.row0 = w.b * p.q_rows + w.i0;
    w.q_row0 = w.i0;
  } else {
    int64_t lo = 0, hi = p.batch;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (tile_base(p, mid) <= t) lo = mid + 1;
      else hi = mid;
    }
    if (lo == 0) return w;
    w.b = lo - 1;
    const int64_t begin = load_index(p.cu_seqlens_q, w.b);
    w.sq = load_index(p.cu_seqlens_q, w.b + 1) - begin;
    w.i0 = (t - tile_base(p, w.b)) * kM;
    w.row0 = w.q_row0 = begin + w.i0;
  }
  const int64_t rows = imin(imin(kM, w.sq - w.i0), p.total_rows() - w.row0);
  if (rows <= 0 || w.row0 < 0) return w;
  w.rows = int(rows);
  w.active = true;
  return w;
}

// Element offsets of KV token t (0 <= t < 2^31) of sequence kv.b in k and v; false when the
// metadata places it outside the cache.
FS_DEV bool token_offsets(const AttnParams& p, const SeqKv& kv, int64_t t, int64_t& k_off, int64_t& v_off) {
  int64_t d0, d1;
  if (p.paged) {
    const uint32_t bs = uint32_t(p.kv_dim1), col = uint32_t(t) / bs;
    if (col >= p.max_blocks) return false;
    d0 = load_index2(p.block_table, kv.b, col);
    d1 = uint32_t(t) - col * bs;
  } else {
    d0 = kv.kb;
    d1 = kv.k_begin + t;
  }
  if (d0 < 0 || d0 >= p.kv_dim0 || d1 < 0 || d1 >= p.kv_dim1) return false;
  k_off = d0 * p.k.stride[0] + d1 * p.k.stride[1] + kv.g * p.k.stride[2];
  v_off = d0 * p.v.stride[0] + d1 * p.v.stride[1] + kv.g * p.v.stride[2];
  return true;
}

// Q [128, D] of head h into shared memory; rows past the CTA's rows are zero-filled.
template <class T, int kD>
FS_DEV void load_q(const AttnParams& p, const CtaWork& w, int64_t h, uint32_t q_s) {
  constexpr int kChunks = kD / 8, kRowsPerPass = kThreads / kChunks;
  const int c = int(threadIdx.x) % kChunks;
  const T* q = static_cast<const T*>(p.q.data);
#pragma unroll
  for (int row = int(threadIdx.x) / kChunks; row < kM; row += kRowsPerPass) {
    const bool valid = row < w.rows;
    const T* src = q + (valid ? w.qb * p.q.stride[0] + (w.q_row0 + row) * p.q.stride[1] + h * p.q.stride[2] + c * 8 : 0);
    cp_async_16(q_s + Smem<kD>::at(row, c), src, valid);
  }
}

// KV tokens [n0, n0 + 64) into one stage: tokens >= kv_end zero-filled; tokens outside the
// cache NaN keys and zero values (plain stores; visible after the same barrier).
template <class T, int kD>
FS_DEV void load_kv(const AttnParams& p, const SeqKv& kv, int64_t n0, int64_t kv_end, uint32_t k_s, uint32_t v_s) {
  constexpr int kChunks = kD / 8, kRowsPerPass = kThreads / kChunks;
  const int c = int(threadIdx.x) % kChunks;
  const T* k = static_cast<const T*>(p.k.data);
  const T* v = static_cast<const T*>(p.v.data);
#pragma unroll
  for (int row = int(threadIdx.x) / kChunks; row < kN; row += kRowsPerPass) {
    const uint32_t at = Smem<kD>::at(row, c);
    int64_t k_off = 0, v_off = 0;
    const bool in_range = n0 + row < kv_end;
    if (in_range && !token_offsets(p, kv, n0 + row, k_off, v_off)) {
      const uint32_t nan2 = std::is_same_v<T, __half> ? 0x7e007e00u : 0x7fc07fc0u;
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(k_s + at), "r"(nan2) : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(v_s + at), "r"(0u) : "memory");
      continue;
    }
    cp_async_16(k_s + at, k + k_off + c * 8, in_range);
    cp_async_16(v_s + at, v + v_off + c * 8, in_range);
  }
}

// S [16, 64] of this warp = Q K^T over D (B fragments: ldmatrix of K rows, two n8 tiles each).
template <class T, int kD>
FS_DEV void qk_tile(const uint32_t (&qf)[kD / 16][4], uint32_t k_s, int lane, float (&s)[kN / 8][4]) {
#pragma unroll
  for (int nt = 0; nt < kN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
  const int key = (lane & 7) + (lane >> 4) * 8, half = (lane >> 3) & 1;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_s + Smem<kD>::at(16 * np + key, 2 * kk + half));
      mma_16816<T>(s[2 * np], qf[kk], b[0], b[1]);
      mma_16816<T>(s[2 * np + 1], qf[kk], b[2], b[3]);
    }
}

// O [16, D] += P V with P = s (probabilities) as A fragments; V B fragments by ldmatrix.trans.
template <class T, int kD>
FS_DEV void pv_tile(const float (&s)[kN / 8][4], uint32_t v_s, int lane, float (&o)[kD / 8][4]) {
  const int key = (lane & 7) + ((lane >> 3) & 1) * 8, half = lane >> 4;
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                           pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_s + Smem<kD>::at(16 * kk + key, 2 * dp + half));
      mma_16816<T>(o[2 * dp], a, b[0], b[1]);
      mma_16816<T>(o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// Scores in log2 units: dot * scale * log2(e), or softcap * tanh(dot * scale / softcap) * log2(e).
struct ScoreLog2 {
  float mul = 1.0f, post = 1.0f;
  bool softcap = false;
  FS_DEV float operator()(float dot) const { return softcap ? tanhf(dot * mul) * post : dot * mul; }
};

// The visible keys of this thread's two rows, relative to the tile start, clamped to [0, 64].
struct TileMask {
  int lo[2], hi[2];
};

// Online softmax over one tile for the thread's rows r = 0 (s[.][0..1]) and 1 (s[.][2..3]):
// s becomes exp2(score - m), l (per-thread partial sums) and o are rescaled to the new max.
template <int kD>
FS_DEV void softmax_tile(float (&s)[kN / 8][4], float (&o)[kD / 8][4], float (&m)[2], float (&l)[2],
                         const ScoreLog2& score, const TileMask& mask, bool masked, int t) {
#pragma unroll
  for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = score(s[nt][e]);
      if (masked) {
        const int rel = 8 * nt + 2 * t + (e & 1), r = e >> 1;
        if (rel < mask.lo[r] || rel >= mask.hi[r]) x = kNegInf;
      }
      s[nt][e] = x;
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = kNegInf;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    const float m_new = fmaxf(m[r], mx);
    const float m_use = m_new == kNegInf ? 0.0f : m_new;  // all -inf so far: p = 0, no NaN
    const float alpha = fast_exp2(m[r] - m_use);
    m[r] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
      s[nt][2 * r] = fast_exp2(s[nt][2 * r] - m_use);
      s[nt][2 * r + 1] = fast_exp2(s[nt][2 * r + 1] - m_use);
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    l[r] = l[r] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) {
      o[dt][2 * r] *= alpha;
      o[dt][2 * r + 1] *= alpha;
    }
  }
}

FS_DEV void store_pair(void* base, int64_t off, DType t, float x, float y) {
  if (t == DType::bf16) *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + off) = __floats2bfloat162_rn(x, y);
  else if (t == DType::f16) *reinterpret_cast<__half2*>(static_cast<__half*>(base) + off) = __floats2half2_rn(x, y);
  else *reinterpret_cast<float2*>(static_cast<float*>(base) + off) = make_float2(x, y);
}

// out = o / l and lse (natural log) of the thread's valid rows; with splits the fp32 partials.
template <int kD>
FS_DEV void store_rows(const AttnParams& p, const CtaWork& w, int64_t h, int split, const float (&o)[kD / 8][4],
                       const float (&m)[2], float (&l)[2], int warp, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
    const int i = 16 * warp + (lane >> 2) + 8 * r;
    if (i >= w.rows) continue;
    const bool empty = l[r] == 0.0f;
    const float inv = empty ? 0.0f : 1.0f / l[r];
    const float lse = empty ? kNegInf : m[r] * kLn2 + logf(l[r]);
    if (p.num_splits > 1) {
      const int64_t at = partial_index(p, split, w.row0 + i, h);
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        p.o_partial[at * kD + 8 * dt + 2 * t] = o[dt][2 * r] * inv;
        p.o_partial[at * kD + 8 * dt + 2 * t + 1] = o[dt][2 * r + 1] * inv;
      }
      if (t == 0) p.lse_partial[at] = lse;
      continue;
    }
    const int64_t row = w.qb * p.out.stride[0] + (w.q_row0 + i) * p.out.stride[1] + h * p.out.stride[2];
    void* out = const_cast<void*>(p.out.data);
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
      store_pair(out, row + 8 * dt + 2 * t, p.out.dtype, o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (t == 0) store_lse(p, w.qb, w.q_row0 + i, h, lse);
  }
}

// Visible local keys of tile row i: visibility (masks.cuh) within the split's range, bounded
// to the tokens the metadata can place in the cache (generic_fwd.cuh). lo and hi are
// non-decreasing in i, so the first and last rows bound the CTA's keys.
struct RowKeys {
  Visibility vis;
  KvRange range;
  KeyRange cache;
  int64_t pos0;  // aligned position of tile row 0: i0 + sk - sq
  int64_t sk;
  FS_DEV KeyRange operator()(int64_t i) const {
    const KeyRange k = vis(pos0 + i, sk);
    return generic::bound_to_cache({imax(k.lo, range.begin), imin(k.hi, range.end)}, cache);
  }
};

FS_DEV int clamp_rel(int64_t x) { return int(imin(imax(x, 0), kN)); }

template <class T, int kD>
__global__ void __launch_bounds__(kThreads, 1) prefill_fwd(const __grid_constant__ AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const CtaWork w = cta_work(p, int64_t(gridDim.x) - 1 - blockIdx.x);  // last (longest causal) tiles first
  if (!w.active) return;
  const Smem<kD> sm(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t h = blockIdx.y;
  const int split = int(blockIdx.z);
  const SeqKv kv = seq_kv(p, w.b, h / p.group);
  const int64_t sk = kv_len(p, w.b);
  const RowKeys keys{make_visibility(p), split_kv_range(sk, p.num_splits, split, p.split_granularity),
                     generic::cache_tokens(p, kv), w.i0 + sk - w.sq, sk};
  const KeyRange first = keys(0), last = keys(w.rows - 1);
  const int64_t n_begin = keys.range.begin + floor_div(first.lo - keys.range.begin, kN) * kN;
  const int tiles = first.lo < last.hi ? int((last.hi - n_begin + kN - 1) / kN) : 0;

  load_q<T, kD>(p, w, h, sm.q);
  cp_async_commit();
  if (tiles > 0) load_kv<T, kD>(p, kv, n_begin, last.hi, sm.k(0), sm.v(0));
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[kD / 16][4];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) ldmatrix_x4(qf[kk], sm.q + Smem<kD>::at(16 * warp + (lane & 15), 2 * kk + (lane >> 4)));

  const int row_a = 16 * warp + (lane >> 2);
  const KeyRange span[2] = {keys(row_a), keys(row_a + 8)};
  ScoreLog2 score{p.softmax_scale * kLog2e, 1.0f, p.softcap > 0.0f};
  if (score.softcap) score = ScoreLog2{p.softmax_scale / p.softcap, p.softcap * kLog2e, true};
  float o[kD / 8][4] = {};
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  for (int j = 0; j < tiles; ++j) {
    const int64_t n0 = n_begin + int64_t(j) * kN;
    if (j + 1 < tiles) load_kv<T, kD>(p, kv, n0 + kN, last.hi, sm.k(j + 1), sm.v(j + 1));
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // tile j is in shared memory
    float s[kN / 8][4];
    qk_tile<T, kD>(qf, sm.k(j), lane, s);
    const bool full = n0 >= last.lo && n0 + kN <= first.hi;  // every row sees every key
    const TileMask mask{{clamp_rel(span[0].lo - n0), clamp_rel(span[1].lo - n0)},
                        {clamp_rel(span[0].hi - n0), clamp_rel(span[1].hi - n0)}};
    softmax_tile<kD>(s, o, m, l, score, mask, !full, lane & 3);
    pv_tile<T, kD>(s, sm.v(j), lane, o);
    __syncthreads();  // stage j & 1 is free for tile j + 2
  }
  store_rows<kD>(p, w, h, split, o, m, l, warp, lane);
}

}  // namespace flashserve::kernels::prefill
