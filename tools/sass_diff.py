#!/usr/bin/env python3
"""Compares the kernels of two CUDA objects (or cuobjdump -sass listings) instruction by instruction.

For a kernel change that must leave other kernels' code as it was (a new instantiation, a
refactor of shared device code): build the object before and after, then

    tools/sass_diff.py before.o after.o [--filter decode_fwd] [--cuobjdump PATH]

Prints per kernel (its mangled name): the instruction counts before and after and
`same` (identical streams), `sameops` (the same opcode counts in another order or other
registers) or `DIFF` with the opcodes whose counts changed (local loads and stores among them
show spills). Exits 1 when any kernel differs. Needs no GPU: cuobjdump from the CUDA toolkit or
pip's nvidia-cuda-cuobjdump.
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys


def listing(path, cuobjdump):
    if path.endswith(".o") or path.endswith(".cubin"):
        return subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    with open(path) as f:
        return f.read()


def kernels(text):
    """{mangled name: [instruction text, ...]} (addresses and encodings dropped)."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if cur and m:
            out[cur].append(re.sub(r"\s+", " ", m.group(1)))
    return out


def opcode(ins):
    parts = ins.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--filter", default="", help="only kernels whose mangled name contains this")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    a = ap.parse_args()
    before = kernels(listing(a.before, a.cuobjdump))
    after = kernels(listing(a.after, a.cuobjdump))
    changed = 0
    for name in sorted(set(before) | set(after)):
        if a.filter not in name:
            continue
        x, y = before.get(name, []), after.get(name, [])
        cx, cy = collections.Counter(map(opcode, x)), collections.Counter(map(opcode, y))
        verdict = "same" if x == y else "sameops" if cx == cy else "DIFF"
        changed += verdict != "same"
        print(f"{len(x):7d} {len(y):7d} {verdict:8s} {name[:120]}")
        if verdict == "DIFF" and x and y:
            delta = {o: (cx[o], cy[o]) for o in sorted(set(cx) | set(cy)) if cx[o] != cy[o]}
            print("         " + ", ".join(f"{o} {b}->{c}" for o, (b, c) in delta.items()))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
