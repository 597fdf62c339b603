// KV-cache maintenance on CUDA (cache.hpp) against the CPU reference, bit for bit: every buffer
// is poisoned, mirrored to the device, and the whole storage (padding and untouched slots
// included) must come back equal to the reference's run on the host copies. reshape_and_cache
// in every cache dtype, layout, block size 1/5/16, strided, interleaved and aligned (vector
// path) caches, fp8 e4m3/e5m2 with scalar and per-head scales, int8 K8V8/K8V16, -1 and
// out-of-range slots (skipped on CUDA); copy_blocks over many caches; swap_blocks in every
// direction with pageable and pinned host memory; advance_step with padding rows;
// quantize_int8; validate_only; int8 rows given already quantized (key_scale).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "flashserve/cache.hpp"
#include "flashserve/status.hpp"
#include "support/device_tensor.hpp"
#include "support/cache_operands.hpp"
#include "support/checks.hpp"
#include "support/host_tensor.hpp"

namespace {

namespace fs = flashserve;
namespace nm = flashserve::numeric;
using fs::DType;
using fs::KvCacheDType;
using fs::KvLayout;
using fs::TensorRef;
using fsgpu::DeviceTensor;
using fstest::block_pairs;
using fstest::HostTensor;
using fstest::mapping_tensor;
using fstest::pick;
using fstest::seed_note;
using fstest::StepBuffers;
using fstest::uniform_int;
using fstest::WriteCase;

// A view of host buffer `h` moved onto the same offset of storage `base` on `dev`.
TensorRef moved(const TensorRef& view, const HostTensor& h, void* base, fs::Device dev) {
  TensorRef v = view;
  v.data = static_cast<char*>(base) + (static_cast<unsigned char*>(view.data) - h.bytes->data());
  v.device = dev;
  return v;
}
// ... onto its device mirror `d`, or onto its clone `c`.
TensorRef on_device(const TensorRef& view, const HostTensor& h, const DeviceTensor& d) {
  return moved(view, h, d.storage.get(), fs::Device{fs::DeviceType::cuda, 0});
}
TensorRef on_clone(const TensorRef& view, const HostTensor& h, const HostTensor& c) {
  return moved(view, h, c.bytes->data(), fs::Device{});
}

void fill_random_bytes(const HostTensor& h, std::mt19937_64& rng) {
  for (unsigned char& b : *h.bytes) b = static_cast<unsigned char>(rng());
}

// "" when both storages hold the same bytes; else how many differ and the first, as an element
// of the buffer's dtype.
std::string diff_storage(const std::string& name, const HostTensor& cpu, const HostTensor& gpu) {
  const auto& a = *cpu.bytes;
  const auto& b = *gpu.bytes;
  int64_t count = 0, first = -1;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && count++ == 0) first = int64_t(i);
  if (count == 0) return "";
  const size_t es = fs::dtype_size(cpu.ref.dtype);
  const size_t e = size_t(first) / es;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s (%s): %lld bytes differ; first in storage element %zu: cpu %.9g gpu %.9g", name.c_str(),
                fstest::describe(cpu.ref).c_str(), (long long)count, e,
                double(nm::load_float(a.data() + e * es, cpu.ref.dtype)),
                double(nm::load_float(b.data() + e * es, cpu.ref.dtype)));
  return buf;
}

void expect_same(const std::string& what, const std::string& name, const HostTensor& cpu, const DeviceTensor& gpu) {
  const std::string d = diff_storage(name, cpu, gpu.download(cpu));
  EXPECT_TRUE(d.empty()) << what << ": " << d << seed_note();
}

// ---- reshape_and_cache

// Key/value rows [rows, H, w]: padded token and head strides, or contiguous when dense.
HostTensor kv_rows(DType t, bool dense, int64_t rows, int64_t H, int64_t w, int64_t pad) {
  return dense ? HostTensor::zeros(t, {rows, H, w}) : HostTensor::strided(t, {rows, H, w}, {H * (w + 1) + pad, w + 1, 1});
}

