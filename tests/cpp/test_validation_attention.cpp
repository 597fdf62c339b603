// Bad inputs to varlen_attention / kvcache_attention (SPEC.md §7). Each case starts from a
// valid baseline, changes one thing, and checks that the call throws the right kind of error,
// that the message starts with the argument's name ("block_table: expected int32, got int64"),
// that nothing was written (every tensor byte-for-byte unchanged, outputs poisoned first), and
// that attention_unsupported_reason reports the same problem as a non-empty string.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/status.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace nm = flashserve::numeric;
using fs::AttentionParams;
using fs::DType;
using fs::TensorRef;
using fstest::HostTensor;
using Shape = std::vector<int64_t>;

// Baseline geometry: 3 sequences, q lengths {3, 1, 2}, KV lengths {5, 7, 2}, GQA 4 -> 2.
constexpr int64_t kB = 3, kH = 4, kHkv = 2, kD = 32;
constexpr int64_t kTotalQ = 6, kTotalK = 14, kSq = 2;      // varlen rows; batched queries/seq
constexpr int64_t kBlocks = 10, kBs = 4, kMaxBlocks = 3;   // paged: capacity 12 per sequence
constexpr int64_t kBCache = 4, kSCache = 8;                // batched contiguous cache
const Shape kCuQ{0, 3, 4, 6}, kCuK{0, 5, 12, 14}, kSeqK{5, 7, 2};
const Shape kTable{0, 2, 4, 1, 3, 5, 6, 9, 7}, kCacheIdx{2, 0, 3};

enum class Base {
  varlen_paged, varlen_paged_f16, varlen_paged_fp8, varlen_paged_int8, varlen_paged_mla,
  varlen_contiguous, batched_paged, batched_contiguous,
};

const char* base_name(Base b) {
  switch (b) {
    case Base::varlen_paged: return "varlen_paged";
    case Base::varlen_paged_f16: return "varlen_paged_f16";
    case Base::varlen_paged_fp8: return "varlen_paged_fp8";
    case Base::varlen_paged_int8: return "varlen_paged_int8";
    case Base::varlen_paged_mla: return "varlen_paged_mla";
    case Base::varlen_contiguous: return "varlen_contiguous";
    case Base::batched_paged: return "batched_paged";
    case Base::batched_contiguous: return "batched_contiguous";
  }
  return "?";
}

bool is_batched(Base b) { return b == Base::batched_paged || b == Base::batched_contiguous; }
bool is_paged(Base b) { return b != Base::varlen_contiguous && b != Base::batched_contiguous; }

