// The decode kernel's tensor-core path (16-bit, fp8 and int8 K/V; included by decode_mainloop.cuh): one warp's
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
//
// fp8 K/V (e4m3 / e5m2) take the same scheme with f16 operands over 32-key tiles (8 KB at D=128,
// as a bf16 tile: the per-tile costs (table reads, copy issue, softmax shuffles) are paid per
// byte as for bf16; 16-key fp8 tiles measured 0.89-0.93x bf16's time, not ~0.5). Every fp8
// value is exact in f16, converted in registers by cvt.rn.f16x2.{e4m3,e5m2}x2 (two elements per
// instruction) after plain 16-byte shared-memory loads; q is staged as f16
// (decode_mainloop.cuh's stage_rows_fp8: exact, a bf16 row scaled by a power of two folded into
// the row's qk_scale with the descales).
//   K: the reduction order over channels is free, so the channels of each k-step are permuted:
//     lane t's B fragments of all k-steps are the contiguous bytes [t D/4, (t+1) D/4) of its key
//     rows g + 8n (byte 4 ks + i of them is k index {2t, 2t+1, 2t+8, 2t+9}[i] of k-step ks),
//     and q's staging writes channel c to that k index (fp8_q_column); D/64 LDS.128 per key row.
//     K rows are unpadded, chunk c of row r stored at c ^ (r & 1) (conflict-free at D=128).
//   V: the output channels are permuted instead: n-tile n's column g is physical channel
//     g D/8 + n, so lane (g, t) reads bytes [g D/8, (g+1) D/8) of keys 16kk + (2t, 2t+1, 2t+8,
//     2t+9) (D/8 bytes each) and pairs the keys' bytes with one PRMT per two pairs; spill()
//     writes the channels back in order.
//   The scores are multiplied by the row's qk_scale before the modifiers; V's descale is
//   applied to O in the epilogue (merge_and_store), as on the CUDA-core path.
// Per 8 KB fp8 tile (32 keys, D=128, per warp): 16 LDS.128 (K 8, V 8), 128 cvt f16x2 (64 K,
// 64 V), 32 PRMT, 64 HMMA (bf16: 32 per 8 KB), softmax over 32 keys (~2x bf16's + 16 FMUL),
// 16 cp.async (as bf16): ~370 instructions against ~150-200 for a bf16 8 KB tile.
// Prediction (H200, 2 CTAs x 4 warps per SM, 2 tiles in flight per warp as bf16): at 4.2 TB/s
// the SM consumes an 8 KB tile every ~250 ns (~450 cycles, ~1800 issue slots): ~370
// instructions (20%), 128 conversions at 16/clk/SM ~256 cycles of that pipe (57%, the closest
// limit), 64 HMMA ~50 ns of the tensor pipe (20%). So fp8 should reach about bf16's fraction of
// the copy ceiling per byte: ~3.2-3.6 TB/s at B=64 L=4k, time 0.5-0.57x bf16's.
// Measured (H200, bench/fp8_pairs.py, commit ea8b780, same process as the bf16 rows):
// B=64 L=4k block 16: 3054 GB/s of fp8 bytes, 0.615x bf16's time (bf16 3756 GB/s); block 256
// 0.575x, block 1 0.639x; B=16 L=8k 0.671x; B=256 L=1k 0.742x; B=1 L=32k 0.758x; verify q_len 2
// / 4 at B=64 L=4k 0.629x / 0.694x; short contexts B=64 L=256 0.862x, B=8 L=128 0.988x, B=256
// L=64 1.038x (slower). The prediction's instruction count was low: the main loop's SASS has
// ~2400 static instructions (the slow softmax path with soft-cap/ALiBi included); the kernel is
// issue-bound, not bound by the conversions: fp8 with 16-key tiles and no conversion at all (a
// bug) already ran at 0.89x, 32-key tiles gave 0.84x, and the softmax shortcuts below (row half
// skip, one multiply per score on interior tiles, O rescaled only when the max moves) 0.615x.
// Next: the scalar work per tile (table reads and 64-bit offsets of issue_tile, the softmax over
// 16 MMA rows of which decode uses 4-8: a transposed q.k, keys as M and rows as N = 8, would
// halve the MMAs and the softmax lanes' work).
//
// int8 (the vLLM int8 fork's K8V8 / K8V16: q and K int8 with per-(token, head) scales; V int8
// with per-(KV head, channel) scales, or 16-bit): q.k on mma.sync m16n8k32 s8 with s32
// accumulators (exact: |sum| <= 128^2 D), over the fp8 scheme's K layout (lane t reads the
// contiguous bytes [t D/4, (t+1) D/4) of its key rows, unpadded and swizzled as fp8's; q staged
// as int8 in the matching order, int8_q_column; D/32 mma per 8 keys instead of D/16); the s32
// dot times the key's k scale (copied per tile into the stage with 4-byte cp.async, 0 for keys
// not loaded), then times the row's q scale (RowMeta::qk_scale) with the softmax scale. K8V8:
// V as the fp8 scheme's V with int8 -> f16 conversions (bytes biased by 128 once per word, then
// placed into 1024's mantissa: one PRMT and one HSUB2 per two values, exact), the per-channel v_scale applied to O at the end
// (merge_and_store: it factors out of the sum over keys); 32-key tiles (8 KB at D=128). K8V16:
// V 16-bit by ldmatrix.trans as the 16-bit path, 16-key tiles (6 KB) in a 4-deep ring (32-key
// tiles would not leave two CTAs per SM).
#pragma once

