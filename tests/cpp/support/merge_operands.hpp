// Test support for merge_states (merge.hpp), shared by the CPU and GPU merge tests: the case
// description, [T, H, D] operand rows (padded or dense), LSE tensors in either layout with
// padded strides, and random LSE pairs covering every special row.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "flashserve/merge.hpp"
#include "support/host_tensor.hpp"

namespace fstest {

struct MergeCase {
  flashserve::DType a_dtype, b_dtype, out_dtype;  // out: f8*/u8 -> fp8 output with a scale
  flashserve::LseLayout layout;
  bool with_out_lse, prefill;
  bool dense = false;         // contiguous operands (else padded heads and tokens)
  bool scalar_scale = false;  // fp8 output_scale of shape [] (else [1])
  std::string str() const;
  bool fp8() const;
  flashserve::DType format() const;  // the fp8 format of the output (u8: e4m3)
};

// [T, H, D]: padded heads and tokens, or contiguous when dense.
HostTensor merge_rows(flashserve::DType t, bool dense, int64_t T, int64_t H, int64_t D);
// An fp32 LSE in `layout` ([H, T] or [T, H]) with a padded leading stride.
HostTensor lse_tensor(flashserve::LseLayout layout, int64_t T, int64_t H);
float* lse_at(const HostTensor& l, flashserve::LseLayout layout, int64_t t, int64_t h);

// LSE pairs covering finite, -inf, +inf, both-empty rows and an underflowing weight.
void fill_lse(std::mt19937_64& rng, const HostTensor& a, const HostTensor& b, flashserve::LseLayout layout, int64_t T,
              int64_t H);

}  // namespace fstest
