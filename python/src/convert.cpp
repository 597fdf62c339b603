// Tensors from Python objects (convert.hpp). Two paths, both DLPack:
//  - fast: a type exposing the DLPack C exchange API (`__dlpack_c_exchange_api__`, torch >=
//    2.10) fills a DLTensor view in C, with no capsule and no Python call (~30 ns a tensor);
//  - generic: nanobind's ndarray import (`__dlpack__` / the buffer protocol): numpy, older
//    torch, any DLPack producer (FLASHSERVE_NO_DLPACK_C_API=1 forces it, for diagnosis); CUDA
//    tensors are exported with `__dlpack__(stream=-1)` (no stream synchronization, so calls
//    can be captured in CUDA graphs).
// fp8 tensors from a torch that cannot export fp8 through DLPack travel as a uint8 view and
// keep their dtype.
#include "convert.hpp"

#include <nanobind/ndarray.h>

#include <array>
#include <cstdlib>
#include <cstdint>
#include <span>
#include <string>

#include "flashserve/status.hpp"
#if FLASHSERVE_WITH_CUDA
#include "kernels/device_info.hpp"
#endif

namespace nb = nanobind;

namespace flashserve::py {

namespace {

namespace dl = nb::dlpack;

// ---- the DLPack C exchange API (dlpack.h >= 1.2), the part this file calls
struct DLTensorView {  // DLTensor
  void* data;
  dl::device device;
  int32_t ndim;
  dl::dtype dtype;
  int64_t* shape;
  int64_t* strides;  // may be null: row-major
  uint64_t byte_offset;
};
struct ExchangeApi {  // DLPackExchangeAPI
  struct { uint32_t major, minor; } version;
  void* prev_api;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensorView* out);  // may be null
  void* current_work_stream;
};

constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

// The exchange API of a Python type, or null; looked up once per type. The cache keeps each
// type and its capsule alive (the GIL guards it).
const ExchangeApi* exchange_api(PyTypeObject* type) {
  static const bool disabled = std::getenv("FLASHSERVE_NO_DLPACK_C_API") != nullptr;
  if (disabled) return nullptr;
  struct Entry { PyTypeObject* type; const ExchangeApi* api; };
  static std::array<Entry, 16> cache{};
  static size_t used = 0;
  for (size_t i = 0; i < used; ++i)
    if (cache[i].type == type) return cache[i].api;
  const ExchangeApi* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (cap && PyCapsule_CheckExact(cap))
    api = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
  PyErr_Clear();
  if (api && (api->version.major != 1 || !api->dltensor_from_py_object_no_sync)) api = nullptr;
  if (used < cache.size()) {
    Py_INCREF(reinterpret_cast<PyObject*>(type));
    cache[used++] = {type, api};
  } else {
    api = nullptr;  // an uncached type: the generic path (the capsule is not kept)
  }
  if (!api) Py_XDECREF(cap);
  return api;
}

bool dtype_of(dl::dtype t, DType& out) {
  using C = dl::dtype_code;
  if (t.lanes != 1) return false;
  const auto is = [&](C code, int bits) { return t.code == uint8_t(code) && t.bits == bits; };
  if (is(C::Float, 32)) out = DType::f32;
  else if (is(C::Float, 16)) out = DType::f16;
  else if (is(C::Bfloat, 16)) out = DType::bf16;
  else if (is(C::Float8_E4M3FN, 8)) out = DType::f8e4m3;
  else if (is(C::Float8_E5M2, 8)) out = DType::f8e5m2;
  else if (is(C::Int, 8)) out = DType::i8;
  else if (is(C::UInt, 8)) out = DType::u8;
  else if (is(C::Int, 32)) out = DType::i32;
  else if (is(C::Int, 64)) out = DType::i64;
  else if (is(C::Float, 64)) out = DType::f64;
  else return false;
  return true;
}

std::string describe_dtype(dl::dtype t) {
  return detail::cat("DLPack dtype (code ", int(t.code), ", bits ", int(t.bits), ", lanes ", t.lanes, ")");
}

TensorRef from_dlpack(const DLTensorView& t, const char* name) {
  TensorRef r;
  if (!dtype_of(t.dtype, r.dtype))
    fail_arg(name, "float16/32/64, bfloat16, float8_e4m3fn, float8_e5m2, (u)int8, int32 or int64", describe_dtype(t.dtype));
  switch (t.device.device_type) {
    case kDLCPU: case kDLCUDAHost: r.device = Device{DeviceType::cpu, 0}; break;
    case kDLCUDA: case kDLCUDAManaged: r.device = Device{DeviceType::cuda, t.device.device_id}; break;
    default: fail_arg(name, "a cpu or cuda tensor", detail::cat("DLPack device type ", t.device.device_type));
  }
  if (t.ndim < 0 || t.ndim > kMaxDims) fail_arg(name, detail::cat("at most ", kMaxDims, " dims"), t.ndim);
  r.ndim = t.ndim;
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) empty |= t.shape[d] == 0;
  int64_t row = 1;  // row-major strides, also for empty tensors (numpy gives them stride 0)
  for (int d = t.ndim - 1; d >= 0; --d) {
    r.shape[size_t(d)] = t.shape[d];
    r.stride[size_t(d)] = t.strides && !empty ? t.strides[d] : row;
    row *= t.shape[d];
  }
  r.data = static_cast<char*>(t.data) + t.byte_offset;
  return r;
}

