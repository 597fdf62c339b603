// Test support shared by the test files: per-test salts and seed notes, random picks, a
// mismatch counter that reports once per case, and checks over the bytes of a view's storage.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "support/host_tensor.hpp"

namespace fstest {

// A salt for make_rng from the running test's suite and name.
uint64_t test_salt();
// " (seed N, rerun with FLASHSERVE_SEED=N)", for failure messages.
std::string seed_note();

// Uniform integer in [lo, hi].
int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi);
template <class T>
T pick(std::mt19937_64& rng, std::initializer_list<T> xs) {
  return *(xs.begin() + int64_t(rng() % xs.size()));
}

// Counts failed checks and keeps the first message, so a broken kernel reports once per case.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  void check(bool ok, const std::string& what) {
    if (!ok && count++ == 0) first = what;
  }
};

// [storage bytes]: 1 where the byte belongs to an element of the view.
std::vector<char> view_bytes(const HostTensor& t);
// Whether every storage byte outside the view still holds the 0xFF poison.
bool padding_untouched(const HostTensor& t);

// Rows [0, T) of [T', H, D] tensors: every element finite and within atol + rtol * |want|
// (one EXPECT, naming the first five mismatches).
void expect_rows_close(const HostTensor& got, const HostTensor& want, int64_t T, double atol, double rtol);

}  // namespace fstest
