"""One rank of the decode-context-parallel tests (test_dcp.py), run in its own process.

Every rank draws the same global batch from the seed: per request a global KV length (after
the step) and the K/V of every position. It keeps the positions its shard owns ((t // I) % W ==
rank, I the interleave) in its own paged cache, the step's new tokens written by the layer at
this rank's slot_mapping (-1 for positions of other ranks), and runs the step through the
backend classes (FlashServeMetadataBuilder with the dcp group, FlashServeImpl). The result is
compared with the single-device result of the same inputs (one FlashServeImpl with every
rank's heads over the whole cache, computed in each rank), and the step is run a second time on
a fresh shard: the two outputs must be bitwise equal (num_splits = 1). On GPUs (NCCL) the step,
collectives included, is also captured in a CUDA graph and replayed: the same bits.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from flashserve import (CommonAttentionMetadata, FlashServeEngineConfig, FlashServeImpl, FlashServeKVCacheSpec,
                        FlashServeMetadataBuilder)

BS = 16


@dataclass
class DcpCase:
    heads_per_rank: int
    num_kv_heads: int
    q_len: int          # 1: decode; > 1: a verify step (num_speculative_tokens = q_len - 1)
    interleave: int
    head_size: int = 64
    sinks: bool = False
    batch: int = 4
    max_seq: int = 300


def cases(world: int) -> list[DcpCase]:
    """Head counts where each rank's heads read whole KV heads (or share one)."""
    return [
        DcpCase(2, 2, 1, 1),
        DcpCase(2, 1, 1, 4, sinks=True),
        DcpCase(2, world, 1, 16),                 # each rank's heads read one KV head
        DcpCase(2, 2, 3, 2),                      # verify: causal across ranks
        DcpCase(4, 2, 4, 16, head_size=128, sinks=True),
        DcpCase(1, 1, 1, 3, batch=8, max_seq=700),  # interleave not dividing the block size
    ]


def owner(pos: torch.Tensor, world: int, il: int) -> torch.Tensor:
    return pos // il % world


def local_index(pos: torch.Tensor, world: int, il: int) -> torch.Tensor:
    return pos // (il * world) * il + pos % il