void run_write_case(const WriteCase& wc, std::mt19937_64& rng) {
  const bool fp8 = wc.fp8(), int8 = wc.int8();
  const DType fmt = wc.fp8_format();
  const int64_t H = pick<int64_t>(rng, {1, 2, 3, 8}), D = pick<int64_t>(rng, {8, 16, 40, 64, 72, 128});
  const int64_t Dv = wc.interleaved ? D : pick<int64_t>(rng, {8, 24, 128});
  const int64_t bs = wc.block_size, nb = (48 + bs - 1) / bs + uniform_int(rng, 0, 2);
  const int64_t T = uniform_int(rng, 4, 40), rows = T + uniform_int(rng, 0, 2);
  std::ostringstream label;
  label << wc.str() << " H " << H << " D " << D << " Dv " << Dv << " T " << T << " blocks " << nb;
  SCOPED_TRACE(label.str());

  HostTensor key = kv_rows(wc.dtype, wc.dense, rows, H, D, 5), value = kv_rows(wc.dtype, wc.dense, rows, H, Dv, 3);
  fstest::fill_uniform(key, rng, -4.0f, 4.0f);
  fstest::fill_uniform(value, rng, -4.0f, 4.0f);
  key.set({0, 0, 0}, 3.9f);  // saturates every fp8 scale below (token 0 is never skipped)
  value.set({0, 0, 0}, -3.9f);
  key.set({1, 0, 1}, NAN);   // special values: NaN codes, saturated infinities, signed zero
  value.set({1, 0, 2}, -INFINITY);
  key.set({2, 0, 3}, INFINITY);
  value.set({2, 0, 0}, -0.0f);

  fstest::Caches cc = fstest::make_caches(wc, nb, H, D, Dv);
  HostTensor ksc = HostTensor::strided(DType::f32, {nb, H, bs}, {H * (bs + 2) + 1, bs + 2, 1});

  // Distinct slots; some skipped (-1, -2, -3); one out of range on the device (-1 on the CPU).
  HostTensor slot_cpu = fstest::slot_tensor(fstest::random_slots(rng, nb * bs, T));
  HostTensor slot_gpu = slot_cpu.clone();
  const int64_t bad = uniform_int(rng, 1, T - 1);
  *static_cast<int64_t*>(slot_cpu.ref.at(bad)) = -1;
  *static_cast<int64_t*>(slot_gpu.ref.at(bad)) = nb * bs + uniform_int(rng, 0, 1000);

  const float lo = fmt == DType::f8e4m3 ? 0.004f : 3e-5f, hi = fmt == DType::f8e4m3 ? 0.008f : 6e-5f;
  HostTensor k_scale = fstest::fp8_scale(rng, wc.scale_rank, H, lo, hi);
  HostTensor v_scale = fstest::fp8_scale(rng, wc.scale_rank, H, lo, hi);
  HostTensor v_scale_i8 = HostTensor::zeros(DType::f32, {H, Dv});
  fstest::fill_uniform(v_scale_i8, rng, 0.02f, 0.05f);

  // Device mirrors (caches poisoned on both sides), then the params for each side.
  DeviceTensor dkb = DeviceTensor::poisoned_mirror(cc.kb), dvb = cc.shared ? dkb : DeviceTensor::poisoned_mirror(cc.vb);
  DeviceTensor dksc = DeviceTensor::poisoned_mirror(ksc);
  DeviceTensor dkey = DeviceTensor::mirror(key), dvalue = DeviceTensor::mirror(value);
  DeviceTensor dslots = DeviceTensor::mirror(slot_gpu);
  DeviceTensor dks = DeviceTensor::mirror(k_scale), dvs = DeviceTensor::mirror(v_scale);
  DeviceTensor dvs8 = DeviceTensor::mirror(v_scale_i8);

  auto params = [&](bool gpu) {
    fs::CacheWriteParams p;
    p.key = gpu ? dkey.ref : key.ref;
    p.value = gpu ? dvalue.ref : value.ref;
    p.key_cache = gpu ? on_device(cc.k, cc.kb, dkb) : cc.k;
    p.value_cache = gpu ? on_device(cc.v, cc.vb, dvb) : cc.v;
    p.layout = wc.layout;
    p.slot_mapping = gpu ? dslots.ref : slot_cpu.ref;
    p.cache_dtype = wc.mode;
    if (fp8) p.k_scale = gpu ? dks.ref : k_scale.ref;
    if (fp8) p.v_scale = gpu ? dvs.ref : v_scale.ref;
    if (wc.mode == KvCacheDType::int8_k8v8) p.v_scale = gpu ? dvs8.ref : v_scale_i8.ref;
    if (int8) p.k_scale_cache = gpu ? dksc.ref : ksc.ref;
    return p;
  };
  fs::reshape_and_cache(params(false));
  fs::reshape_and_cache(params(true));
  fsgpu::sync();

  expect_same(label.str(), cc.shared ? "kv_cache" : "key_cache", cc.kb, dkb);
  if (!cc.shared) expect_same(label.str(), "value_cache", cc.vb, dvb);
  expect_same(label.str(), "k_scale_cache", ksc, dksc);
}

