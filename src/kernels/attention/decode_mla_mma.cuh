// The MLA absorbed-decode kernel on mma.sync (sm80+; decode_mla.cuh has the scheme and what every
// MLA decode kernel shares): the copies of a load tile, step 1 (S = Q [k | v]^T), step 3
// (O += P V), the tile loop of a row group and the entry point.
//
// Per 32-key tile (1152 B per key: 36,864 B of KV):
//   kM = 64 (H = 128, 8 warps, 1 CTA per SM, two CTAs per sequence share the tile through L2):
//     4.46 MFLOP = 1088 mma (S 576, P V 512); shared-memory reads ~360 KB (S: per warp 36 Q and
//     36 K ldmatrix.x4 = 36 KB; P V: per warp 8 P and 8 V ldmatrix.x4 = 8 KB; S/P 20 KB) plus
//     36 KB of cp.async writes; 4 barriers. At ~128 B/clk of shared memory the tile needs
//     ~3100 clk against ~1750 clk of mma.sync issue (~0.6 m16n8k16 per clk per SM): shared
//     memory bound, ~4.46 MFLOP / 3100 clk x 1.83 GHz x 132 SMs = ~350 TFLOP/s ideal, ~200-250
//     expected with the barriers (30-35% of a ~700 TFLOP/s bf16 GEMM; the 60% target needs the
//     Q re-reads gone: wgmma with Q from shared-memory descriptors, or Q held in registers
//     over a split contraction).
//   kM = 16 (H = 16, 4 warps, 2 CTAs per SM): 1.11 MFLOP = 272 mma; shared-memory reads ~150 KB
//     (S: per warp 36 Q + 18 K ldmatrix.x4; P V: per warp 2 P + 16 V) + 36 KB of writes. At
//     85% of the copy ceiling (3.64 TB/s = ~15 B/clk per SM) an SM must retire a tile every
//     ~2450 clk: ~1450 clk of shared memory (60%), mma ~450 clk; 72 KB in flight per SM (one
//     tile per CTA while the other is consumed) against ~41 KB of bandwidth x latency. Bound
//     by HBM when the grid fills >= 2 CTAs per SM: predicted 3.3-3.7 TB/s at B=64 L=4k; B=1
//     L=32k is bounded by the planner's split count (stream_splits: 32 splits of 1024 keys =
//     32 CTAs on 132 SMs) to ~25% until the planner splits MLA finer.
//     Measured (H200, B=64 L=4k block 64, waiting for tile k before issuing k + 1): 0.124 ms,
//     2.43 TB/s (57%): per SM 18.4 B/ns, i.e. each CTA retired a 37 KB tile every ~4 us,
//     about twice the tile's compute plus a loaded HBM latency; with that order a CTA had
//     ONE tile in flight while it waited (the next stage was free but not yet issued), so an
//     SM had <= 74 KB in flight only while both CTAs computed and ~37-74 KB while they waited.
//     Issuing k + 1 first (decode_mla.cuh's scheme; one barrier more) keeps two tiles per CTA
//     in flight during the wait: predicted 3.0-3.5 TB/s (70-80%) if the stream was latency-bound as these
//     numbers say; if it was bound by the per-tile compute instead, ~1-3% slower (the barrier).
//
// fp8 latent cache (decode_mla.cuh: f16 operands, q staged as f16, descales):
//   Load tiles of 64 keys (64 x 592 B = 37.9 KB per stage, as a 32-key 16-bit tile), computed
//   as two 32-key tiles (the steps above; one more barrier between them, so the barriers per
//   byte are unchanged).
//   S: the channels of each 16-channel k-step are permuted (fp8_q_column, applied to Q's
//   staging) so that ldmatrix on fp8 key rows (a 16-byte row = one k-step of a key) hands lane
//   (g, t) exactly its B fragment: one ldmatrix.x4 = four k-steps of 8 keys, two cvt per k-step.
//   P V: the output channels are permuted instead (n-tile n's column g is channel
//   w kCols + g kNTiles + n): lane (g, t) reads kNTiles contiguous bytes (LDS.128 at kM = 16,
//   LDS.64 at kM = 64) of keys 16 kk + (2t, 2t+1, 2t+8, 2t+9) and pairs them with PRMT; the
//   epilogue writes the channels back in order. KV rows are 592 B (= 80 mod 128): the
//   ldmatrix rows and the V loads of a quarter- (half-) warp hit distinct banks.
//   Per 32-key compute tile, kM = 16 (per warp): 36 Q + 9 K ldmatrix.x4, 36 + 32 mma, 72 + 64
//   cvt, 16 PRMT, 8 LDS.128, 2 P ldmatrix. The conversions are the tightest pipe: the latent's
//   v channels are converted twice (S's contraction and P V's B operand): 544 f16x2
//   conversions per key; at 16 per clk per SM (the F2FP rate decode_mma.cuh assumes) ~34 clk
//   per 576-byte key, ~17 B/clk per SM = ~4.1 TB/s on 132 SMs at 1.83 GHz before any overlap
//   loss. Shared memory per 37.9 KB load tile: Q re-reads 147 KB (twice bf16's per byte), K
//   37 KB, V 32 KB, cp.async 38 KB: ~250 KB, ~2000 clk at 128 B/clk against ~2450 clk for 85%
//   of the copy ceiling. Predicted (B=64 L=4k H=16): 2.9-3.4 TB/s of fp8 bytes (time 0.55-0.65x
//   bf16's); B=1 L=32k bounded by the split count as bf16. kM = 64 (H = 128): the 4 m-blocks'
//   warps each convert the same K (4x): ~2800 clk of conversions per 32-key tile, about bf16's
//   ~3100 clk of shared memory: about bf16's time per key (0.9-1.2x). Next: K converted once per
//   tile at kM = 64 (an f16 copy in shared memory), or integer unpacking (PRMT + LOP3, exact but
//   for NaN) for part of the conversions to take load off the F2FP pipe.
#pragma once

