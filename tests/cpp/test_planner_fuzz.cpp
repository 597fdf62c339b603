// Planner fuzz: random batches through MetadataBuilder.
//
// Oracle (thousands of batches over random configs: block sizes, decode/prefill thresholds,
// cascade with shared prefixes, chunked local, draft trees, DCP ranks, sliding windows,
// cross-attention, encoders, CPU or CUDA planning):
// - every pass group the metadata uses (decode+prefill | cascade prefix, suffix | local |
//   tree prefix, tree) covers every query token exactly once;
// - the union of the KV each query token sees over all groups (through cu_seqlens_q,
//   seqused_k, causal, the layer window, the block tables) is exactly the set the layer
//   defines for it, computed by brute force, with no key seen twice;
// - views lie within the engine's table or the builder's own buffers, builder views never
//   alias each other, seqused_k fits each table, plans fit max_num_splits and the workspace.
// Replay: one builder over 50 changing batches equals fresh builders field by field with its
// own buffers fixed (CUDA-graph mode); update_block_table equals a build on the other table;
// advance_decode_step equals a rebuild with seq_lens + 1.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/backend_variants.hpp"
#include "support/engine_step.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using V32 = std::vector<int32_t>;
using V64 = std::vector<int64_t>;

// The engine's step for a random builder config.
struct Case : fstest::EngineStep {
  be::BuilderConfig config;
  bool tree = false;
  V32 parents, num_drafts;
  int64_t common_prefix_len = 0;

  int64_t bs() const { return config.block_size; }
  bool encoder() const {
    return config.layer.type == be::AttnType::encoder || config.layer.type == be::AttnType::encoder_only;
  }
  // Physical slot of KV position `pos` (on this rank) of request r.
  int64_t slot(int64_t r, int64_t pos) const { return int64_t(block(r, pos / bs())) * bs() + pos % bs(); }
  // The engine's slot of each query token; under DCP only this rank's positions have one.
  void fill_slots() {
    slots.clear();
    const int w = config.dcp_world_size;
    const int64_t il = config.dcp_interleave;
    for (int64_t r = 0; r < num_reqs(); ++r)
      for (int64_t i = 0; i < q(r); ++i) {
        const int64_t pos = seq[size_t(r)] - q(r) + i;
        slots.push_back(be::DcpAttentionLayer::owner(pos, w, il) == config.dcp_rank
                            ? slot(r, be::DcpAttentionLayer::local_index(pos, w, il))
                            : -1);
      }
  }
  be::CommonMetadata common() const { return EngineStep::common(!encoder()); }
};

be::BuilderConfig random_config(std::mt19937_64& rng, bool& tree) {
  be::BuilderConfig c;
  const int64_t kv = 1 + int64_t(rng() % 4);
  c.layer.num_kv_heads = kv;
  c.layer.num_heads = kv * (1 + int64_t(rng() % 8));
  c.layer.head_size = 64;
  const int64_t sizes[] = {1, 2, 4, 16};
  c.block_size = sizes[rng() % 4];
  c.max_num_reqs = 16;
  c.max_num_tokens = 192;
  c.max_blocks_per_req = 1024;
  c.max_num_splits = 1 + int(rng() % 16);
  c.reorder_batch_threshold = 1 + int(rng() % 3);
  c.device = fs::DeviceProps::cpu();
  if (rng() % 2) c.device = fs::DeviceProps{fs::Device{fs::DeviceType::cuda, 0}, 1 + int(rng() % 200), 9, 0};
  const int kind = int(rng() % 10);
  tree = false;
  if (kind == 0) c.layer.type = be::AttnType::encoder_decoder;
  if (kind == 1) c.layer.type = rng() % 2 ? be::AttnType::encoder : be::AttnType::encoder_only;
  if (kind == 2) c.layer.attention_chunk_size = c.block_size * (1 + int64_t(rng() % 6));
  if (kind == 3) {
    c.dcp_world_size = 2 + int(rng() % 3), c.dcp_rank = int(rng() % c.dcp_world_size);
    c.dcp_interleave = std::array<int64_t, 4>{1, 2, 3, 16}[rng() % 4];
  }
  if (kind == 4) tree = true, c.reorder_batch_threshold = 8, c.max_draft_depth = 4 + int64_t(rng() % 4);
  if ((kind == 1 || kind >= 5) && rng() % 3 == 0) c.layer.sliding_window = 1 + int64_t(rng() % 40);
  return c;
}

