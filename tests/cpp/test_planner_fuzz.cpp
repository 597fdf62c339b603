// Planner fuzz: thousands of random batches through MetadataBuilder over random configs
// (block sizes, decode/prefill thresholds, cascade with shared prefixes, chunked local, draft
// trees, DCP ranks, sliding windows, cross-attention, encoders, CPU or CUDA planning). For each:
// - every pass group the metadata uses (decode+prefill | cascade prefix, suffix | local |
//   tree prefix, tree) covers every query token exactly once;
// - the union of the KV each query token sees over all groups (through cu_seqlens_q,
//   seqused_k, causal, the layer window, the block tables) is exactly the set the layer
//   defines for it, computed by brute force, with no key seen twice;
// - views lie within the engine's table or the builder's own buffers, builder views never
//   alias each other, seqused_k fits each table, plans fit max_num_splits and the workspace.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "flashserve/backend.hpp"
#include "flashserve/backend_variants.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace be = flashserve::backend;
using fs::DType;
using fs::TensorRef;
using V32 = std::vector<int32_t>;
using V64 = std::vector<int64_t>;

struct Case {
  be::BuilderConfig config;
  bool tree = false;
  // The engine's step.
  V32 qsl{0}, seq, enc, parents, num_drafts;
  int64_t rows = 0, cols = 0, stride = 0, common_prefix_len = 0;
  V32 table;
  V64 slots;

  int64_t R() const { return int64_t(seq.size()); }
  int64_t T() const { return qsl.back(); }
  int64_t q(int64_t r) const { return qsl[size_t(r) + 1] - qsl[size_t(r)]; }
  int64_t bs() const { return config.block_size; }
  bool encoder() const {
    return config.layer.type == be::AttnType::encoder || config.layer.type == be::AttnType::encoder_only;
  }
  // Physical slot of KV position `pos` (on this rank) of request r.
  int64_t slot(int64_t r, int64_t pos) const { return int64_t(table[size_t(r * stride + pos / bs())]) * bs() + pos % bs(); }
  TensorRef table_ref() const {
    return TensorRef::strided(const_cast<int32_t*>(table.data()), DType::i32, {rows, cols}, {stride, 1});
  }
  be::CommonMetadata common() const {
    be::CommonMetadata c;
    c.num_reqs = R();
    c.num_actual_tokens = T();
    for (int64_t r = 0; r < R(); ++r) c.max_query_len = std::max<int64_t>(c.max_query_len, q(r));
    for (int32_t s : seq) c.max_seq_len = std::max<int64_t>(c.max_seq_len, s);
    c.query_start_loc = qsl;
    c.seq_lens = seq;
    c.encoder_seq_lens = enc;
    if (!encoder()) {
      c.block_table = table_ref();
      c.slot_mapping = TensorRef::contiguous(const_cast<int64_t*>(slots.data()), DType::i64, {T()});
    }
    return c;
  }
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
  if (kind == 3) c.dcp_world_size = 2 + int(rng() % 3), c.dcp_rank = int(rng() % c.dcp_world_size);
  if (kind == 4) tree = true, c.reorder_batch_threshold = 8, c.max_draft_depth = 4 + int64_t(rng() % 4);
  if ((kind == 1 || kind >= 5) && rng() % 3 == 0) c.layer.sliding_window = 1 + int64_t(rng() % 40);
  return c;
}

