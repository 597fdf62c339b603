#include "support/host_tensor.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace fstest {

namespace nm = flashserve::numeric;

HostTensor HostTensor::with_view(TensorRef view, int64_t storage_elems) {
  HostTensor h;
  h.bytes = std::make_shared<std::vector<unsigned char>>(
      size_t(std::max<int64_t>(storage_elems, 1)) * flashserve::dtype_size(view.dtype), 0);
  view.data = h.bytes->data();
  h.ref = view;
  return h;
}

HostTensor HostTensor::clone() const {
  HostTensor c = *this;
  c.bytes = std::make_shared<std::vector<unsigned char>>(*bytes);
  c.ref.data = c.bytes->data() + (static_cast<unsigned char*>(ref.data) - bytes->data());
  return c;
}

HostTensor HostTensor::zeros(DType dtype, std::initializer_list<int64_t> shape) {
  TensorRef v = TensorRef::contiguous(nullptr, dtype, shape);
  return with_view(v, v.numel());
}

HostTensor HostTensor::strided(DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> stride) {
  TensorRef v = TensorRef::strided(nullptr, dtype, shape, stride);
  return with_view(v, v.span_elements());
}

namespace {
void* addr(const TensorRef& t, std::initializer_list<int64_t> idx) {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) off += i * t.stride[size_t(d++)];
  return static_cast<char*>(t.data) + off * int64_t(flashserve::dtype_size(t.dtype));
}
}  // namespace

float HostTensor::get(std::initializer_list<int64_t> idx) const { return nm::load_float(addr(ref, idx), ref.dtype); }
double HostTensor::getd(std::initializer_list<int64_t> idx) const { return nm::load_double(addr(ref, idx), ref.dtype); }
void HostTensor::set(std::initializer_list<int64_t> idx, float x) const { nm::store_float(addr(ref, idx), ref.dtype, x); }

uint64_t test_seed() {
  static const uint64_t seed = [] {
    uint64_t s;
    if (const char* e = std::getenv("FLASHSERVE_SEED")) {
      s = std::strtoull(e, nullptr, 0);
    } else {
      std::random_device rd;
      s = (uint64_t(rd()) << 32) ^ rd();
    }
    std::fprintf(stderr, "[flashserve tests] seed %llu (rerun with FLASHSERVE_SEED=%llu)\n",
                 (unsigned long long)s, (unsigned long long)s);
    return s;
  }();
  return seed;
}

std::mt19937_64 make_rng(uint64_t salt) {
  std::seed_seq seq{uint32_t(test_seed()), uint32_t(test_seed() >> 32), uint32_t(salt), uint32_t(salt >> 32)};
  return std::mt19937_64(seq);
}

void fill_uniform(const TensorRef& t, std::mt19937_64& rng, float lo, float hi) {
  const size_t es = flashserve::dtype_size(t.dtype);
  const bool integral = t.dtype == DType::i8 || t.dtype == DType::u8 || t.dtype == DType::i32 || t.dtype == DType::i64;
  for_each_index(t, [&](const std::vector<int64_t>&, int64_t off) {
    void* p = static_cast<char*>(t.data) + off * int64_t(es);
    if (integral) {
      std::uniform_int_distribution<int64_t> d{int64_t(lo), int64_t(hi)};
      nm::store_float(p, t.dtype, float(d(rng)));
    } else {
      std::uniform_real_distribution<float> d{lo, hi};
      nm::store_float(p, t.dtype, d(rng));
    }
  });
}

void poison(const TensorRef& t) {
  const size_t es = flashserve::dtype_size(t.dtype);
  for_each_index(t, [&](const std::vector<int64_t>&, int64_t off) {
    std::memset(static_cast<char*>(t.data) + off * int64_t(es), 0xFF, es);
  });
}

void poison_storage(const HostTensor& t) { std::memset(t.bytes->data(), 0xFF, t.bytes->size()); }
HostTensor padded_poisoned(DType dtype, std::initializer_list<int64_t> shape) {
  std::vector<int64_t> s(shape), st(s.size(), 1);
  for (int d = int(s.size()) - 2; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * s[size_t(d) + 1] + (d % 2 ? 3 : 1);
  TensorRef v = TensorRef::contiguous(nullptr, dtype, shape);
  for (size_t d = 0; d < s.size(); ++d) v.stride[d] = st[d];
  HostTensor h = HostTensor::with_view(v, v.span_elements() + 2);
  poison_storage(h);
  return h;
}
std::vector<unsigned char> snapshot(const HostTensor& t) { return *t.bytes; }
bool same_bytes(const HostTensor& t, const std::vector<unsigned char>& snap) { return *t.bytes == snap; }

std::string describe(const TensorRef& t) {
  std::ostringstream os;
  os << flashserve::dtype_name(t.dtype) << t.shape_str() << " strides [";
  for (int d = 0; d < t.ndim; ++d) os << (d ? ", " : "") << t.stride[size_t(d)];
  os << "]";
  return os.str();
}

}  // namespace fstest
