#!/usr/bin/env bash
# One device call (~6 min on an H200): build, the persistent prefill forms' tests forced on
# (FLASHSERVE_PREFILL_PERSISTENT=1), the A/B of off / on on bench/specs/persistent_ab.txt (ab.txt),
# then racecheck and memcheck of the forced-on tests and the attention fuzz. PARTS
# (switch-lib.sh); session25-run.sh runs both pending scripts' parts in one call.
set -o pipefail
cd "$(dirname "$0")/../.."
. bench/pending/switch-lib.sh
switch_setup persistent FLASHSERVE_PREFILL_PERSISTENT summary.txt
say "$(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader)"
build_cuda_dev /tmp/c.log /tmp/b.log attn_bench test_gpu_prefill test_gpu_prefill_fp8 test_gpu_attention ||
  { tail -30 /tmp/c.log; grep -m3 -A12 error /tmp/b.log; exit 1; }
say "build $((SECONDS - t0)) s"
if has tests; then
  run prefill_on.log 150 test_gpu_prefill
  run fp8_on.log 120 test_gpu_prefill_fp8
fi
has ab && ab bench/specs/persistent_ab.txt ab.txt
if has san; then
  sanitize racecheck_prefill.log racecheck 120 test_gpu_prefill '*FullyMasked*:*Splits*:*ThreeWarpgroup*'
  sanitize racecheck_fp8.log racecheck 90 test_gpu_prefill_fp8 '*VarlenCausal*:*OutDtypes*'
  sanitize memcheck_prefill.log memcheck 120 test_gpu_prefill '*PagedBlockSizesOnPrefillTma*:*FullyMasked*:*Splits*'
  run attention_on.log 120 test_gpu_attention
fi
switch_done