namespace flashserve::kernels::decode {

// fp8 K/V: the f16 q column (k index within the row) of physical channel d (see above).
template <class S>
FS_DEV int fp8_q_column(int d) {
  constexpr int kLaneBytes = S::kDim / 4;  // K bytes per lane per key row
  const int t = d / kLaneBytes, r = d % kLaneBytes, ks = r / 4, i = r % 4;
  return 16 * ks + 2 * t + (i < 2 ? i : i + 6);
}

// int8 q and K: the q column (byte within the row) of physical channel d: lane t's B fragments of
// all k-steps (32 channels each) are the contiguous bytes [t D/4, (t+1) D/4) of its key rows
// (word 2 ks + h of them is k index 16 h + 4t + {0..3} of k-step ks).
template <class S>
FS_DEV int int8_q_column(int d) {
  constexpr int kLaneBytes = S::kDim / 4;
  const int t = d / kLaneBytes, r = d % kLaneBytes, j = r / 4, i = r % 4;
  return 32 * (j / 2) + 16 * (j % 2) + 4 * t + i;
}

// Two int8 values biased by 128 (x ^ 0x80 per byte; low 16 bits, low byte first) as an f16x2
// register (low half first), exact: the biased bytes become the low mantissa bytes of 1024
// (0x64xx), then 1152 is taken off.
FS_DEV uint32_t i8x2_biased_to_f16x2(uint32_t two) {
  uint32_t h, d;
  asm("prmt.b32 %0, %1, %2, 0x4140;\n" : "=r"(h) : "r"(two), "r"(0x64646464u));
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(h), "r"(0x64806480u));
  return d;
}

// Two fp8 values (low byte first) as an f16x2 register (low half first), exact.
template <DType kKv>
FS_DEV uint32_t fp8x2_to_f16x2(uint32_t two) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xffffu), kKv == DType::f8e4m3 ? __NV_E4M3 : __NV_E5M2);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Four fp8 values (bytes 0-3) as two f16x2 registers (bytes 0-1 -> lo, 2-3 -> hi), exact. One
// PTX block, so ptxas reads the upper half in place (F2FP ... R.H1) instead of shifting it down
// first (fp8x2_to_f16x2(w >> 16): one SHF per conversion, 64 per 32-key tile at D = 128). The
// cvt needs sm_89: the sm_80 build (the `cuda` preset's portable pass) converts by the intrinsic.
template <DType kKv>
FS_DEV void fp8x4_to_f16x2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  lo = fp8x2_to_f16x2<kKv>(four & 0xffffu);
  hi = fp8x2_to_f16x2<kKv>(four >> 16);