#include <cstdint>

#include "kernels/attention/decode_mla.cuh"

namespace flashserve::kernels::mla {

// The copies of a located load tile (kL keys) into a stage: K (kKChunks chunks per key) at the
// row's start, V (kVChunks) after it; skipped and bad keys as zero rows; warp 0 sets the stage's
// bad masks.
template <class S>
FS_DEV void issue_kv(const AttnParams& p, const TokenLoc* loc, uint32_t* bad, uint32_t stage) {
  const int tid = int(threadIdx.x);
  set_bad_masks<S>(loc, bad);
  const char* kg = static_cast<const char*>(p.k.data);
  const char* vg = static_cast<const char*>(p.v.data);
#pragma unroll
  for (int it = 0; it < S::kL * S::kKChunks / S::kThreads; ++it) {
    const int i = tid + it * S::kThreads, r = i / S::kKChunks, c = i % S::kKChunks;
    const TokenLoc& L = loc[r];
    cp_async_16(stage + S::kv_at(r, c), kg + L.k_off * S::kVb + c * 16, L.state == kTokenValid);
  }
#pragma unroll
  for (int it = 0; it < S::kL * S::kVChunks / S::kThreads; ++it) {
    const int i = tid + it * S::kThreads, r = i / S::kVChunks, c = i % S::kVChunks;
    const TokenLoc& L = loc[r];
    cp_async_16(stage + S::kv_at(r, S::kKChunks + c), vg + L.v_off * S::kVb + c * 16, L.state == kTokenValid);
  }
}

// Step 1: S [kM, 32] (fp32, rows kSStride bytes apart) = Q [k | v]^T, the warp's m-block and key slice.
template <class S>
FS_DEV void compute_s(uint32_t q, uint32_t kv, unsigned char* sbuf, int warp, int lane) {
  using T = typename S::T;
  const int mb = warp / S::kWarpsPerMBlock, k0 = (warp % S::kWarpsPerMBlock) * S::kKeysPerWarp;
  const uint32_t qa = q + uint32_t((16 * mb + lane % 8 + 8 * ((lane / 8) % 2)) * S::kRowBytes + 16 * (lane / 16));
  float acc[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  if constexpr (S::kKeysPerWarp == 16) {
    // matrices: keys 0-7 (channels lo | hi), keys 8-15 (lo | hi) of k-step ks
    const uint32_t kb = kv + uint32_t((k0 + lane % 8 + 8 * (lane / 16)) * S::kKvRow + 16 * ((lane / 8) % 2));
#pragma unroll 6
    for (int ks = 0; ks < S::kKSteps; ++ks) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, qa + uint32_t(ks * 32));
      ldmatrix_x4(b, kb + uint32_t(ks * 32));
      mma_16816<T>(acc[0], a, b[0], b[1]);
      mma_16816<T>(acc[1], a, b[2], b[3]);
    }
  } else {
    // matrices: keys 0-7 x channels (lo | hi) of k-steps 2 ks2 and 2 ks2 + 1; two chains
    const uint32_t kb = kv + uint32_t((k0 + lane % 8) * S::kKvRow + 16 * (lane / 8));
#pragma unroll 6
    for (int ks2 = 0; ks2 < S::kKSteps / 2; ++ks2) {
      uint32_t a0[4], a1[4], b[4];
      ldmatrix_x4(b, kb + uint32_t(ks2 * 64));
      ldmatrix_x4(a0, qa + uint32_t(ks2 * 64));
      ldmatrix_x4(a1, qa + uint32_t(ks2 * 64 + 32));
      mma_16816<T>(acc[0], a0, b[0], b[1]);
      mma_16816<T>(acc[1], a1, b[2], b[3]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][e] += acc[1][e];
  }
  const int row = 16 * mb + lane / 4;
#pragma unroll
  for (int n = 0; n < S::kKeysPerWarp / 8; ++n) {
    const int col = k0 + 8 * n + 2 * (lane % 4);
    *reinterpret_cast<float2*>(sbuf + row * S::kSStride + col * 4) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(sbuf + (row + 8) * S::kSStride + col * 4) = make_float2(acc[n][2], acc[n][3]);
  }
}

// Step 1 for fp8 KV: S [kM, 32] = Q [k | v]^T with K's B fragments by ldmatrix on the fp8 rows
// (one x4 = four k-steps of 8 keys; fp8_q_column's order) converted in registers to f16x2 (exact).
// Each operand's descale on its own part: S = k_desc q.k + v_desc q_v.v (the k and v of a latent
// row are two tensors with their own descales, as the CPU reference dequantizes them); the row's
// 2^-shift (RowMeta::qk_scale) is applied by the softmax.
template <class S, DType kKv>
FS_DEV void compute_s_fp8(uint32_t q, uint32_t kv, unsigned char* sbuf, int warp, int lane, float k_desc,
                          float v_desc) {
  constexpr int kNb = S::kKeysPerWarp / 8;  // n8 key blocks per warp
  const int mb = warp / S::kWarpsPerMBlock, k0 = (warp % S::kWarpsPerMBlock) * S::kKeysPerWarp;
  const uint32_t qa = q + uint32_t((16 * mb + lane % 8 + 8 * ((lane / 8) % 2)) * S::kRowBytes + 16 * (lane / 16));
  const uint32_t kb = kv + uint32_t((k0 + lane % 8) * S::kKvRow + 16 * (lane / 8));
  // Chunk c = k-steps 4c..4c+3 (64 channels): chunk 0 is k (rope) against q, chunks 1-8 are v
  // (latent) against q_v.
  auto chunk = [&](int c, float (&acc)[2][4]) {
    uint32_t w[kNb][4];
#pragma unroll
    for (int n = 0; n < kNb; ++n) ldmatrix_x4(w[n], kb + uint32_t(n * 8 * S::kKvRow + c * 64));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      ldmatrix_x4(a, qa + uint32_t((4 * c + j) * 32));
#pragma unroll
      for (int n = 0; n < kNb; ++n) {
        uint32_t b0, b1;
        decode::fp8x4_to_f16x2x2<kKv>(w[n][j], b0, b1);
        mma_16816<__half>(acc[kNb == 2 ? n : j % 2], a, b0, b1);
      }
    }
  };
  static_assert(kMlaD == 64, "chunk 0 is k");
  float acc[2][4], ak[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = ak[n][e] = 0.0f;
#pragma unroll 3
  for (int c = 1; c < S::kKSteps / 4; ++c) chunk(c, acc);
  chunk(0, ak);
  descale_s(acc, ak, k_desc, v_desc);
  if constexpr (kNb == 1) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][e] += acc[1][e];
  }
  const int row = 16 * mb + lane / 4;
