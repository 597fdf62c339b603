#!/usr/bin/env bash
# The ncu evidence for the rows that miss their targets (issues 14, 15), one device call (~6 min):
#  - prefill_tma at D = 128 S = 2k (B 8, H 16: 2048 CTAs of 16 row tiles; a fit over the H100
#    rows of 2026-12-07 gives ~1.5 us per 128-key tile and ~5.5-6.5 us per CTA, the start and end
#    a CTA pays whatever its tiles): non-causal, one CTA per item and persistent
#    (FLASHSERVE_PREFILL_PERSISTENT=1, 4.7% slower there), and the chunked-local row (0.46 of the
#    plain path per FLOP on the H200);
#  - decode: bf16 B1 L32k (66% of the copy ceiling), fp8 verify q8 B64 L4k (0.54 of decode's
#    bandwidth), MLA H16 B64 L4k fp8 latent (39%).
# With the argument `tma` instead (session 28's rows, ~3 min warm):
#  - bf16 B1 L32k on the decode TMA form (FLASHSERVE_DECODE_TMA=1), beside the ring's run above:
#    DRAM %, SM activity, and where its stalls moved (the tile loop's top held 27% on the ring);
#  - short verify q4 (B256 L64, 16 packed rows, one 16-key tile per warp): fp8 85.0 us against
#    bf16's 73.6 (H200, RESULTS.md 2026-11-25 22:10), 1.16x slower where issue 15 wants fp8 never
#    slower; q1 differs by 1.5% only, so the 12 more active rows' staging (stage_rows_fp8) and
#    per-row work are the suspects: the source views of both say.
# Returns ncu.tgz (summary.txt, source.csv, attn_bench.txt per run) and ncu.txt (headlines).
cd "$(dirname "$0")/../.."
out=${OUT:-build/session27-ncu}
mkdir -p "$out"
t0=$SECONDS
run() {  # name kernel-regex env spec
  local name=$1 kernel=$2 env=$3 spec=$4
  echo "== $name ($env) at $((SECONDS - t0)) s" | tee -a "$out/ncu.txt"
  env $env OUT=/tmp/ncu/$name timeout 150 tools/gpu-ncu --kernel "$kernel" "name=$name,$spec" 2>&1 | tail -14 |
    tee -a "$out/ncu.txt"
}
p=op=prefill,H=16,Hkv=16,D=128,B=8,S=2048
d="op=decode,H=32,Hkv=8,D=128,block=16"
if [ "${1:-}" = tma ]; then
  run bf16_b1_l32k_tma decode_fwd "FLASHSERVE_DECODE_TMA=1 FLASHSERVE_DECODE_CLUSTER=0" "$d,B=1,L=32768,kv=bf16"
  run bf16_q4_b256_l64 decode_fwd FLASHSERVE_DECODE_CLUSTER=0 "$d,B=256,L=64,kv=bf16,Q=4"
  run fp8_q4_b256_l64 decode_fwd FLASHSERVE_DECODE_CLUSTER=0 "$d,B=256,L=64,kv=fp8,Q=4"
  tar czf "$out/ncu.tgz" -C /tmp ncu
  echo "done at $((SECONDS - t0)) s" | tee -a "$out/ncu.txt"
  exit 0
fi
run d128_s2k prefill_tma FLASHSERVE_PREFILL_PERSISTENT=0 "$p"
run d128_s2k_pers prefill_tma FLASHSERVE_PREFILL_PERSISTENT=1 "$p"
run chunk_s2kc prefill_tma FLASHSERVE_PREFILL_PERSISTENT=0 "$p,causal=1,mod=chunk,W=512"
run bf16_b1_l32k decode_fwd FLASHSERVE_DECODE_CLUSTER=0 "$d,B=1,L=32768,kv=bf16"
run fp8_q8_b64_l4k decode_fwd FLASHSERVE_DECODE_CLUSTER=0 "$d,B=64,L=4096,kv=fp8,Q=8"
run mla16_fp8_b64 decode_mla FLASHSERVE_DECODE_CLUSTER=0 "op=decode,Hkv=1,D=64,block=64,mla=1,H=16,B=64,L=4096,kv=fp8"
tar czf "$out/ncu.tgz" -C /tmp ncu
echo "done at $((SECONDS - t0)) s" | tee -a "$out/ncu.txt"
