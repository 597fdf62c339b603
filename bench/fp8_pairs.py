#!/usr/bin/env python3
"""fp8 e4m3 against bf16 paged decode, same shapes, one attn_bench process (GPU machine).

    python3 bench/fp8_pairs.py [--attn-bench build/cuda-dev/bench/attn_bench] [--min-iters 20]

Runs each shape with kv=bf16 and kv=fp8 (H = 32, H_kv = 8, D = 128; descales absent) and prints
per shape: the kernel, the time of each, KV GB/s of each (bytes as stored: 2 B per element for
bf16, 1 for fp8) and the time ratio fp8 / bf16 (the issue's target: <= 0.55 at the headline
shapes, < 1 everywhere). The raw JSON rows go to --jsonl when given. The shapes cover the
headline decode shapes, blocks 1 and 256, short contexts and verify steps (Q > 1, causal).
"""
import argparse
import json
import subprocess
import sys

SHAPES = [  # (B, L, block, Q)
    (1, 32768, 16, 1), (16, 8192, 16, 1), (64, 4096, 16, 1), (256, 1024, 16, 1),
    (64, 4096, 1, 1), (64, 4096, 256, 1), (16, 8192, 1, 1),
    (64, 256, 16, 1), (8, 128, 16, 1), (256, 64, 16, 1),
    (64, 4096, 16, 2), (64, 4096, 16, 4), (16, 1024, 16, 4), (64, 4096, 1, 4),
]


def spec(b, l, bs, q, kv):
    return (f"name=b{b}_l{l}_bs{bs}_q{q}_{kv},op=decode,B={b},L={l},H=32,Hkv=8,D=128,block={bs},Q={q},kv={kv}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attn-bench", default="build/cuda-dev/bench/attn_bench")
    ap.add_argument("--min-iters", default="20")
    ap.add_argument("--jsonl", default=None)
    a = ap.parse_args()
    specs = [spec(*s, kv) for s in SHAPES for kv in ("bf16", "fp8")]
    r = subprocess.run([a.attn_bench, "--min-iters", a.min_iters, *specs], capture_output=True, text=True)
    sys.stderr.write(r.stderr[-4000:])
    rows = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[row["config"]] = row
    if a.jsonl:
        with open(a.jsonl, "w") as f:
            f.write(r.stdout)
    print(f"{'B':>4} {'L':>6} {'bs':>4} {'Q':>2} | {'bf16 ms':>8} {'GB/s':>6} | {'fp8 ms':>8} {'GB/s':>6} | "
          f"{'fp8/bf16':>8} | kernels, splits")
    for b, l, bs, q in SHAPES:
        x, y = rows.get(f"b{b}_l{l}_bs{bs}_q{q}_bf16"), rows.get(f"b{b}_l{l}_bs{bs}_q{q}_fp8")
        if not x or not y or x.get("status") != "ok" or y.get("status") != "ok":
            print(f"{b:>4} {l:>6} {bs:>4} {q:>2} | missing: {x and x.get('error')} / {y and y.get('error')}")
            continue
        elems = 2 * b * l * 8 * 128  # K and V elements read
        tb, tf = x["time_ms"], y["time_ms"]
        print(f"{b:>4} {l:>6} {bs:>4} {q:>2} | {tb:8.4f} {elems * 2 / tb / 1e6:6.0f} | {tf:8.4f} "
              f"{elems / tf / 1e6:6.0f} | {tf / tb:8.3f} | {x['kernel']}/{y['kernel']}, "
              f"{x.get('num_splits')}/{y.get('num_splits')}")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
