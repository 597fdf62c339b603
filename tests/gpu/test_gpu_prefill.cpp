// The tensor-core prefill kernels (kernels/attention/prefill_fwd.cuh: mma.sync, sm80+;
// prefill_wgmma.cuh: wgmma, sm_90a) against the fp64 oracle (tests/cpp/naive: 2 output
// roundings + 4 eps of the head's max |v|, plus tanh.approx's bound on soft-capped rows) and
// the CPU reference run under the same plan (relative error ||out - ref|| / ||ref|| < 1e-2: P
// is rounded to the operand dtype before the PV product). Every case first checks which kernel the selection picks: bf16 D = 128 (built in
// every configuration) must get "prefill_wgmma" on a 9.0 device of an sm_90a build, else
// "prefill_mma" (prefill_tma, hopper_kernel, for contiguous K/V and paged caches of its block
// sizes); ctest also runs this binary with FLASHSERVE_DISABLE_KERNELS=prefill_wgmma,prefill_tma
// (prefix mma80.), so the portable kernel is tested on Hopper too, and with prefill_tma taken
// out (prefix wgmma.), so prefill_wgmma keeps serving every case there. f16, D = 64 and D = 256 may
// be served by the generic kernel in dev builds; D = 96, 192 and 192/128 must get prefill_tma
// (contiguous K/V, paged caches of the block sizes prefill_tma_block_size_ok takes) or
// prefill_wgmma (other block sizes) on Hopper in every build (generic elsewhere).
// Varlen batches with uneven lengths, causal / non-causal, GQA 1..8, paged caches of any block
// size, splits, the score modifiers (window, soft-cap, sinks, ALiBi linear and sqrt, chunked
// local attention), context parallelism, fully masked rows and zero-length sequences; problems
// outside the kernels' scope must fall back to the generic kernel. ctest runs the binary again
// with prefill_tma's persistent form forced on (prefix persistent.) and off (prefix onecta.).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_attention_case.hpp"
#include "kernels/attention/select.hpp"

using flashserve::DType;
using fstest::CaseConfig;
using fstest::KvMode;
namespace fs = flashserve;

