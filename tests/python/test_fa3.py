"""flashserve.fa3: FlashAttention-3's flash_attn_interface (signatures, defaults, return
conventions) against the float reference of torch_reference.py: flash_attn_func and
flash_attn_varlen_func (contiguous and paged, seqused_k, sinks, attention_chunk, qv, fp8).
flash_attn_with_kvcache, flash_attn_combine, get_scheduler_metadata, bad inputs, and every entry
under inference_mode / torch.compile / CUDA graphs: test_fa3_kvcache.py."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")
fa3 = pytest.importorskip("flashserve.fa3")

from helpers_torch import (DEVICES, HALF_DTYPES, Case, check_bits, check_lse, check_out,  # noqa: E402
                           check_out_fp8_qkv, cu_seqlens, fp8_descale, make_paged_kv, n_cases, seq_lens)
from torch_reference import batched_ref, per_seq, varlen_ref  # noqa: E402
from fa3_cases import E4M3, draw_features, heads_dims, scaled  # noqa: E402


@pytest.fixture
def case(request) -> Case:
    return Case(request)


# ---------------------------------------------------------------- signatures

SIGNATURES = {
    "flash_attn_func": (
        "(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, "
        "v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, "
        "pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, sinks=None)"),
    "flash_attn_varlen_func": (
        "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, "
        "seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, "
        "v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, "
        "pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *, "
        "return_softmax_lse=False, sinks=None, ver=3, page_table=None)"),
    "flash_attn_with_kvcache": (
        "(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, "
        "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None, "
        "cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None, "
        "q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False, "
        "window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True, "
        "scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, "
        "return_softmax_lse=False, sinks=None, ver=3)"),
    "flash_attn_combine": "(out_partial, lse_partial, out=None, out_dtype=None)",
    "get_scheduler_metadata": (
        "(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, "
        "cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, "
        "cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0, "
        "causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0, "
        "pack_gqa=None, sm_margin=0)"),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature(name: str) -> None:
    """FA3's parameter names, order and defaults (PYTHON_API.md), plus sinks / ver."""
    got = str(inspect.signature(getattr(fa3, name)))
    got = got.split(" ->")[0]
    assert got == SIGNATURES[name], f"{name}{got}"




