#!/usr/bin/env bash
# One device call (~6 min on an H200): build, the persistent prefill forms' tests forced on, the
# A/B of off / on (FLASHSERVE_PREFILL_PERSISTENT) on bench/specs/persistent_ab.txt (ab.txt), then
# racecheck and memcheck of the forced-on tests. PARTS="tests ab san" (default) or a subset;
# session25-run.sh runs both pending scripts' parts in one call. At most 8 files come back from
# $OUT: the logs go into one tarball, the A/B table beside it, and the summary is printed last.
set -o pipefail
parts=${PARTS:-"tests ab san"}
has() { [[ " $parts " == *" $1 "* ]]; }
cd "$(dirname "$0")/../.."
. tools/lib/cuda-dev.sh
use_cuda_toolkit
out=${OUT:-/tmp/out}
logs=/tmp/persistent-logs
mkdir -p $out $logs
t0=$SECONDS
summary=$out/summary.txt  # grows in $OUT: it comes back even if the call is cut
say() { echo "$*" | tee -a $summary; }
say "$(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader)"
build_cuda_dev /tmp/c.log /tmp/b.log attn_bench test_gpu_prefill test_gpu_prefill_fp8 test_gpu_attention ||
  { tail -30 /tmp/c.log; grep -m3 -A12 error /tmp/b.log; exit 1; }
say "build $((SECONDS - t0)) s"
run() {  # run <log> <timeout> <env> <binary>
  env $3 timeout $2 build/cuda-dev/tests/gpu/$4 >$logs/$1 2>&1
  local rc=$?
  [ $rc = 124 ] && hung=1  # a hang: no A/B of the same form (attn_bench has no timeout)
  say "$1: exit $rc ($((SECONDS - t0)) s) $(grep -E '^\[  (PASSED|FAILED) |gpu fuzz\] [0-9]+ cases' $logs/$1 | tr '\n' ' ')"
}
if has tests; then
  run prefill_on.log 150 FLASHSERVE_PREFILL_PERSISTENT=1 test_gpu_prefill
  run fp8_on.log 120 FLASHSERVE_PREFILL_PERSISTENT=1 test_gpu_prefill_fp8
fi
if has ab && [ -z "${hung:-}" ]; then
  OUT=$logs/ab timeout 240 tools/gpu-ab --specs bench/specs/persistent_ab.txt --env-variant off="FLASHSERVE_PREFILL_PERSISTENT=0" \
    --env-variant on="FLASHSERVE_PREFILL_PERSISTENT=1" >$logs/gpu-ab.log 2>&1
  cp $logs/ab/ab.txt $out/ab.txt 2>/dev/null
  cat $out/ab.txt
fi
if has san; then
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  sanitize() {  # sanitize <log> <tool> <timeout> <binary> <filter>
    FLASHSERVE_PREFILL_PERSISTENT=1 timeout $3 $san --tool $2 --error-exitcode 9 build/cuda-dev/tests/gpu/$4 \
      --gtest_filter="$5" >$logs/$1 2>&1
    say "$1: exit $? ($((SECONDS - t0)) s) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) ' $logs/$1 | tr '\n' ' ')"
  }
  sanitize racecheck_prefill.log racecheck 120 test_gpu_prefill '*FullyMasked*:*Splits*:*ThreeWarpgroup*'
  sanitize racecheck_fp8.log racecheck 90 test_gpu_prefill_fp8 '*VarlenCausal*:*OutDtypes*'
  sanitize memcheck_prefill.log memcheck 120 test_gpu_prefill '*PagedBlockSizesOnPrefillTma*:*FullyMasked*:*Splits*'
  run attention_on.log 120 FLASHSERVE_PREFILL_PERSISTENT=1 test_gpu_attention
fi
say "persistent-run ($parts) $((SECONDS - t0)) s"
tar czf $out/logs.tgz -C $logs . 2>/dev/null
cat $summary
