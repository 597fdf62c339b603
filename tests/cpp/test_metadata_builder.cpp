// MetadataBuilder (SPEC.md §6) on hand-made batches: the decode/prefill split and its views,
// plans, cascade, chunked local, draft-tree, DCP, cross-attention and encoder metadata,
// update_block_table, advance_decode_step, capacities and errors. Random replays (graph mode,
// update, advance against fresh builds) live in test_planner_fuzz.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "support/engine_step.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using V32 = std::vector<int32_t>;
using V64 = std::vector<int64_t>;

// ---------------------------------------------------------------- an engine's step

// The engine's step with its block size; slots from the table.
struct Step : fstest::EngineStep {
  int64_t bs = 16;

  int64_t slot_of(int64_t r, int64_t pos) const { return int64_t(block(r, pos / bs)) * bs + pos % bs; }
  void fill_slots() {
    slots.assign(size_t(qsl.back()), -1);
    for (int64_t r = 0; r < num_reqs(); ++r)
      for (int64_t i = 0; i < q(r); ++i) slots[size_t(qsl[size_t(r)] + i)] = slot_of(r, seq[size_t(r)] - q(r) + i);
  }
};

// Distinct block ids per (row, column), except that every row's first `shared` blocks are
// row 0's (a shared prefix). `salt` changes the ids (another layer group's table).
Step make_step(const V32& q_lens, const V32& seq_lens, int64_t bs, int64_t cols, int64_t shared = 0, int salt = 0) {
  Step s;
  s.qsl = {0};
  for (int32_t q : q_lens) s.qsl.push_back(s.qsl.back() + q);
  s.seq = seq_lens;
  s.enc = seq_lens;
  s.bs = bs;
  s.rows = int64_t(q_lens.size()) + 1;
  s.cols = cols;
  s.stride = cols + 3;
  s.table.assign(size_t(s.rows * s.stride), -5);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      s.table[size_t(r * s.stride + j)] = int32_t(j < shared ? 7 + 3 * j + salt : 7 + 3 * (r * cols + j) + salt);
  s.fill_slots();
  return s;
}

be::BuilderConfig base_config(int64_t bs = 16) {
  be::BuilderConfig c;
  c.layer.num_heads = 8;
  c.layer.num_kv_heads = 2;
  c.layer.head_size = 64;
  c.block_size = bs;
  c.max_num_reqs = 32;
  c.max_num_tokens = 512;
  c.max_blocks_per_req = 64;
  c.device = fs::DeviceProps::cpu();
  return c;
}

// ---------------------------------------------------------------- reading metadata

V32 values(const TensorRef& t) {
  V32 v;
  for (int64_t i = 0; i < (t.ndim ? t.size(0) : 0); ++i) v.push_back(*static_cast<const int32_t*>(t.at(i)));
  return v;
}

V32 row_of(const TensorRef& t, int64_t r) {
  V32 v;
  for (int64_t j = 0; j < t.size(1); ++j) v.push_back(*static_cast<const int32_t*>(t.at(r, j)));
  return v;
}

const void* engine_row(const Step& s, int64_t r, int64_t col = 0) { return &s.table[size_t(r * s.stride + col)]; }

// The plan of a part is the one for the call the forward makes with it.
void expect_plan_for(const be::PartMetadata& p, const be::BuilderConfig& c, int64_t page, bool local) {
  const fs::ProblemShape& s = p.plan.shape;
  EXPECT_EQ(s.batch, p.num_reqs);
  EXPECT_EQ(s.max_seqlen_q, p.max_query_len);
  EXPECT_EQ(s.max_seqlen_k, p.max_seq_len);
  EXPECT_EQ(s.total_q, p.num_tokens);
  EXPECT_EQ(s.num_heads, c.layer.num_heads * c.dcp_world_size);
  EXPECT_EQ(s.num_kv_heads, c.layer.num_kv_heads);
  EXPECT_EQ(s.head_dim, c.layer.head_size);
  EXPECT_EQ(s.head_dim_v, c.layer.head_size_v ? c.layer.head_size_v : c.layer.head_size);
  EXPECT_EQ(s.page_size, page);
  EXPECT_EQ(s.causal, p.causal);
  EXPECT_EQ(s.local, local);
  EXPECT_GE(p.plan.num_splits, 1);
  EXPECT_LE(p.plan.num_splits, c.max_num_splits);
}

