#!/usr/bin/env bash
# One device call: build, the persistent forms' tests (forced on, and the default selection),
# then the A/B of the three selections (auto / off / on) on bench/specs/persistent_ab.txt.
set -o pipefail
cd "$(dirname "$0")/../.."
. tools/lib/cuda-dev.sh
use_cuda_toolkit
out=${OUT:-/tmp/out}
mkdir -p $out
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
build_cuda_dev /tmp/c.log /tmp/b.log attn_bench test_gpu_prefill test_gpu_prefill_fp8 test_gpu_attention ||
  { tail -30 /tmp/c.log; grep -m3 -A12 error /tmp/b.log; exit 1; }
echo "build $((SECONDS - t0)) s"
run() {  # run <log> <timeout> <env> <binary>
  env $3 timeout $2 build/cuda-dev/tests/gpu/$4 >$out/$1 2>&1
  echo "$1: exit $? ($((SECONDS - t0)) s) $(grep -E '^\[  (PASSED|FAILED) ' $out/$1 | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]|gpu fuzz' $out/$1 | head -8
}
run prefill_on.log 150 FLASHSERVE_PREFILL_PERSISTENT=1 test_gpu_prefill
run fp8_on.log 120 FLASHSERVE_PREFILL_PERSISTENT=1 test_gpu_prefill_fp8
run prefill_auto.log 150 FLASHSERVE_PREFILL_PERSISTENT=auto test_gpu_prefill
run fp8_auto.log 120 FLASHSERVE_PREFILL_PERSISTENT=auto test_gpu_prefill_fp8
run attention_on.log 200 FLASHSERVE_PREFILL_PERSISTENT=1 test_gpu_attention
OUT=$out/ab tools/gpu-ab --specs bench/specs/persistent_ab.txt --env-variant off="FLASHSERVE_PREFILL_PERSISTENT=0" \
  --env-variant on="FLASHSERVE_PREFILL_PERSISTENT=1" 2>&1 | tail -40
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
sanitize() {  # sanitize <log> <tool> <timeout> <binary> <filter>
  FLASHSERVE_PREFILL_PERSISTENT=1 timeout $3 $san --tool $2 --error-exitcode 9 build/cuda-dev/tests/gpu/$4 \
    --gtest_filter="$5" >$out/$1 2>&1
  echo "$1: exit $? ($((SECONDS - t0)) s) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) ' $out/$1 | tr '\n' ' ')"
}
sanitize racecheck_prefill.log racecheck 150 test_gpu_prefill '*FullyMasked*:*Splits*:*ThreeWarpgroup*'
sanitize racecheck_fp8.log racecheck 120 test_gpu_prefill_fp8 '*VarlenCausal*:*OutDtypes*'
sanitize memcheck_prefill.log memcheck 150 test_gpu_prefill '*PagedBlockSizesOnPrefillTma*:*FullyMasked*:*Splits*'
echo "total $((SECONDS - t0)) s"
cat $out/ab/ab.txt
