// The decode kernel's tensor-core path (16-bit K/V; included by decode_mainloop.cuh): one warp's
// q.k, online softmax and p.v over a 16-key tile with mma.sync m16n8k16, for the 16 packed rows
// of the row group (the mma's M; rows past nrows are zero queries that see no key).
//
// Per tile (g = lane / 4, t = lane % 4; fragment layouts in kernels/common/mma.cuh):
//   S [16 rows, 16 keys] = Q K^T: Q's A fragments (ldmatrix from the row group's q, held in
//     registers for D <= 128, re-read per tile above), K's B fragments by ldmatrix from the
//     stage (K row-major is B column-major); D/16 ldmatrix.x4 and D/8 mma.
//   softmax: the lane's scores are rows g and g + 8, keys 2t, 2t+1, 8+2t, 9+2t; masks and
//     modifiers per element (masks.cuh), row max over the quad (2 shuffles); the running sum
//     stays per lane and is reduced once, in spill().
//   O [16, D] += P V: P's A fragment is S's accumulator packed to 16 bits (no shuffles; fp32
//     outputs add the residue P - P16 in a second pass); V's B fragments by ldmatrix.trans;
//     D/16 ldmatrix.x4 and D/8 mma.
// D=128: ~100 instructions per 8 KB tile against ~1880 on the CUDA-core path.
#pragma once

namespace flashserve::kernels::decode {

template <DType kKv, class S>
struct MmaWarp {
  using T = std::conditional_t<kKv == DType::bf16, __nv_bfloat16, __half>;
  static constexpr int kKSteps = S::kDim / 16;  // q.k k-steps of 16 channels
  static constexpr int kNTiles = S::kDim / 8;   // p.v output tiles of 8 channels
  static constexpr bool kQInRegs = S::kDim <= 128;

  uint32_t qf[kQInRegs ? kKSteps : 1][4];  // Q A fragments (D <= 128)
  float o[kNTiles][4];                     // O: rows g (o[.][0..1]), g + 8 (o[.][2..3])
  float m[2], l[2];                        // rows g, g + 8: running max, lane-partial sum
  int64_t pos[2], lo[2], hi[2];
  float slope[2];
  uint32_t q_smem;

