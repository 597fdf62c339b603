"""vLLM v0's cache operations as public drop-ins: flashserve.swap_blocks, copy_blocks and
advance_step (= advance_step_flashattn), called the way vLLM v0's FlashAttention backend calls
ops.swap_blocks / ops.copy_blocks / ops.advance_step_flashattn (on kv_cache[0] / kv_cache[1]
views of the (2, num_blocks, block_size, H_kv, D) cache), against a reference written here:
copies bit for bit, every other block and row untouched, bad input rejected naming the
argument with nothing written. CPU always; CUDA (and CUDA <-> host swaps) when available."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")

from helpers_torch import HAS_CUDA, DEVICES  # noqa: E402

NAN = float("nan")


def gen_of(rng: np.random.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(1 << 62)))


def kv_cache(rng, num_blocks: int, block_size: int, heads_kv: int, d: int, dtype, device,
             layout: str) -> torch.Tensor:
    """vLLM's (2, num_blocks, block_size, H_kv, D) cache, HND through its stride order."""
    shape = (2, num_blocks, heads_kv, block_size, d) if layout == "hnd" else (2, num_blocks, block_size, heads_kv, d)
    x = torch.randn(shape, generator=gen_of(rng)).to(dtype).to(device)
    return x.transpose(2, 3) if layout == "hnd" else x


def mapping(rng, n: int, src_blocks: int, dst_blocks: int, distinct_from_src: bool) -> torch.Tensor:
    """int64 [n, 2] (src, dst): distinct destinations, none of them a source when asked."""
    dst = rng.permutation(dst_blocks)[:n]
    pool = np.setdiff1d(np.arange(src_blocks), dst) if distinct_from_src else np.arange(src_blocks)
    src = rng.choice(pool, size=n, replace=True)
    return torch.tensor(np.stack([src, dst], axis=1), dtype=torch.int64)


def test_signatures_match_vllm() -> None:
    """Same parameter names and order as vLLM's ops (v0 _custom_ops)."""
    assert list(inspect.signature(flashserve.swap_blocks).parameters) == ["src", "dst", "block_mapping"]
    assert list(inspect.signature(flashserve.copy_blocks).parameters) == ["key_caches", "value_caches",
                                                                         "block_mapping"]
    params = list(inspect.signature(flashserve.advance_step).parameters)
    assert params == ["num_seqs", "num_queries", "block_size", "input_tokens", "sampled_token_ids",
                      "input_positions", "seq_lens", "slot_mapping", "block_tables", "turn_prefills_into_decodes"]
    assert flashserve.advance_step_flashattn is flashserve.advance_step
    assert {"swap_blocks", "copy_blocks", "advance_step"} <= set(flashserve.__all__)


# ---------------------------------------------------------------- swap_blocks

SWAP_DIRECTIONS = [("cpu", "cpu")] + ([("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")]
                                      if HAS_CUDA else [])


@pytest.mark.parametrize("src_dev,dst_dev", SWAP_DIRECTIONS, ids=lambda d: d)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8], ids=["bf16", "fp16", "u8"])
def test_swap_blocks(rng, src_dev: str, dst_dev: str, layout: str, dtype) -> None:
    """vLLM v0's backend swap: ops.swap_blocks(src_kv[0], dst_kv[0], src_to_dst), then [1]."""
    block_size, heads_kv, d = int(rng.choice([1, 16])), 2, 64
    src_kv = kv_cache(rng, int(rng.integers(4, 12)), block_size, heads_kv, d, dtype, src_dev, layout)
    dst_kv = kv_cache(rng, int(rng.integers(4, 12)), block_size, heads_kv, d, dtype, dst_dev, layout)
    if dst_dev == "cpu" and src_dev != "cpu":
        dst_kv = dst_kv.pin_memory() if layout == "nhd" else dst_kv
    n = int(rng.integers(1, min(src_kv.shape[1], dst_kv.shape[1]) + 1))
    m = mapping(rng, n, src_kv.shape[1], dst_kv.shape[1], False)
    want = dst_kv.cpu().clone()
    for s, t in m.tolist():
        want[:, t] = src_kv[:, s].cpu()
    for i in (0, 1):
        flashserve.swap_blocks(src_kv[i], dst_kv[i], m)
    if "cuda" in (src_dev, dst_dev):
        torch.cuda.synchronize()
    assert torch.equal(dst_kv.cpu().view(torch.uint8) if dtype != torch.uint8 else dst_kv.cpu(),
                       want.view(torch.uint8) if dtype != torch.uint8 else want)


