#!/usr/bin/env python3
"""Draws the serving demo's per-step JSON (examples/serving/serve_demo) as a PNG.

    tools/plot_demo.py build/demo/serve_demo.json [out.png]

Top: tokens per step, split into decode and prefill tokens. Second: attention time per step,
coloured by the path the backend took (decode, prefill, mixed, cascade, verify, tree); rings
mark verified steps (red: the verification failed). On CUDA runs, third: the fraction of the
roofline ceiling each step reached (max(bytes / bandwidth, FLOPs / compute) over its attention
time, the ceilings from the run's config), with the per-path totals in the legend. Bottom:
running and waiting requests, and free KV blocks.
The PNG goes next to the JSON (same name, .png) unless given. Exit status 3: no matplotlib.
"""
import json
import sys
from pathlib import Path

PATH_COLORS = {
    "decode": "tab:blue",
    "prefill": "tab:orange",
    "mixed": "tab:green",
    "cascade": "tab:red",
    "verify": "tab:purple",
    "tree": "tab:brown",
}


def draw_ceiling(ax, steps, cfg, paths):
    """Per-step % of the roofline ceiling, by path; the legend has each path's totals."""
    bw = float(cfg.get("bw_ceiling_gbs", 4200)) * 1e9
    peak = float(cfg.get("tflops_ceiling", 760)) * 1e12
    for path, color in PATH_COLORS.items():
        pts = [(s["step"], 100 * max(s["bytes"] / bw, s["flops"] / peak) / (s["attention_ms"] * 1e-3))
               for s in steps if s["path"] == path and s["attention_ms"] > 0]
        if not pts:
            continue
        p = paths.get(path, {})
        label = path
        if p.get("ceiling_fraction") is not None:
            label += (f": {100 * p['ceiling_fraction']:.0f}% ({p['bound']}; {p['gbs']:.0f} GB/s,"
                      f" {p['tflops']:.0f} TFLOP/s)")
        ax.scatter(*zip(*pts), s=10, color=color, label=label)
    ax.set_ylabel("% of roofline ceiling")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=7, ncol=2,
              title=f"ceilings {bw / 1e9:.0f} GB/s, {peak / 1e12:.0f} TFLOP/s", title_fontsize=7)


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    src = Path(argv[1])
    dst = Path(argv[2]) if len(argv) > 2 else src.with_suffix(".png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot_demo: matplotlib is not installed for {sys.executable} "
              "(apt-get install python3-matplotlib, or pip install matplotlib)", file=sys.stderr)
        return 3
    data = json.loads(src.read_text())
    steps = data["steps"]
    if not steps:
        print("plot_demo: no steps in " + str(src), file=sys.stderr)
        return 1
    x = [s["step"] for s in steps]
    cfg = data.get("config", {})

    cuda = cfg.get("device") == "cuda" and all("bytes" in s for s in steps)
    ratios = [2, 2, 2, 1.3] if cuda else [2, 2, 1.3]
    fig, axes = plt.subplots(len(ratios), 1, figsize=(11, 3 * len(ratios)), sharex=True,
                             gridspec_kw={"height_ratios": ratios})
    ax_tok, ax_ms, ax_req = axes[0], axes[1], axes[-1]
    dec = [s["decode_tokens"] for s in steps]
    pre = [s["prefill_tokens"] for s in steps]
    ax_tok.bar(x, dec, width=1.0, color="tab:blue", label="decode tokens")
    ax_tok.bar(x, pre, width=1.0, bottom=dec, color="tab:orange", label="prefill tokens")
    ax_tok.set_ylabel("tokens / step")
    ax_tok.legend(loc="upper right", fontsize=8)

    for label, ok, edge in (("verified", True, "black"), ("verification failed", False, "red")):
        pts = [(s["step"], s["attention_ms"]) for s in steps
               if s.get("verified") and s.get("verify", {}).get("passed", True) == ok]
        if pts:
            ax_ms.scatter(*zip(*pts), s=36, facecolors="none", edgecolors=edge, linewidths=0.7,
                          label=f"{label} ({len(pts)})", zorder=1)
    for path, color in PATH_COLORS.items():
        pts = [(s["step"], s["attention_ms"]) for s in steps if s["path"] == path]
        if pts:
            ax_ms.scatter(*zip(*pts), s=10, color=color, label=f"{path} ({len(pts)})", zorder=2)
    ax_ms.set_ylabel("attention ms / step")
    ax_ms.legend(loc="upper right", fontsize=8, ncol=4)
    if cuda:
        draw_ceiling(axes[2], steps, cfg, data.get("paths", {}))

    ax_req.plot(x, [s["running"] for s in steps], color="tab:green", label="running")
    ax_req.plot(x, [s["waiting"] for s in steps], color="tab:gray", label="waiting")
    ax_req.set_ylabel("requests")
    ax_req.set_xlabel("step")
    ax_blk = ax_req.twinx()
    ax_blk.plot(x, [s["free_blocks"] for s in steps], color="tab:cyan", linestyle=":", label="free KV blocks")
    ax_blk.set_ylabel("free blocks")
    lines = ax_req.get_legend_handles_labels()
    blk = ax_blk.get_legend_handles_labels()
    ax_req.legend(lines[0] + blk[0], lines[1] + blk[1], loc="upper right", fontsize=8)

    totals = data.get("totals", {})
    verdict = "PASS" if totals.get("verification_passed", True) else "FAIL"
    preset = cfg.get("preset", "none")
    fig.suptitle(f"flashserve serving demo{'' if preset == 'none' else ' (' + preset + ')'}: {cfg.get('layers', '?')} layers, H={cfg.get('num_heads', '?')} "
                 f"H_kv={cfg.get('num_kv_heads', '?')} D={cfg.get('head_size', '?')} {cfg.get('dtype', '')} "
                 f"(cache {cfg.get('kv_cache_dtype', 'auto')}), device {cfg.get('device_name', cfg.get('device', '?'))}, {totals.get('finished', '?')} requests, verification {verdict}",
                 fontsize=10)
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