namespace {

// A bf16 D = 128 prefill configuration (the kernel's always-built case) with LSE.
CaseConfig prefill_config(KvMode mode, std::vector<int64_t> q_lens, std::vector<int64_t> k_lens, int64_t H,
                          int64_t H_kv) {
  return fsgpu::prefill_case_config(mode, std::move(q_lens), std::move(k_lens), H, H_kv, DType::bf16);
}

// The tensor-core prefill kernel the selection must pick for bf16 D = 128 on device 0.
std::string expected_prefill_kernel() {
  const bool wgmma_off = fs::kernels::kernel_disabled(fs::kernels::AttnKernelId::prefill_wgmma);
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  const bool hopper = FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0;
  return hopper && !wgmma_off ? "prefill_wgmma" : "prefill_mma";
}

// Whether prefill_tma serves the case's K/V: contiguous, or paged with a block size it takes
// (a multiple of 16 dividing its key tile or divided by it: 16, 32, 64, 128, 256; not 1 or 80).
bool tma_kv(const CaseConfig& c) {
  return !c.paged() || fs::kernels::prefill_tma_block_size_ok(c.D, c.Dv ? c.Dv : c.D, c.block_size);
}

// The Hopper kernel of a case the wgmma family serves: prefill_tma for its K/V (tma_kv) where
// built (and not disabled), prefill_wgmma otherwise.
std::string hopper_kernel(const CaseConfig& c) {
  const bool tma = tma_kv(c) && fs::kernels::prefill_tma_config_built(c.q_dtype, c.D, c.Dv ? c.Dv : c.D) &&
                   !fs::kernels::kernel_disabled(fs::kernels::AttnKernelId::prefill_tma);
  return tma ? "prefill_tma" : "prefill_wgmma";
}

// Runs the case on the CPU (reference, GPU plan) and the GPU; returns "" when the GPU agrees
// with the oracle and the reference (relative error < 1e-2). `kernel` receives the selected
// kernel's name; a positive `split_granularity` replaces the plan's (both runs use the plan).
std::string run_and_check(fstest::AttentionCase& ac, std::string& kernel, int split_granularity = 0) {
  return fsgpu::check_prefill_case(ac, kernel, 1e-2, false, split_granularity);
}

// Builds the case from `salt`, checks it (run_and_check) and returns the kernel that served it.
std::string expect_case_matches(const CaseConfig& c, uint64_t salt) {
  auto rng = fstest::make_rng(salt);
  fstest::AttentionCase ac = fstest::build_case(c, rng);
  std::string kernel;
  EXPECT_EQ(run_and_check(ac, kernel), "") << fstest::describe(c) << "\n(seed " << fstest::test_seed() << ")";
  return kernel;
}

// Checks the case; bf16 D = 128 cases must be served by the expected tensor-core kernel
// (prefill_mma declines fp32 out, which needs P to fp32 precision: the generic kernel serves it).
void expect_prefill_matches(const CaseConfig& c, uint64_t salt) {
  const std::string kernel = expect_case_matches(c, salt);
  const std::string expected = expected_prefill_kernel();
  if (c.q_dtype == DType::bf16 && c.D == 128 && (c.out_dtype == c.q_dtype || expected == "prefill_wgmma"))
    EXPECT_EQ(kernel, expected == "prefill_wgmma" ? hopper_kernel(c) : expected) << fstest::describe(c);
  if (c.out_dtype == DType::f32) EXPECT_NE(kernel, "prefill_mma") << fstest::describe(c);
}

// The kernel that must serve a bf16 case of D = 96, 192 or 192/128 (built for both Hopper kernels
// in every configuration): on a 9.0 device of an sm_90a build prefill_tma for contiguous K/V and
// paged caches of its block sizes (tma_kv), prefill_wgmma for other paged caches (and for any
// with prefill_tma disabled); else, or with the kernel disabled, the generic kernel (no
// prefill_mma instantiation of these sizes).
std::string head_dims_kernel(const CaseConfig& c) {
  using fs::kernels::AttnKernelId;
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  if (!(FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0)) return "generic";
  if (tma_kv(c) && !fs::kernels::kernel_disabled(AttnKernelId::prefill_tma)) return "prefill_tma";
  return fs::kernels::kernel_disabled(AttnKernelId::prefill_wgmma) ? "generic" : "prefill_wgmma";
}

}  // namespace

TEST(GpuPrefill, VarlenUnevenLengthsCausalAndGqa) {
  const std::vector<int64_t> q = {1, 130, 777, 1100, 64, 129};
  struct Variant { bool causal; int64_t H_kv; };
  for (Variant v : {Variant{true, 4}, Variant{true, 1}, Variant{false, 2}}) {  // groups 1, 4, 2
    CaseConfig c = prefill_config(KvMode::varlen_contiguous, q, q, 4, v.H_kv);
    c.causal = v.causal;
    expect_prefill_matches(c, 1);
  }
  // Chunked prefill: more keys than queries (bottom-right alignment), group 8.
  CaseConfig c = prefill_config(KvMode::varlen_contiguous, {200, 3, 90}, {3000, 70, 90}, 8, 1);
  c.causal = true;
  expect_prefill_matches(c, 2);
}

// Many sequences: the CTA's row-tile lookup (prefill_common.cuh, tile_sequence) tests 32
// sequences per round, so 33 and 40 take two rounds and 1100 three; zero-length sequences
// (several sequences sharing a tile base) and sequences of 1 to 3 row tiles among them.
TEST(GpuPrefill, VarlenManySequences) {
  for (int64_t B : {33, 40, 1100}) {
    std::vector<int64_t> q(size_t(B), 0);
    for (int64_t i = 0; i < B; ++i)
      if (i % 7 != 3) q[size_t(i)] = (i * 37) % 53 + 1 + (i % 11 == 0 ? 130 : 0) + (i % 29 == 0 ? 128 : 0);
    CaseConfig c = prefill_config(B == 40 ? KvMode::varlen_paged : KvMode::varlen_contiguous, q, q, 4, 2);
    c.causal = B != 33;
    expect_prefill_matches(c, 20 + uint64_t(B));
  }
}