# ---------------------------------------------------------------- flash_attn_func

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_flash_attn_func(case: Case, device: str, dtype) -> None:
    """Dense batch q [B, Sq, H, D], k/v [B, Sk, H_kv, D]; return_attn_probs gives (out, lse)."""
    for i in range(n_cases(device, 3, 10)):
        heads, heads_kv, d = heads_dims(case)
        batch, sq = case.rng.randint(1, 3), case.rng.randint(1, 12)
        sk = sq + case.rng.randint(0, 30)
        api, ref = draw_features(case, heads, device)
        probs = case.rng.random() < 0.5
        case.desc = f"case {i}: B={batch} sq={sq} sk={sk} H={heads}/{heads_kv} D={d} {api}"
        q = case.randn(batch, sq, heads, d, dtype=dtype, device=device)
        k, v = (case.randn(batch, sk, heads_kv, d, dtype=dtype, device=device) for _ in range(2))
        res = fa3.flash_attn_func(q, k, v, return_attn_probs=probs, num_splits=case.rng.choice([1, 0, 3]), **api)
        out, lse = res if probs else (res, None)
        assert isinstance(out, torch.Tensor)
        ref_o, ref_l = batched_ref(q, list(k), list(v), **scaled(ref, d))
        check_out(case, "out", out, ref_o, sk)
        if probs:
            check_lse(case, "softmax_lse [B, H, Sq]", lse, ref_l)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_func_qv(case: Case, device: str) -> None:
    """qv (MLA absorbed decode: D = 64 + qv of width Dv = 512): score q·k + qv·v, default scale
    (D + Dv)^-0.5."""
    batch, sq, sk, heads = 2, case.rng.randint(1, 4), case.rng.randint(4, 40), case.rng.choice([1, 4])
    case.desc = f"sq={sq} sk={sk} H={heads}"
    q = case.randn(batch, sq, heads, 64, dtype=torch.bfloat16, device=device)
    qv = case.randn(batch, sq, heads, 512, dtype=torch.bfloat16, device=device, scale=0.3)
    k = case.randn(batch, sk, 1, 64, dtype=torch.bfloat16, device=device)
    v = case.randn(batch, sk, 1, 512, dtype=torch.bfloat16, device=device, scale=0.3)
    res = case.call(fa3.flash_attn_func, q, k, v, causal=True, qv=qv)
    if res is not None:
        ref_o, _ = batched_ref(q, list(k), list(v), q_v=qv, scale=(64 + 512) ** -0.5, causal=True)
        check_out(case, "out", res, ref_o, sk)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_func_fp8(case: Case, device: str) -> None:
    """fp8 (e4m3) q, k, v with descales [B, H_kv]: bf16 out."""
    for i in range(n_cases(device, 2, 6)):
        heads, heads_kv, d = heads_dims(case)
        batch, sq = case.rng.randint(1, 3), case.rng.randint(1, 6)
        sk = sq + case.rng.randint(0, 30)
        case.desc = f"case {i}: B={batch} sq={sq} sk={sk} H={heads}/{heads_kv} D={d}"
        q = case.randn(batch, sq, heads, d, device=device, scale=2.0).to(E4M3)
        k, v = (case.randn(batch, sk, heads_kv, d, device=device, scale=2.0).to(E4M3) for _ in range(2))
        q_ds, k_ds, v_ds = (fp8_descale(case, batch, heads_kv, device, case.rng.random() < 0.5) for _ in range(3))
        res = case.call(fa3.flash_attn_func, q, k, v, causal=True, q_descale=q_ds, k_descale=k_ds, v_descale=v_ds)
        if res is None:
            continue
        assert res.dtype == torch.bfloat16
        keys = [k[b].float() * k_ds[b][None, :, None] for b in range(batch)]
        values = [v[b].float() * v_ds[b][None, :, None] for b in range(batch)]
        ref_o, _ = batched_ref(q, keys, values, q_descale=q_ds, scale=d ** -0.5, causal=True)
        check_out_fp8_qkv(case, "out", res, ref_o, values, sk)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_speed_only_keywords(case: Case, device: str) -> None:
    """pack_gqa, deterministic and ver (3 or 4) change nothing: bit-equal results from each
    function; get_scheduler_metadata ignores the keywords that do not change flashserve's
    schedule (qkv_dtype, cu_seqlens_k_new, cache_leftpad, max_seqlen_k_new, has_softcap,
    pack_gqa)."""
    q = case.randn(2, 3, 4, 64, dtype=torch.bfloat16, device=device)
    k, v = (case.randn(2, 9, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2))
    base = fa3.flash_attn_func(q, k, v, causal=True)
    for kw in (dict(pack_gqa=True), dict(pack_gqa=False), dict(deterministic=True)):
        check_bits(case, f"flash_attn_func {kw}", fa3.flash_attn_func(q, k, v, causal=True, **kw), base)
    cu_q, cu_k = cu_seqlens([3, 3], device), cu_seqlens([9, 9], device)
    args = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 3, 9)
    base = fa3.flash_attn_varlen_func(*args, causal=True)
    for kw in (dict(pack_gqa=True), dict(deterministic=True), dict(ver=4), dict(ver=3)):
        check_bits(case, f"flash_attn_varlen_func {kw}", fa3.flash_attn_varlen_func(*args, causal=True, **kw), base)
    seqlens = torch.tensor([9, 9], dtype=torch.int32, device=device)
    base = fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
    for kw in (dict(pack_gqa=True), dict(ver=4)):
        check_bits(case, f"flash_attn_with_kvcache {kw}",
                   fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, **kw), base)
    md = fa3.get_scheduler_metadata(2, 3, 9, 4, 2, 64, seqlens, causal=True)
    same = fa3.get_scheduler_metadata(2, 3, 9, 4, 2, 64, seqlens, qkv_dtype=torch.float16, causal=True,
                                      cu_seqlens_k_new=cu_k, cache_leftpad=seqlens * 0, max_seqlen_k_new=3,
                                      has_softcap=True, pack_gqa=True)
    assert torch.equal(md.cpu(), same.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_qv(case: Case, device: str) -> None:
    """flash_attn_varlen_func with qv (D = 64, Dv = 512) over contiguous KV."""
    q_lens, k_lens, heads = [2, 1], [7, 12], 4
    q = case.randn(sum(q_lens), heads, 64, dtype=torch.bfloat16, device=device)
    qv = case.randn(sum(q_lens), heads, 512, dtype=torch.bfloat16, device=device, scale=0.3)
    k = case.randn(sum(k_lens), 1, 64, dtype=torch.bfloat16, device=device)
    v = case.randn(sum(k_lens), 1, 512, dtype=torch.bfloat16, device=device, scale=0.3)
    res = case.call(fa3.flash_attn_varlen_func, q, k, v, cu_seqlens(q_lens, device), cu_seqlens(k_lens, device),
                    2, 12, qv=qv, causal=True, return_softmax_lse=True)
    if res is not None:
        keys = [k[a:b] for a, b in per_seq(k_lens)]
        values = [v[a:b] for a, b in per_seq(k_lens)]
        ref_o, ref_l = varlen_ref(q, q_lens, keys, values, q_v=qv, scale=576 ** -0.5, causal=True)
        check_out(case, "out", res[0], ref_o)
        check_lse(case, "lse", res[1], ref_l)
    case.done()


# ---------------------------------------------------------------- flash_attn_varlen_func

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_varlen(case: Case, device: str, kv: str) -> None:
    """Varlen q over contiguous KV (cu_seqlens_k, seqused_k shortening segments) or paged KV
    (page_table + seqused_k); return_softmax_lse / return_attn_probs give (out, lse [H, total_q])."""
    dtype = torch.bfloat16
    for i in range(n_cases(device, 3, 10)):
        heads, heads_kv, d = heads_dims(case)
        batch = case.rng.randint(1, 4)
        k_lens = seq_lens(case, batch, 40, lo=1)
        q_lens = [case.rng.randint(0, n) for n in k_lens]
        api, ref = draw_features(case, heads, device)
        want = case.rng.choice(["none", "return_softmax_lse", "return_attn_probs"])
        case.desc = f"case {i}: {kv} q_lens={q_lens} k_lens={k_lens} H={heads}/{heads_kv} D={d} {api} {want}"
        q = case.randn(sum(q_lens), heads, d, dtype=dtype, device=device)
        kw = dict(api)
        if want != "none":
            kw[want] = True
        if kv == "paged":
            paged = make_paged_kv(case, k_lens, heads_kv, d, d, case.rng.choice([1, 4, 16]), dtype, device,
                                  case.rng.choice(["separate", "interleaved"]), case.rng.choice(["nhd", "hnd"]))
            res = fa3.flash_attn_varlen_func(q, paged.k_cache, paged.v_cache, cu_seqlens(q_lens, device), None,
                                             max(q_lens), max(k_lens),
                                             seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
                                             page_table=paged.block_table, **kw)
            keys, values = paged.keys(), paged.values()
        else:
            seg = [n + case.rng.randint(0, 3) for n in k_lens]  # seqused_k <= segment
            k, v = (case.randn(sum(seg), heads_kv, d, dtype=dtype, device=device) for _ in range(2))
            use_seqused = case.rng.random() < 0.5 or seg != k_lens
            res = fa3.flash_attn_varlen_func(
                q, k, v, cu_seqlens(q_lens, device), cu_seqlens(seg, device), max(q_lens), max(seg),
                seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device) if use_seqused else None, **kw)
            keys = [k[a:a + n] for (a, _), n in zip(per_seq(seg), k_lens)]
            values = [v[a:a + n] for (a, _), n in zip(per_seq(seg), k_lens)]
        out, lse = res if want != "none" else (res, None)
        assert isinstance(out, torch.Tensor)
        ref_o, ref_l = varlen_ref(q, q_lens, keys, values, **scaled(ref, d))
        check_out(case, "out", out, ref_o, max(k_lens))
        if lse is not None:
            check_lse(case, "softmax_lse [H, total_q]", lse, ref_l)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_fp8(case: Case, device: str) -> None:
    """fp8 (e4m3) q and paged caches with descales [B, H_kv] (SGLang's kv_cache_dtype fp8):
    bf16 output."""
    for i in range(n_cases(device, 2, 6)):
        heads, heads_kv, d = heads_dims(case)
        batch = case.rng.randint(1, 3)
        k_lens = seq_lens(case, batch, 40, lo=1)
        q_lens = [min(n, case.rng.randint(1, 4)) for n in k_lens]
        case.desc = f"case {i}: q_lens={q_lens} k_lens={k_lens} H={heads}/{heads_kv} D={d}"
        paged = make_paged_kv(case, k_lens, heads_kv, d, d, 16, E4M3, device)
        q = case.randn(sum(q_lens), heads, d, device=device, scale=2.0).to(E4M3)
        q_ds, k_ds, v_ds = (fp8_descale(case, batch, heads_kv, device, case.rng.random() < 0.5) for _ in range(3))
        res = case.call(fa3.flash_attn_varlen_func, q, paged.k_cache, paged.v_cache, cu_seqlens(q_lens, device),
                        None, max(q_lens), max(k_lens),
                        seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
                        page_table=paged.block_table, causal=True, q_descale=q_ds, k_descale=k_ds, v_descale=v_ds)
        if res is None:
            continue
        assert res.dtype == torch.bfloat16
        values = paged.values(v_ds)
        ref_o, _ = varlen_ref(q, q_lens, paged.keys(k_ds), values, q_descale=q_ds, scale=d ** -0.5, causal=True)
        check_out_fp8_qkv(case, "out", res, ref_o, values, max(k_lens))
    case.done()
