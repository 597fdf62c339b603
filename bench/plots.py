#!/usr/bin/env python3
"""PNG plots of a bench/driver.py results.json:

  prefill.png  TFLOP/s vs sequence length, one line per peer, one panel per (D, causal);
               the dashed line is the bf16 GEMM ceiling of the run.
  decode.png   KV GB/s vs batch (B, L pairs), one line per peer (paged bf16, block 16), plus
               flashserve with blocks of 1, 64 and 256 and with an fp8 KV cache, fa4 with
               blocks of 64, flex_paged with blocks of 256; the dashed line
               is the copy ceiling of the run.

    python3 bench/plots.py results.json [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STYLE = {"flashserve": "C3", "cudnn": "C0", "fa2": "C1", "flex": "C2", "flex_paged": "C4", "fa4": "C6"}


def _ok(rows, **match):
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def _prefill(plt, result, out: Path) -> Path | None:
    cfg = {c["name"]: c for c in result["configs"] if c["family"] == "prefill"}
    if not cfg:
        return None
    dims = sorted({c["D"] for c in cfg.values()})
    fig, axes = plt.subplots(len(dims), 2, figsize=(11, 3.2 * len(dims)), squeeze=False, sharex=True)
    ceiling = result["header"].get("ceilings", {}).get("gemm_tflops")
    for i, d in enumerate(dims):
        for j, causal in enumerate((False, True)):
            ax = axes[i][j]
            for peer, color in STYLE.items():
                pts = sorted((cfg[r["config"]]["S"], r["tflops"]) for r in _ok(result["rows"], peer=peer)
                             if r["config"] in cfg and cfg[r["config"]]["D"] == d
                             and cfg[r["config"]]["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, label=peer)
            if ceiling:
                ax.axhline(ceiling, color="gray", linestyle="--", linewidth=1, label="GEMM ceiling")
            ax.set_xscale("log", base=2)
            ax.set_title(f"prefill D={d}{' causal' if causal else ''}", fontsize=10)
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length S (B·S = 16k tokens)")
    axes[0][0].legend(fontsize=8)
    return _save(plt, fig, result, out / "prefill.png")


def _decode(plt, result, out: Path) -> Path | None:
    cfg = {c["name"]: c for c in result["configs"] if c["op"] == "decode"}
    if not cfg:
        return None
    shapes = sorted({(c["B"], c["L"]) for c in cfg.values()})
    x_of = {s: i for i, s in enumerate(shapes)}
    series = [(peer, dict(block=16, kv="bf16"), STYLE[peer], "-") for peer in STYLE]
    series += [("flashserve", dict(block=1, kv="bf16"), STYLE["flashserve"], ":"),
               ("flashserve", dict(block=256, kv="bf16"), STYLE["flashserve"], "-."),
               ("flashserve", dict(block=16, kv="fp8"), "C5", "-"),
               ("flex_paged", dict(block=256, kv="bf16"), STYLE["flex_paged"], "-."),
               ("flashserve", dict(block=64, kv="bf16"), STYLE["flashserve"], (0, (5, 2))),
               ("fa4", dict(block=64, kv="bf16"), STYLE["fa4"], (0, (5, 2)))]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for peer, want, color, ls in series:
        pts = sorted((x_of[(cfg[r["config"]]["B"], cfg[r["config"]]["L"])], r["gbps"])
                     for r in _ok(result["rows"], peer=peer) if r["config"] in cfg
                     and all(cfg[r["config"]][k] == v for k, v in want.items()))
        if pts:
            label = peer + ("" if want == dict(block=16, kv="bf16") else f" (block {want['block']}, {want['kv']})")
            ax.plot(*zip(*pts), marker="o", color=color, linestyle=ls, label=label)
    ceiling = result["header"].get("ceilings", {}).get("copy_gbps")
    if ceiling:
        ax.axhline(ceiling, color="gray", linestyle="--", linewidth=1, label="copy ceiling")
    ax.set_xticks(range(len(shapes)), [f"B={b}\nL={l // 1024}k" for b, l in shapes])
    ax.set_ylabel("GB/s of KV read")
    ax.set_ylim(bottom=0)
    ax.set_title("decode, H=32, H_kv=8, D=128: flashserve, fa4, flex_paged paged; cudnn/fa2/flex contiguous KV",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, result, out / "decode.png")


def _save(plt, fig, result, path: Path) -> Path:
    h = result["header"]
    fig.suptitle(f"{h.get('device', '?')}  commit {h.get('commit', '?')}  {h.get('date', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(result: dict, out: Path) -> list[Path]:
    """Writes the plots into `out`; returns their paths (none when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: matplotlib not installed, no PNG written", file=sys.stderr)
        return []
    paths = []
    for draw in (_prefill, _decode):
        try:
            p = draw(plt, result, out)
        except Exception as e:  # noqa: BLE001 -- a plot must not lose the run's results
            print(f"plots: {draw.__name__[1:]} failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if p:
            paths.append(p)
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, help="folder for the PNGs (default: beside results.json)")
    args = ap.parse_args()
    res = json.loads(args.results.read_text())
    for p in render(res, args.out or args.results.parent):
        print(p)
