#!/usr/bin/env bash
# The next session's first device call (~8 min on a fresh machine): the cluster placement A/B
# (cluster-ab.txt: off / on / spread / lb over bench/specs/cluster_ab.txt, attn_bench built once),
# then gpu-check's build and test steps (summary.txt, logs.tgz). The sanitizers and the Python
# step follow as two more calls on the warm machine:
#   GPU_CHECK_STEPS=sanitize tools/gpu-check   then   GPU_CHECK_STEPS=python tools/gpu-check
# Returns run.txt, cluster-ab.txt, cluster-ab-logs.tgz, summary.txt, logs.tgz.
cd "$(dirname "$0")/../.."
out=${OUT:-build/session26-out}
mkdir -p "$out"
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/run.txt"
c=FLASHSERVE_DECODE_CLUSTER p=FLASHSERVE_DECODE_CLUSTER_POLICY
OUT=/tmp/cluster-ab timeout 300 tools/gpu-ab --specs bench/specs/cluster_ab.txt --env-variant off="$c=0" \
  --env-variant on="$c=1" --env-variant spread="$c=1 $p=1" --env-variant lb="$c=1 $p=2" >/tmp/cluster-ab.log 2>&1
echo "gpu-ab exit $? ($((SECONDS - t0)) s)" | tee -a "$out/run.txt"
cp /tmp/cluster-ab/ab.txt "$out/cluster-ab.txt" 2>/dev/null && cat "$out/cluster-ab.txt"
tar czf "$out/cluster-ab-logs.tgz" -C /tmp cluster-ab cluster-ab.log 2>/dev/null
OUT=$out GPU_CHECK_STEPS=build,test FLASHSERVE_COMMIT=${FLASHSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} \
  timeout $((590 - (SECONDS - t0))) tools/gpu-check
echo "gpu-check exit $? ($((SECONDS - t0)) s)" | tee -a "$out/run.txt"
