// The tree-speculation metadata operations (spec_metadata.hpp) on the CPU against loop oracles
// written from SGLang's torch / Triton formulation (support/spec_operands.*): random batches
// (int32 and int64 indices, padded tables, padded graph batches reading mask element 0, window
// lengths past their source tables), outputs poisoned so that every write and every untouched
// column shows; validate_only writes nothing; bad inputs are rejected naming the argument before
// any write.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "flashserve/spec_metadata.hpp"
#include "flashserve/status.hpp"
#include "support/checks.hpp"
#include "support/spec_operands.hpp"

namespace {

namespace fs = flashserve;
using fs::DType;
using fs::TensorRef;
using fstest::HostTensor;
using fstest::uniform_int;

constexpr fs::Device kCuda{fs::DeviceType::cuda, 0};

template <class Case>
void expect_matches(const Case& c, const std::string& label) {
  std::string first;
  const int64_t bad = fstest::compare_outputs(c.out, fstest::oracle(c), first);
  EXPECT_EQ(bad, 0) << label << ": " << first << fstest::seed_note();
  EXPECT_TRUE(fstest::padding_untouched(c.out.page_table)) << label << ": wrote outside page_table's view";
}

TEST(SpecMetadata, DraftExpandMatchesOracle) {
  std::mt19937_64 rng = fstest::make_rng(fstest::test_salt());
  for (int i = 0; i < 40; ++i) {
    const int64_t rows = uniform_int(rng, 0, 40), steps = uniform_int(rng, 1, 6);
    fstest::DraftExpandCase c = fstest::make_draft_expand(rng, rows, steps, i % 2 ? DType::i64 : DType::i32);
    fs::spec_draft_expand(c.params());
    expect_matches(c, "case " + std::to_string(i));
  }
}

TEST(SpecMetadata, VerifyExpandMatchesOracle) {
  std::mt19937_64 rng = fstest::make_rng(fstest::test_salt());
  for (int i = 0; i < 60; ++i) {
    const int64_t batch = uniform_int(rng, 0, 9), drafts = uniform_int(rng, 1, 8);
    fstest::VerifyExpandCase c =
        fstest::make_verify_expand(rng, batch, drafts, i % 2 ? DType::i64 : DType::i32, i % 3 == 0);
    fs::spec_verify_expand(c.params());
    expect_matches(c, "case " + std::to_string(i) + " B=" + std::to_string(batch) + " n=" + std::to_string(drafts));
  }
}

TEST(SpecMetadata, WindowPageTableMatchesOracle) {
  std::mt19937_64 rng = fstest::make_rng(fstest::test_salt());
  for (int i = 0; i < 40; ++i) {
    const int64_t batch = uniform_int(rng, 0, 6), drafts = uniform_int(rng, 1, 6);
    fstest::WindowCase c = fstest::make_window(rng, batch, drafts, uniform_int(rng, 0, 30), uniform_int(rng, 0, 8));
    fs::spec_window_page_table(c.params());
    expect_matches(c, "case " + std::to_string(i));
  }
}

// A tree of 4 drafts (0 <- 1, 0 <- 2 <- 3) over prefixes of 3 and 1 tokens: slots 100 b + pos,
// the expand rows by hand (visible drafts first, in draft order, then the hidden ones).
TEST(SpecMetadata, VerifyExpandWorkedExample) {
  std::mt19937_64 rng = fstest::make_rng(1);
  fstest::VerifyExpandCase c = fstest::make_verify_expand(rng, 2, 4, DType::i32, false);
  const std::vector<int64_t> lens = {3, 1};
  for (int64_t b = 0; b < 2; ++b) {
    *static_cast<int32_t*>(c.seq_lens.ref.at(b)) = int32_t(lens[size_t(b)]);
    const int64_t req = *static_cast<const int32_t*>(c.req_pool_indices.ref.at(b));
    for (int64_t j = 0; j < 8; ++j) *static_cast<int32_t*>(c.req_to_token.ref.at(req, j)) = int32_t(100 * b + j);
  }
  // draft i's row shows the prefix, itself and its ancestors
  const bool tree[4][4] = {{1, 0, 0, 0}, {1, 1, 0, 0}, {1, 0, 1, 0}, {1, 0, 1, 1}};
  c.custom_mask = HostTensor::zeros(DType::u8, {4 * (3 + 4) + 4 * (1 + 4)});
  int64_t at = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t k = 0; k < lens[size_t(b)] + 4; ++k, ++at)
        static_cast<uint8_t*>(c.custom_mask.ref.data)[at] = k < lens[size_t(b)] || tree[i][k - lens[size_t(b)]];
  fs::spec_verify_expand(c.params());
  const int32_t want_rows[4][4] = {{3, 4, 5, 6}, {3, 4, 5, 6}, {3, 5, 4, 6}, {3, 5, 6, 4}};
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t k = 0; k < 4; ++k)
        EXPECT_EQ(*static_cast<int32_t*>(c.out.page_table.ref.at(b * 4 + i, k)),
                  100 * b + want_rows[i][k] - (b ? 2 : 0)) << "row " << b * 4 + i << " col " << k;
  const std::vector<int32_t> want_lens = {1, 2, 2, 3, 1, 2, 2, 3};
  for (int64_t r = 0; r < 8; ++r) EXPECT_EQ(*static_cast<int32_t*>(c.out.cache_seqlens.ref.at(r)), want_lens[size_t(r)]);
  EXPECT_EQ(*static_cast<int32_t*>(c.out.cu_seqlens_k.ref.at(8)), 16);
}

