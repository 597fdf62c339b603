// The launchers' switches (A/B runs, the GPU tests' ctest entries): an environment variable read
// as one digit. Plain C++.
#pragma once

#include <cstdlib>

namespace flashserve::kernels {

// Environment variable `name` as one digit in [kLo, kHi]; kOtherwise when unset or anything else.
// Callers read it once (a function-local static).
template <int kLo, int kHi, int kOtherwise>
int env_digit(const char* name) {
  const char* env = std::getenv(name);
  return env && env[0] >= '0' + kLo && env[0] <= '0' + kHi && env[1] == '\0' ? env[0] - '0' : kOtherwise;
}

}  // namespace flashserve::kernels
