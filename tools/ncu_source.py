#!/usr/bin/env python3
"""Maps an ncu per-SASS-instruction CSV (tools/gpu-ncu's source.csv) to source lines.

ncu's device report carries SASS without line information when the build had none; the same
tree compiled here with -lineinfo gives the kernel's SASS in the same order, annotated by
nvdisasm -gi, so the two are matched instruction by instruction (the opcode sequence is checked).

    tools/ncu_source.py source.csv --cubin k.cubin --function prefill_tma --top 30

Make the cubin with the kernel's compile line plus `-lineinfo -cubin -o k.cubin` (nvcc; the
file the kernel lives in), and nvdisasm on PATH or with --nvdisasm (pip's
nvidia-cuda-nvdisasm / cuobjdump wheels carry it). Prints per source line: executed warp
instructions, warp stall samples (all, and the top reasons), and the share of the kernel's
samples; then the same per file. Without --cubin, prints per SASS opcode only.
"""
import argparse
import collections
import csv
import re
import subprocess
import sys


def read_ncu(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(names) or not r[0].startswith("0x"):
            continue
        out.append(dict(zip(names, r)))
    return out


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def opcode(text):
    t = text.strip()
    if t.startswith("@"):
        t = t.split(None, 1)[1] if " " in t else t
    return t.split(None, 1)[0].split(".")[0] if t else ""


def disasm(cubin, function, nvdisasm):
    text = subprocess.run([nvdisasm, "-gi", "-c", cubin], check=True, capture_output=True, text=True).stdout
    # Before an instruction whose location changed, nvdisasm -gi prints its inline chain, one
    # "//## File" line per level, innermost first: the instruction gets the innermost of ours.
    funcs, cur, loc, chain = {}, None, ("?", 0), []
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            cur, chain = m.group(1), []
            funcs[cur] = []
            continue
        if "//## File" in line:
            chain += [(f, int(n)) for f, n in re.findall(r'"([^"]+)", line (\d+)', line)]
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur is not None:
            if chain:
                ours = [x for x in chain if "/src/" in x[0] or "/include/flashserve/" in x[0]]
                loc, chain = (ours or chain)[0], []
            funcs[cur].append((loc, m.group(2)))
    picks = [k for k in funcs if function in k]
    if not picks:
        sys.exit(f"ncu_source: no function matching {function!r} in {cubin}")
    if len(picks) > 1:
        print(f"ncu_source: {len(picks)} functions match; taking the one whose length matches", file=sys.stderr)
    return picks, funcs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--cubin")
    ap.add_argument("--function", default="")
    ap.add_argument("--nvdisasm", default="nvdisasm")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    rows = read_ncu(a.csv)
    stall_cols = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] if rows else []
    total = sum(num(r.get("Warp Stall Sampling (All Samples)", "0")) for r in rows) or 1.0
    key = lambda r: opcode(r.get("Source", ""))
    sass = [(key(r), r) for r in rows]

    if not a.cubin:
        by = collections.defaultdict(lambda: [0.0, 0.0])
        for op, r in sass:
            by[op][0] += num(r.get("Instructions Executed", "0"))
            by[op][1] += num(r.get("Warp Stall Sampling (All Samples)", "0"))
        print(f"{'opcode':<14}{'executed':>14}{'samples':>10}{'share':>8}")
        for op, (ex, sm) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"{op:<14}{ex:14.0f}{sm:10.0f}{sm / total:8.1%}")
        return

    picks, funcs = disasm(a.cubin, a.function, a.nvdisasm)
    chosen = next((k for k in picks if len(funcs[k]) == len(sass)), None)
    if chosen is None:
        sys.exit(f"ncu_source: no matching function has {len(sass)} instructions: "
                 + ", ".join(f"{k[:60]}.. {len(funcs[k])}" for k in picks))
    local = funcs[chosen]
    mismatch = sum(1 for (op, _), (_, t) in zip(sass, local) if op != opcode(t))
    if mismatch > len(sass) // 50:
        sys.exit(f"ncu_source: {mismatch} of {len(sass)} opcodes differ: not the same build")

    by_line = collections.defaultdict(lambda: collections.Counter())
    for (op, r), (loc, _) in zip(sass, local):
        c = by_line[loc]
        c["executed"] += num(r.get("Instructions Executed", "0"))
        c["samples"] += num(r.get("Warp Stall Sampling (All Samples)", "0"))
        for s in stall_cols:
            c[s] += num(r.get(s, "0"))
    print(f"{chosen[:100]}: {len(sass)} SASS instructions, {total:.0f} stall samples ({mismatch} opcode mismatches)")
    print(f"{'file:line':<48}{'executed':>12}{'samples':>9}{'share':>7}  top stalls")
    for loc, c in sorted(by_line.items(), key=lambda kv: -kv[1]["samples"])[: a.top]:
        tops = sorted(((c[s], s[6:]) for s in stall_cols), reverse=True)[:3]
        where = f"{loc[0].rsplit('/', 1)[-1]}:{loc[1]}"
        print(f"{where:<48}{c['executed']:12.0f}{c['samples']:9.0f}{c['samples'] / total:7.1%}  "
              + ", ".join(f"{n} {v / max(c['samples'], 1):.0%}" for v, n in tops if v > 0))
    by_file = collections.Counter()
    for loc, c in by_line.items():
        by_file[loc[0].rsplit("/", 1)[-1]] += c["samples"]
    print("per file: " + ", ".join(f"{f} {v / total:.0%}" for f, v in by_file.most_common(8)))


if __name__ == "__main__":
    main()