// Block sizes 1 and 80 stay on prefill_wgmma, 16 and 64 (and 32) go to prefill_tma on Hopper
// (expect_prefill_matches checks the kernel through hopper_kernel).
TEST(GpuPrefill, PagedAnyBlockSize) {
  for (int64_t bs : {1, 16, 64, 80})
    for (fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
      CaseConfig c = prefill_config(KvMode::varlen_paged, {300, 17, 129}, {700, 17, 300}, 4, 2);
      c.block_size = bs;
      c.layout = layout;
      c.random_block_ids = true;
      c.causal = bs != 64;
      expect_prefill_matches(c, 3);
    }
  CaseConfig c = prefill_config(KvMode::batched_paged, {150}, {150, 400, 9}, 4, 4);
  c.block_size = 32;
  c.causal = true;
  expect_prefill_matches(c, 4);
}

namespace {

// "prefill_tma" when the selection must pick it for a bf16 case of its scope on device 0 (a 9.0
// device of an sm_90a build, the kernel not disabled), else "" (the mma80. run, other devices:
// whichever kernel serves it, checked for correctness only).
std::string tma_if_hopper(const CaseConfig& c) {
  const fs::DeviceProps dev = fs::kernels::cuda_device_props(0);
  const bool hopper = FLASHSERVE_SM90A && dev.cc_major == 9 && dev.cc_minor == 0;
  return hopper && hopper_kernel(c) == "prefill_tma" ? "prefill_tma" : "";
}

}  // namespace

// The paged block sizes prefill_tma takes (whole 16-row page segments of its 128- or 64-key
// tile) and its K/V box rows; the rest (1, 80, ...) stays on prefill_wgmma. Host arithmetic.
TEST(GpuPrefill, PrefillTmaBlockSizeRule) {
  using fs::kernels::prefill_tma_block_size_ok;
  for (int64_t bs : {16, 32, 64, 128, 256, 384, 1024}) EXPECT_TRUE(prefill_tma_block_size_ok(128, 128, bs)) << bs;
  for (int64_t bs : {1, 8, 24, 48, 80, 96, 160, 200}) EXPECT_FALSE(prefill_tma_block_size_ok(128, 128, bs)) << bs;
  for (int64_t bs : {16, 32, 64, 128, 256}) EXPECT_TRUE(prefill_tma_block_size_ok(192, 128, bs)) << bs;
  for (int64_t bs : {1, 48, 80, 96}) EXPECT_FALSE(prefill_tma_block_size_ok(256, 256, bs)) << bs;
  EXPECT_EQ(fs::kernels::prefill_tma_box_rows(128, true, 16), 16);
  EXPECT_EQ(fs::kernels::prefill_tma_box_rows(128, true, 256), 128);
  EXPECT_EQ(fs::kernels::prefill_tma_box_rows(64, true, 128), 64);
  EXPECT_EQ(fs::kernels::prefill_tma_box_rows(128, false, 16), 128);  // contiguous: dim 1 is rows_k
}

// prefill_tma's persistent form (prefill_persistent.cuh) for CTAs of at most
// kPrefillPersistentMaxKeys keys, one CTA per SM; one CTA per item past it or when the keys are
// unknown. (FLASHSERVE_PREFILL_PERSISTENT forces either: the ctest entries onecta. and
// persistent. run this binary so.) Host arithmetic.
TEST(GpuPrefill, PersistentFormByKeys) {
  using fs::kernels::kPrefillPersistentMaxKeys;
  using fs::kernels::prefill_tma_persistent_ctas;
  const char* env = std::getenv("FLASHSERVE_PREFILL_PERSISTENT");
  const std::string forced = env ? env : "";
  if (forced == "0" || forced == "1") {
    EXPECT_EQ(prefill_tma_persistent_ctas(0, 132), forced == "1" ? 132 : 0);
    EXPECT_EQ(prefill_tma_persistent_ctas(1 << 20, 132), forced == "1" ? 132 : 0);
    return;
  }
  if (kPrefillPersistentMaxKeys > 0) {
    EXPECT_EQ(prefill_tma_persistent_ctas(1, 132), 132);
    EXPECT_EQ(prefill_tma_persistent_ctas(kPrefillPersistentMaxKeys, 78), 78);
  }
  EXPECT_EQ(prefill_tma_persistent_ctas(kPrefillPersistentMaxKeys + 1, 132), 0);
  EXPECT_EQ(prefill_tma_persistent_ctas(0, 132), 0);
}

