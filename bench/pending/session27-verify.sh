#!/usr/bin/env bash
# The cluster merge's bits (the fix of test_backend_step_graph_replay_1000_steps' 1-ulp failure,
# bench/RESULTS.md 2026-12-08 00:21): test_gpu_decode's cluster and split tests (default, then
# every split count clustered), and the graph tests with the failing seed and one of 2026-11-25
# (the default, then every split count clustered).
# One call (~4 min on a fresh machine: the dev build of the library, the test and _C).
cd "$(dirname "$0")/../.."
. tools/lib/cuda-dev.sh
use_cuda_toolkit
t0=$SECONDS
cmake --preset cuda-dev -DFLASHSERVE_PYTHON=ON >/tmp/verify-configure.log 2>&1 || { tail -20 /tmp/verify-configure.log; exit 1; }
cmake --build build/cuda-dev -j "$(nproc)" --target test_gpu_decode _C >/tmp/verify-build.log 2>&1 ||
  { tail -30 /tmp/verify-build.log; exit 1; }
echo "build ok ($((SECONDS - t0)) s)"
bin=build/cuda-dev/tests/gpu/test_gpu_decode
$bin --gtest_filter='*Cluster*:*ShortSplits*:*LargeBatchLongKv*:*VerifyPastSixteen*' 2>&1 | tail -4
FLASHSERVE_DECODE_CLUSTER=1 $bin --gtest_filter='*ClusterMergeEquals*:*LargeBatchLongKv*' 2>&1 | tail -3
for run in "1317963718 0" "1871673196 0" "1317963718 1"; do  # seed, FLASHSERVE_DECODE_CLUSTER
  set -- $run
  FLASHSERVE_SEED=$1 FLASHSERVE_DECODE_CLUSTER=$2 FLASHSERVE_PYTHONPATH=build/cuda-dev/python timeout 150 \
    python3 -m pytest -q tests/python/test_backend_graphs.py 2>&1 | tail -2
done
echo "done ($((SECONDS - t0)) s)"
