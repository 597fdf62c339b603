#include "api/validate_cache.hpp"

#include <cstdint>
#include <limits>
#include <string>

#include "flashserve/status.hpp"

namespace flashserve::detail {



namespace {

constexpr std::initializer_list<DType> kFloats = {DType::f16, DType::bf16, DType::f32};

// fp8 k_scale / v_scale: fp32 [], [1] or [H_kv]; returned as [H_kv] (stride 0 when shared).
TensorRef fp8_scale(std::string_view name, const OptTensor& s, int64_t heads, KvCacheDType cd) {
  if (!s) fail_arg(name, cat("an fp32 tensor [], [1] or [H_kv] for kv_cache_dtype ", kv_cache_dtype_name(cd)), "none");
  check_dtype(*s, name, {DType::f32});
  const bool ok = s->ndim == 0 || (s->ndim == 1 && (s->size(0) == 1 || s->size(0) == heads));
  if (!ok) fail_arg(name, cat("shape [], [1] or [", heads, "] (H_kv)"), s->shape_str());
  TensorRef v = *s;
  if (v.ndim == 0 || v.shape[0] == 1) {
    v.ndim = 1;
    v.shape[0] = heads;
    v.stride[0] = 0;
  }
  return v;
}

// The 4-D cache as given; returns its NHD view [num_blocks, block_size, H_kv, width].
TensorRef paged_cache(std::string_view name, const TensorRef& c, KvLayout layout) {
  check_rank(c, name, 4, layout == KvLayout::nhd ? "[num_blocks, block_size, H_kv, D] (nhd)"
                                                    : "[num_blocks, H_kv, block_size, D] (hnd)");
  check_last_contiguous(c, name);
  return layout == KvLayout::nhd ? c : c.permute({0, 2, 1, 3});
}

void check_cache_shape(std::string_view name, const TensorRef& c, KvLayout layout, int64_t nb,
                       int64_t bs, int64_t heads, int64_t width, std::string_view as) {
  if (layout == KvLayout::nhd)
    check_shape(c, name, {nb, bs, heads, width}, cat("nhd [num_blocks, block_size, H_kv, D] as ", as));
  else
    check_shape(c, name, {nb, heads, bs, width}, cat("hnd [num_blocks, H_kv, block_size, D] as ", as));
}

// Key/value rows: [>= num_tokens, H_kv, width], last dim contiguous.
void check_rows(std::string_view name, const TensorRef& t, int64_t num_tokens) {
  check_rank(t, name, 3, "[num_tokens, H_kv, D]");
  check_last_contiguous(t, name);
  if (t.size(0) < num_tokens)
    fail_arg(name, cat("at least ", num_tokens, " rows (slot_mapping's length)"), t.shape_str());
}

// int8 rows given already quantized (the int8 fork's reshape_and_cache_flash_int8 / _mix): the
// key stored as is with its scales from key_scale; the value as is (int8 for K8V8, 16-bit for
// K8V16).
void resolve_given_int8(const CacheWriteParams& p, CacheWriteProblem& pr) {
  pr.k_kind = StoreKind::int8_given;
  if (!p.key_scale) fail_arg("key_scale", "an fp32 tensor [num_tokens, H_kv]: the scales of the int8 key", "none");
  const TensorRef& ks = *p.key_scale;
  check_dtype(ks, "key_scale", {DType::f32});
  check_rank(ks, "key_scale", 2, "[num_tokens, H_kv]");
  if (ks.size(0) < pr.num_tokens || ks.size(1) != pr.num_kv_heads)
    fail_arg("key_scale", cat("[>= ", pr.num_tokens, ", ", pr.num_kv_heads, "] ([num_tokens, H_kv] as key)"),
             ks.shape_str());
  check_non_negative_strides(ks, "key_scale");
  pr.key_scale = ks;
  if (p.cache_dtype == KvCacheDType::int8_k8v8) {
    check_dtype(p.value, "value", {DType::i8});
    check_dtype(p.value_cache, "value_cache", {DType::i8});
    if (p.v_scale)
      fail_arg("v_scale", "none with an int8 value (already quantized by its static scale)", "a tensor");
    pr.v_format = DType::i8;
  } else {
    check_dtype(p.value, "value", {DType::f16, DType::bf16});
    check_dtype_as(p.value_cache, "value_cache", p.value.dtype, "value's dtype (int8_k8v16: 16-bit values)");
    pr.v_format = p.value.dtype;
  }
  pr.v_kind = StoreKind::plain;
}

// Sets the store kinds and formats of `pr` for the cache dtype and checks the cache dtypes.
void resolve_cache_dtype(const CacheWriteParams& p, CacheWriteProblem& pr) {
  const KvCacheDType cd = p.cache_dtype;
  const DType kd = p.key.dtype;
  switch (cd) {
    case KvCacheDType::auto_:
      check_dtype_as(p.key_cache, "key_cache", kd, "key's dtype");
      check_dtype_as(p.value_cache, "value_cache", kd, "value's dtype");
      pr.k_kind = pr.v_kind = StoreKind::plain;
      pr.k_format = pr.v_format = kd;
      return;
    case KvCacheDType::fp8_e4m3:
    case KvCacheDType::fp8_e5m2: {
      const DType fmt = cd == KvCacheDType::fp8_e4m3 ? DType::f8e4m3 : DType::f8e5m2;
      check_dtype(p.key_cache, "key_cache", {DType::u8, fmt});
      check_dtype(p.value_cache, "value_cache", {DType::u8, fmt});
      pr.k_kind = pr.v_kind = StoreKind::fp8;
      pr.k_format = pr.v_format = fmt;
      pr.k_scale = fp8_scale("k_scale", p.k_scale, pr.num_kv_heads, cd);
      pr.v_scale = fp8_scale("v_scale", p.v_scale, pr.num_kv_heads, cd);
      return;
    }
    case KvCacheDType::int8_k8v8:
    case KvCacheDType::int8_k8v16:
      check_dtype(p.key_cache, "key_cache", {DType::i8});
      pr.k_format = DType::i8;
      if (kd == DType::i8) {
        resolve_given_int8(p, pr);
      } else if (cd == KvCacheDType::int8_k8v8) {
        pr.k_kind = StoreKind::int8_dynamic;
        check_dtype(p.value_cache, "value_cache", {DType::i8});
        if (!p.v_scale) fail_arg("v_scale", "an fp32 tensor [H_kv, Dv] for kv_cache_dtype int8_k8v8", "none");
        check_dtype(*p.v_scale, "v_scale", {DType::f32});
        check_shape(*p.v_scale, "v_scale", {pr.num_kv_heads, pr.head_dim_v}, "[H_kv, Dv]");
        pr.v_kind = StoreKind::int8_static;
        pr.v_format = DType::i8;
        pr.v_scale = p.v_scale;
      } else {
        pr.k_kind = StoreKind::int8_dynamic;
        check_dtype_as(p.value_cache, "value_cache", kd, "value's dtype");
        pr.v_kind = StoreKind::plain;
        pr.v_format = kd;
      }
      if (!p.k_scale_cache)
        fail_arg("k_scale_cache", cat("an fp32 tensor [num_blocks, H_kv, block_size] for kv_cache_dtype ",
                                      kv_cache_dtype_name(cd)), "none");
      check_dtype(*p.k_scale_cache, "k_scale_cache", {DType::f32});
      check_shape(*p.k_scale_cache, "k_scale_cache", {pr.num_blocks, pr.num_kv_heads, pr.block_size}, "[num_blocks, H_kv, block_size]");
      check_last_contiguous(*p.k_scale_cache, "k_scale_cache");
      pr.k_scale_cache = p.k_scale_cache->permute({0, 2, 1});
      return;
  }
  fail_arg("cache_dtype", "a KvCacheDType", int(cd));
}

}  // namespace

CacheWriteProblem validate_cache_write(const CacheWriteParams& p) {
  const KvCacheDType cd = p.cache_dtype;
  const bool fp8 = cd == KvCacheDType::fp8_e4m3 || cd == KvCacheDType::fp8_e5m2;
  const bool int8 = cd == KvCacheDType::int8_k8v8 || cd == KvCacheDType::int8_k8v16;
  const bool v_scaled = fp8 || cd == KvCacheDType::int8_k8v8;
  CacheWriteProblem pr;
  pr.device = common_device({{"key", &p.key}, {"value", &p.value}, {"key_cache", &p.key_cache},
                             {"value_cache", &p.value_cache}, {"slot_mapping", &p.slot_mapping},
                             {"k_scale", fp8 && p.k_scale ? &*p.k_scale : nullptr},
                             {"v_scale", v_scaled && p.v_scale ? &*p.v_scale : nullptr},
                             {"k_scale_cache", int8 && p.k_scale_cache ? &*p.k_scale_cache : nullptr},
                             {"key_scale", int8 && p.key_scale ? &*p.key_scale : nullptr}});

  check_dtype(p.slot_mapping, "slot_mapping", {DType::i64});
  check_rank(p.slot_mapping, "slot_mapping", 1, "[num_tokens]");
  pr.num_tokens = p.slot_mapping.size(0);

  const bool given_int8 = p.key.dtype == DType::i8;  // rows already quantized (int8 caches only)
  if (int8) check_dtype(p.key, "key", {DType::f16, DType::bf16, DType::f32, DType::i8});
  else check_dtype(p.key, "key", kFloats);
  check_rows("key", p.key, pr.num_tokens);
  if (!given_int8) {
    check_dtype_as(p.value, "value", p.key.dtype, "as key");
    if (p.key_scale) fail_arg("key_scale", "none with a float key (quantized in the call)", "a tensor");
  }
  check_rows("value", p.value, pr.num_tokens);
  pr.num_kv_heads = p.key.size(1);
  pr.head_dim = p.key.size(2);
  pr.head_dim_v = p.value.size(2);
  check_shape(p.value, "value", {-1, pr.num_kv_heads, -1}, "[num_tokens, H_kv, Dv]");

  pr.key_cache = paged_cache("key_cache", p.key_cache, p.layout);
  pr.num_blocks = pr.key_cache.size(0);
  pr.block_size = pr.key_cache.size(1);
  check_cache_shape("key_cache", p.key_cache, p.layout, -1, -1, pr.num_kv_heads, pr.head_dim, "key");
  if (pr.block_size < 1) fail_arg("key_cache", "block_size >= 1", p.key_cache.shape_str());
  pr.value_cache = paged_cache("value_cache", p.value_cache, p.layout);
  check_cache_shape("value_cache", p.value_cache, p.layout, pr.num_blocks, pr.block_size,
                    pr.num_kv_heads, pr.head_dim_v, "key_cache and value");

  resolve_cache_dtype(p, pr);
  pr.key = p.key;
  pr.value = p.value;
  pr.slot_mapping = p.slot_mapping;
  return pr;
}

void check_cache_write_contents(const CacheWriteProblem& pr) {
  const int64_t capacity = pr.num_blocks * pr.block_size;
  for (int64_t i = 0; i < pr.num_tokens; ++i) {
    const int64_t slot = *static_cast<const int64_t*>(pr.slot_mapping.at(i));
    if (slot >= capacity)
      fail_arg("slot_mapping", cat("slots < num_blocks * block_size = ", capacity, " (negative to skip)"),
               cat(slot, " at index ", i));
  }
}

namespace {
void check_mapping_shape(const TensorRef& m) {
  check_dtype(m, "block_mapping", {DType::i64});
  check_rank(m, "block_mapping", 2, "[n, 2]");
  check_shape(m, "block_mapping", {-1, 2}, "[n, 2] rows of (src, dst)");
}
}  // namespace

Device validate_copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping) {
  for (size_t i = 0; i < caches.size(); ++i) {
    const TensorRef& c = caches[i];
    const std::string name = cat("caches[", i, "]");
    if (c.ndim < 1) fail_arg(name, "at least 1 dim [num_blocks, ...]", c.shape_str());
    if (i == 0) continue;
    if (!(c.device == caches[0].device))
      fail_arg(name, cat("device ", to_string(caches[0].device), " (as caches[0])"), to_string(c.device));
    if (c.size(0) != caches[0].size(0))
      fail_arg(name, cat(caches[0].size(0), " blocks in dim 0 (as caches[0])"), c.shape_str());
  }
  if (!caches.empty() && !(block_mapping.device == caches[0].device))
    fail_arg("block_mapping", cat("device ", to_string(caches[0].device), " (as caches[0])"),
             to_string(block_mapping.device));
  check_mapping_shape(block_mapping);
  return caches.empty() ? block_mapping.device : caches[0].device;
}

