#!/usr/bin/env bash
# ncu evidence for the next decode steps (issue 15), one device call (~3 min warm):
#  - bf16 B1 L32k on the TMA form (FLASHSERVE_DECODE_TMA=1), beside session27-ncu.sh's ring run:
#    DRAM %, SM activity, and where its stalls moved (the tile loop's top held 27% on the ring);
#  - short verify q4 (B256 L64, 16 packed rows, one 16-key tile per warp): fp8 85.0 us against
#    bf16's 73.6 (H200, RESULTS.md 2026-11-25 22:10), 1.16x slower where issue 15 wants fp8 never slower;
#    q1 differs by 1.5% only, so the 12 more active rows' staging (stage_rows_fp8) and per-row
#    work are the suspects: the source views of both say.
# Returns ncu.tgz (summary.txt, source.csv, attn_bench.txt per run) and ncu.txt (headlines).
cd "$(dirname "$0")/../.."
out=${OUT:-build/session28-ncu}
mkdir -p "$out"
t0=$SECONDS
run() {  # name kernel-regex env spec
  local name=$1 kernel=$2 env=$3 spec=$4
  echo "== $name ($env) at $((SECONDS - t0)) s" | tee -a "$out/ncu.txt"
  env $env OUT=/tmp/ncu28/$name timeout 150 tools/gpu-ncu --kernel "$kernel" "name=$name,$spec" 2>&1 | tail -14 |
    tee -a "$out/ncu.txt"
}
d="op=decode,H=32,Hkv=8,D=128,block=16"
run bf16_b1_l32k_tma decode_fwd "FLASHSERVE_DECODE_TMA=1 FLASHSERVE_DECODE_CLUSTER=0" "$d,B=1,L=32768,kv=bf16"
run bf16_q4_b256_l64 decode_fwd FLASHSERVE_DECODE_CLUSTER=0 "$d,B=256,L=64,kv=bf16,Q=4"
run fp8_q4_b256_l64 decode_fwd FLASHSERVE_DECODE_CLUSTER=0 "$d,B=256,L=64,kv=fp8,Q=4"
tar czf "$out/ncu.tgz" -C /tmp ncu28
echo "done at $((SECONDS - t0)) s" | tee -a "$out/ncu.txt"