// nanobind's import (data() includes the byte offset).
TensorRef from_ndarray(const nb::ndarray<nb::ro>& a, const char* name) {
  if (a.ndim() > size_t(kMaxDims)) fail_arg(name, detail::cat("at most ", kMaxDims, " dims"), a.ndim());
  std::array<int64_t, kMaxDims> shape{}, stride{};
  for (size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = int64_t(a.shape(d));
    stride[d] = a.stride(d);
  }
  const DLTensorView v{const_cast<void*>(a.data()), dl::device{a.device_type(), a.device_id()}, int32_t(a.ndim()),
                       a.dtype(), shape.data(), stride.data(), 0};
  return from_dlpack(v, name);
}

// str(obj)
std::string text(nb::handle obj) {
  PyObject* s = PyObject_Str(obj.ptr());
  if (!s) throw nb::python_error();
  return nb::steal<nb::str>(s).c_str();
}

// A torch fp8 tensor that DLPack would not export: its uint8 view, typed back.
bool torch_fp8_fallback(nb::handle obj, const char* name, TensorRef& out) {
  if (!nb::hasattr(obj, "dtype") || !nb::hasattr(obj, "view")) return false;
  const std::string dt = text(obj.attr("dtype"));
  DType fp8;
  if (dt == "torch.float8_e4m3fn") fp8 = DType::f8e4m3;
  else if (dt == "torch.float8_e5m2") fp8 = DType::f8e5m2;
  else return false;
  const nb::object bytes = obj.attr("view")(nb::module_::import_("torch").attr("uint8"));
  out = tensor_arg(bytes, name);  // shares obj's storage, which outlives the call
  out.dtype = fp8;
  return true;
}

std::string python_type_name(nb::handle obj) { return text(nb::handle(obj.type()).attr("__name__")); }

