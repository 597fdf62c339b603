// Errors. Every rejected input throws before anything is written, and the message names the
// argument, what was expected and what was given: "block_table: expected int32, got int64".
#pragma once

#include <charconv>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace flashserve {

// An invalid argument (Python: ValueError). `what()` starts with the argument's name.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A valid combination that this build or device does not implement (Python:
// NotImplementedError). The message names the missing feature.
class NotImplemented : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// A failure reported by a runtime (CUDA error, thread failure).
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Messages are built without iostreams: no locale, no stream state, and nothing that a host
// process's other C++ runtime (a Python extension beside torch) could have set up differently.
inline void append(std::string& s, std::string_view v) { s.append(v); }
inline void append(std::string& s, const char* v) { s.append(v); }
inline void append(std::string& s, char c) { s.push_back(c); }
inline void append(std::string& s, bool b) { s.append(b ? "1" : "0"); }
template <class T>
  requires(std::is_arithmetic_v<T> && !std::is_same_v<T, char> && !std::is_same_v<T, bool>)
void append(std::string& s, T v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // integers exact, floats shortest round-trip
  s.append(buf, r.ptr);
}

template <class... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

// "arg: expected <expected>, got <got>"
template <class E, class G>
[[noreturn]] void fail_arg(std::string_view arg, const E& expected, const G& got) {
  throw Error(detail::cat(arg, ": expected ", expected, ", got ", got));
}

template <class... Args>
[[noreturn]] void fail_not_implemented(const Args&... what) {
  throw NotImplemented(detail::cat("not implemented: ", what...));
}

}  // namespace flashserve

// Checks an argument; on failure throws flashserve::Error "arg: expected E, got G".
#define FS_CHECK_ARG(cond, arg, expected, got)        \
  do {                                                \
    if (!(cond)) ::flashserve::fail_arg(arg, expected, got); \
  } while (0)
