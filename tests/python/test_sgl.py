"""flashserve.sgl, the sgl_kernel-shaped entry, called exactly as SGLang's FlashAttention
backend (python/sglang/srt/layers/attention/flashattention_backend.py) calls sgl_kernel:
extend/decode over token pages with cu_seqlens_q and cu_seqlens_k_new, cascade verify with
merge_state_v2 over transposed LSEs, MHA extend through flash_attn_varlen_func with
return_softmax_lse, absorbed MLA with qv over views of one latent cache, fp8 with expanded
descales, sinks in bf16, ver, inputs that require grad; under torch.inference_mode and
torch.compile(fullgraph=True). Compared with the float reference of torch_reference.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")

from flashserve.sgl import merge_state_v2  # noqa: E402
from flashserve.sgl.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402

from helpers_torch import (DEVICES, Case, check_bits, check_lse, check_out, cu_seqlens,  # noqa: E402
                           n_cases, poisoned, seq_lens)
from torch_reference import attention_ref, gather_paged, merge_ref, per_seq, varlen_ref  # noqa: E402


@pytest.fixture
def case(request) -> Case:
    return Case(request)


def test_entry_points() -> None:
    """The modules and names SGLang imports, FA3's functions behind them."""
    import flashserve.sgl as sgl
    from flashserve import fa3
    assert sgl.flash_attn.flash_attn_with_kvcache is fa3.flash_attn_with_kvcache
    assert sgl.flash_attn.flash_attn_varlen_func is fa3.flash_attn_varlen_func
    assert sgl.merge_state_v2 is flashserve.merge_state_v2
    assert sgl.flash_attn.is_fa3_supported("cpu") is True