// ---------------------------------------------------------------- validation

// One case of each operation; mutate() breaks one argument.
struct OpSet {
  std::mt19937_64 rng = fstest::make_rng(7);
  fstest::DraftExpandCase draft = fstest::make_draft_expand(rng, 6, 3, DType::i64);
  fstest::VerifyExpandCase verify = fstest::make_verify_expand(rng, 3, 4, DType::i64, false);
  fstest::WindowCase window = fstest::make_window(rng, 3, 2, 10, 3);
  fs::SpecDraftExpandParams dp = draft.params();
  fs::SpecVerifyExpandParams vp = verify.params();
  fs::SpecWindowPageTableParams wp = window.params();

  std::vector<const HostTensor*> all() const {
    std::vector<const HostTensor*> v;
    for (const fstest::SpecOutputs* o : {&draft.out, &verify.out, &window.out})
      for (const HostTensor* t : {&o->page_table, &o->cache_seqlens, &o->cu_seqlens_k}) v.push_back(t);
    return v;
  }
};

enum class Op { draft, verify, window };

struct Bad {
  std::string label;
  Op op;
  std::string arg;  // empty: NotImplemented naming CUDA
  std::function<void(OpSet&)> mutate;
};

void run(OpSet& s, Op op, const fs::ExecContext& ctx = {}) {
  if (op == Op::draft) fs::spec_draft_expand(s.dp, ctx);
  if (op == Op::verify) fs::spec_verify_expand(s.vp, ctx);
  if (op == Op::window) fs::spec_window_page_table(s.wp, ctx);
}

void expect_rejected(const Bad& bad) {
  SCOPED_TRACE(bad.label);
#if FLASHSERVE_WITH_CUDA
  if (bad.arg.empty()) return;  // CUDA builds run these on the device (tests/gpu)
#endif
  OpSet s;
  bad.mutate(s);
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : s.all()) before.push_back(fstest::snapshot(*t));
  try {
    run(s, bad.op);
    ADD_FAILURE() << "no exception";
  } catch (const fs::Error& e) {
    EXPECT_FALSE(bad.arg.empty()) << "Error instead of NotImplemented: " << e.what();
    EXPECT_EQ(std::string(e.what()).rfind(bad.arg + ": expected ", 0), 0u) << "message: " << e.what();
  } catch (const fs::NotImplemented& e) {
    EXPECT_TRUE(bad.arg.empty()) << "NotImplemented instead of Error: " << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  const std::vector<const HostTensor*> all = s.all();
  for (size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(fstest::same_bytes(*all[i], before[i])) << "tensor " << i << " changed";
}

TensorRef with_dtype(TensorRef t, DType d) {
  t.dtype = d;
  return t;
}
TensorRef on_cuda(TensorRef t) {
  t.device = kCuda;
  return t;
}
void set_at(const HostTensor& t, int64_t i, int64_t v) {
  if (t.ref.dtype == DType::i64) *static_cast<int64_t*>(t.ref.at(i)) = v;
  else *static_cast<int32_t*>(t.ref.at(i)) = int32_t(v);
}

}  // namespace

