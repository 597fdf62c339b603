"""Decode context parallelism through the Python backend, one process per rank
(torch.multiprocessing spawn; the rank's work is dcp_worker.run_rank): random decode and verify
batches over interleaved KV shards, the shard's new K/V written by the layer, the step's
output compared with the single-device result of the same inputs, and bitwise equal over two
runs (num_splits = 1).

On the CPU over torch.distributed's gloo (worlds 2 and 3); the same test runs over NCCL on
GPUs when at least `world` are visible (skipped otherwise), where it also replays the step
captured in a CUDA graph. Pure-Python pieces (DcpGroup over a
vLLM-like GroupCoordinator, the slot and length helpers) are checked in-process.
"""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import dcp_worker  # noqa: E402
import flashserve  # noqa: E402
from flashserve import dcp  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, backend: str) -> None:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    seed = int(os.environ.get("FLASHSERVE_SEED", "1")) % 100000
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(dcp_worker.run_rank, args=(world, backend, init, seed), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_gloo_matches_single_device(world):
    if not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    _spawn(world, "gloo")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_dcp_nccl_matches_single_device(world):
    if not (flashserve.WITH_CUDA and torch.cuda.is_available() and torch.cuda.device_count() >= world):
        pytest.skip(f"needs {world} GPUs and a CUDA build")
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    _spawn(world, "nccl")


# ---------------------------------------------------------------- in-process pieces


class _Coordinator:
    """vLLM's GroupCoordinator surface that DcpGroup uses, over W simulated ranks' tensors."""

    def __init__(self, world: int, rank: int, shared: dict) -> None:
        self.world_size, self.rank_in_group, self.shared = world, rank, shared

    def all_gather(self, t, dim=0):
        return torch.cat([self.shared[r] for r in range(self.world_size)], dim=dim)

    def reduce_scatter(self, t, dim=0):
        parts = [self.shared[r].chunk(self.world_size, dim=dim)[self.rank_in_group] for r in range(self.world_size)]
        return torch.stack(parts).sum(0)


def test_dcp_group_over_a_group_coordinator():
    shared = {r: torch.full((2, 3), float(r + 1)) for r in range(3)}
    g = dcp.DcpGroup(_Coordinator(3, 1, shared))
    assert (g.world_size, g.rank) == (3, 1)
    out = torch.empty(6, 3)
    g.all_gather(out, shared[1])
    assert torch.equal(out, torch.cat([shared[r] for r in range(3)]))
    shared.update({r: torch.arange(6.0).view(3, 2) * (r + 1) for r in range(3)})
    rs = torch.empty(1, 2)
    g.reduce_scatter(rs, shared[1])
    assert torch.equal(rs, (torch.tensor([[2.0, 3.0]]) * 6))


def test_dcp_group_needs_a_group():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="dcp_group"):
        dcp.DcpGroup(None)


@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_local_lengths_and_slots(interleave):
    W = 3
    lens = torch.arange(0, 200, dtype=torch.int32)
    for r in range(W):
        local = dcp.dcp_local_seq_lens(lens, W, r, interleave)
        want = torch.tensor([sum(1 for t in range(n) if (t // interleave) % W == r) for n in lens.tolist()])
        assert torch.equal(local.long(), want)
        assert all(flashserve._C.DcpAttentionLayer.local_len(n, W, r, interleave) == int(w)
                   for n, w in zip(lens.tolist(), want.tolist()))
    # slots: one request whose local block table is [5, 2, 7]
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    pos = torch.arange(0, 60)
    for r in range(W):
        s = dcp.dcp_slot_mapping(pos, table.expand(len(pos), -1), 16, W, r, interleave)
        for p, slot in zip(pos.tolist(), s.tolist()):
            if (p // interleave) % W != r:
                assert slot == -1
            else:
                li = p // (interleave * W) * interleave + p % interleave
                assert slot == [5, 2, 7][li // 16] * 16 + li % 16


def test_builder_without_group_builds_metadata_only():
    spec = flashserve.FlashServeKVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    config = flashserve.FlashServeEngineConfig(num_heads=2, dcp_world_size=2, dcp_rank=1,
                                               cp_kv_cache_interleave_size=4, max_model_len=1024)
    b = flashserve.FlashServeMetadataBuilder(spec, ["l"], config)
    assert (b.dcp_world_size, b.dcp_rank, b.cp_kv_cache_interleave_size) == (2, 1, 4)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq = torch.tensor([37], dtype=torch.int32)
    common = flashserve.CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq, num_reqs=1,
        num_actual_tokens=1, max_query_len=1, max_seq_len=37, block_table_tensor=torch.zeros((1, 4), dtype=torch.int32),
        slot_mapping=torch.tensor([-1]))
    md = b.build(0, common)
    assert (md.handle.dcp_world_size, md.handle.dcp_rank, md.handle.dcp_interleave) == (2, 1, 4)
    impl = flashserve.FlashServeImpl(2, 64, 0.125, 2, dtype="float32")
    kv = torch.zeros((2, 4, 16, 2, 64))
    with pytest.raises(ValueError, match="dcp_group"):
        impl.forward(None, torch.zeros(1, 2, 64), None, None, kv, md, output=torch.zeros(1, 2, 64))


def test_dcp_bench_smoke(tmp_path):
    """bench/dcp_bench.py's single-device side on the CPU (tiny context): it runs and writes its
    JSON (the GPU numbers come from the GPU machine)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "dcp.json"
    env = dict(os.environ, FLASHSERVE_PYTHONPATH=os.path.dirname(os.path.dirname(flashserve.__file__)))
    subprocess.run([sys.executable, os.path.join(root, "bench", "dcp_bench.py"), "--device", "cpu", "--quick",
                    "--context", "256", "--batch", "1", "--ranks", "2", "--models", "gqa", "mla", "--json", str(out)],
                   check=True, env=env, capture_output=True, timeout=120)
    results = json.load(open(out))["results"]
    assert [r["model"].split()[0] for r in results] == ["gqa", "mla"]
    assert all(r["rows"][0]["N"] == 2 and r["rows"][0]["step_us"] > 0 for r in results)