#pragma unroll
  for (int n = 0; n < kNb; ++n) {
    const int col = k0 + 8 * n + 2 * (lane % 4);
    *reinterpret_cast<float2*>(sbuf + row * S::kSStride + col * 4) = make_float2(acc[n][0], acc[n][1]);
    *reinterpret_cast<float2*>(sbuf + (row + 8) * S::kSStride + col * 4) = make_float2(acc[n][2], acc[n][3]);
  }
}

// Step 3: O = O * alpha + P V over the tile, the warp's output columns for all rows.
template <class S, DType kKv>
FS_DEV void accumulate_pv(const unsigned char* kvp, const unsigned char* sbuf, const float* rscale, int warp, int lane,
                          float (&o)[S::kMBlocks][S::kNTiles][4]) {
  using T = typename S::T;
  float al[S::kMBlocks][2];
  bool moved = false;
#pragma unroll
  for (int mb = 0; mb < S::kMBlocks; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      al[mb][r] = rscale[16 * mb + lane / 4 + 8 * r];
      moved |= al[mb][r] != 1.0f;
    }
  if (__any_sync(kFullMask, moved)) {
#pragma unroll
    for (int mb = 0; mb < S::kMBlocks; ++mb)
#pragma unroll
      for (int n = 0; n < S::kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mb][n][e] *= al[mb][e / 2];
  }
  const uint32_t pbase = smem_u32(sbuf) + uint32_t((lane % 8 + 8 * ((lane / 8) % 2)) * S::kSStride + 16 * (lane / 16));
  if constexpr (S::kFp8) {
    // V's output channels permuted: n-tile n's column g is channel warp kCols + g kNTiles + n, so
    // lane (g, t) reads kNTiles contiguous bytes of keys 16 kk + (2t, 2t+1, 2t+8, 2t+9) and pairs
    // the keys' bytes with PRMT (the epilogue writes the channels back in order).
    constexpr int kB = S::kNTiles, kW = kB / 4;
    const int g = lane / 4, t = lane % 4;
    const unsigned char* vrow = kvp + S::kKBytes + warp * S::kCols + g * kB;
#pragma unroll
    for (int kk = 0; kk < S::kN / 16; ++kk) {
      uint32_t a[S::kMBlocks][4];
#pragma unroll
      for (int mb = 0; mb < S::kMBlocks; ++mb) ldmatrix_x4(a[mb], pbase + uint32_t(16 * mb * S::kSStride + kk * 32));
      uint32_t w[4][kW];
#pragma unroll
      for (int r = 0; r < 4; ++r) decode::load_words<kB>(vrow + (16 * kk + 2 * t + (r % 2) + 8 * (r / 2)) * S::kKvRow, w[r]);
#pragma unroll
      for (int i = 0; i < kW; ++i) {
        const uint32_t ab[2] = {decode::prmt(w[0][i], w[1][i], 0x5140u), decode::prmt(w[0][i], w[1][i], 0x7362u)};
        const uint32_t cd[2] = {decode::prmt(w[2][i], w[3][i], 0x5140u), decode::prmt(w[2][i], w[3][i], 0x7362u)};
        uint32_t fab[4], fcd[4];  // j -> the f16x2 of ab / cd's key pair j
        decode::fp8x4_to_f16x2x2<kKv>(ab[0], fab[0], fab[1]);
        decode::fp8x4_to_f16x2x2<kKv>(ab[1], fab[2], fab[3]);
        decode::fp8x4_to_f16x2x2<kKv>(cd[0], fcd[0], fcd[1]);
        decode::fp8x4_to_f16x2x2<kKv>(cd[1], fcd[2], fcd[3]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t b0 = fab[j], b1 = fcd[j];
#pragma unroll
          for (int mb = 0; mb < S::kMBlocks; ++mb) mma_16816<__half>(o[mb][4 * i + j], a[mb], b0, b1);
        }
      }
    }
  } else {
    const uint32_t kv = smem_u32(kvp);
    const uint32_t vbase =
        kv + uint32_t((lane % 8 + 8 * ((lane / 8) % 2)) * S::kKvRow + S::kKBytes + warp * S::kCols * 2 + 16 * (lane / 16));
#pragma unroll
    for (int kk = 0; kk < S::kN / 16; ++kk) {
      uint32_t a[S::kMBlocks][4];
#pragma unroll
      for (int mb = 0; mb < S::kMBlocks; ++mb) ldmatrix_x4(a[mb], pbase + uint32_t(16 * mb * S::kSStride + kk * 32));
#pragma unroll
      for (int n2 = 0; n2 < S::kNTiles / 2; ++n2) {
        uint32_t b[4];  // channels 16 n2 + (0-7 | 8-15) x keys 16 kk + (0-7 | 8-15)
        ldmatrix_x4_trans(b, vbase + uint32_t(16 * kk * S::kKvRow + n2 * 32));
#pragma unroll
        for (int mb = 0; mb < S::kMBlocks; ++mb) {
          mma_16816<T>(o[mb][2 * n2], a[mb], b[0], b[1]);
          mma_16816<T>(o[mb][2 * n2 + 1], a[mb], b[2], b[3]);
        }
      }
    }
  }
}