def test_swap_blocks_rejects_before_writing(rng) -> None:
    src = kv_cache(rng, 6, 16, 2, 32, torch.bfloat16, "cpu", "nhd")[0]
    dst = torch.full((4, 16, 2, 32), NAN, dtype=torch.bfloat16)
    before = dst.clone()
    bad = [("block_mapping", dict(block_mapping=torch.tensor([[0, 1], [2, 4]]))),   # dst block 4 of 4
           ("block_mapping", dict(block_mapping=torch.tensor([[6, 0]]))),           # src block 6 of 6
           ("block_mapping", dict(block_mapping=torch.tensor([[0, 1]], dtype=torch.int32))),
           ("block_mapping", dict(block_mapping=torch.tensor([0, 1]))),
           ("dst", dict(dst=torch.zeros(4, 16, 2, 32, dtype=torch.float16))),
           ("dst", dict(dst=torch.zeros(4, 8, 2, 32, dtype=torch.bfloat16)))]
    for name, change in bad:
        args = dict(src=src, dst=dst, block_mapping=torch.tensor([[0, 1]]))
        args.update(change)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            flashserve.swap_blocks(**args)
        assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8)), name
    if HAS_CUDA:
        with pytest.raises(ValueError, match="^block_mapping: expected device cpu"):
            flashserve.swap_blocks(src.cuda(), dst, torch.tensor([[0, 1]], device="cuda"))


