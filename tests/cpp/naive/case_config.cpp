// Random attention configurations, their description and their coverage tags.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "naive/attention_case.hpp"

namespace fstest {

using flashserve::DType;
using flashserve::KvLayout;

namespace {

struct Draw {
  std::mt19937_64& g;
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  bool coin(double p) { return std::bernoulli_distribution(p)(g); }
  template <class T>
  T pick(std::initializer_list<T> xs) { return *(xs.begin() + integer(0, int64_t(xs.size()) - 1)); }
};

// A sequence length: often 0 or 1 (decode), mostly short, up to `hi`.
int64_t draw_len(Draw& r, int64_t hi) {
  const int64_t u = r.integer(0, 99);
  if (u < 8) return 0;
  if (u < 25) return 1;
  if (u < 60) return r.integer(1, std::min<int64_t>(16, hi));
  return r.integer(1, hi);
}

void draw_heads(CaseConfig& c, Draw& r) {
  const int64_t group = r.pick<int64_t>({1, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16});
  c.H_kv = group > 8 ? r.integer(1, 2) : r.integer(1, 4);
  c.H = c.H_kv * group;
  const int64_t u = r.integer(0, 99);
  if (u < 8) {
    c.D = 192, c.Dv = 128;  // MLA prefill
  } else if (u < 15) {
    c.D = 64, c.Dv = 512, c.has_qv = true;  // MLA absorbed decode
    c.H = std::min<int64_t>(c.H, 8 * c.H_kv);
  } else {
    c.D = u < 60 ? r.pick<int64_t>({8, 16, 32, 40, 64, 72, 80, 96, 128, 256}) : 8 * r.integer(1, 32);
    c.Dv = c.D;
  }
}

void draw_dtypes(CaseConfig& c, Draw& r) {
  const int64_t u = r.integer(0, 99);
  c.quant = u < 45 ? QuantMode::none : u < 60 ? QuantMode::fp8_kv : u < 70 ? QuantMode::fp8_qkv
          : u < 85 ? QuantMode::int8_k8v8 : QuantMode::int8_k8v16;
  if (c.has_qv && c.quant != QuantMode::none) c.quant = QuantMode::fp8_kv;
  const DType fl = r.pick({DType::f32, DType::f16, DType::bf16});
  const DType f8 = r.pick({DType::f8e4m3, DType::f8e5m2});
  switch (c.quant) {
    case QuantMode::none: c.q_dtype = c.kv_dtype = c.out_dtype = fl; break;
    case QuantMode::fp8_kv: c.q_dtype = c.out_dtype = fl, c.kv_dtype = f8; break;
    case QuantMode::fp8_qkv:
      c.q_dtype = r.pick({DType::f8e4m3, DType::f8e5m2}), c.kv_dtype = f8;
      c.out_dtype = r.coin(0.75) ? DType::bf16 : DType::f16;
      break;
    case QuantMode::int8_k8v8:
    case QuantMode::int8_k8v16:
      c.q_dtype = c.kv_dtype = DType::i8;
      c.out_dtype = r.pick({DType::f16, DType::bf16});
      c.v16_dtype = r.pick({DType::f16, DType::bf16});
      break;
  }
  c.sink_dtype = r.pick({DType::f32, DType::f16, DType::bf16});
  c.descale_broadcast = int(r.integer(0, 2));
}

// Lengths, then shrunk until the work fits the budget (the whole fuzz run stays well under a
// minute on 2 cores).
void draw_lengths(CaseConfig& c, Draw& r) {
  const bool big = r.coin(0.06);
  const int64_t hi = big ? 300 : 64;
  const int64_t B = c.batched() ? r.integer(1, 4) : r.integer(1, 5);
  c.q_lens.assign(size_t(B), 0);
  c.k_lens.assign(size_t(B), 0);
  const int64_t sq = r.coin(0.4) ? 1 : r.coin(0.05) ? 0 : r.integer(1, r.coin(0.5) ? 8 : 32);
  for (int64_t b = 0; b < B; ++b) {
    c.q_lens[size_t(b)] = c.batched() ? sq : draw_len(r, hi);
    c.k_lens[size_t(b)] = draw_len(r, hi);
    if (r.coin(0.3)) c.k_lens[size_t(b)] = c.q_lens[size_t(b)] + r.integer(0, 40);  // prefill with context
  }
  const double unit = double(c.H * (c.D + c.Dv + (c.has_qv ? c.Dv : 0)));
  const double budget = big ? 3e7 : 4e6;
  for (int iter = 0; iter < 200; ++iter) {
    double work = 0.0, worst_work = -1.0;
    size_t worst = 0;
    for (size_t b = 0; b < c.q_lens.size(); ++b) {
      const double w = double(std::max<int64_t>(c.q_lens[b], 1) * std::max<int64_t>(c.k_lens[b], 1)) * unit;
      work += w;
      if (w > worst_work) worst = b, worst_work = w;
    }
    if (work <= budget) break;
    int64_t& kl = c.k_lens[worst];
    if (c.batched() ? kl > 4 : kl >= c.q_lens[worst]) {
      kl = kl * 3 / 4;
    } else if (c.batched()) {
      for (auto& q : c.q_lens) q = q * 3 / 4;
    } else {
      c.q_lens[worst] = c.q_lens[worst] * 3 / 4;
    }
  }
  if (c.mode == KvMode::batched_contiguous && !c.use_seqused) {
    const int64_t s = *std::max_element(c.k_lens.begin(), c.k_lens.end());
    std::fill(c.k_lens.begin(), c.k_lens.end(), s);  // no cache_seqlens: every length is S_cache
  }
}

void draw_features(CaseConfig& c, Draw& r) {
  const int64_t maxk = std::max<int64_t>(1, *std::max_element(c.k_lens.begin(), c.k_lens.end()));
  if (r.coin(0.5)) c.softmax_scale = float(r.uniform(0.5, 3.0) / std::sqrt(double(c.D + (c.has_qv ? c.Dv : 0))));
  if (r.coin(0.25)) c.softcap = float(r.uniform(2.0, 30.0));
  c.alibi = r.coin(0.3) ? int(r.integer(1, 2)) : 0;
  c.alibi_sqrt = c.alibi && r.coin(0.3);
  c.causal = r.coin(0.5);
  if (r.coin(0.3)) {
    c.window.left = r.coin(0.3) ? -1 : int(r.integer(0, maxk));
    c.window.right = r.coin(0.4) ? -1 : int(r.integer(0, std::min<int64_t>(maxk, 8)));
  }
  if (r.coin(0.15)) c.chunk = r.integer(1, maxk);
  c.sinks = r.coin(0.25);
  c.lse = r.coin(0.6);
  c.num_splits = r.pick({0, 1, 2, 3, 7});
}

}  // namespace

CaseConfig small_case_config(KvMode mode, std::vector<int64_t> q_lens, std::vector<int64_t> k_lens) {
  CaseConfig c;
  c.mode = mode;
  if (c.batched()) q_lens.assign(k_lens.size(), q_lens[0]);
  c.H = 4, c.H_kv = 2, c.D = c.Dv = 32;
  c.q_dtype = c.kv_dtype = c.out_dtype = DType::f32;
  c.q_lens = std::move(q_lens);
  c.k_lens = std::move(k_lens);
  c.lse = true;
  c.extra_kv_rows = 1;
  c.extra_table_cols = 1;
  return c;
}

CaseConfig random_case_config(std::mt19937_64& rng) {
  Draw r{rng};
  CaseConfig c;
  c.mode = KvMode(r.integer(0, 3));
  c.layout = r.coin(0.5) ? KvLayout::hnd : KvLayout::nhd;
  c.block_size = r.pick<int64_t>({1, 2, 5, 16, 32, 64});
  switch (c.mode) {
    case KvMode::varlen_contiguous: c.use_seqused = r.coin(0.5); break;
    case KvMode::varlen_paged: c.use_seqused = r.coin(0.8); break;
    case KvMode::batched_paged: c.use_seqused = true; break;
    case KvMode::batched_contiguous:
      c.use_seqused = r.coin(0.7);
      c.use_cache_batch_idx = r.coin(0.5);
      break;
  }
  draw_heads(c, r);
  draw_dtypes(c, r);
  draw_lengths(c, r);
  draw_features(c, r);
  c.max_seqlen_slack = r.coin(0.3) ? r.integer(1, 5) : 0;
  c.extra_kv_rows = r.integer(0, 3);
  c.extra_table_cols = r.integer(0, 2);
  c.kv_interleaved = c.quant != QuantMode::int8_k8v16 && r.coin(0.4);
  c.kv_pad = r.coin(0.3) ? r.pick<int64_t>({3, 8, 64}) : 0;
  c.table_row_pad = r.coin(0.5) ? r.integer(1, 4) : 0;
  c.table_col_offset = r.integer(0, c.table_row_pad);
  c.q_pad = r.coin(0.3) ? r.integer(1, 16) : 0;
  c.out_pad = r.coin(0.3) ? r.integer(1, 16) : 0;
  c.random_block_ids = r.coin(0.6);
  return c;
}

namespace {

const char* mode_name(KvMode m) {
  switch (m) {
    case KvMode::varlen_contiguous: return "varlen_contiguous";
    case KvMode::varlen_paged: return "varlen_paged";
    case KvMode::batched_paged: return "batched_paged";
    case KvMode::batched_contiguous: return "batched_contiguous";
  }
  return "?";
}

const char* quant_name(QuantMode q) {
  switch (q) {
    case QuantMode::none: return "none";
    case QuantMode::fp8_kv: return "fp8_kv";
    case QuantMode::fp8_qkv: return "fp8_qkv";
    case QuantMode::int8_k8v8: return "int8_k8v8";
    case QuantMode::int8_k8v16: return "int8_k8v16";
  }
  return "?";
}

template <class T>
std::string list(const std::vector<T>& xs) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < xs.size(); ++i) os << (i ? ", " : "") << xs[i];
  os << ']';
  return os.str();
}

}  // namespace

