// attn_bench: times flashserve's CUDA attention on named configurations and prints one JSON
// row per configuration on stdout (bench/driver.py builds the specs, merges the rows with the
// peers' and computes the figures; see bench/README.md).
//
//   attn_bench [--device I] [--warmup N] [--min-iters N] [--max-iters N] [--target-s S]
//              [--row-budget-s S] [--seed N] SPEC...
//   SPEC  name=prefill_d128_s2k_causal,op=prefill,B=8,S=2048,H=16,Hkv=16,D=128,causal=1
//         name=prefill_d128_s8k_causal_chunk,op=prefill,B=2,S=8192,H=16,Hkv=16,D=128,causal=1,mod=chunk,W=2048
//         name=decode_b64_l4k_bs16,op=decode,B=64,L=4096,H=32,Hkv=8,D=128,block=16,kv=bf16
//         name=shared_b64_p4k,op=shared_prefix,B=64,L=4352,P=4096,H=32,Hkv=8,D=128,cascade=1
//         name=mixed_b64,op=mixed_step,B=64,L=4096,NP=2,S=2048,C=8192,H=32,Hkv=8,D=128
//
// prefill: varlen_attention, q/k/v [B*S, H(kv), D] bf16 (kv=fp8: q/k/v fp8 e4m3, no descales, out
//          bf16; v and out Dv with Dv=), cu_seqlens every
//          S tokens; mod= one score modifier: sinks, alibi, alibi_sqrt, softcap (30), chunk or
//          window (size W; window (W, 0) causal, (W, W) not). paged=1: k/v in paged NHD caches
//          [blocks, block, Hkv, D(v)] (vLLM's flash_attn_varlen_func with a block table), each
//          sequence's ceil(S / block) blocks shuffled over the pool of every input set.
// decode:  kvcache_attention, q [B, Q, H, D] bf16 (Q = 1 unless given; Q > 1 is a causal
//          verify step), paged NHD caches [blocks, block, Hkv, D] (kv = bf16, fp8 e4m3
//          or fp8e5m2, descales absent; or the vLLM int8 fork's formats, q int8 [B, Q, H, D] with q_scale f32
//          [B, Q, H], k int8 with k_scale_cache f32 [blocks, Hkv, block], v int8 with v_scale
//          f32 [Hkv, D] (kv = k8v8) or bf16 (kv = k8v16); out bf16), block tables shuffled over the pool. mla=1: MLA absorbed decode,
//          q [B, Q, H, 64] + q_v [B, Q, H, 512] over one latent cache [blocks, block, 1, 576]
//          (v = channels 0..511, k = 512..575; Hkv and D are ignored; kv = bf16 or fp8 e4m3,
//          descales absent), out [B, Q, H, 512]. splits=N forces the split-KV count (0: the
//          planner's; the row reports the count used).
// shared_prefix: one decode step of B requests through the backend layer (MetadataBuilder with
//          CUDA metadata, AttentionLayer::forward incl. the cache write), each context the same
//          P-token prefix (shared blocks) plus L - P tokens of its own; cascade=0 keeps the
//          builder on split-KV decode. One input set (the shared prefix is meant to be hot).
// mixed_step: one backend step of B decodes (context L) and NP chunked prefills (S new tokens
//          after C cached ones): the decode part and the prefill part of one forward.
// Inputs are random (never zeros), generated on the host and copied to the device. Input sets
// rotate so that consecutive runs touch different memory (at least 2 sets, and together more
// than 3x the L2). Timing: CUDA events around each call after warm-up; the calls are queued
// behind a host-released gate so that the host's per-call work stays out of the GPU times;
// the median of >= min-iters runs (fewer only when one run exceeds row-budget-s / min-iters,
// and the row says so). Exit status 3: a CUDA error that may have poisoned the context; the
// driver restarts the remaining specs in a fresh process.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/backend.hpp"
#include "flashserve/status.hpp"
#include "kernels/device_info.hpp"
#include "bench_cuda.hpp"

