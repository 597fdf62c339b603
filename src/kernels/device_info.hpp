// What the planner needs to know of a CUDA device, queried once per device and cached.
// A plain C++ header: host code includes it without CUDA headers. Defined only in CUDA builds
// (FLASHSERVE_WITH_CUDA=1).
#pragma once

#include "flashserve/plan.hpp"

namespace flashserve::kernels {

// SM count and compute capability of CUDA device `device_index`. Thread-safe; the first call
// per device queries the runtime, later calls return the cached value. Throws
// flashserve::Error for an index outside [0, device count), flashserve::RuntimeError when the
// runtime fails (no driver, no device).
DeviceProps cuda_device_props(int device_index);

}  // namespace flashserve::kernels