std::string describe(const CaseConfig& c) {
  std::ostringstream os;
  os << "mode=" << mode_name(c.mode) << " layout=" << (c.layout == KvLayout::hnd ? "HND" : "NHD")
     << " block_size=" << c.block_size << " H=" << c.H << " H_kv=" << c.H_kv << " D=" << c.D
     << " Dv=" << c.Dv << " q_v=" << c.has_qv << "\n  q_lens=" << list(c.q_lens) << " k_lens=" << list(c.k_lens)
     << " use_seqused=" << c.use_seqused << " cache_batch_idx=" << c.use_cache_batch_idx
     << " max_seqlen_slack=" << c.max_seqlen_slack << " extra_kv_rows=" << c.extra_kv_rows
     << " extra_table_cols=" << c.extra_table_cols << "\n  quant=" << quant_name(c.quant)
     << " q=" << dtype_name(c.q_dtype) << " kv=" << dtype_name(c.kv_dtype) << " out=" << dtype_name(c.out_dtype)
     << " v16=" << dtype_name(c.v16_dtype) << " sink=" << dtype_name(c.sink_dtype)
     << " descale_broadcast=" << c.descale_broadcast << "\n  kv_interleaved=" << c.kv_interleaved
     << " kv_latent=" << c.kv_latent
     << " kv_pad=" << c.kv_pad << " table_row_pad=" << c.table_row_pad << " table_col_offset=" << c.table_col_offset
     << " q_pad=" << c.q_pad << " out_pad=" << c.out_pad << " random_block_ids=" << c.random_block_ids
     << "\n  softmax_scale=" << c.softmax_scale << " softcap=" << c.softcap << " alibi=" << c.alibi
     << " alibi_sqrt=" << c.alibi_sqrt << " causal=" << c.causal << " window=(" << c.window.left << ", "
     << c.window.right << ") chunk=" << c.chunk << " sinks=" << c.sinks << " lse=" << c.lse
     << " num_splits=" << c.num_splits;
  return os.str();
}