// Grids of many more items than SMs, so that each persistent CTA walks several (~17 at 132 SMs) with
// inactive row tiles (varlen's spare tiles, zero-length sequences) among them: row tiles of 1 to
// 3 tiles of keys, causal and not, GQA, a chunked prefill (keys past the queries) and splits
// (items over splits too); every case's output against the reference (the walk's pipelines,
// item hand-over, Q reloads and ping-pong across items), in whichever form the selection or
// FLASHSERVE_PREFILL_PERSISTENT gives.
TEST(GpuPrefill, ManyItemsPerCta) {
  std::vector<int64_t> q, k;
  fsgpu::many_short_sequences(q, k);
  int variant = 0;
  for (int64_t H_kv : {8, 2})
    for (bool causal : {true, false}) {
      CaseConfig c = prefill_config(KvMode::varlen_contiguous, q, k, 8, H_kv);
      c.causal = causal;
      c.num_splits = variant == 3 ? 2 : 1;
      expect_prefill_matches(c, 300 + uint64_t(variant++));
    }
}

// Paged caches on prefill_tma (one TMA box per page segment of a key tile, at the page's block
// id): block sizes 16, 64, 128 and 256 (pages smaller than, equal to and larger than the
// 128-key tile; at D = 256 and 192/128 the tile is 64 keys), NHD and HND, random block ids,
// uneven varlen lengths with tails the producer copies (700, 300, 40 keys; a 17-key and a 1-row
// sequence), causal and not, splits (the GPU plan's 128-key granularity: tiles start pages) and
// a split granularity of 48 keys (tile starts off the pages: those tiles take the cp.async
// path), head sizes 64, 128, 256 and 192/128. Each must be served by prefill_tma on Hopper.
TEST(GpuPrefill, PagedBlockSizesOnPrefillTma) {
  struct Heads { int64_t D, Dv; };
  int variant = 0;
  for (Heads hd : {Heads{128, 128}, Heads{64, 64}, Heads{256, 256}, Heads{192, 128}})
    for (int64_t bs : {16, 64, 128, 256})
      for (fs::KvLayout layout : {fs::KvLayout::nhd, fs::KvLayout::hnd}) {
        if (hd.D != 128 && layout == fs::KvLayout::hnd && bs != 64) continue;  // HND: every block size at D = 128
        CaseConfig c = prefill_config(KvMode::varlen_paged, {300, 17, 129, 1}, {700, 17, 300, 40}, 4, 2);
        c.D = hd.D, c.Dv = hd.Dv;
        c.block_size = bs;
        c.layout = layout;
        c.random_block_ids = true;
        c.causal = variant % 2 == 0;
        c.num_splits = variant % 3 == 1 ? 3 : 1;
        const int granularity = variant % 6 == 4 ? 48 : 0;  // with 3 splits
        ++variant;
        auto rng = fstest::make_rng(70 + uint64_t(variant));
        fstest::AttentionCase ac = fstest::build_case(c, rng);
        std::string kernel;
        EXPECT_EQ(run_and_check(ac, kernel, granularity), "")
            << fstest::describe(c) << "granularity " << granularity << "\n(seed " << fstest::test_seed() << ")";
        const std::string want = tma_if_hopper(c);
        if (!want.empty()) {
          EXPECT_EQ(kernel, want) << fstest::describe(c);
        }
      }
}