template <class F>
void expect_error(F&& f, const std::string& arg) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one naming " << arg;
  } catch (const fs::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(arg + ":", 0), 0u) << e.what();
  }
}

}  // namespace

// ---------------------------------------------------------------- the split

TEST(MetadataBuilder, DecodePrefillSplitAndViews) {
  const be::BuilderConfig c = base_config();
  be::MetadataBuilder b(c);
  const Step s = make_step({1, 1, 1, 5, 3}, {10, 20, 33, 40, 3}, 16, 4);
  const be::AttentionMetadata& md = b.build(s.common());
  EXPECT_EQ(md.num_reqs, 5);
  EXPECT_EQ(md.num_actual_tokens, 11);
  EXPECT_EQ(md.num_decodes, 3);
  EXPECT_EQ(md.num_decode_tokens, 3);
  EXPECT_EQ(md.num_prefills, 2);
  EXPECT_EQ(md.num_prefill_tokens, 8);
  EXPECT_EQ(md.slot_mapping.data, s.slots.data());
  EXPECT_EQ(md.slot_mapping.size(0), 11);
  EXPECT_FALSE(md.cascade.enabled || md.local.enabled || md.tree.enabled);

  const be::PartMetadata& d = md.decode;
  EXPECT_EQ(d.req_begin, 0);
  EXPECT_EQ(d.num_reqs, 3);
  EXPECT_EQ(d.token_begin, 0);
  EXPECT_EQ(d.num_tokens, 3);
  EXPECT_EQ(d.max_query_len, 1);
  EXPECT_EQ(d.max_seq_len, 33);
  EXPECT_EQ(values(d.cu_seqlens_q), (V32{0, 1, 2, 3}));
  EXPECT_EQ(values(d.seqused_k), (V32{10, 20, 33}));
  EXPECT_EQ(d.cp_tot_seqused_k.ndim, 0);
  EXPECT_EQ(d.block_table.data, engine_row(s, 0));
  EXPECT_EQ(d.block_table.shape_str(), "[3, 4]");
  EXPECT_EQ(d.block_table.stride[0], s.stride);
  EXPECT_TRUE(d.causal);
  expect_plan_for(d, c, 16, false);

  const be::PartMetadata& p = md.prefill;
  EXPECT_EQ(p.req_begin, 3);
  EXPECT_EQ(p.num_reqs, 2);
  EXPECT_EQ(p.token_begin, 3);
  EXPECT_EQ(p.num_tokens, 8);
  EXPECT_EQ(p.max_query_len, 5);
  EXPECT_EQ(p.max_seq_len, 40);
  EXPECT_EQ(values(p.cu_seqlens_q), (V32{0, 5, 8}));
  EXPECT_EQ(values(p.seqused_k), (V32{40, 3}));
  EXPECT_EQ(p.block_table.data, engine_row(s, 3));
  EXPECT_EQ(p.block_table.shape_str(), "[2, 4]");
  expect_plan_for(p, c, 16, false);
  EXPECT_NE(d.cu_seqlens_q.data, p.cu_seqlens_q.data);
  EXPECT_NE(d.seqused_k.data, p.seqused_k.data);
}