// The DLPack capsule of a CUDA tensor (`cuda` set), exported without stream synchronization;
// an invalid object for anything else (host arrays: numpy's __dlpack__ takes no stream) or on
// failure (e.g. a dtype this torch cannot export: the caller then tries the fp8 fallback, never
// the synchronizing __dlpack__()). torch 2.8 and 2.9 read __dlpack__() without a
// stream, which nanobind's import calls, as "synchronize with the legacy default stream": an
// event recorded on the current stream and the default stream made to wait on it, per tensor
// and call, and inside CUDA graph capture an error ("operation not permitted when stream is
// capturing"). stream=-1 asks for no synchronization (every torch with DLPack accepts it):
// flashserve runs on the caller's current stream, where the tensors are already ordered.
nb::object cuda_capsule_no_sync(nb::handle obj, bool& cuda) {
  cuda = false;
  PyObject* dev = PyObject_CallMethod(obj.ptr(), "__dlpack_device__", nullptr);
  if (!dev) {
    PyErr_Clear();
    return {};
  }
  const nb::object device = nb::steal(dev);
  long type = -1;
  if (PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2) type = PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
  if (type == -1 && PyErr_Occurred()) PyErr_Clear();
  if (type != kDLCUDA && type != kDLCUDAManaged) return {};
  cuda = true;
  PyObject* method = PyObject_GetAttrString(obj.ptr(), "__dlpack__");
  if (!method) {
    PyErr_Clear();
    return {};
  }
  const nb::object dlpack = nb::steal(method);
  const nb::object kwargs = nb::dict();
  kwargs["stream"] = -1;
  PyObject* empty = PyTuple_New(0);
  PyObject* capsule = empty ? PyObject_Call(method, empty, kwargs.ptr()) : nullptr;
  Py_XDECREF(empty);
  if (!capsule) {
    PyErr_Clear();
    return {};
  }
  return nb::steal(capsule);
}

}  // namespace

TensorRef tensor_arg(nb::handle obj, const char* name) {
  if (obj.is_none()) fail_arg(name, "a tensor", "None");
  if (const ExchangeApi* api = exchange_api(Py_TYPE(obj.ptr()))) {
    DLTensorView view{};
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &view) == 0) return from_dlpack(view, name);
    PyErr_Clear();  // e.g. a dtype this torch cannot export: try the generic path
  }
  nb::ndarray<nb::ro> arr;
  bool cuda = false;
  const nb::object capsule = cuda_capsule_no_sync(obj, cuda);
  if (cuda ? capsule.is_valid() && nb::try_cast(capsule, arr, false) : nb::try_cast(obj, arr, false))
    return from_ndarray(arr, name);
  TensorRef fp8;
  if (torch_fp8_fallback(obj, name, fp8)) return fp8;
  fail_arg(name, "a torch tensor or numpy array (DLPack)", python_type_name(obj));
}

OptTensor opt_tensor_arg(nb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return tensor_arg(obj, name);
}

std::span<const int32_t> host_i32_arg(nb::handle obj, const char* name) {
  const TensorRef t = tensor_arg(obj, name);
  if (t.device.type != DeviceType::cpu) fail_arg(name, "a host (CPU) array", to_string(t.device));
  if (t.dtype != DType::i32) fail_arg(name, "int32", dtype_name(t.dtype));
  if (t.ndim != 1) fail_arg(name, "a 1-D array", t.shape_str());
  if (t.size(0) > 1 && t.stride[0] != 1) fail_arg(name, "a contiguous array", detail::cat("stride ", t.stride[0]));
  return {t.ptr<const int32_t>(), size_t(t.size(0))};
}

std::span<const int32_t> opt_host_i32_arg(nb::handle obj, const char* name) {
  if (obj.is_none()) return {};
  return host_i32_arg(obj, name);
}

void* stream_arg(nb::handle stream) {
  if (stream.is_none()) return nullptr;
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(stream));
}

ExecContext stream_context(nb::handle stream) {
  ExecContext ctx;
  ctx.stream = stream_arg(stream);
  return ctx;
}

Device parse_device(const std::string& type, int index) {
  if (type != "cpu" && type != "cuda") fail_arg("device", "a cpu or cuda device", type);
  return Device{type == "cuda" ? DeviceType::cuda : DeviceType::cpu, index};
}

DeviceProps device_props(Device d) {
  if (d.type == DeviceType::cpu) return DeviceProps::cpu();
#if FLASHSERVE_WITH_CUDA
  return kernels::cuda_device_props(d.index);
#else
  fail_not_implemented("CUDA devices (this build has no CUDA kernels: FLASHSERVE_WITH_CUDA=0)");
#endif
}

}  // namespace flashserve::py
