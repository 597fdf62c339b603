#!/usr/bin/env bash
# Both pending scripts in one device call (machines were scarce: one start for both): one build
# of every target they use, then the forced-on tests and A/Bs of both, then the sanitizers, in
# the order of their value should the call be cut (each summary grows in $OUT as it goes).
# Returns cluster-summary.txt, cluster-ab.txt, cluster-logs.tgz, summary.txt, ab.txt,
# persistent-logs.tgz (6 of the 8 files a call returns).
cd "$(dirname "$0")/../.."
. tools/lib/cuda-dev.sh
use_cuda_toolkit
t0=$SECONDS
build_cuda_dev /tmp/c.log /tmp/b.log attn_bench test_gpu_decode test_gpu_decode_mla test_gpu_attention \
  test_gpu_batch_invariant test_gpu_prefill test_gpu_prefill_fp8 ||
  { tail -30 /tmp/c.log; grep -m3 -A12 error /tmp/b.log; exit 1; }
echo "build $((SECONDS - t0)) s"
PARTS="tests ab" bash bench/pending/cluster-run.sh
PARTS="ab tests" bash bench/pending/persistent-run.sh
PARTS="san" bash bench/pending/cluster-run.sh
PARTS="san" bash bench/pending/persistent-run.sh
echo "session25-run $((SECONDS - t0)) s"