Case random_case(std::mt19937_64& rng) {
  Case k;
  k.config = random_config(rng, k.tree);
  const be::BuilderConfig& c = k.config;
  const int64_t bs = c.block_size, thr = c.reorder_batch_threshold;
  const bool many = rng() % 2;  // cascade needs >= 8 requests
  const int64_t R = many ? 8 + int64_t(rng() % 9) : int64_t(rng() % 8);
  const int64_t nd = R ? int64_t(rng() % (R + 1)) : 0;
  const int64_t shared = rng() % 2 ? (256 + int64_t(rng() % 200)) / bs : int64_t(rng() % 4);
  const bool all_share = rng() % 4 != 0;  // else some requests stop short of the shared blocks
  for (int64_t r = 0; r < R; ++r) {
    int32_t q;
    if (k.tree) {
      const int32_t drafts = int32_t(rng() % 5);
      k.num_drafts.push_back(drafts);
      for (int32_t d = 0; d < drafts; ++d) k.parents.push_back(int32_t(rng() % (d + 1)) - 1);
      q = drafts + int32_t(drafts == 0 || rng() % 3 != 0);  // 16 x 5 tokens at most: within capacity
    } else {
      q = r < nd ? int32_t(rng() % 10 == 0 ? 0 : 1 + rng() % thr) : int32_t(thr + 1 + rng() % 14);
      if (k.T() + q > c.max_num_tokens) break;
    }
    k.qsl.push_back(k.qsl.back() + q);
    const int64_t ctx = k.encoder() ? 0 : (all_share || rng() % 3 ? shared * bs : 0) + int64_t(rng() % 40);
    k.seq.push_back(int32_t(ctx + q));
    k.enc.push_back(k.encoder() ? int32_t(q) : int32_t(rng() % 90));
  }
  // The table: room for each request's KV on this rank (and the encoder's), some spare.
  int64_t need = 1;
  for (int64_t r = 0; r < R; ++r) {
    need = std::max<int64_t>(need, be::DcpAttentionLayer::local_len(k.seq[size_t(r)], c.dcp_world_size, c.dcp_rank));
    need = std::max<int64_t>(need, k.enc[size_t(r)]);
  }
  k.rows = R + int64_t(rng() % 3);
  k.cols = (need + bs - 1) / bs + int64_t(rng() % 3);
  k.stride = k.cols + int64_t(rng() % 4);
  k.table.assign(size_t(std::max<int64_t>(1, k.rows * k.stride)), -3);
  const int64_t shared_cols = std::min(shared, k.cols);
  for (int64_t r = 0; r < k.rows; ++r)
    for (int64_t j = 0; j < k.cols; ++j)
      k.table[size_t(r * k.stride + j)] = int32_t(j < shared_cols ? j : shared_cols + r * k.cols + j);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < k.q(r); ++i) {
      const int64_t pos = k.seq[size_t(r)] - k.q(r) + i, w = c.dcp_world_size;
      k.slots.push_back(pos % w == c.dcp_rank ? k.slot(r, pos / w) : -1);
    }
  k.common_prefix_len = shared_cols * bs + int64_t(rng() % bs) - (rng() % 4 == 0 ? bs : 0);
  k.common_prefix_len = std::max<int64_t>(0, k.common_prefix_len);
  return k;
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
  const int64_t W = c.dcp_world_size;
  for (int64_t g = lo; g <= p; ++g)
    if (g % W == c.dcp_rank) keys.push_back(k.slot(r, g / W));
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
  ASSERT_LE(p.token_begin + p.num_tokens, k.T());
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
void part_keys(const Case& k, const be::PartMetadata& p, const Group& g, std::vector<V64>& seen, std::vector<int>& hits) {
  const be::BuilderConfig& c = k.config;
  const fs::Window w = g.windowed ? be::layer_window(c.layer) : fs::Window{};
  const int64_t W = c.dcp_world_size;
  for (int64_t b = 0; b < p.num_reqs; ++b) {
    const int64_t row0 = p.token_begin + at1(p.cu_seqlens_q, b), sq = at1(p.cu_seqlens_q, b + 1) - at1(p.cu_seqlens_q, b);
    const int64_t sk = at1(p.seqused_k, b);
    const int64_t tot = p.cp_tot_seqused_k.ndim ? at1(p.cp_tot_seqused_k, b) : sk;
    for (int64_t i = 0; i < sq; ++i) {
      ++hits[size_t(row0 + i)];
      const int64_t ip = i + tot - sq;  // aligned position (global under DCP)
      for (int64_t j = 0; j < sk; ++j) {
        const int64_t jg = W > 1 ? j * W + c.dcp_rank : j;
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
  std::vector<V64> seen(size_t(k.T()));
  std::vector<Span> owned;
  for (const Group& g : groups_of(k, md)) {
    std::vector<int> hits(size_t(k.T()), 0);
    for (const be::PartMetadata* p : g.parts) {
      check_views(k, *p, g, owned);
      if (testing::Test::HasFatalFailure()) return;
      part_keys(k, *p, g, seen, hits);
      if (k.config.device.device.type == fs::DeviceType::cuda) ASSERT_LE(p->plan.workspace.total_bytes, max_ws);
    }
    for (int64_t t = 0; t < k.T(); ++t) ASSERT_EQ(hits[size_t(t)], 1) << "query token " << t;
  }
  for (const be::PartMetadata* p : all) {
    bool in_use = false;
    for (const Group& g : groups_of(k, md)) in_use |= std::find(g.parts.begin(), g.parts.end(), p) != g.parts.end();
    ASSERT_TRUE(in_use || p->empty()) << "a part outside the groups in use has requests";
  }
  for (int64_t r = 0; r < k.R(); ++r)
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
    SCOPED_TRACE(testing::Message() << "case " << it << ": reqs " << k.R() << " tokens " << k.T() << " bs " << k.bs()
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
  for (int m = 0; m < 5; ++m) EXPECT_GT(modes[m], 40) << "mode " << m << " (split, cascade, local, tree, dcp) rarely seen";
}