std::vector<WriteCase> write_cases(std::mt19937_64& rng) {
  std::vector<WriteCase> cases;
  for (KvLayout l : {KvLayout::nhd, KvLayout::hnd})
    for (int shape = 0; shape < 3; ++shape)  // padded, interleaved, dense
      for (int64_t bs : {1, 5, 16}) {
        const bool inter = shape == 1, dense = shape == 2;
        for (DType t : {DType::f16, DType::bf16, DType::f32})
          cases.push_back({l, inter, dense, bs, KvCacheDType::auto_, t, DType::u8, 0});
        for (int rank : {0, 1, 2}) {
          cases.push_back({l, inter, dense, bs, KvCacheDType::fp8_e4m3, pick(rng, {DType::f16, DType::bf16}),
                           rank == 1 ? DType::f8e4m3 : DType::u8, rank});
          cases.push_back({l, inter, dense, bs, KvCacheDType::fp8_e5m2, pick(rng, {DType::f16, DType::bf16, DType::f32}),
                           rank == 1 ? DType::u8 : DType::f8e5m2, rank});
        }
        cases.push_back({l, inter, dense, bs, KvCacheDType::int8_k8v8, pick(rng, {DType::f16, DType::bf16, DType::f32}),
                         DType::u8, 0});
        if (!inter)  // the v cache holds f16/bf16 while k is int8: separate buffers
          cases.push_back({l, inter, dense, bs, KvCacheDType::int8_k8v16, pick(rng, {DType::f16, DType::bf16}), DType::u8, 0});
      }
  return cases;
}

}  // namespace

TEST(GpuReshapeAndCache, EqualsCpuInEveryModeLayoutAndBlockSize) {
  auto rng = fstest::make_rng(0x9e11);
  for (int rep = 0; rep < 2; ++rep)
    for (const WriteCase& wc : write_cases(rng)) run_write_case(wc, rng);
}