// A block id outside the cache (-1, 2^20) in sequence 1's table, at column `col` of a causal
// varlen paged case with q_lens == k_lens: the kernel never reads it (TMA would zero-fill it:
// the producer copies that tile with cp.async, NaN keys), exactly the rows of sequence 1 that
// see its keys (positions >= col x P) are NaN, every other output matches the CPU reference
// run on the good table; with and without splits, block sizes 16 (7 pages per 128-key tile
// besides the bad one), 64 and 256 (a page holding two tiles).
TEST(GpuPrefill, PagedBadBlockIdGivesNanRowsOnPrefillTma) {
  for (int64_t bs : {16, 64, 256})
    for (int splits : {1, 3})
      for (int32_t bad_id : {-1, 1 << 20}) {
        CaseConfig c = prefill_config(KvMode::varlen_paged, {200, 700, 90}, {200, 700, 90}, 4, 2);
        c.causal = true;
        c.block_size = bs;
        c.random_block_ids = true;
        c.num_splits = splits;
        const int col = bs == 256 ? 1 : 3;  // keys 48.., 192.., 256..: inside sequence 1's tiles
        std::string kernel;
        EXPECT_EQ(fsgpu::check_bad_block_nan_rows(c, 90 + uint64_t(bs), col, bad_id, 1e-2, kernel), "")
            << "bs " << bs << " splits " << splits << " bad id " << bad_id;
        const std::string want = tma_if_hopper(c);
        if (!want.empty()) {
          EXPECT_EQ(kernel, want);
        }
      }
}

TEST(GpuPrefill, SplitsWindowSoftcapAndOutputDtypes) {
  for (int splits : {2, 3}) {
    CaseConfig c = prefill_config(KvMode::varlen_paged, {256, 40}, {1000, 520}, 4, 2);
    c.num_splits = splits;
    c.causal = splits == 2;
    expect_prefill_matches(c, 5);
  }
  CaseConfig c = prefill_config(KvMode::varlen_contiguous, {500, 260}, {500, 300}, 4, 1);
  c.causal = true;
  c.window = {100, 0};
  c.softcap = 30.0f;
  expect_prefill_matches(c, 6);
  c.causal = false;
  c.window = {64, 37};
  c.out_dtype = DType::f32;
  expect_prefill_matches(c, 7);
  // fp32 out (a cascade prefix pass: one sequence of many rows, non-causal; then a causal one
  // over a paged cache with splits).
  CaseConfig f = prefill_config(KvMode::varlen_paged, {640}, {1500}, 8, 2);
  f.out_dtype = DType::f32;
  expect_prefill_matches(f, 13);
  f.causal = true;
  f.num_splits = 3;
  expect_prefill_matches(f, 14);
}

TEST(GpuPrefill, HeadDims64To256AndF16) {
  for (DType t : {DType::f16, DType::bf16})
    for (int64_t D : {64, 128, 256}) {
      CaseConfig c = prefill_config(KvMode::varlen_contiguous, {333, 90}, {333, 200}, 4, 2);
      c.q_dtype = c.kv_dtype = c.out_dtype = t;
      c.D = c.Dv = D;
      c.causal = D == 64;
      expect_prefill_matches(c, 8);
    }
}

// D = 64 on prefill_tma: 192-row CTAs (three consumer warpgroups, select.hpp:
// prefill_tma_rows: sequences of up to max_q rows where 192-row tiles pad them little), so
// sequences of 191, 192, 193 and 576 rows end inside, at and just past a row tile, the varlen
// lookup counts tiles of 192, and the 128-row instantiations (fp32 out; short sequences) run
// beside it. Causal and not, GQA 4, batched and varlen, splits, paged (blocks of 16 and 256),
// soft-cap and a window, sinks, ALiBi.
TEST(GpuPrefill, ThreeWarpgroupTilesAtD64) {
  using fs::kernels::prefill_tma_rows;
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 2048), 192);
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 385), 192);
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 512, true), 128);
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 2048, true), 192);
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 576, true), 192);
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 128), 128);
  EXPECT_EQ(prefill_tma_rows(64, 64, false, 256), 128);
  EXPECT_EQ(prefill_tma_rows(64, 64, true, 2048), 128);
  EXPECT_EQ(prefill_tma_rows(128, 128, false, 2048), 128);
  const auto check = [](const CaseConfig& c, uint64_t salt) {
    const std::string kernel = expect_case_matches(c, salt);
    if (head_dims_kernel(c) == "prefill_tma") EXPECT_EQ(kernel, "prefill_tma") << fstest::describe(c);
  };
  const std::vector<int64_t> q = {1, 191, 192, 193, 576, 40};  // max 576: 192 rows, causal too
  for (int variant = 0; variant < 6; ++variant) {
    CaseConfig c = prefill_config(variant == 2 || variant == 5 ? KvMode::varlen_paged : KvMode::varlen_contiguous, q,
                                  {1, 191, 200, 900, 600, 700}, 8, 2);
    c.D = c.Dv = 64;
    c.causal = variant % 2 == 0;
    if (variant == 1) c.num_splits = 3;
    if (variant == 2) c.block_size = 16;
    if (variant == 3) c.softcap = 30.0f, c.window = {150, 0};
    if (variant == 4) c.out_dtype = DType::f32;
    if (variant == 5) c.block_size = 256, c.sinks = true;
    check(c, 40 + uint64_t(variant));
  }
  CaseConfig short_rows = prefill_config(KvMode::varlen_contiguous, {100, 128, 1}, {300, 128, 50}, 8, 2);
  short_rows.D = short_rows.Dv = 64;
  short_rows.causal = true;
  check(short_rows, 46);  // 128-row CTAs (max_seqlen_q 128)
  CaseConfig b = prefill_config(KvMode::batched_contiguous, {760, 760}, {760, 760}, 4, 4);
  b.D = b.Dv = 64;
  b.causal = true;
  b.alibi = 1;
  check(b, 47);
}