// The engine's step for `c`: decodes first, then prefills (or verify requests with drafts);
// often >= 8 requests sharing >= 256 tokens of whole blocks.
Case make_case(std::mt19937_64& rng, const be::BuilderConfig& c, bool tree, bool decode_only = false) {
  Case k;
  k.config = c;
  k.tree = tree;
  const int64_t bs = c.block_size, thr = c.reorder_batch_threshold;
  const bool many = decode_only ? rng() % 4 != 0 : rng() % 2 != 0;
  const int64_t R = many ? 8 + int64_t(rng() % 9) : int64_t(decode_only) + int64_t(rng() % 7);
  const int64_t nd = decode_only ? R : R ? int64_t(rng() % (R + 1)) : 0;
  const int64_t shared = decode_only || rng() % 2 ? (256 + int64_t(rng() % 200)) / bs : int64_t(rng() % 4);
  const bool all_share = decode_only || rng() % 4 != 0;  // else some requests stop short of the shared blocks
  for (int64_t r = 0; r < R; ++r) {
    int32_t q;
    if (tree) {
      const int32_t drafts = int32_t(rng() % 5);
      k.num_drafts.push_back(drafts);
      for (int32_t d = 0; d < drafts; ++d) k.parents.push_back(int32_t(rng() % (d + 1)) - 1);
      q = drafts + int32_t(drafts == 0 || rng() % 3 != 0);  // 16 x 5 tokens at most: within capacity
    } else if (decode_only) {
      q = 1;
    } else {
      q = r < nd ? int32_t(rng() % 10 == 0 ? 0 : 1 + rng() % thr) : int32_t(thr + 1 + rng() % 14);
      if (k.num_tokens() + q > c.max_num_tokens) break;
    }
    k.qsl.push_back(k.qsl.back() + q);
    const int64_t ctx = k.encoder() ? 0 : (all_share || rng() % 3 ? shared * bs : 0) + int64_t(rng() % 40);
    k.seq.push_back(int32_t(ctx + q));
    k.enc.push_back(k.encoder() ? int32_t(q) : int32_t(rng() % 90));
  }
  // The table: room for each request's KV on this rank (and the encoder's), and spare.
  int64_t need = 1;
  for (int64_t r = 0; r < k.num_reqs(); ++r) {
    need = std::max<int64_t>(need, be::DcpAttentionLayer::local_len(k.seq[size_t(r)], c.dcp_world_size, c.dcp_rank,
                                                                      c.dcp_interleave));
    need = std::max<int64_t>(need, k.enc[size_t(r)]);
  }
  k.rows = k.num_reqs() + int64_t(rng() % 3);
  k.cols = (need + bs - 1) / bs + 1 + int64_t(rng() % 3);
  k.stride = k.cols + int64_t(rng() % 4);
  k.table.assign(size_t(std::max<int64_t>(1, k.rows * k.stride)), -3);
  const int64_t shared_cols = std::min(shared, k.cols);
  for (int64_t r = 0; r < k.rows; ++r)
    for (int64_t j = 0; j < k.cols; ++j)
      k.table[size_t(r * k.stride + j)] = int32_t(j < shared_cols ? j : shared_cols + r * k.cols + j);
  k.fill_slots();
  k.common_prefix_len = shared_cols * bs + int64_t(rng() % bs) - (rng() % 4 == 0 ? bs : 0);
  k.common_prefix_len = std::max<int64_t>(0, k.common_prefix_len);
  return k;
}

