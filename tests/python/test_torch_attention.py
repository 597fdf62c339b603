"""flash_attn_varlen_func and flash_attn_with_kvcache on torch tensors (CPU reference and CUDA
kernels) against the float reference of torch_reference.py: random shapes, GQA, contiguous and
paged KV with strided views, fp8 caches with descales, sinks, softcap, ALiBi, windows, both LSE
layouts, split counts, scheduler metadata, out= in place."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")

from helpers_torch import (DEVICES, HALF_DTYPES, LSE_TOL, Case, check_bits,  # noqa: E402
                           check_close, check_in_place, check_lse, check_out, check_out_fp8_qkv, cu_seqlens,
                           fp8_descale, fused_views,
                           make_paged_kv, n_cases, poisoned, seq_lens, strided_like)
from torch_reference import attention_ref, batched_ref, per_seq, varlen_ref  # noqa: E402

HEAD_DIMS = [64, 128, 64, 128, 80, 256, 96]
GROUPS = [1, 2, 3, 4, 5, 6, 7, 8]
FEATURES = ["plain", "causal", "window", "softcap", "alibi", "sinks", "mixed"]
ARRANGEMENTS = ["separate", "stacked", "interleaved"]


@pytest.fixture
def case(request) -> Case:
    return Case(request)


def out_dtypes(device: str) -> list:
    return HALF_DTYPES + ([torch.float32] if device == "cpu" else [])


def draw_heads(case: Case, device: str) -> tuple[int, int, int]:
    """(H, H_kv, D) with a GQA ratio of 1..8."""
    heads_kv = case.rng.choice([1, 2] if device == "cpu" else [1, 2, 4])
    d = case.rng.choice(HEAD_DIMS if device != "cpu" else [64, 128, 80])
    return heads_kv * case.rng.choice(GROUPS), heads_kv, d


def draw_features(case: Case, name: str, heads: int, batch: int, device: str) -> tuple[dict, dict]:
    """(api kwargs, reference kwargs) for a feature set; "mixed" draws each feature at random."""
    pick = (lambda f: name == f) if name != "mixed" else (lambda f: case.rng.random() < 0.5)
    api, ref = {}, {}
    scale = case.rng.choice([None, case.rng.uniform(0.03, 0.2)])
    api["softmax_scale"] = scale
    ref["scale"] = scale
    api["causal"] = ref["causal"] = pick("causal")
    if pick("window"):
        left = case.rng.randint(0, case.rng.choice([40, 40, 1000]))
        window = (left, case.rng.choice([-1, 0, case.rng.randint(0, 8)]))
        api["window_size"] = ref["window"] = window
    if pick("softcap"):
        api["softcap"] = ref["softcap"] = case.rng.uniform(2.0, 30.0)
    if pick("alibi"):
        shape = (heads,) if case.rng.random() < 0.5 else (batch, heads)
        slopes = torch.rand(*shape, generator=case.gen) * 0.3
        api["alibi_slopes"] = slopes.to(device)
        ref["alibi"] = slopes.to(device)
    if pick("sinks"):
        sink = torch.randn(heads, generator=case.gen) * 2.0
        sink = sink.to(case.rng.choice([torch.float32, torch.float32, torch.bfloat16])).to(device)
        api["s_aux"] = sink
        ref["sink"] = sink.float()
    return api, ref


def fill_scale(ref_kw: dict, d: int) -> dict:
    kw = dict(ref_kw)
    if kw.get("scale") is None:
        kw["scale"] = d ** -0.5
    return kw


def split_result(res, want_lse: bool):
    if want_lse:
        assert isinstance(res, tuple) and len(res) == 2, "return_softmax_lse: expected (out, lse)"
        return res
    assert isinstance(res, torch.Tensor), "expected a tensor when return_softmax_lse=False"
    return res, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_contiguous(case: Case, device: str, dtype, feature: str) -> None:
    """flash_attn_varlen_func over contiguous varlen K/V (q, k, v views of fused projections)."""
    if dtype not in out_dtypes(device):
        pytest.skip("fp32 attention is a CPU-reference feature")
    for i in range(n_cases(device, 2, 6)):
        heads, heads_kv, d = draw_heads(case, device)
        batch = case.rng.randint(1, 3 if device == "cpu" else 8)
        big = device != "cpu" and case.rng.random() < 0.3
        q_lens = seq_lens(case, batch, 300 if big else 20)
        k_lens = seq_lens(case, batch, 1100 if big else 48)
        api, ref = draw_features(case, feature, heads, batch, device)
        want_lse = case.rng.random() < 0.7
        num_splits = case.rng.choice([0, 1, 3])
        case.desc = (f"case {i}: H={heads} H_kv={heads_kv} D={d} q_lens={q_lens} k_lens={k_lens} "
                     f"splits={num_splits} {api}")
        (q,) = fused_views(case, sum(q_lens), [(heads, d)], dtype, device,
                           scale=case.rng.uniform(0.5, 3.0))
        k, v = fused_views(case, sum(k_lens), [(heads_kv, d), (heads_kv, d)], dtype, device)
        out = poisoned(q.shape, dtype, device) if case.rng.random() < 0.5 else None
        res = case.call(flashserve.flash_attn_varlen_func, q, k, v, max(q_lens), cu_seqlens(q_lens, device),
                        max(k_lens), cu_seqlens_k=cu_seqlens(k_lens, device), return_softmax_lse=want_lse,
                        out=out, num_splits=num_splits, **api)
        if res is None:
            continue
        o, lse = split_result(res, want_lse)
        keys = [k[a:b] for a, b in per_seq(k_lens)]
        values = [v[a:b] for a, b in per_seq(k_lens)]
        ref_o, ref_lse = varlen_ref(q, q_lens, keys, values, **fill_scale(ref, d))
        if out is not None:
            check_in_place(case, "out", o, out)
        check_out(case, "out", o, ref_o, max(k_lens))
        if want_lse:
            check_lse(case, "softmax_lse [H, total_q]", lse, ref_lse)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_varlen_paged(case: Case, device: str, dtype, feature: str, block_size: int) -> None:
    """flash_attn_varlen_func over a paged cache (block_table + seqused_k), as vLLM calls it:
    chunked prefill and decode rows in one batch, K/V views of one allocation, NHD or HND."""
    for i in range(n_cases(device, 1, 5)):
        heads, heads_kv, d = draw_heads(case, device)
        batch = case.rng.randint(1, 4 if device == "cpu" else 12)
        big = device != "cpu" and case.rng.random() < 0.3
        q_lens = seq_lens(case, batch, 200 if big else 12)
        k_lens = [n + case.rng.randint(0, 900 if big else 30) for n in q_lens]
        arrangement, layout = case.rng.choice(ARRANGEMENTS), case.rng.choice(["nhd", "hnd"])
        api, ref = draw_features(case, feature, heads, batch, device)
        num_splits = case.rng.choice([0, 1, 4])
        case.desc = (f"case {i}: H={heads} H_kv={heads_kv} D={d} bs={block_size} q_lens={q_lens} "
                     f"k_lens={k_lens} {arrangement}/{layout} splits={num_splits} {api}")
        kv = make_paged_kv(case, k_lens, heads_kv, d, d, block_size, dtype, device, arrangement,
                           layout, extra_cols=case.rng.randint(0, 2))
        (q,) = fused_views(case, sum(q_lens), [(heads, d)], dtype, device,
                           scale=case.rng.uniform(0.5, 3.0))
        out = poisoned(q.shape, dtype, device)
        res = case.call(flashserve.flash_attn_varlen_func, q, kv.k_cache, kv.v_cache, max(q_lens),
                        cu_seqlens(q_lens, device), max(k_lens),
                        seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
                        block_table=kv.block_table, return_softmax_lse=True, out=out,
                        num_splits=num_splits, **api)
        if res is None:
            continue
        o, lse = split_result(res, True)
        ref_o, ref_lse = varlen_ref(q, q_lens, kv.keys(), kv.values(), **fill_scale(ref, d))
        check_in_place(case, "out", o, out)
        check_out(case, "out", o, ref_o, max(k_lens))
        check_lse(case, "softmax_lse [H, total_q]", lse, ref_lse)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_kind", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("cache_fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("feature", ["plain", "mixed"])
def test_varlen_paged_fp8(case: Case, device: str, q_kind: str, cache_fp8, feature: str) -> None:
    """fp8 caches read as value * descale ([B, H_kv] fp32, per sequence and head or a stride-0
    broadcast); q in bf16/fp16 or fp8 (out bf16 then)."""
    if q_kind == "fp8" and cache_fp8 != torch.float8_e4m3fn:
        pytest.skip("fp8 q pairs with e4m3 caches")
    for i in range(n_cases(device, 1, 5)):
        heads, heads_kv, d = draw_heads(case, device)
        batch = case.rng.randint(1, 3 if device == "cpu" else 10)
        q_lens = seq_lens(case, batch, 8 if device == "cpu" else 64)
        k_lens = [n + case.rng.randint(0, 30 if device == "cpu" else 700) for n in q_lens]
        block_size = case.rng.choice([1, 16, 32])
        api, ref = draw_features(case, feature, heads, batch, device)
        descales = {name: fp8_descale(case, batch, heads_kv, device, case.rng.random() < 0.5)
                    for name in ("q_descale", "k_descale", "v_descale")}
        case.desc = (f"case {i}: H={heads} H_kv={heads_kv} D={d} bs={block_size} q_lens={q_lens} "
                     f"k_lens={k_lens} {api}")
        kv = make_paged_kv(case, k_lens, heads_kv, d, d, block_size, cache_fp8, device,
                           case.rng.choice(ARRANGEMENTS), case.rng.choice(["nhd", "hnd"]))
        if q_kind == "fp8":
            (q,) = fused_views(case, sum(q_lens), [(heads, d)], torch.float32, device, scale=4.0)
            q = q.to(torch.float8_e4m3fn)
            out_dtype, q_descale = torch.bfloat16, descales["q_descale"]
        else:
            dtype = torch.bfloat16 if q_kind == "bf16" else torch.float16
            (q,) = fused_views(case, sum(q_lens), [(heads, d)], dtype, device)
            out_dtype, q_descale = dtype, None
        out = poisoned(q.shape, out_dtype, device)
        res = case.call(flashserve.flash_attn_varlen_func, q, kv.k_cache, kv.v_cache, max(q_lens),
                        cu_seqlens(q_lens, device), max(k_lens),
                        seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
                        block_table=kv.block_table, return_softmax_lse=True, out=out,
                        q_descale=q_descale, k_descale=descales["k_descale"],
                        v_descale=descales["v_descale"], **api)
        if res is None:
            continue
        o, lse = split_result(res, True)
        keys, values = kv.keys(descales["k_descale"]), kv.values(descales["v_descale"])
        scale_kw = fill_scale(ref, d)
        ref_o, ref_lse = varlen_ref(q, q_lens, keys, values, q_descale=q_descale, **scale_kw)
        check_in_place(case, "out", o, out)
        if q_kind == "fp8" and device == "cuda":
            check_out_fp8_qkv(case, "out", o, ref_o, values, max(k_lens))
            # Its e4m3 q.k runs on fp8 tensor cores, each logit within 2^-10 of
            # scale * sum_d |q_d k_d| (the C++ tests' qk_rel), which bounds the LSE's error.
            k_max = max((float(k.abs().max()) for k in keys if k.numel()), default=0.0)
            q_l1 = float(q.float().abs().sum(-1).max()) * float(q_descale.float().max()) if q.numel() else 0.0
            lse_extra = 2.0 ** -10 * abs(scale_kw["scale"]) * q_l1 * k_max
            check_close(case, "softmax_lse [H, total_q]", lse, ref_lse, LSE_TOL[0] + lse_extra, LSE_TOL[1])
        else:
            check_out(case, "out", o, ref_o, max(k_lens))
            check_lse(case, "softmax_lse [H, total_q]", lse, ref_lse)
    case.done()


def kvcache_inputs(case: Case, device: str, dtype, paged: bool, sq_max: int):
    """(q [B, sq, H, D] strided, k_cache, v_cache, kwargs, keys, values, desc) for
    flash_attn_with_kvcache: a paged cache, or a contiguous [B_cache, S_cache, H_kv, D] cache
    with cache_batch_idx."""
    heads, heads_kv, d = draw_heads(case, device)
    batch = case.rng.randint(1, 4 if device == "cpu" else 16)
    sq = case.rng.randint(1, sq_max)
    lens = seq_lens(case, batch, 40 if device == "cpu" else case.rng.choice([64, 600, 2000]))
    q = strided_like(case, case.randn(batch, sq, heads, d, dtype=dtype, device=device,
                                      scale=case.rng.uniform(0.5, 3.0)))
    kw = {"cache_seqlens": torch.tensor(lens, dtype=torch.int32, device=device)}
    if paged:
        block_size = case.rng.choice([1, 16, 32])
        kv = make_paged_kv(case, lens, heads_kv, d, d, block_size, dtype, device,
                           case.rng.choice(ARRANGEMENTS), case.rng.choice(["nhd", "hnd"]))
        kw["block_table"] = kv.block_table
        k_cache, v_cache, keys, values = kv.k_cache, kv.v_cache, kv.keys(), kv.values()
        desc = f"bs={block_size}"
    else:
        rows = batch + case.rng.randint(0, 3)
        s_cache = max(lens) + case.rng.randint(0, 5)
        k_cache = case.randn(rows, s_cache, heads_kv, d, dtype=dtype, device=device)
        v_cache = case.randn(rows, s_cache, heads_kv, d, dtype=dtype, device=device)
        idx = case.perm(rows)[:batch]
        kw["cache_batch_idx"] = torch.tensor(idx, dtype=torch.int32, device=device)
        keys = [k_cache[r, :n].float() for r, n in zip(idx, lens)]
        values = [v_cache[r, :n].float() for r, n in zip(idx, lens)]
        desc = f"contiguous rows={rows} S={s_cache} idx={idx}"
    desc = f"H={heads} H_kv={heads_kv} D={d} B={batch} sq={sq} lens={lens} {desc}"
    return q, k_cache, v_cache, kw, keys, values, desc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("feature", FEATURES)
def test_kvcache(case: Case, device: str, dtype, paged: bool, feature: str) -> None:
    """flash_attn_with_kvcache for decode (sq = 1) and speculative verify (sq > 1): out
    [B, sq, H, Dv], lse [B, H, sq]."""
    for i in range(n_cases(device, 1, 5)):
        q, k_cache, v_cache, kw, keys, values, desc = kvcache_inputs(case, device, dtype, paged, 4)
        api, ref = draw_features(case, feature, q.shape[2], q.shape[0], device)
        api["num_splits"] = case.rng.choice([0, 1, 3])
        if "window_size" not in api and case.rng.random() < 0.5:
            api["window_size"] = (-1, -1)
        case.desc = f"case {i}: {desc} {api}"
        out = poisoned(q.shape, dtype, device) if case.rng.random() < 0.7 else None
        res = case.call(flashserve.flash_attn_with_kvcache, q, k_cache, v_cache, **kw, **api,
                        return_softmax_lse=True, out=out)
        if res is None:
            continue
        o, lse = split_result(res, True)
        ref_o, ref_lse = batched_ref(q, keys, values, **fill_scale(ref, q.shape[3]))
        if out is not None:
            check_in_place(case, "out", o, out)
        check_out(case, "out [B, sq, H, Dv]", o, ref_o, max(len(k) for k in keys))
        check_lse(case, "softmax_lse [B, H, sq]", lse, ref_lse)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_fp8", [False, True], ids=["q_bf16", "q_fp8"])
def test_kvcache_fp8(case: Case, device: str, q_fp8: bool) -> None:
    """Decode over an fp8 e4m3 paged cache with descales, sinks and softcap on."""
    for i in range(n_cases(device, 2, 8)):
        heads, heads_kv, d = draw_heads(case, device)
        batch = case.rng.randint(1, 4 if device == "cpu" else 16)
        lens = seq_lens(case, batch, 40 if device == "cpu" else 1500)
        kv = make_paged_kv(case, lens, heads_kv, d, d, case.rng.choice([1, 16, 32]),
                           torch.float8_e4m3fn, device, case.rng.choice(ARRANGEMENTS),
                           case.rng.choice(["nhd", "hnd"]))
        api, ref = draw_features(case, "mixed", heads, batch, device)
        k_descale = fp8_descale(case, batch, heads_kv, device, case.rng.random() < 0.5)
        v_descale = fp8_descale(case, batch, heads_kv, device, case.rng.random() < 0.5)
        q = case.randn(batch, 1, heads, d, dtype=torch.bfloat16, device=device)
        q_descale = None
        if q_fp8:
            q = (q.float() * 4).to(torch.float8_e4m3fn)
            q_descale = fp8_descale(case, batch, heads_kv, device, False)
        case.desc = f"case {i}: H={heads} H_kv={heads_kv} D={d} lens={lens} {api}"
        out = poisoned(q.shape, torch.bfloat16, device)
        res = case.call(flashserve.flash_attn_with_kvcache, q, kv.k_cache, kv.v_cache,
                        cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                        block_table=kv.block_table, return_softmax_lse=True, out=out,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, **api)
        if res is None:
            continue
        o, lse = split_result(res, True)
        ref_o, ref_lse = batched_ref(q, kv.keys(k_descale), kv.values(v_descale),
                                     q_descale=q_descale, **fill_scale(ref, d))
        check_in_place(case, "out", o, out)
        check_out(case, "out", o, ref_o, max(lens))
        check_lse(case, "softmax_lse [B, H, sq]", lse, ref_lse)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_no_splits_is_deterministic_and_batch_invariant(case: Case, device: str) -> None:
    """num_splits=1: the same call twice gives the same bits, and a sequence's rows do not
    depend on the rest of the batch."""
    q, k_cache, v_cache, kw, _, _, desc = kvcache_inputs(case, device, torch.bfloat16, True, 2)
    case.desc = desc
    first = flashserve.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, causal=True, num_splits=1)
    again = flashserve.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, causal=True, num_splits=1)
    check_bits(case, "repeated call", again, first)
    for b in range(q.shape[0]):
        alone = flashserve.flash_attn_with_kvcache(
            q[b:b + 1], k_cache, v_cache, cache_seqlens=kw["cache_seqlens"][b:b + 1],
            block_table=kw["block_table"][b:b + 1], causal=True, num_splits=1)
        check_bits(case, f"sequence {b} alone vs in the batch", alone[0], first[b])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale"])
def test_scheduler_metadata(case: Case, device: str, stale: bool) -> None:
    """get_scheduler_metadata's schedule passed back in gives the reference result; one made
    for another batch shape never changes the result (SPEC.md §3): the call either computes
    the right result or raises ValueError naming scheduler_metadata."""
    for i in range(n_cases(device, 2, 6)):
        q, k_cache, v_cache, kw, keys, values, desc = kvcache_inputs(case, device, torch.bfloat16,
                                                                     True, 1)
        batch, sq, heads, d = q.shape
        seqlens = kw["cache_seqlens"]
        capacity = kw["block_table"].shape[1] * k_cache.shape[1]
        if stale:  # made for a smaller batch with a shorter cache
            batch, seqlens, capacity = max(1, batch // 2), seqlens[: max(1, batch // 2)], capacity // 2
        case.desc = f"case {i}: {desc}"
        md = flashserve.get_scheduler_metadata(
            batch, sq, max(capacity, 1), heads, k_cache.shape[2], d, seqlens,
            qkv_dtype=torch.bfloat16, page_size=k_cache.shape[1], causal=True)
        assert isinstance(md, torch.Tensor) and md.dtype == torch.int32 and md.dim() == 1
        assert md.device.type == q.device.type, "scheduler metadata lives on the inputs' device"
        out = poisoned(q.shape, q.dtype, device)
        try:
            res = flashserve.flash_attn_with_kvcache(q, k_cache, v_cache, **kw, causal=True,
                                                     out=out, scheduler_metadata=md)
        except ValueError as e:
            assert stale and str(e).startswith("scheduler_metadata"), f"{e} {case.where()}"
            assert out.isnan().all(), f"a rejected call wrote out {case.where()}"
            continue
        ref_o, _ = batched_ref(q, keys, values, scale=d ** -0.5, causal=True)
        check_in_place(case, "out", res, out)
        check_out(case, "out", res, ref_o, max(len(k) for k in keys))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_varlen_mla_prefill_shapes(case: Case, device: str, dtype) -> None:
    """D != Dv (MLA prefill, D = 192, Dv = 128): out [total_q, H, 128], the default scale
    D^-0.5; causal new tokens and a non-causal context pass with LSE."""
    for i in range(n_cases(device, 1, 4)):
        heads = case.rng.choice([1, 4, 16])
        batch = case.rng.randint(1, 3 if device == "cpu" else 8)
        q_lens = seq_lens(case, batch, 16 if device == "cpu" else 300)
        k_lens = [n + case.rng.randint(0, 20 if device == "cpu" else 500) for n in q_lens]
        causal = case.rng.random() < 0.5
        case.desc = f"case {i}: H={heads} q_lens={q_lens} k_lens={k_lens} causal={causal}"
        (q,) = fused_views(case, sum(q_lens), [(heads, 192)], dtype, device)
        k, v = fused_views(case, sum(k_lens), [(heads, 192), (heads, 128)], dtype, device)
        res = case.call(flashserve.flash_attn_varlen_func, q, k, v, max(q_lens),
                        cu_seqlens(q_lens, device), max(k_lens), cu_seqlens_k=cu_seqlens(k_lens, device),
                        causal=causal, return_softmax_lse=True)
        if res is None:
            continue
        o, lse = split_result(res, True)
        ref_o, ref_lse = varlen_ref(q, q_lens, [k[a:b] for a, b in per_seq(k_lens)],
                                    [v[a:b] for a, b in per_seq(k_lens)], scale=192 ** -0.5,
                                    causal=causal)
        check_out(case, "out [total_q, H, Dv]", o, ref_o, max(k_lens))
        check_lse(case, "softmax_lse [H, total_q]", lse, ref_lse)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_reference_matches_sdpa(case: Case, device: str) -> None:
    """The oracle itself: attention_ref equals torch's SDPA for causal GQA with sq == sk."""
    heads_kv, group, sq, d = 2, 3, 17, 64
    q = case.randn(sq, heads_kv * group, d, device=device)
    k = case.randn(sq, heads_kv, d, device=device)
    v = case.randn(sq, heads_kv, d, device=device)
    out, _ = attention_ref(q, k, v, scale=d ** -0.5, causal=True)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    check_out(case, "reference vs SDPA", out, expect)


def test_reference_lse_layouts(case: Case) -> None:
    """The oracle's LSE layouts ([H, total_q] varlen, [B, H, sq] batched) and empty rows."""
    q = case.randn(5, 4, 8)
    k = [case.randn(3, 2, 8), case.randn(0, 2, 8)]
    out, lse = varlen_ref(q, [2, 3], k, k, scale=0.3, causal=True)
    assert out.shape == (5, 4, 8) and lse.shape == (4, 5)
    assert (lse[:, 2:] == -float("inf")).all() and (out[2:] == 0).all()
    out, lse = batched_ref(case.randn(2, 1, 4, 8), k, k, scale=0.3)
    assert out.shape == (2, 1, 4, 8) and lse.shape == (2, 4, 1)