#else
  if constexpr (kKv == DType::f8e4m3)
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(four));
  else
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e5m2x2 %0, l;\n cvt.rn.f16x2.e5m2x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(four));
#endif
}

FS_DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// kBytes bytes of shared memory at src (aligned to min(16, kBytes)) as 32-bit words.
template <int kBytes>
FS_DEV void load_words(const unsigned char* src, uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  } else {
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + 16 * c);
      w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
    }
  }
}

template <DType kKv, class S>
struct MmaWarp {
  static constexpr bool kInt8 = S::kInt8;                 // int8 q and K: s8 mma, per-key scales
  static constexpr bool kFp8 = S::kKb == 1 && !kInt8;     // fp8 K and V
  static constexpr bool kScaled = S::kKb == 1;            // scores times the row's qk_scale
  static constexpr bool kV8 = S::kVb == 1;                // 8-bit V (fp8, int8): f16 operands in registers
  // p.v operands (and q.k's for 16-bit K/V): V's 16-bit type, f16 for 8-bit V
  using T = std::conditional_t<S::kVDtype == DType::bf16, __nv_bfloat16, __half>;
  static constexpr int kKSteps = S::kDim / (kInt8 ? 32 : 16);  // q.k k-steps of 16 channels (int8: 32)
  static constexpr int kNTiles = S::kDim / 8;   // p.v output tiles of 8 channels
  // 16-row passes per tile (32-row CTAs: two, on the same K and V fragments).
  static constexpr int kPasses = S::kRows / 16;
  // Q's fragments held in registers (32 at D = 128) under the two-CTA budget of one pass; at three
  // CTAs per SM (168 registers) or two passes they are read from shared memory per tile, which
  // keeps the loop spill-free.
  static constexpr bool kQInRegs = S::kDim <= 128 && S::kCtas <= 2 && kPasses == 1;
  static constexpr int kTile = S::kTile;        // keys per tile: 16 (16-bit K/V) or 32 (fp8)
  static constexpr int kSTiles = kTile / 8;     // score n-tiles of 8 keys
  using Scores = float[kPasses][kSTiles][4];

  uint32_t qf[kQInRegs ? kKSteps : 1][4];  // Q A fragments (D <= 128, one pass)
  float o[kPasses][kNTiles][4];            // O: rows g (o[.][.][0..1]), g + 8 (o[.][.][2..3]) of each pass
  float m[kPasses][2], l[kPasses][2];      // rows g, g + 8: running max, lane-partial sum
  // A row's position and ALiBi slope (the modifiers' slow path only): in registers for one pass,
  // read from the row's RowMeta for two (their registers spilled).
  static constexpr int kRegMeta = kPasses == 1 ? 1 : 0;
  int64_t pos[kRegMeta][2];
  float slope[kRegMeta][2];
  int64_t lo[kPasses][2], hi[kPasses][2];
  float qk_scale[kPasses][2];  // fp8, int8: the rows' score factors
  bool rows_on[kPasses][2];    // some lane's row 16 ps + g + 8r sees a key of the split (warp-uniform)
  uint32_t q_smem;
  const RowMeta* meta;