Case random_case(std::mt19937_64& rng) {
  bool tree = false;
  const be::BuilderConfig c = random_config(rng, tree);
  return make_case(rng, c, tree);
}

// ---- brute force: the keys query token t of request r sees under the layer's definition.
// Keys are physical slots (paged layers) or key rows of the batch (encoders).
V64 expected_keys(const Case& k, int64_t r, int64_t i) {
  const be::BuilderConfig& c = k.config;
  const fs::Window w = be::layer_window(c.layer);
  V64 keys;
  if (k.encoder()) {
    for (int64_t j = 0; j < k.q(r); ++j)
      if ((w.left < 0 || j >= i - w.left) && (w.right < 0 || j <= i + w.right)) keys.push_back(k.qsl[size_t(r)] + j);
    return keys;
  }
  if (c.layer.type == be::AttnType::encoder_decoder) {
    for (int64_t j = 0; j < k.enc[size_t(r)]; ++j) keys.push_back(k.slot(r, j));
    return keys;
  }
  const int64_t p = k.seq[size_t(r)] - k.q(r) + i;  // absolute position of the query
  if (k.tree) {
    const int64_t nd = k.num_drafts[size_t(r)], committed = k.seq[size_t(r)] - nd;
    for (int64_t j = 0; j < committed; ++j) keys.push_back(k.slot(r, j));
    int64_t first = 0;  // the request's first draft in `parents`
    for (int64_t x = 0; x < r; ++x) first += k.num_drafts[size_t(x)];
    for (int64_t d = i - (k.q(r) - nd); d >= 0; d = k.parents[size_t(first + d)])
      keys.push_back(k.slots[size_t(k.qsl[size_t(r)] + k.q(r) - nd + d)]);
    return keys;
  }
  int64_t lo = 0;
  if (w.left >= 0) lo = std::max<int64_t>(0, p - w.left);
  if (c.layer.attention_chunk_size > 0) lo = p / c.layer.attention_chunk_size * c.layer.attention_chunk_size;
  const int W = c.dcp_world_size;
  for (int64_t g = lo; g <= p; ++g)
    if (be::DcpAttentionLayer::owner(g, W, c.dcp_interleave) == c.dcp_rank)
      keys.push_back(k.slot(r, be::DcpAttentionLayer::local_index(g, W, c.dcp_interleave)));
  return keys;
}

// ---- what the metadata makes the attention calls read (SPEC.md §2 over each part).
struct Group {
  std::vector<const be::PartMetadata*> parts;
  bool windowed = false;  // the forward applies the layer window to these calls
  int64_t page = 0;       // 0: contiguous (encoders: cu_seqlens_k = cu_seqlens_q)
};

int32_t at1(const TensorRef& t, int64_t i) { return *static_cast<const int32_t*>(t.at(i)); }
int32_t at2(const TensorRef& t, int64_t i, int64_t j) { return *static_cast<const int32_t*>(t.at(i, j)); }

struct Span {
  const char* lo;
  const char* hi;
};
Span span_of(const TensorRef& t) {
  const char* p = static_cast<const char*>(t.data);
  return {p, p + t.span_elements() * int64_t(fs::dtype_size(t.dtype))};
}