namespace {

using namespace flashserve;
using namespace flashserve::bench;

// ---------------------------------------------------------------- specs

struct Spec {
  std::string name, op, kv = "bf16";
  int64_t B = 0, S = 0, L = 0, H = 0, Hkv = 0, D = 0, block = 16;
  int64_t Q = 1;         // decode: query rows per sequence (speculative verify: > 1, causal)
  int64_t P = 0;         // shared_prefix: tokens every request shares (whole blocks)
  int64_t C = 0, NP = 2; // mixed_step: cached tokens of each of the NP chunked prefills (S new)
  bool causal = false;
  bool cascade = true;   // shared_prefix: let the builder take the cascade path
  std::string mod;       // prefill: a score modifier (see make_prefill), "" for none
  int64_t W = 0;         // prefill: chunk size (mod=chunk) or left window (mod=window)
  int64_t Dv = 0;        // prefill: V head size (0: D; MLA prefill 192/128)
  bool mla = false;      // decode: MLA absorbed decode over a latent cache (D 64 + Dv 512, Hkv 1)
  int64_t splits = 0;    // decode: AttentionParams::num_splits (0: the planner's heuristic)
  bool paged = false;    // prefill: k/v in a paged cache of `block`-token blocks
  bool inv = false;      // decode: batch-invariant mode (AttentionParams::batch_invariant)
};

Spec parse_spec(const std::string& text) {
  Spec s;
  std::map<std::string, std::string> kv;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("spec item without '=': " + item);
    kv[item.substr(0, eq)] = item.substr(eq + 1);
  }
  auto num = [&](const char* key, int64_t& dst) {
    if (auto it = kv.find(key); it != kv.end()) dst = std::stoll(it->second), kv.erase(it);
  };
  auto str = [&](const char* key, std::string& dst) {
    if (auto it = kv.find(key); it != kv.end()) dst = it->second, kv.erase(it);
  };
  int64_t causal = 0, cascade = 1, mla = 0, inv = 0, paged = 0;
  str("name", s.name), str("op", s.op), str("kv", s.kv), str("mod", s.mod);
  num("W", s.W), num("Dv", s.Dv);
  num("B", s.B), num("S", s.S), num("L", s.L), num("H", s.H), num("Hkv", s.Hkv), num("D", s.D);
  num("block", s.block), num("causal", causal), num("P", s.P), num("cascade", cascade);
  num("C", s.C), num("NP", s.NP), num("Q", s.Q), num("mla", mla), num("splits", s.splits), num("inv", inv);
  num("paged", paged);
  s.paged = paged != 0;
  if (s.paged && s.op != "prefill") throw std::invalid_argument("paged=1: op=prefill only (decode is always paged)");
  s.causal = causal != 0;
  s.inv = inv != 0;
  if (s.inv && s.op != "decode") throw std::invalid_argument("inv=1: op=decode only");
  s.mla = mla != 0;
  if (s.mla && (s.op != "decode" || (s.kv != "bf16" && s.kv != "fp8")))
    throw std::invalid_argument("mla=1: op=decode with kv=bf16 or fp8 only");
  if (s.mla) s.Hkv = 1, s.D = 64, s.Dv = 512;
  s.cascade = cascade != 0;
  if (!kv.empty()) throw std::invalid_argument("unknown spec key: " + kv.begin()->first);
  if (s.name.empty()) throw std::invalid_argument("spec without name");
  if (s.op != "prefill" && s.op != "decode" && s.op != "shared_prefix" && s.op != "mixed_step")
    throw std::invalid_argument("op: expected prefill, decode, shared_prefix or mixed_step, got " + s.op);
  if (s.op == "mixed_step" && (s.S <= 0 || s.C < 0 || s.NP < 0))
    throw std::invalid_argument("mixed_step: expected S > 0, C >= 0, NP >= 0");
  if (s.op == "shared_prefix" && (s.P < 0 || s.P % s.block != 0 || s.P >= s.L))
    throw std::invalid_argument("P: expected whole blocks shorter than L, got " + std::to_string(s.P));
  if (s.kv != "bf16" && s.kv != "fp8" && s.kv != "fp8e5m2" && s.kv != "k8v8" && s.kv != "k8v16")
    throw std::invalid_argument("kv: expected bf16, fp8, fp8e5m2, k8v8 or k8v16, got " + s.kv);
  if (s.kv == "fp8e5m2" && (s.op != "decode" || s.mla))
    throw std::invalid_argument("kv=fp8e5m2: op=decode (GQA paged cache) only");
  static const char* const kMods[] = {"", "sinks", "alibi", "alibi_sqrt", "softcap", "chunk", "window"};
  if (std::find(std::begin(kMods), std::end(kMods), s.mod) == std::end(kMods))
    throw std::invalid_argument("mod: expected sinks, alibi, alibi_sqrt, softcap, chunk or window, got " + s.mod);
  if ((s.mod == "chunk" || s.mod == "window") && s.W <= 0)
    throw std::invalid_argument("mod=" + s.mod + ": expected W > 0 (chunk size or left window)");
  if (s.Dv == 0) s.Dv = s.D;
  if (s.op == "prefill" && s.kv != "bf16" && s.kv != "fp8")
    throw std::invalid_argument("op=prefill: kv=bf16 or fp8 (q, k, v e4m3, out bf16) only, got " + s.kv);
  const bool bad = s.Q <= 0 || s.B <= 0 || s.H <= 0 || s.Hkv <= 0 || s.D <= 0 || s.block <= 0 ||
                   (s.op == "prefill" ? s.S <= 0 : s.L <= 0);
  if (bad) throw std::invalid_argument("spec with a non-positive size: " + text);
  return s;
}