TEST(MetadataBuilder, SpecDecodeThresholdOrderAndWindow) {
  be::BuilderConfig c = base_config();
  c.reorder_batch_threshold = 3;
  c.layer.sliding_window = 64;
  be::MetadataBuilder b(c);
  const Step s = make_step({3, 3, 1, 8}, {30, 40, 12, 50}, 16, 4);
  const be::AttentionMetadata& md = b.build(s.common());
  EXPECT_EQ(md.num_decodes, 3);
  EXPECT_EQ(md.num_decode_tokens, 7);
  EXPECT_EQ(values(md.decode.cu_seqlens_q), (V32{0, 3, 6, 7}));
  expect_plan_for(md.decode, c, 16, true);  // the window makes the calls local
  // A request over the threshold before a decode: not reordered.
  const Step bad = make_step({3, 8, 1}, {30, 50, 12}, 16, 4);
  expect_error([&] { b.build(bad.common()); }, "query_start_loc");
  EXPECT_EQ(values(md.decode.seqused_k), (V32{30, 40, 12})) << "a rejected build changed the metadata";
  const Step only_prefill = make_step({5, 8}, {30, 50}, 16, 4);
  const be::AttentionMetadata& m2 = b.build(only_prefill.common());
  EXPECT_TRUE(m2.decode.empty());
  EXPECT_EQ(m2.prefill.num_reqs, 2);
}

TEST(MetadataBuilder, PlansAreCappedAtMaxNumSplits) {
  be::BuilderConfig c = base_config();
  c.device.num_sms = 64;
  c.max_num_splits = 3;
  c.max_blocks_per_req = 512;
  be::MetadataBuilder b(c);
  const Step s = make_step({1}, {4000}, 16, 256);
  const be::AttentionMetadata& md = b.build(s.common());
  EXPECT_EQ(md.decode.plan.num_splits, 3);  // one request on 64 "SMs": the heuristic wants more
  c.max_num_splits = 128;
  be::MetadataBuilder b2(c);
  EXPECT_GT(b2.build(s.common()).decode.plan.num_splits, 3);
  expect_plan_for(b2.build(s.common()).decode, c, 16, false);
}

TEST(MetadataBuilder, FixedNumSplitsIgnoresTheBatch) {
  be::BuilderConfig c = base_config();
  c.device.num_sms = 64;
  c.max_blocks_per_req = 512;
  c.num_splits = 5;  // CUDA graphs: the same count for one request or many
  be::MetadataBuilder b(c);
  EXPECT_EQ(b.build(make_step({1}, {4000}, 16, 256).common()).decode.plan.num_splits, 5);
  V32 q(12, 1), seq(12, 3000);
  EXPECT_EQ(b.build(make_step(q, seq, 16, 256).common()).decode.plan.num_splits, 5);
  // capped by the keys' granules (never a split past the keys) and by max_num_splits
  EXPECT_LT(b.build(make_step({1}, {20}, 16, 256).common()).decode.plan.num_splits, 5);
  c.max_num_splits = 2;
  be::MetadataBuilder b2(c);
  EXPECT_EQ(b2.build(make_step({1}, {4000}, 16, 256).common()).decode.plan.num_splits, 2);
  be::BuilderConfig bad = base_config();
  bad.num_splits = -1;
  expect_error([&] { be::MetadataBuilder x(bad); }, "num_splits");
}

// ---------------------------------------------------------------- cascade

