// Chunked local attention as virtual batches (SPEC.md §6): the worked example, random batches
// against a brute-force construction per query token, the exactly-once invariant, the
// gathered virtual block table and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "flashserve/status.hpp"
#include "planner/local_batches.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace pl = flashserve::planner;
using V32 = std::vector<int32_t>;

V32 starts_of(const V32& q_lens) {
  V32 qsl{0};
  for (int32_t q : q_lens) qsl.push_back(qsl.back() + q);
  return qsl;
}

struct Virtual {
  V32 cu, k_lens, k_start, request;
  int64_t n = 0;
};

Virtual make(const V32& q_lens, const V32& k_lens, int64_t chunk, int64_t spare = 0) {
  const V32 qsl = starts_of(q_lens);
  const int64_t n = pl::count_local_virtual_requests(qsl, k_lens, chunk);
  const size_t cap = size_t(n + spare);
  Virtual v;
  v.cu.assign(cap + 1, -7);
  v.k_lens.assign(cap, -7);
  v.k_start.assign(cap, -7);
  v.request.assign(cap, -7);
  v.n = pl::make_local_virtual_batch(qsl, k_lens, chunk, {v.cu, v.k_lens, v.k_start, v.request});
  EXPECT_EQ(v.n, n);
  v.cu.resize(size_t(n) + 1);
  v.k_lens.resize(size_t(n));
  v.k_start.resize(size_t(n));
  v.request.resize(size_t(n));
  return v;
}

V32 q_lens_of(const Virtual& v) {
  V32 q;
  for (int64_t i = 0; i < v.n; ++i) q.push_back(v.cu[size_t(i) + 1] - v.cu[size_t(i)]);
  return q;
}

// Brute force, per query token (request r, row i at absolute position p = k - q + i): its
// virtual request must start its keys at its chunk's start, hold it as a query row aligned so
// that causal attention sees exactly keys [p / C * C, p], and come from request r. Every
// query token lands in exactly one virtual request.
void check_against_brute_force(const V32& q_lens, const V32& k_lens, int64_t chunk, const Virtual& v) {
  const V32 qsl = starts_of(q_lens);
  ASSERT_EQ(v.cu.front(), 0);
  ASSERT_EQ(v.cu.back(), qsl.back());
  std::vector<int> hits(size_t(qsl.back()), 0);
  for (int64_t j = 0; j < v.n; ++j) {
    const int64_t lq = v.cu[size_t(j) + 1] - v.cu[size_t(j)], lk = v.k_lens[size_t(j)];
    ASSERT_GE(lq, 1) << "virtual request " << j << " has no query";
    ASSERT_GE(lk, lq);
    ASSERT_LE(lk, chunk);
    ASSERT_EQ(v.k_start[size_t(j)] % chunk, 0);
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t row = v.cu[size_t(j)] + i;
      ++hits[size_t(row)];
      const int64_t r = v.request[size_t(j)];
      ASSERT_TRUE(row >= qsl[size_t(r)] && row < qsl[size_t(r) + 1]) << "row " << row << " not of request " << r;
      const int64_t p = k_lens[size_t(r)] - q_lens[size_t(r)] + (row - qsl[size_t(r)]);
      // Causal bottom-right alignment in the virtual request: row i sees keys [0, lk - lq + i].
      const int64_t first_key = v.k_start[size_t(j)], last_key = v.k_start[size_t(j)] + lk - lq + i;
      ASSERT_EQ(first_key, p / chunk * chunk) << "row " << row;
      ASSERT_EQ(last_key, p) << "row " << row;
    }
  }
  for (size_t t = 0; t < hits.size(); ++t) ASSERT_EQ(hits[t], 1) << "query token " << t;
}

}  // namespace

TEST(LocalBatches, WorkedExampleOfTheSpec) {
  const V32 q{4, 10, 5}, k{6, 17, 9};
  const Virtual v = make(q, k, 4);
  EXPECT_EQ(q_lens_of(v), (V32{2, 2, 1, 4, 4, 1, 4, 1}));
  EXPECT_EQ(v.k_lens, (V32{4, 2, 4, 4, 4, 1, 4, 1}));
  EXPECT_EQ(v.k_start, (V32{0, 4, 4, 8, 12, 16, 4, 8}));
  EXPECT_EQ(v.request, (V32{0, 0, 1, 1, 1, 1, 2, 2}));
  check_against_brute_force(q, k, 4, v);
}

