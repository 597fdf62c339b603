// Warpgroup tensor-core primitives of the sm_90a kernels: shared-memory matrix descriptors for
// 128-byte-swizzled tiles, the wgmma fence / commit / wait, the async-proxy fence that makes
// generic-proxy shared-memory writes (cp.async, st.shared) visible to wgmma, and the
// instruction wrappers (wgmma_mma.cuh, generated).
//
// The tile layout every operand uses (SwizzledTile): a tile of `Rows` rows x D 16-bit values
// is stored as D / 64 column blocks of [Rows, 64], each row of a block 128 bytes, 16-byte chunk
// c of row r at chunk c ^ (r % 8). With the tile 1024-byte aligned this is the canonical
// 128-byte swizzle of wgmma (address bits [4, 7) XOR bits [7, 10)), for both operand majors:
//   K-major (A = Q, B = K: the reduction runs along a row): 8-row groups 1024 bytes apart
//     (stride byte offset); one k16 step is 32 bytes into the row, a column block further
//     Rows x 128 bytes;
//   N-major (B = V of P V: the reduction runs over rows = keys): an atom is 8 keys x 64
//     channels, the next 64 channels a column block further (leading byte offset Rows x 128),
//     the next 8 keys 1024 bytes further (stride byte offset); a k16 step is 16 rows.
#pragma once

#include <cstdint>

#include "kernels/common/mma.cuh"
#include "kernels/common/wgmma_mma.cuh"

namespace flashserve::kernels {

template <int Rows>
struct SwizzledTile {
  static_assert(Rows % 8 == 0, "whole 8-row swizzle atoms");
  static constexpr uint32_t kBlockBytes = uint32_t(Rows) * 128u;  // one 64-channel column block
  static FS_DEV uint32_t at(int row, int chunk) {
    return uint32_t(chunk >> 3) * kBlockBytes + uint32_t(row) * 128u + (uint32_t((chunk & 7) ^ (row & 7)) << 4);
  }
};

// A wgmma shared-memory descriptor: start address, leading / stride byte offsets (16-byte
// units), 128-byte swizzle (layout type 1 in bits 62-63), base offset 0 (atoms 1024-aligned).
FS_DEV uint64_t smem_desc_sw128(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lead_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t((stride_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

// The descriptor of an operand `bytes` (a multiple of 16) further in shared memory than d's:
// the start address field (bits 0-13) holds address >> 4, which stays below 2^14 for every
// shared address (< 256 KB), so the add never carries into the other fields. Built from one
// masked base per tile, the k steps' descriptors cost one integer add each (and stay in
// uniform registers when the base is warp-uniform: warp_uniform), where a full build per
// wgmma made its issue a dependent chain of ~9 instructions.
FS_DEV uint64_t desc_plus(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}

// Bytes from a K-major SwizzledTile<Rows>'s start to its k16 step kk (column block kk / 4, 32
// bytes per step into it): a descriptor's k steps are its base's plus this / 16.
template <int Rows>
constexpr uint32_t k_step_bytes(int kk) {
  return uint32_t(kk >> 2) * SwizzledTile<Rows>::kBlockBytes + uint32_t(kk & 3) * 32u;
}

// K-major operand rows [row0, row0 + 8 m) of a SwizzledTile<Rows> at `tile`, k16 step kk.
template <int Rows>
FS_DEV uint64_t desc_k_major(uint32_t tile, int row0, int kk) {
  return desc_plus(smem_desc_sw128(tile, 16u, 1024u), k_step_bytes<Rows>(kk) + uint32_t(row0) * 128u);
}

// N-major operand (N = the tile's channels, K = its rows), rows [16 kk, 16 kk + 16).
template <int Rows>
FS_DEV uint64_t desc_n_major(uint32_t tile, int kk) {
  return desc_plus(smem_desc_sw128(tile, SwizzledTile<Rows>::kBlockBytes, 1024u), uint32_t(kk) * 16u * 128u);
}

// x as the compiler may keep in a uniform register: lane 0's value (every lane of the warp
// must hold the same x and take part). Shared-memory addresses and warpgroup indices that feed
// wgmma descriptors go through it.
FS_DEV uint32_t warp_uniform(uint32_t x) { return __shfl_sync(0xFFFFFFFFu, x, 0); }

FS_DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FS_DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
FS_DEV void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// This thread's completed generic-proxy shared-memory writes, visible to the async proxy.
FS_DEV void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The barrier before wgmma reads cp.async-filled tiles: this thread's copies but the newest
// kPending groups complete and visible to the async proxy, then every thread's.
template <int kPending>
FS_DEV void landed_barrier() {
  cp_async_wait<kPending>();
  fence_proxy_async_shared();
  __syncthreads();
}

// stmatrix.x4 (sm_90): four 8 x 8 16-bit matrices to shared memory; lanes 8m .. 8m + 7 give
// the row addresses of matrix m, whose row g gets register rm's of lanes 4g .. 4g + 3 (lane
// (g, t)'s at byte 4t): ldmatrix's non-transposed layout.
FS_DEV void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// stmatrix.x4.trans: the same four matrices stored transposed: memory row r of matrix m (the
// address of lane 8 m + r) receives column r of it (elements (0..7, r), 16 bytes).
FS_DEV void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The first 1024-byte-aligned address at or after p in shared memory (swizzle atoms; the
// kernels ask for 1024 bytes more than their layout).
FS_DEV unsigned char* align_1024(unsigned char* p) { return p + ((1024u - smem_u32(p) % 1024u) % 1024u); }

// Keeps the compiler from moving accesses of accumulator registers across the async MMA.
template <int N>
FS_DEV void fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// The same for the A fragments of in-flight register-A wgmmas (live until the wait that retires
// them).
template <int N>
FS_DEV void fence_fragments(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

}  // namespace flashserve::kernels
