// The CPU reference against the independent fp64 oracle over >= 500 random configurations:
// every batch description (varlen contiguous / seqused / paged NHD and HND, batched paged and
// contiguous, cache_batch_idx), strided views, GQA, head sizes incl. MLA, every score modifier,
// split counts, float/fp8/int8 operands, zero-length and fully masked sequences.
// Reproduce a failure with FLASHSERVE_SEED=<seed> FLASHSERVE_FUZZ_CASE=<case>.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include "naive/attention_case.hpp"

namespace {

constexpr uint64_t kSalt = 0xa77e471f0221ull;
constexpr int kCases = 520;
constexpr int kMaxReported = 5;

// The features every run must have exercised (each is drawn with probability >= ~3%).
const char* const kRequiredTags[] = {
    "varlen_contiguous", "varlen_seqused", "varlen_paged", "varlen_paged_cu_seqlens_k", "batched_paged",
    "batched_contiguous", "cache_batch_idx", "no_cache_batch_idx", "no_cache_seqlens", "paged_nhd", "paged_hnd",
    "bs=1", "bs=2", "bs=5", "bs=16", "bs=32", "bs=64", "random_block_ids", "table_row_slice",
    "group=1", "group=2", "group=3", "group=4", "group=8", "group=16", "mqa", "D=40", "D=72", "D=80", "D=256",
    "mla_192_128", "mla_qv_512", "quant=none", "quant=fp8_kv", "quant=fp8_qkv", "quant=int8_k8v8",
    "quant=int8_k8v16", "q=float32", "q=float16", "q=bfloat16", "q=float8_e4m3fn", "q=float8_e5m2", "q=int8",
    "kv=float8_e4m3fn", "kv=float8_e5m2", "out=bfloat16", "descale_broadcast", "kv_interleaved", "q_padded",
    "out_padded", "causal", "window", "window_left_unbounded", "chunk", "softcap", "alibi_h", "alibi_bh",
    "alibi_sqrt", "sinks", "lse", "splits=0", "splits=1", "splits=2", "splits=3", "splits=7", "sq=0", "sk=0",
    "sq>sk", "sq>sk_causal", "long_sequence"};

// One case: returns an empty string when it agrees with the oracle.
std::string run_one(int index, fstest::CaseConfig& cfg) {
  auto rng = fstest::make_rng(kSalt + uint64_t(index) * 0x9e3779b97f4a7c15ull);
  cfg = fstest::random_case_config(rng);
  fstest::AttentionCase ac = fstest::build_case(cfg, rng);
  try {
    fstest::run_case(ac);
  } catch (const std::exception& e) {
    return std::string("the call threw: ") + e.what();
  }
  return fstest::check_case(ac);
}

}  // namespace

TEST(AttentionFuzz, ReferenceMatchesOracle) {
  const auto t0 = std::chrono::steady_clock::now();
  int first = 0, last = kCases;
  if (const char* one = std::getenv("FLASHSERVE_FUZZ_CASE")) first = std::atoi(one), last = first + 1;
  std::map<std::string, int> coverage;
  int ran = 0, failed = 0;
  for (int i = first; i < last && failed < kMaxReported; ++i) {
    fstest::CaseConfig cfg;
    const std::string err = run_one(i, cfg);
    ++ran;
    for (const std::string& tag : fstest::coverage_tags(cfg)) ++coverage[tag];
    if (err.empty()) continue;
    ++failed;
    ADD_FAILURE() << "case " << i << " (rerun: FLASHSERVE_SEED=" << fstest::test_seed()
                  << " FLASHSERVE_FUZZ_CASE=" << i << ")\n  " << fstest::describe(cfg) << "\n" << err;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[fuzz] %d cases in %.1f s, %d failed\n", ran, secs, failed);
  if (last - first == 1 || failed > 0) return;  // a reproduced case, or stopped early
  EXPECT_GE(ran, 500);
  std::set<std::string> missing;
  for (const char* tag : kRequiredTags)
    if (coverage[tag] == 0) missing.insert(tag);
  std::string list;
  for (const auto& m : missing) list += " " + m;
  EXPECT_TRUE(missing.empty()) << "features never drawn in " << ran << " cases:" << list;
}
