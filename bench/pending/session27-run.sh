#!/usr/bin/env bash
# The second device call (~9 min on the warm machine of session26-run.sh): the persistent prefill
# forms with the ticket walk against one CTA per item (persistent-ab.txt: off / on over
# bench/specs/persistent_ab.txt), then session27-ncu.sh (ncu.txt, ncu.tgz) in what is left.
# Returns persistent-ab.txt, persistent-ab-logs.tgz, ncu.txt, ncu.tgz.
cd "$(dirname "$0")/../.."
out=${OUT:-build/session27-out}
mkdir -p "$out"
t0=$SECONDS
v=FLASHSERVE_PREFILL_PERSISTENT
OUT=/tmp/persistent-ab timeout 240 tools/gpu-ab --specs bench/specs/persistent_ab.txt --env-variant off="$v=0" \
  --env-variant on="$v=1" >/tmp/persistent-ab.log 2>&1
echo "gpu-ab exit $? ($((SECONDS - t0)) s)" | tee "$out/run.txt"
cp /tmp/persistent-ab/ab.txt "$out/persistent-ab.txt" 2>/dev/null && cat "$out/persistent-ab.txt"
tar czf "$out/persistent-ab-logs.tgz" -C /tmp persistent-ab persistent-ab.log 2>/dev/null
OUT=$out timeout $((585 - (SECONDS - t0))) bash bench/pending/session27-ncu.sh
echo "ncu exit $? ($((SECONDS - t0)) s)" | tee -a "$out/run.txt"
