// Warp-level tensor-core primitives of the prefill and decode kernels (sm80+ PTX): cp.async copies into
// shared memory, ldmatrix, mma.sync m16n8k16 (f16/bf16 operands, fp32 accumulators) and m16n8k32
// (int8 operands, int32 accumulators), packing
// of fp32 pairs into 16-bit operand registers, and exp2.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 (4 regs):  a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 2t+8..),
//                      a3 (row g+8, k 2t+8..)
//   B 16x8  (2 regs):  b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g)
//   C 16x8  (4 fp32):  c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8, cols 2t, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/attention/load.cuh"

namespace flashserve::kernels {

FS_DEV uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared; `valid` false writes 16 zero bytes and reads nothing.
FS_DEV void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// 4 bytes global -> shared (both 4-byte aligned); `valid` false writes 4 zero bytes and reads nothing.
FS_DEV void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// 16 bytes (four words) to shared memory.
FS_DEV void st_shared_v4(uint32_t dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
FS_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// An arrival on the mbarrier at `bar` once every cp.async this thread issued before it has
// completed (.noinc: the arrival counts against the barrier's expected count).
FS_DEV void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
template <int kPending>
FS_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices; lane l addresses row l % 8 of matrix l / 8.
FS_DEV void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FS_DEV void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b for 16-bit element type T (__nv_bfloat16 or __half).
template <class T>
FS_DEV void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c += a * b on int8 operands, int32 accumulators (exact): mma.sync m16n8k32. Fragments (g = lane
// / 4, t = lane % 4; 4 bytes per register): A a0 (row g, k 4t..4t+3), a1 (row g+8, k 4t..), a2
// (row g, k 16+4t..), a3 (row g+8, k 16+4t..); B b0 (k 4t..4t+3, col g), b1 (k 16+4t.., col g);
// C as m16n8k16's.
FS_DEV void mma_16832_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) rounded to nearest even, lo in the low half (the lower column index).
template <class T>
FS_DEV uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The two 16-bit values of a pack2 register as floats (exact), lo first.
template <class T>
FS_DEV float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
}

// The probabilities of k16 step kk of an N-key tile (s in the C layout above, s[n8 tile][4]) as
// the A operand of P V (mma.sync m16n8k16 and wgmma m64nNk16 register A share the layout),
// rounded to the operand dtype T.
template <class T, int kN>
FS_DEV void p_fragment(const float (&s)[kN / 8][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The rounding residue of p_fragment: P - round_T(P), rounded to T, so that hi + lo carries P
// to ~2^-16 relative (fp32 outputs: P V = P_hi V + P_lo V).
template <class T, int kN>
FS_DEV void p_residue(const float (&s)[kN / 8][4], int kk, const uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* x = s[2 * kk + (i >> 1)] + 2 * (i & 1);
    const float2 h = unpack2<T>(hi[i]);
    lo[i] = pack2<T>(x[0] - h.x, x[1] - h.y);
  }
}

FS_DEV float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashserve::kernels
