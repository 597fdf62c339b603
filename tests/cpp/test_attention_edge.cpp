// Attention edge cases against the fp64 oracle: zero-length sequences in the middle of a batch,
// fully masked rows (out exactly 0, lse -inf or the sink), one-token pages, a single token,
// and KV caches larger than 2^31 bytes (blocks, cache rows and tokens past the 2^31-byte
// offset, block ids at the very end of the cache).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "naive/attention_case.hpp"

using flashserve::DType;
using flashserve::KvLayout;
using flashserve::TensorRef;
using fstest::CaseConfig;
using fstest::KvMode;

namespace {

fstest::AttentionCase build(const CaseConfig& c, uint64_t salt) {
  auto rng = fstest::make_rng(salt);
  return fstest::build_case(c, rng);
}

void expect_matches(const CaseConfig& c, uint64_t salt) {
  fstest::AttentionCase ac = build(c, salt);
  fstest::run_case(ac);
  EXPECT_EQ(fstest::check_case(ac), "") << fstest::describe(c);
}

}  // namespace

TEST(AttentionEdge, ZeroLengthSequencesInTheMiddle) {
  const std::vector<int64_t> q_lens = {3, 0, 4, 0, 2, 0}, k_lens = {5, 7, 0, 0, 9, 3};
  for (KvMode mode : fstest::kAllKvModes)
    for (int splits : {1, 3}) {
      CaseConfig c = fstest::small_case_config(mode, q_lens, k_lens);
      c.num_splits = splits;
      c.causal = splits == 3;
      expect_matches(c, 1);
    }
  // A batched call whose every sequence has sq = 0, and one with every KV length 0.
  for (KvMode mode : {KvMode::batched_paged, KvMode::batched_contiguous}) {
    expect_matches(fstest::small_case_config(mode, {0, 0}, {4, 6}), 2);
    expect_matches(fstest::small_case_config(mode, {2, 2, 2}, {0, 0, 0}), 3);
  }
}

// Rows whose aligned position i' = i + sk - sq sees no key: out exactly 0, lse -inf, or the
// sink's logit with a sink. Causal with sq > sk, a chunk with i' < 0 (floor division), a
// window to the right of every key, and sk = 0.
TEST(AttentionEdge, FullyMaskedRows) {
  struct Masking {
    bool causal;
    int64_t chunk;
    flashserve::Window window;
  };
  const Masking maskings[] = {{true, 0, {}}, {false, 3, {}}, {false, 0, {0, 0}}, {true, 2, {1, -1}}};
  for (KvMode mode : fstest::kAllKvModes)
    for (const Masking& m : maskings)
      for (bool sinks : {false, true}) {
        CaseConfig c = fstest::small_case_config(mode, {7, 5}, {3, 0});
        c.causal = m.causal, c.chunk = m.chunk, c.window = m.window;
        c.sinks = sinks;
        c.num_splits = 2;
        fstest::AttentionCase ac = build(c, 4);
        fstest::run_case(ac);
        EXPECT_EQ(fstest::check_case(ac), "") << fstest::describe(c);
        const bool batched = c.batched();
        int64_t masked = 0;
        for (int64_t b = 0; b < c.batch(); ++b) {
          const int64_t sq = c.q_lens[size_t(b)], sk = c.k_lens[size_t(b)];
          for (int64_t i = 0; i < sq; ++i) {
            if (i + sk - sq >= 0 && sk > 0) continue;  // i' < 0 is masked under every masking here
            ++masked;
            const int64_t row = batched ? i : ac.q_row0[size_t(b)] + i;
            for (int64_t h = 0; h < c.H; ++h) {
              for (int64_t d = 0; d < c.Dv; ++d) {
                const float o = batched ? *static_cast<float*>(ac.out.ref.at(b, i, h, d))
                                        : *static_cast<float*>(ac.out.ref.at(row, h, d));
                ASSERT_EQ(o, 0.0f) << "b=" << b << " i=" << i << " h=" << h << "\n" << fstest::describe(c);
              }
              const float lse = batched ? *static_cast<float*>(ac.lse.ref.at(b, h, i))
                                        : *static_cast<float*>(ac.lse.ref.at(h, row));
              const float want = sinks ? float(ac.feats[size_t(b)].sinks[size_t(h)]) : -INFINITY;
              ASSERT_EQ(lse, want) << "b=" << b << " i=" << i << " h=" << h << "\n" << fstest::describe(c);
            }
          }
        }
        EXPECT_GT(masked, 0);
      }
}

