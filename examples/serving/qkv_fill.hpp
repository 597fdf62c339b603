// The CUDA counterpart of Activations::fill (qkv_fill.cu): one launch writes a step's q, k and
// v rows of one layer on the device, bit for bit the values the host generates
// (activation_hash.hpp). q/k/v f16 or bf16, contiguous [>= rows, heads, D]. Plain C++ header.
#pragma once

#include "runtime.hpp"

namespace serving {

// f.device_rows holds f.rows.size() rows in device memory; `stream` is a cudaStream_t.
// Throws std::invalid_argument for another dtype, std::runtime_error when the launch fails.
void fill_qkv_cuda(const QkvFill& f, void* stream);

}  // namespace serving