void check_views(const Case& k, const be::PartMetadata& p, const Group& g, std::vector<Span>& owned) {
  const Span table{reinterpret_cast<const char*>(k.table.data()),
                   reinterpret_cast<const char*>(k.table.data() + k.table.size())};
  auto engine = [&](const TensorRef& t) { return span_of(t).lo >= table.lo && span_of(t).hi <= table.hi; };
  ASSERT_EQ(p.cu_seqlens_q.ndim, 1);
  ASSERT_EQ(p.cu_seqlens_q.size(0), p.num_reqs + 1);
  ASSERT_EQ(at1(p.cu_seqlens_q, 0), 0);
  ASSERT_EQ(at1(p.cu_seqlens_q, p.num_reqs), p.num_tokens);
  ASSERT_LE(p.token_begin + p.num_tokens, k.num_tokens());
  ASSERT_EQ(p.seqused_k.size(0), p.num_reqs);
  for (int64_t b = 0; b < p.num_reqs; ++b) {
    ASSERT_LE(at1(p.cu_seqlens_q, b), at1(p.cu_seqlens_q, b + 1));
    ASSERT_GE(at1(p.seqused_k, b), 0);
  }
  owned.push_back(span_of(p.cu_seqlens_q));
  owned.push_back(span_of(p.seqused_k));
  if (p.cp_tot_seqused_k.ndim) owned.push_back(span_of(p.cp_tot_seqused_k));
  if (p.empty()) return;
  if (g.page > 0) {
    const TensorRef& bt = p.block_table;
    ASSERT_EQ(bt.ndim, 2);
    ASSERT_EQ(bt.size(0), p.num_reqs);
    if (engine(bt)) {
      ASSERT_EQ(bt.stride[0], k.stride);
    } else {
      owned.push_back(span_of(bt));
    }
    for (int64_t b = 0; b < p.num_reqs; ++b) ASSERT_LE(at1(p.seqused_k, b), bt.size(1) * g.page) << "request " << b;
  }
  const be::BuilderConfig& c = k.config;
  ASSERT_GE(p.plan.num_splits, 1);
  ASSERT_LE(p.plan.num_splits, c.max_num_splits);
  ASSERT_EQ(p.plan.shape.batch, p.num_reqs);
  ASSERT_EQ(p.plan.shape.total_q, p.num_tokens);
  ASSERT_EQ(p.plan.shape.page_size, g.page);
  ASSERT_EQ(p.plan.shape.local, g.windowed && !be::layer_window(c.layer).unbounded());
}

// Keys a query row of a part reads: bottom-right causal alignment, the layer window, DCP
// (causality on global positions: local key j is global j * world + rank).
void part_keys(const Case& k, const be::PartMetadata& p, const Group& g, std::vector<V64>& seen,
               std::vector<int>& hits) {
  const be::BuilderConfig& c = k.config;
  const fs::Window w = g.windowed ? be::layer_window(c.layer) : fs::Window{};
  const int64_t W = c.dcp_world_size;
  for (int64_t b = 0; b < p.num_reqs; ++b) {
    const int64_t row0 = p.token_begin + at1(p.cu_seqlens_q, b);
    const int64_t sq = at1(p.cu_seqlens_q, b + 1) - at1(p.cu_seqlens_q, b);
    const int64_t sk = at1(p.seqused_k, b);
    const int64_t tot = p.cp_tot_seqused_k.ndim ? at1(p.cp_tot_seqused_k, b) : sk;
    for (int64_t i = 0; i < sq; ++i) {
      ++hits[size_t(row0 + i)];
      const int64_t ip = i + tot - sq;  // aligned position (global under DCP)
      for (int64_t j = 0; j < sk; ++j) {
        // global position of local key j (common/cp_layout.hpp), written out independently
        const int64_t il = c.dcp_interleave;
        const int64_t jg = W > 1 ? (j / il) * W * il + c.dcp_rank * il + j % il : j;
        if (p.causal && jg > ip) continue;
        if (w.left >= 0 && jg < ip - w.left) continue;
        if (w.right >= 0 && jg > ip + w.right) continue;
        const int64_t key = g.page ? int64_t(at2(p.block_table, b, j / g.page)) * g.page + j % g.page : row0 + j;
        seen[size_t(row0 + i)].push_back(key);
      }
    }
  }
}

std::vector<Group> groups_of(const Case& k, const be::AttentionMetadata& md) {
  const int64_t bs = k.bs();
  if (md.cascade.enabled) return {{{&md.cascade.prefix}, false, bs}, {{&md.cascade.suffix}, false, bs}};
  if (md.local.enabled) return {{{&md.local.part}, false, bs}};
  if (md.tree.enabled) return {{{&md.tree.prefix}, false, bs}, {{&md.tree.tree}, false, 1}};
  return {{{&md.decode, &md.prefill}, true, k.encoder() ? 0 : bs}};
}