bool validate_swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping) {
  if (block_mapping.device.type != DeviceType::cpu)
    fail_arg("block_mapping", "device cpu", to_string(block_mapping.device));
  check_mapping_shape(block_mapping);
  if (src.ndim < 1) fail_arg("src", "at least 1 dim [num_blocks, ...]", src.shape_str());
  bool same = dst.ndim == src.ndim;
  std::string want = "[*";
  for (int d = 1; d < src.ndim; ++d) {
    want += cat(", ", src.shape[d]);
    same = same && dst.shape[d] == src.shape[d];
  }
  if (!same) fail_arg("dst", want + "] (block shape as src)", dst.shape_str());
  check_dtype_as(dst, "dst", src.dtype, "as src");
  return src.device.type == DeviceType::cuda || dst.device.type == DeviceType::cuda;
}

void check_block_mapping(const TensorRef& m, int64_t src_blocks, int64_t dst_blocks) {
  for (int64_t i = 0; i < m.size(0); ++i) {
    const int64_t s = *static_cast<const int64_t*>(m.at(i, 0));
    const int64_t d = *static_cast<const int64_t*>(m.at(i, 1));
    if (s < 0 || s >= src_blocks)
      fail_arg("block_mapping", cat("source blocks in [0, ", src_blocks, ")"), cat(s, " at row ", i));
    if (d < 0 || d >= dst_blocks)
      fail_arg("block_mapping", cat("destination blocks in [0, ", dst_blocks, ")"), cat(d, " at row ", i));
  }
}