// int8 rows given already quantized (the int8 fork's reshape_and_cache_flash_int8 / _mix): key
// rows and the strided key_scale (a transposed [H, T] buffer) into the caches, bit for bit as
// the CPU, every other byte (poisoned) untouched; an out-of-range slot skipped on the device.
TEST(GpuReshapeAndCache, Int8RowsGivenQuantizedEqualCpu) {
  auto rng = fstest::make_rng(0x9e18);
  for (int rep = 0; rep < 3; ++rep)
    for (KvCacheDType mode : {KvCacheDType::int8_k8v8, KvCacheDType::int8_k8v16})
      for (KvLayout layout : {KvLayout::nhd, KvLayout::hnd})
        for (int64_t bs : {1, 5, 16}) {
          const bool k8v8 = mode == KvCacheDType::int8_k8v8;
          const int64_t H = pick<int64_t>(rng, {1, 2, 8}), D = pick<int64_t>(rng, {8, 40, 64, 128});
          const int64_t T = uniform_int(rng, 4, 40), rows = T + uniform_int(rng, 0, 2);
          const int64_t nb = (48 + bs - 1) / bs + 1;
          const DType vt = k8v8 ? DType::i8 : pick(rng, {DType::f16, DType::bf16});
          std::ostringstream label;
          label << fs::kv_cache_dtype_name(mode) << (layout == KvLayout::nhd ? " nhd" : " hnd") << " bs " << bs
                << " H " << H << " D " << D << " T " << T;
          SCOPED_TRACE(label.str());
          HostTensor key = kv_rows(DType::i8, rep == 0, rows, H, D, 5), value = kv_rows(vt, rep == 0, rows, H, D, 3);
          fill_random_bytes(key, rng);
          if (k8v8) fill_random_bytes(value, rng);
          else fstest::fill_uniform(value, rng, -4.0f, 4.0f);
          HostTensor scales = HostTensor::zeros(DType::f32, {H, rows});
          fstest::fill_uniform(scales, rng, 0.001f, 0.1f);
          const TensorRef key_scale = scales.ref.permute({1, 0});
          auto cache = [&](DType t) {
            return layout == KvLayout::nhd ? HostTensor::zeros(t, {nb, bs, H, D}) : HostTensor::zeros(t, {nb, H, bs, D});
          };
          HostTensor kc = cache(DType::i8), vc = cache(vt), ksc = HostTensor::zeros(DType::f32, {nb, H, bs});
          HostTensor slot_cpu = fstest::slot_tensor(fstest::random_slots(rng, nb * bs, T));
          HostTensor slot_gpu = slot_cpu.clone();
          const int64_t bad = uniform_int(rng, 1, T - 1);
          *static_cast<int64_t*>(slot_cpu.ref.at(bad)) = -1;
          *static_cast<int64_t*>(slot_gpu.ref.at(bad)) = nb * bs + uniform_int(rng, 0, 1000);
          DeviceTensor dkc = DeviceTensor::poisoned_mirror(kc), dvc = DeviceTensor::poisoned_mirror(vc);
          DeviceTensor dksc = DeviceTensor::poisoned_mirror(ksc);
          DeviceTensor dkey = DeviceTensor::mirror(key), dvalue = DeviceTensor::mirror(value);
          DeviceTensor dscales = DeviceTensor::mirror(scales), dslots = DeviceTensor::mirror(slot_gpu);
          auto params = [&](bool gpu) {
            fs::CacheWriteParams p;
            p.key = gpu ? dkey.ref : key.ref;
            p.value = gpu ? dvalue.ref : value.ref;
            p.key_cache = gpu ? dkc.ref : kc.ref;
            p.value_cache = gpu ? dvc.ref : vc.ref;
            p.layout = layout;
            p.slot_mapping = gpu ? dslots.ref : slot_cpu.ref;
            p.cache_dtype = mode;
            p.k_scale_cache = gpu ? dksc.ref : ksc.ref;
            p.key_scale = gpu ? on_device(key_scale, scales, dscales) : key_scale;
            return p;
          };
          fs::reshape_and_cache(params(false));
          fs::reshape_and_cache(params(true));
          fsgpu::sync();
          expect_same(label.str(), "key_cache", kc, dkc);
          expect_same(label.str(), "value_cache", vc, dvc);
          expect_same(label.str(), "k_scale_cache", ksc, dksc);
        }
}

TEST(GpuReshapeAndCache, ValidateOnlyWritesNothing) {
  HostTensor key = HostTensor::zeros(DType::f16, {3, 2, 8}), slots = HostTensor::zeros(DType::i64, {3});
  auto rng = fstest::make_rng(0x9e12);
  fstest::fill_uniform(key, rng, -1, 1);
  HostTensor kc = HostTensor::zeros(DType::f16, {2, 4, 2, 8}), vc = HostTensor::zeros(DType::f16, {2, 4, 2, 8});
  DeviceTensor dkey = DeviceTensor::mirror(key), dslots = DeviceTensor::mirror(slots);
  DeviceTensor dkc = DeviceTensor::poisoned_mirror(kc), dvc = DeviceTensor::poisoned_mirror(vc);
  fs::CacheWriteParams p;
  p.key = p.value = dkey.ref;
  p.key_cache = dkc.ref;
  p.value_cache = dvc.ref;
  p.slot_mapping = dslots.ref;
  fs::ExecContext ctx;
  ctx.validate_only = true;
  fs::reshape_and_cache(p, ctx);
  fsgpu::sync();
  expect_same("validate_only", "key_cache", kc, dkc);
  expect_same("validate_only", "value_cache", vc, dvc);
  p.slot_mapping = dkey.ref;  // still validated on CUDA: float16 slots
  EXPECT_THROW(fs::reshape_and_cache(p, ctx), fs::Error);
}