// D = 96 and 192 (D == Dv) and MLA prefill's D = 192, Dv = 128, bf16, on prefill_tma (contiguous,
// and the paged variants' blocks of 16 and 64) on Hopper, the generic kernel elsewhere. Uneven varlen lengths
// with tail tiles (333 keys: 2 whole 128-key tiles or 5 of 64, then a tail the producer copies;
// a 1-row sequence), GQA 4. Variants: causal new tokens; paged with splits and sinks;
// non-causal context chunks with LSE into fp32 out (merged later); ALiBi (sqrt at D = 96) with
// chunked local attention; non-causal bf16 out with q and K/V rows padded by NaN-poisoned
// elements (the TMA maps span D channels: D = 96's last box reads none of the padding past
// channel 96, zeros instead); paged without splits, blocks of 64 in random order.
TEST(GpuPrefill, HeadDims96And192AndMla) {
  struct Heads { int64_t D, Dv; };
  for (Heads hd : {Heads{96, 96}, Heads{192, 192}, Heads{192, 128}})
    for (int variant = 0; variant < 6; ++variant) {
      CaseConfig c = prefill_config(KvMode::varlen_contiguous, {333, 90, 1}, {333, 700, 40}, 8, 2);
      c.D = hd.D, c.Dv = hd.Dv;
      c.causal = variant != 2 && variant != 4 && variant != 5;
      if (variant == 1) c.num_splits = 3, c.sinks = true, c.mode = KvMode::varlen_paged, c.block_size = 16;
      if (variant == 2) c.out_dtype = DType::f32;  // a context chunk: non-causal, fp32 partial state
      if (variant == 3) c.alibi = 1, c.alibi_sqrt = hd.D == 96, c.chunk = 128;
      if (variant == 4) c.q_pad = 8, c.kv_pad = 16, c.extra_kv_rows = 3;
      if (variant == 5) c.mode = KvMode::varlen_paged, c.block_size = 64, c.random_block_ids = true;
      const std::string kernel = expect_case_matches(c, 50 + uint64_t(hd.D + hd.Dv + variant));
      EXPECT_EQ(kernel, head_dims_kernel(c)) << fstest::describe(c);
    }
}

// Both Hopper prefill kernels are instantiated for every prefill head size in every sm_90a
// build, the dev set included (bf16): a table that drops one sends it to the generic kernel.
TEST(GpuPrefill, HopperTablesHoldEveryHeadSize) {
  if (!FLASHSERVE_SM90A) GTEST_SKIP() << "no sm_90a code in this build";
  struct Heads { int64_t D, Dv; };
  for (Heads hd : {Heads{64, 64}, Heads{96, 96}, Heads{128, 128}, Heads{192, 192}, Heads{256, 256}, Heads{192, 128}}) {
    EXPECT_TRUE(fs::kernels::prefill_tma_config_built(DType::bf16, hd.D, hd.Dv)) << hd.D << "/" << hd.Dv;
    EXPECT_TRUE(fs::kernels::prefill_wgmma_config_built(DType::bf16, hd.D, hd.Dv)) << hd.D << "/" << hd.Dv;
  }
}

