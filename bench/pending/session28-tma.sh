#!/usr/bin/env bash
# The decode kernel's TMA form (issue 15; decode_config.hpp: decode_tma_tiling), its first GPU run:
# test_gpu_decode forced on (FLASHSERVE_DECODE_TMA=1: the new TmaFormPagesAndTails and every case
# it can take), memcheck and racecheck of its cases, the Python drop-ins' kvcache and graph suites
# on it, then the A/B against the cp.async ring on
# one build (the env switch; the other kernels' SASS is byte-identical to 4aead93's, checked
# with cuobjdump). Run after session27-verify.sh on the same warm machine (~3 min more).
cd "$(dirname "$0")/../.."
. tools/lib/cuda-dev.sh
use_cuda_toolkit
t0=$SECONDS
cmake --preset cuda-dev -DFLASHSERVE_PYTHON=ON >/tmp/tma-configure.log 2>&1 || { tail -20 /tmp/tma-configure.log; exit 1; }
cmake --build build/cuda-dev -j "$(nproc)" --target test_gpu_decode attn_bench _C >/tmp/tma-build.log 2>&1 ||
  { tail -30 /tmp/tma-build.log; exit 1; }
echo "build ok ($((SECONDS - t0)) s)"
bin=build/cuda-dev/tests/gpu/test_gpu_decode
FLASHSERVE_DECODE_TMA=1 timeout 300 $bin 2>&1 | grep -E "FAILED|PASSED|Failure|error" | head -20
# with the splits merged in clusters too (the merge's partials in the TMA form's aligned area)
FLASHSERVE_DECODE_TMA=1 FLASHSERVE_DECODE_CLUSTER=1 timeout 200 $bin \
  --gtest_filter='*Cluster*:*LargeBatchLongKv*:*TmaForm*' 2>&1 | grep -E "FAILED|PASSED|Failure" | head -8
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  FLASHSERVE_DECODE_TMA=1 timeout 200 "$san" --tool $tool --error-exitcode 9 $bin \
    --gtest_filter='*TmaForm*:*BadBlock*:*VarlenContiguousAndEmpty*' 2>&1 | grep -E "SUMMARY|FAILED|PASSED" | head -4
done
# the drop-ins on the form: inference mode, torch.compile, CUDA-graph capture and replay
FLASHSERVE_DECODE_TMA=1 FLASHSERVE_PYTHONPATH=build/cuda-dev/python timeout 240 python3 -m pytest -q \
  tests/python/test_fa3_kvcache.py tests/python/test_torch_graphs.py tests/python/test_backend_graphs.py 2>&1 | tail -2
echo "tests done ($((SECONDS - t0)) s)"
tools/gpu-ab --specs bench/specs/decode_tma_ab.txt --env-variant tma="FLASHSERVE_DECODE_TMA=1" 2>&1 | tail -16
echo "done ($((SECONDS - t0)) s)"