// ---------------------------------------------------------------- random inputs

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Random codes with a bounded exponent: never zero, inf or NaN.
// bf16: |x| in [2^-7, 2); fp8 e4m3 and e5m2: |x| in [2^-3, 2); int8: [-127, 127]; f32 (int8 scales):
// [0.5, 1.5) / 127.
// A code of kBits with the sign on top, kMant mantissa bits and the exponent field kExpLo plus
// 0 .. kExpSpan - 1 (a power of two), sign and mantissa from r.
template <int kBits, int kMant, uint32_t kExpLo, uint32_t kExpSpan>
uint32_t random_code(uint64_t r) {
  const uint32_t sign = uint32_t(r) & (1u << (kBits - 1)), exp = kExpLo + (uint32_t(r >> 8) & (kExpSpan - 1));
  return sign | (exp << kMant) | (uint32_t(r >> 16) & ((1u << kMant) - 1));
}
uint16_t random_bf16(uint64_t r) { return uint16_t(random_code<16, 7, 120, 8>(r)); }
uint8_t random_e4m3(uint64_t r) { return uint8_t(random_code<8, 3, 4, 4>(r)); }
uint8_t random_e5m2(uint64_t r) { return uint8_t(random_code<8, 2, 12, 4>(r)); }

// Fills `n` elements of a bf16, fp8, int8 or f32 device buffer through a host staging buffer.
void fill_random(void* dst, int64_t n, DType t, uint64_t seed) {
  const size_t esize = dtype_size(t);
  const int64_t chunk = int64_t(1) << 26;  // elements per staging round (<= 128 MB)
  std::vector<uint8_t> host(size_t(std::min(n, chunk)) * esize);
  for (int64_t base = 0; base < n; base += chunk) {
    const int64_t m = std::min(chunk, n - base);
    uint8_t* h = host.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      const uint64_t r = splitmix64(seed ^ uint64_t(base + i) * 0xD6E8FEB86659FD93ull);
      if (esize == 4) {
        const float v = (0.5f + float(r >> 40) * 0x1p-24f) / 127.0f;
        std::memcpy(h + size_t(i) * 4, &v, 4);
      } else if (esize == 2) {
        const uint16_t v = random_bf16(r);
        std::memcpy(h + size_t(i) * 2, &v, 2);
      } else if (t == DType::i8) {
        h[i] = uint8_t(int8_t(int64_t(r % 255) - 127));
      } else {
        h[i] = t == DType::f8e5m2 ? random_e5m2(r) : random_e4m3(r);
      }
    }
    cuda_ok(cudaMemcpy(static_cast<uint8_t*>(dst) + size_t(base) * esize, h, size_t(m) * esize,
                       cudaMemcpyHostToDevice),
            "cudaMemcpy (inputs)");
  }
}