TEST(AttentionEdge, BlockSizeOne) {
  for (KvMode mode : {KvMode::varlen_paged, KvMode::batched_paged})
    for (KvLayout layout : {KvLayout::nhd, KvLayout::hnd}) {
      CaseConfig c = fstest::small_case_config(mode, {1, 9, 4}, {100, 37, 1});
      c.block_size = 1;
      c.layout = layout;
      c.random_block_ids = true;
      c.table_row_pad = 3, c.table_col_offset = 2;
      c.causal = true;
      c.num_splits = 3;
      expect_matches(c, 5);
    }
}

TEST(AttentionEdge, SingleToken) {
  for (KvMode mode : fstest::kAllKvModes)
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      CaseConfig c = fstest::small_case_config(mode, {1}, {1});
      c.q_dtype = c.kv_dtype = c.out_dtype = dt;
      c.block_size = 16;
      c.causal = true;
      c.softcap = 5.0f;
      c.sinks = dt == DType::bf16;
      c.num_splits = 7;
      expect_matches(c, 6);
    }
}

// ---- caches over 2^31 bytes, in sparse virtual memory (only touched pages are backed)

namespace {

constexpr int64_t kGiB = int64_t(1) << 30;
constexpr int64_t k2GiB = int64_t(1) << 31;

struct SparseRegion {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  explicit SparseRegion(int64_t n) : bytes(size_t(n)) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  }
  ~SparseRegion() {
    if (ok()) munmap(base, bytes);
  }
  bool ok() const { return base != MAP_FAILED; }
  char* at(int64_t off) const { return static_cast<char*>(base) + off; }
};

TensorRef with_strides(TensorRef t, void* data, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride) {
  return TensorRef::strided(data, t.dtype, shape, stride, t.device);
}

// Copies src into dst (same shape), one last-dim row at a time.
void copy_rows(const TensorRef& src, const TensorRef& dst) {
  ASSERT_EQ(src.ndim, dst.ndim);
  const int64_t es = int64_t(flashserve::dtype_size(src.dtype)), row = src.shape[size_t(src.ndim - 1)] * es;
  fstest::for_each_index(src.select(-1, 0), [&](const std::vector<int64_t>& idx, int64_t off) {
    int64_t doff = 0;
    for (size_t d = 0; d < idx.size(); ++d) doff += idx[d] * dst.stride[d];
    std::memcpy(static_cast<char*>(dst.data) + doff * es, static_cast<const char*>(src.data) + off * es, size_t(row));
  });
}

// Paged caches moved into `r`: K blocks at `k_off`, V blocks at `v_off`, block stride
// `stride` elements, `num_blocks` blocks; old block n becomes new_id[n] (the block table is
// rewritten).
void relocate_paged(fstest::AttentionCase& ac, const SparseRegion& r, int64_t k_off, int64_t v_off,
                    int64_t stride, int64_t num_blocks, const std::vector<int64_t>& new_id) {
  auto& p = ac.params;
  auto moved = [&](const TensorRef& t, int64_t off) {
    return with_strides(t, r.at(off), {num_blocks, t.shape[1], t.shape[2], t.shape[3]},
                        {stride, t.stride[1], t.stride[2], 1});
  };
  const TensorRef k = moved(p.k, k_off), v = moved(p.v, v_off);
  for (int64_t n = 0; n < p.k.shape[0]; ++n) {
    copy_rows(p.k.select(0, n), k.select(0, new_id[size_t(n)]));
    copy_rows(p.v.select(0, n), v.select(0, new_id[size_t(n)]));
  }
  const TensorRef& bt = *p.block_table;
  for (int64_t b = 0; b < bt.shape[0]; ++b)
    for (int64_t j = 0; j < bt.shape[1]; ++j) {
      int32_t* e = static_cast<int32_t*>(bt.at(b, j));
      *e = int32_t(new_id[size_t(*e)]);
    }
  p.k = k, p.v = v;
}

}  // namespace

