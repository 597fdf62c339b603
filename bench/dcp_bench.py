#!/usr/bin/env python3
"""Decode context parallelism (DCP) benchmark: one decode step of one attention layer over long
contexts (default 128k tokens per request), B = 1 and 8, GQA 32/8 (D 128) and MLA (DeepSeek's
absorbed decode: 128 heads, 512-wide latent + 64 rope, one KV head), on 1 GPU and N GPUs.

Single GPU (what one H200 measures; no collectives):

    python bench/dcp_bench.py --device cuda [--json out.json]

  1. the baseline: the whole layer on one GPU (every head over the whole context);
  2. for each N in --ranks (default 2 4 8): the local compute of one DCP rank, simulated on the
     one GPU: the all-gathered queries (all heads) over rank 0's shard (ceil(L / N) tokens: the
     largest), with the LSE, then the LSE correction; exactly the per-rank phases the N-GPU step
     runs (flashserve._C.DcpAttentionLayer.attend + correct for GQA; the q_v attention call with
     cp arguments + lse_correct for MLA);
  3. the model on paper for each N: step(N) = compute(N) + AG(q) + AG(lse) + RS(out), each
     collective t = alpha + (N - 1) / N * bytes / busbw (--alpha-us, --busbw-gbps: defaults for
     NVLink-connected H200s; or the collectives measured by an N-GPU run: --measured file.json),
     the speed-up baseline / step(N), and the collectives' share of the step.

N GPUs (one process per GPU):

    torchrun --nproc_per_node N bench/dcp_bench.py --device cuda [--json out.json]

  measures the real step through flashserve.dcp.dcp_forward (GQA) or the same phases around the
  MLA call (MLA) over NCCL: the step, the three collectives alone at the step's sizes, and the
  local compute; rank 0 also measures the single-GPU baseline. Its JSON (--json) can be given to
  a single-GPU run as --measured to model 4 and 8 GPUs from measured collectives.

Timing: CUDA graphs of --reps steps replayed --iters times (host overhead out, as an engine
runs decode), CUDA events; --no-graph times eager calls. --device cpu --quick is a smoke run of
the same code on the CPU reference (tiny contexts; with torchrun over gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

if os.environ.get("FLASHSERVE_PYTHONPATH"):
    sys.path.insert(0, os.path.abspath(os.environ["FLASHSERVE_PYTHONPATH"]))

import flashserve  # noqa: E402
from flashserve import _C  # noqa: E402
from flashserve import dcp as fdcp  # noqa: E402

BLOCK = 64


# ---------------------------------------------------------------- models


@dataclass
class Model:
    name: str
    heads: int          # query heads of the layer (all ranks)
    kv_heads: int
    head_size: int      # q.k width (MLA: the latent 512 + rope 64 = 576)
    head_size_v: int
    mla: bool = False

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        if self.mla:  # one latent row holds K and V
            return self.kv_heads * self.head_size * dtype_bytes
        return self.kv_heads * (self.head_size + self.head_size_v) * dtype_bytes


MODELS = {
    "gqa": Model("gqa 32/8 D128", 32, 8, 128, 128),
    "mla": Model("mla 128h 512+64", 128, 1, 576, 512, mla=True),
}


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], None], device: torch.device, args: argparse.Namespace) -> tuple[float, str]:
    """Seconds per call of fn: a CUDA graph of args.reps calls replayed (falls back to eager
    when capture fails), or eager calls on the CPU / with --no-graph."""
    for _ in range(args.warmup):
        fn()
    sync(device)
    if device.type == "cuda" and args.graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s):
                fn()  # warm on the capture stream
            torch.cuda.current_stream(device).wait_stream(s)
            sync(device)
            with torch.cuda.graph(g):
                for _ in range(args.reps):
                    fn()
            g.replay()
            sync(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                g.replay()
            end.record()
            sync(device)
            return start.elapsed_time(end) / 1e3 / (args.iters * args.reps), "graph"
        except Exception as e:  # noqa: BLE001
            print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing eager calls)",
                  file=sys.stderr)
            sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        sync(device)
        return start.elapsed_time(end) / 1e3 / args.iters, "eager"
    t0 = time.perf_counter()
    for _ in range(args.iters):
        fn()
    return (time.perf_counter() - t0) / args.iters, "eager"


# ---------------------------------------------------------------- one rank's data


class Shard:
    """One rank's paged cache of `tokens` positions for each of B requests (W = 1: the whole
    context), random bf16 contents, and the step's metadata inputs."""

    def __init__(self, m: Model, B: int, context: int, W: int, rank: int, device: torch.device,
                 dtype: torch.dtype, interleave: int) -> None:
        self.m, self.B, self.context, self.W, self.rank = m, B, context, W, rank
        self.local = [_C.DcpAttentionLayer.local_len(context, W, rank, interleave) for _ in range(B)]
        nblk = [-(-n // BLOCK) for n in self.local]
        width = max(nblk) + 1
        total = sum(nblk) + 1
        self.table = torch.zeros((B, width), dtype=torch.int32)
        nxt = 0
        for b, n in enumerate(nblk):
            self.table[b, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
            nxt += n
        self.table = self.table.to(device)
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        if m.mla:
            self.latent = torch.randn((total, BLOCK, 1, m.head_size), generator=gen, device=device,
                                      dtype=torch.float32).to(dtype)
            self.kv = None
        else:
            self.kv = torch.randn((2, total, BLOCK, m.kv_heads, m.head_size), generator=gen, device=device,
                                  dtype=torch.float32).to(dtype)
        # the step: one new token per request, at global position context - 1
        self.seq = torch.full((B,), context, dtype=torch.int32)
        self.qsl = torch.arange(0, B + 1, dtype=torch.int32)
        pos = torch.full((B,), context - 1, dtype=torch.int64)
        own = pos // interleave % W == rank
        li = pos // (interleave * W) * interleave + pos % interleave
        slots = self.table.cpu().long().gather(1, (li // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + li % BLOCK
        self.slots = torch.where(own, slots, torch.full_like(slots, -1)).to(device)


# ---------------------------------------------------------------- GQA: the backend's DCP path


def gqa_builder(m: Model, sh: Shard, heads: int, W: int, rank: int, group: Any, device: torch.device,
                interleave: int, num_splits: int) -> Any:
    spec = flashserve.FlashServeKVCacheSpec(block_size=BLOCK, num_kv_heads=m.kv_heads, head_size=m.head_size,
                                            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = flashserve.FlashServeEngineConfig(
        num_heads=heads, max_num_seqs=max(16, sh.B), max_num_batched_tokens=max(64, sh.B),
        max_model_len=sh.context + BLOCK, num_splits=num_splits, max_num_splits=64,
        dcp_world_size=W, dcp_rank=rank, dcp_group=group, cp_kv_cache_interleave_size=interleave)
    builder = flashserve.FlashServeMetadataBuilder(spec, ["layer"], config, device=device)
    common = flashserve.CommonAttentionMetadata(
        query_start_loc=sh.qsl.to(device), query_start_loc_cpu=sh.qsl, seq_lens=sh.seq.to(device),
        seq_lens_cpu=sh.seq, num_reqs=sh.B, num_actual_tokens=sh.B, max_query_len=1, max_seq_len=sh.context,
        block_table_tensor=sh.table, slot_mapping=sh.slots)
    return builder, builder.build(0, common)


class GqaRank:
    """The per-rank phases of one GQA DCP step (attend + correct), or with a group the whole
    step (dcp_forward), or with W = 1 the single-GPU layer (every head, whole context)."""

    def __init__(self, m: Model, B: int, context: int, W: int, rank: int, device: torch.device,
                 dtype: torch.dtype, args: argparse.Namespace, group: Optional[fdcp.DcpGroup] = None) -> None:
        self.m, self.B, self.W, self.device = m, B, W, device
        Hl = m.heads // W
        self.sh = Shard(m, B, context, W, rank, device, dtype, args.interleave)
        self.builder, self.md = gqa_builder(m, self.sh, Hl, W, rank, None if group is None else group.group,
                                            device, args.interleave, args.num_splits)
        gen = torch.Generator(device=device).manual_seed(99 + rank)
        self.q = torch.randn((B, Hl, m.head_size), generator=gen, device=device).to(dtype)
        self.key = torch.randn((B, m.kv_heads, m.head_size), generator=gen, device=device).to(dtype)
        self.value = torch.randn((B, m.kv_heads, m.head_size_v), generator=gen, device=device).to(dtype)
        self.out = torch.empty((B, Hl, m.head_size_v), dtype=dtype, device=device)
        self.group = group
        spec = _C.LayerSpec(Hl, m.kv_heads, m.head_size, kv_layout="NHD", dtype="bfloat16" if dtype == torch.bfloat16
                            else "float32")
        if W == 1:
            self.layer = _C.AttentionLayer(spec)
            self.ws = torch.empty(max(1, self.layer.workspace_bytes(self.builder._c)), dtype=torch.uint8, device=device)
        else:
            self.layer = _C.DcpAttentionLayer(spec, world_size=W, rank=rank)
            self.ws = torch.empty(max(1, self.layer.attend_workspace_bytes(self.builder._c)), dtype=torch.uint8,
                                  device=device)
            self.q_all = torch.randn((W, B, Hl, m.head_size), generator=gen, device=device).to(dtype)
            self.out_all = torch.empty((W, B, Hl, m.head_size_v), dtype=torch.float32, device=device)
            self.out_tok = torch.empty((B, W * Hl, m.head_size_v), dtype=torch.float32, device=device)
            self.lse_local = torch.empty((W * Hl, B), dtype=torch.float32, device=device)
            self.lse_all = torch.zeros((W, W * Hl, B), dtype=torch.float32, device=device)
        self.stream = (lambda: torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (lambda: None)

    def sizes(self) -> dict:
        W, B, m = self.W, self.B, self.m
        el = self.q.element_size()
        return {"ag_q": W * B * (m.heads // W) * m.head_size * el,          # gathered bytes
                "ag_lse": W * m.heads * B * 4,
                "rs_out": W * B * (m.heads // W) * m.head_size_v * 4}        # reduce-scatter input bytes

    def full(self) -> None:  # W = 1: the whole layer on one GPU (writes the new token, attends)
        self.layer.forward(self.md.handle, self.q, self.key, self.value, self.sh.kv[0], self.sh.kv[1], self.out,
                           self.ws, stream=self.stream())

    def compute(self) -> None:  # one rank's local phases, as dcp_forward runs them (fused heads)
        W, B, Hl = self.W, self.B, self.m.heads // self.W
        q_tok = self.q_all.transpose(0, 1).reshape(B, W * Hl, -1)
        self.layer.attend(self.md.handle, q_tok, self.sh.kv[0], self.sh.kv[1], self.out_tok, self.lse_local,
                          self.ws, stream=self.stream())
        self.layer.correct(self.out_tok, self.lse_all, stream=self.stream())
        self.out_all.copy_(self.out_tok.view(B, W, Hl, -1).transpose(0, 1))

    def compute_slices(self) -> None:  # the same with one attention call per rank's slice of heads
        self.layer.attend(self.md.handle, self.q_all, self.sh.kv[0], self.sh.kv[1], self.out_all, self.lse_local,
                          self.ws, stream=self.stream())
        self.layer.correct(self.out_all, self.lse_all, stream=self.stream())

    def step(self) -> None:  # the whole DCP step over the group
        fdcp.dcp_forward(self.layer, self.md.handle, self.q, self.key, self.value, self.sh.kv[0], self.sh.kv[1],
                         self.out, self.group, self.ws)


# ---------------------------------------------------------------- MLA: absorbed decode with q_v


class MlaRank:
    """MLA's absorbed decode: q_pe [B, H, 64] against the rope part, q_nope absorbed [B, H, 512]
    (q_v) against the latent part, one call over the latent cache; under DCP with the cp
    arguments (queries at their global positions) and the LSE, then lse_correct."""

    def __init__(self, m: Model, B: int, context: int, W: int, rank: int, device: torch.device,
                 dtype: torch.dtype, args: argparse.Namespace, group: Optional[fdcp.DcpGroup] = None) -> None:
        if args.interleave != 1:
            raise SystemExit("--interleave: MLA runs through the drop-in's cp arguments (interleave 1)")
        self.m, self.B, self.W, self.rank, self.device, self.group = m, B, W, rank, device, group
        self.sh = Shard(m, B, context, W, rank, device, dtype, 1)
        H, Hl = m.heads, m.heads // W
        self.Hl = Hl
        gen = torch.Generator(device=device).manual_seed(7 + rank)
        lat = self.sh.latent
        self.k_pe = lat[..., m.head_size_v:]         # [nb, bs, 1, 64]
        self.kv_c = lat[..., :m.head_size_v]         # [nb, bs, 1, 512]
        # one query row [nope absorbed 512 | rope 64] per (token, head): one all-gather moves both
        self.q = torch.randn((W * B, Hl, m.head_size), generator=gen, device=device).to(dtype)
        q_all = self.q.view(W, B, Hl, -1).transpose(0, 1).reshape(B, H, -1)
        self.q_nope_all, self.q_pe_all = q_all[..., :m.head_size_v], q_all[..., m.head_size_v:]
        self.out_all = torch.empty((B, H, m.head_size_v), dtype=torch.float32, device=device)
        self.out_full = torch.empty((B, H, m.head_size_v), dtype=dtype, device=device)
        self.lse_all = torch.zeros((W, H, B), dtype=torch.float32, device=device)
        self.cu = self.sh.qsl.to(device)
        self.seqused = torch.tensor(self.sh.local, dtype=torch.int32, device=device)
        self.tot = self.sh.seq.to(device)
        self.out = torch.empty((B, Hl, m.head_size_v), dtype=dtype, device=device)
        self.scale = (192) ** -0.5  # DeepSeek: (nope 128 + rope 64)^-0.5
        self.num_splits = args.num_splits
        self.stream = (lambda: torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (lambda: None)

    def sizes(self) -> dict:
        W, B, m = self.W, self.B, self.m
        el = self.q.element_size()
        return {"ag_q": W * B * self.Hl * m.head_size * el, "ag_lse": W * m.heads * B * 4,
                "rs_out": B * m.heads * m.head_size_v * 4}

    def _attend(self, out: Any, lse: bool) -> Any:
        kw = {} if self.W == 1 else dict(cp_world_size=self.W, cp_rank=self.rank, cp_tot_seqused_k=self.tot)
        return flashserve.flash_attn_varlen_func(
            self.q_pe_all, self.k_pe, self.kv_c, 1, self.cu, self.sh.context, seqused_k=self.seqused,
            q_v=self.q_nope_all, softmax_scale=self.scale, causal=True, block_table=self.sh.table,
            return_softmax_lse=lse, out=out, num_splits=self.num_splits, **kw)

    def full(self) -> None:
        self._attend(self.out_full, False)

    def compute(self) -> None:
        _, lse = self._attend(self.out_all, True)
        _C.lse_correct(self.out_all, self.lse_all, self.rank, None, False, self.stream())

    def step(self) -> None:
        # the same phases as dcp_forward around the MLA call: gather q (both parts), attend,
        # gather LSEs, correct, reduce-scatter the heads back ([B, H] -> this rank's H / W)
        W, B, Hl, g, Dv = self.W, self.B, self.Hl, self.group, self.m.head_size_v
        q = torch.empty_like(self.q)
        g.all_gather(q, self.q[:B].contiguous())
        q = q.view(W, B, Hl, -1).transpose(0, 1).reshape(B, W * Hl, -1)
        qn, qp = q[..., :Dv], q[..., Dv:]
        kw = dict(cp_world_size=W, cp_rank=self.rank, cp_tot_seqused_k=self.tot)
        out_all = torch.empty((B, W * Hl, self.m.head_size_v), dtype=torch.float32, device=self.device)
        _, lse = flashserve.flash_attn_varlen_func(
            qp, self.k_pe, self.kv_c, 1, self.cu, self.sh.context, seqused_k=self.seqused, q_v=qn,
            softmax_scale=self.scale, causal=True, block_table=self.sh.table, return_softmax_lse=True, out=out_all,
            num_splits=self.num_splits, **kw)
        lse_all = torch.empty((W * W * Hl, B), dtype=torch.float32, device=self.device)
        g.all_gather(lse_all, lse.contiguous())
        _C.lse_correct(out_all, lse_all.view(W, W * Hl, B), self.rank, None, False, self.stream())
        rs_in = out_all.view(B, W, Hl, -1).transpose(0, 1).contiguous()
        summed = torch.empty((B, Hl, self.m.head_size_v), dtype=torch.float32, device=self.device)
        g.reduce_scatter(summed, rs_in.view(W * B, Hl, -1))
        self.out.copy_(summed)


def make_rank(m: Model, *a: Any, **kw: Any) -> Any:
    return (MlaRank if m.mla else GqaRank)(m, *a, **kw)


# ---------------------------------------------------------------- the model on paper


def coll_time(bytes_: float, N: int, alpha_s: float, busbw: float) -> float:
    return alpha_s + (N - 1) / N * bytes_ / busbw


def model_row(base_s: float, compute_s: float, sizes: dict, N: int, args: argparse.Namespace,
              measured: Optional[dict]) -> dict:
    src = "paper"
    if measured is not None:
        colls = {k: measured[k] for k in ("ag_q", "ag_lse", "rs_out")}
        src = "measured"
    else:
        a, bw = args.alpha_us * 1e-6, args.busbw_gbps * 1e9
        colls = {k: coll_time(v, N, a, bw) for k, v in sizes.items()}
    comm = sum(colls.values())
    step = compute_s + comm
    return {"N": N, "compute_us": compute_s * 1e6, **{f"{k}_us": v * 1e6 for k, v in colls.items()},
            "step_us": step * 1e6, "speedup": base_s / step, "comm_share": comm / step, "collectives": src}


# ---------------------------------------------------------------- drivers


@dataclass
class Result:
    model: str
    B: int
    context: int
    baseline_us: float
    rows: list = field(default_factory=list)


def single_gpu(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    measured = {}
    if args.measured:
        for r in json.load(open(args.measured))["results"]:
            for row in r["rows"]:
                measured[(r["model"], r["B"], row["N"])] = {k: row[f"{k}_us"] * 1e-6 for k in ("ag_q", "ag_lse",
                                                                                                 "rs_out")}
    results = []
    for mk in args.models:
        m = MODELS[mk]
        for B in args.batch:
            base = make_rank(m, B, args.context, 1, 0, device, dtype, args)
            t_base, how = time_fn(base.full, device, args)
            gb = B * args.context * m.kv_bytes_per_token() / 1e9
            print(f"{m.name} B={B} L={args.context}: 1 GPU {t_base * 1e6:9.1f} us ({how}; KV {gb:.2f} GB, "
                  f"{gb / t_base:.0f} GB/s)", flush=True)
            del base
            res = Result(m.name, B, args.context, t_base * 1e6)
            for N in args.ranks:
                if m.heads % N:
                    continue
                r = make_rank(m, B, args.context, N, 0, device, dtype, args)
                t_c, _ = time_fn(r.compute, device, args)
                row = model_row(t_base, t_c, r.sizes(), N, args, measured.get((m.name, B, N)))
                if hasattr(r, "compute_slices"):
                    row["compute_slices_us"] = time_fn(r.compute_slices, device, args)[0] * 1e6
                res.rows.append(row)
                print(f"    N={N}: rank compute {row['compute_us']:8.1f} us + AG(q) {row['ag_q_us']:6.1f} + "
                      f"AG(lse) {row['ag_lse_us']:6.1f} + RS {row['rs_out_us']:6.1f} ({row['collectives']}) = "
                      f"{row['step_us']:8.1f} us: speed-up {row['speedup']:5.2f}x, collectives "
                      f"{100 * row['comm_share']:4.1f}% of the step"
                      + (f" [per-slice calls: compute {row['compute_slices_us']:.1f} us]"
                         if "compute_slices_us" in row else ""), flush=True)
                del r
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results.append(res)
    return results


def multi_gpu(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    import torch.distributed as dist
    W, rank = dist.get_world_size(), dist.get_rank()
    group = fdcp.DcpGroup(None)
    results = []
    for mk in args.models:
        m = MODELS[mk]
        if m.heads % W:
            if rank == 0:
                print(f"{m.name}: {m.heads} heads do not split over {W} ranks; skipped")
            continue
        for B in args.batch:
            t_base = float("nan")
            if rank == 0 and not args.skip_baseline:
                base = make_rank(m, B, args.context, 1, 0, device, dtype, args)
                t_base, _ = time_fn(base.full, device, args)
                del base
            dist.barrier()
            r = make_rank(m, B, args.context, W, rank, device, dtype, args, group=group)
            t_step, how = time_fn(r.step, device, args)
            t_c, _ = time_fn(r.compute, device, args)
            sizes = r.sizes()
            bufs = {k: torch.empty(v // 4 if k != "ag_q" else v // 2,
                                   dtype=torch.float32 if k != "ag_q" else dtype, device=device)
                    for k, v in sizes.items()}
            colls = {}
            for k, buf in bufs.items():
                n = buf.numel() // W
                if k == "rs_out":
                    dst = torch.empty(n, dtype=buf.dtype, device=device)
                    colls[k], _ = time_fn(lambda: group.reduce_scatter(dst, buf), device, args)
                else:
                    src = buf[:n].clone()
                    colls[k], _ = time_fn(lambda: group.all_gather(buf, src), device, args)
            t = torch.tensor([t_step, t_c, *colls.values()], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            t_step, t_c, *cv = t.tolist()
            comm = sum(cv)
            row = {"N": W, "step_us": t_step * 1e6, "compute_us": t_c * 1e6,
                   **{f"{k}_us": v * 1e6 for k, v in zip(colls, cv)},
                   "speedup": t_base / t_step, "comm_share": comm / (t_c + comm),
                   "collectives": "measured", "timing": how}
            if rank == 0:
                print(f"{m.name} B={B} L={args.context}: 1 GPU {t_base * 1e6:9.1f} us; {W} GPUs step "
                      f"{t_step * 1e6:8.1f} us ({how}): compute {t_c * 1e6:8.1f} + AG(q) {cv[0] * 1e6:6.1f} + "
                      f"AG(lse) {cv[1] * 1e6:6.1f} + RS {cv[2] * 1e6:6.1f} us; speed-up {t_base / t_step:5.2f}x, "
                      f"collectives {100 * row['comm_share']:4.1f}% of compute + collectives", flush=True)
            results.append(Result(m.name, B, args.context, t_base * 1e6, [row]))
            del r, bufs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--context", type=int, default=131072, help="KV tokens per request (default 128k)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--models", nargs="+", default=["gqa", "mla"], choices=sorted(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="N of the single-GPU model")
    ap.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size (GQA)")
    ap.add_argument("--num-splits", type=int, default=0, help="0: the planner's split-KV heuristic")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=10, help="steps per captured graph")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-graph", dest="graph", action="store_false")
    ap.add_argument("--alpha-us", type=float, default=15.0, help="paper model: latency of one NCCL collective")
    ap.add_argument("--busbw-gbps", type=float, default=300.0, help="paper model: NCCL bus bandwidth")
    ap.add_argument("--measured", help="JSON of an N-GPU run: its collectives replace the paper model's")
    ap.add_argument("--skip-baseline", action="store_true", help="N GPUs: no single-GPU baseline on rank 0")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4k context, few iterations")
    ap.add_argument("--json", help="write the results here (rank 0)")
    args = ap.parse_args()
    if args.quick:
        args.context = min(args.context, 4096)
        args.iters, args.reps, args.warmup = 3, 2, 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available() or not flashserve.WITH_CUDA:
            raise SystemExit("--device cuda: needs a GPU and flashserve built with CUDA")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        results = multi_gpu(args, device, dtype)
    else:
        results = single_gpu(args, device, dtype)
    if args.json and rank == 0:
        info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world": world,
                "context": args.context, "timing": "graph" if args.graph else "eager", "alpha_us": args.alpha_us,
                "busbw_gbps": args.busbw_gbps, "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
        print(f"wrote {args.json}")
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