TEST(GpuPrefill, FullyMaskedRowsAndZeroLengthSequences) {
  // Causal with sq > sk: the leading rows see no key (out 0, lse -inf).
  CaseConfig c = prefill_config(KvMode::varlen_contiguous, {300, 0, 150, 0}, {100, 50, 0, 0}, 4, 2);
  c.causal = true;
  expect_prefill_matches(c, 9);
  c.mode = KvMode::varlen_paged;
  c.num_splits = 2;
  expect_prefill_matches(c, 10);
  CaseConfig w = prefill_config(KvMode::batched_contiguous, {130}, {0, 200}, 4, 4);
  w.window = {0, 0};
  expect_prefill_matches(w, 11);
}

// Sinks (gpt-oss s_aux, SPEC.md §2.5): one extra logit per head with no value row, merged into
// the final normalisation by the kernel's epilogue, or once by the combine with splits; rows
// that see no key get out 0 and lse = the sink. Every sink dtype, fp32 out (P hi + lo), paged
// and batched.
TEST(GpuPrefill, Sinks) {
  for (int splits : {1, 3})
    for (DType sink : {DType::f32, DType::bf16, DType::f16}) {
      CaseConfig c = prefill_config(KvMode::varlen_paged, {300, 0, 129, 77}, {700, 40, 129, 20}, 8, 2);
      c.causal = true;  // the last sequence's leading rows see no key
      c.sinks = true;
      c.sink_dtype = sink;
      c.num_splits = splits;
      c.random_block_ids = true;
      expect_prefill_matches(c, 20 + uint64_t(splits));
    }
  CaseConfig f = prefill_config(KvMode::varlen_contiguous, {640, 33}, {1500, 33}, 4, 4);
  f.sinks = true;
  f.out_dtype = DType::f32;
  expect_prefill_matches(f, 24);
  CaseConfig b = prefill_config(KvMode::batched_paged, {200}, {200, 450}, 4, 1);
  b.sinks = true;
  b.causal = true;
  b.window = {150, 0};
  b.softcap = 20.0f;
  expect_prefill_matches(b, 25);
}

// ALiBi (slopes [H] and [B, H], linear and sqrt; distances |i' - j| bottom-right aligned) on
// the tensor-core kernels' ALiBi instantiations, alone and with every other modifier.
TEST(GpuPrefill, Alibi) {
  for (int alibi : {1, 2})
    for (bool sqrt_dist : {false, true}) {
      CaseConfig c = prefill_config(KvMode::varlen_contiguous, {300, 129, 40, 77}, {700, 129, 300, 20}, 8, 2);
      c.causal = true;  // the last sequence's leading rows see no key
      c.alibi = alibi;
      c.alibi_sqrt = sqrt_dist;
      c.num_splits = sqrt_dist ? 2 : 1;
      expect_prefill_matches(c, 30 + uint64_t(2 * alibi + sqrt_dist));
    }
  // Non-causal (keys on both sides of i'), with soft-cap (prescaled scores), sinks, a
  // two-sided window, a custom scale, a paged cache and splits.
  for (bool sqrt_dist : {false, true}) {
    CaseConfig c = prefill_config(KvMode::varlen_paged, {260, 17, 140}, {260, 400, 900}, 4, 1);
    c.alibi = 2;
    c.alibi_sqrt = sqrt_dist;
    c.softcap = 25.0f;
    c.sinks = true;
    c.window = {300, 50};
    c.softmax_scale = 0.05f;
    c.block_size = 16;
    c.random_block_ids = true;
    c.num_splits = sqrt_dist ? 3 : 1;
    expect_prefill_matches(c, 36 + uint64_t(sqrt_dist));
  }
  CaseConfig b = prefill_config(KvMode::batched_paged, {150}, {150, 400, 9}, 4, 4);
  b.alibi = 1;
  b.causal = true;
  b.block_size = 32;
  expect_prefill_matches(b, 38);
}