  // Row meta of the lane's rows into registers; Q fragments (D <= 128, one pass).
  FS_DEV MmaWarp(const unsigned char* q, const RowMeta* meta_, int lane) : q_smem(smem_u32(q)), meta(meta_) {
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const RowMeta& rm = meta[16 * ps + lane / 4 + 8 * r];
        if constexpr (kRegMeta) {
          pos[0][r] = rm.pos;
          slope[0][r] = rm.slope;
        }
        lo[ps][r] = rm.lo;
        hi[ps][r] = rm.hi;
        qk_scale[ps][r] = rm.qk_scale;
        m[ps][r] = kNegInf;
        l[ps][r] = 0.0f;
        rows_on[ps][r] = __any_sync(kFullMask, hi[ps][r] > lo[ps][r]);
      }
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps)
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[ps][n][e] = 0.0f;
    if constexpr (kQInRegs) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) load_q(0, ks, lane, qf[ks]);
    }
  }

  // Q's A fragment of pass ps, k-step ks: matrices (rows 0-7 | 8-15) x (channels lo | hi).
  FS_DEV void load_q(int ps, int ks, int lane, uint32_t (&a)[4]) const {
    const int row = 16 * ps + lane % 8 + 8 * ((lane / 8) % 2), col = 16 * ks + 8 * (lane / 16);
    ldmatrix_x4(a, q_smem + uint32_t(row * S::kQStride + col * 2));
  }

  // Q's A fragment of pass ps, k-step ks, from the registers (kQInRegs) or shared memory.
  FS_DEV void q_fragment(int ps, int ks, int lane, uint32_t (&a)[4]) const {
    if constexpr (kQInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = qf[ks][i];
    } else {
      load_q(ps, ks, lane, a);
    }
  }

  // 8-bit K (fp8, int8): the lane's D / 4 bytes of key row g + 8n (lane / 4 = g), chunks
  // c0.. of the row (c0 = (lane % 4) x D / 64), chunk c stored at c ^ (row & 1) (unpadded
  // rows, decode_config.hpp; the TMA form: at Swz::at(row, c)), as D / 16 words.
  static constexpr int k8BitLaneWords = S::kDim / 16;
  FS_DEV static void k_words_8bit(const Stage<S>& st, int n, int lane, uint32_t (&w)[k8BitLaneWords]) {
    constexpr int kLaneBytes = S::kDim / 4;
    const int c0 = (lane % 4) * (kLaneBytes / 16), swz = (lane / 4) & 1;  // first chunk; row parity
    const unsigned char* kr = st.k + (lane / 4) * S::kKStride;
#pragma unroll
    for (int j = 0; j < kLaneBytes / 16; ++j) {  // chunk c0 + j, stored at (c0 + j) ^ swz
      const unsigned char* at = S::kTma ? st.k + S::Swz::at(lane / 4 + 8 * n, c0 + j)
                                        : kr + 8 * n * S::kKStride + 16 * ((c0 + j) ^ swz);
      const uint4 v = *reinterpret_cast<const uint4*>(at);
      w[4 * j] = v.x, w[4 * j + 1] = v.y, w[4 * j + 2] = v.z, w[4 * j + 3] = v.w;
    }
  }
  // 8-bit V: the lane's D / 8 bytes (n-tiles' channels (lane / 4) x D / 8 ..) of key rows
  // 16 kk + (2t, 2t + 1, 2t + 8, 2t + 9) (t = lane % 4) as words.
  template <int kLaneBytes>
  FS_DEV static void v_words_8bit(const Stage<S>& st, int kk, int lane, uint32_t (&w)[4][kLaneBytes / 4]) {
    const int r0 = 16 * kk + 2 * (lane % 4);
    if constexpr (S::kTma) {  // (D >= 128: whole 16-byte chunks)
      constexpr int kChunks = kLaneBytes / 16;
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const uint4 v = *reinterpret_cast<const uint4*>(st.v + S::Swz::at(r0 + (i & 1) + 8 * (i / 2),
                                                                             (lane / 4) * kChunks + j));
          w[i][4 * j] = v.x, w[i][4 * j + 1] = v.y, w[i][4 * j + 2] = v.z, w[i][4 * j + 3] = v.w;
        }
    } else {
      const unsigned char* vr = st.v + r0 * S::kVStride + (lane / 4) * kLaneBytes;
      load_words<kLaneBytes>(vr, w[0]);
      load_words<kLaneBytes>(vr + S::kVStride, w[1]);
      load_words<kLaneBytes>(vr + 8 * S::kVStride, w[2]);
      load_words<kLaneBytes>(vr + 9 * S::kVStride, w[3]);
    }
  }

  // s[ps][n][.] = scores of keys 8n + 2t, 8n + 2t + 1 (rows 16 ps + g: [0..1], 16 ps + g + 8:
  // [2..3]); K's fragments are read (and converted) once for every pass.
  FS_DEV void scores(const Stage<S>& st, int lane, Scores& s) const {
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps)
#pragma unroll
      for (int n = 0; n < kSTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[ps][n][e] = 0.0f;
    if constexpr (kInt8) {
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {  // keys g + 8n
        uint32_t w[k8BitLaneWords];          // words 2 ks, 2 ks + 1: k-step ks (of 32 channels)
        k_words_8bit(st, n, lane, w);
        // keys 8n + 2t, 8n + 2t + 1: their scales (exact s32 dots, one rounding per factor)
        const float2 ksc = *reinterpret_cast<const float2*>(st.kscale + 8 * n + 2 * (lane % 4));
#pragma unroll
        for (int ps = 0; ps < kPasses; ++ps) {
          int acc[4] = {0, 0, 0, 0};
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) {
            uint32_t a[4];
            q_fragment(ps, ks, lane, a);
            mma_16832_s8(acc, a, w[2 * ks], w[2 * ks + 1]);
          }
          s[ps][n][0] = float(acc[0]) * ksc.x;
          s[ps][n][1] = float(acc[1]) * ksc.y;
          s[ps][n][2] = float(acc[2]) * ksc.x;
          s[ps][n][3] = float(acc[3]) * ksc.y;
        }
      }
      return;
    } else if constexpr (kFp8) {
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {  // keys g + 8n
        uint32_t w[k8BitLaneWords];          // word ks: k-step ks (of 16 channels)
        k_words_8bit(st, n, lane, w);
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          uint32_t b0, b1;
          fp8x4_to_f16x2x2<kKv>(w[ks], b0, b1);
#pragma unroll
          for (int ps = 0; ps < kPasses; ++ps) {
            uint32_t a[4];
            q_fragment(ps, ks, lane, a);
            mma_16816<T>(s[ps][n], a, b0, b1);
          }
        }
      }
      return;
    }
    const int krow = lane % 8 + 8 * (lane / 16), kchunk = (lane / 8) % 2;
    const uint32_t kbase = smem_u32(st.k) + (S::kTma ? 0u : uint32_t(krow * S::kKStride + 16 * kchunk));
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t b[4];  // keys 0-7 (lo, hi channels), keys 8-15 (lo, hi)
      ldmatrix_x4(b, S::kTma ? kbase + S::Swz::at(krow, 2 * ks + kchunk) : kbase + uint32_t(ks * 32));
