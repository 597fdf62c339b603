#!/usr/bin/env python3
"""The one benchmark driver (../shared/BENCH.md): flashserve's CUDA attention beside cuDNN and
PyTorch's FlashAttention-2 (through SDPA), FlashAttention-4 (flash_attn.cute, optional: absent
means no fa4 rows) and FlexAttention, on the headline configurations,
in one run on one GPU, with the copy and GEMM ceilings re-measured in the header.

    python3 bench/driver.py [--quick] [--only NAME,...] [--out DIR] [--dry-run] ...

flashserve rows come from the C++ program build/cuda-dev/bench/attn_bench (--attn-bench), peer
rows from bench/peers.py (torch). Writes DIR/results.json (header, configurations, rows) and
PNG plots (bench/plots.py), and prints a short fixed-width table last. --dry-run prints the
plan (configurations, FLOP and byte counts) without torch or a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BINARY = REPO / "build" / "cuda-dev" / "bench" / "attn_bench"
PEERS = ("cudnn", "fa2", "fa4", "flex", "flex_paged")   # run in this order: the compiled flex ones last
FA4_MODS = ("sinks", "softcap", "window")   # prefill modifiers FA4 takes (learnable_sink, softcap, window_size)
FA4_BLOCKS = (16, 64)                       # paged decode page sizes the fa4 peer runs
ALL_PEERS = ("flashserve",) + PEERS


@dataclass(frozen=True)
class Config:
    """One named configuration. prefill: varlen, q_len = kv_len = S per sequence; decode: one
    query per sequence over a paged cache of L tokens in blocks of `block`."""
    name: str
    family: str          # prefill | prefill_paged | paged_decode | small_pages | fp8_decode | int8_decode | verify | batch_invariant |
                         # mla_decode | shared_prefix | mixed_step
    op: str              # prefill | decode | shared_prefix, mixed_step (one backend step)
    B: int
    H: int
    Hkv: int
    D: int
    S: int = 0
    L: int = 0
    block: int = 16
    kv: str = "bf16"     # KV element type: bf16 | fp8 (e4m3) | fp8e5m2 (decode) | k8v8 | k8v16 (the vLLM int8 fork's: int8 q and K with
                         # per-token scales, V int8 with per-channel scales or bf16)
    P: int = 0           # shared_prefix: tokens of L every request shares
    cascade: bool = True # shared_prefix: the builder may take the cascade path
    C: int = 0           # mixed_step: cached tokens of each chunked prefill (S new ones)
    NP: int = 0          # mixed_step: chunked prefills beside the B decodes
    causal: bool = False
    mod: str = ""        # prefill: score modifier (sinks, alibi, alibi_sqrt, softcap, chunk, window)
    W: int = 0           # prefill: chunk size (mod chunk) or left window (mod window)
    Dv: int = 0          # prefill: V head size when it differs from D (MLA prefill 192/128)
    mla: bool = False    # decode: MLA absorbed decode (q 64 + q_v 512 over one latent cache [.., 576], Hkv 1)
    Q: int = 1           # decode: query rows per sequence (speculative verify: > 1, causal)
    inv: bool = False    # decode: batch-invariant mode (fixed-size splits)
    base: str = ""       # verify / batch_invariant: the q_len-1 / default-mode row of the same shape
    plain: str = ""      # prefill_mods: the unmodified configuration of the same shape (vs_plain); prefill_paged:
                         # the contiguous one (vs_contig)
    paged: bool = False  # prefill: K/V in a paged cache of blocks of `block` (shuffled block tables)
    parts: tuple = ()    # mixed_step: the rows of its parts as steps of their own (vs_separate: their summed
                         # time over this row's; issue 14 wants >= 1.2)
    peers: tuple = ()    # peers (besides flashserve) that run it
    quick: bool = False  # part of --quick

    @property
    def pairs(self) -> float:
        """Visible (query, key) pairs per sequence and head of a prefill: S² (÷2 causal); with a
        chunk c, S·c (÷2 causal); with a left window w, S·(w + 1) - w(w + 1)/2 (causal; two-sided
        non-causal: 2 S w + S - w(w + 1))."""
        s, w = self.S, self.W
        if self.mod == "chunk":
            return s * min(w, s) / (2 if self.causal else 1)
        if self.mod == "window":
            w = min(w, s - 1)
            one_side = s * (w + 1) - w * (w + 1) / 2
            return one_side if self.causal else 2 * one_side - s
        return s * s / (2 if self.causal else 1)

    @property
    def flops(self) -> float:
        """2·B·H·pairs·(D + Dv) for prefill (4·B·H·S²·D, ÷2 causal, when D = Dv and no chunk or
        window); 4·B·H·L·D for decode."""
        if self.op == "prefill":
            return 2.0 * self.B * self.H * self.pairs * (self.D + (self.Dv or self.D))
        if self.mla:  # scores over 576 channels, P·V over 512
            return 2.0 * self.B * self.H * self.L * (576 + 512)
        decode = 4.0 * self.B * self.H * self.L * self.D
        if self.op == "mixed_step":  # each prefill row i of S sees C + i + 1 keys
            return decode + self.NP * 4.0 * self.H * self.D * self.S * (self.C + (self.S + 1) / 2)
        return decode

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one call must read: 2·B·L·H_kv·D·elem (decode), 2·B·S·H_kv·D·2 (prefill);
        int8: B·L·H_kv·(D·(1 + v elem) + 4) (the k scale per token and KV head)."""
        if self.kv in ("k8v8", "k8v16"):
            return self.B * self.L * self.Hkv * (self.D * (1 + (1 if self.kv == "k8v8" else 2)) + 4)
        elem = 1 if self.kv in ("fp8", "fp8e5m2") else 2
        if self.mla:  # the latent cache, read once: 576 channels per token
            return self.B * self.L * 576 * elem
        tokens = self.B * (self.S if self.op == "prefill" else self.L)
        return 2 * tokens * self.Hkv * self.D * elem

    @property
    def compute_bound(self) -> bool:
        """Figures in TFLOP/s against the GEMM ceiling (else KV GB/s against the copy ceiling)."""
        return self.op == "prefill" or (self.op == "mixed_step" and self.NP > 0) or (self.mla and self.H >= 64)

    @property
    def metric(self) -> str:
        return "TFLOP/s" if self.compute_bound else "GB/s"

    def shape(self) -> str:
        if self.op == "prefill":
            dv = f"/{self.Dv}" if self.Dv and self.Dv != self.D else ""
            mod = f" {self.mod}" + (f" {self.W}" if self.W else "") if self.mod else ""
            paged = f" paged block={self.block}" if self.paged else ""
            kv = f" kv={self.kv}" if self.kv != "bf16" else ""
            return f"B={self.B} S={self.S} H={self.H} D={self.D}{dv}{' causal' if self.causal else ''}{mod}{paged}{kv}"
        if self.op == "shared_prefix":
            return (f"B={self.B} L={self.L} (prefix {self.P}) H={self.H}/{self.Hkv} D={self.D} block={self.block}"
                    f" {'cascade' if self.cascade else 'split-KV'}")
        if self.op == "mixed_step":
            return (f"{self.B} decodes L={self.L} + {self.NP} prefills {self.S} on {self.C} H={self.H}/{self.Hkv}"
                    f" D={self.D} block={self.block}")
        if self.mla:
            return f"MLA B={self.B} L={self.L} H={self.H} D=64+512 block={self.block} kv={self.kv}"
        extra = (f" q_len={self.Q}" if self.Q > 1 else "") + (" batch-invariant" if self.inv else "")
        return f"B={self.B} L={self.L} H={self.H}/{self.Hkv} D={self.D} block={self.block} kv={self.kv}{extra}"

    def spec(self) -> str:
        """The attn_bench argument for this configuration."""
        common = f"name={self.name},op={self.op},B={self.B},H={self.H},Hkv={self.Hkv},D={self.D}"
        if self.op == "prefill":
            extra = (f",mod={self.mod}" if self.mod else "") + (f",W={self.W}" if self.W else "")
            extra += f",Dv={self.Dv}" if self.Dv else ""
            extra += f",paged=1,block={self.block}" if self.paged else ""
            extra += f",kv={self.kv}" if self.kv != "bf16" else ""
            return f"{common},S={self.S},causal={int(self.causal)}{extra}"
        if self.op == "shared_prefix":
            return f"{common},L={self.L},P={self.P},block={self.block},cascade={int(self.cascade)}"
        if self.op == "mixed_step":
            return f"{common},L={self.L},S={self.S},C={self.C},NP={self.NP},block={self.block}"
        extra = (",mla=1" if self.mla else "") + (f",Q={self.Q}" if self.Q > 1 else "") + (",inv=1" if self.inv else "")
        return f"{common},L={self.L},block={self.block},kv={self.kv}{extra}"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def all_configs() -> list[Config]:
    """The headline configurations of BENCH.md."""
    out = []
    for d in (64, 128, 256):
        for s in (512, 2048, 8192):
            for causal in (False, True):
                out.append(Config(
                    name=f"prefill_d{d}_s{_k(s)}{'_causal' if causal else ''}", family="prefill",
                    op="prefill", B=16384 // s, H=2048 // d, Hkv=2048 // d, D=d, S=s, causal=causal,
                    peers=("cudnn", "fa2", "fa4", "flex"), quick=d == 128 and s >= 2048))
    # Score modifiers on the prefill shape (bf16 D = 128, causal): each against the plain row of
    # the same shape (vs_plain: TFLOP/s over the plain row's; chunk and window count only the
    # visible pairs). The SDPA peers take none of them; fa4 takes sinks, softcap and window.
    for s in (2048, 8192):
        plain = f"prefill_d128_s{_k(s)}_causal"
        for mod, w in (("sinks", 0), ("alibi", 0), ("alibi_sqrt", 0), ("softcap", 0), ("chunk", s // 4),
                       ("window", s // 4)):
            out.append(Config(name=f"{plain}_{mod}", family="prefill_mods", op="prefill", B=16384 // s, H=16,
                              Hkv=16, D=128, S=s, causal=True, mod=mod, W=w, plain=plain, quick=s == 8192,
                              peers=("fa4",) if mod in FA4_MODS else ()))
    # Head sizes beyond the headline three: D = 96 and 192, and MLA prefill's 192/128 (H·D = 2048
    # for D = Dv; MLA with 16 heads), S = 8k causal. flashserve only.
    for d, dv, h in ((96, 0, 2048 // 96), (192, 0, 2048 // 192), (192, 128, 16)):
        out.append(Config(name=f"prefill_d{d}{f'_dv{dv}' if dv else ''}_s8k_causal", family="prefill_heads",
                          op="prefill", B=2, H=h, Hkv=h, D=d, Dv=dv, S=8192, causal=True))
    # Paged prefill (vLLM's flash_attn_varlen_func with a block table): the D = 128 S = 8k causal
    # shape over a paged cache, blocks of 1 (SGLang's default page), 16, 32, 64 and 256 in shuffled
    # order, against the contiguous row (vs_contig: TFLOP/s over prefill_d128_s8k_causal's; the
    # issue's target is >= 0.9).
    for bs in (1, 16, 32, 64, 256):
        out.append(Config(name=f"prefill_paged_d128_s8k_causal_bs{bs}", family="prefill_paged", op="prefill", B=2,
                          H=16, Hkv=16, D=128, S=8192, causal=True, paged=True, block=bs,
                          plain="prefill_d128_s8k_causal"))
    # fp8 prefill (q, k, v e4m3, out bf16: vLLM's and SGLang's prefill over an fp8 KV cache)
    # against the bf16 row of the same shape (vs_bf16 = bf16 time / fp8 time; the issue's
    # target is >= 1.5), contiguous and over a paged cache of 16- and 64-token blocks.
    for s in (2048, 8192):
        for causal in (False, True):
            bf16 = f"prefill_d128_s{_k(s)}{'_causal' if causal else ''}"
            out.append(Config(name=bf16.replace("prefill_", "prefill_fp8_"), family="fp8_prefill", op="prefill",
                              B=16384 // s, H=16, Hkv=16, D=128, S=s, causal=causal, kv="fp8", quick=s == 8192))
    for bs in (16, 64):
        out.append(Config(name=f"prefill_fp8_paged_d128_s8k_causal_bs{bs}", family="fp8_prefill", op="prefill", B=2,
                          H=16, Hkv=16, D=128, S=8192, causal=True, kv="fp8", paged=True, block=bs,
                          plain="prefill_fp8_d128_s8k_causal"))
    decode_shapes = ((1, 32768), (16, 8192), (64, 4096), (256, 1024))
    common = dict(op="decode", H=32, Hkv=8, D=128)
    for b, l in decode_shapes:
        out.append(Config(name=f"decode_b{b}_l{_k(l)}_bs16", family="paged_decode", B=b, L=l, block=16,
                          peers=PEERS, quick=b in (16, 64), **common))
    for bs in (1, 64, 256):  # other page sizes (64: FA4's second measured size)
        for b, l in decode_shapes:
            peers = (("fa4",) if bs in FA4_BLOCKS else ()) + (("flex_paged",) if bs >= 16 else ())
            out.append(Config(name=f"decode_b{b}_l{_k(l)}_bs{bs}", family="small_pages", B=b, L=l, block=bs,
                              peers=peers, quick=b == 64, **common))
    # Short contexts (per-CTA setup and the split combine weigh most) and GQA ratios 1 and 16;
    # flashserve only, their fp8 rows below pair with them.
    short_shapes = ((64, 256), (256, 64))
    for b, l in short_shapes:
        out.append(Config(name=f"decode_b{b}_l{_k(l)}_bs16", family="paged_decode", B=b, L=l, block=16, quick=True,
                          **common))
    for hkv in (32, 2):
        out.append(Config(name=f"decode_g{32 // hkv}_b64_l4k_bs16", family="paged_decode", B=64, L=4096, block=16,
                          quick=True, **{**common, "Hkv": hkv}))
    # fp8 (vs_bf16: the bf16 row's time / this row's; issue 15: <= 0.55x the time, never slower),
    # at block 16, block 1 and the short contexts.
    for b, l in decode_shapes + short_shapes:
        out.append(Config(name=f"decode_fp8_b{b}_l{_k(l)}_bs16", family="fp8_decode", B=b, L=l, block=16,
                          kv="fp8", quick=b == 64 or (b, l) in short_shapes, **common))
    out.append(Config(name="decode_fp8_b64_l4k_bs1", family="fp8_decode", B=64, L=4096, block=1, kv="fp8", quick=True,
                      **common))
    # fp8 e5m2 (vLLM's kv_cache_dtype fp8_e5m2; the same kernel, its own conversion) at two shapes.
    for b, l in ((64, 4096), (16, 8192)):
        out.append(Config(name=f"decode_fp8e5m2_b{b}_l{_k(l)}_bs16", family="fp8_decode", B=b, L=l, block=16,
                          kv="fp8e5m2", quick=b == 64, **common))
    # Speculative verify (q_len 2-8, causal) over the decode shapes' caches; vs_decode: the q_len-1
    # row's time / this row's (the same KV bytes: issue 15 wants >= 0.9 at q_len 4). flashserve only.
    for kv in ("bf16", "fp8"):
        for q in (2, 4, 8):
            pre = "decode_" if kv == "bf16" else f"decode_{kv}_"
            out.append(Config(name=f"verify{'' if kv == 'bf16' else '_' + kv}_q{q}_b64_l4k_bs16", family="verify", B=64,
                              L=4096, block=16, kv=kv, Q=q, base=f"{pre}b64_l4k_bs16", quick=q == 4, **common))
    # Batch-invariant mode against the default split heuristic (vs_default: default time / this
    # row's; issue 15 wants >= 0.9 at every shape). flashserve only.
    for b, l in decode_shapes:
        out.append(Config(name=f"decode_inv_b{b}_l{_k(l)}_bs16", family="batch_invariant", B=b, L=l, block=16,
                          inv=True, base=f"decode_b{b}_l{_k(l)}_bs16", quick=b == 64, **common))
    # int8 (the vLLM int8 fork's K8V8 / K8V16 decode; fs/best: bf16 time / int8 time). flashserve only.
    for kv in ("k8v8", "k8v16"):
        for b, l in ((64, 4096), (16, 8192)):
            out.append(Config(name=f"decode_{kv}_b{b}_l{_k(l)}_bs16", family="int8_decode", B=b, L=l, block=16,
                              kv=kv, quick=b == 64, **common))
    # MLA absorbed decode (DeepSeek-V2/V3): H = 16 is a memory stream (GB/s of latent cache), H = 128
    # compute (TFLOP/s: 2·H·L·(576 + 512) per sequence). flashserve only.
    # kv=fp8: an e4m3 latent cache (576 bytes per token; the _fp8_ rows pair with the bf16 ones).
    for kv in ("bf16", "fp8"):
        for h in (16, 128):
            for b, l in ((1, 32768), (64, 4096)):
                tag = "_fp8" if kv == "fp8" else ""
                out.append(Config(name=f"mla_decode{tag}_h{h}_b{b}_l{_k(l)}_bs64", family="mla_decode", op="decode",
                                  B=b, L=l, block=64, H=h, Hkv=1, D=64, mla=True, kv=kv, quick=b == 64))
    # Shared prefix: B decodes whose contexts share P tokens, 256 of their own; one backend step.
    for b, p in ((64, 4096), (256, 4096), (64, 32768), (256, 32768)):
        for cascade in (True, False):
            out.append(Config(name=f"shared_b{b}_p{_k(p)}_{'cascade' if cascade else 'split'}",
                              family="shared_prefix", op="shared_prefix", B=b, L=p + 256, P=p, block=16,
                              H=32, Hkv=8, D=128, cascade=cascade, quick=b == 64 and p == 4096))
    # Mixed step: 64 decodes (context 4k) and 2 chunked prefills of 2k new tokens on 8k cached, and
    # its parts as steps of their own (the decodes alone; the prefills with one decode, as a step
    # holds at least one): separate launches, against which the one step is measured.
    mixed = dict(family="mixed_step", op="mixed_step", L=4096, S=2048, C=8192, H=32, Hkv=8, D=128, quick=True)
    out.append(Config(name="mixed_b64_l4k_p2x2k_c8k", B=64, NP=2,
                      parts=("mixed_b64_l4k_decodes", "mixed_p2x2k_c8k_prefills"), **mixed))
    out.append(Config(name="mixed_b64_l4k_decodes", B=64, NP=0, **mixed))
    out.append(Config(name="mixed_p2x2k_c8k_prefills", B=1, NP=2, **mixed))
    return out


def select_configs(quick: bool, only: str | None) -> list[Config]:
    configs = all_configs()
    if quick:
        configs = [c for c in configs if c.quick]
    if only:
        pats = [p.strip() for p in only.split(",") if p.strip()]
        chosen = [c for c in configs if any(fnmatch.fnmatchcase(c.name, p) or c.family == p for p in pats)]
        unmatched = [p for p in pats if not any(fnmatch.fnmatchcase(c.name, p) or c.family == p for c in configs)]
        if unmatched:
            names = ", ".join(c.name for c in configs)
            sys.exit(f"driver: --only {','.join(unmatched)} matches no configuration; have: {names}")
        configs = chosen
    return configs


# ---------------------------------------------------------------- plan (dry run)

def print_plan(configs: list[Config], peers: tuple) -> None:
    print(f"{'config':36} {'family':13} {'shape':44} {'GFLOP':>9} {'KV MB':>8}  peers")
    for c in configs:
        ps = ",".join(["flashserve"] + [p for p in c.peers if p in peers])
        print(f"{c.name:36} {c.family:13} {c.shape():44} {c.flops / 1e9:9.1f} {c.kv_bytes / 1e6:8.1f}  {ps}")
    rows = sum(1 + len([p for p in c.peers if p in peers]) for c in configs)
    print(f"{len(configs)} configurations, {rows} rows; figures: prefill TFLOP/s = 4·B·H·S²·D (÷2 causal) / t "
          f"vs the bf16 GEMM ceiling; decode GB/s = KV bytes read / t vs the copy ceiling")


# ---------------------------------------------------------------- flashserve rows

def flashserve_rows(configs: list[Config], binary: Path, timeout_s: float, extra: list[str]) -> list[dict]:
    """Runs attn_bench over the configurations; restarts it after a CUDA error (exit 3) or a
    crash with the configurations not yet reported. Every configuration gets a row."""
    if not binary.is_file():
        return [_missing_row(c, f"attn_bench not built ({binary})", "missing") for c in configs]
    rows: dict[str, dict] = {}
    pending = list(configs)
    deadline = time.monotonic() + timeout_s
    rc = None
    while pending:
        left = deadline - time.monotonic()
        if left <= 1:
            break
        cmd = [str(binary), *extra, *[c.spec() for c in pending]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = f"driver: attn_bench stopped at the time limit ({timeout_s:.0f} s)", None
        if err.strip():
            print(err.rstrip(), file=sys.stderr)
        for line in out.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row.get("config", "")] = row
        pending = [c for c in pending if c.name not in rows]
        if rc in (0, None) or not pending:
            break
        if rc != 3:  # a crash: the first configuration without a row is the one that crashed
            first = pending.pop(0)
            rows[first.name] = _missing_row(first, f"attn_bench exited with status {rc} on this configuration", "error")
    timed_out = time.monotonic() >= deadline - 1 or rc is None
    for c in pending:
        rows[c.name] = (_missing_row(c, "attn_bench ran out of time", "timeout") if timed_out
                        else _missing_row(c, f"no row from attn_bench (exit status {rc})", "error"))
    return [rows[c.name] for c in configs]


def _missing_row(c: Config, why: str, status: str) -> dict:
    return {"config": c.name, "peer": "flashserve", "status": status, "kernel": "unknown", "error": why}


# ---------------------------------------------------------------- figures

# Families whose rows report vs_bf16: the bf16 row of the same shape's time / this row's.
BF16_PAIRED = ("fp8_decode", "int8_decode", "fp8_prefill")


def bf16_pair(c: Config) -> str:
    """The name of the bf16 row that an 8-bit row of BF16_PAIRED is compared with."""
    bf16 = c.name.replace(f"decode_{c.kv}_", "decode_").replace("prefill_fp8_paged_", "prefill_paged_")
    return bf16.replace("prefill_fp8_", "prefill_")


def add_figures(rows: list[dict], configs: list[Config], header: dict) -> None:
    """Throughput, fraction of ceiling, ratio to the best peer (and fp8 over bf16) per row."""
    by_name = {c.name: c for c in configs}
    ceil = header.get("ceilings", {})
    times = {(r["config"], r["peer"]): r["time_ms"] for r in rows if r.get("status") == "ok"}
    for r in rows:
        c = by_name[r["config"]]
        r.update(family=c.family, shape=c.shape(), metric=c.metric, flops=c.flops, kv_bytes=c.kv_bytes)
        if r.get("status") != "ok":
            continue
        t = r["time_ms"] * 1e-3
        if c.compute_bound:
            r["tflops"] = c.flops / t / 1e12
            if ceil.get("gemm_tflops"):
                r["frac_ceiling"] = r["tflops"] / ceil["gemm_tflops"]
        else:
            r["gbps"] = c.kv_bytes / t / 1e9
            if ceil.get("copy_gbps"):
                r["frac_ceiling"] = r["gbps"] / ceil["copy_gbps"]
        if c.mla:  # both figures: latent-cache GB/s and TFLOP/s
            r["gbps"] = c.kv_bytes / t / 1e9
            r["tflops"] = c.flops / t / 1e12
        if r["peer"] == "flashserve":
            peer_times = [times[(c.name, p)] for p in c.peers if (c.name, p) in times]
            if peer_times:
                r["vs_best_peer"] = min(peer_times) / r["time_ms"]
            if c.family in BF16_PAIRED:
                bf16 = bf16_pair(c)
                if (bf16, "flashserve") in times:
                    r["vs_bf16"] = times[(bf16, "flashserve")] / r["time_ms"]
            if c.base and (c.base, "flashserve") in times:
                r["vs_decode" if c.family == "verify" else "vs_default"] = times[(c.base, "flashserve")] / r["time_ms"]
            if c.plain and (c.plain, "flashserve") in times:
                p = by_name.get(c.plain)
                if p is not None:
                    r["vs_contig" if c.paged else "vs_plain"] = (c.flops / times[(c.name, "flashserve")]) / (
                        p.flops / times[(c.plain, "flashserve")])
            if c.parts and all((q, "flashserve") in times for q in c.parts):
                r["vs_separate"] = sum(times[(q, "flashserve")] for q in c.parts) / r["time_ms"]
            if c.op == "shared_prefix" and c.cascade:
                split = c.name.replace("_cascade", "_split")
                if (split, "flashserve") in times:
                    r["vs_split"] = times[(split, "flashserve")] / r["time_ms"]


def figure(r: dict | None) -> str:
    if r is None:
        return "-"
    st = r.get("status")
    if st != "ok":
        return {"not_implemented": "n/i", "missing": "no-bin", "timeout": "t/o", "skipped": "skip",
                "infeasible": "n/a", "unsupported": "n/s"}.get(st, "err")
    # the row's own metric (MLA decode rows carry both: H = 16 is read in GB/s, H = 128 in TFLOP/s)
    v = r.get("gbps", 0.0) if r.get("metric") == "GB/s" else r.get("tflops", r.get("gbps", 0.0))
    flag = "!" if r.get("out_check", "ok") != "ok" else ""
    return (f"{v:.1f}" if v < 100 else f"{v:.0f}") + flag


def print_table(header: dict, configs: list[Config], rows: list[dict]) -> None:
    cell = {(r["config"], r["peer"]): r for r in rows}
    ceil = header.get("ceilings", {})
    print()
    print(f"flashserve bench {header.get('date', '')}  {header.get('device', '?')} ({header.get('sms', '?')} SMs)  "
          f"commit {header.get('commit', '?')}  torch {header.get('torch', '?')} cuDNN {header.get('cudnn', '?')}")
    print(f"ceilings: copy {ceil.get('copy_gbps', 0):.0f} GB/s (read+write), bf16 GEMM 8192^3 "
          f"{ceil.get('gemm_tflops', 0):.0f} TFLOP/s; prefill and mixed step in TFLOP/s, decode in GB/s of KV read")
    print(f"{'config':36}" + "".join(f"{p:>11}" for p in ALL_PEERS) + f"{'fs/best':>9}{'fs%ceil':>9}  fs kernel")
    for c in configs:
        line = f"{c.name:36}" + "".join(f"{figure(cell.get((c.name, p))):>11}" for p in ALL_PEERS)
        fs = cell.get((c.name, "flashserve"), {})
        ratio = next((fs[k] for k in ("vs_best_peer", "vs_bf16", "vs_split", "vs_plain", "vs_contig", "vs_decode",
                                      "vs_default", "vs_separate") if k in fs), None)
        line += f"{ratio:9.2f}" if ratio is not None else f"{'-':>9}"
        frac = fs.get("frac_ceiling")
        line += f"{100 * frac:8.0f}%" if frac is not None else f"{'-':>9}"
        print(line + f"  {str(fs.get('kernel', '-'))[:12]}")
    gqa = {}
    for r in rows:
        if r.get("gqa"):
            gqa.setdefault(r["peer"], set()).add(r["gqa"])
    if gqa:
        print("decode GQA: " + ", ".join(f"{p} {'/'.join(sorted(v))}" for p, v in gqa.items()))
    fa4 = header.get("fa4")
    if fa4 is not None:
        print("fa4: " + (f"flash-attn-4 {fa4.get('version')}, nvidia-cutlass-dsl {fa4.get('cutlass_dsl')}"
                         if fa4.get("available") else f"absent ({fa4.get('error')}): no fa4 rows"))
    print("n/i: not implemented in flashserve; err: error in results.json; skip: time budget; n/a: infeasible "
          "formulation; n/s: the peer does not support it (fa4: no split-KV on SM90);\n!: flashserve output "
          "non-finite or all zeros;\nfs/best: best peer time / flashserve time "
          "(fp8 / int8 rows: bf16 time / fp8 or int8 time; shared *_cascade rows: split-KV time / cascade time;\nprefill_mods rows "
          "without an ok peer row (alibi, alibi_sqrt, chunk; fa4 absent): TFLOP/s over the plain row's of the same shape;\n"
          "prefill_paged rows: TFLOP/s over the contiguous row's; mixed step: its parts' summed step times over its "
          "own);\nfs%ceil: of the "
          "GEMM (prefill) or copy (decode) ceiling")


# ---------------------------------------------------------------- main

def git_commit() -> str:
    # FLASHSERVE_COMMIT first: the GPU machine's copy of the tree may carry a stale .git (its HEAD
    # an older commit than the files), where the caller knows the commit of what it sent.
    if os.environ.get("FLASHSERVE_COMMIT"):
        return os.environ["FLASHSERVE_COMMIT"]
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if sha:
            return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset of the configurations (a few minutes)")
    ap.add_argument("--only", help="comma-separated configuration names, fnmatch patterns or families")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"peers to run (default {','.join(PEERS)}; '' for none)")
    ap.add_argument("--no-flashserve", action="store_true", help="skip the attn_bench rows")
    ap.add_argument("--attn-bench", type=Path, default=DEFAULT_BINARY, help="path of the attn_bench binary")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "build" / "bench-out")))
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="wall-clock budget for the whole run; rows past it are marked skipped")
    ap.add_argument("--min-iters", type=int, default=20, help="timed runs per row (median), at least")
    ap.add_argument("--row-budget-s", type=float, default=4.0,
                    help="flashserve: fewer than --min-iters runs only when they would exceed this")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only (no torch, no GPU)")
    args = ap.parse_args(argv)
    args.peers = tuple(p for p in args.peers.split(",") if p)
    bad = [p for p in args.peers if p not in PEERS]
    if bad:
        ap.error(f"unknown peer(s) {bad}; have {PEERS}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    configs = select_configs(args.quick, args.only)
    if args.dry_run:
        print_plan(configs, args.peers)
        return 0
    import peers as peer_mod  # torch: imported only for a GPU run
    import plots

    args.out.mkdir(parents=True, exist_ok=True)
    header = peer_mod.measure_header(min_iters=args.min_iters)
    header.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), commit=git_commit(),
                  command="python3 bench/driver.py " + " ".join(argv), attn_bench=str(args.attn_bench))
    print(f"driver: {header['device']}, ceilings copy {header['ceilings']['copy_gbps']:.0f} GB/s, "
          f"GEMM {header['ceilings']['gemm_tflops']:.0f} TFLOP/s ({time.monotonic() - t0:.0f} s)", flush=True)
    peers = args.peers
    if "fa4" in peers:  # optional: carried as wheels (tools/carry-fa4); absent -> the other peers only
        header["fa4"] = peer_mod.fa4_status()
        if header["fa4"]["available"]:
            print(f"driver: FlashAttention-4 {header['fa4'].get('version')} (flash_attn.cute) imported "
                  f"({time.monotonic() - t0:.0f} s); its first call per shape JIT-compiles (untimed)", flush=True)
        else:
            print(f"driver: FlashAttention-4 absent ({header['fa4'].get('error')}); continuing without the fa4 "
                  "peer (tools/carry-fa4 says how to carry it)", flush=True)
            peers = tuple(p for p in peers if p != "fa4")

    rows: list[dict] = []
    if not args.no_flashserve:
        peer_mod.release_memory()
        left = args.budget_s - (time.monotonic() - t0)
        extra = ["--min-iters", str(args.min_iters), "--row-budget-s", str(args.row_budget_s)]
        rows += flashserve_rows(configs, args.attn_bench, max(left * 0.5, 1.0), extra)
        print(f"driver: flashserve rows done ({time.monotonic() - t0:.0f} s)", flush=True)
    # Cheap peers first over every configuration, then the compiled ones.
    for peer in peers:
        for c in configs:
            if peer not in c.peers:
                continue
            if time.monotonic() - t0 > args.budget_s:
                rows.append({"config": c.name, "peer": peer, "status": "skipped", "error": "time budget"})
                continue
            rows.append(peer_mod.run_peer(peer, c, min_iters=args.min_iters))
        print(f"driver: {peer} rows done ({time.monotonic() - t0:.0f} s)", flush=True)
    header["clocks_end"] = peer_mod.gpu_clocks()
    header["wall_s"] = round(time.monotonic() - t0, 1)

    add_figures(rows, configs, header)
    result = {"header": header, "configs": [dataclasses.asdict(c) | {"flops": c.flops, "kv_bytes": c.kv_bytes}
                                            for c in configs], "rows": rows}
    path = args.out / "results.json"
    path.write_text(json.dumps(result, indent=1))
    for png in plots.render(result, args.out):
        print(f"driver: wrote {png}")
    print(f"driver: wrote {path} ({len(rows)} rows, {header['wall_s']} s)")
    print_table(header, configs, rows)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
