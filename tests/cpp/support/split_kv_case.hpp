// The CPU split-KV test cases (test_split_kv.cpp, test_batch_invariant.cpp): random varlen /
// batched, paged / contiguous attention calls over owning host storage, run with a split count
// and compared per sequence.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashserve/attention.hpp"
#include "flashserve/plan.hpp"
#include "support/host_tensor.hpp"

namespace fstest::splitkv {

namespace fs = flashserve;
using fs::DType;
using fstest::HostTensor;

enum class Kv { varlen_contiguous, varlen_paged, batched_paged, batched_contiguous };

struct SeqSpec {
  int64_t sq = 0, sk = 0;
  uint64_t seed = 0;  // the sequence's data: q, k, v, ALiBi slopes, descales
};

struct Config {
  Kv kv = Kv::varlen_contiguous;
  fs::KvLayout layout = fs::KvLayout::nhd;
  int64_t block_size = 16;
  int64_t H = 1, Hkv = 1, D = 64, Dv = 64;
  bool qv = false;             // q_v [.., H, Dv]
  DType dtype = DType::f32;    // q, out (and k, v unless fp8_kv)
  bool fp8_kv = false;         // k, v float8_e4m3fn with k_descale / v_descale
  bool causal = false;
  fs::Window window{};
  int64_t chunk = 0;
  float softcap = 0.0f;
  bool sinks = false, alibi = false, alibi_sqrt = false, cache_batch_idx = false;
  uint64_t seed = 0;           // per-call tensors (the sinks)
  uint64_t placement = 0;      // where KV blocks and rows go
  std::vector<SeqSpec> seqs;
  bool batched() const { return kv == Kv::batched_paged || kv == Kv::batched_contiguous; }
  bool paged() const { return kv == Kv::varlen_paged || kv == Kv::batched_paged; }
};

// A built call over owning storage; unused KV slots and rows hold NaN.
struct Built {
  fs::AttentionParams p;
  std::vector<HostTensor> keep;
  HostTensor out, lse;
  std::vector<int64_t> row0;  // first q row of each sequence (varlen), 0 (batched)
  float max_abs_v = 0.0f;     // of the dequantized v
  Config cfg;
};

// One sequence's results: out [sq, H, Dv], lse [H, sq].
struct SeqOut {
  std::vector<float> out, lse;
};
using Result = std::vector<SeqOut>;

// "varlen_paged NHD bs=16 H=4/2 ..." for failure messages.
std::string describe(const Config& c);

// The call of `c` over owning host storage (unused KV slots and rows NaN).
Built build(const Config& c);

// keep: t owned by bt, its TensorRef returned.
fs::TensorRef keep(Built& bt, const HostTensor& t);

// varlen_attention or kvcache_attention (batched) with bt's params.
void call(const Built& bt, const fs::ExecContext& ctx = {});

// The call with num_splits (out and lse poisoned first): each sequence's out and lse.
Result run(Built& bt, int num_splits, const fs::ExecContext& ctx = {});

bool same_bits(const std::vector<float>& a, const std::vector<float>& b);

// Empty when `got` matches `want` within the tolerances; else the first mismatch.
std::string compare(const Result& got, const Result& want, float out_tol, float lse_tol);

inline constexpr int kFamilies = 8;

// Family: 0 varlen paged NHD, 1 varlen paged HND, 2 varlen contiguous, 3 batched paged,
// 4 batched contiguous, 5 long-KV decode (1.5k-2.1k keys), 6 fp8 KV, 7 MLA decode with q_v.
Config random_config(std::mt19937_64& rng, int family);

// Rounding allowed between split counts: fp32 merging, plus one unit of a 16-bit out dtype.
float out_tolerance(const Built& bt);
inline constexpr float kLseTol = 2e-5f;

// KV granules of the plan the CPU makes for bt's call.
int granules(const Built& bt, const fs::DeviceProps& dev);

}  // namespace fstest::splitkv