void check_case(const Case& k, const be::AttentionMetadata& md, size_t max_ws) {
  const be::PartMetadata* all[] = {&md.decode, &md.prefill, &md.cascade.prefix, &md.cascade.suffix,
                                   &md.local.part, &md.tree.prefix, &md.tree.tree};
  std::vector<V64> seen(size_t(k.num_tokens()));
  std::vector<Span> owned;
  for (const Group& g : groups_of(k, md)) {
    std::vector<int> hits(size_t(k.num_tokens()), 0);
    for (const be::PartMetadata* p : g.parts) {
      check_views(k, *p, g, owned);
      if (testing::Test::HasFatalFailure()) return;
      part_keys(k, *p, g, seen, hits);
      if (k.config.device.device.type == fs::DeviceType::cuda) ASSERT_LE(p->plan.workspace.total_bytes, max_ws);
    }
    for (int64_t t = 0; t < k.num_tokens(); ++t) ASSERT_EQ(hits[size_t(t)], 1) << "query token " << t;
  }
  for (const be::PartMetadata* p : all) {
    bool in_use = false;
    for (const Group& g : groups_of(k, md)) in_use |= std::find(g.parts.begin(), g.parts.end(), p) != g.parts.end();
    ASSERT_TRUE(in_use || p->empty()) << "a part outside the groups in use has requests";
  }
  for (int64_t r = 0; r < k.num_reqs(); ++r)
    for (int64_t i = 0; i < k.q(r); ++i) {
      V64 got = seen[size_t(k.qsl[size_t(r)] + i)], want = expected_keys(k, r, i);
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      ASSERT_EQ(got, want) << "request " << r << " query row " << i;
    }
  // Builder buffers never alias (empty views excepted).
  std::sort(owned.begin(), owned.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  for (size_t i = 1; i < owned.size(); ++i)
    if (owned[i - 1].hi > owned[i - 1].lo && owned[i].hi > owned[i].lo) ASSERT_LE(owned[i - 1].hi, owned[i].lo);
}

}  // namespace

TEST(PlannerFuzz, RandomBatchesCoverEveryTokenAndKeyExactlyOnce) {
  auto rng = fstest::make_rng(0xf022);
  int modes[5] = {};
  for (int it = 0; it < 8000; ++it) {
    const Case k = random_case(rng);
    SCOPED_TRACE(testing::Message() << "case " << it << ": reqs " << k.num_reqs() << " tokens " << k.num_tokens() << " bs " << k.bs()
                                    << " type " << int(k.config.layer.type) << " chunk "
                                    << k.config.layer.attention_chunk_size << " window " << k.config.layer.sliding_window
                                    << " dcp " << k.config.dcp_world_size << "/" << k.config.dcp_rank << " tree "
                                    << k.tree << " prefix " << k.common_prefix_len);
    be::MetadataBuilder b(k.config);
    const be::DraftTree tree{k.parents, k.num_drafts};
    const be::AttentionMetadata& md = b.build(k.common(), k.common_prefix_len, k.tree ? &tree : nullptr);
    check_case(k, md, b.max_workspace_bytes());
    if (HasFatalFailure()) return;
    modes[md.cascade.enabled ? 1 : md.local.enabled ? 2 : md.tree.enabled ? 3 : k.config.dcp_world_size > 1 ? 4 : 0]++;
  }
  for (int m = 0; m < 5; ++m)
    EXPECT_GT(modes[m], 40) << "mode " << m << " (split, cascade, local, tree, dcp) rarely seen";
}

// ---------------------------------------------------------------- replay