#pragma unroll
      for (int ps = 0; ps < kPasses; ++ps) {
        uint32_t a[4];
        q_fragment(ps, ks, lane, a);
        mma_16816<T>(s[ps][0], a, b[0], b[1]);
        mma_16816<T>(s[ps][1], a, b[2], b[3]);
      }
    }
  }

  // Masks and modifiers, online softmax (exp2 of log2e-scaled differences); the scores become p
  // in place. `bad`: bit k set when key t0 + k is bad (its rows NaN). Warp-uniform shortcuts:
  // rows g + 8r that no lane needs (decode with <= 8 packed rows: the upper half) are skipped
  // (p = 0), and a tile that every active row sees whole, with no bad key, soft-cap or ALiBi,
  // takes one multiply per score (fmaxf: a NaN score still poisons its row through exp and l).
  FS_DEV void softmax(const AttnParams& p, int64_t t0, uint32_t bad, int lane, Scores& sc) {
    constexpr float kLog2e = 1.4426950408889634f;
    const ScoreTransform score = make_score_transform(p);
    const bool plain = !(score.softcap > 0.0f) && !score.alibi && bad == 0;
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float(&s)[kSTiles][4] = sc[ps];
        if (!rows_on[ps][r]) {
#pragma unroll
          for (int n = 0; n < kSTiles; ++n) s[n][2 * r] = s[n][2 * r + 1] = 0.0f;
          continue;
        }
        float mx = kNegInf;
        const bool act = lo[ps][r] < hi[ps][r];
        if (__all_sync(kFullMask, plain && (!act || (lo[ps][r] <= t0 && t0 + kTile <= hi[ps][r])))) {
          const float c = kScaled ? score.scale * qk_scale[ps][r] : score.scale;
#pragma unroll
          for (int n = 0; n < kSTiles; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[n][2 * r + e];
              x = act ? x * c : kNegInf;
              mx = fmaxf(mx, x);
            }
        } else {
          const int vlo = int(imin(imax(lo[ps][r] - t0, 0), kTile)), vhi = int(imin(imax(hi[ps][r] - t0, 0), kTile));
          const RowMeta& rm = meta[16 * ps + lane / 4 + 8 * r];
          const int64_t row_pos = kRegMeta ? pos[0][r] : rm.pos;
          const float row_slope = kRegMeta ? slope[0][r] : rm.slope;
#pragma unroll
          for (int n = 0; n < kSTiles; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int k = 8 * n + 2 * (lane % 4) + e;
              float& x = s[n][2 * r + e];
              x = k < vlo || k >= vhi ? kNegInf
                  : (bad >> k) & 1u   ? nan_value()
                                      : score(kScaled ? x * qk_scale[ps][r] : x, row_pos, t0 + k, row_slope);
              mx = nan_max(mx, x);
            }
        }
        mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float new_m = nan_max(m[ps][r], mx);
        if (new_m == kNegInf) {  // nothing visible yet: p = 0, state and O unchanged
#pragma unroll
          for (int n = 0; n < kSTiles; ++n) s[n][2 * r] = s[n][2 * r + 1] = 0.0f;
          continue;
        }
        const float mb = new_m * kLog2e;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kSTiles; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[n][2 * r + e];
            x = fast_exp2(fmaf(x, kLog2e, -mb));  // -inf -> 0; NaN stays
            sum += x;
          }
        const float alpha = fast_exp2(fmaf(m[ps][r], kLog2e, -mb));
        l[ps][r] = l[ps][r] * alpha + sum;
        m[ps][r] = new_m;
        if (alpha != 1.0f) {  // the running max moved (rare after the first tiles)
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
            o[ps][n][2 * r] *= alpha;
            o[ps][n][2 * r + 1] *= alpha;
          }
        }
      }
  }

  // O += P V over the tile's keys, one k-step of 16 keys at a time; V's fragments are read (and
  // converted) once for every pass. P is rounded to 16 bits for the mma; with `split_p` (fp32
  // outputs, which promise full precision) the rounding residue goes through a second mma,
  // leaving P with ~16 significant bits. A template parameter: as a runtime flag the residue mma
  // was issued predicated off on every tile (H200 ncu: 48 HMMA per 16-key bf16 tile for 32
  // useful), each one after its accumulator's first mma.
  template <bool split_p>
  FS_DEV void accumulate(const Stage<S>& st, int lane, const Scores& pr) {
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      uint32_t a[kPasses][4], r[kPasses][4];
#pragma unroll
      for (int ps = 0; ps < kPasses; ++ps) {
        p_fragment<T, kTile>(pr[ps], kk, a[ps]);
        if constexpr (split_p) p_residue<T, kTile>(pr[ps], kk, a[ps], r[ps]);
      }
      // The mma(s) of one B fragment pair (V's keys x 8 channels) into n-tile n of every pass.
      auto mma_n = [&](int n, uint32_t b0, uint32_t b1) {
#pragma unroll
        for (int ps = 0; ps < kPasses; ++ps) {
          mma_16816<T>(o[ps][n], a[ps], b0, b1);
          if constexpr (split_p) mma_16816<T>(o[ps][n], r[ps], b0, b1);
        }
      };
      if constexpr (kV8) {
        constexpr int kLaneBytes = S::kDim / 8;  // one byte per n-tile
        uint32_t w[4][kLaneBytes / 4];           // keys 16 kk + (2t, 2t+1, 2t+8, 2t+9)
        v_words_8bit<kLaneBytes>(st, kk, lane, w);
        if constexpr (kInt8) {  // bias by 128 once per word (i8x2_biased_to_f16x2)
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < kLaneBytes / 4; ++c) w[i][c] ^= 0x80808080u;
        }
#pragma unroll
        for (int c = 0; c < kLaneBytes / 4; ++c)  // n-tiles 4c .. 4c + 3
#pragma unroll
          for (int h = 0; h < 2; ++h) {            // n-tiles 4c + 2h, 4c + 2h + 1
            const uint32_t sel = h == 0 ? 0x5140u : 0x7362u;  // the two keys' bytes 2h, 2h + 1
            const uint32_t lo = prmt(w[0][c], w[1][c], sel), hi = prmt(w[2][c], w[3][c], sel);
            uint32_t bl[2], bh[2];  // lo's and hi's two key pairs as f16x2
            if constexpr (kInt8) {
              bl[0] = v8x2_to_f16x2(lo), bl[1] = v8x2_to_f16x2(lo >> 16);
              bh[0] = v8x2_to_f16x2(hi), bh[1] = v8x2_to_f16x2(hi >> 16);
            } else {
              fp8x4_to_f16x2x2<S::kVDtype>(lo, bl[0], bl[1]);
              fp8x4_to_f16x2x2<S::kVDtype>(hi, bh[0], bh[1]);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) mma_n(4 * c + 2 * h + e, bl[e], bh[e]);
          }
      } else {
        const int vrow = 16 * kk + lane % 8 + 8 * ((lane / 8) % 2), vchunk = lane / 16;
        const uint32_t vbase = smem_u32(st.v) + (S::kTma ? 0u : uint32_t(vrow * S::kVStride + 16 * vchunk));
#pragma unroll
        for (int n2 = 0; n2 < kNTiles / 2; ++n2) {
          uint32_t b[4];  // channels 16 n2 + (0-7 | 8-15) x keys (0-7 | 8-15)
          ldmatrix_x4_trans(b, S::kTma ? vbase + S::Swz::at(vrow, 2 * n2 + vchunk) : vbase + uint32_t(n2 * 32));
          mma_n(2 * n2, b[0], b[1]);
          mma_n(2 * n2 + 1, b[2], b[3]);
        }
      }
    }
  }

  // Two 8-bit V values (low 16 bits; int8: biased by 128) as f16x2, exact.
  static FS_DEV uint32_t v8x2_to_f16x2(uint32_t two) {
    if constexpr (kInt8) return i8x2_biased_to_f16x2(two);
    else return fp8x2_to_f16x2<S::kVDtype>(two);
  }

  // One tile; kSplitP: fp32 outputs (accumulate), chosen once per CTA by the caller.
  template <bool kSplitP>
  FS_DEV void consume(const AttnParams& p, const Stage<S>& st, int64_t t0, int lane) {
    const uint32_t bad = *st.bad;
    Scores s;
    scores(st, lane, s);
    softmax(p, t0, bad, lane, s);
    accumulate<kSplitP>(st, lane, s);
  }

  // The warp's state into the merge area: mo [kWarps, kRows, kD], ms [kWarps, kRows, 2].
  FS_DEV void spill(float* mo, float* ms, int warp, int nrows, int lane) {
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[ps][r] += __shfl_xor_sync(kFullMask, l[ps][r], 1);
        l[ps][r] += __shfl_xor_sync(kFullMask, l[ps][r], 2);
        const int j = 16 * ps + lane / 4 + 8 * r;
        if (j >= nrows) continue;
        if constexpr (kV8) {  // column c of n-tile n is channel c D/8 + n
          float* row = mo + (warp * S::kRows + j) * S::kDim + 2 * (lane % 4) * kNTiles;
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
            row[n] = o[ps][n][2 * r];
            row[kNTiles + n] = o[ps][n][2 * r + 1];
          }
        } else {
          float* row = mo + (warp * S::kRows + j) * S::kDim + 2 * (lane % 4);
#pragma unroll
          for (int n = 0; n < kNTiles; ++n)
            *reinterpret_cast<float2*>(row + 8 * n) = make_float2(o[ps][n][2 * r], o[ps][n][2 * r + 1]);
        }
        if (lane % 4 == 0) {
          ms[(warp * S::kRows + j) * 2] = m[ps][r];
          ms[(warp * S::kRows + j) * 2 + 1] = l[ps][r];
        }
      }
  }
};

}  // namespace flashserve::kernels::decode