namespace {
void check_vector(std::string_view name, const TensorRef& t, DType dtype, int64_t rows) {
  check_dtype(t, name, {dtype});
  check_rank(t, name, 1, "[num_seqs]");
  if (t.size(0) < rows) fail_arg(name, cat("at least ", rows, " rows (num_seqs)"), t.shape_str());
}
}  // namespace

Device validate_advance_step(const AdvanceStepParams& p) {
  const Device dev = common_device({{"input_tokens", &p.input_tokens}, {"sampled_token_ids", &p.sampled_token_ids},
                                    {"input_positions", &p.input_positions}, {"seq_lens", &p.seq_lens},
                                    {"slot_mapping", &p.slot_mapping}, {"block_tables", &p.block_tables}});
  if (p.block_size < 1) fail_arg("block_size", ">= 1", p.block_size);
  if (p.num_queries < 0) fail_arg("num_queries", ">= 0", p.num_queries);
  if (p.num_seqs < p.num_queries) fail_arg("num_seqs", cat(">= num_queries (", p.num_queries, ")"), p.num_seqs);
  check_vector("input_tokens", p.input_tokens, DType::i64, p.num_seqs);
  check_vector("input_positions", p.input_positions, DType::i64, p.num_seqs);
  check_vector("seq_lens", p.seq_lens, DType::i32, p.num_seqs);
  check_vector("slot_mapping", p.slot_mapping, DType::i64, p.num_seqs);
  check_dtype(p.sampled_token_ids, "sampled_token_ids", {DType::i64});
  check_rank(p.sampled_token_ids, "sampled_token_ids", 2, "[num_queries, 1]");
  if (p.sampled_token_ids.size(0) < p.num_queries || p.sampled_token_ids.size(1) != 1)
    fail_arg("sampled_token_ids", cat("[>= ", p.num_queries, ", 1] (num_queries)"), p.sampled_token_ids.shape_str());
  check_dtype(p.block_tables, "block_tables", {DType::i32});
  check_rank(p.block_tables, "block_tables", 2, "[num_seqs, max_blocks]");
  check_last_contiguous(p.block_tables, "block_tables");
  if (p.block_tables.size(0) < p.num_seqs)
    fail_arg("block_tables", cat("at least ", p.num_seqs, " rows (num_seqs)"), p.block_tables.shape_str());
  return dev;
}

