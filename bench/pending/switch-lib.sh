# Sourced by the pending scripts that test and time a launcher switch (an environment variable
# VAR=0/1), from the repository root: switch_setup <tag> <VAR> [summary file name] sets up the
# logs (/tmp/<tag>-logs) and the summary (grown in $OUT: it comes back even if the call is cut);
# then run, sanitize (VAR=1 for both unless the env says otherwise) and ab. PARTS="tests ab san"
# (default) or a subset; `has PART` tests it.
. tools/lib/cuda-dev.sh
use_cuda_toolkit
parts=${PARTS:-"tests ab san"}
has() { [[ " $parts " == *" $1 "* ]]; }
switch_setup() {  # switch_setup <tag> <VAR> [summary name]
  tag=$1 var=$2
  out=${OUT:-/tmp/out}
  logs=/tmp/$tag-logs
  mkdir -p $out $logs
  t0=$SECONDS
  summary=$out/${3:-$tag-summary.txt}
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
}
say() { echo "$*" | tee -a $summary; }
run() {  # run <log> <timeout> <binary>: with VAR=1
  env $var=1 timeout $2 build/cuda-dev/tests/gpu/$3 >$logs/$1 2>&1
  local rc=$?
  [ $rc = 124 ] && hung=1  # a hang: no A/B of the same form (attn_bench has no timeout)
  say "$1: exit $rc ($((SECONDS - t0)) s) $(grep -E '^\[  (PASSED|FAILED) |gpu fuzz\] [0-9]+ cases' $logs/$1 | tr '\n' ' ')"
}
sanitize() {  # sanitize <log> <tool> <timeout> <binary> <filter>: with VAR=1
  env $var=1 timeout $3 $san --tool $2 --error-exitcode 9 build/cuda-dev/tests/gpu/$4 --gtest_filter="$5" >$logs/$1 2>&1
  say "$1: exit $? ($((SECONDS - t0)) s) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) ' $logs/$1 | tr '\n' ' ')"
}
ab() {  # ab <specs> <table name in $OUT> [NAME="K=V .." ...]: off / on (and more variants) on one build, skipped after a hang
  [ -n "${hung:-}" ] && { say "A/B skipped: a test hung"; return; }
  local specs=$1 table=$2 more=()
  shift 2
  for v in "$@"; do more+=(--env-variant "$v"); done
  OUT=$logs/ab timeout 300 tools/gpu-ab --specs $specs --env-variant off="$var=0" --env-variant on="$var=1" "${more[@]}" \
    >$logs/gpu-ab.log 2>&1
  cp $logs/ab/ab.txt $out/$table 2>/dev/null
  cat $out/$table
}
switch_done() {  # the tarball of the logs, the summary
  say "$tag ($parts) $((SECONDS - t0)) s"
  tar czf $out/$tag-logs.tgz -C $logs . 2>/dev/null
  cat $summary
}