Shape shape_of(const TensorRef& t) { return Shape(t.shape.begin(), t.shape.begin() + t.ndim); }
Shape with_dim(const TensorRef& t, int d, int64_t n) {
  Shape s = shape_of(t);
  s[size_t(d < 0 ? d + t.ndim : d)] = n;
  return s;
}
Shape cat(Shape a, const Shape& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TensorRef view_of(DType dt, const Shape& shape, const Shape& stride) {
  TensorRef t;
  t.dtype = dt;
  t.ndim = int(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    t.shape[d] = shape[d];
    t.stride[d] = stride[d];
  }
  return t;
}
Shape contiguous_strides(const Shape& shape) {
  Shape s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

void set_int(const TensorRef& t, int64_t i, int64_t v) { nm::store_float(t.at(i), t.dtype, float(v)); }
void set_int(const TensorRef& t, int64_t i, int64_t j, int64_t v) {
  nm::store_float(t.at(i, j), t.dtype, float(v));
}

// A baseline call: the params plus owning storage for every tensor they reference.
struct Fixture {
  Base base;
  AttentionParams p;
  std::vector<HostTensor> owned;
  std::mt19937_64 rng;

  explicit Fixture(Base b) : base(b), rng(fstest::make_rng(uint64_t(b) * 7919 + 17)) {}

  TensorRef own(HostTensor h) {
    owned.push_back(h);
    return h.ref;
  }
  // Random contents in [lo, hi] (integers for integer dtypes), over a strided view if given.
  TensorRef tensor(DType dt, const Shape& shape, float lo = -1.0f, float hi = 1.0f, Shape stride = {}) {
    if (stride.empty()) stride = contiguous_strides(shape);
    TensorRef v = view_of(dt, shape, stride);
    HostTensor h = HostTensor::with_view(v, v.span_elements());
    fstest::fill_uniform(h.ref, rng, lo, hi);
    return own(h);
  }
  TensorRef output(DType dt, const Shape& shape) {
    TensorRef t = tensor(dt, shape);
    fstest::poison(t);
    return t;
  }
  TensorRef ints(DType dt, const Shape& shape, const Shape& values) {
    TensorRef t = tensor(dt, shape, 0, 0);
    for (size_t i = 0; i < values.size(); ++i) {
      int64_t off = 0, rem = int64_t(i);
      for (int d = t.ndim - 1; d >= 0; --d) {
        off += (rem % t.shape[size_t(d)]) * t.stride[size_t(d)];
        rem /= t.shape[size_t(d)];
      }
      nm::store_float(static_cast<char*>(t.data) + off * int64_t(fs::dtype_size(dt)), dt, float(values[i]));
    }
    return t;
  }
  // Same shape and values, another dtype (or another stride pattern), new storage.
  TensorRef copy_as(const TensorRef& src, DType dt, int64_t last_stride = 1) {
    Shape shape = shape_of(src), stride = contiguous_strides(shape);
    for (auto& s : stride) s *= last_stride;
    TensorRef dst = tensor(dt, shape, 0, 0, stride);
    fstest::for_each_index(src, [&](const std::vector<int64_t>& idx, int64_t off) {
      int64_t doff = 0;
      for (size_t d = 0; d < idx.size(); ++d) doff += idx[d] * dst.stride[d];
      float x = nm::load_float(static_cast<char*>(src.data) + off * int64_t(fs::dtype_size(src.dtype)), src.dtype);
      if (std::isnan(x)) x = 0.0f;  // poisoned outputs: NaN has no integer value
      nm::store_float(static_cast<char*>(dst.data) + doff * int64_t(fs::dtype_size(dt)), dt, x);
    });
    return dst;
  }
  // Same dtype, another shape, fresh random contents (poisoned if it is an output).
  TensorRef reshaped(const TensorRef& src, const Shape& shape) {
    const bool is_out = src.data == p.out.data || (p.lse && src.data == p.lse->data);
    return is_out ? output(src.dtype, shape) : tensor(src.dtype, shape);
  }
  bool batched() const { return is_batched(base); }
};

Fixture make_fixture(Base base) {
  Fixture f(base);
  AttentionParams& p = f.p;
  const bool batched = is_batched(base), paged = is_paged(base);
  DType qt = DType::bf16, kt = DType::bf16, ot = DType::bf16;
  int64_t d = kD, dv = kD;
  if (base == Base::varlen_paged_f16) qt = kt = ot = DType::f16;
  if (base == Base::varlen_paged_fp8) qt = kt = DType::f8e4m3;
  if (base == Base::varlen_paged_int8) qt = kt = DType::i8;
  if (base == Base::varlen_paged_mla) d = 64, dv = 512;
  const float lo = qt == DType::i8 ? -127.0f : -1.0f, hi = qt == DType::i8 ? 127.0f : 1.0f;

  const Shape rows = batched ? Shape{kB, kSq} : Shape{kTotalQ};
  p.q = f.tensor(qt, cat(rows, {kH, d}), lo, hi);
  if (base == Base::varlen_paged_mla) p.q_v = f.tensor(qt, cat(rows, {kH, dv}));
  p.out = f.output(ot, cat(rows, {kH, dv}));
  p.lse = f.output(DType::f32, batched ? Shape{kB, kH, kSq} : Shape{kH, kTotalQ});

  const Shape kv_rows = paged ? Shape{kBlocks, kBs} : batched ? Shape{kBCache, kSCache} : Shape{kTotalK};
  p.k = f.tensor(kt, cat(kv_rows, {kHkv, d}), lo, hi);
  p.v = f.tensor(kt, cat(kv_rows, {kHkv, dv}), lo, hi);
  if (paged) {
    // A row slice of a wider table: row stride 5 > max_blocks, as engines pass it.
    p.block_table = f.tensor(DType::i32, {kB, kMaxBlocks}, 0, 0, {5, 1});
    for (int64_t i = 0; i < kB * kMaxBlocks; ++i) set_int(*p.block_table, i / kMaxBlocks, i % kMaxBlocks, kTable[size_t(i)]);
    p.seqused_k = f.ints(DType::i32, {kB}, kSeqK);
  } else if (batched) {
    p.seqused_k = f.ints(DType::i32, {kB}, kSeqK);
    p.cache_batch_idx = f.ints(DType::i32, {kB}, kCacheIdx);
  } else {
    p.cu_seqlens_k = f.ints(DType::i32, {kB + 1}, kCuK);
  }
  if (!batched) {
    p.cu_seqlens_q = f.ints(DType::i32, {kB + 1}, kCuQ);
    p.max_seqlen_q = 4;
    p.max_seqlen_k = 8;
  }
  if (base == Base::varlen_paged_fp8) {
    p.q_descale = f.tensor(DType::f32, {kB, kHkv}, 0.5f, 2.0f);
    p.k_descale = f.tensor(DType::f32, {kB, kHkv}, 0.5f, 2.0f);
    p.v_descale = f.tensor(DType::f32, {kB, kHkv}, 0.5f, 2.0f);
  }
  if (base == Base::varlen_paged_int8) {  // K8V8
    p.q_scale = f.tensor(DType::f32, {kTotalQ, kH}, 0.001f, 0.01f);
    p.k_scale_cache = f.tensor(DType::f32, {kBlocks, kHkv, kBs}, 0.001f, 0.01f);
    p.v_scale = f.tensor(DType::f32, {kHkv, dv}, 0.001f, 0.01f);
  }
  return f;
}

void run_call(const Fixture& f) {
  if (f.batched())
    fs::kvcache_attention(f.p);
  else
    fs::varlen_attention(f.p);
}

fs::DeviceProps props_for(const AttentionParams& p) {
  if (p.q.device.type == fs::DeviceType::cpu) return fs::DeviceProps::cpu();
  fs::DeviceProps d = fs::DeviceProps::h200();
  d.device = p.q.device;
  return d;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

// ---------------------------------------------------------------- positive controls

class Baseline : public ::testing::TestWithParam<Base> {};

TEST_P(Baseline, RunsAndWritesEveryOutputElement) {
  Fixture f = make_fixture(GetParam());
  std::vector<std::vector<unsigned char>> inputs;
  for (const HostTensor& h : f.owned) inputs.push_back(fstest::snapshot(h));

  EXPECT_EQ(fs::attention_unsupported_reason(f.p, f.batched(), fs::DeviceProps::cpu()), "");
  ASSERT_NO_THROW(run_call(f));

  int64_t unwritten = 0;
  fstest::for_each_index(f.p.out, [&](const std::vector<int64_t>&, int64_t off) {
    const void* e = static_cast<char*>(f.p.out.data) + off * int64_t(fs::dtype_size(f.p.out.dtype));
    unwritten += !std::isfinite(nm::load_float(e, f.p.out.dtype));
  });
  EXPECT_EQ(unwritten, 0) << "of " << f.p.out.numel() << " out elements";
  int64_t bad_lse = 0;
  fstest::for_each_index(*f.p.lse, [&](const std::vector<int64_t>&, int64_t off) {
    bad_lse += !std::isfinite(f.p.lse->ptr<float>()[off]);  // every row sees at least one key
  });
  EXPECT_EQ(bad_lse, 0) << "of " << f.p.lse->numel() << " lse elements";
  for (size_t i = 0; i < f.owned.size(); ++i) {
    const bool output = f.owned[i].ref.data == f.p.out.data || f.owned[i].ref.data == f.p.lse->data;
    if (!output) {
      EXPECT_TRUE(fstest::same_bytes(f.owned[i], inputs[i])) << "input " << fstest::describe(f.owned[i].ref) << " was modified";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Attention, Baseline,
    ::testing::Values(Base::varlen_paged, Base::varlen_paged_f16, Base::varlen_paged_fp8,
                      Base::varlen_paged_int8, Base::varlen_paged_mla, Base::varlen_contiguous,
                      Base::batched_paged, Base::batched_contiguous),
    [](const ::testing::TestParamInfo<Base>& i) { return std::string(base_name(i.param)); });

// ---------------------------------------------------------------- bad inputs

struct BadInput {
  std::string name;
  Base base;
  std::function<void(Fixture&)> mutate;
  bool not_implemented = false;
  std::vector<std::string> args;  // Error: the message starts with one of these + ':'
  std::string feature;            // NotImplemented: the message contains this (any case)
  std::string detail;             // Error: the message also shows this (the given value)
};
void PrintTo(const BadInput& c, std::ostream* os) { *os << c.name; }

BadInput bad(std::string name, Base base, std::function<void(Fixture&)> m, std::vector<std::string> args,
             std::string detail = "") {
  return BadInput{std::move(name), base, std::move(m), false, std::move(args), "", std::move(detail)};
}
BadInput unsupported(std::string name, Base base, std::function<void(Fixture&)> m, std::string feature) {
  return BadInput{std::move(name), base, std::move(m), true, {}, std::move(feature), ""};
}

// Every tensor field of the params, for device changes.
template <class F>
void for_each_tensor(AttentionParams& p, F&& f) {
  for (TensorRef* t : {&p.q, &p.out, &p.k, &p.v}) f(*t);
  for (fs::OptTensor* t : {&p.q_v, &p.lse, &p.cu_seqlens_q, &p.cu_seqlens_k, &p.seqused_k, &p.block_table,
                           &p.cache_batch_idx, &p.alibi_slopes, &p.s_aux, &p.q_descale, &p.k_descale,
                           &p.v_descale, &p.q_scale, &p.k_scale_cache, &p.v_scale})
    if (*t) f(**t);
}

// Head sizes D = Dv = n everywhere (q, k, v, out).
void set_head_size(Fixture& f, int64_t n) {
  for (TensorRef* t : {&f.p.q, &f.p.k, &f.p.v, &f.p.out}) *t = f.reshaped(*t, with_dim(*t, -1, n));
}

constexpr Base VP = Base::varlen_paged, VC = Base::varlen_contiguous, BP = Base::batched_paged,
               BC = Base::batched_contiguous, F16 = Base::varlen_paged_f16, FP8 = Base::varlen_paged_fp8,
               I8 = Base::varlen_paged_int8, MLA = Base::varlen_paged_mla;

std::vector<BadInput> dtype_cases() {
  return {
      bad("q_dtype_int32", VP, [](Fixture& f) { f.p.q = f.copy_as(f.p.q, DType::i32); }, {"q"}, "int32"),
      bad("k_dtype_int32", VP, [](Fixture& f) { f.p.k = f.copy_as(f.p.k, DType::i32); }, {"k"}),
      bad("v_dtype_int32", VP, [](Fixture& f) { f.p.v = f.copy_as(f.p.v, DType::i32); }, {"v"}),
      bad("v_dtype_differs_from_k", VP, [](Fixture& f) { f.p.v = f.copy_as(f.p.v, DType::f16); }, {"v"}),
      bad("out_dtype_int32", VP, [](Fixture& f) { f.p.out = f.copy_as(f.p.out, DType::i32); }, {"out"}),
      bad("out_f16_for_bf16_q", VP, [](Fixture& f) { f.p.out = f.copy_as(f.p.out, DType::f16); }, {"out"}, "float16"),
      bad("out_bf16_for_f16_q", F16, [](Fixture& f) { f.p.out = f.copy_as(f.p.out, DType::bf16); }, {"out"}),
      bad("lse_dtype_bf16", VP, [](Fixture& f) { f.p.lse = f.copy_as(*f.p.lse, DType::bf16); }, {"lse"}),
      bad("cu_seqlens_q_int64", VP, [](Fixture& f) { f.p.cu_seqlens_q = f.copy_as(*f.p.cu_seqlens_q, DType::i64); }, {"cu_seqlens_q"}, "int64"),
      bad("cu_seqlens_k_int64", VC, [](Fixture& f) { f.p.cu_seqlens_k = f.copy_as(*f.p.cu_seqlens_k, DType::i64); }, {"cu_seqlens_k"}),
      bad("block_table_int64", VP, [](Fixture& f) { f.p.block_table = f.copy_as(*f.p.block_table, DType::i64); }, {"block_table"}, "int64"),
      bad("seqused_k_int64", VP, [](Fixture& f) { f.p.seqused_k = f.copy_as(*f.p.seqused_k, DType::i64); }, {"seqused_k"}, "int64"),
      bad("cache_batch_idx_int64", BC, [](Fixture& f) { f.p.cache_batch_idx = f.copy_as(*f.p.cache_batch_idx, DType::i64); }, {"cache_batch_idx"}),
      bad("fp8_out_dtype_fp8", FP8, [](Fixture& f) { f.p.out = f.copy_as(f.p.out, DType::f8e4m3); }, {"out"}),
      bad("fp8_k_descale_f16", FP8, [](Fixture& f) { f.p.k_descale = f.copy_as(*f.p.k_descale, DType::f16); }, {"k_descale"}),
      bad("int8_q_scale_f16", I8, [](Fixture& f) { f.p.q_scale = f.copy_as(*f.p.q_scale, DType::f16); }, {"q_scale"}),
      bad("alibi_slopes_bf16", VP, [](Fixture& f) { f.p.alibi_slopes = f.tensor(DType::bf16, {kH}, 0.1f, 1.0f); }, {"alibi_slopes"}),
  };
}

std::vector<BadInput> shape_cases() {
  return {
      bad("q_rank_4_varlen", VP, [](Fixture& f) { f.p.q = f.reshaped(f.p.q, {1, kTotalQ, kH, kD}); }, {"q"}),
      bad("q_rank_3_batched", BP, [](Fixture& f) { f.p.q = f.reshaped(f.p.q, {kB * kSq, kH, kD}); }, {"q"}),
      bad("k_rank_3_paged", VP, [](Fixture& f) { f.p.k = f.reshaped(f.p.k, {kBlocks * kBs, kHkv, kD}); }, {"k"}),
      bad("block_table_rank_1", VP, [](Fixture& f) { f.p.block_table = f.ints(DType::i32, {kB * kMaxBlocks}, kTable); }, {"block_table"}),
      bad("lse_rank_1", VP, [](Fixture& f) { f.p.lse = f.reshaped(*f.p.lse, {kH * kTotalQ}); }, {"lse"}),
      bad("q_head_size_differs_from_k", VP, [](Fixture& f) { f.p.k = f.reshaped(f.p.k, with_dim(f.p.k, -1, 40)); }, {"k"}),
      bad("heads_not_multiple_of_kv_heads", VP, [](Fixture& f) {
            f.p.k = f.reshaped(f.p.k, with_dim(f.p.k, 2, 3));
            f.p.v = f.reshaped(f.p.v, with_dim(f.p.v, 2, 3));
          }, {"k", "q"}),
      bad("v_heads_differ_from_k", VP, [](Fixture& f) { f.p.v = f.reshaped(f.p.v, with_dim(f.p.v, 2, 1)); }, {"v"}),
      bad("out_rows_mismatch", VP, [](Fixture& f) { f.p.out = f.reshaped(f.p.out, with_dim(f.p.out, 0, kTotalQ + 1)); }, {"out"}),
      bad("out_heads_mismatch", VP, [](Fixture& f) { f.p.out = f.reshaped(f.p.out, with_dim(f.p.out, 1, kH - 1)); }, {"out"}),
      bad("out_dv_mismatch", VP, [](Fixture& f) { f.p.out = f.reshaped(f.p.out, with_dim(f.p.out, 2, kD / 2)); }, {"out"}, "[6, 4, 16]"),
      bad("lse_token_major_varlen", VP, [](Fixture& f) { f.p.lse = f.reshaped(*f.p.lse, {kTotalQ, kH}); }, {"lse"}),
      bad("lse_varlen_layout_in_batched", BP, [](Fixture& f) { f.p.lse = f.reshaped(*f.p.lse, {kH, kB * kSq}); }, {"lse"}),
      bad("q_last_dim_strided", VP, [](Fixture& f) { f.p.q = f.copy_as(f.p.q, f.p.q.dtype, 2); }, {"q"}),
      bad("k_last_dim_strided", VP, [](Fixture& f) { f.p.k = f.copy_as(f.p.k, f.p.k.dtype, 2); }, {"k"}),
      bad("out_last_dim_strided", VP, [](Fixture& f) {
            f.p.out = f.copy_as(f.p.out, f.p.out.dtype, 2);
            fstest::poison(f.p.out);
          }, {"out"}),
      bad("block_table_rows_differ_from_batch", BP, [](Fixture& f) { f.p.block_table = f.ints(DType::i32, {kB - 1, kMaxBlocks}, kTable); }, {"block_table"}),
      bad("alibi_slopes_wrong_length", VP, [](Fixture& f) { f.p.alibi_slopes = f.tensor(DType::f32, {kH + 1}, 0.1f, 1.0f); }, {"alibi_slopes"}),
      bad("alibi_slopes_wrong_batch", VP, [](Fixture& f) { f.p.alibi_slopes = f.tensor(DType::f32, {kB + 1, kH}, 0.1f, 1.0f); }, {"alibi_slopes"}),
      bad("s_aux_wrong_length", VP, [](Fixture& f) { f.p.s_aux = f.tensor(DType::f32, {kH - 1}); }, {"s_aux"}),
      bad("q_v_width_differs_from_dv", MLA, [](Fixture& f) { f.p.q_v = f.reshaped(*f.p.q_v, with_dim(*f.p.q_v, -1, 256)); }, {"q_v"}, "[6, 4, 256]"),
      // fp8 descales are optional (absent = 1.0, FlashAttention-3). For 16-bit operands they are
      // unused (Descales.UnusedFor16BitOperands) but still checked as FlashAttention's would be;
      // for int8 operands (which take q_scale / k_scale_cache / v_scale) they are an error.
      bad("bf16_k_descale_wrong_shape", VP, [](Fixture& f) { f.p.k_descale = f.tensor(DType::f32, {kB, kH}, 0.5f, 2.0f); }, {"k_descale"}, "[3, 4]"),
      bad("bf16_q_descale_f16", VP, [](Fixture& f) { f.p.q_descale = f.tensor(DType::f16, {kB, kHkv}, 0.5f, 2.0f); }, {"q_descale"}, "float16"),
      bad("bf16_v_descale_rank_1", BP, [](Fixture& f) { f.p.v_descale = f.tensor(DType::f32, {kB}, 0.5f, 2.0f); }, {"v_descale"}),
      bad("int8_k_descale", I8, [](Fixture& f) { f.p.k_descale = f.tensor(DType::f32, {kB, kHkv}, 0.5f, 2.0f); }, {"k_descale"}),
      bad("int8_q_descale", I8, [](Fixture& f) { f.p.q_descale = f.tensor(DType::f32, {kB, kHkv}, 0.5f, 2.0f); }, {"q_descale"}),
      bad("fp8_k_descale_wrong_shape", FP8, [](Fixture& f) { f.p.k_descale = f.tensor(DType::f32, {kB, kH}, 0.5f, 2.0f); }, {"k_descale"}),
      bad("fp8_v_descale_wrong_batch", FP8, [](Fixture& f) { f.p.v_descale = f.tensor(DType::f32, {kB + 1, kHkv}, 0.5f, 2.0f); }, {"v_descale"}),
      bad("int8_q_without_q_scale", I8, [](Fixture& f) { f.p.q_scale.reset(); }, {"q_scale"}),
      bad("int8_k_without_k_scale_cache", I8, [](Fixture& f) { f.p.k_scale_cache.reset(); }, {"k_scale_cache"}),
      bad("int8_v_without_v_scale", I8, [](Fixture& f) { f.p.v_scale.reset(); }, {"v_scale"}),
      bad("int8_k_scale_cache_token_major", I8, [](Fixture& f) { f.p.k_scale_cache = f.tensor(DType::f32, {kBlocks, kBs, kHkv}, 0.001f, 0.01f); }, {"k_scale_cache"}),
      bad("int8_v_scale_wrong_shape", I8, [](Fixture& f) { f.p.v_scale = f.tensor(DType::f32, {kH, kD}, 0.001f, 0.01f); }, {"v_scale"}),
      bad("q_data_null", VP, [](Fixture& f) { f.p.q.data = nullptr; }, {"q"}),
  };
}

std::vector<BadInput> metadata_cases() {
  return {
      bad("cu_seqlens_q_not_starting_at_0", VP, [](Fixture& f) { set_int(*f.p.cu_seqlens_q, 0, 1); }, {"cu_seqlens_q"}),
      bad("cu_seqlens_q_decreasing", VP, [](Fixture& f) { set_int(*f.p.cu_seqlens_q, 2, 2); }, {"cu_seqlens_q"}),
      // cu_seqlens_q[B] < total_q is padding (PaddedRows.NeitherReadNorWritten); past q is not.
      bad("cu_seqlens_q_last_past_q", VC, [](Fixture& f) { set_int(*f.p.cu_seqlens_q, kB, kTotalQ + 1); }, {"cu_seqlens_q"}),
      // B+1 entries expected; which tensor is blamed depends on which one defines B.
      bad("cu_seqlens_q_length_b", VP, [](Fixture& f) { f.p.cu_seqlens_q = f.ints(DType::i32, {kB}, {0, 3, 6}); },
          {"cu_seqlens_q", "block_table", "seqused_k"}),
      bad("cu_seqlens_k_length_differs", VC, [](Fixture& f) { f.p.cu_seqlens_k = f.ints(DType::i32, {kB + 2}, {0, 5, 12, 14, 14}); },
          {"cu_seqlens_k"}),
      bad("cu_seqlens_k_past_end_of_k", VC, [](Fixture& f) { set_int(*f.p.cu_seqlens_k, kB, kTotalK + 1); }, {"cu_seqlens_k"}),
      bad("cu_seqlens_k_decreasing", VC, [](Fixture& f) {
            set_int(*f.p.cu_seqlens_k, 2, 4);
            f.p.max_seqlen_k = 16;
          }, {"cu_seqlens_k"}),
      bad("seq_longer_than_max_seqlen_q", VP, [](Fixture& f) { f.p.max_seqlen_q = 2; }, {"max_seqlen_q", "cu_seqlens_q"}),
      bad("seq_longer_than_max_seqlen_k_paged", VP, [](Fixture& f) { f.p.max_seqlen_k = 6; }, {"max_seqlen_k", "seqused_k"}),
      bad("seq_longer_than_max_seqlen_k_contiguous", VC, [](Fixture& f) { f.p.max_seqlen_k = 6; }, {"max_seqlen_k", "cu_seqlens_k"}),
      bad("seqused_k_past_block_table_capacity", VP, [](Fixture& f) {
            set_int(*f.p.seqused_k, 1, kMaxBlocks * kBs + 1);
            f.p.max_seqlen_k = 16;
          }, {"seqused_k"}),
      bad("seqused_k_negative", VP, [](Fixture& f) { set_int(*f.p.seqused_k, 2, -1); }, {"seqused_k"}),
      bad("seqused_k_past_cache_rows", BC, [](Fixture& f) { set_int(*f.p.seqused_k, 0, kSCache + 1); }, {"seqused_k"}),
      bad("seqused_k_length_differs_from_batch", BP, [](Fixture& f) { f.p.seqused_k = f.ints(DType::i32, {kB - 1}, {5, 7}); }, {"seqused_k"}),
      bad("block_index_num_blocks", VP, [](Fixture& f) { set_int(*f.p.block_table, 1, 1, kBlocks); }, {"block_table"}),
      bad("block_index_negative", VP, [](Fixture& f) { set_int(*f.p.block_table, 0, 0, -1); }, {"block_table"}),
      bad("paged_without_seqused_k", VP, [](Fixture& f) { f.p.seqused_k.reset(); }, {"seqused_k"}),
      // KV lengths from cu_seqlens_k (no seqused_k) must fit the block table too.
      bad("paged_cu_seqlens_k_past_block_table_capacity", VP, [](Fixture& f) {
            f.p.seqused_k.reset();
            f.p.cu_seqlens_k = f.ints(DType::i32, {kB + 1}, {0, 5, 18, 20});
            f.p.max_seqlen_k = 16;
          }, {"cu_seqlens_k"}),
      // Both given: seqused_k may shorten a sequence of cu_seqlens_k, never lengthen it.
      bad("paged_seqused_k_past_cu_seqlens_k", VP, [](Fixture& f) {
            f.p.cu_seqlens_k = f.ints(DType::i32, {kB + 1}, {0, 5, 12, 13});
          }, {"seqused_k", "cu_seqlens_k"}),
      bad("cache_batch_idx_past_cache", BC, [](Fixture& f) { set_int(*f.p.cache_batch_idx, 0, kBCache); }, {"cache_batch_idx"}),
      bad("cache_batch_idx_negative", BC, [](Fixture& f) { set_int(*f.p.cache_batch_idx, 1, -1); }, {"cache_batch_idx"}),
  };
}

std::vector<BadInput> scalar_and_device_cases() {
  return {
      bad("window_left_below_minus_1", VP, [](Fixture& f) { f.p.window.left = -2; }, {"window", "window.left"}),
      bad("window_right_below_minus_1", VP, [](Fixture& f) { f.p.window.right = -3; }, {"window", "window.right"}),
      bad("chunk_size_negative", VP, [](Fixture& f) { f.p.chunk_size = -4; }, {"chunk_size"}),
      bad("softcap_negative", VP, [](Fixture& f) { f.p.softcap = -1.0f; }, {"softcap"}),
      bad("softcap_nan", VP, [](Fixture& f) { f.p.softcap = NAN; }, {"softcap"}),
      bad("softmax_scale_nan", VP, [](Fixture& f) { f.p.softmax_scale = NAN; }, {"softmax_scale"}),
      bad("num_splits_negative", VP, [](Fixture& f) { f.p.num_splits = -1; }, {"num_splits"}),
      bad("max_seqlen_q_negative", VP, [](Fixture& f) { f.p.max_seqlen_q = -1; }, {"max_seqlen_q"}),
      bad("k_on_other_cpu_device", VP, [](Fixture& f) { f.p.k.device = {fs::DeviceType::cpu, 1}; }, {"k"}, "cpu:1"),
      bad("block_table_on_cuda_rest_on_cpu", VP, [](Fixture& f) { f.p.block_table->device = {fs::DeviceType::cuda, 0}; }, {"block_table"}),
      bad("out_on_cuda_rest_on_cpu", BC, [](Fixture& f) { f.p.out.device = {fs::DeviceType::cuda, 0}; }, {"out"}),
      unsupported("head_size_20", VP, [](Fixture& f) { set_head_size(f, 20); }, "head size"),
      unsupported("head_size_264", VP, [](Fixture& f) { set_head_size(f, 264); }, "head size"),
#if !FLASHSERVE_WITH_CUDA  // CUDA builds run CUDA tensors (tests/gpu)
      unsupported("all_tensors_on_cuda", VP, [](Fixture& f) {
            for_each_tensor(f.p, [](TensorRef& t) { t.device = {fs::DeviceType::cuda, 0}; });
          }, "cuda"),
#endif
  };
}

std::vector<BadInput> all_cases() {
  std::vector<BadInput> all;
  for (auto* part : {&dtype_cases, &shape_cases, &metadata_cases, &scalar_and_device_cases})
    for (BadInput& c : (*part)()) all.push_back(std::move(c));
  return all;
}

bool starts_with_arg(const std::string& msg, const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (msg.rfind(a + ":", 0) == 0) return true;
  return false;
}

class BadInputs : public ::testing::TestWithParam<BadInput> {};

TEST_P(BadInputs, RejectedBeforeAnyWrite) {
  const BadInput& c = GetParam();
  Fixture f = make_fixture(c.base);
  c.mutate(f);
  for (const HostTensor& h : f.owned)
    if (h.ref.data == f.p.out.data || (f.p.lse && h.ref.data == f.p.lse->data)) fstest::poison_storage(h);
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor& h : f.owned) before.push_back(fstest::snapshot(h));

  std::string msg, kind = "nothing";
  try {
    run_call(f);
  } catch (const fs::Error& e) {
    kind = "flashserve::Error", msg = e.what();
  } catch (const fs::NotImplemented& e) {
    kind = "flashserve::NotImplemented", msg = e.what();
  } catch (const std::exception& e) {
    kind = "another exception", msg = e.what();
  }
  RecordProperty("message", msg);  // visible with --gtest_output=xml
  const std::string want = c.not_implemented ? "flashserve::NotImplemented" : "flashserve::Error";
  EXPECT_EQ(kind, want) << "message: \"" << msg << "\"";
  if (c.not_implemented) {
    EXPECT_NE(lower(msg).find(lower(c.feature)), std::string::npos)
        << "message should name \"" << c.feature << "\": \"" << msg << "\"";
  } else {
    EXPECT_TRUE(starts_with_arg(msg, c.args)) << "message should start with \"" << c.args[0] << ":\": \"" << msg << "\"";
    EXPECT_NE(msg.find("expected"), std::string::npos) << "uninformative: \"" << msg << "\"";
    EXPECT_NE(msg.find("got"), std::string::npos) << "uninformative: \"" << msg << "\"";
    EXPECT_NE(msg.find(c.detail), std::string::npos) << "should show \"" << c.detail << "\": \"" << msg << "\"";
  }

  std::string reason;
  EXPECT_NO_THROW(reason = fs::attention_unsupported_reason(f.p, f.batched(), props_for(f.p)));
  EXPECT_FALSE(reason.empty()) << "attention_unsupported_reason accepted it; the call said \"" << msg << "\"";
  if (!reason.empty()) {
    const std::string needle = c.not_implemented ? c.feature : c.args[0];
    bool named = lower(reason).find(lower(needle)) != std::string::npos;
    for (const std::string& a : c.args) named = named || reason.find(a) != std::string::npos;
    EXPECT_TRUE(named) << "reason should name \"" << needle << "\": \"" << reason << "\"";
  }

  for (size_t i = 0; i < f.owned.size(); ++i)
    EXPECT_TRUE(fstest::same_bytes(f.owned[i], before[i]))
        << "tensor " << fstest::describe(f.owned[i].ref) << " was written by a rejected call";
}

INSTANTIATE_TEST_SUITE_P(Attention, BadInputs, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<BadInput>& i) { return i.param.name; });

TEST(BadInputCases, AtLeast35Distinct) { EXPECT_GE(all_cases().size(), 35u); }

// ---------------------------------------------------------------- accepted, left unused

// The call's out and lse (copies of the bytes of their storage).
struct Outputs {
  std::vector<unsigned char> out, lse;
};
HostTensor owner_of(const Fixture& f, const void* data) {
  for (const HostTensor& h : f.owned)
    if (h.ref.data == data) return h;
  ADD_FAILURE() << "no owner";
  return f.owned.front();
}
Outputs run_outputs(const Fixture& f, const fs::ExecContext& ctx = {}) {
  f.batched() ? fs::kvcache_attention(f.p, ctx) : fs::varlen_attention(f.p, ctx);
  return {fstest::snapshot(owner_of(f, f.p.out.data)), fstest::snapshot(owner_of(f, f.p.lse->data))};
}
void repoison(const Fixture& f) {
  fstest::poison_storage(owner_of(f, f.p.out.data));
  fstest::poison_storage(owner_of(f, f.p.lse->data));
}

// vLLM passes its layer's q/k/v scales as descales ([B, H_kv] stride-0 expansions) whatever the
// dtype; FlashAttention leaves them unused for 16-bit operands, and so does flashserve: the
// result is the one without descales, bit for bit, for descales far from 1.
TEST(Descales, UnusedFor16BitOperands) {
  for (Base base : {Base::varlen_paged, Base::varlen_paged_f16, Base::varlen_contiguous, Base::batched_paged,
                    Base::batched_contiguous}) {
    Fixture f = make_fixture(base);
    const Outputs plain = run_outputs(f);
    repoison(f);
    const TensorRef scale = f.tensor(DType::f32, {1}, 2.0f, 4.0f);  // vLLM: _k_scale.expand((B, H_kv))
    f.p.q_descale = view_of(DType::f32, {kB, kHkv}, {0, 0});
    f.p.q_descale->data = scale.data;
    f.p.k_descale = f.tensor(DType::f32, {kB, kHkv}, 2.0f, 4.0f);
    f.p.v_descale = f.tensor(DType::f32, {kB, kHkv}, 0.1f, 0.5f);
    EXPECT_EQ(fs::attention_unsupported_reason(f.p, f.batched(), fs::DeviceProps::cpu()), "") << base_name(base);
    Outputs descaled;
    ASSERT_NO_THROW(descaled = run_outputs(f)) << base_name(base);
    EXPECT_EQ(descaled.out, plain.out) << base_name(base) << ": out changed by descales of a 16-bit operand";
    EXPECT_EQ(descaled.lse, plain.lse) << base_name(base) << ": lse changed by descales of a 16-bit operand";
  }
}

// A batch padded for a CUDA graph: q, out and lse have rows past cu_seqlens_q[B]. Those rows are
// neither read (NaN in q changes nothing) nor written (out/lse keep their poison), and the
// other rows equal the unpadded call's; a plan made for the unpadded batch serves the padded one.
TEST(PaddedRows, NeitherReadNorWritten) {
  for (Base base : {Base::varlen_paged, Base::varlen_contiguous, Base::varlen_paged_fp8}) {
    for (int64_t pad : {1, 3}) {
      Fixture f = make_fixture(base);
      const int64_t real = kTotalQ - pad;  // the last sequences shortened; rows [real, kTotalQ) padding
      for (int64_t b = 1; b <= kB; ++b)
        set_int(*f.p.cu_seqlens_q, b, std::min(kCuQ[size_t(b)], real));
      const TensorRef q = f.p.q, out = f.p.out, lse = *f.p.lse;
      // The unpadded call: views of the first `real` rows.
      f.p.q = q.slice(0, 0, real);
      f.p.out = out.slice(0, 0, real);
      f.p.lse = lse.slice(1, 0, real);
      repoison(f);
      const fs::Plan unpadded_plan = fs::plan_varlen_attention(f.p, fs::DeviceProps::cpu());
      const Outputs want = run_outputs(f);

      f.p.q = q, f.p.out = out, f.p.lse = lse;
      for (int64_t r = real; r < kTotalQ; ++r)
        fstest::poison(q.slice(0, r, r + 1));
      for (int with_plan = 0; with_plan < 2; ++with_plan) {
        repoison(f);
        fs::ExecContext ctx;
        if (with_plan) ctx.plan = &unpadded_plan;
        Outputs got;
        ASSERT_NO_THROW(got = run_outputs(f, ctx)) << base_name(base) << " pad " << pad;
        // Every byte equal to the unpadded call's: the same rows written, the padding still poisoned.
        EXPECT_EQ(got.out, want.out) << base_name(base) << " pad " << pad << " plan " << with_plan;
        EXPECT_EQ(got.lse, want.lse) << base_name(base) << " pad " << pad << " plan " << with_plan;
      }
      const fs::Plan padded_plan = fs::plan_varlen_attention(f.p, fs::DeviceProps::cpu(), unpadded_plan);
      EXPECT_EQ(padded_plan.shape.total_q, kTotalQ);
      EXPECT_EQ(padded_plan.num_splits, unpadded_plan.num_splits);

      // Still rejected: a plan made for another shape than the rows, and cu_seqlens_q past q.
      fs::Plan other = unpadded_plan;
      other.shape.max_seqlen_k += 1;
      fs::ExecContext ctx;
      ctx.plan = &other;
      repoison(f);
      try {
        run_outputs(f, ctx);
        ADD_FAILURE() << "a plan for another max_seqlen_k was accepted";
      } catch (const fs::Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind("scheduler_metadata: expected a plan made for ", 0), 0u) << e.what();
      }
      EXPECT_THROW(fs::plan_varlen_attention(f.p, fs::DeviceProps::cpu(), other), fs::Error);
      f.p.q = q.slice(0, 0, real - 1);
      f.p.out = out.slice(0, 0, real - 1);
      f.p.lse = lse.slice(1, 0, real - 1);
      try {
        run_outputs(f);
        ADD_FAILURE() << "cu_seqlens_q[B] past the rows of q was accepted";
      } catch (const fs::Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind("cu_seqlens_q: expected last entry <= ", 0), 0u) << e.what();
      }
    }
  }
}

}  // namespace