void check_advance_step_contents(const AdvanceStepParams& p) {
  const int64_t max_blocks = p.block_tables.size(1);
  for (int64_t i = 0; i < p.num_queries; ++i) {
    const int64_t len = *static_cast<const int32_t*>(p.seq_lens.at(i));
    if (len < 0 || len >= std::numeric_limits<int32_t>::max())
      fail_arg("seq_lens", cat("values in [0, ", std::numeric_limits<int32_t>::max() - 1, "]"),
               cat(len, " at index ", i));
    const int64_t block = len / p.block_size;  // the next position is len
    if (block >= max_blocks)
      fail_arg("block_tables", cat("at least ", block + 1, " blocks in row ", i, " for position ", len,
                                   " (block_size ", p.block_size, ")"), cat(max_blocks, " blocks"));
  }
}

Device validate_quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale) {
  const Device dev = common_device({{"x", &x}, {"out", &out}, {"scale", &scale}});
  check_dtype(x, "x", kFloats);
  check_rank(x, "x", 3, "[T, H, D]");
  check_last_contiguous(x, "x");
  check_dtype(out, "out", {DType::i8});
  check_shape(out, "out", {x.size(0), x.size(1), x.size(2)}, "[T, H, D] as x");
  check_last_contiguous(out, "out");
  check_dtype(scale, "scale", {DType::f32});
  check_shape(scale, "scale", {x.size(0), x.size(1)}, "[T, H] as x");
  return dev;
}

}  // namespace flashserve::detail