TEST(GpuCopyBlocks, EqualsCpuOverManyCachesAndSkipsBadRows) {
  auto rng = fstest::make_rng(0xc0b2);
  for (int rep = 0; rep < 8; ++rep) {
    const int64_t nb = uniform_int(rng, 4, 14), bs = pick<int64_t>(rng, {1, 5, 16});
    const int64_t H = pick<int64_t>(rng, {1, 2, 4}), D = pick<int64_t>(rng, {5, 8, 64});
    std::vector<HostTensor> bufs = {
        HostTensor::zeros(DType::bf16, {nb, 2, bs, H, D}),                                      // interleaved K/V
        HostTensor::strided(DType::f16, {nb, H, bs, D}, {H * bs * (D + 1) + 3, bs * (D + 1), D + 1, 1}),
        HostTensor::zeros(DType::f32, {nb, H, bs}),                                             // int8 k scales
        HostTensor::zeros(DType::i32, {nb}),
        HostTensor::zeros(DType::u8, {nb, bs, H, D}),                                           // fp8
        HostTensor::zeros(DType::f16, {nb, H, D}),                                              // viewed [nb, D, H]
    };
    const int extra = rep % 4 == 0 ? 260 : rep % 4 == 2 ? 36 : 0;  // 260: past one launch's 256 caches
    for (int i = 0; i < extra; ++i) bufs.push_back(HostTensor::zeros(DType::f32, {nb, 3}));
    std::vector<TensorRef> views = {bufs[0].ref.select(1, 0), bufs[0].ref.select(1, 1), bufs[1].ref, bufs[2].ref,
                                    bufs[3].ref, bufs[4].ref, bufs[5].ref.permute({0, 2, 1})};
    std::vector<size_t> owner = {0, 0, 1, 2, 3, 4, 5};
    for (int i = 0; i < extra; ++i) views.push_back(bufs[size_t(6 + i)].ref), owner.push_back(size_t(6 + i));

    std::vector<DeviceTensor> dev;
    for (const HostTensor& b : bufs) {
      fill_random_bytes(b, rng);
      dev.push_back(DeviceTensor::mirror(b));
    }
    std::vector<TensorRef> dviews;
    for (size_t i = 0; i < views.size(); ++i) dviews.push_back(on_device(views[i], bufs[owner[i]], dev[owner[i]]));

    auto rows = block_pairs(rng, nb, nb, uniform_int(rng, 0, nb / 2), true);
    HostTensor map_cpu = mapping_tensor(rows);
    const std::pair<int64_t, int64_t> bad[] = {{nb + 2, rows.empty() ? 0 : rows[0].second}, {0, -1}, {-3, 1}, {1, nb}};
    rows.insert(rows.begin() + int64_t(rng() % (rows.size() + 1)), bad[rng() % 4]);
    HostTensor map_gpu = mapping_tensor(rows);
    DeviceTensor dmap = DeviceTensor::mirror(map_gpu);

    fs::copy_blocks(views, map_cpu);
    fs::copy_blocks(dviews, dmap.ref);
    fsgpu::sync();
    const std::string what = "rep " + std::to_string(rep) + " blocks " + std::to_string(nb) + " bs " +
                             std::to_string(bs) + " H " + std::to_string(H) + " D " + std::to_string(D);
    for (size_t i = 0; i < bufs.size(); ++i) expect_same(what, "buffer " + std::to_string(i), bufs[i], dev[i]);
  }
}