TEST(SpecMetadata, ValidateOnlyWritesNothing) {
  OpSet s;
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor* t : s.all()) before.push_back(fstest::snapshot(*t));
  fs::ExecContext dry;
  dry.validate_only = true;
  for (Op op : {Op::draft, Op::verify, Op::window}) run(s, op, dry);
  const std::vector<const HostTensor*> all = s.all();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(fstest::same_bytes(*all[i], before[i])) << "tensor " << i;
  OpSet bad;  // validate_only still checks the CPU contents that index memory
  set_at(bad.verify.req_pool_indices, 1, 1000);
  EXPECT_THROW(run(bad, Op::verify, dry), fs::Error);
}

TEST(SpecMetadata, BadInputsAreRejectedBeforeAnyWrite) {
  using D = Op;
  const std::vector<Bad> cases = {
      // spec_draft_expand
      {"out_cache_loc float32", D::draft, "out_cache_loc", [](OpSet& s) {
         s.dp.out_cache_loc = with_dtype(s.draft.out_cache_loc, DType::f32); }},
      {"out_cache_loc 1 dim", D::draft, "out_cache_loc", [](OpSet& s) {
         s.dp.out_cache_loc = s.draft.out_cache_loc.ref.select(1, 0); }},
      {"decode_length 0", D::draft, "decode_length", [](OpSet& s) { s.dp.decode_length = 0; }},
      {"decode_length past num_steps", D::draft, "decode_length", [](OpSet& s) { s.dp.decode_length = 4; }},
      {"page_table too narrow", D::draft, "page_table", [](OpSet& s) {
         s.dp.decode_length = 3, s.dp.page_table = s.draft.out.page_table.ref.slice(1, 0, 2); }},
      {"page_table rows", D::draft, "page_table", [](OpSet& s) {
         s.dp.page_table = s.draft.out.page_table.ref.slice(0, 0, 5); }},
      {"page_table int64", D::draft, "page_table", [](OpSet& s) {
         s.dp.page_table = with_dtype(s.draft.out.page_table, DType::i64); }},
      {"cache_seqlens [R - 1]", D::draft, "cache_seqlens", [](OpSet& s) {
         s.dp.cache_seqlens = s.draft.out.cache_seqlens.ref.slice(0, 0, 5); }},
      {"cu_seqlens_k [R]", D::draft, "cu_seqlens_k", [](OpSet& s) {
         s.dp.cu_seqlens_k = s.draft.out.cu_seqlens_k.ref.slice(0, 0, 6); }},
      {"page_table on CUDA", D::draft, "page_table", [](OpSet& s) { s.dp.page_table = on_cuda(s.draft.out.page_table); }},
      {"all on CUDA", D::draft, "", [](OpSet& s) {
         for (TensorRef* t : {&s.dp.out_cache_loc, &s.dp.page_table, &s.dp.cache_seqlens, &s.dp.cu_seqlens_k})
           t->device = kCuda; }},
      // spec_verify_expand
      {"custom_mask int32", D::verify, "custom_mask", [](OpSet& s) {
         s.vp.custom_mask = TensorRef::contiguous(s.verify.custom_mask.ref.data, DType::i32, {4}); }},
      {"custom_mask too short", D::verify, "custom_mask", [](OpSet& s) {
         s.vp.custom_mask = s.verify.custom_mask.ref.slice(0, 0, s.verify.custom_mask.ref.size(0) - 1); }},
      {"req_to_token int64", D::verify, "req_to_token", [](OpSet& s) {
         s.vp.req_to_token = with_dtype(s.verify.req_to_token, DType::i64); }},
      {"pool index past req_to_token", D::verify, "req_pool_indices", [](OpSet& s) {
         set_at(s.verify.req_pool_indices, 2, s.verify.req_to_token.ref.size(0)); }},
      {"negative pool index", D::verify, "req_pool_indices", [](OpSet& s) { set_at(s.verify.req_pool_indices, 0, -1); }},
      {"drafts past req_to_token's columns", D::verify, "seq_lens", [](OpSet& s) {
         set_at(s.verify.seq_lens, 1, s.verify.req_to_token.ref.size(1) - 3); }},
      {"negative seq_lens", D::verify, "seq_lens", [](OpSet& s) { set_at(s.verify.seq_lens, 0, -1); }},
      {"seq_lens [B - 1]", D::verify, "seq_lens", [](OpSet& s) { s.vp.seq_lens = s.verify.seq_lens.ref.slice(0, 0, 2); }},
      {"num_draft_tokens 0", D::verify, "num_draft_tokens", [](OpSet& s) { s.vp.num_draft_tokens = 0; }},
      {"num_draft_tokens differs", D::verify, "page_table", [](OpSet& s) { s.vp.num_draft_tokens = 3; }},
      {"mask_rows past B * n", D::verify, "mask_rows", [](OpSet& s) { s.vp.mask_rows = 13; }},
      {"negative mask_rows", D::verify, "mask_rows", [](OpSet& s) { s.vp.mask_rows = -1; }},
      {"page_table narrower than n", D::verify, "page_table", [](OpSet& s) {
         s.vp.page_table = s.verify.out.page_table.ref.slice(1, 0, 3); }},
      {"cu_seqlens_k int64", D::verify, "cu_seqlens_k", [](OpSet& s) {
         s.vp.cu_seqlens_k = with_dtype(s.verify.out.cu_seqlens_k, DType::i64); }},
      {"seq_lens on CUDA", D::verify, "seq_lens", [](OpSet& s) { s.vp.seq_lens = on_cuda(s.verify.seq_lens); }},
      {"all on CUDA", D::verify, "", [](OpSet& s) {
         for (TensorRef* t : {&s.vp.custom_mask, &s.vp.req_to_token, &s.vp.req_pool_indices, &s.vp.seq_lens,
                              &s.vp.page_table, &s.vp.cache_seqlens, &s.vp.cu_seqlens_k}) t->device = kCuda; }},
      // spec_window_page_table
      {"seq_len_a int64", D::window, "seq_len_a", [](OpSet& s) { s.wp.seq_len_a = with_dtype(s.window.seq_len_a, DType::i64); }},
      {"seq_len_b [B * n - 1]", D::window, "seq_len_b", [](OpSet& s) {
         s.wp.seq_len_b = s.window.seq_len_b.ref.slice(0, 0, 5); }},
      {"page_table_a rows", D::window, "page_table_a", [](OpSet& s) {
         s.wp.page_table_a = s.window.page_table_a.ref.slice(0, 0, 2); }},
      {"page_table_b rows", D::window, "page_table_b", [](OpSet& s) {
         s.wp.page_table_b = s.window.page_table_b.ref.slice(0, 0, 5); }},
      {"negative seq_len_b", D::window, "seq_len_b", [](OpSet& s) { set_at(s.window.seq_len_b, 4, -2); }},
      {"negative seq_len_a", D::window, "seq_len_a", [](OpSet& s) { set_at(s.window.seq_len_a, 1, -2); }},
      {"row past page_table's width", D::window, "page_table", [](OpSet& s) {
         s.wp.page_table = s.window.out.page_table.ref.slice(1, 0, 3), set_at(s.window.seq_len_a, 0, 4); }},
      {"num_draft_tokens 0", D::window, "num_draft_tokens", [](OpSet& s) { s.wp.num_draft_tokens = 0; }},
      {"page_table_b on CUDA", D::window, "page_table_b", [](OpSet& s) {
         s.wp.page_table_b = on_cuda(s.window.page_table_b); }},
      {"all on CUDA", D::window, "", [](OpSet& s) {
         for (TensorRef* t : {&s.wp.page_table_a, &s.wp.page_table_b, &s.wp.seq_len_a, &s.wp.seq_len_b,
                              &s.wp.page_table, &s.wp.cache_seqlens, &s.wp.cu_seqlens_k}) t->device = kCuda; }},
  };
  for (const Bad& bad : cases) expect_rejected(bad);
}