namespace {

V32 values(const TensorRef& t) {
  V32 v;
  for (int64_t i = 0; i < (t.ndim ? t.size(0) : 0); ++i) v.push_back(at1(t, i));
  return v;
}

V64 values64(const TensorRef& t) {
  V64 v;
  for (int64_t i = 0; i < (t.ndim ? t.size(0) : 0); ++i) v.push_back(*static_cast<const int64_t*>(t.at(i)));
  return v;
}

// Field by field: scalars, plans, the contents of every view; views of the engine's table
// must be the same view, views of builder buffers may sit elsewhere.
void expect_part_eq(const be::PartMetadata& a, const be::PartMetadata& b, const Case& k, const char* name) {
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
  const TensorRef &ta = a.block_table, &tb = b.block_table;
  EXPECT_EQ(ta.shape_str(), tb.shape_str());
  EXPECT_EQ(k.in_table(ta.data), k.in_table(tb.data));
  if (k.in_table(ta.data)) {
    EXPECT_EQ(ta.data, tb.data);
    EXPECT_EQ(ta.stride, tb.stride);
  }
  for (int64_t r = 0; r < (ta.ndim == 2 ? ta.size(0) : 0); ++r)
    for (int64_t j = 0; j < ta.size(1); ++j)
      ASSERT_EQ(at2(ta, r, j), at2(tb, r, j)) << "block_table[" << r << "][" << j << "]";
  EXPECT_TRUE(a.plan.shape == b.plan.shape);
  EXPECT_EQ(a.plan.num_splits, b.plan.num_splits);
  EXPECT_EQ(a.plan.split_granularity, b.plan.split_granularity);
  EXPECT_EQ(a.plan.workspace.total_bytes, b.plan.workspace.total_bytes);
}

void expect_md_eq(const be::AttentionMetadata& a, const be::AttentionMetadata& b, const Case& k) {
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
  expect_part_eq(a.decode, b.decode, k, "decode");
  expect_part_eq(a.prefill, b.prefill, k, "prefill");
  expect_part_eq(a.cascade.prefix, b.cascade.prefix, k, "cascade.prefix");
  expect_part_eq(a.cascade.suffix, b.cascade.suffix, k, "cascade.suffix");
  expect_part_eq(a.local.part, b.local.part, k, "local");
  expect_part_eq(a.tree.prefix, b.tree.prefix, k, "tree.prefix");
  expect_part_eq(a.tree.tree, b.tree.tree, k, "tree.tree");
}

// Pointers of the builder's own views, by field: none may move.
void expect_fixed_pointers(const be::AttentionMetadata& md, const Case& k, std::map<std::string, const void*>& seen) {
  const std::pair<const char*, const be::PartMetadata*> parts[] = {
      {"decode", &md.decode}, {"prefill", &md.prefill}, {"cascade.prefix", &md.cascade.prefix},
      {"cascade.suffix", &md.cascade.suffix}, {"local", &md.local.part}, {"tree.prefix", &md.tree.prefix},
      {"tree.tree", &md.tree.tree}};
  for (const auto& [name, p] : parts) {
    const std::pair<const char*, const TensorRef*> views[] = {{".cu_seqlens_q", &p->cu_seqlens_q},
                                                               {".seqused_k", &p->seqused_k},
                                                               {".cp_tot_seqused_k", &p->cp_tot_seqused_k},
                                                               {".block_table", &p->block_table}};
    for (const auto& [field, t] : views) {
      if (t->data == nullptr || k.in_table(t->data)) continue;
      const auto [it, first] = seen.emplace(std::string(name) + field, t->data);
      EXPECT_EQ(it->second, t->data) << name << field << " moved";
    }
  }
}

// 0: plain decoder on few SMs (cascade often), 1: chunked local, 2: DCP, 3: draft trees.
be::BuilderConfig replay_config(int kind) {
  be::BuilderConfig c;
  c.layer.num_heads = 8;
  c.layer.num_kv_heads = 2;
  c.layer.head_size = 64;
  c.block_size = kind == 1 ? 4 : 16;
  c.max_num_reqs = 16;
  c.max_num_tokens = 256;
  c.max_blocks_per_req = 128;
  c.device = fs::DeviceProps::cpu();
  c.device.num_sms = 4;
  if (kind == 1) c.layer.attention_chunk_size = 8;
  if (kind == 2) c.dcp_world_size = 3, c.dcp_rank = 2, c.dcp_interleave = 4;
  if (kind == 3) c.reorder_batch_threshold = 5;
  return c;
}

const be::DraftTree* tree_of(const Case& k, be::DraftTree& storage) {
  storage = {k.parents, k.num_drafts};
  return k.tree ? &storage : nullptr;
}

}  // namespace