TEST(GpuSwapBlocks, EveryDirectionPageableAndPinned) {
  auto rng = fstest::make_rng(0x5a4c);
  for (int rep = 0; rep < 36; ++rep) {
    const int dir = rep % 3;                 // 0: device -> host, 1: host -> device, 2: device -> device
    const bool pinned = (rep / 3) % 2 == 1;  // host memory registered with CUDA
    const int shape = rep / 6 % 3;           // the other side: padded NHD, HND seen as NHD, [bs, D, H] seen as NHD
    const int64_t bs = pick<int64_t>(rng, {1, 5, 16}), H = pick<int64_t>(rng, {1, 3}), D = pick<int64_t>(rng, {8, 16, 40});
    const int64_t na = uniform_int(rng, 2, 9), nh = uniform_int(rng, 2, 9);
    HostTensor a = HostTensor::zeros(DType::f16, {na, 2, bs, H, D});  // the device-side cache, K half used
    HostTensor b = shape == 0 ? HostTensor::strided(DType::f16, {nh, bs, H, D}, {bs * H * (D + 2) + 4, H * (D + 2), D + 2, 1})
                   : shape == 1 ? HostTensor::strided(DType::f16, {nh, H, bs, D}, {H * bs * (D + 2) + 4, bs * (D + 2), D + 2, 1})
                                : HostTensor::zeros(DType::f16, {nh, bs, D, H});
    const TensorRef av = a.ref.select(1, 0);
    const TensorRef bv = shape == 0 ? b.ref : shape == 1 ? b.ref.permute({0, 2, 1, 3}) : b.ref.permute({0, 1, 3, 2});
    fill_random_bytes(a, rng);
    fill_random_bytes(b, rng);
    const bool a_is_src = dir != 1;
    const int64_t src_blocks = a_is_src ? na : nh, dst_blocks = a_is_src ? nh : na;
    const int64_t n = uniform_int(rng, 0, std::min(na, nh));
    HostTensor map = mapping_tensor(block_pairs(rng, src_blocks, dst_blocks, n, false));

    HostTensor ra = a.clone(), rb = b.clone();  // the reference's run
    const TensorRef rav = on_clone(av, a, ra), rbv = on_clone(bv, b, rb);
    fs::swap_blocks(a_is_src ? rav : rbv, a_is_src ? rbv : rav, map);

    DeviceTensor da = DeviceTensor::mirror(a), db = DeviceTensor::mirror(b);
    const TensorRef gav = on_device(av, a, da), gbv = dir == 2 ? on_device(bv, b, db) : bv;
    if (pinned) ASSERT_EQ(cudaHostRegister(b.bytes->data(), b.bytes->size(), cudaHostRegisterDefault), cudaSuccess);
    fs::swap_blocks(a_is_src ? gav : gbv, a_is_src ? gbv : gav, map);
    fsgpu::sync();
    if (pinned) ASSERT_EQ(cudaHostUnregister(b.bytes->data()), cudaSuccess);

    const std::string what = std::string(dir == 0 ? "device->host" : dir == 1 ? "host->device" : "device->device") +
                             (pinned ? " pinned" : " pageable") + (shape == 1 ? " hnd" : shape == 2 ? " transposed" : "") + " bs " +
                             std::to_string(bs) + " H " + std::to_string(H) + " D " + std::to_string(D);
    expect_same(what, "device cache", ra, da);
    if (dir == 2) {
      expect_same(what, "second device cache", rb, db);
    } else {
      const std::string d = diff_storage("host cache", rb, b);
      EXPECT_TRUE(d.empty()) << what << ": " << d << seed_note();
    }
  }
}

namespace {

// Runs advance_step on device mirrors of `s` (num_seqs, num_queries, bs) and compares every
// buffer with `want` (the expected host state).
void expect_step(const std::string& what, const StepBuffers& s, const StepBuffers& want, int64_t num_seqs,
                 int64_t num_queries, int64_t bs) {
  std::vector<DeviceTensor> d;
  for (const HostTensor* t : s.all()) d.push_back(DeviceTensor::mirror(*t));
  fs::AdvanceStepParams p = fstest::step_params(s, num_seqs, num_queries, bs);
  TensorRef* refs[] = {&p.input_tokens, &p.input_positions, &p.slot_mapping, &p.seq_lens, &p.sampled_token_ids, &p.block_tables};
  for (size_t i = 0; i < d.size(); ++i) *refs[i] = d[i].ref;
  fs::advance_step(p);
  fsgpu::sync();
  const char* names[] = {"input_tokens", "input_positions", "slot_mapping", "seq_lens", "sampled_token_ids", "block_tables"};
  for (size_t i = 0; i < d.size(); ++i) expect_same(what, names[i], *want.all()[i], d[i]);
}


}  // namespace