TEST(MetadataBuilder, CascadeMetadata) {
  const be::BuilderConfig c = base_config();
  be::MetadataBuilder b(c);
  // 9 decodes and a prefill sharing 20 blocks (320 tokens); the scheduler says 330.
  V32 q(9, 1), seq;
  q.push_back(7);
  for (int r = 0; r < 10; ++r) seq.push_back(340 + 13 * r);
  const Step s = make_step(q, seq, 16, 40, 20);
  const be::AttentionMetadata& md = b.build(s.common(), 330);
  ASSERT_TRUE(md.cascade.enabled);
  EXPECT_EQ(md.cascade.common_prefix_len, 320);
  EXPECT_TRUE(md.decode.empty() && md.prefill.empty());
  EXPECT_EQ(md.num_decodes, 9);

  const be::PartMetadata& pre = md.cascade.prefix;
  EXPECT_EQ(pre.num_reqs, 1);
  EXPECT_EQ(pre.num_tokens, 16);
  EXPECT_EQ(pre.max_query_len, 16);
  EXPECT_EQ(pre.max_seq_len, 320);
  EXPECT_EQ(values(pre.cu_seqlens_q), (V32{0, 16}));
  EXPECT_EQ(values(pre.seqused_k), (V32{320}));
  EXPECT_EQ(pre.block_table.data, engine_row(s, 0));
  EXPECT_EQ(pre.block_table.shape_str(), "[1, 20]");
  EXPECT_FALSE(pre.causal);
  expect_plan_for(pre, c, 16, false);

  const be::PartMetadata& suf = md.cascade.suffix;
  EXPECT_EQ(suf.num_reqs, 10);
  EXPECT_EQ(suf.num_tokens, 16);
  EXPECT_EQ(values(suf.cu_seqlens_q), s.qsl);
  V32 rest;
  for (int32_t x : seq) rest.push_back(x - 320);
  EXPECT_EQ(values(suf.seqused_k), rest);
  EXPECT_EQ(suf.block_table.data, engine_row(s, 0, 20));
  EXPECT_EQ(suf.block_table.shape_str(), "[10, 20]");
  EXPECT_EQ(suf.block_table.stride[0], s.stride);
  EXPECT_TRUE(suf.causal);
  expect_plan_for(suf, c, 16, false);
  for (int64_t r = 0; r < 10; ++r) EXPECT_EQ(row_of(suf.block_table, r)[0], s.block(r, 20));

  // The prefix is clamped to every request's context (request 0 has 339 tokens before its
  // query), in whole blocks.
  const Step all_shared = make_step(q, seq, 16, 40, 40);
  EXPECT_EQ(b.build(all_shared.common(), 100000).cascade.common_prefix_len, 336);
  // Below 256 tokens, or with cascade disabled: the plain split.
  EXPECT_FALSE(b.build(s.common(), 255).cascade.enabled);
  be::BuilderConfig off = c;
  off.enable_cascade = false;
  be::MetadataBuilder b_off(off);
  EXPECT_FALSE(b_off.build(s.common(), 330).cascade.enabled);
  // Rows that do not share the blocks the scheduler claims.
  const Step unshared = make_step(q, seq, 16, 40, 10);
  expect_error([&] { b.build(unshared.common(), 330); }, "common_prefix_len");
  expect_error([&] { b.build(s.common(), -1); }, "common_prefix_len");
}

// ---------------------------------------------------------------- chunked local

TEST(MetadataBuilder, ChunkedLocalVirtualBatch) {
  be::BuilderConfig c = base_config(2);
  c.layer.attention_chunk_size = 4;
  be::MetadataBuilder b(c);
  const Step s = make_step({4, 10, 5}, {6, 17, 9}, 2, 9);
  const be::AttentionMetadata& md = b.build(s.common(), 1000);
  ASSERT_TRUE(md.local.enabled);
  EXPECT_FALSE(md.cascade.enabled);
  EXPECT_TRUE(md.decode.empty() && md.prefill.empty());
  const be::PartMetadata& p = md.local.part;
  EXPECT_EQ(p.num_reqs, 8);
  EXPECT_EQ(p.num_tokens, 19);
  EXPECT_EQ(values(p.cu_seqlens_q), (V32{0, 2, 4, 5, 9, 13, 14, 18, 19}));
  EXPECT_EQ(values(p.seqused_k), (V32{4, 2, 4, 4, 4, 1, 4, 1}));
  EXPECT_EQ(p.max_query_len, 4);
  EXPECT_EQ(p.max_seq_len, 4);
  EXPECT_TRUE(p.causal);
  expect_plan_for(p, c, 2, false);
  const V32 k_start{0, 4, 4, 8, 12, 16, 4, 8}, req{0, 0, 1, 1, 1, 1, 2, 2};
  ASSERT_EQ(p.block_table.size(1), 2);
  for (int64_t v = 0; v < 8; ++v)
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t col = k_start[size_t(v)] / 2 + j;
      EXPECT_EQ(row_of(p.block_table, v)[size_t(j)], col < 9 ? s.block(req[size_t(v)], col) : 0) << v << "," << j;
    }
  be::BuilderConfig bad = c;
  bad.layer.attention_chunk_size = 6;
  bad.block_size = 4;
  expect_error([&] { be::MetadataBuilder x(bad); }, "attention_chunk_size");
}

