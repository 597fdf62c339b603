// The runtime -> compile-time step of every launcher: an instantiation table (a constexpr array
// of select.hpp / decode_config.hpp) is walked at compile time, and the entry the problem
// matches is launched with its index as a template argument. Plain C++.
#pragma once

#include <cstddef>
#include <iterator>
#include <utility>

namespace flashserve::kernels {

// Calls f.template operator()<I>() for the first entry I of kTable with match(kTable[I]);
// false when no entry matches (the configuration is not built).
template <const auto& kTable, class Match, class F>
bool dispatch_built(Match&& match, F&& f) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return ((match(kTable[I]) ? (f.template operator()<I>(), true) : false) || ...);
  }(std::make_index_sequence<std::size(kTable)>{});
}

}  // namespace flashserve::kernels