TEST(GpuAdvanceStep, EqualsCpuWithPaddingRows) {
  auto rng = fstest::make_rng(0xadd6);
  for (int rep = 0; rep < 30; ++rep) {
    const int64_t num_seqs = uniform_int(rng, 1, 300), num_queries = uniform_int(rng, 0, num_seqs);
    const int64_t bs = pick<int64_t>(rng, {1, 5, 16}), max_blocks = uniform_int(rng, 1, 6);
    StepBuffers s = fstest::step_buffers(rng, num_seqs + 2, num_queries, bs, max_blocks);
    StepBuffers want = s.clone();
    fs::advance_step(fstest::step_params(want, num_seqs, num_queries, bs));
    expect_step("rep " + std::to_string(rep) + " num_seqs " + std::to_string(num_seqs) + " num_queries " +
                    std::to_string(num_queries) + " bs " + std::to_string(bs),
                s, want, num_seqs, num_queries, bs);
  }
}

// A row whose next position has no block in its table row: on CUDA it becomes a padding row
// (token 0, position 0, slot -1, seq_len untouched) and the table is never read past the row.
TEST(GpuAdvanceStep, RowPastItsBlockTableBecomesPadding) {
  auto rng = fstest::make_rng(0xadd7);
  const int64_t num_seqs = 6, num_queries = 5, bs = 4, max_blocks = 2;
  StepBuffers s = fstest::step_buffers(rng, num_seqs + 2, num_queries, bs, max_blocks);
  for (const auto& [row, len] : {std::pair<int64_t, int32_t>{1, 8}, {3, -5}})
    *static_cast<int32_t*>(s.lens.ref.at(row)) = len;
  StepBuffers want = s.clone();
  for (int64_t row : {1, 3}) *static_cast<int32_t*>(want.lens.ref.at(row)) = 0;  // valid for the reference
  fs::advance_step(fstest::step_params(want, num_seqs, num_queries, bs));
  for (const auto& [row, len] : {std::pair<int64_t, int32_t>{1, 8}, {3, -5}}) {
    *static_cast<int32_t*>(want.lens.ref.at(row)) = len;
    *static_cast<int64_t*>(want.tokens.ref.at(row)) = 0;
    *static_cast<int64_t*>(want.positions.ref.at(row)) = 0;
    *static_cast<int64_t*>(want.slots.ref.at(row)) = -1;
  }
  expect_step("bad rows 1 (past the table) and 3 (negative length)", s, want, num_seqs, num_queries, bs);
}

TEST(GpuQuantizeInt8, EqualsCpu) {
  auto rng = fstest::make_rng(0x9a48);
  for (int rep = 0; rep < 12; ++rep) {
    const DType t = pick(rng, {DType::f16, DType::bf16, DType::f32});
    const bool dense = rep % 2 == 0;
    const int64_t T = uniform_int(rng, 1, 300), H = uniform_int(rng, 1, 8), D = pick<int64_t>(rng, {8, 40, 64, 72, 128});
    HostTensor x = dense ? HostTensor::zeros(t, {T, H, D}) : HostTensor::strided(t, {T, H, D}, {H * (D + 1) * 2, D + 1, 1});
    fstest::fill_uniform(x, rng, -30.0f, 30.0f);
    for (int64_t c = 0; c < D; ++c) x.set({0, 0, c}, 0.0f);  // an all-zero row: scale 1
    if (T > 1) x.set({1, 0, 3}, NAN);
    HostTensor out = dense ? HostTensor::zeros(DType::i8, {T, H, D}) : HostTensor::strided(DType::i8, {T, H, D}, {H * D + 3, D, 1});
    HostTensor scale = HostTensor::strided(DType::f32, {T, H}, {1, T + 1});  // head-major storage
    DeviceTensor dx = DeviceTensor::mirror(x), dout = DeviceTensor::poisoned_mirror(out);
    DeviceTensor dscale = DeviceTensor::poisoned_mirror(scale);
    fs::quantize_int8(x, out, scale);
    fs::quantize_int8(dx.ref, dout.ref, dscale.ref);
    fsgpu::sync();
    const std::string what = std::string(fs::dtype_name(t)) + (dense ? " dense" : " padded") + " T " + std::to_string(T) +
                             " H " + std::to_string(H) + " D " + std::to_string(D);
    expect_same(what, "out", out, dout);
    expect_same(what, "scale", scale, dscale);
  }
}