# ---------------------------------------------------------------- copy_blocks

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "f32"])
def test_copy_blocks(rng, device: str, layout: str, dtype) -> None:
    """vLLM v0's backend copy: ops.copy_blocks([kv[0] per layer], [kv[1] per layer], src_to_dists)
    copies each pair in every layer's K and V cache and nothing else."""
    layers, num_blocks = int(rng.integers(1, 4)), int(rng.integers(6, 16))
    kv_caches = [kv_cache(rng, num_blocks, int(rng.choice([1, 16])), 2, 64, dtype, device, layout)
                 for _ in range(layers)]
    m = mapping(rng, int(rng.integers(1, num_blocks // 2 + 1)), num_blocks, num_blocks, True).to(device)
    want = [kv.cpu().clone() for kv in kv_caches]
    for w in want:
        for s, t in m.tolist():
            w[:, t] = w[:, s].clone()
    flashserve.copy_blocks([kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], m)
    if device == "cuda":
        torch.cuda.synchronize()
    for layer, (kv, w) in enumerate(zip(kv_caches, want)):
        assert torch.equal(kv.cpu().view(torch.uint8), w.view(torch.uint8)), f"layer {layer}"


def test_copy_blocks_rejects_before_writing(rng) -> None:
    keys = [torch.randn(6, 16, 2, 32, generator=gen_of(rng)) for _ in range(2)]
    values = [torch.randn(6, 16, 2, 32, generator=gen_of(rng)) for _ in range(2)]
    before = [t.clone() for t in keys + values]
    ok = torch.tensor([[0, 1]])
    bad = [("value_caches", dict(value_caches=values[:1])),
           ("value_caches\\[1\\]", dict(value_caches=[values[0], torch.randn(5, 16, 2, 32)])),
           ("value_caches\\[0\\]", dict(value_caches=["not a tensor", values[1]])),
           ("block_mapping", dict(block_mapping=torch.tensor([[0, 1], [3, 6]]))),
           ("block_mapping", dict(block_mapping=torch.tensor([[-1, 2]]))),
           ("block_mapping", dict(block_mapping=torch.tensor([[0, 1, 2]])))]
    for name, change in bad:
        args = dict(key_caches=keys, value_caches=values, block_mapping=ok)
        args.update(change)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            flashserve.copy_blocks(**args)
        for t, b in zip(keys + values, before):
            assert torch.equal(t, b), name


# ---------------------------------------------------------------- advance_step

def advance_ref(num_queries: int, block_size: int, tokens, sampled, positions, seq_lens, slots, tables,
                num_seqs: int) -> None:
    """vLLM's advance_step_flashattn on host lists/tensors, in place."""
    for i in range(num_seqs):
        if i < num_queries:
            pos = int(seq_lens[i])
            tokens[i], positions[i] = int(sampled[i, 0]), pos
            seq_lens[i] = pos + 1
            slots[i] = int(tables[i, pos // block_size]) * block_size + pos % block_size
        else:
            tokens[i], positions[i], slots[i] = 0, 0, -1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph_padded"])
@pytest.mark.parametrize("turn_prefills_into_decodes", [False, True], ids=["decodes", "prefills_into_decodes"])
def test_advance_step(rng, device: str, padded: bool, turn_prefills_into_decodes: bool) -> None:
    """FlashAttentionMetadata.advance_step's op: rows < num_queries advance one token, CUDA-graph
    padding rows (num_queries <= i < num_seqs) become (0, 0, -1). After a mixed step whose
    prefills turn into decodes, input_tokens / input_positions / slot_mapping still hold that
    step's rows: their first num_seqs rows are written, the rest are left alone."""
    num_queries = int(rng.integers(1, 9))
    num_seqs = num_queries + (int(rng.integers(1, 5)) if padded else 0)
    block_size, max_blocks = int(rng.choice([1, 16, 32])), int(rng.integers(2, 6))
    rows = num_seqs + (int(rng.integers(1, 20)) if turn_prefills_into_decodes else 0)
    lens = rng.integers(0, block_size * max_blocks, size=num_seqs).astype(np.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    tables = torch.tensor(rng.integers(0, 1000, size=(num_seqs, max_blocks + 2)), dtype=torch.int32,
                          device=device)[:, :max_blocks]  # a column slice, as vLLM passes it
    sampled = torch.tensor(rng.integers(0, 50000, size=(num_queries, 1)), dtype=torch.int64, device=device)
    tokens, positions, slots = (torch.tensor(rng.integers(-9, 9, size=rows), dtype=torch.int64, device=device)
                                for _ in range(3))
    want = [t.cpu().clone() for t in (tokens, positions, seq_lens, slots)]
    advance_ref(num_queries, block_size, want[0], sampled.cpu(), want[1], want[2], want[3], tables.cpu(),
                num_seqs)
    flashserve.advance_step(num_seqs=num_seqs, num_queries=num_queries, block_size=block_size,
                            input_tokens=tokens, sampled_token_ids=sampled, input_positions=positions,
                            seq_lens=seq_lens, slot_mapping=slots, block_tables=tables,
                            turn_prefills_into_decodes=turn_prefills_into_decodes)
    for name, got, w in zip(("input_tokens", "input_positions", "seq_lens", "slot_mapping"),
                            (tokens, positions, seq_lens, slots), want):
        assert torch.equal(got.cpu(), w), f"{name}: {got.cpu().tolist()} != {w.tolist()}"


@pytest.mark.parametrize("device", DEVICES)
def test_advance_step_rejects_before_writing(rng, device: str) -> None:
    n, bs = 3, 16
    base = dict(num_seqs=n, num_queries=2, block_size=bs,
                input_tokens=torch.full((n,), 7, dtype=torch.int64, device=device),
                sampled_token_ids=torch.ones(2, 1, dtype=torch.int64, device=device),
                input_positions=torch.full((n,), 7, dtype=torch.int64, device=device),
                seq_lens=torch.tensor([5, 31, 2], dtype=torch.int32, device=device),
                slot_mapping=torch.full((n,), 7, dtype=torch.int64, device=device),
                block_tables=torch.tensor(rng.integers(0, 9, size=(n, 2)), dtype=torch.int32, device=device))
    snapshot = {k: v.clone() for k, v in base.items() if isinstance(v, torch.Tensor)}
    longer = torch.full((n + 4,), 7, dtype=torch.int64, device=device)
    bad = [("input_tokens", dict(input_tokens=longer)),  # more rows only with turn_prefills_into_decodes
           ("slot_mapping", dict(slot_mapping=longer.clone(), turn_prefills_into_decodes=False)),
           ("seq_lens", dict(seq_lens=torch.tensor([5, 31, 2, 4], dtype=torch.int32, device=device),
                             turn_prefills_into_decodes=True)),
           ("input_positions", dict(input_positions=longer[:n - 1].clone(), turn_prefills_into_decodes=True)),
           ("seq_lens", dict(seq_lens=torch.tensor([5, 31, 2], dtype=torch.int64, device=device))),
           ("sampled_token_ids", dict(sampled_token_ids=torch.ones(2, dtype=torch.int64, device=device))),
           ("block_size", dict(block_size=0)),
           ("num_seqs", dict(num_queries=4))]
    if device == "cpu":  # the next position of sequence 1 (31) needs block 1; 32 would need a third
        bad.append(("block_tables", dict(seq_lens=torch.tensor([5, 32, 2], dtype=torch.int32))))
    for name, change in bad:
        args = dict(base)
        args.update(change)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            flashserve.advance_step(**args)
        for k, v in snapshot.items():
            assert torch.equal(base[k], v), f"{k} written by a rejected call ({name})"