class Cache:
    """A paged NHD cache (2, num_blocks, BS, H_kv, D) holding, per request, the positions
    `keep(pos)` at local index `index(pos)`, blocks in a shuffled order."""

    def __init__(self, gen: torch.Generator, local_lens: list[int], H_kv: int, D: int, dtype, device) -> None:
        nblocks = [-(-n // BS) for n in local_lens]
        total = sum(nblocks) + 2
        order = torch.randperm(total, generator=gen).tolist()
        self.kv = torch.zeros((2, total, BS, H_kv, D), dtype=dtype, device=device)
        width = max(nblocks) + 1
        self.table = torch.zeros((len(local_lens), width), dtype=torch.int32)
        nxt = 0
        for r, n in enumerate(nblocks):
            self.table[r, :n] = torch.tensor(order[nxt:nxt + n], dtype=torch.int32)
            nxt += n
        self.table = self.table.to(device)

    def slots(self, r: int, local: torch.Tensor) -> torch.Tensor:
        blocks = self.table[r].long()[local // BS]
        return blocks * BS + local % BS


def run_rank(rank: int, world: int, backend: str, init: str, seed: int) -> None:
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(world)), backend=backend)
    try:
        for i, c in enumerate(cases(world)):
            run_case(rank, world, group, device, c, seed * 1000 + i)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_case(rank: int, world: int, group, device, c: DcpCase, seed: int) -> None:
    what = f"world {world} rank {rank} {c} seed {seed}"
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    dtype = torch.bfloat16
    Hl, H_kv, D, q = c.heads_per_rank, c.num_kv_heads, c.head_size, c.q_len
    H = Hl * world
    B = c.batch
    seq = [int(x) for x in rng.integers(q, c.max_seq, size=B)]
    seq[0] = q  # a request whose only KV are the new tokens
    k_all = [torch.randn((n, H_kv, D), generator=gen).to(dtype) for n in seq]
    v_all = [torch.randn((n, H_kv, D), generator=gen).to(dtype) for n in seq]
    query = (torch.randn((B * q, H, D), generator=gen)).to(dtype).to(device)
    sinks = torch.rand((H,), generator=gen).to(device) * 2 - 1 if c.sinks else None
    new_k = torch.cat([k[-q:] for k in k_all]).to(device)
    new_v = torch.cat([v[-q:] for v in v_all]).to(device)
    qsl = torch.arange(0, B * q + 1, q, dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)

    def step(W: int, r: int, heads: int, cache_gen_seed: int):
        """(output [T, heads, D], cache) of rank r of W over its shard (W = 1: the whole cache)."""
        il = c.interleave if W > 1 else 1
        mine = [torch.nonzero(owner(torch.arange(n), W, il) == r).flatten() for n in seq]
        cache = Cache(torch.Generator().manual_seed(cache_gen_seed), [len(m) for m in mine], H_kv, D, dtype, device)
        slots = []
        for b, n in enumerate(seq):
            pos = mine[b]
            ctx = pos[pos < n - q]  # the context; the step's tokens are the layer's to write
            s = cache.slots(b, local_index(ctx, W, il).to(device))
            cache.kv[0].view(-1, H_kv, D)[s] = k_all[b][ctx].to(device)
            cache.kv[1].view(-1, H_kv, D)[s] = v_all[b][ctx].to(device)
            new = torch.arange(n - q, n)
            ns = cache.slots(b, local_index(new, W, il).to(device))
            slots.append(torch.where(owner(new, W, il).to(device) == r, ns, torch.full_like(ns, -1)))
        slot_mapping = torch.cat(slots).long()
        spec = FlashServeKVCacheSpec(block_size=BS, num_kv_heads=H_kv, head_size=D, dtype=dtype)
        config = FlashServeEngineConfig(num_heads=heads, max_num_seqs=16, max_num_batched_tokens=64,
                                        max_model_len=1024, num_speculative_tokens=q - 1, num_splits=1,
                                        dcp_group=group if W > 1 else None, cp_kv_cache_interleave_size=il)
        builder = FlashServeMetadataBuilder(spec, ["layer"], config, device=device)
        assert builder.dcp_world_size == W and builder.dcp_rank == r, what
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_t.to(device),
            seq_lens_cpu=seq_t, num_reqs=B, num_actual_tokens=B * q, max_query_len=q, max_seq_len=max(seq),
            block_table_tensor=cache.table, slot_mapping=slot_mapping)
        md = builder.build(0, common)
        h0 = r * heads
        impl = FlashServeImpl(heads, D, D ** -0.5, H_kv,
                              sinks=None if sinks is None else sinks[h0:h0 + heads].contiguous(),
                              forward_includes_kv_cache_update=True, dtype=dtype, dcp_world_size=W)
        out = torch.full((B * q, heads, D), float("nan"), dtype=dtype, device=device)
        q_rank = query[:, h0:h0 + heads]
        impl.forward(None, q_rank, new_k, new_v, cache.kv, md, output=out)
        if device.type == "cuda" and W > 1:
            # the whole step, collectives included, captured in one CUDA graph and replayed
            # (the cache write is idempotent): the eager step's bits
            replayed = torch.full_like(out, float("nan"))
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                impl.forward(None, q_rank, new_k, new_v, cache.kv, md, output=replayed)
            torch.cuda.current_stream(device).wait_stream(side)
            replayed.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                impl.forward(None, q_rank, new_k, new_v, cache.kv, md, output=replayed)
            graph.replay()
            torch.cuda.synchronize(device)
            assert torch.equal(replayed, out), f"{what}: the graph replay differs from the eager step"
        # the layer wrote this rank's new tokens, and only those
        for b, n in enumerate(seq):
            new = torch.arange(n - q, n)
            own = new[owner(new, W, il) == r]
            s = cache.slots(b, local_index(own, W, il).to(device))
            assert torch.equal(cache.kv[0].view(-1, H_kv, D)[s].cpu(), k_all[b][own]), what
        return out

    want = step(1, 0, H, seed + 1)[:, rank * Hl:(rank + 1) * Hl].float().cpu()
    got = step(world, rank, Hl, seed + 2 + rank)
    again = step(world, rank, Hl, seed + 2 + rank)
    assert torch.isfinite(got.float()).all(), what
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= 2e-2, f"{what}: max |dcp - single device| = {err}"
    assert torch.equal(got, again), f"{what}: two runs differ"


def main() -> None:  # python dcp_worker.py: a torchrun entry (RANK / WORLD_SIZE / MASTER_*)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("DCP_BACKEND", "nccl" if torch.cuda.device_count() >= world else "gloo")
    run_rank(rank, world, backend, "env://", int(os.environ.get("FLASHSERVE_SEED", "1")))


if __name__ == "__main__":
    main()