// 64-bit offsets: a K/V-interleaved f16 cache over 2^31 bytes, written past 2 GiB by
// reshape_and_cache and copied across it by copy_blocks.
TEST(GpuLargeCache, OffsetsPast2GiB) {
  const int64_t bs = 16, H = 1, D = 64, block_bytes = 2 * bs * H * D * 2;  // [2, bs, H, D] f16
  const int64_t nb = (int64_t(1) << 31) / block_bytes + 4096;
  auto buf = fsgpu::device_alloc(size_t(nb * block_bytes));
  ASSERT_EQ(cudaMemset(buf.get(), 0xFF, size_t(nb * block_bytes)), cudaSuccess);
  const fs::Device gpu{fs::DeviceType::cuda, 0};
  const TensorRef cache = TensorRef::contiguous(buf.get(), DType::f16, {nb, 2, bs, H, D}, gpu);
  char* base = static_cast<char*>(buf.get());

  auto rng = fstest::make_rng(0x2a1e);
  const int64_t T = 3;
  HostTensor key = HostTensor::zeros(DType::f16, {T, H, D}), value = HostTensor::zeros(DType::f16, {T, H, D});
  fstest::fill_uniform(key, rng, -4.0f, 4.0f);
  fstest::fill_uniform(value, rng, -4.0f, 4.0f);
  const int64_t slot_of[T] = {(nb - 1) * bs + 3, (nb - 2) * bs + 15, 5};
  HostTensor slots = HostTensor::zeros(DType::i64, {T});
  for (int64_t i = 0; i < T; ++i) *static_cast<int64_t*>(slots.ref.at(i)) = slot_of[i];
  DeviceTensor dkey = DeviceTensor::mirror(key), dvalue = DeviceTensor::mirror(value), dslots = DeviceTensor::mirror(slots);
  fs::CacheWriteParams p;
  p.key = dkey.ref;
  p.value = dvalue.ref;
  p.key_cache = cache.select(1, 0);
  p.value_cache = cache.select(1, 1);
  p.slot_mapping = dslots.ref;
  fs::reshape_and_cache(p);
  fsgpu::sync();
  std::vector<unsigned char> row(static_cast<size_t>(D * 2));
  for (int64_t i = 0; i < T; ++i)
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t b = slot_of[i] / bs, o = slot_of[i] % bs;
      const int64_t off = b * block_bytes + (kv * bs + o) * H * D * 2;
      ASSERT_EQ(cudaMemcpy(row.data(), base + off, row.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      const HostTensor& src = kv == 0 ? key : value;
      EXPECT_EQ(std::memcmp(row.data(), src.ref.at(i, 0, 0), row.size()), 0)
          << (kv == 0 ? "key" : "value") << " row of token " << i << " at byte offset " << off;
    }

  HostTensor map = mapping_tensor({{nb - 1, 1}, {nb - 2, nb - 3}});
  DeviceTensor dmap = DeviceTensor::mirror(map);
  const std::vector<TensorRef> caches{cache.select(1, 0), cache.select(1, 1)};
  fs::copy_blocks(caches, dmap.ref);
  fsgpu::sync();
  std::vector<unsigned char> from(static_cast<size_t>(block_bytes)), to(static_cast<size_t>(block_bytes));
  for (const auto& [s, d] : {std::pair<int64_t, int64_t>{nb - 1, 1}, {nb - 2, nb - 3}}) {
    ASSERT_EQ(cudaMemcpy(from.data(), base + s * block_bytes, from.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(to.data(), base + d * block_bytes, to.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(from, to) << "block " << s << " copied to block " << d;
  }
}
