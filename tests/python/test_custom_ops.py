"""The torch custom ops (torch.ops.flashserve.*) on CPU tensors: torch.library.opcheck of each
op over several inputs (schema and aliasing, fake tensors, autograd registration, AOT dispatch
with dynamic shapes), the ops equal to the eager drop-ins, and torch.compile(fullgraph=True)
of a function calling the drop-ins equal to eager, caches included. Also torch tensors through
the binding: fp8 (and fp8 from a torch that cannot export it through DLPack), metadata."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import flashserve as fs  # noqa: E402

OPS = ("reshape_and_cache_flash", "merge_attn_states", "merge_state_v2", "varlen_fwd", "kvcache_fwd")
NAN = float("nan")


@pytest.fixture
def gen(rng) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(1 << 31)))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def paged_cache(gen, k_lens, block_size, hk, d, dtype, hnd=False):
    """(k_cache, v_cache, block_table) views: caches [num_blocks, block_size, Hk, D] (HND
    through a permuted view), sequence blocks in shuffled order."""
    widths = [-(-n // block_size) for n in k_lens]
    blocks = sum(widths) + 2
    shape = (blocks, hk, block_size, d) if hnd else (blocks, block_size, hk, d)
    caches = [randn(gen, *shape, dtype=dtype) for _ in range(2)]
    if hnd:
        caches = [c.permute(0, 2, 1, 3) for c in caches]
    order = torch.randperm(blocks, generator=gen)
    table = torch.zeros(len(k_lens), max(widths) + 1, dtype=torch.int32)
    used = 0
    for b, w in enumerate(widths):
        table[b, :w] = order[used:used + w]
        used += w
    return caches[0], caches[1], table


def opcheck(name, args, kwargs=None):
    op = getattr(torch.ops.flashserve, name).default
    result = torch.library.opcheck(op, args, kwargs or {})
    assert all(v == "SUCCESS" for v in result.values()), result


def test_ops_registered():
    for name in OPS:
        assert hasattr(torch.ops.flashserve, name), name
    schema = str(torch.ops.flashserve.reshape_and_cache_flash.default._schema)
    assert "Tensor(a0!) key_cache" in schema or "Tensor($0! -> ) key_cache" in schema, schema


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("hnd", [False, True], ids=["nhd", "hnd"])
def test_opcheck_reshape_and_cache_flash(gen, kv_cache_dtype, hnd):
    fused = randn(gen, 6, 3, 2, 16, dtype=torch.bfloat16)  # key/value: views with token stride > row
    k_cache, v_cache, _ = paged_cache(gen, [8], 4, 2, 16, torch.bfloat16, hnd)
    if kv_cache_dtype != "auto":  # fp8 caches as engines allocate them: uint8 (opcheck cannot compare fp8)
        k_cache, v_cache = (c.to(torch.float8_e4m3fn).view(torch.uint8) for c in (k_cache, v_cache))
    slots = torch.tensor([3, -1, 9, 0, 7], dtype=torch.int64)
    scale = torch.tensor([0.5, 0.25])
    opcheck("reshape_and_cache_flash", (fused[:5, 1], fused[:5, 2], k_cache, v_cache, slots, kv_cache_dtype,
                                        scale, scale))


@pytest.mark.parametrize("lse, rows", [(True, None), (False, 4), (True, 0)])
def test_opcheck_merge(gen, lse, rows):
    t, h, d = 6, 3, 16
    a, b = randn(gen, t, h, d, dtype=torch.float16), randn(gen, t, h, d, dtype=torch.float16)
    la, lb = randn(gen, h, t), randn(gen, h, t)
    out = torch.empty(t, h, d, dtype=torch.float16)
    opcheck("merge_attn_states", (out, torch.empty(h, t) if lse else None, a, la, b, lb, rows, None))
    opcheck("merge_state_v2", (a, la.t().contiguous(), b, lb.t().contiguous(), out, torch.empty(t, h)))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("feature", ["plain", "lse_window_sinks", "grad"])
def test_opcheck_varlen_fwd(gen, paged, feature):
    q_lens, k_lens, hk, d = [3, 0, 1, 4], [5, 2, 9, 4], 2, 32
    q = randn(gen, sum(q_lens), 4, d, dtype=torch.bfloat16)
    kwargs = {"causal": True}
    if paged:
        k, v, table = paged_cache(gen, k_lens, 4, hk, d, torch.bfloat16)
        kwargs.update(seqused_k=torch.tensor(k_lens, dtype=torch.int32), block_table=table)
    else:
        k, v = (randn(gen, sum(k_lens), hk, d, dtype=torch.bfloat16) for _ in range(2))
        kwargs["cu_seqlens_k"] = cu(k_lens)
    if feature == "lse_window_sinks":
        kwargs.update(softmax_lse=torch.empty(4, sum(q_lens)), window_left=2, window_right=0, s_aux=randn(gen, 4),
                      num_splits=2)
    if feature == "grad":
        q.requires_grad_(True)
    opcheck("varlen_fwd", (q, k, v, torch.empty_like(q).detach(), cu(q_lens), max(q_lens), max(k_lens)), kwargs)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_opcheck_kvcache_fwd(gen, paged):
    b, sq, h, hk, d = 3, 2, 4, 2, 16
    lens = [5, 9, 2]
    q = randn(gen, b, sq, h, d)
    if paged:
        k, v, table = paged_cache(gen, lens, 4, hk, d, torch.float32, hnd=True)
        kwargs = {"block_table": table}
    else:
        k, v, table = randn(gen, b + 1, 12, hk, d), randn(gen, b + 1, 12, hk, d), None
        kwargs = {"cache_batch_idx": torch.tensor([3, 0, 1], dtype=torch.int32)}
    kwargs.update(softmax_lse=torch.empty(b, h, sq), cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                  softcap=3.0, alibi_slopes=randn(gen, h).abs())
    opcheck("kvcache_fwd", (q, k, v, torch.empty_like(q)), kwargs)


def test_ops_equal_eager_drop_ins(gen):
    q, k, v = randn(gen, 4, 2, 16), randn(gen, 10, 1, 16), randn(gen, 10, 1, 16)
    cq, ck = cu([3, 1]), cu([6, 4])
    want, want_lse = fs.flash_attn_varlen_func(q, k, v, 3, cq, 6, cu_seqlens_k=ck, causal=True,
                                               return_softmax_lse=True)
    out, lse = torch.full_like(q, NAN), torch.full((2, 4), NAN)
    torch.ops.flashserve.varlen_fwd(q, k, v, out, cq, 3, 6, lse, ck, causal=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def decode_step(q, k_new, v_new, k_cache, v_cache, slots, cu_q, lens, table, scale, sinks):
    """An engine's decode step through the drop-ins: cache write, attention (both APIs), merge."""
    fs.reshape_and_cache_flash(k_new, v_new, k_cache, v_cache, slots, "auto", scale, scale)
    out, lse = fs.flash_attn_varlen_func(q, k_cache, v_cache, 1, cu_q, 64, seqused_k=lens, block_table=table,
                                         causal=True, return_softmax_lse=True, s_aux=sinks)
    out2, lse2 = fs.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=lens,
                                            block_table=table, window_size=(8, 0), return_softmax_lse=True)
    merged = torch.empty_like(out)
    merged_lse = torch.empty_like(lse)
    fs.merge_attn_states(merged, out, lse, out2.squeeze(1), lse2[:, :, 0].t().contiguous(), output_lse=merged_lse)
    v2, s2 = fs.merge_state_v2(out, lse.t(), merged, merged_lse.t())
    return merged * 2, v2, s2


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(gen, dynamic):
    b, h, hk, d, bs = 3, 4, 2, 32, 8
    lens = torch.tensor([7, 20, 1], dtype=torch.int32)
    k_cache, v_cache, table = paged_cache(gen, [30, 30, 30], bs, hk, d, torch.bfloat16, hnd=dynamic)
    pos = lens - 1
    slots = (table[torch.arange(b), (pos // bs).long()] * bs + pos % bs).long()
    q, k_new, v_new = (randn(gen, b, n, d, dtype=torch.bfloat16) for n in (h, hk, hk))
    args = (q, k_new, v_new, k_cache, v_cache, slots, cu([1, 1, 1]), lens, table, torch.tensor(0.5), randn(gen, h))
    eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    want = decode_step(*eager_args)
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    got = compiled(*args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(args[3], eager_args[3]) and torch.equal(args[4], eager_args[4]), "caches differ"


class Fp8Only:
    """An fp8 tensor as a torch without fp8 DLPack export shows it: no __dlpack__, a dtype and
    view(torch.uint8) (the binding's fallback)."""

    def __init__(self, t):
        self.t, self.dtype, self.shape = t, t.dtype, t.shape

    def view(self, dtype):
        return self.t.view(dtype)


def test_fp8_tensors(gen):
    b, h, hk, d = 2, 4, 2, 64
    q = randn(gen, b, 1, h, d)
    k_cache, v_cache = randn(gen, b, 16, hk, d), randn(gen, b, 16, hk, d)
    lens = torch.tensor([10, 16], dtype=torch.int32)
    q8, k8, v8 = q.to(torch.float8_e4m3fn), (k_cache / 2).to(torch.float8_e5m2), (v_cache / 2).to(torch.float8_e5m2)
    descale = torch.full((b, hk), 2.0)
    out = fs.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=lens, k_descale=descale, v_descale=descale)
    assert out.dtype == torch.bfloat16
    want = fs.flash_attn_with_kvcache(q8.float(), k8.float() * 2, v8.float() * 2, cache_seqlens=lens)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    via_view = torch.full_like(out, NAN)
    from flashserve import _calls
    _calls.kvcache_fwd(Fp8Only(q8), Fp8Only(k8), Fp8Only(v8), via_view, cache_seqlens=lens, k_descale=descale,
                       v_descale=descale)
    assert torch.equal(via_view, out)


def test_scheduler_metadata_tensor(gen):
    q, k, v = randn(gen, 3, 4, 32), randn(gen, 300, 2, 32), randn(gen, 300, 2, 32)
    cq, ck, lens = cu([1, 1, 1]), cu([100, 120, 80]), torch.tensor([100, 120, 80], dtype=torch.int32)
    md = fs.get_scheduler_metadata(3, 1, 120, 4, 2, 32, lens, cu_seqlens_q=cq, page_size=None, num_splits=4)
    assert md.dtype == torch.int32 and md.dim() == 1 and md.device == lens.device
    got = fs.flash_attn_varlen_func(q, k, v, 1, cq, 120, cu_seqlens_k=ck, scheduler_metadata=md)
    assert torch.equal(got, fs.flash_attn_varlen_func(q, k, v, 1, cq, 120, cu_seqlens_k=ck, num_splits=4))
    with pytest.raises(ValueError, match="^scheduler_metadata: expected a plan made for"):
        fs.flash_attn_varlen_func(q[:2], k, v, 1, cq[:3], 120, cu_seqlens_k=ck[:3], scheduler_metadata=md)
