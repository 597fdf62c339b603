"""batch_invariant=True on the drop-ins (numpy on the CPU; torch CUDA when available): a
sequence's out and LSE are bitwise the same alone and inside random batches of its class
(decode/verify: q_len <= 16), KV lengths across several 1024-key splits."""

from __future__ import annotations

import numpy as np
import pytest

import flashserve as fs


def _rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _varlen(seqs, **kw):
    """seqs: [(q, k, v)] -> (out, lse) per sequence, from one varlen call over all of them."""
    q = np.concatenate([s[0] for s in seqs])
    k = np.concatenate([s[1] for s in seqs])
    v = np.concatenate([s[2] for s in seqs])
    ql, kl = [len(s[0]) for s in seqs], [len(s[1]) for s in seqs]
    out, lse = fs.flash_attn_varlen_func(q, k, v, max(ql), _cu(ql), max(kl), cu_seqlens_k=_cu(kl),
                                         causal=True, return_softmax_lse=True, **kw)
    cq = _cu(ql)
    return [(out[cq[i]:cq[i + 1]], lse[:, cq[i]:cq[i + 1]]) for i in range(len(seqs))]


def _seq(rng, sq, sk, h=4, hk=2, d=32):
    return _rand(rng, (sq, h, d)), _rand(rng, (sk, hk, d)), _rand(rng, (sk, hk, d))


def test_varlen_sequence_is_bitwise_the_same_in_every_batch(rng):
    target = _seq(rng, int(rng.integers(1, 9)), int(rng.integers(1500, 3500)))
    alone = _varlen([target], batch_invariant=True)[0]
    for _ in range(4):
        others = [_seq(rng, int(rng.integers(1, 17)), int(rng.integers(0, 5000))) for _ in range(rng.integers(1, 4))]
        at = int(rng.integers(0, len(others) + 1))
        mix = others[:at] + [target] + others[at:]
        got = _varlen(mix, batch_invariant=True)[at]
        assert np.array_equal(got[0], alone[0]) and np.array_equal(got[1], alone[1])
    unsplit = _varlen([target], num_splits=1, batch_invariant=True)[0]
    np.testing.assert_allclose(alone[0], unsplit[0], rtol=1e-4, atol=1e-5)


def test_kvcache_keyword_and_errors(rng):
    b, sq, hk, h, d = 3, 2, 1, 2, 16
    lens = [1100, 40, 2300]
    k_cache, v_cache = _rand(rng, (b, 2400, hk, d)), _rand(rng, (b, 2400, hk, d))
    q = _rand(rng, (b, sq, h, d))
    full = fs.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array(lens, np.int32),
                                      causal=True, batch_invariant=True)
    for i in range(b):
        one = fs.flash_attn_with_kvcache(q[i:i + 1], k_cache[i:i + 1, :lens[i] + 5], v_cache[i:i + 1, :lens[i] + 5],
                                         cache_seqlens=np.array(lens[i:i + 1], np.int32), causal=True,
                                         batch_invariant=True)
        assert np.array_equal(one[0], full[i]), f"sequence {i}"
    with pytest.raises(ValueError, match="^num_splits: expected 0 .*batch_invariant"):
        fs.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array(lens, np.int32), num_splits=4,
                                   batch_invariant=True)


def test_scheduler_metadata_carries_the_flag(rng):
    q_lens, k_lens = [1, 1], [2000, 90]
    q, k, v = _rand(rng, (2, 4, 32)), _rand(rng, (2090, 2, 32)), _rand(rng, (2090, 2, 32))
    args = (q, k, v, 1, _cu(q_lens), 2000)
    md = fs.get_scheduler_metadata(2, 1, 2000, 4, 2, 32, np.array(k_lens, np.int32), cu_seqlens_q=_cu(q_lens),
                                   batch_invariant=True)
    a = fs.flash_attn_varlen_func(*args, cu_seqlens_k=_cu(k_lens), batch_invariant=True)
    b = fs.flash_attn_varlen_func(*args, cu_seqlens_k=_cu(k_lens), batch_invariant=True, scheduler_metadata=md)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="^scheduler_metadata:"):  # made without the flag
        fs.flash_attn_varlen_func(*args, cu_seqlens_k=_cu(k_lens), batch_invariant=True,
                                  scheduler_metadata=fs.get_scheduler_metadata(
                                      2, 1, 2000, 4, 2, 32, np.array(k_lens, np.int32), cu_seqlens_q=_cu(q_lens)))


def test_cuda_decode_is_bitwise_the_same_in_every_batch():
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and fs.WITH_CUDA):
        pytest.skip("needs a CUDA device and a package with CUDA kernels")
    g = torch.Generator(device="cuda").manual_seed(5)
    bs, hk, grp, d, B = 16, 8, 4, 128, 12
    lens = torch.randint(1, 6000, (B,), generator=g, device="cuda").to(torch.int32)
    blocks = int((lens.max().item() + bs - 1) // bs)
    k_cache = torch.randn(B * blocks + 4, bs, hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(B * blocks + 4, device="cuda", generator=g)[:B * blocks].view(B, blocks).to(torch.int32)
    for sq in (1, 4):
        q = torch.randn(B, sq, hk * grp, d, device="cuda", generator=g, dtype=torch.bfloat16)
        full = fs.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True,
                                          batch_invariant=True)
        for i in range(B):
            cols = int((lens[i].item() + bs - 1) // bs)
            one = fs.flash_attn_with_kvcache(q[i:i + 1], k_cache, v_cache, cache_seqlens=lens[i:i + 1],
                                             block_table=table[i:i + 1, :cols].contiguous(), causal=True,
                                             batch_invariant=True)
            assert torch.equal(one[0], full[i]), f"sq={sq} sequence {i} (len {lens[i].item()})"


@pytest.mark.parametrize("how", ["inference_mode", "compile", "cuda_graph"])
def test_keyword_under_inference_mode_compile_and_graphs(rng, how):
    """batch_invariant=True through the torch path (the custom ops): eager, torch.inference_mode,
    torch.compile(fullgraph=True) and (CUDA) graph capture give the same bits."""
    torch = pytest.importorskip("torch")
    from helpers_torch import DEVICES, capture  # noqa: E402 (torch present)
    if how == "cuda_graph" and "cuda" not in DEVICES:
        pytest.skip("CUDA-graph capture needs CUDA")
    for device in DEVICES:
        if how == "cuda_graph" and device != "cuda":
            continue
        g = torch.Generator(device="cpu").manual_seed(int(rng.integers(1 << 31)))
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        b, hk, h, d, bs, blocks = 3, 2, 4, 64, 16, 160
        k_cache = torch.randn(b * blocks, bs, hk, d, generator=g).to(device, dt)
        v_cache = torch.randn(b * blocks, bs, hk, d, generator=g).to(device, dt)
        table = torch.randperm(b * blocks, generator=g)[: b * blocks].view(b, blocks).to(device, torch.int32)
        lens = torch.tensor([2500, 37, 1800], dtype=torch.int32, device=device)
        q = torch.randn(b, 2, h, d, generator=g).to(device, dt)

        def step(out):
            return fs.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                              causal=True, out=out, batch_invariant=True)

        eager = step(torch.full_like(q, float("nan")))
        out = torch.full_like(q, float("nan"))
        if how == "inference_mode":
            with torch.inference_mode():
                step(out)
        elif how == "compile":
            torch._dynamo.reset()
            torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(out)
        else:
            graph = capture(lambda: step(out))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{how} on {device}"