  // Row meta of the lane's two rows into registers; Q fragments (D <= 128).
  FS_DEV MmaWarp(const unsigned char* q, const RowMeta* meta, int lane) : q_smem(smem_u32(q)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const RowMeta& rm = meta[lane / 4 + 8 * r];
      pos[r] = rm.pos;
      lo[r] = rm.lo;
      hi[r] = rm.hi;
      slope[r] = rm.slope;
      m[r] = kNegInf;
      l[r] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    if constexpr (kQInRegs) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) load_q(ks, lane, qf[ks]);
    }
  }

  // Q's A fragment of k-step ks: matrices (rows 0-7 | 8-15) x (channels lo | hi).
  FS_DEV void load_q(int ks, int lane, uint32_t (&a)[4]) const {
    const int row = lane % 8 + 8 * ((lane / 8) % 2), col = 16 * ks + 8 * (lane / 16);
    ldmatrix_x4(a, q_smem + uint32_t(row * S::kQStride + col * 2));
  }

  // s[n][.] = scores of keys 8n + 2t, 8n + 2t + 1 (rows g: [0..1], g + 8: [2..3]).
  FS_DEV void scores(const Stage<S>& st, int lane, float (&s)[2][4]) const {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
    const uint32_t kbase = smem_u32(st.k) + uint32_t((lane % 8 + 8 * (lane / 16)) * S::kKStride + 16 * ((lane / 8) % 2));
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t b[4];  // keys 0-7 (lo, hi channels), keys 8-15 (lo, hi)
      ldmatrix_x4(b, kbase + uint32_t(ks * 32));
      if constexpr (kQInRegs) {
        mma_16816<T>(s[0], qf[ks], b[0], b[1]);
        mma_16816<T>(s[1], qf[ks], b[2], b[3]);
      } else {
        uint32_t a[4];
        load_q(ks, lane, a);
        mma_16816<T>(s[0], a, b[0], b[1]);
        mma_16816<T>(s[1], a, b[2], b[3]);
      }
    }
  }

  // Masks and modifiers, online softmax (exp2 of log2e-scaled differences); the scores become p
  // in place. `bad`: bit k set when key t0 + k is bad (its rows NaN).
  FS_DEV void softmax(const AttnParams& p, int64_t t0, uint32_t bad, int lane, float (&s)[2][4]) {
    constexpr float kLog2e = 1.4426950408889634f;
    const ScoreTransform score = make_score_transform(p);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int vlo = int(imin(imax(lo[r] - t0, 0), kTile)), vhi = int(imin(imax(hi[r] - t0, 0), kTile));
      float mx = kNegInf;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = 8 * n + 2 * (lane % 4) + e;
          float& x = s[n][2 * r + e];
          x = k < vlo || k >= vhi   ? kNegInf
              : (bad >> k) & 1u     ? nan_value()
                                      : score(x, pos[r], t0 + k, slope[r]);
          mx = nan_max(mx, x);
        }
      mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float new_m = nan_max(m[r], mx);
      if (new_m == kNegInf) {  // nothing visible yet: p = 0, state and O unchanged
#pragma unroll
        for (int n = 0; n < 2; ++n) s[n][2 * r] = s[n][2 * r + 1] = 0.0f;
        continue;
      }
      const float mb = new_m * kLog2e;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[n][2 * r + e];
          x = fast_exp2(fmaf(x, kLog2e, -mb));  // -inf -> 0; NaN stays
          sum += x;
        }
      const float alpha = fast_exp2(fmaf(m[r], kLog2e, -mb));
      l[r] = l[r] * alpha + sum;
      m[r] = new_m;
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }
  }

  // O += P V over the tile's 16 keys. P is rounded to 16 bits for the mma; with `split_p` (fp32
  // outputs, which promise full precision) the rounding residue goes through a second mma,
  // leaving P with ~16 significant bits.
  FS_DEV void accumulate(const Stage<S>& st, int lane, const float (&pr)[2][4], bool split_p) {
    uint32_t a[4], r[4];
    p_fragment<T, kTile>(pr, 0, a);
    if (split_p) p_residue<T, kTile>(pr, 0, a, r);
    const uint32_t vbase = smem_u32(st.v) + uint32_t((lane % 8 + 8 * ((lane / 8) % 2)) * S::kVStride + 16 * (lane / 16));
#pragma unroll
    for (int n2 = 0; n2 < kNTiles / 2; ++n2) {
      uint32_t b[4];  // channels 16 n2 + (0-7 | 8-15) x keys (0-7 | 8-15)
      ldmatrix_x4_trans(b, vbase + uint32_t(n2 * 32));
      mma_16816<T>(o[2 * n2], a, b[0], b[1]);
      mma_16816<T>(o[2 * n2 + 1], a, b[2], b[3]);
      if (split_p) {
        mma_16816<T>(o[2 * n2], r, b[0], b[1]);
        mma_16816<T>(o[2 * n2 + 1], r, b[2], b[3]);
      }
    }
  }

  FS_DEV void consume(const AttnParams& p, const Stage<S>& st, int64_t t0, int lane) {
    const uint32_t bad = *st.bad;
    float s[2][4];
    scores(st, lane, s);
    softmax(p, t0, bad, lane, s);
    accumulate(st, lane, s, p.out.dtype == DType::f32);
  }

  // The warp's state into the merge area: mo [kWarps, kRows, kD], ms [kWarps, kRows, 2].
  FS_DEV void spill(float* mo, float* ms, int warp, int nrows, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
      l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
      const int j = lane / 4 + 8 * r;
      if (j >= nrows) continue;
      float* row = mo + (warp * S::kRows + j) * S::kDim + 2 * (lane % 4);
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
        *reinterpret_cast<float2*>(row + 8 * n) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
      if (lane % 4 == 0) {
        ms[(warp * S::kRows + j) * 2] = m[r];
        ms[(warp * S::kRows + j) * 2 + 1] = l[r];
      }
    }
  }
};

}  // namespace flashserve::kernels::decode
