// The context-parallel KV layout (SPEC.md §6, decode context parallelism), shared by the host
// (API checks, reference, planner, builder, layer) and the kernels' masks.
//
// With `world` ranks and an interleave of I tokens (vLLM's cp_kv_cache_interleave_size),
// position t of a sequence lives on rank (t / I) % world, at local index
// (t / (I * world)) * I + t % I: runs of I consecutive tokens are dealt round-robin. I = 1 is
// the token-wise layout (rank t % world, local index t / world). Local -> global is
// increasing, so the keys a causal query sees on one rank are a prefix of its local keys.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FS_CP_HD __host__ __device__ __forceinline__
#else
#define FS_CP_HD inline
#endif

namespace flashserve {

// How many of the positions [0, len) live on `rank` (len <= 0: none).
FS_CP_HD int64_t cp_local_len(int64_t len, int64_t world, int64_t rank, int64_t interleave) {
  if (len <= 0) return 0;
  const int64_t span = world * interleave, full = len / span;
  const int64_t rem = len - full * span - rank * interleave;
  return full * interleave + (rem < 0 ? 0 : (rem > interleave ? interleave : rem));
}

// The global position of local key `local` of `rank`.
FS_CP_HD int64_t cp_global_pos(int64_t local, int64_t world, int64_t rank, int64_t interleave) {
  return (local / interleave) * world * interleave + rank * interleave + local % interleave;
}

// The rank that holds position `pos` (pos >= 0) and its local index there.
FS_CP_HD int64_t cp_owner(int64_t pos, int64_t world, int64_t interleave) { return (pos / interleave) % world; }
FS_CP_HD int64_t cp_local_index(int64_t pos, int64_t world, int64_t interleave) {
  return (pos / (interleave * world)) * interleave + pos % interleave;
}

}  // namespace flashserve