// One row group: packed rows [g0, g0 + nrows) of the CTA's sequence.
template <class S>
FS_DEV void run_rows(const AttnParams& p, const DecodeSeq& s, int64_t g0, int nrows, int split, unsigned char* sm) {
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const auto [q, kv, sbuf, meta, rscale, loc, bad] = RowSmem<S>(sm);
  unsigned char* kvp = sm + S::kKvOff;
  const KeyRange u = start_rows<S>(p, s, g0, nrows, q, meta);
  const int row = tid / S::kTpr, part = tid % S::kTpr;
  RowRegs rr = row_regs(meta[row]);
  float o[S::kMBlocks][S::kNTiles][4];
#pragma unroll
  for (int mb = 0; mb < S::kMBlocks; ++mb)
#pragma unroll
    for (int n = 0; n < S::kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mb][n][e] = 0.0f;

  // Compute tiles of kN keys from base (aligned to the split's start); load tiles of kL = kSub
  // compute tiles (the last one's trailing compute tiles past u.hi are skipped zero rows).
  constexpr int kN = S::kN, kL = S::kL;
  const int64_t base = s.range.begin + (u.lo - s.range.begin) / kN * kN;
  const int64_t nsub = u.lo < u.hi ? (u.hi - base + kN - 1) / kN : 0;
  const int64_t nload = (nsub + S::kSub - 1) / S::kSub;
  auto locate_load = [&](int64_t t0) {
#pragma unroll
    for (int h = 0; h < S::kSub; ++h) locate<S>(p, s, t0 + h * kN, u, loc + h * 32, lane);
  };
  if (nload > 0) {
    if (warp == 0) locate_load(base);
    __syncthreads();
    issue_kv<S>(p, loc, bad, kv);
  }
  cp_async_commit();  // Q (16-bit KV) + load tile 0
  if constexpr (S::kFp8) {
    cp_async_wait<1>();  // q landed (load tile 0 may still be in flight)
    __syncthreads();
    convert_q_fp8<S>(sm + S::kQOff, meta);
    __syncthreads();
  }
  rr.qk = meta[row].qk_scale;
  if (nload > 1) {
    __syncthreads();  // load tile 0's locations are read
    if (warp == 0) locate_load(base + kL);
  }
  for (int64_t k = 0; k < nload; ++k) {
    const int st = int(k & 1);
    // Load tile k + 1 is issued as soon as its stage is free, before waiting for tile k: two
    // tiles in flight per CTA while it waits (one barrier more per load tile than waiting first).
    __syncthreads();  // every warp is done with tile k - 1 (its stage is free); k + 1's locations are written
    if (k + 1 < nload) issue_kv<S>(p, loc, bad + (st ^ 1) * S::kSub, kv + uint32_t((st ^ 1) * S::kStageBytes));
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // load tile k landed (every thread's copies)
#pragma unroll
    for (int h = 0; h < S::kSub; ++h) {
      const int64_t sub = k * S::kSub + h;
      if (sub >= nsub) break;  // CTA-uniform
      const size_t off = size_t(st) * S::kStageBytes + size_t(h) * kN * S::kKvRow;
      if (h > 0) __syncthreads();  // every warp is done with the previous compute tile's P and alpha
      // warp 0: the block-table reads of load tile k + 2 in flight during S and the softmax
      // (located after the softmax: the entries stay int32 until then, so nothing waits on
      // them); kM = 64 (8 warps at 255 registers) reads and locates after the softmax.
      constexpr bool kEarly = S::kM == 16;
      decode::TileKey next[S::kSub];
      if (kEarly && h == 0 && warp == 0 && k + 2 < nload) {
#pragma unroll
        for (int hh = 0; hh < S::kSub; ++hh)
          next[hh] = decode::tile_key<kN>(p, s.kv, base + (k + 2) * kL + hh * kN, u.lo, u.hi, lane);
      }
      if constexpr (S::kFp8) compute_s_fp8<S, S::kKvDt>(q, kv + uint32_t(off), sbuf, warp, lane, s.kv.k_desc, s.kv.v_desc);
      else compute_s<S>(q, kv + uint32_t(off), sbuf, warp, lane);
      __syncthreads();  // S complete; load tile k + 1's locations are read
      softmax_rows<S>(p, sbuf, rscale, bad[st * S::kSub + h], base + sub * kN, rr, row, part);
      if (h == 0 && warp == 0 && k + 2 < nload) {
        if constexpr (kEarly) {
#pragma unroll
          for (int hh = 0; hh < S::kSub; ++hh) loc[hh * 32 + lane] = decode::tile_loc(p, s.kv, next[hh]);
        } else {
          locate_load(base + (k + 2) * kL);
        }
      }
      __syncthreads();  // P and alpha complete
      accumulate_pv<S, S::kKvDt>(kvp + off, sbuf, rscale, warp, lane, o);
    }
  }
  cp_async_wait<0>();
  finish_rows<S>(p, s, g0, nrows, split, rscale, rr, row, part);
  store_o<S, S::kMBlocks, S::kNTiles, S::kFp8>(p, s, g0, nrows, split, rscale, o, 0, warp * S::kCols, lane);
}

// kM = 16: two CTAs per SM (shared memory); kM = 64: one, 8 warps (<= 255 registers).
template <DType kDt, DType kKv, int kM>
__global__ void __launch_bounds__(32 * mla_warps(kM), kM == 16 ? 2 : 1)
    decode_mla_fwd(const __grid_constant__ AttnParams p) {
  using S = Shape<kDt, kKv, kM>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  for_row_groups<kM>(p, [&](const DecodeSeq& s, int64_t g0, int nrows, int split) {
    run_rows<S>(p, s, g0, nrows, split, smem_raw);
  });
}

}  // namespace flashserve::kernels::mla
