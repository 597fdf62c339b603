// The extension module flashserve._C: error translation, build facts, device queries, and the
// registration of the binding files. flashserve::Error (an std::invalid_argument) reaches
// Python as ValueError through nanobind's standard translation; NotImplemented is mapped to
// NotImplementedError here; RuntimeError stays RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>
#include <tuple>

#include "convert.hpp"
#include "flashserve/backend.hpp"
#include "flashserve/plan.hpp"
#include "flashserve/status.hpp"

namespace nb = nanobind;

namespace flashserve::py {

namespace {

// Why flashserve cannot run on this device ("" when it can): the backend's capability check.
std::string device_unsupported_reason(const std::string& type, int index) {
  try {
    const DeviceProps dev = device_props(parse_device(type, index));
    if (!backend::Capabilities::supports_compute_capability(dev))
      return detail::cat("compute capability ", dev.cc_major, ".", dev.cc_minor, " (flashserve needs sm80 or newer)");
  } catch (const NotImplemented& e) {
    return e.what();
  } catch (const RuntimeError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

}  // namespace flashserve::py

NB_MODULE(_C, m) {
  using namespace flashserve::py;
  m.doc() = "flashserve's C++ API (DLPack tensors in, nothing allocated)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const flashserve::NotImplemented& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

  m.attr("with_cuda") = bool(FLASHSERVE_WITH_CUDA);
  m.def(
      "device_info",
      [](const std::string& type, int index) {
        const flashserve::DeviceProps d = device_props(parse_device(type, index));
        return std::make_tuple(d.num_sms, d.cc_major, d.cc_minor);
      },
      nb::arg("type"), nb::arg("index") = 0,
      "(num_sms, cc_major, cc_minor) as the planner sees the device; CPU: (worker threads, 0, 0)");
  m.def("device_unsupported_reason", &device_unsupported_reason, nb::arg("type"), nb::arg("index") = 0,
        "Why flashserve cannot run on the device, or '' when it can");

  register_ops(m);
  register_backend(m);
  register_sglang(m);
}
