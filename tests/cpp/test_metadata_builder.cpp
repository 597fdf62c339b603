// MetadataBuilder (SPEC.md §6): the decode/prefill split and its views, plans, cascade, chunked
// local, draft-tree, DCP, cross-attention and encoder metadata; graph mode (one builder over
// changing batches equals fresh builders, pointers fixed); update_block_table;
// advance_decode_step against a rebuild; capacities and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/backend_variants.hpp"
#include "flashserve/status.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using V32 = std::vector<int32_t>;
using V64 = std::vector<int64_t>;

// ---------------------------------------------------------------- an engine's step

struct Step {
  V32 qsl, seq, enc;
  int64_t bs = 16, rows = 0, cols = 0, stride = 0;
  V32 table;  // [rows, cols] with row stride `stride`
  V64 slots;  // per query token

  TensorRef table_ref() const {
    return TensorRef::strided(const_cast<int32_t*>(table.data()), DType::i32, {rows, cols}, {stride, 1});
  }
  int64_t num_reqs() const { return int64_t(seq.size()); }
  int64_t q(int64_t r) const { return qsl[size_t(r) + 1] - qsl[size_t(r)]; }
  int32_t block(int64_t r, int64_t j) const { return table[size_t(r * stride + j)]; }
  int64_t slot_of(int64_t r, int64_t pos) const { return int64_t(block(r, pos / bs)) * bs + pos % bs; }
  void fill_slots() {
    slots.assign(size_t(qsl.back()), -1);
    for (int64_t r = 0; r < num_reqs(); ++r)
      for (int64_t i = 0; i < q(r); ++i) slots[size_t(qsl[size_t(r)] + i)] = slot_of(r, seq[size_t(r)] - q(r) + i);
  }
  be::CommonMetadata common() const {
    be::CommonMetadata c;
    c.num_reqs = num_reqs();
    c.num_actual_tokens = qsl.back();
    for (int64_t r = 0; r < num_reqs(); ++r) c.max_query_len = std::max<int64_t>(c.max_query_len, q(r));
    for (int32_t s : seq) c.max_seq_len = std::max<int64_t>(c.max_seq_len, s);
    c.query_start_loc = qsl;
    c.seq_lens = seq;
    c.encoder_seq_lens = enc;
    c.block_table = table_ref();
    c.slot_mapping = TensorRef::contiguous(const_cast<int64_t*>(slots.data()), DType::i64, {int64_t(slots.size())});
    return c;
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
  be::MetadataBuilder b(c);
  // 8 splits x 512 rows x 8 heads: o_partial fp32 [8, 512, 8, 64], then lse_partial [8, 512, 8].
  const size_t o = 8ull * 512 * 8 * 64 * 4, lse = 8ull * 512 * 8 * 4;
  const size_t aligned = (o + fs::kWorkspaceAlign - 1) / fs::kWorkspaceAlign * fs::kWorkspaceAlign;
  EXPECT_EQ(b.max_workspace_bytes(), aligned + lse);
  c.dcp_world_size = 2;
  EXPECT_EQ(be::MetadataBuilder(c).max_workspace_bytes(), 2 * aligned + 2 * lse);
}

// ---------------------------------------------------------------- replay: graph mode, update, advance

namespace {

bool in_step_table(const Step& s, const void* p) {
  const auto* q = static_cast<const int32_t*>(p);
  return q >= s.table.data() && q < s.table.data() + s.table.size();
}

// Field by field: scalars, plans, the contents of every view; views of the engine's table
// must be the same view, views of builder buffers may sit elsewhere.
void expect_part_eq(const be::PartMetadata& a, const be::PartMetadata& b, const Step& s, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(a.req_begin, b.req_begin);
  EXPECT_EQ(a.num_reqs, b.num_reqs);
  EXPECT_EQ(a.token_begin, b.token_begin);
  EXPECT_EQ(a.num_tokens, b.num_tokens);
  EXPECT_EQ(a.max_query_len, b.max_query_len);
  EXPECT_EQ(a.max_seq_len, b.max_seq_len);
  EXPECT_EQ(a.causal, b.causal);
  EXPECT_EQ(values(a.cu_seqlens_q), values(b.cu_seqlens_q));
  EXPECT_EQ(values(a.seqused_k), values(b.seqused_k));
  EXPECT_EQ(values(a.cp_tot_seqused_k), values(b.cp_tot_seqused_k));
  EXPECT_EQ(a.block_table.shape_str(), b.block_table.shape_str());
  EXPECT_EQ(in_step_table(s, a.block_table.data), in_step_table(s, b.block_table.data));
  if (in_step_table(s, a.block_table.data)) {
    EXPECT_EQ(a.block_table.data, b.block_table.data);
    EXPECT_EQ(a.block_table.stride, b.block_table.stride);
  }
  for (int64_t r = 0; r < (a.block_table.ndim == 2 ? a.block_table.size(0) : 0); ++r)
    EXPECT_EQ(row_of(a.block_table, r), row_of(b.block_table, r)) << "row " << r;
  EXPECT_TRUE(a.plan.shape == b.plan.shape);
  EXPECT_EQ(a.plan.num_splits, b.plan.num_splits);
  EXPECT_EQ(a.plan.split_granularity, b.plan.split_granularity);
  EXPECT_EQ(a.plan.workspace.total_bytes, b.plan.workspace.total_bytes);
}

V64 values64(const TensorRef& t) {
  V64 v;
  for (int64_t i = 0; i < (t.ndim ? t.size(0) : 0); ++i) v.push_back(*static_cast<const int64_t*>(t.at(i)));
  return v;
}

void expect_md_eq(const be::AttentionMetadata& a, const be::AttentionMetadata& b, const Step& s) {
  EXPECT_EQ(a.num_actual_tokens, b.num_actual_tokens);
  EXPECT_EQ(a.num_reqs, b.num_reqs);
  EXPECT_EQ(a.num_decodes, b.num_decodes);
  EXPECT_EQ(a.num_decode_tokens, b.num_decode_tokens);
  EXPECT_EQ(a.num_prefills, b.num_prefills);
  EXPECT_EQ(a.num_prefill_tokens, b.num_prefill_tokens);
  EXPECT_EQ(values64(a.slot_mapping), values64(b.slot_mapping));
  EXPECT_EQ(a.cascade.enabled, b.cascade.enabled);
  EXPECT_EQ(a.cascade.common_prefix_len, b.cascade.common_prefix_len);
  EXPECT_EQ(a.local.enabled, b.local.enabled);
  EXPECT_EQ(a.tree.enabled, b.tree.enabled);
  expect_part_eq(a.decode, b.decode, s, "decode");
  expect_part_eq(a.prefill, b.prefill, s, "prefill");
  expect_part_eq(a.cascade.prefix, b.cascade.prefix, s, "cascade.prefix");
  expect_part_eq(a.cascade.suffix, b.cascade.suffix, s, "cascade.suffix");
  expect_part_eq(a.local.part, b.local.part, s, "local");
  expect_part_eq(a.tree.prefix, b.tree.prefix, s, "tree.prefix");
  expect_part_eq(a.tree.tree, b.tree.tree, s, "tree.tree");
}

// Pointers of the builder's own views, by field: each must never move.
void record_pointers(const be::AttentionMetadata& md, const Step& s, std::map<std::string, const void*>& seen) {
  auto note = [&](const std::string& name, const TensorRef& t) {
    if (t.data == nullptr || in_step_table(s, t.data)) return;
    auto [it, fresh] = seen.emplace(name, t.data);
    EXPECT_EQ(it->second, t.data) << name << " moved";
  };
  const std::pair<const char*, const be::PartMetadata*> parts[] = {
      {"decode", &md.decode}, {"prefill", &md.prefill}, {"cascade.prefix", &md.cascade.prefix},
      {"cascade.suffix", &md.cascade.suffix}, {"local", &md.local.part}, {"tree.prefix", &md.tree.prefix},
      {"tree.tree", &md.tree.tree}};
  for (const auto& [name, p] : parts) {
    note(std::string(name) + ".cu_seqlens_q", p->cu_seqlens_q);
    note(std::string(name) + ".seqused_k", p->seqused_k);
    note(std::string(name) + ".cp_tot_seqused_k", p->cp_tot_seqused_k);
    note(std::string(name) + ".block_table", p->block_table);
  }
}

// A random step for `c`: decodes first, then prefills; sometimes a shared prefix of whole
// blocks; with `tree`, every request a verify request (tip + drafts, or drafts only).
struct RandomStep {
  Step step;
  int64_t common_prefix_len = 0;
  V32 parents, num_drafts;
  bool has_tree = false;
  be::DraftTree tree() const { return {parents, num_drafts}; }
};

RandomStep random_step(std::mt19937_64& rng, const be::BuilderConfig& c, bool tree) {
  RandomStep rs;
  const int64_t bs = c.block_size, thr = c.reorder_batch_threshold;
  const int64_t R = rng() % 2 ? 8 + int64_t(rng() % 5) : int64_t(rng() % 8);  // cascade needs >= 8
  const int64_t nd = R ? int64_t(rng() % (R + 1)) : 0;
  const int64_t shared = rng() % 2 ? (256 + int64_t(rng() % 160)) / bs : int64_t(rng() % 4);
  V32 q, seq;
  int64_t tokens = 0;
  for (int64_t r = 0; r < R; ++r) {
    int32_t qr;
    if (tree) {
      const int32_t drafts = int32_t(rng() % 5);
      rs.num_drafts.push_back(drafts);
      for (int32_t d = 0; d < drafts; ++d) rs.parents.push_back(int32_t(rng() % (d + 1)) - 1);
      qr = drafts + int32_t(drafts == 0 || rng() % 3 != 0);  // 12 x 5 tokens at most: within capacity
    } else {
      qr = r < nd ? int32_t(rng() % 8 == 0 ? 0 : 1 + rng() % thr) : int32_t(thr + 1 + rng() % 12);
      if (tokens + qr > c.max_num_tokens) break;
    }
    tokens += qr;
    q.push_back(qr);
    seq.push_back(int32_t(shared * bs + int64_t(rng() % 60) + qr));
  }
  int64_t max_seq = 1;
  for (int32_t x : seq) max_seq = std::max<int64_t>(max_seq, x);
  const int64_t cols = (max_seq + bs - 1) / bs + int64_t(rng() % 3);
  rs.step = make_step(q, seq, bs, cols, shared, int(rng() % 5));
  rs.common_prefix_len = shared * bs + int64_t(rng() % bs);
  rs.has_tree = tree;
  return rs;
}

be::BuilderConfig replay_config(int kind) {
  be::BuilderConfig c = base_config(kind == 1 ? 4 : 16);
  c.max_num_reqs = 16;
  c.max_num_tokens = 256;
  c.max_blocks_per_req = 128;
  c.device.num_sms = 4;  // few SMs: the cost model takes cascade for shared decode batches
  if (kind == 1) c.layer.attention_chunk_size = 8;
  if (kind == 2) c.dcp_world_size = 3, c.dcp_rank = 2;
  if (kind == 3) c.reorder_batch_threshold = 5;
  return c;
}

}  // namespace

TEST(MetadataBuilder, GraphModeReplayEqualsFreshBuilds) {
  auto rng = fstest::make_rng(0x9a9);
  for (int kind = 0; kind < 4; ++kind) {
    const be::BuilderConfig c = replay_config(kind);
    be::MetadataBuilder reused(c);
    std::map<std::string, const void*> seen;
    int cascades = 0, trees = 0;
    for (int it = 0; it < 50; ++it) {
      SCOPED_TRACE(testing::Message() << "config " << kind << " batch " << it);
      const RandomStep rs = random_step(rng, c, kind == 3 && rng() % 4 != 0);
      const be::DraftTree tree = rs.tree();
      const be::DraftTree* t = rs.has_tree ? &tree : nullptr;
      const be::AttentionMetadata& a = reused.build(rs.step.common(), rs.common_prefix_len, t);
      be::MetadataBuilder fresh(c);
      expect_md_eq(a, fresh.build(rs.step.common(), rs.common_prefix_len, t), rs.step);
      record_pointers(a, rs.step, seen);
      cascades += a.cascade.enabled;
      trees += a.tree.enabled;
    }
    if (kind == 0) EXPECT_GT(cascades, 0);
    if (kind == 3) EXPECT_GT(trees, 0);
  }
}

TEST(MetadataBuilder, UpdateBlockTable) {
  auto rng = fstest::make_rng(0xb10c);
  for (int kind = 0; kind < 4; ++kind) {
    const be::BuilderConfig c = replay_config(kind);
    be::MetadataBuilder b(c);
    expect_error([&] { b.update_block_table(make_step({1}, {3}, 16, 2).table_ref()); }, "block_table");
    for (int it = 0; it < 20; ++it) {
      SCOPED_TRACE(testing::Message() << "config " << kind << " batch " << it);
      const RandomStep rs = random_step(rng, c, kind == 3);
      const be::DraftTree tree = rs.tree();
      const be::DraftTree* t = rs.has_tree ? &tree : nullptr;
      b.build(rs.step.common(), rs.common_prefix_len, t);
      // Another layer group: same shape, other block ids (same sharing).
      Step other = rs.step;
      for (int32_t& x : other.table) x = x < 0 ? x : x + 1000;
      other.fill_slots();
      const be::AttentionMetadata& md = b.update_block_table(other.table_ref());
      be::MetadataBuilder fresh(c);
      be::AttentionMetadata want = fresh.build(other.common(), rs.common_prefix_len, t);
      want.slot_mapping = rs.step.common().slot_mapping.slice(0, 0, rs.step.qsl.back());  // not re-pointed
      expect_md_eq(md, want, other);
    }
    Step narrow = make_step({1}, {3}, 16, 1);
    expect_error([&] { b.update_block_table(narrow.table_ref()); }, "block_table");
  }
}

TEST(MetadataBuilder, AdvanceDecodeStepEqualsRebuild) {
  auto rng = fstest::make_rng(0xadd);
  for (int kind = 0; kind < 3; ++kind) {
    const be::BuilderConfig c = replay_config(kind);
    be::MetadataBuilder b(c);
    expect_error([&] { b.advance_decode_step(); }, "advance_decode_step");
    for (int it = 0; it < 10; ++it) {
      const int64_t R = 1 + int64_t(rng() % 12), shared = int64_t(rng() % 30);
      V32 q(static_cast<size_t>(R), 1), seq;
      for (int64_t r = 0; r < R; ++r) seq.push_back(int32_t(shared * c.block_size + 1 + int64_t(rng() % 50)));
      const int64_t cols = (*std::max_element(seq.begin(), seq.end()) + 4) / c.block_size + 1;
      Step s = make_step(q, seq, c.block_size, cols, shared);
      const int64_t prefix = shared * c.block_size;
      b.build(s.common(), prefix);
      for (int step = 0; step < 4; ++step) {
        SCOPED_TRACE(testing::Message() << "config " << kind << " batch " << it << " step " << step);
        const be::AttentionMetadata& md = b.advance_decode_step();
        for (int32_t& x : s.seq) ++x;
        s.fill_slots();
        if (c.dcp_world_size > 1)  // only this rank's tokens get a slot
          for (int64_t r = 0; r < R; ++r) {
            const int64_t pos = s.seq[size_t(r)] - 1, w = c.dcp_world_size;
            s.slots[size_t(r)] = pos % w == c.dcp_rank ? s.slot_of(r, pos / w) : -1;
          }
        be::MetadataBuilder fresh(c);
        expect_md_eq(md, fresh.build(s.common(), prefix), s);
      }
    }
    // Not decode-only, or no room for another token: rejected, metadata unchanged.
    const Step mixed = make_step({1, 3}, {5, 9}, c.block_size, 4);
    b.build(mixed.common());
    expect_error([&] { b.advance_decode_step(); }, "advance_decode_step");
    // The next token of request 1 lands on this rank, one past the table's 4 blocks.
    const int32_t at_capacity = int32_t(4 * c.block_size * c.dcp_world_size + c.dcp_rank);
    const Step full = make_step({1, 1}, {5, at_capacity}, c.block_size, 4);
    const be::AttentionMetadata& md = b.build(full.common());
    const V32 before = values(md.decode.seqused_k);
    expect_error([&] { b.advance_decode_step(); }, "seq_lens");
    EXPECT_EQ(values(md.decode.seqused_k), before);
  }
}
