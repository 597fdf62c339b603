#!/usr/bin/env bash
# One device call (~5 min on an H200): decode's splits merged in a cluster
# (FLASHSERVE_DECODE_CLUSTER=1: the decode kernel, decode_mla_heads) under the decode and MLA
# tests, batch invariance and the attention fuzz, the decode tests again on eight-warp CTAs
# (FLASHSERVE_DECODE_WARPS8=1); the A/B of off / on / w8 (both) on bench/specs/cluster_ab.txt
# (cluster-ab.txt); racecheck and memcheck of the forced-on tests.
# PARTS (switch-lib.sh); session25-run.sh runs both pending scripts' parts in one call.
set -o pipefail
cd "$(dirname "$0")/../.."
. bench/pending/switch-lib.sh
switch_setup cluster FLASHSERVE_DECODE_CLUSTER
build_cuda_dev /tmp/c.log /tmp/b.log attn_bench test_gpu_decode test_gpu_decode_mla test_gpu_attention test_gpu_batch_invariant ||
  { tail -30 /tmp/c.log; grep -m3 -A12 error /tmp/b.log; exit 1; }
say "build $((SECONDS - t0)) s"
if has tests; then
  run decode_on.log 150 test_gpu_decode
  var="FLASHSERVE_DECODE_CLUSTER=1 FLASHSERVE_DECODE_WARPS8" run decode_w8.log 150 test_gpu_decode
  run mla_on.log 150 test_gpu_decode_mla
  run invariant_on.log 120 test_gpu_batch_invariant
fi
has ab && ab bench/specs/cluster_ab.txt cluster-ab.txt w8="FLASHSERVE_DECODE_CLUSTER=1 FLASHSERVE_DECODE_WARPS8=1"
if has san; then
  sanitize racecheck_decode.log racecheck 120 test_gpu_decode '*LargeBatchLongKv*:*VarlenContiguousAndEmpty*'
  var="FLASHSERVE_DECODE_CLUSTER=1 FLASHSERVE_DECODE_WARPS8" \
    sanitize racecheck_decode_w8.log racecheck 120 test_gpu_decode '*LargeBatchLongKv*:*Int8TensorCores*'
  sanitize racecheck_mla.log racecheck 120 test_gpu_decode_mla '*HeadsQlenBlockSizesSplits*:*Fp8LatentHeadsQlen*'
  sanitize memcheck_decode.log memcheck 120 test_gpu_decode '*LargeBatchLongKv*:*VarlenContiguousAndEmpty*:*BadBlockIndex*'
  run attention_on.log 120 test_gpu_attention
fi
switch_done