// Chunked local attention (chunk c: j and i' in the same chunk, floor division): chunks smaller
// than a CTA's 128 rows, boundaries inside a CTA, chunked prefill with more keys than queries,
// splits, and with ALiBi and sinks.
TEST(GpuPrefill, ChunkedLocalAttention) {
  for (int64_t chunk : {48, 200, 1000}) {
    CaseConfig c = prefill_config(KvMode::varlen_paged, {600, 1, 300, 9}, {1500, 700, 300, 3}, 4, 2);
    c.causal = true;
    c.chunk = chunk;
    c.num_splits = chunk == 200 ? 3 : 1;
    c.random_block_ids = true;
    expect_prefill_matches(c, 40 + uint64_t(chunk));
  }
  CaseConfig c = prefill_config(KvMode::varlen_contiguous, {500, 260}, {900, 260}, 8, 2);
  c.chunk = 256;
  c.causal = true;
  c.alibi = 1;
  c.alibi_sqrt = true;
  c.sinks = true;
  expect_prefill_matches(c, 41);
  c.causal = false;  // chunks alone bound the keys on both sides
  c.alibi = 0;
  expect_prefill_matches(c, 42);
}

// Context parallelism (rank r of W holds global keys r, r + W, ...; positions, masks and the
// causal diagonal in global terms): the tensor-core kernels against the CPU reference under the
// same plan (the oracle knows no context parallelism), causal and windowed, splits, sinks, paged
// and contiguous. ALiBi with it stays on the generic kernel (checked too).
TEST(GpuPrefill, ContextParallel) {
  const std::vector<int64_t> global = {700, 9, 300};
  for (int world : {2, 3})
    for (int rank : {0, world - 1})
      for (int variant = 0; variant < 3; ++variant) {
        std::vector<int64_t> local;
        for (int64_t g : global) local.push_back(g > rank ? (g - rank + world - 1) / world : 0);
        CaseConfig c = prefill_config(variant == 1 ? KvMode::varlen_paged : KvMode::varlen_contiguous, {200, 3, 130},
                                      local, 4, 2);
        c.causal = variant != 1;
        if (variant == 1) c.window = {150, 20}, c.num_splits = 2, c.sinks = true, c.random_block_ids = true;
        if (variant == 2) c.alibi = 1;
        auto rng = fstest::make_rng(60 + uint64_t(world * 10 + rank * 3 + variant));
        fstest::AttentionCase ac = fstest::build_case(c, rng);
        fsgpu::set_context_parallel(ac, global, world, rank);
        std::string kernel;
        fstest::HostTensor cpu_out;
        const std::string err = fsgpu::match_cpu_reference(ac, kernel, &cpu_out);
        const std::string what = "world " + std::to_string(world) + " rank " + std::to_string(rank) + " variant " +
                                 std::to_string(variant) + " kernel " + kernel + "\n" + fstest::describe(c);
        EXPECT_EQ(err, "") << what;
        EXPECT_LT(fsgpu::relative_error(ac, cpu_out), 1e-2) << what;
        const std::string tc = expected_prefill_kernel() == "prefill_wgmma" ? hopper_kernel(c) : expected_prefill_kernel();
        EXPECT_EQ(kernel, variant == 2 ? "generic" : tc) << what;
      }
}

// Problems outside the kernel's scope stay on the generic kernel (and stay correct).
TEST(GpuPrefill, OutOfScopeFallsBackToGeneric) {
  struct Variant {
    const char* what;
    void (*apply)(CaseConfig&);
  };
  const Variant variants[] = {
      {"alibi with fp32 out (not instantiated)", [](CaseConfig& c) { c.alibi = 1, c.out_dtype = DType::f32; }},
      {"q_pad 4 (8-byte rows)", [](CaseConfig& c) { c.q_pad = 4; }},
      {"fp8 kv", [](CaseConfig& c) { c.quant = fstest::QuantMode::fp8_kv, c.kv_dtype = DType::f8e4m3; }},
  };
  for (const Variant& v : variants) {
    CaseConfig c = prefill_config(KvMode::varlen_contiguous, {70, 20}, {90, 20}, 2, 1);
    c.causal = true;
    v.apply(c);
    auto rng = fstest::make_rng(12);
    fstest::AttentionCase ac = fstest::build_case(c, rng);
    std::string kernel;
    EXPECT_EQ(run_and_check(ac, kernel), "") << v.what << "\n" << fstest::describe(c);
    EXPECT_EQ(kernel, "generic") << v.what;
  }
}