TEST(AttentionEdge, PagedCacheOver2GiB) {
  const int64_t region = 4 * kGiB + kGiB / 2;
  SparseRegion r(region);
  if (!r.ok()) GTEST_SKIP() << "mmap of " << region << " bytes of sparse virtual memory failed";
  for (KvMode mode : {KvMode::varlen_paged, KvMode::batched_paged})
    for (KvLayout layout : {KvLayout::nhd, KvLayout::hnd})
      for (DType kv : {DType::f16, DType::f8e4m3}) {
        CaseConfig c = fstest::small_case_config(mode, {3, 1, 5}, {40, 70, 33});
        c.block_size = 16, c.layout = layout, c.causal = true, c.num_splits = 2;
        c.q_dtype = c.out_dtype = DType::f16;
        c.kv_dtype = kv;
        c.quant = kv == DType::f16 ? fstest::QuantMode::none : fstest::QuantMode::fp8_kv;
        fstest::AttentionCase ac = build(c, 7);
        const int64_t old_blocks = ac.params.k.shape[0];
        const int64_t block_elems = ac.params.k.shape[1] * ac.params.k.shape[2] * ac.params.k.shape[3];
        const int64_t es = int64_t(flashserve::dtype_size(kv)), half = region / 2;
        const int64_t num_blocks = half / (block_elems * es);
        // Old blocks go to the very end of the cache, then around the 2^31-byte offset.
        std::vector<int64_t> new_id(static_cast<size_t>(old_blocks));
        const int64_t boundary = k2GiB / (block_elems * es);
        for (int64_t n = 0; n < old_blocks; ++n)
          new_id[size_t(n)] = n < 4 ? num_blocks - 1 - n : boundary - 2 + (n - 4) * 3;
        ASSERT_LT(new_id.back(), num_blocks - 4);
        relocate_paged(ac, r, 0, half, block_elems, num_blocks, new_id);
        fstest::run_case(ac);
        EXPECT_EQ(fstest::check_case(ac), "") << "blocks past 2^31 bytes\n" << fstest::describe(c);

        // Few blocks, each 320 MiB apart (K and V interleaved in the block stride): blocks 7 and
        // later lie past 2^31 bytes.
        fstest::AttentionCase ac2 = build(c, 8);
        const int64_t nb2 = ac2.params.k.shape[0], stride2 = 320 * (kGiB / 1024) / es;
        ASSERT_LE(nb2 * stride2 * es, region);
        std::vector<int64_t> same(static_cast<size_t>(nb2));
        for (int64_t n = 0; n < nb2; ++n) same[size_t(n)] = n;
        relocate_paged(ac2, r, 0, stride2 * es / 2, stride2, nb2, same);
        fstest::run_case(ac2);
        EXPECT_EQ(fstest::check_case(ac2), "") << "320 MiB block stride\n" << fstest::describe(c);
      }
}

TEST(AttentionEdge, ContiguousCacheOver2GiB) {
  const int64_t region = 4 * kGiB + kGiB / 2;
  SparseRegion r(region);
  if (!r.ok()) GTEST_SKIP() << "mmap of " << region << " bytes of sparse virtual memory failed";
  // Batched: cache rows 1 GiB apart (rows 2 and 3 lie past 2^31 bytes), V 512 MiB into each row.
  {
    CaseConfig c = fstest::small_case_config(KvMode::batched_contiguous, {2, 2}, {30, 12});
    c.use_cache_batch_idx = true, c.extra_kv_rows = 2;
    fstest::AttentionCase ac = build(c, 9);
    auto& p = ac.params;
    const int64_t es = 4, row = kGiB / es;
    ASSERT_LE(p.k.shape[0] * kGiB, region);
    const TensorRef k = with_strides(p.k, r.at(0), {p.k.shape[0], p.k.shape[1], p.k.shape[2], p.k.shape[3]},
                                     {row, p.k.stride[1], p.k.stride[2], 1});
    const TensorRef v = with_strides(p.v, r.at(kGiB / 2), {p.v.shape[0], p.v.shape[1], p.v.shape[2], p.v.shape[3]},
                                     {row, p.v.stride[1], p.v.stride[2], 1});
    copy_rows(p.k, k);
    copy_rows(p.v, v);
    p.k = k, p.v = v;
    fstest::run_case(ac);
    EXPECT_EQ(fstest::check_case(ac), "") << fstest::describe(c);
  }
  // Varlen: a token stride of 384 MiB, so tokens 6 and later lie past 2^31 bytes.
  {
    CaseConfig c = fstest::small_case_config(KvMode::varlen_contiguous, {2, 3}, {4, 5});
    c.use_seqused = false, c.extra_kv_rows = 0;
    fstest::AttentionCase ac = build(c, 10);
    auto& p = ac.params;
    const int64_t es = 4, tok = 384 * (kGiB / 1024) / es;
    ASSERT_LE(p.k.shape[0] * tok * es, region);
    const TensorRef k = with_strides(p.k, r.at(0), {p.k.shape[0], p.k.shape[1], p.k.shape[2]}, {tok, p.k.stride[1], 1});
    const TensorRef v = with_strides(p.v, r.at(tok * es / 2), {p.v.shape[0], p.v.shape[1], p.v.shape[2]},
                                     {tok, p.v.stride[1], 1});
    copy_rows(p.k, k);
    copy_rows(p.v, v);
    p.k = k, p.v = v;
    fstest::run_case(ac);
    EXPECT_EQ(fstest::check_case(ac), "") << fstest::describe(c);
  }
}
