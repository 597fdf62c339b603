"""The variant backend classes at the layer level against fp64 torch references written the
way vLLM's backends compute: differential attention (FlashServeDifferentialImpl: interleaved
head pairs, two half caches, λ, RMSNorm sub-layer norm, re-interleaved) over a builder's
decode + prefill step, and MLA prefill (FlashServeMLAPrefillImpl: q/k 192, v 128, new tokens
causal, context chunks merged by LSE) both through forward_prefill and through vLLM's per-call
methods merged with merge_attn_states. Outputs start NaN; inputs are fresh per test seed."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

import flashserve  # noqa: E402
from flashserve.backend import (CommonAttentionMetadata, FlashServeDifferentialBackend,  # noqa: E402
                                FlashServeDifferentialImpl, FlashServeEngineConfig,
                                FlashServeKVCacheSpec, FlashServeMetadataBuilder,
                                FlashServeMLAPrefillBackend, FlashServeMLAPrefillImpl,
                                MLAChunkedContextMetadata, MLAPrefillMetadata)
from helpers_torch import DEVICES, Case, check_bits, check_out, cu_seqlens, poisoned  # noqa: E402
from torch_reference import attention_ref  # noqa: E402


@pytest.fixture
def case(request):
    return Case(request)


def act_dtype(device: str):
    return torch.float32 if device == "cpu" else torch.bfloat16


# ---------------------------------------------------------------- differential attention

def diff_reference(q, keys, values, q_lens, lam, lam_init, weight, eps, scale):
    """vLLM's DifferentialFlashAttentionImpl in fp64, per request over its whole sequence."""
    outs, lo = [], 0
    for r, n in enumerate(q_lens):
        qr = q[lo:lo + n].double()
        k, v = keys[r].double(), values[r].double()
        q1, q2 = qr[:, 0::2], qr[:, 1::2]
        k1, k2, v1, v2 = k[:, 0::2], k[:, 1::2], v[:, 0::2], v[:, 1::2]

        def attn(qq, kk, vv):
            return attention_ref(qq, kk, vv, scale=scale, causal=True)[0].double()
        a1 = torch.cat([attn(q1, k1, v1), attn(q1, k1, v2)], dim=-1)
        a2 = torch.cat([attn(q2, k2, v1), attn(q2, k2, v2)], dim=-1)
        x = a1 - lam * a2
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        x = x * (1 - lam_init)
        t, h2, d2 = x.shape
        outs.append(x.view(t, h2, 2, d2 // 2).reshape(t, 2 * h2, d2 // 2))
        lo += n
    return torch.cat(outs).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("subln_kind", ["torch_rmsnorm", "vllm_rmsnorm"])
def test_differential_step(case, device, subln_kind):
    H, Hk, D, bs, dtype = 8, 4, 64, 16, act_dtype(device)
    q_lens = [1, 1] + [case.rng.randint(2, 20) for _ in range(2)]
    seq_lens = [q + case.rng.randint(0, 60) for q in q_lens]
    case.desc = f"q_lens={q_lens} seq_lens={seq_lens} {subln_kind}"
    lam_init = 0.8 - 0.6 * case.rng.random()
    lams = [case.randn(D, scale=0.1) for _ in range(4)]
    weight = case.randn(2 * D, scale=0.3) + 1.0
    if subln_kind == "torch_rmsnorm":
        subln = torch.nn.RMSNorm(2 * D, eps=1e-5)
        with torch.no_grad():
            subln.weight.copy_(weight)
        eps = 1e-5
    else:
        eps = 1e-6
        subln = types.SimpleNamespace(weight=weight, variance_epsilon=eps)
    cfg = {"lambda_init": lam_init, "lambda_q1": lams[0], "lambda_k1": lams[1], "lambda_q2": lams[2],
           "lambda_k2": lams[3], "subln": subln}
    impl = FlashServeDifferentialImpl(H, D, D ** -0.5, Hk, None, None, "auto",
                                      differential_flash_attention_config=cfg, dtype=dtype)
    lam = (torch.exp((lams[0] * lams[1]).sum()) - torch.exp((lams[2] * lams[3]).sum())).item() + lam_init
    assert abs(impl.lambda_full - lam) < 1e-5, case.where()

    need = [-(-n // bs) for n in seq_lens]
    nb = sum(need) + 1
    shape = FlashServeDifferentialBackend.get_kv_cache_shape(nb, bs, Hk, D)
    assert shape == (2, 2, nb, bs, Hk // 2, D)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    ids = case.perm(nb)
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    keys = [case.randn(n, Hk, D, dtype=dtype, device=device) for n in seq_lens]
    values = [case.randn(n, Hk, D, dtype=dtype, device=device) for n in seq_lens]

    def slots(r, a, b):
        pos = torch.arange(a, b)
        return torch.tensor(tables[r], dtype=torch.int64)[pos // bs] * bs + pos % bs

    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):  # the context, as earlier steps wrote it
        sl = slots(r, 0, s - q).to(device)
        for half in range(2):
            kv_cache[half, 0, sl // bs, sl % bs] = keys[r][:s - q, half::2]
            kv_cache[half, 1, sl // bs, sl % bs] = values[r][:s - q, half::2]
    new_slots = torch.cat([slots(r, s - q, s) for r, (q, s) in enumerate(zip(q_lens, seq_lens))]).to(device)
    key = torch.cat([k[s - q:] for k, q, s in zip(keys, q_lens, seq_lens)])
    value = torch.cat([v[s - q:] for v, q, s in zip(values, q_lens, seq_lens)])
    T = sum(q_lens)
    query = case.randn(T, H, D, dtype=dtype, device=device)
    table = torch.zeros(len(q_lens), max(need), dtype=torch.int32)
    for r, row in enumerate(tables):
        table[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
    qsl, sl = cu_seqlens(q_lens, "cpu"), torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=sl.to(device), seq_lens_cpu=sl,
        num_reqs=len(q_lens), num_actual_tokens=T, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device), slot_mapping=new_slots)
    spec = FlashServeKVCacheSpec(block_size=bs, num_kv_heads=Hk, head_size=D, dtype=dtype)
    builder = FlashServeMetadataBuilder(spec, ["layers.0.attn"], FlashServeEngineConfig(
        num_heads=H, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256), device)
    md = builder.build(0, common)
    out = poisoned((T, H, D), dtype, device)
    returned = impl.forward(None, query.view(T, H * D), key, value, kv_cache, md, out)
    assert returned.shape == (T, H * D) and returned.data_ptr() == out.data_ptr()
    ref = diff_reference(query, keys, values, q_lens, lam, lam_init, weight.to(device), eps, D ** -0.5)
    check_out(case, "output", out, ref, max(seq_lens))
    for half in range(2):
        check_bits(case, f"key cache half {half}", kv_cache[half, 0, new_slots // bs, new_slots % bs],
                   key[:, half::2])
        check_bits(case, f"value cache half {half}", kv_cache[half, 1, new_slots // bs, new_slots % bs],
                   value[:, half::2])


def test_differential_bad_arguments():
    cfg = {"lambda_init": 0.5, "lambda_q1": torch.zeros(64), "lambda_k1": torch.zeros(64),
           "lambda_q2": torch.zeros(64), "lambda_k2": torch.zeros(64), "subln": torch.nn.RMSNorm(128, eps=1e-5)}
    with pytest.raises(ValueError, match="num_kv_heads"):
        FlashServeDifferentialBackend.get_kv_cache_shape(4, 16, 3, 64)
    with pytest.raises(ValueError, match="lambda_k2"):
        FlashServeDifferentialImpl(8, 64, 0.125, 4, differential_flash_attention_config={
            k: v for k, v in cfg.items() if k != "lambda_k2"})
    with pytest.raises(ValueError, match="lambda_q1"):
        FlashServeDifferentialImpl(8, 64, 0.125, 4, differential_flash_attention_config={
            **cfg, "lambda_q1": torch.zeros(32)})
    with pytest.raises(ValueError, match="subln"):
        FlashServeDifferentialImpl(8, 64, 0.125, 4, differential_flash_attention_config={
            **cfg, "subln": torch.nn.RMSNorm(64)})
    with pytest.raises(NotImplementedError, match="alibi"):
        FlashServeDifferentialImpl(8, 64, 0.125, 4, [0.5] * 8, differential_flash_attention_config=cfg)
    with pytest.raises(ValueError, match="num_kv_heads"):
        FlashServeDifferentialImpl(8, 64, 0.125, 1, differential_flash_attention_config=cfg)


# ---------------------------------------------------------------- MLA prefill

def mla_batch(case: Case, device: str, H: int, n_chunks: int):
    dtype = act_dtype(device)
    q_lens = [case.rng.randint(1, 24) for _ in range(3)]
    ctx_lens = [case.rng.choice([0, case.rng.randint(1, 70)]) if n_chunks else 0 for _ in q_lens]
    T = sum(q_lens)
    q = case.randn(T, H, 192, dtype=dtype, device=device)
    k = case.randn(T, H, 192, dtype=dtype, device=device)
    v = case.randn(T, H, 128, dtype=dtype, device=device)
    # context chunk i holds context tokens [i * c, (i + 1) * c) of each request
    c = max(1, -(-max(ctx_lens) // max(n_chunks, 1)))
    ctx_k = [case.randn(n, H, 192, dtype=dtype, device=device) for n in ctx_lens]
    ctx_v = [case.randn(n, H, 128, dtype=dtype, device=device) for n in ctx_lens]
    chunks, cu, mx = [], [], []
    for i in range(n_chunks):
        lens = [max(0, min(n, (i + 1) * c) - i * c) for n in ctx_lens]
        chunks.append((torch.cat([x[i * c:i * c + m] for x, m in zip(ctx_k, lens)]),
                       torch.cat([x[i * c:i * c + m] for x, m in zip(ctx_v, lens)])))
        cu.append(cu_seqlens(lens, device))
        mx.append(max(lens))
    md = MLAPrefillMetadata(query_start_loc=cu_seqlens(q_lens, device), max_query_len=max(q_lens),
                            chunked_context=MLAChunkedContextMetadata(cu, mx) if n_chunks else None)
    ref = torch.zeros(T, H, 128, device=device)
    lo = 0
    for r, n in enumerate(q_lens):
        keys = torch.cat([ctx_k[r], k[lo:lo + n]])
        vals = torch.cat([ctx_v[r], v[lo:lo + n]])
        ref[lo:lo + n] = attention_ref(q[lo:lo + n], keys, vals, scale=192 ** -0.5, causal=True)[0]
        lo += n
    case.desc = f"q_lens={q_lens} ctx_lens={ctx_lens} chunks={n_chunks}"
    return md, q, k, v, chunks, ref, max(q_lens) + max(ctx_lens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_chunks", [0, 1, 3])
def test_mla_prefill_forward(case, device, n_chunks):
    H = 4
    md, q, k, v, chunks, ref, max_len = mla_batch(case, device, H, n_chunks)
    assert FlashServeMLAPrefillBackend.get_prefill_impl_cls() is FlashServeMLAPrefillImpl
    assert FlashServeMLAPrefillBackend.is_available()
    impl = FlashServeMLAPrefillImpl(H, 192 ** -0.5, 512, 128, 64, 128,
                                    types.SimpleNamespace(max_num_batched_tokens=256), device)
    out = poisoned((q.shape[0], H, 128), q.dtype, device)
    assert impl.forward_prefill(md, q, k, v, chunks, out) is out
    check_out(case, "forward_prefill output", out, ref, max_len)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_prefill_vllm_calls_merged(case, device):
    """vLLM's flow: run_prefill_context_chunk per chunk and run_prefill_new_tokens, the partial
    states merged by LSE (merge_attn_states)."""
    H = 4
    md, q, k, v, chunks, ref, max_len = mla_batch(case, device, H, 2)
    impl = FlashServeMLAPrefillImpl(H, 192 ** -0.5, 512, 128, 64, 128, None, device)
    acc, acc_lse = None, None
    for i, (ck, cv) in enumerate(chunks):
        o, lse = impl.run_prefill_context_chunk(md, i, q, ck, cv)
        assert o.shape == (q.shape[0], H, 128) and lse.shape == (H, q.shape[0]), case.where()
        if acc is None:
            acc, acc_lse = o.float(), lse
        else:
            merged, merged_lse = torch.empty_like(acc), torch.empty_like(acc_lse)
            flashserve.merge_attn_states(merged, acc, acc_lse, o.float(), lse, output_lse=merged_lse)
            acc, acc_lse = merged, merged_lse
    new, new_lse = impl.run_prefill_new_tokens(md, q, k, v, return_softmax_lse=True)
    out = poisoned((q.shape[0], H, 128), q.dtype, device)
    flashserve.merge_attn_states(out, acc.to(q.dtype), acc_lse, new, new_lse)
    check_out(case, "merged output", out, ref, max_len)
    only_new = impl.run_prefill_new_tokens(md, q, k, v, return_softmax_lse=False)
    assert only_new.shape == (q.shape[0], H, 128)


def test_mla_prefill_bad_arguments(case):
    md, q, k, v, chunks, _, _ = mla_batch(case, "cpu", 4, 2)
    impl = FlashServeMLAPrefillImpl(4, 192 ** -0.5, 512, 128, 64, 128)
    with pytest.raises(ValueError, match="context"):
        impl.forward_prefill(md, q, k, v, chunks[:1])
    with pytest.raises(ValueError, match="chunk_idx"):
        impl.run_prefill_context_chunk(md, 2, q, *chunks[0])
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        FlashServeMLAPrefillImpl(4, 0.1, 512, 100, 64, 128)