TEST(PlannerFuzz, GraphModeReplayEqualsFreshBuilds) {
  auto rng = fstest::make_rng(0x9a9);
  for (int kind = 0; kind < 4; ++kind) {
    const be::BuilderConfig c = replay_config(kind);
    be::MetadataBuilder reused(c);
    std::map<std::string, const void*> seen;
    int cascades = 0;
    for (int it = 0; it < 50; ++it) {
      SCOPED_TRACE(testing::Message() << "config " << kind << " batch " << it);
      const Case k = make_case(rng, c, kind == 3 && rng() % 4 != 0);
      be::DraftTree storage;
      const be::DraftTree* tree = tree_of(k, storage);
      const be::AttentionMetadata& a = reused.build(k.common(), k.common_prefix_len, tree);
      be::MetadataBuilder fresh(c);
      expect_md_eq(a, fresh.build(k.common(), k.common_prefix_len, tree), k);
      expect_fixed_pointers(a, k, seen);
      cascades += a.cascade.enabled;
    }
    if (kind == 0) EXPECT_GT(cascades, 0);
  }
}

TEST(PlannerFuzz, UpdateBlockTableEqualsBuildOnTheOtherTable) {
  auto rng = fstest::make_rng(0xb10c);
  for (int kind = 0; kind < 4; ++kind) {
    const be::BuilderConfig c = replay_config(kind);
    be::MetadataBuilder b(c);
    for (int it = 0; it < 20; ++it) {
      SCOPED_TRACE(testing::Message() << "config " << kind << " batch " << it);
      const Case k = make_case(rng, c, kind == 3);
      be::DraftTree storage;
      const be::DraftTree* tree = tree_of(k, storage);
      b.build(k.common(), k.common_prefix_len, tree);
      Case other = k;  // another layer group: same shape and sharing, other block ids
      for (int32_t& x : other.table) x += 1000;
      other.fill_slots();
      const be::AttentionMetadata& md = b.update_block_table(other.table_ref());
      be::MetadataBuilder fresh(c);
      be::AttentionMetadata want = fresh.build(other.common(), k.common_prefix_len, tree);
      want.slot_mapping = k.common().slot_mapping;  // the slot mapping is not re-pointed
      expect_md_eq(md, want, other);
    }
  }
}

TEST(PlannerFuzz, AdvanceDecodeStepEqualsRebuild) {
  auto rng = fstest::make_rng(0xadd);
  for (int kind = 0; kind < 3; ++kind) {
    const be::BuilderConfig c = replay_config(kind);
    be::MetadataBuilder b(c);
    int cascades = 0;
    for (int it = 0; it < 20; ++it) {
      Case k = make_case(rng, c, false, true);
      b.build(k.common(), k.common_prefix_len);
      for (int step = 0; step < 4; ++step) {
        SCOPED_TRACE(testing::Message() << "config " << kind << " batch " << it << " step " << step);
        const be::AttentionMetadata& md = b.advance_decode_step();
        for (int32_t& x : k.seq) ++x;
        k.fill_slots();
        be::MetadataBuilder fresh(c);
        expect_md_eq(md, fresh.build(k.common(), k.common_prefix_len), k);
        cascades += md.cascade.enabled;
      }
    }
    if (kind == 0) EXPECT_GT(cascades, 0);
  }
}