TEST(LocalBatches, EdgeCases) {
  // Zero-query requests make no virtual request; a decode at a chunk boundary starts one.
  const Virtual v = make({0, 1, 1, 3}, {5, 8, 9, 3}, 4);
  EXPECT_EQ(q_lens_of(v), (V32{1, 1, 3}));
  EXPECT_EQ(v.k_lens, (V32{4, 1, 3}));
  EXPECT_EQ(v.k_start, (V32{4, 8, 0}));
  EXPECT_EQ(v.request, (V32{1, 2, 3}));
  const Virtual e = make({}, {}, 8);
  EXPECT_EQ(e.n, 0);
  EXPECT_EQ(e.cu, (V32{0}));
  const Virtual one = make({7}, {7}, 1);  // chunk 1: every token alone
  EXPECT_EQ(q_lens_of(one), V32(7, 1));
  EXPECT_EQ(one.k_lens, V32(7, 1));
}

TEST(LocalBatches, RandomBatchesMatchBruteForce) {
  auto rng = fstest::make_rng(0x10ca1);
  for (int it = 0; it < 2000; ++it) {
    const int64_t chunk = 1 + int64_t(rng() % 24);
    const int n = int(rng() % 9);
    V32 q(static_cast<size_t>(n)), k(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      q[size_t(r)] = int32_t(rng() % 4 == 0 ? rng() % 2 : rng() % 60);
      k[size_t(r)] = q[size_t(r)] + int32_t(rng() % 3 == 0 ? 0 : rng() % 100);
    }
    const Virtual v = make(q, k, chunk, int64_t(rng() % 3));  // outputs with spare room, or exact
    SCOPED_TRACE(testing::Message() << "iteration " << it << " chunk " << chunk);
    check_against_brute_force(q, k, chunk, v);
  }
}

TEST(LocalBatches, GatheredBlockTableRows) {
  // 3 requests, block size 2, chunk 4: virtual row v = table row request[v] from k_start / 2.
  const int64_t bs = 2, cols = 9, stride = 11;
  V32 table(size_t(3 * stride), -1);
  for (int r = 0; r < 3; ++r)
    for (int j = 0; j < cols; ++j) table[size_t(r * stride + j)] = 100 * r + j;
  const V32 q{4, 10, 5}, k{6, 17, 9};
  const Virtual v = make(q, k, 4);
  const int64_t width = 2;
  V32 out(size_t(v.n * width), -9);
  pl::gather_local_block_table({table.data(), 3, cols, stride}, bs, v.k_start, v.request, v.n, out, width);
  for (int64_t j = 0; j < v.n; ++j)
    for (int64_t c = 0; c < width; ++c) {
      const int64_t col = v.k_start[size_t(j)] / bs + c;
      const int32_t want = col < cols ? table[size_t(v.request[size_t(j)] * stride + col)] : 0;
      EXPECT_EQ(out[size_t(j * width + c)], want) << "virtual " << j << " column " << c;
    }
  // Every block a virtual request reads is its request's block for that position.
  for (int64_t j = 0; j < v.n; ++j)
    for (int64_t t = 0; t < v.k_lens[size_t(j)]; ++t) {
      const int64_t pos = v.k_start[size_t(j)] + t;
      EXPECT_EQ(out[size_t(j * width + t / bs)], table[size_t(v.request[size_t(j)] * stride + pos / bs)]);
    }
}

TEST(LocalBatches, Errors) {
  const V32 qsl{0, 4, 6};
  EXPECT_THROW(pl::count_local_virtual_requests(qsl, V32{3, 5}, 4), fs::Error);  // k < q
  EXPECT_THROW(pl::count_local_virtual_requests(qsl, V32{5, 5}, 0), fs::Error);
  EXPECT_THROW(pl::count_local_virtual_requests(V32{0, 4}, V32{5, 5}, 4), fs::Error);
  EXPECT_THROW(pl::count_local_virtual_requests(V32{0, 4, 2}, V32{5, 5}, 4), fs::Error);
  try {
    pl::count_local_virtual_requests(qsl, V32{3, 5}, 4);
  } catch (const fs::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("seq_lens:", 0), 0u) << e.what();
  }
  V32 small(1), cu(3, -1);
  V32 ks(2, -1), st(2, -1), rq(2, -1);
  EXPECT_THROW(pl::make_local_virtual_batch(qsl, V32{5, 5}, 4, {cu, small, st, rq}), fs::Error);
  EXPECT_EQ(cu, V32(3, -1)) << "written before the capacity check";
  V32 table(8, 1), out(4, -1);
  const V32 bad_start{2}, req{0};
  EXPECT_THROW(pl::gather_local_block_table({table.data(), 1, 8, 8}, 4, bad_start, req, 1, out, 4), fs::Error);
  EXPECT_EQ(out, V32(4, -1));
}