void upload_i32(void* dst, const std::vector<int32_t>& v) {
  cuda_ok(cudaMemcpy(dst, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy (metadata)");
}

// ---------------------------------------------------------------- cases

// A configuration ready to run: one params per input set, the buffers they point into, and the
// random fills still to do (done after the plan, so an unsupported row costs no fill).
struct BenchCase {
  bool batched = false;
  std::vector<AttentionParams> sets;
  std::vector<DeviceBuffer> buffers;
  struct Fill { void* ptr; int64_t n; DType t; };
  std::vector<Fill> fills;
  TensorRef out0;  // the output of set 0, checked after timing
};

void* alloc(BenchCase& c, size_t bytes) {
  c.buffers.emplace_back(bytes);
  return c.buffers.back().get();
}

void* alloc_random(BenchCase& c, int64_t n, DType t) {
  void* p = alloc(c, size_t(n) * dtype_size(t));
  c.fills.push_back({p, n, t});
  return p;
}

// Input sets: at least 2, and together more than 3x the L2, within `budget` bytes.
int choose_sets(size_t set_bytes, size_t l2_bytes, size_t budget) {
  const size_t want = std::max<size_t>(2, (3 * l2_bytes + set_bytes - 1) / std::max<size_t>(set_bytes, 1));
  const size_t fit = std::max<size_t>(1, budget / std::max<size_t>(set_bytes, 1));
  return int(std::min<size_t>({want, fit, 64}));
}

size_t prefill_set_bytes(const Spec& s) {
  const size_t tokens = size_t(s.B * s.S), in = s.kv == "fp8" ? 1 : 2;
  return tokens * (size_t(s.H * s.D + s.Hkv * (s.D + s.Dv)) * in + size_t(s.H * s.Dv) * 2);
}

// prefill's q/k/v type: bf16, or fp8 e4m3 for kv=fp8 (vLLM's and SGLang's prefill over an fp8
// cache quantizes q too; descales absent, = 1).
DType prefill_input_type(const Spec& s) { return s.kv == "fp8" ? DType::f8e4m3 : DType::bf16; }

// The modifier's parameters (the same in every input set): sinks f32 [H] in [-2, 2), ALiBi
// slopes f32 [H] = 2^(-8 (h + 1) / H) (the ALiBi paper's), soft-cap 30, chunk or left window W.
void set_modifier(const Spec& s, BenchCase& c, AttentionParams& p, Device dev) {
  if (s.mod == "sinks" || s.mod == "alibi" || s.mod == "alibi_sqrt") {
    std::vector<float> v(static_cast<size_t>(s.H));
    for (int64_t h = 0; h < s.H; ++h)
      v[size_t(h)] = s.mod == "sinks" ? float(int64_t(splitmix64(uint64_t(h)) % 4096) - 2048) / 1024.0f
                                      : std::exp2(-8.0f * float(h + 1) / float(s.H));
    void* d = alloc(c, v.size() * 4);
    cuda_ok(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy (modifier)");
    const TensorRef t = TensorRef::contiguous(d, DType::f32, {s.H}, dev);
    if (s.mod == "sinks") p.s_aux = t;
    else p.alibi_slopes = t, p.alibi_sqrt = s.mod == "alibi_sqrt";
  } else if (s.mod == "softcap") {
    p.softcap = 30.0f;
  } else if (s.mod == "chunk") {
    p.chunk_size = s.W;
  } else if (s.mod == "window") {
    p.window = {int(s.W), s.causal ? 0 : int(s.W)};
  }
}

size_t decode_set_bytes(const Spec& s) {
  const size_t blocks = size_t(s.B * ((s.L + s.block - 1) / s.block));
  if (s.mla)  // the latent cache, q + q_v and out
    return blocks * size_t(s.block) * 576 * (s.kv == "fp8" ? 1 : 2) + size_t(s.B * s.Q * s.H) * (64 + 2 * 512) * 2 +
           blocks * 4;
  const bool int8 = s.kv == "k8v8" || s.kv == "k8v16";
  const size_t k_elem = s.kv == "bf16" ? 2 : 1, v_elem = s.kv == "bf16" || s.kv == "k8v16" ? 2 : 1;
  const size_t kv = blocks * size_t(s.block * s.Hkv) * (size_t(s.D) * (k_elem + v_elem) + (int8 ? 4 : 0));
  return kv + size_t(s.B * s.Q * s.H) * (size_t(s.D) * 4 + (int8 ? 4 : 0)) + blocks * 4;
}

// A shuffled permutation of a pool of `pool` blocks; set i's block table [B, per_seq] is its
// slice i (uploaded once, device memory owned by c).
std::vector<int32_t> shuffled_blocks(int64_t pool, uint64_t seed) {
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed));
  return perm;
}

TensorRef block_table_of(BenchCase& c, const std::vector<int32_t>& perm, int i, int64_t B, int64_t per_seq,
                         Device dev) {
  void* table = alloc(c, size_t(B * per_seq) * 4);
  const auto first = perm.begin() + int64_t(i) * B * per_seq;
  upload_i32(table, std::vector<int32_t>(first, first + B * per_seq));
  return TensorRef::contiguous(table, DType::i32, {B, per_seq}, dev);
}

// paged=1: k and v of every input set in one pool of blocks (NHD), each set's block table
// [B, ceil(S / block)] a slice of a shuffled permutation of the pool.
void set_paged_kv(const Spec& s, int nsets, Device dev, uint64_t seed, BenchCase& c) {
  const int64_t per_seq = (s.S + s.block - 1) / s.block, pool = int64_t(nsets) * s.B * per_seq;
  const DType t = prefill_input_type(s);
  const TensorRef k =
      TensorRef::contiguous(alloc_random(c, pool * s.block * s.Hkv * s.D, t), t, {pool, s.block, s.Hkv, s.D}, dev);
  const TensorRef v =
      TensorRef::contiguous(alloc_random(c, pool * s.block * s.Hkv * s.Dv, t), t, {pool, s.block, s.Hkv, s.Dv}, dev);
  const std::vector<int32_t> perm = shuffled_blocks(pool, seed);
  for (int i = 0; i < nsets; ++i) {
    AttentionParams& p = c.sets[size_t(i)];
    p.k = k;
    p.v = v;
    p.block_table = block_table_of(c, perm, i, s.B, per_seq, dev);
  }
}

BenchCase make_prefill(const Spec& s, int nsets, Device dev, uint64_t seed) {
  BenchCase c;
  const int64_t tokens = s.B * s.S;
  std::vector<int32_t> cu(static_cast<size_t>(s.B + 1));
  for (int64_t b = 0; b <= s.B; ++b) cu[size_t(b)] = int32_t(b * s.S);
  void* cu_dev = alloc(c, cu.size() * 4);
  upload_i32(cu_dev, cu);
  const TensorRef cu_ref = TensorRef::contiguous(cu_dev, DType::i32, {s.B + 1}, dev);
  for (int i = 0; i < nsets; ++i) {
    AttentionParams p;
    const DType t = prefill_input_type(s);
    auto random_tensor = [&](int64_t heads, int64_t d) {
      return TensorRef::contiguous(alloc_random(c, tokens * heads * d, t), t, {tokens, heads, d}, dev);
    };
    p.q = random_tensor(s.H, s.D);
    if (!s.paged) {
      p.k = random_tensor(s.Hkv, s.D);
      p.v = random_tensor(s.Hkv, s.Dv);
    }
    p.out = TensorRef::contiguous(alloc(c, size_t(tokens * s.H * s.Dv) * 2), DType::bf16, {tokens, s.H, s.Dv}, dev);
    p.cu_seqlens_q = cu_ref;
    p.cu_seqlens_k = cu_ref;
    p.max_seqlen_q = s.S;
    p.max_seqlen_k = s.S;
    p.causal = s.causal;
    set_modifier(s, c, p, dev);
    c.sets.push_back(p);
  }
  if (s.paged) set_paged_kv(s, nsets, dev, seed, c);
  c.out0 = c.sets[0].out;
  return c;
}

BenchCase make_decode(const Spec& s, int nsets, Device dev, uint64_t seed) {
  BenchCase c;
  c.batched = true;
  const bool int8 = s.kv == "k8v8" || s.kv == "k8v16";
  const DType kv_t = s.kv == "fp8"       ? DType::f8e4m3
                     : s.kv == "fp8e5m2" ? DType::f8e5m2
                     : int8              ? DType::i8
                                         : DType::bf16;
  const DType v_t = s.kv == "k8v16" ? DType::bf16 : kv_t, q_t = int8 ? DType::i8 : DType::bf16;
  const int64_t per_seq = (s.L + s.block - 1) / s.block;
  const int64_t pool = int64_t(nsets) * s.B * per_seq;
  const int64_t cache_elems = pool * s.block * s.Hkv * s.D;
  TensorRef k_ref, v_ref;
  if (s.mla) {  // one latent cache: v = channels 0..511, k = 512..575 of each 576-element row
    char* latent = static_cast<char*>(alloc_random(c, pool * s.block * 576, kv_t));
    v_ref = TensorRef::strided(latent, kv_t, {pool, s.block, 1, 512}, {s.block * 576, 576, 576, 1}, dev);
    k_ref = TensorRef::strided(latent + 512 * dtype_size(kv_t), kv_t, {pool, s.block, 1, 64},
                               {s.block * 576, 576, 576, 1}, dev);
  } else {
    void* k = alloc_random(c, cache_elems, kv_t);
    void* v = alloc_random(c, cache_elems, v_t);
    k_ref = TensorRef::contiguous(k, kv_t, {pool, s.block, s.Hkv, s.D}, dev);
    v_ref = TensorRef::contiguous(v, v_t, {pool, s.block, s.Hkv, s.D}, dev);
  }
  OptTensor k_scale_cache, v_scale;  // int8: the fork's [blocks, Hkv, block] and [Hkv, D]
  if (int8) {
    k_scale_cache = TensorRef::contiguous(alloc_random(c, pool * s.Hkv * s.block, DType::f32), DType::f32,
                                          {pool, s.Hkv, s.block}, dev);
    if (s.kv == "k8v8")
      v_scale = TensorRef::contiguous(alloc_random(c, s.Hkv * s.D, DType::f32), DType::f32, {s.Hkv, s.D}, dev);
  }

  const std::vector<int32_t> perm = shuffled_blocks(pool, seed);
  void* lens = alloc(c, size_t(s.B) * 4);
  upload_i32(lens, std::vector<int32_t>(size_t(s.B), int32_t(s.L)));
  for (int i = 0; i < nsets; ++i) {
    AttentionParams p;
    p.q = TensorRef::contiguous(alloc_random(c, s.B * s.Q * s.H * s.D, q_t), q_t, {s.B, s.Q, s.H, s.D}, dev);
    if (int8) {
      p.q_scale = TensorRef::contiguous(alloc_random(c, s.B * s.Q * s.H, DType::f32), DType::f32, {s.B, s.Q, s.H},
                                        dev);
      p.k_scale_cache = k_scale_cache;
      p.v_scale = v_scale;
    }
    p.out = TensorRef::contiguous(alloc(c, size_t(s.B * s.Q * s.H * s.Dv) * 2), DType::bf16, {s.B, s.Q, s.H, s.Dv},
                                  dev);
    if (s.mla)
      p.q_v = TensorRef::contiguous(alloc_random(c, s.B * s.Q * s.H * s.Dv, DType::bf16), DType::bf16,
                                    {s.B, s.Q, s.H, s.Dv}, dev);
    p.causal = s.Q > 1;
    p.num_splits = int(s.splits);
    p.batch_invariant = s.inv;
    p.k = k_ref;
    p.v = v_ref;
    p.block_table = block_table_of(c, perm, i, s.B, per_seq, dev);
    p.seqused_k = TensorRef::contiguous(lens, DType::i32, {s.B}, dev);
    c.sets.push_back(p);
  }
  c.out0 = c.sets[0].out;
  return c;
}

// ---------------------------------------------------------------- backend step (shared prefix)

struct StepCase {
  BenchCase c;  // the buffers
  backend::BuilderConfig config;
  std::unique_ptr<backend::MetadataBuilder> builder;
  std::unique_ptr<backend::AttentionLayer> layer;
  const backend::AttentionMetadata* md = nullptr;
  backend::KvCache cache;
  TensorRef q, key, value, out;
  std::vector<int32_t> qsl, seq_lens;
};

// One backend step over a paged cache: request r has q_lens[r] new tokens ending its context of
// seq_lens[r] (decodes first); the first `prefix` tokens (whole blocks) of every context share
// blocks, the others are each request's own, shuffled over the pool.
std::unique_ptr<StepCase> make_step_case(const Spec& s, const std::vector<int32_t>& q_lens,
                                         const std::vector<int32_t>& seq_lens, int64_t prefix, Device dev,
                                         const DeviceProps& props, cudaStream_t stream, uint64_t seed) {
  auto st = std::make_unique<StepCase>();
  BenchCase& c = st->c;
  const int64_t R = int64_t(q_lens.size()), bs = s.block, shared = prefix / bs;
  const int64_t T = std::accumulate(q_lens.begin(), q_lens.end(), int64_t(0));
  int64_t width = 0, owned = 0;
  for (int32_t len : seq_lens) width = std::max<int64_t>(width, (len + bs - 1) / bs), owned += (len + bs - 1) / bs - shared;
  const int64_t pool = shared + owned, cache_elems = pool * bs * s.Hkv * s.D;
  st->cache.key_cache = TensorRef::contiguous(alloc_random(c, cache_elems, DType::bf16), DType::bf16,
                                              {pool, bs, s.Hkv, s.D}, dev);
  st->cache.value_cache = TensorRef::contiguous(alloc_random(c, cache_elems, DType::bf16), DType::bf16,
                                                {pool, bs, s.Hkv, s.D}, dev);
  std::vector<int32_t> own_ids(static_cast<size_t>(owned));
  std::iota(own_ids.begin(), own_ids.end(), int32_t(shared));
  std::shuffle(own_ids.begin(), own_ids.end(), std::mt19937_64(seed));
  std::vector<int32_t> table(static_cast<size_t>(R * width), 0);
  std::vector<int64_t> slots;
  st->qsl.assign(1, 0);
  for (int64_t r = 0, next = 0; r < R; ++r) {
    const int64_t len = seq_lens[size_t(r)], q = q_lens[size_t(r)];
    for (int64_t j = 0; j < (len + bs - 1) / bs; ++j)
      table[size_t(r * width + j)] = j < shared ? int32_t(j) : own_ids[size_t(next++)];
    for (int64_t pos = len - q; pos < len; ++pos)
      slots.push_back(int64_t(table[size_t(r * width + pos / bs)]) * bs + pos % bs);
    st->qsl.push_back(st->qsl.back() + int32_t(q));
  }
  void* table_dev = alloc(c, table.size() * 4);
  upload_i32(table_dev, table);
  void* slots_dev = alloc(c, slots.size() * 8);
  cuda_ok(cudaMemcpy(slots_dev, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy (slots)");
  auto random_rows = [&](int64_t heads) {
    return TensorRef::contiguous(alloc_random(c, T * heads * s.D, DType::bf16), DType::bf16, {T, heads, s.D}, dev);
  };
  st->q = random_rows(s.H), st->key = random_rows(s.Hkv), st->value = random_rows(s.Hkv);
  st->out = TensorRef::contiguous(alloc(c, size_t(T * s.H * s.D) * 2), DType::bf16, {T, s.H, s.D}, dev);
  c.out0 = st->out;

  backend::LayerSpec& spec = st->config.layer;
  spec.num_heads = s.H, spec.num_kv_heads = s.Hkv, spec.head_size = s.D, spec.dtype = DType::bf16;
  st->config.block_size = bs;
  st->config.enable_cascade = s.cascade;
  st->config.device = props;
  st->config.max_num_reqs = R;
  st->config.max_num_tokens = T;
  st->config.max_blocks_per_req = width;
  st->config.stream = stream;
  st->builder = std::make_unique<backend::MetadataBuilder>(st->config);
  st->layer = std::make_unique<backend::AttentionLayer>(spec);
  st->seq_lens = seq_lens;
  backend::CommonMetadata cm;
  cm.num_reqs = R;
  cm.num_actual_tokens = T;
  cm.max_query_len = *std::max_element(q_lens.begin(), q_lens.end());
  cm.max_seq_len = *std::max_element(seq_lens.begin(), seq_lens.end());
  cm.query_start_loc = st->qsl;
  cm.seq_lens = st->seq_lens;
  cm.block_table = TensorRef::contiguous(table_dev, DType::i32, {R, width}, dev);
  cm.slot_mapping = TensorRef::contiguous(slots_dev, DType::i64, {T}, dev);
  st->md = &st->builder->build(cm, prefix);
  return st;
}

// The requests of a step spec: shared_prefix, B decodes of context L sharing P tokens;
// mixed_step, B decodes of context L then NP chunked prefills of S new tokens on C cached ones.
std::unique_ptr<StepCase> make_step_spec(const Spec& s, Device dev, const DeviceProps& props, cudaStream_t stream,
                                         uint64_t seed) {
  std::vector<int32_t> q_lens(size_t(s.B), 1), seq_lens(size_t(s.B), int32_t(s.L));
  if (s.op == "mixed_step")
    for (int64_t i = 0; i < s.NP; ++i) q_lens.push_back(int32_t(s.S)), seq_lens.push_back(int32_t(s.C + s.S));
  return make_step_case(s, q_lens, seq_lens, s.op == "shared_prefix" ? s.P : 0, dev, props, stream, seed);
}

// ---------------------------------------------------------------- rows

std::string json_str(const std::string& s) {
  constexpr const char* kHex = "0123456789abcdef";
  std::string r = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') r += '\\', r += ch;
    else if (static_cast<unsigned char>(ch) < 0x20) r += detail::cat("\\u00", kHex[(ch >> 4) & 15], kHex[ch & 15]);
    else r += ch;
  }
  return r + "\"";
}

struct Row {
  std::string config, status = "error", kernel = "unknown", note, error, out_check;
  Timing t;
  int sets = 0, num_splits = 0;

  void print() const {
    std::ostringstream os;
    os.precision(6);
    os << "{\"config\": " << json_str(config) << ", \"peer\": \"flashserve\", \"status\": " << json_str(status)
       << ", \"kernel\": " << json_str(kernel);
    if (status == "ok")
      os << ", \"time_ms\": " << t.median_ms << ", \"time_min_ms\": " << t.min_ms << ", \"time_max_ms\": " << t.max_ms
         << ", \"runs\": " << t.runs << ", \"sets\": " << sets << ", \"num_splits\": " << num_splits
         << ", \"out_check\": " << json_str(out_check);
    const std::string n = t.note.empty() ? note : (note.empty() ? t.note : note + "; " + t.note);
    if (!n.empty()) os << ", \"note\": " << json_str(n);
    if (!error.empty()) os << ", \"error\": " << json_str(error);
    os << "}\n";
    std::fputs(os.str().c_str(), stdout);
    std::fflush(stdout);
  }
};

std::string served_by(const AttentionParams& p, bool batched, const DeviceProps& dev) {
  return attention_kernel_name(p, batched, dev);
}

struct Options {
  int device = 0;
  uint64_t seed = 0x5EED;
  TimingOptions timing;
  std::vector<std::string> specs;
};

// One attention call (op prefill / decode), timed over rotating input sets.
void run_attention(const Spec& s, const Options& o, const cudaDeviceProp& prop, const DeviceProps& props,
                   cudaStream_t stream, Row& row) {
  const Device dev{DeviceType::cuda, o.device};
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const size_t budget = free_b / 10 * 7;
  const bool decode = s.op == "decode";
  const size_t set_bytes = decode ? decode_set_bytes(s) : prefill_set_bytes(s);
  const int nsets = choose_sets(set_bytes, size_t(prop.l2CacheSize), budget);
  if (set_bytes * size_t(nsets) > budget)
    throw std::invalid_argument(detail::cat("inputs of ", set_bytes >> 20, " MiB do not fit in ", budget >> 20, " MiB"));
  const uint64_t seed = splitmix64(o.seed ^ std::hash<std::string>{}(s.name));
  BenchCase c = decode ? make_decode(s, nsets, dev, seed) : make_prefill(s, nsets, dev, seed);
  row.sets = nsets;
  const Plan plan = c.batched ? plan_kvcache_attention(c.sets[0], props) : plan_varlen_attention(c.sets[0], props);
  row.kernel = served_by(c.sets[0], c.batched, props);
  row.num_splits = plan.num_splits;
  DeviceBuffer workspace(plan.workspace.total_bytes);
  for (size_t i = 0; i < c.fills.size(); ++i)
    fill_random(c.fills[i].ptr, c.fills[i].n, c.fills[i].t, splitmix64(seed + i));
  ExecContext ctx;
  ctx.stream = stream;
  ctx.workspace = workspace.get();
  ctx.workspace_bytes = workspace.bytes();
  ctx.plan = &plan;
  auto call = [&](int set) {
    if (c.batched) kvcache_attention(c.sets[size_t(set)], ctx);
    else varlen_attention(c.sets[size_t(set)], ctx);
  };
  row.t = time_calls(call, nsets, stream, o.timing);
  row.out_check = check_output(c.out0);
  row.status = "ok";
}

// One backend step (op shared_prefix / mixed_step): the builder's metadata, then
// AttentionLayer::forward (cache write included), timed.
void run_step(const Spec& s, const Options& o, const DeviceProps& props, cudaStream_t stream, Row& row) {
  const Device dev{DeviceType::cuda, o.device};
  const uint64_t seed = splitmix64(o.seed ^ std::hash<std::string>{}(s.name));
  std::unique_ptr<StepCase> st = make_step_spec(s, dev, props, stream, seed);
  for (size_t i = 0; i < st->c.fills.size(); ++i)
    fill_random(st->c.fills[i].ptr, st->c.fills[i].n, st->c.fills[i].t, splitmix64(seed + i));
  const backend::AttentionMetadata& md = *st->md;
  row.kernel = md.cascade.enabled ? "cascade" : md.prefill.empty() ? "decode" : "decode+prefill";
  row.num_splits = md.cascade.enabled ? md.cascade.suffix.plan.num_splits : md.decode.plan.num_splits;
  row.sets = 1;
  DeviceBuffer ws(st->layer->workspace_bytes(st->config));
  const backend::LayerWorkspace lw{ws.get(), ws.bytes(), dev};
  ExecContext ctx;
  ctx.stream = stream;
  auto call = [&](int) { st->layer->forward(md, st->q, st->key, st->value, &st->cache, st->out, lw, ctx); };
  row.t = time_calls(call, 1, stream, o.timing);
  row.out_check = check_output(st->out);
  row.status = "ok";
}

// Runs one spec; returns false when a CUDA error may have poisoned the context.
bool run_spec(const std::string& text, const Options& o, const cudaDeviceProp& prop, cudaStream_t stream) {
  Row row;
  row.config = text.substr(0, text.find(','));
  if (row.config.rfind("name=", 0) == 0) row.config = row.config.substr(5);
  try {
    const Spec s = parse_spec(text);
    row.config = s.name;
    const DeviceProps props = kernels::cuda_device_props(o.device);
    if (s.op == "shared_prefix" || s.op == "mixed_step") {
      run_step(s, o, props, stream, row);
    } else {
      run_attention(s, o, prop, props, stream, row);
    }
  } catch (const NotImplemented& e) {
    row.status = "not_implemented", row.error = e.what();
  } catch (const Error& e) {
    row.error = std::string("invalid argument: ") + e.what();
  } catch (const std::exception& e) {  // CudaFailure, RuntimeError (CUDA errors) and the rest
    row.error = e.what();
  }
  // A failed allocation clears; a kernel fault stays and poisons the context.
  cudaGetLastError();
  const bool healthy = cudaDeviceSynchronize() == cudaSuccess;
  if (!healthy) row.note = "CUDA error: the driver restarts the remaining specs in a fresh process";
  row.print();
  return healthy;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--device") o.device = std::stoi(value());
    else if (a == "--warmup") o.timing.warmup = std::stoi(value());
    else if (a == "--min-iters") o.timing.min_iters = std::stoi(value());
    else if (a == "--max-iters") o.timing.max_iters = std::stoi(value());
    else if (a == "--target-s") o.timing.target_s = std::stod(value());
    else if (a == "--row-budget-s") o.timing.row_budget_s = std::stod(value());
    else if (a == "--seed") o.seed = std::stoull(value());
    else if (a.rfind("--", 0) == 0) throw std::invalid_argument("unknown option " + a);
    else o.specs.push_back(a);
  }
  o.timing.max_iters = std::max(o.timing.max_iters, o.timing.min_iters);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attn_bench: %s\nusage: attn_bench [options] name=..,op=prefill|decode,.. ...\n", e.what());
    return 2;
  }
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;
  try {
    cuda_ok(cudaSetDevice(o.device), "cudaSetDevice");
    cuda_ok(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties");
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attn_bench: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "attn_bench: %s, %d SMs, L2 %d MB, %zu specs\n", prop.name, prop.multiProcessorCount,
               prop.l2CacheSize >> 20, o.specs.size());
  for (const std::string& spec : o.specs)
    if (!run_spec(spec, o, prop, stream)) return 3;
  cudaStreamDestroy(stream);
  return 0;
}
