#!/usr/bin/env bash
# One device call (~5 min on an H200): decode's splits merged in a cluster
# (FLASHSERVE_DECODE_CLUSTER=1: the decode kernel, decode_mla_heads) under the decode and MLA
# tests, batch invariance and the attention fuzz; the A/B of off / on on
# bench/specs/cluster_ab.txt (cluster-ab.txt); racecheck and memcheck of the forced-on tests.
# PARTS="tests ab san" (default) or a subset; session25-run.sh runs both pending scripts' parts in
# one call. At most 8 files come back from $OUT: logs in one tarball, the summary grown in $OUT.
set -o pipefail
parts=${PARTS:-"tests ab san"}
has() { [[ " $parts " == *" $1 "* ]]; }
cd "$(dirname "$0")/../.."
. tools/lib/cuda-dev.sh
use_cuda_toolkit
out=${OUT:-/tmp/out}
logs=/tmp/cluster-logs
mkdir -p $out $logs
t0=$SECONDS
summary=$out/cluster-summary.txt  # grows in $OUT: it comes back even if the call is cut
say() { echo "$*" | tee -a $summary; }
build_cuda_dev /tmp/c.log /tmp/b.log attn_bench test_gpu_decode test_gpu_decode_mla test_gpu_attention test_gpu_batch_invariant ||
  { tail -30 /tmp/c.log; grep -m3 -A12 error /tmp/b.log; exit 1; }
say "build $((SECONDS - t0)) s"
run() {  # run <log> <timeout> <env> <binary>
  env $3 timeout $2 build/cuda-dev/tests/gpu/$4 >$logs/$1 2>&1
  local rc=$?
  [ $rc = 124 ] && hung=1  # a hang: no A/B of the same form (attn_bench has no timeout)
  say "$1: exit $rc ($((SECONDS - t0)) s) $(grep -E '^\[  (PASSED|FAILED) |gpu fuzz\] [0-9]+ cases' $logs/$1 | tr '\n' ' ')"
}
if has tests; then
  run decode_on.log 150 FLASHSERVE_DECODE_CLUSTER=1 test_gpu_decode
  run mla_on.log 150 FLASHSERVE_DECODE_CLUSTER=1 test_gpu_decode_mla
  run invariant_on.log 120 FLASHSERVE_DECODE_CLUSTER=1 test_gpu_batch_invariant
fi
if has ab && [ -z "${hung:-}" ]; then
  OUT=$logs/ab timeout 240 tools/gpu-ab --specs bench/specs/cluster_ab.txt --env-variant off="FLASHSERVE_DECODE_CLUSTER=0" \
    --env-variant on="FLASHSERVE_DECODE_CLUSTER=1" >$logs/gpu-ab.log 2>&1
  cp $logs/ab/ab.txt $out/cluster-ab.txt 2>/dev/null
  cat $out/cluster-ab.txt
fi
if has san; then
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  sanitize() {  # sanitize <log> <tool> <timeout> <binary> <filter>
    FLASHSERVE_DECODE_CLUSTER=1 timeout $3 $san --tool $2 --error-exitcode 9 build/cuda-dev/tests/gpu/$4 \
      --gtest_filter="$5" >$logs/$1 2>&1
    say "$1: exit $? ($((SECONDS - t0)) s) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) ' $logs/$1 | tr '\n' ' ')"
  }
  sanitize racecheck_decode.log racecheck 120 test_gpu_decode '*LargeBatchLongKv*:*VarlenContiguousAndEmpty*'
  sanitize racecheck_mla.log racecheck 120 test_gpu_decode_mla '*HeadsQlenBlockSizesSplits*:*Fp8LatentHeadsQlen*'
  sanitize memcheck_decode.log memcheck 120 test_gpu_decode '*LargeBatchLongKv*:*VarlenContiguousAndEmpty*:*BadBlockIndex*'
  run attention_on.log 120 FLASHSERVE_DECODE_CLUSTER=1 test_gpu_attention
fi
say "cluster-run ($parts) $((SECONDS - t0)) s"
tar czf $out/cluster-logs.tgz -C $logs . 2>/dev/null
cat $summary