class TokenPool:
    """SGLang's KV pool: per-layer buffers [num_tokens, H_kv, D] viewed as pages
    [-1, page_size, H_kv, D]; each request owns random pages; page_table [B, max_pages]."""

    def __init__(self, case: Case, device: str, lens: list[int], page: int, heads_kv: int, d: int,
                 dtype=torch.bfloat16) -> None:
        width = max(1, max(-(-n // page) for n in lens))
        num_pages = len(lens) * width + 3
        self.k_buf, self.v_buf = (case.randn(num_pages * page, heads_kv, d, device=device).to(dtype)
                                  for _ in range(2))
        self.k_cache = self.k_buf.view(-1, page, heads_kv, d)
        self.v_cache = self.v_buf.view(-1, page, heads_kv, d)
        ids = torch.tensor(case.perm(num_pages)[: len(lens) * width], dtype=torch.int32).view(len(lens), width)
        self.page_table = ids.to(device)
        self.lens = lens
        self.seqlens = torch.tensor(lens, dtype=torch.int32, device=device)

    def keys(self, scale=None) -> list:
        return [gather_paged(self.k_cache, self.page_table[b], n, None if scale is None else scale[b])
                for b, n in enumerate(self.lens)]

    def values(self, scale=None) -> list:
        return [gather_paged(self.v_cache, self.page_table[b], n, None if scale is None else scale[b])
                for b, n in enumerate(self.lens)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_forward_like_sglang(case: Case, device: str, mode: str) -> None:
    """forward_extend / forward_decode (non-MLA): q [T, H, D] varlen over token pages, with
    cu_seqlens_k_new (ignored without k/v), window_size, logit_cap, sinks and ver through
    **kwargs as SGLang builds them."""
    for i in range(n_cases(device, 3, 10)):
        heads_kv = case.rng.choice([1, 2])
        heads, d = heads_kv * case.rng.choice([1, 4]), case.rng.choice([64, 128])
        batch = case.rng.randint(1, 4)
        lens = seq_lens(case, batch, 50, lo=1)
        q_lens = [1] * batch if mode == "decode" else [case.rng.randint(1, n) for n in lens]
        pool = TokenPool(case, device, lens, case.rng.choice([1, 16, 64]), heads_kv, d)
        kwargs = {}
        if case.rng.random() < 0.5:
            kwargs["sinks"] = (torch.randn(heads, generator=case.gen) * 2).to(torch.bfloat16).to(device)
        if case.rng.random() < 0.3:
            kwargs["ver"] = 4
        window = (case.rng.randint(0, 20), 0) if case.rng.random() < 0.3 else (-1, -1)
        logit_cap = case.rng.choice([0.0, 30.0])
        scaling = d ** -0.5
        case.desc = f"case {i}: lens={lens} q_lens={q_lens} H={heads}/{heads_kv} D={d} window={window} {list(kwargs)}"
        q = case.randn(sum(q_lens), heads * d, dtype=torch.bfloat16, device=device)
        o = flash_attn_with_kvcache(
            q=q.contiguous().view(-1, heads, d), k_cache=pool.k_cache, v_cache=pool.v_cache,
            page_table=pool.page_table, cache_seqlens=pool.seqlens, cu_seqlens_q=cu_seqlens(q_lens, device),
            cu_seqlens_k_new=cu_seqlens(lens, device), max_seqlen_q=max(q_lens), softmax_scale=scaling,
            causal=True, window_size=window, softcap=logit_cap, k_descale=None, v_descale=None,
            return_softmax_lse=False, num_splits=0, **kwargs)
        out = o.view(-1, heads * d)
        sink = kwargs["sinks"].float() if "sinks" in kwargs else None
        ref_o, _ = varlen_ref(q.view(-1, heads, d), q_lens, pool.keys(), pool.values(), scale=scaling, causal=True,
                              window=window, softcap=logit_cap, sink=sink)
        check_out(case, "o", out.view(-1, heads, d), ref_o, max(lens))


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_verify_with_merge_state_v2(case: Case, device: str) -> None:
    """Target verify with topk > 1: a non-causal pass over each request's committed prefix
    and one over each draft token's own expanded keys (batch B * draft tokens), merged by
    merge_state_v2(o, lse.T.contiguous(), o_expand, lse_expand.T.contiguous()) as SGLang does;
    equals attention over prefix + that token's drafts."""
    heads, heads_kv, d, draft = 8, 2, 128, 3
    for i in range(n_cases(device, 2, 6)):
        batch = case.rng.randint(1, 3)
        lens = seq_lens(case, batch, 40, lo=1)
        prefix = TokenPool(case, device, lens, 1, heads_kv, d)
        exp_lens = [case.rng.randint(1, draft) for _ in range(batch * draft)]
        expand = TokenPool(case, device, exp_lens, 1, heads_kv, d)
        case.desc = f"case {i}: lens={lens} expand={exp_lens}"
        q = case.randn(batch * draft, heads, d, dtype=torch.bfloat16, device=device)
        common = dict(q=q, softmax_scale=d ** -0.5, causal=False, window_size=(-1, -1), softcap=0.0,
                      k_descale=None, v_descale=None, return_softmax_lse=True, num_splits=0)
        o, softmax_lse, *rest = flash_attn_with_kvcache(
            k_cache=prefix.k_cache, v_cache=prefix.v_cache, page_table=prefix.page_table,
            cache_seqlens=prefix.seqlens, cu_seqlens_q=cu_seqlens([draft] * batch, device),
            cu_seqlens_k_new=cu_seqlens(lens, device), max_seqlen_q=draft, **common)
        o_expand, softmax_lse_expand, *rest_expand = flash_attn_with_kvcache(
            k_cache=expand.k_cache, v_cache=expand.v_cache, page_table=expand.page_table,
            cache_seqlens=expand.seqlens, cu_seqlens_q=cu_seqlens([1] * (batch * draft), device),
            cu_seqlens_k_new=cu_seqlens(exp_lens, device), max_seqlen_q=1, **common)
        assert softmax_lse.shape == (heads, batch * draft)
        merged, _ = merge_state_v2(o, softmax_lse.T.contiguous(), o_expand, softmax_lse_expand.T.contiguous())
        pk, pv, ek, ev = prefix.keys(), prefix.values(), expand.keys(), expand.values()
        for t in range(batch * draft):
            b = t // draft
            ref_o, _ = attention_ref(q[t:t + 1], torch.cat([pk[b], ek[t]]), torch.cat([pv[b], ev[t]]),
                                     scale=d ** -0.5)
            check_out(case, f"merged row {t}", merged[t:t + 1], ref_o, lens[b] + draft)


@pytest.mark.parametrize("device", DEVICES)
def test_mha_extend_varlen(case: Case, device: str) -> None:
    """MHA extend (and chunked prefix cache): flash_attn_varlen_func with contiguous k/v cast
    to q's dtype, return_softmax_lse=True -> (output, lse [H, total_q], *rest)."""
    heads, heads_kv, d, dv = 4, 4, 192, 128  # MLA prefill shapes: D 192, Dv 128
    for i in range(n_cases(device, 2, 6)):
        batch = case.rng.randint(1, 3)
        q_lens = seq_lens(case, batch, 20, lo=1)
        prefix = case.rng.random() < 0.5
        k_lens = [n + case.rng.randint(0, 30) for n in q_lens] if prefix else q_lens
        case.desc = f"case {i}: q_lens={q_lens} k_lens={k_lens}"
        q = case.randn(sum(q_lens), heads * d, dtype=torch.bfloat16, device=device)
        k = case.randn(sum(k_lens), heads_kv * d, device=device)
        v = case.randn(sum(k_lens), heads_kv * dv, device=device)
        output = flash_attn_varlen_func(
            q=q.view(-1, heads, d), k=k.view(-1, heads_kv, d).to(q.dtype), v=v.view(-1, heads_kv, dv).to(q.dtype),
            cu_seqlens_q=cu_seqlens(q_lens, device), cu_seqlens_k=cu_seqlens(k_lens, device),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens), softmax_scale=d ** -0.5, causal=not prefix,
            return_softmax_lse=True)
        output, lse, *rest = output
        lse = torch.transpose(lse, 0, 1).contiguous()
        kb, vb = k.view(-1, heads_kv, d).to(q.dtype), v.view(-1, heads_kv, dv).to(q.dtype)
        keys = [kb[a:b] for a, b in per_seq(k_lens)]
        values = [vb[a:b] for a, b in per_seq(k_lens)]
        ref_o, ref_l = varlen_ref(q.view(-1, heads, d), q_lens, keys, values, scale=d ** -0.5, causal=not prefix)
        check_out(case, "output", output, ref_o, max(k_lens))
        check_lse(case, "lse [total_q, H]", lse, ref_l.T)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_absorbed_decode(case: Case, device: str) -> None:
    """Absorbed MLA: one latent cache [tokens, 1, 576] sliced into k_rope (64) and c_kv (512)
    views paged by page_size, q_rope + qv=q_nope; cascade-free decode and extend."""
    heads, page = case.rng.choice([1, 8, 16]), case.rng.choice([1, 16])
    for i in range(n_cases(device, 2, 6)):
        batch = case.rng.randint(1, 3)
        lens = seq_lens(case, batch, 40, lo=1)
        q_lens = [case.rng.randint(1, min(n, 3)) for n in lens]
        width = max(-(-n // page) for n in lens)
        num_pages = batch * width + 2
        kv_cache = case.randn(num_pages * page, 1, 576, dtype=torch.bfloat16, device=device, scale=0.5)
        k_rope = kv_cache[:, :, 512:]
        c_kv = kv_cache[:, :, :512]
        k_rope_cache = k_rope.view(-1, page, 1, 64)
        c_kv_cache = c_kv.view(-1, page, 1, 512)
        ids = torch.tensor(case.perm(num_pages)[: batch * width], dtype=torch.int32)
        page_table = ids.view(batch, width).to(device)
        q_all = case.randn(sum(q_lens), heads, 576, dtype=torch.bfloat16, device=device, scale=0.5)
        q_nope, q_rope = q_all[:, :, :512], q_all[:, :, 512:]
        scaling = 576 ** -0.5
        case.desc = f"case {i}: H={heads} page={page} lens={lens} q_lens={q_lens}"
        res = case.call(flash_attn_with_kvcache, q=q_rope, k_cache=k_rope_cache, v_cache=c_kv_cache, qv=q_nope,
                        page_table=page_table, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                        cu_seqlens_q=cu_seqlens(q_lens, device), cu_seqlens_k_new=cu_seqlens(lens, device),
                        max_seqlen_q=max(q_lens), softmax_scale=scaling, causal=True, softcap=0.0,
                        k_descale=None, v_descale=None, return_softmax_lse=False, num_splits=0)
        if res is None:
            continue
        keys = [gather_paged(k_rope_cache, page_table[b], n) for b, n in enumerate(lens)]
        values = [gather_paged(c_kv_cache, page_table[b], n) for b, n in enumerate(lens)]
        ref_o, _ = varlen_ref(q_rope, q_lens, keys, values, q_v=q_nope, scale=scaling, causal=True)
        check_out(case, "o", res, ref_o, max(lens))
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_decode(case: Case, device: str) -> None:
    """kv_cache_dtype fp8_e4m3: q.to(fp8), k/v descales = layer scale .expand(B, H_kv)
    (stride 0), token pages; bf16 output."""
    heads, heads_kv, d = 8, 2, 128
    for i in range(n_cases(device, 2, 6)):
        batch = case.rng.randint(1, 4)
        lens = seq_lens(case, batch, 60, lo=1)
        pool = TokenPool(case, device, lens, 1, heads_kv, d, dtype=torch.float8_e4m3fn)
        k_scale = torch.tensor([case.rng.uniform(0.1, 0.5)], device=device)
        v_scale = torch.tensor([case.rng.uniform(0.1, 0.5)], device=device)
        k_descale, v_descale = k_scale.expand(batch, heads_kv), v_scale.expand(batch, heads_kv)
        q = case.randn(batch, heads, d, device=device, scale=2.0).to(torch.bfloat16)
        case.desc = f"case {i}: lens={lens}"
        o = case.call(flash_attn_with_kvcache, q=q.to(torch.float8_e4m3fn), k_cache=pool.k_cache,
                      v_cache=pool.v_cache, page_table=pool.page_table, cache_seqlens=pool.seqlens,
                      cu_seqlens_q=cu_seqlens([1] * batch, device), cu_seqlens_k_new=cu_seqlens(lens, device),
                      max_seqlen_q=1, softmax_scale=d ** -0.5, causal=True, window_size=(-1, -1), softcap=0.0,
                      k_descale=k_descale, v_descale=v_descale, return_softmax_lse=False, num_splits=0)
        if o is None:
            continue
        assert o.dtype == torch.bfloat16
        ref_o, _ = varlen_ref(q.to(torch.float8_e4m3fn), [1] * batch, pool.keys(k_descale), pool.values(v_descale),
                              scale=d ** -0.5, causal=True)
        check_out(case, "o", o, ref_o, max(lens))
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_v2(case: Case, device: str) -> None:
    """merge_state_v2(v_a, s_a, v_b, s_b[, v_merged, s_merged]) -> (v_merged, s_merged), LSEs
    [T, H]; outputs allocated when not given, written in place when given."""
    t, h, d = case.rng.randint(1, 20), 4, 64
    v_a, v_b = (case.randn(t, h, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    s_a, s_b = (case.randn(t, h, device=device) for _ in range(2))
    s_a[0, 0] = float("-inf")
    ref_v, ref_s = merge_ref(v_a, s_a, v_b, s_b)
    v, s = merge_state_v2(v_a, s_a, v_b, s_b)
    check_out(case, "v_merged", v, ref_v)
    check_lse(case, "s_merged", s, ref_s)
    v_given, s_given = poisoned((t, h, d), torch.bfloat16, device), poisoned((t, h), torch.float32, device)
    v2, s2 = merge_state_v2(v_a, s_a, v_b, s_b, v_given, s_given)
    assert v2 is v_given and s2 is s_given
    check_bits(case, "v_merged in place", v_given, v)


@pytest.mark.parametrize("device", DEVICES)
def test_requires_grad_inputs(case: Case, device: str) -> None:
    """Inputs that require grad (a model run without no_grad): forward only, no graph."""
    pool = TokenPool(case, device, [5, 9], 16, 2, 64)
    q = case.randn(2, 4, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    sinks = torch.zeros(4, device=device, requires_grad=True)
    o = flash_attn_with_kvcache(q=q, k_cache=pool.k_cache, v_cache=pool.v_cache, page_table=pool.page_table,
                                cache_seqlens=pool.seqlens, cu_seqlens_q=cu_seqlens([1, 1], device), max_seqlen_q=1,
                                causal=True, sinks=sinks)
    assert not o.requires_grad
    ref_o, _ = varlen_ref(q.detach(), [1, 1], pool.keys(), pool.values(), scale=64 ** -0.5, causal=True,
                          sink=sinks.detach())
    check_out(case, "o", o, ref_o)


def sglang_decode_step(q, k_cache, v_cache, page_table, seqlens, cu_q, cu_k, exp_table, exp_seqlens, exp_cu_q,
                       exp_cu_k, sinks):
    """forward_decode with cascade (topk > 1), as SGLang writes it (merge_state_v2 included)."""
    heads, d = q.shape[1], q.shape[2]
    common = dict(softmax_scale=d ** -0.5, causal=False, window_size=(-1, -1), softcap=0.0, k_descale=None,
                  v_descale=None, return_softmax_lse=True, num_splits=0, sinks=sinks)
    o, softmax_lse, *rest = flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                                                    cache_seqlens=seqlens, cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k,
                                                    max_seqlen_q=1, **common)
    o_expand, softmax_lse_expand, *rest_expand = flash_attn_with_kvcache(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=exp_table, cache_seqlens=exp_seqlens,
        cu_seqlens_q=exp_cu_q, cu_seqlens_k_new=exp_cu_k, max_seqlen_q=1, **common)
    o, _ = merge_state_v2(o, softmax_lse.T.contiguous(), o_expand, softmax_lse_expand.T.contiguous())
    return o.view(-1, heads * d)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_inference_mode_and_compile(case: Case, device: str) -> None:
    """The cascade decode step under torch.inference_mode and torch.compile(fullgraph=True)
    (SGLang wraps merge_state_v2 in dynamo.disable for sgl_kernel; flashserve's compiles) equals
    eager bit for bit."""
    heads, heads_kv, d, batch = 8, 2, 64, 3
    lens = seq_lens(case, batch, 40, lo=1)
    exp_lens = [case.rng.randint(1, 3) for _ in range(batch)]
    pool = TokenPool(case, device, lens + exp_lens, 1, heads_kv, d)  # one pool: prefixes, then drafts
    args = dict(q=case.randn(batch, heads, d, dtype=torch.bfloat16, device=device), k_cache=pool.k_cache,
                v_cache=pool.v_cache, page_table=pool.page_table[:batch], seqlens=pool.seqlens[:batch],
                cu_q=cu_seqlens([1] * batch, device), cu_k=cu_seqlens(lens, device),
                exp_table=pool.page_table[batch:], exp_seqlens=pool.seqlens[batch:],
                exp_cu_q=cu_seqlens([1] * batch, device), exp_cu_k=cu_seqlens(exp_lens, device),
                sinks=torch.randn(heads, generator=case.gen).to(torch.bfloat16).to(device))
    eager = sglang_decode_step(**args)
    with torch.inference_mode():
        inf = sglang_decode_step(**args)
    check_bits(case, "inference_mode", inf, eager)
    torch._dynamo.reset()
    compiled = torch.compile(sglang_decode_step, fullgraph=True,
                             backend="aot_eager" if device == "cpu" else "inductor")
    check_bits(case, "compiled", compiled(**args), eager)
    keys, values = pool.keys(), pool.values()
    for t in range(batch):  # each pass counts the sink (as SGLang passes sinks to both)
        kw = dict(scale=d ** -0.5, sink=args["sinks"].float())
        o_a, l_a = attention_ref(args["q"][t:t + 1], keys[t], values[t], **kw)
        o_b, l_b = attention_ref(args["q"][t:t + 1], keys[batch + t], values[batch + t], **kw)
        ref_o, _ = merge_ref(o_a, l_a.T, o_b, l_b.T)
        check_out(case, f"row {t}", eager[t:t + 1].view(1, heads, d), ref_o)