std::vector<std::string> coverage_tags(const CaseConfig& c) {
  std::vector<std::string> t;
  auto add = [&](bool on, std::string tag) { if (on) t.push_back(std::move(tag)); };
  t.push_back(mode_name(c.mode));
  add(c.mode == KvMode::varlen_contiguous && c.use_seqused, "varlen_seqused");
  add(c.mode == KvMode::varlen_paged && !c.use_seqused, "varlen_paged_cu_seqlens_k");
  add(c.mode == KvMode::batched_contiguous && c.use_cache_batch_idx, "cache_batch_idx");
  add(c.mode == KvMode::batched_contiguous && !c.use_cache_batch_idx, "no_cache_batch_idx");
  add(c.mode == KvMode::batched_contiguous && !c.use_seqused, "no_cache_seqlens");
  if (c.paged()) {
    t.push_back(c.layout == KvLayout::hnd ? "paged_hnd" : "paged_nhd");
    t.push_back("bs=" + std::to_string(c.block_size));
    add(c.random_block_ids, "random_block_ids");
    add(c.table_row_pad > 0, "table_row_slice");
  }
  const int64_t group = c.H / c.H_kv;
  t.push_back("group=" + std::to_string(group));
  add(c.H_kv == 1, "mqa");
  add(c.D == 40 || c.D == 72 || c.D == 80, "D=" + std::to_string(c.D));
  add(c.D == 256, "D=256");
  add(c.D == 192 && c.Dv == 128, "mla_192_128");
  add(c.has_qv, "mla_qv_512");
  t.push_back(std::string("quant=") + quant_name(c.quant));
  t.push_back(std::string("q=") + std::string(dtype_name(c.q_dtype)));
  t.push_back(std::string("kv=") + std::string(dtype_name(c.kv_dtype)));
  t.push_back(std::string("out=") + std::string(dtype_name(c.out_dtype)));
  add(c.quant != QuantMode::none && c.quant != QuantMode::int8_k8v8 && c.quant != QuantMode::int8_k8v16 &&
          c.descale_broadcast > 0, "descale_broadcast");
  add(c.kv_interleaved, "kv_interleaved");
  add(c.q_pad > 0, "q_padded");
  add(c.out_pad > 0, "out_padded");
  add(c.causal, "causal");
  add(c.window.left >= 0 || c.window.right >= 0, "window");
  add(c.window.left < 0 && c.window.right >= 0, "window_left_unbounded");
  add(c.chunk > 0, "chunk");
  add(c.softcap > 0, "softcap");
  add(c.alibi == 1, "alibi_h");
  add(c.alibi == 2, "alibi_bh");
  add(c.alibi_sqrt, "alibi_sqrt");
  add(c.sinks, "sinks");
  add(c.lse, "lse");
  t.push_back("splits=" + std::to_string(c.num_splits));
  bool sq0 = false, sk0 = false, sq_gt_sk = false, big = false;
  for (size_t b = 0; b < c.q_lens.size(); ++b) {
    sq0 |= c.q_lens[b] == 0;
    sk0 |= c.k_lens[b] == 0;
    sq_gt_sk |= c.q_lens[b] > c.k_lens[b];
    big |= c.k_lens[b] > 100 || c.q_lens[b] > 100;
  }
  add(sq0, "sq=0");
  add(sk0, "sk=0");
  add(sq_gt_sk, "sq>sk");
  add(sq_gt_sk && c.causal, "sq>sk_causal");
  add(big, "long_sequence");
  return t;
}

}  // namespace fstest
