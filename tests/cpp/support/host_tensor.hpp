// Test support: owning host tensors, seeded randomness, poisoning and snapshots.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flashserve/numeric.hpp"
#include "flashserve/tensor.hpp"

namespace fstest {

using flashserve::DType;
using flashserve::TensorRef;

// An owning host buffer with a view. `storage_elems` may exceed the view's span (for strided
// views); the view starts at the buffer's start.
struct HostTensor {
  std::shared_ptr<std::vector<unsigned char>> bytes;
  TensorRef ref;

  static HostTensor zeros(DType dtype, std::initializer_list<int64_t> shape);
  // A view with explicit strides over a buffer just large enough for it.
  static HostTensor strided(DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> stride);
  // From a view whose storage is `storage_elems` long (the view sits at its start).
  static HostTensor with_view(TensorRef view, int64_t storage_elems);
  // A deep copy: its own storage, the same view.
  HostTensor clone() const;

  float get(std::initializer_list<int64_t> idx) const;   // through numeric::load_float
  double getd(std::initializer_list<int64_t> idx) const;
  void set(std::initializer_list<int64_t> idx, float x) const;
  operator const TensorRef&() const { return ref; }
};

// The seed for this process: FLASHSERVE_SEED if set, else a fresh one. Printed once.
uint64_t test_seed();
// A generator seeded from test_seed() and a per-test salt (e.g. a hash of the test name).
std::mt19937_64 make_rng(uint64_t salt);

// Every element of the view, in row-major index order, as flat indices.
template <class F>
void for_each_index(const TensorRef& t, F&& f) {
  std::vector<int64_t> idx(size_t(t.ndim), 0);
  if (t.numel() == 0) return;
  while (true) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[size_t(d)] * t.stride[size_t(d)];
    f(idx, off);
    int d = t.ndim - 1;
    for (; d >= 0; --d) {
      if (++idx[size_t(d)] < t.shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
    if (d < 0) return;
  }
}

// Uniform in [lo, hi), rounded through the dtype (ints: uniform integers in [lo, hi]).
void fill_uniform(const TensorRef& t, std::mt19937_64& rng, float lo, float hi);
// Poison: every byte 0xFF (NaN for floats, -1 for ints) over the view's elements.
void poison(const TensorRef& t);
// Poison the whole storage of a HostTensor (also bytes outside the view).
void poison_storage(const HostTensor& t);
// A view with padded strides over every dim but the last (rows 1 or 3 elements apart beyond
// their extent), its whole storage poisoned.
HostTensor padded_poisoned(DType dtype, std::initializer_list<int64_t> shape);
// Copy of the raw bytes of the whole storage, for "left untouched" checks.
std::vector<unsigned char> snapshot(const HostTensor& t);
bool same_bytes(const HostTensor& t, const std::vector<unsigned char>& snap);

// Human-readable description for failure messages.
std::string describe(const TensorRef& t);

}  // namespace fstest