// ---------------------------------------------------------------- draft tree

TEST(MetadataBuilder, DraftTreeVerify) {
  be::BuilderConfig c = base_config(4);
  c.reorder_batch_threshold = 4;
  be::MetadataBuilder b(c);
  // r0: tip + 3 drafts (d0 <- tip, d1 <- d0, d2 <- d0); r1: 2 drafts only (d1 <- d0); r2: a decode.
  const Step s = make_step({4, 2, 1}, {20, 9, 5}, 4, 8);
  const V32 parents{-1, 0, 0, -1, 0}, num_drafts{3, 2, 0};
  const be::DraftTree tree{parents, num_drafts};
  const be::AttentionMetadata& md = b.build(s.common(), 0, &tree);
  ASSERT_TRUE(md.tree.enabled);
  EXPECT_TRUE(md.decode.empty() && md.prefill.empty() && !md.cascade.enabled);
  const be::PartMetadata& pre = md.tree.prefix;
  EXPECT_EQ(pre.num_reqs, 3);
  EXPECT_EQ(values(pre.cu_seqlens_q), s.qsl);
  EXPECT_EQ(values(pre.seqused_k), (V32{17, 7, 5}));  // committed = seq_len - num_drafts
  EXPECT_EQ(pre.block_table.data, engine_row(s, 0));
  EXPECT_FALSE(pre.causal);
  expect_plan_for(pre, c, 4, false);

  const be::PartMetadata& tr = md.tree.tree;
  EXPECT_EQ(tr.num_reqs, 7);
  EXPECT_EQ(tr.num_tokens, 7);
  EXPECT_EQ(values(tr.cu_seqlens_q), (V32{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(values(tr.seqused_k), (V32{0, 1, 2, 2, 1, 2, 0}));
  EXPECT_EQ(tr.max_seq_len, 2);
  EXPECT_FALSE(tr.causal);
  expect_plan_for(tr, c, 1, false);
  const auto& sl = s.slots;
  auto path = [&](int64_t t) {
    V32 r = row_of(tr.block_table, t);
    r.resize(size_t(values(tr.seqused_k)[size_t(t)]));
    return r;
  };
  EXPECT_EQ(path(1), (V32{int32_t(sl[1])}));
  EXPECT_EQ(path(2), (V32{int32_t(sl[1]), int32_t(sl[2])}));
  EXPECT_EQ(path(3), (V32{int32_t(sl[1]), int32_t(sl[3])}));
  EXPECT_EQ(path(5), (V32{int32_t(sl[4]), int32_t(sl[5])}));

  const V32 two_tips{2, 2, 0}, four{-1, 0, -1, 0};  // r0 would have two non-draft tokens
  const V32 later_parent{-1, 1, 0, -1, 0}, too_few{-1, 0}, chain{-1, 0, 1, -1, 0};
  expect_error([&] { const be::DraftTree t{four, two_tips}; b.build(s.common(), 0, &t); }, "num_drafts");
  expect_error([&] { const be::DraftTree t{later_parent, num_drafts}; b.build(s.common(), 0, &t); }, "parents");
  expect_error([&] { const be::DraftTree t{too_few, num_drafts}; b.build(s.common(), 0, &t); }, "parents");
  be::BuilderConfig shallow = c;
  shallow.max_draft_depth = 2;
  be::MetadataBuilder bs(shallow);
  expect_error([&] { const be::DraftTree t{chain, num_drafts}; bs.build(s.common(), 0, &t); }, "max_draft_depth");
  be::BuilderConfig windowed = c;
  windowed.layer.sliding_window = 8;
  be::MetadataBuilder bw(windowed);
  EXPECT_THROW(bw.build(s.common(), 0, &tree), fs::NotImplemented);
}

// ---------------------------------------------------------------- DCP, cross, encoder

TEST(MetadataBuilder, DecodeContextParallel) {
  be::BuilderConfig c = base_config();
  c.dcp_world_size = 4;
  c.dcp_rank = 3;
  be::MetadataBuilder b(c);
  V32 q(9, 1), seq;
  for (int r = 0; r < 9; ++r) seq.push_back(300 + 37 * r);
  q.push_back(2);
  seq.push_back(3);
  const Step s = make_step(q, seq, 16, 12, 8);
  const be::AttentionMetadata& md = b.build(s.common(), 256);
  EXPECT_FALSE(md.cascade.enabled);
  V32 local, global(seq.begin(), seq.begin() + 9);
  for (int r = 0; r < 9; ++r) local.push_back(int32_t(be::DcpAttentionLayer::local_len(seq[size_t(r)], 4, 3)));
  EXPECT_EQ(values(md.decode.seqused_k), local);
  EXPECT_EQ(values(md.decode.cp_tot_seqused_k), global);
  EXPECT_EQ(values(md.prefill.seqused_k), (V32{0}));  // 3 tokens: none on rank 3
  EXPECT_EQ(values(md.prefill.cp_tot_seqused_k), (V32{3}));
  expect_plan_for(md.decode, c, 16, false);
  EXPECT_EQ(md.decode.plan.shape.num_heads, 32);
}

TEST(MetadataBuilder, CrossAttentionAndEncoders) {
  be::BuilderConfig c = base_config();
  c.layer.type = be::AttnType::encoder_decoder;
  be::MetadataBuilder cross(c);
  Step s = make_step({1, 1, 6}, {10, 11, 6}, 16, 4);
  s.enc = {50, 7, 33};
  const be::AttentionMetadata& md = cross.build(s.common(), 1000);
  EXPECT_FALSE(md.cascade.enabled);
  EXPECT_EQ(values(md.decode.seqused_k), (V32{50, 7}));
  EXPECT_EQ(values(md.prefill.seqused_k), (V32{33}));
  EXPECT_FALSE(md.decode.causal || md.prefill.causal);
  expect_plan_for(md.prefill, c, 16, false);

  for (be::AttnType t : {be::AttnType::encoder, be::AttnType::encoder_only}) {
    be::BuilderConfig e = base_config();
    e.layer.type = t;
    e.layer.sliding_window = 3;
    be::MetadataBuilder enc(e);
    Step es = make_step({5, 1, 3}, {5, 1, 3}, 16, 1);
    be::CommonMetadata cm = es.common();
    cm.block_table = TensorRef{};
    cm.slot_mapping = TensorRef{};
    const be::AttentionMetadata& m = enc.build(cm);
    EXPECT_EQ(m.num_decodes, 0);
    EXPECT_TRUE(m.decode.empty());
    EXPECT_EQ(m.prefill.num_reqs, 3);
    EXPECT_EQ(values(m.prefill.cu_seqlens_q), (V32{0, 5, 6, 9}));
    EXPECT_EQ(values(m.prefill.seqused_k), (V32{5, 1, 3}));
    EXPECT_EQ(m.prefill.block_table.ndim, 0);
    EXPECT_FALSE(m.prefill.causal);
    expect_plan_for(m.prefill, e, 0, true);
    EXPECT_EQ(m.slot_mapping.ndim, 0);
  }
}

// ---------------------------------------------------------------- capacities and errors

TEST(MetadataBuilder, CapacitiesAndErrors) {
  be::BuilderConfig c = base_config();
  c.max_num_reqs = 4;
  c.max_num_tokens = 16;
  c.max_blocks_per_req = 3;
  be::MetadataBuilder b(c);
  const Step ok = make_step({1, 1, 5}, {10, 20, 40}, 16, 4);
  const be::AttentionMetadata& md = b.build(ok.common());
  const V32 before = values(md.prefill.seqused_k);
  expect_error([&] { b.build(make_step({1, 1, 1, 1, 1}, {2, 2, 2, 2, 2}, 16, 4).common()); }, "num_reqs");
  expect_error([&] { b.build(make_step({1, 16}, {2, 20}, 16, 4).common()); }, "num_actual_tokens");
  expect_error([&] { b.build(make_step({1, 5}, {2, 49}, 16, 4).common()); }, "seq_lens");      // > 3 blocks
  expect_error([&] { b.build(make_step({1, 5}, {2, 40}, 16, 2).common()); }, "seq_lens");      // > the table
  expect_error([&] { b.build(make_step({1, 5}, {2, 4}, 16, 4).common()); }, "seq_lens");       // < query
  Step s = make_step({1, 5}, {2, 20}, 16, 4);
  be::CommonMetadata cm = s.common();
  cm.max_query_len = 4;
  expect_error([&] { b.build(cm); }, "max_query_len");
  cm = s.common();
  cm.num_actual_tokens = 5;
  expect_error([&] { b.build(cm); }, "query_start_loc");
  cm = s.common();
  cm.block_table.dtype = DType::i64;
  expect_error([&] { b.build(cm); }, "block_table");
  cm = s.common();
  cm.slot_mapping.dtype = DType::i32;
  expect_error([&] { b.build(cm); }, "slot_mapping");
  cm = s.common();
  cm.block_table.device = fs::Device{fs::DeviceType::cuda, 0};
  EXPECT_THROW(b.build(cm), fs::NotImplemented);
  EXPECT_EQ(values(md.prefill.seqused_k), before) << "a rejected build changed the metadata";

  be::BuilderConfig bad = base_config();
  bad.max_num_splits = 0;
  expect_error([&] { be::MetadataBuilder x(bad); }, "max_num_splits");
  bad = base_config();
  bad.dcp_rank = 1;
  expect_error([&] { be::MetadataBuilder x(bad); }, "dcp_rank");
  bad = base_config();
  bad.layer.num_kv_heads = 3;
  expect_error([&] { be::MetadataBuilder x(bad); }, "num_kv_heads");
}

TEST(MetadataBuilder, MaxWorkspaceBytes) {
  be::BuilderConfig c = base_config();
  c.layer.head_size_v = 0;
  c.max_num_splits = 8;
  c.max_num_tokens = 256;
  // 8 splits x 256 rows x 8 heads: o_partial fp32 [16384, 64], then lse_partial [16384]; a CPU
  // config sizes for an H200, whose max_split_rows (16,896) this stays under.
  const size_t rows = 8ull * 256 * 8;
  ASSERT_LE(rows, size_t(fs::max_split_rows(fs::DeviceProps::h200())));
  const auto bytes = [](size_t n) {
    return (n * 64 * 4 + fs::kWorkspaceAlign - 1) / fs::kWorkspaceAlign * fs::kWorkspaceAlign + n * 4;
  };
  EXPECT_EQ(be::MetadataBuilder(c).max_workspace_bytes(), bytes(rows));
  // DCP doubles the call's heads: 32768 partial rows, capped at the device's max_split_rows.
  c.dcp_world_size = 2;
  const size_t cap = size_t(fs::max_split_rows(fs::DeviceProps::h200()));
  ASSERT_LT(cap, 2 * rows);
  EXPECT_EQ(be::MetadataBuilder(c).max_workspace_bytes(), bytes(cap));
}

// ---------------------------------------------------------------- replay
// (random replays against fresh builds: test_planner_fuzz.cpp)

TEST(MetadataBuilder, UpdateBlockTableRepointsViews) {
  const be::BuilderConfig c = base_config();
  be::MetadataBuilder b(c);
  expect_error([&] { b.update_block_table(make_step({1}, {3}, 16, 2).table_ref()); }, "block_table");
  const Step s = make_step({1, 1, 5}, {10, 20, 40}, 16, 4);
  b.build(s.common());
  const Step other = make_step({1, 1, 5}, {10, 20, 40}, 16, 4, 0, 500);
  const be::AttentionMetadata& md = b.update_block_table(other.table_ref());
  EXPECT_EQ(md.decode.block_table.data, engine_row(other, 0));
  EXPECT_EQ(md.prefill.block_table.data, engine_row(other, 2));
  EXPECT_EQ(values(md.prefill.seqused_k), (V32{40}));
  EXPECT_EQ(md.slot_mapping.data, s.slots.data());
  expect_error([&] { b.update_block_table(make_step({1, 1, 5}, {10, 20, 40}, 16, 3).table_ref()); }, "block_table");
}

TEST(MetadataBuilder, AdvanceDecodeStep) {
  const be::BuilderConfig c = base_config();
  be::MetadataBuilder b(c);
  expect_error([&] { b.advance_decode_step(); }, "advance_decode_step");
  const Step s = make_step({1, 1, 1}, {5, 16, 33}, 16, 4);
  b.build(s.common());
  const be::AttentionMetadata& md = b.advance_decode_step();
  // New tokens at positions 5, 16, 33: block 0 slot 5, block 1 slot 0, block 2 slot 1.
  EXPECT_EQ(values(md.decode.seqused_k), (V32{6, 17, 34}));
  EXPECT_EQ(md.decode.max_seq_len, 34);
  EXPECT_EQ(md.decode.plan.shape.max_seqlen_k, 34);
  ASSERT_EQ(md.slot_mapping.dtype, DType::i64);
  ASSERT_EQ(md.slot_mapping.size(0), 3);
  const V64 want{s.slot_of(0, 5), s.slot_of(1, 16), s.slot_of(2, 33)};
  for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(*static_cast<const int64_t*>(md.slot_mapping.at(r)), want[size_t(r)]);
  EXPECT_NE(md.slot_mapping.data, s.slots.data());  // the builder's own buffer
  b.advance_decode_step();
  EXPECT_EQ(values(md.decode.seqused_k), (V32{7, 18, 35}));

  // Not decode-only, or no room for another token: rejected, metadata unchanged.
  const Step mixed = make_step({1, 3}, {5, 9}, 16, 4);
  b.build(mixed.common());
  expect_error([&] { b.advance_decode_step(); }, "advance_decode_step");
  const Step full = make_step({1, 1}, {5, 64}, 16, 4);
  b.build(full.common());
  expect_error([&] { b.advance_decode_step(); }, "seq_lens");
  EXPECT_EQ(values(md.decode.seqused_k), (V32{5, 64}));
  be::BuilderConfig dcp = c;  // DCP: only tokens landing on this rank get a slot
  dcp.dcp_world_size = 2;
  dcp.dcp_rank = 1;
  be::MetadataBuilder bd(dcp);
  const Step ds = make_step({1, 1}, {5, 6}, 16, 4);
  bd.build(ds.common());
  const be::AttentionMetadata& mdd = bd.advance_decode_step();  // positions 5 (rank 1), 6 (rank 0)
  EXPECT_EQ(*static_cast<const int64_t*>(mdd.slot_mapping.at(0)), ds.slot_of(0, 5 / 2));
  EXPECT_EQ(*static_cast<const int64_t*>(mdd.slot_mapping.at(1)), -1);
  EXPECT_EQ(values(mdd.decode.seqused_k), (V32{3, 3}));
  EXPECT_EQ(values(mdd.decode.cp_tot_seqused_k), (V32{6, 7}));
}
