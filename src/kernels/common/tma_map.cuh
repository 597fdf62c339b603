// Host side of the TMA loads (tma.cuh): a tensor map over a 16-bit or fp8 operand in the
// normalized 4-D view of params.hpp ([dim0, dim1, heads, channels], strides in elements,
// channels contiguous), whose box is one 128-byte column block (64 16-bit or 128 fp8 channels)
// of `box_rows` rows of one head: the [box_rows, 128 bytes] block of a SwizzledTile (wgmma.cuh)
// with the 128-byte swizzle. Elements out of
// the tensor's bounds load as zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zero fill, the NaN
// fill being the other mode), and a box completes its full size in the mbarrier's transaction
// bytes all the same: rows past the last one, and channels past a head size that is not a
// multiple of 64 (D = 96: the box at channel 64 brings 64..95 and zeros). cuTensorMapEncodeTiled
// comes through the runtime's driver entry point (no link against libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/attention/params.hpp"

namespace flashserve::kernels {

// The map over `ref` ([d0, d1, heads, channels] of sizes n0 .. n3); `what` names the operand in
// errors. The TMA coordinates of a box are (c x the box's channels, head, row in dim1, index in
// dim0).
CUtensorMap make_tma_map(const StridedRef& ref, int64_t n0, int64_t n1, int64_t heads, int64_t channels,
                         int box_rows, const char* what);

// Whether `ref` suits a TMA map: 16-byte aligned base, 16-byte multiple strides (dims longer
// than 1), channels contiguous, every size in [1, 2^31).
bool tma_mappable(const StridedRef& ref, int64_t n0, int64_t n1, int64_t heads, int64_t channels);

}  // namespace flashserve::kernels
