#!/bin/bash
set -f
cmake --preset cuda-dev -DFLASHSERVE_TESTS=ON >/dev/null 2>&1
cmake --build --preset cuda-dev -j16 --target attn_bench > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
P="op=prefill,H=16,Hkv=16,D=128"
ncu --clock-control none -k regex:prefill_tma -c 1 --section SourceCounters --section WarpStateStats -o /tmp/rep build/cuda-dev/bench/attn_bench --min-iters 3 --warmup 1 "name=s512,$P,B=32,S=512" > /tmp/ncu.log 2>&1 || tail -20 /tmp/ncu.log
ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > $OUT/src.csv 2>/dev/null
ncu -i /tmp/rep.ncu-rep --page details --csv > $OUT/details.csv 2>/dev/null
ls -la $OUT
