// The Python extension's shared helpers: tensors from Python objects, streams, and the
// registration functions of the binding files. The extension holds no logic: it converts
// arguments and calls the C++ API (include/flashserve/*.hpp).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include <nanobind/nanobind.h>

#include "flashserve/plan.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::py {

// A tensor argument from a Python object: a torch tensor (CPU or CUDA) or a numpy array,
// taken through DLPack. Raises ValueError "<name>: ..." when the object is not a tensor.
TensorRef tensor_arg(nanobind::handle obj, const char* name);
// As tensor_arg; None gives an empty OptTensor.
OptTensor opt_tensor_arg(nanobind::handle obj, const char* name);
// A host int32 1-D array (numpy or a CPU torch tensor) as a span (ValueError otherwise).
std::span<const int32_t> host_i32_arg(nanobind::handle obj, const char* name);
// As host_i32_arg; None gives an empty span.
std::span<const int32_t> opt_host_i32_arg(nanobind::handle obj, const char* name);
// A cudaStream_t passed as a Python int (torch.cuda.current_stream().cuda_stream); None or 0 =
// the default stream.
void* stream_arg(nanobind::handle stream);
// An ExecContext on that stream (no workspace, no plan).
ExecContext stream_context(nanobind::handle stream);
// op(args..., ctx) on `stream` with the GIL released (the call may wait on the device; other
// Python threads run meanwhile): the tail of every operation binding.
template <class Op, class... Args>
void call_on_stream(nanobind::handle stream, Op&& op, const Args&... args) {
  const ExecContext ctx = stream_context(stream);
  nanobind::gil_scoped_release nogil;
  op(args..., ctx);
}

// "cpu" or "cuda" and an index as a Device (ValueError naming `device` otherwise).
Device parse_device(const std::string& type, int index);
// The planner's view of a device (CUDA: queried once per device); NotImplemented for CUDA in
// a CPU build.
DeviceProps device_props(Device d);

// Each binding file registers its functions on the extension module `flashserve._C`.
void register_ops(nanobind::module_& m);      // python/src/bind_ops.cpp
void register_backend(nanobind::module_& m);  // python/src/bind_backend.cpp
void register_sglang(nanobind::module_& m);   // python/src/bind_sglang.cpp

}  // namespace flashserve::py
