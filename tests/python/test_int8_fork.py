"""The vLLM int8 fork's surface (flashserve.ixformer; PYTHON_API.md "The vLLM fork's int8
entry"), called as the fork's backend calls it (000_*: VLLM_ATTN_OPT_LEVEL 1 = K8V8, 2 = K8V16):
scaled_int8_quant_for_attn, reshape_and_cache_flash_int8 / _mix, flash_attn_varlen_int8_func,
vllm_paged_attention_int8 / _mix (with the fused save_* cache write), the fork's
flash_attn_varlen_func / flash_attn_with_kvcache (HND caches, sinks, sqrt-ALiBi, cu_query_lens),
merge_attn_states in ixformer's order. Fresh random inputs, poisoned outputs, an fp64 torch
reference of the int8 semantics (dequantized operands), bad inputs named; inference_mode,
torch.compile(fullgraph=True) and CUDA-graph capture (CUDA only)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashserve  # noqa: E402
import flashserve.ixformer as ixf  # noqa: E402
from helpers_torch import DEVICES  # noqa: E402
from torch_reference import attention_ref  # noqa: E402

NAN = float("nan")


def gen(rng: np.random.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(1 << 31)))


def randn(g, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def quant_ref(x: torch.Tensor) -> tuple:
    """Mode 2 in float: scale = absmax / 127 (1 for zero rows), round half even, clamp."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a tensor divisor: torch divides by a Python scalar through its reciprocal on CUDA (an ulp
    # off absmax / 127, which the library rounds correctly)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 127.0), torch.ones_like(amax))
    q = torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


# ---------------------------------------------------------------- quantization


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transpose", [False, True])
def test_quant_mode2_per_token_head(rng, device, dtype, transpose):
    g = gen(rng)
    T, H, D = int(rng.integers(1, 40)), int(rng.integers(1, 6)), int(rng.choice([8, 64, 128]))
    # a view of a fused buffer (token stride > H * D), as the engine's q/k slices of qkv
    x = randn(g, T, H + 1, D, dtype=dtype, device=device, scale=float(rng.uniform(0.1, 30)))[:, 1:]
    x[0, 0] = 0  # an all-zero row: scale 1
    q, s = ixf.scaled_int8_quant_for_attn(x, 2, transpose_scale=transpose)
    want_q, want_s = quant_ref(x)
    assert q.dtype == torch.int8 and q.shape == (T, H, D)
    assert s.dtype == torch.float32 and s.shape == ((H, T) if transpose else (T, H))
    assert torch.equal(s.t() if transpose else s, want_s)
    assert torch.equal(q, want_q)
    deq = q.double() * (s.t() if transpose else s).double()[..., None]
    assert (deq - x.double()).abs().max() <= 0.5 * want_s.double().max() * (1 + 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_quant_mode0_per_head_channel(rng, device):
    g = gen(rng)
    T, H, D = int(rng.integers(1, 30)), int(rng.integers(1, 4)), 16
    x = randn(g, T, H, D, dtype=torch.bfloat16, device=device, scale=3.0)
    static = (torch.rand(H, D, generator=g) * 0.05 + 0.01).to(device)
    q, s = ixf.scaled_int8_quant_for_attn(x, 0, transpose_scale=False, scale=static)
    assert s is static
    assert torch.equal(q, torch.round(x.float() / static).clamp(-127, 127).to(torch.int8))
    q2, s2 = ixf.scaled_int8_quant_for_attn(x, 0)  # dynamic: absmax over the tokens
    amax = x.float().abs().amax(dim=0)
    assert torch.equal(s2, torch.where(amax > 0, amax / torch.full_like(amax, 127.0), torch.ones_like(amax)))
    assert q2.abs().amax() == 127


def test_quant_bad_inputs():
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="^x: expected"):
        ixf.scaled_int8_quant_for_attn(x[0], 2)
    with pytest.raises(ValueError, match="^x: expected"):
        ixf.scaled_int8_quant_for_attn(x.to(torch.int8), 2)
    with pytest.raises(ValueError, match="^scale: expected None"):
        ixf.scaled_int8_quant_for_attn(x, 2, scale=torch.ones(2, 8))
    with pytest.raises(ValueError, match="^scale: expected"):
        ixf.scaled_int8_quant_for_attn(x, 0, scale=torch.ones(2, 4))
    with pytest.raises(NotImplementedError, match="^mode"):
        ixf.scaled_int8_quant_for_attn(x, 1)
    with pytest.raises(NotImplementedError, match="^transpose_scale"):
        ixf.scaled_int8_quant_for_attn(x, 0, transpose_scale=True)


# ---------------------------------------------------------------- the fork's caches


class ForkCaches:
    """The fork's int8 cache of one layer: kv_cache (2|3, num_blocks, H_kv, block_size, D)
    int8 (K8V16: planes 1-2 hold the 16-bit values), key_scale_cache, value scale (K8V8)."""

    def __init__(self, g, k8v8: bool, nb: int, H_kv: int, bs: int, D: int, dtype, device) -> None:
        self.k8v8, self.dtype = k8v8, dtype
        self.kv = torch.randint(-128, 128, (2 if k8v8 else 3, nb, H_kv, bs, D), dtype=torch.int8,
                                generator=g).to(device)  # garbage everywhere: must stay where not written
        self.own_values = None  # K8V16 values in a tensor of their own (_clone_caches)
        self.key_scale_cache = torch.full((nb, H_kv, bs), NAN, device=device)
        self.value_scale = (torch.rand(H_kv, D, generator=g) * 0.02 + 0.01).to(device) if k8v8 else None

    # The planes are views taken from kv where they are used, as the fork's attention takes
    # kv_cache[0] / kv_cache[1] inside its forward: under torch.compile the base is then a graph
    # input. Views of one base lifted as separate inputs and both mutated by one op are copied
    # through a base-sized clone read from the view's pointer under inductor (out of bounds;
    # pytorch/pytorch#139628), a torch limitation no op can work around.
    @property
    def key_cache(self):
        return self.kv[0]

    @property
    def value_cache(self):
        if self.k8v8:
            return self.kv[1]
        if self.own_values is not None:
            return self.own_values
        _, nb, H_kv, bs, D = self.kv.shape
        return self.kv[1:].view(self.dtype).reshape(nb, H_kv, bs, D)

    def write(self, key, value, slots) -> None:
        """The fork's has_prefill write (quant_type 1 / 2)."""
        i8_key, key_scale = ixf.scaled_int8_quant_for_attn(key, 2, transpose_scale=False)
        if self.k8v8:
            i8_value, _ = ixf.scaled_int8_quant_for_attn(value, 0, transpose_scale=False, scale=self.value_scale)
            ixf.reshape_and_cache_flash_int8(key=i8_key, value=i8_value, k_scale=key_scale, key_cache=self.key_cache,
                                             value_cache=self.value_cache, key_scale_cache=self.key_scale_cache,
                                             slot_mapping=slots, kv_cache_dtype="")
        else:
            ixf.reshape_and_cache_flash_mix(key=i8_key, value=value, k_scale=key_scale, key_cache=self.key_cache,
                                            value_cache=self.value_cache, key_scale_cache=self.key_scale_cache,
                                            slot_mapping=slots, kv_cache_dtype="")

    def keys(self, blocks, length):
        """Dequantized K and V rows 0..length of one sequence, float64 [length, H_kv, D]."""
        bs = self.key_cache.shape[2]
        t = torch.arange(length, device=blocks.device)
        ids, off = blocks.long()[t // bs], t % bs
        k = self.key_cache[ids, :, off].double() * self.key_scale_cache[ids, :, off].double()[..., None]
        v = self.value_cache[ids, :, off].double()
        if self.k8v8:
            v = v * self.value_scale.double()[None]
        return k, v


def slots_for(block_table, lens_before, new_lens, bs, device):
    slots = []
    for b, (n0, n) in enumerate(zip(lens_before, new_lens)):
        for p in range(n0, n0 + n):
            slots.append(int(block_table[b, p // bs]) * bs + p % bs)
    return torch.tensor(slots, dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k8v8", [True, False], ids=["k8v8", "k8v16"])
def test_reshape_and_cache_int8_writes_rows_as_given(rng, device, k8v8):
    g = gen(rng)
    H_kv, D, bs, nb = int(rng.integers(1, 4)), int(rng.choice([16, 64])), int(rng.choice([16, 32])), 6
    dtype = torch.bfloat16 if rng.integers(2) else torch.float16
    c = ForkCaches(g, k8v8, nb, H_kv, bs, D, dtype, device)
    T = int(rng.integers(1, 3 * bs))
    perm = torch.randperm(nb * bs, generator=g)[:T].to(device)
    slots = torch.where(torch.rand(T, generator=g).to(device) < 0.2, torch.full_like(perm, -1), perm)
    key = randn(g, T + 2, H_kv, D, dtype=dtype, device=device)  # padded rows past slot_mapping
    value = randn(g, T + 2, H_kv, D, dtype=dtype, device=device)
    before = c.kv.clone(), c.key_scale_cache.clone()
    c.write(key, value, slots)
    kq, ks = quant_ref(key)
    want_kv, want_ks = before[0].clone(), before[1].clone()
    want_k = want_kv[0]
    want_v = want_kv[1] if k8v8 else want_kv[1:].view(dtype).reshape(nb, H_kv, bs, D)
    for i in range(T):
        s = int(slots[i])
        if s < 0:
            continue
        b, o = divmod(s, bs)
        want_k[b, :, o] = kq[i]
        want_ks[b, :, o] = ks[i]
        want_v[b, :, o] = (torch.round(value[i].float() / c.value_scale).clamp(-127, 127).to(torch.int8)
                           if k8v8 else value[i])
    assert torch.equal(c.kv, want_kv)
    assert torch.equal(c.key_scale_cache.nan_to_num(7.0), want_ks.nan_to_num(7.0))


def test_reshape_and_cache_int8_bad_inputs():
    c = ForkCaches(torch.Generator().manual_seed(1), True, 3, 2, 16, 8, torch.float16, "cpu")
    key = torch.randint(-127, 127, (4, 2, 8), dtype=torch.int8)
    ks = torch.rand(4, 2)
    slots = torch.arange(4, dtype=torch.int64)
    snapshot = c.kv.clone()
    args = dict(key=key, value=key, k_scale=ks, key_cache=c.key_cache, value_cache=c.value_cache,
                key_scale_cache=c.key_scale_cache, slot_mapping=slots, kv_cache_dtype="")
    for change, name in ((dict(key=key.float()), "key"), (dict(k_scale=ks[:, :1]), "k_scale"),
                         (dict(k_scale=ks.double()), "k_scale"), (dict(value=key.half()), "value"),
                         (dict(key_scale_cache=c.key_scale_cache[:, :1]), "key_scale_cache"),
                         (dict(slot_mapping=slots.int()), "slot_mapping"),
                         (dict(slot_mapping=slots + 100), "slot_mapping"),
                         (dict(kv_cache_dtype="fp8"), "kv_cache_dtype")):
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            ixf.reshape_and_cache_flash_int8(**{**args, **change})
    with pytest.raises(ValueError, match="^value: expected"):  # K8V16: 16-bit values
        ixf.reshape_and_cache_flash_mix(**args)
    assert torch.equal(c.kv, snapshot) and c.key_scale_cache.isnan().all()


# ---------------------------------------------------------------- attention


def fork_step(rng, device, k8v8, dtype, *, ctx_hi=40, q_hi=12):
    """A mixed step as the fork runs it: requests with context already cached plus new tokens,
    written by the fork's has_prefill path. Returns what the calls and the reference need."""
    g = gen(rng)
    H_kv = int(rng.choice([1, 2]))
    H = H_kv * int(rng.choice([1, 2, 4]))
    D, bs = int(rng.choice([32, 64, 128])), 16
    B = int(rng.integers(1, 5))
    q_lens = [int(rng.integers(1, q_hi)) for _ in range(B)]
    ctx = [int(rng.integers(0, ctx_hi)) for _ in range(B)]
    k_lens = [c + q for c, q in zip(ctx, q_lens)]
    max_blocks = max(math.ceil(n / bs) for n in k_lens) + 1
    nb = B * max_blocks + 2
    block_table = torch.randperm(nb, generator=g)[:B * max_blocks].view(B, max_blocks).to(torch.int32).to(device)
    c = ForkCaches(g, k8v8, nb, H_kv, bs, D, dtype, device)
    # the cached context, then this step's tokens
    c.write(randn(g, sum(ctx), H_kv, D, dtype=dtype, device=device),
            randn(g, sum(ctx), H_kv, D, dtype=dtype, device=device),
            slots_for(block_table.cpu(), [0] * B, ctx, bs, device))
    T = sum(q_lens)
    key = randn(g, T, H_kv, D, dtype=dtype, device=device)
    value = randn(g, T, H_kv, D, dtype=dtype, device=device)
    slots = slots_for(block_table.cpu(), ctx, q_lens, bs, device)
    query = randn(g, T, H, D, dtype=dtype, device=device)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32, device=device)
    return dict(g=g, c=c, H=H, H_kv=H_kv, D=D, bs=bs, B=B, q_lens=q_lens, k_lens=k_lens, ctx=ctx,
                block_table=block_table, key=key, value=value, slots=slots, query=query, cu_q=cu_q, cu_k=cu_k)


def reference(s, q_rows, q_scale_rows, **kw):
    """fp64 attention over the dequantized q (q_scale_rows [T, H]) and cache."""
    q = q_rows.double() * q_scale_rows.double()[..., None]
    out = torch.zeros(q.shape[0], s["H"], s["D"], dtype=torch.float64, device=q.device)
    lo = 0
    for b in range(s["B"]):
        n = s["q_lens"][b]
        k, v = s["c"].keys(s["block_table"][b], s["k_lens"][b])
        o, _ = attention_ref(q[lo:lo + n], k, v, **kw)
        out[lo:lo + n] = o.double()
        lo += n
    return out


def slopes(g, H, device):
    return (torch.rand(H, generator=g) * 0.3 + 0.05)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k8v8", [True, False], ids=["k8v8", "k8v16"])
@pytest.mark.parametrize("variant", ["plain", "alibi_sqrt", "window_softcap"])
def test_flash_attn_varlen_int8_func_prefill(rng, device, k8v8, variant):
    dtype = torch.bfloat16 if rng.integers(2) else torch.float16
    s = fork_step(rng, device, k8v8, dtype)
    c, g = s["c"], s["g"]
    c.write(s["key"], s["value"], s["slots"])
    num_decode = int(rng.integers(0, 3))  # rows before the prefill part, as the fork slices them
    pad_q = randn(g, num_decode, s["H"], s["D"], dtype=dtype, device=device)
    query = torch.cat([pad_q, s["query"]])
    int8_query, query_scale = ixf.scaled_int8_quant_for_attn(query, 2, transpose_scale=True)
    output = torch.full((query.shape[0], s["H"], s["D"]), NAN, dtype=dtype, device=device)
    kw = dict(scale=float(rng.uniform(0.05, 0.2)), causal=True)
    alibi, sqrt_alibi, window, softcap = None, False, (-1, -1), 0.0
    if variant == "alibi_sqrt":
        alibi, sqrt_alibi = slopes(g, s["H"], device), bool(rng.integers(2))
        kw.update(alibi=alibi.to(device), alibi_sqrt=sqrt_alibi)
    elif variant == "window_softcap":
        window, softcap = (int(rng.integers(0, 20)), 0), float(rng.uniform(5, 30))
        kw.update(window=window, softcap=softcap)
    ret = ixf.flash_attn_varlen_int8_func(
        q=int8_query[num_decode:], k=c.key_cache, v=c.value_cache, q_scale=query_scale[:, num_decode:],
        k_scale=c.key_scale_cache, v_scale=c.value_scale, cu_seqlens_q=s["cu_q"], cu_seqlens_k=s["cu_k"],
        max_seqlen_q=max(s["q_lens"]), max_seqlen_k=max(s["q_lens"]),  # the fork passes max_query_len
        softmax_scale=kw["scale"], causal=True, window_size=window, alibi_slopes=alibi, softcap=softcap,
        sqrt_alibi=sqrt_alibi, out=output[num_decode:], block_table=s["block_table"], output_dtype=dtype)
    assert ret.data_ptr() == output[num_decode:].data_ptr()
    assert output[:num_decode].isnan().all()  # rows of the decode part untouched
    want = reference(s, int8_query[num_decode:], query_scale[:, num_decode:].t(), **kw)
    torch.testing.assert_close(output[num_decode:].double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k8v8", [True, False], ids=["k8v8", "k8v16"])
@pytest.mark.parametrize("fused", [True, False], ids=["save_fused", "written_before"])
def test_vllm_paged_attention_int8_decode(rng, device, k8v8, fused):
    """The fork's decode: int8 q with [T, H] scales, MTP query lengths (cu_query_lens), the new
    K/V written through save_key/save_value/save_key_scale (decode-only steps) or before."""
    dtype = torch.bfloat16 if rng.integers(2) else torch.float16
    s = fork_step(rng, device, k8v8, dtype, ctx_hi=70, q_hi=4)
    c = s["c"]
    int8_query, query_scale = ixf.scaled_int8_quant_for_attn(s["query"], 2, transpose_scale=False)
    i8_key, key_scale = ixf.scaled_int8_quant_for_attn(s["key"], 2, transpose_scale=False)
    i8_value = (ixf.scaled_int8_quant_for_attn(s["value"], 0, scale=c.value_scale)[0] if k8v8
                else s["value"].contiguous())
    if not fused:
        c.write(s["key"], s["value"], s["slots"])
    T = s["query"].shape[0]
    output = torch.full((T + 2, s["H"], s["D"]), NAN, dtype=dtype, device=device)  # padded rows
    seq_lens = torch.tensor(s["k_lens"], dtype=torch.int32, device=device)
    scale = float(rng.uniform(0.05, 0.2))
    para = dict(output=output[:T], query=int8_query, key_cache=c.key_cache, query_scale=query_scale,
                key_scale_cache=c.key_scale_cache, num_kv_heads=s["H_kv"], scale=scale,
                block_tables=s["block_table"], context_lens=seq_lens, block_size=s["bs"], softcap=0.0,
                alibi_slopes=None, causal=True, window_left=-1, window_right=-1, use_sqrt_alibi=False,
                use_cuda_graph=False, max_context_len=max(s["k_lens"]), cu_query_lens=s["cu_q"],
                max_query_len=max(s["q_lens"]))
    if fused:
        para.update(save_key=i8_key, save_value=i8_value, save_key_scale=key_scale)
    if k8v8:
        ixf.vllm_paged_attention_int8(**para, value_cache=c.value_cache, value_scale_cache=c.value_scale)
    else:
        ixf.vllm_paged_attention_mix(**para, value_cache=c.value_cache)
    assert output[T:].isnan().all()
    want = reference(s, int8_query, query_scale, scale=scale, causal=True)
    torch.testing.assert_close(output[:T].double(), want, atol=2e-2, rtol=2e-2)
    if fused:  # the fused write equals the fork's separate one
        kq, ks = quant_ref(s["key"])
        bs = s["bs"]
        for i, slot in enumerate(s["slots"].tolist()):
            b, o = divmod(slot, bs)
            assert torch.equal(c.key_cache[b, :, o], kq[i]) and torch.equal(c.key_scale_cache[b, :, o], ks[i])


def test_paged_attention_int8_bad_inputs():
    s = fork_step(np.random.default_rng(3), "cpu", True, torch.float16)
    c = s["c"]
    q, qs = ixf.scaled_int8_quant_for_attn(s["query"], 2)
    T = q.shape[0]
    out = torch.full((T, s["H"], s["D"]), NAN, dtype=torch.float16)
    i8_key, key_scale = ixf.scaled_int8_quant_for_attn(s["key"], 2)
    i8_value = ixf.scaled_int8_quant_for_attn(s["value"], 0, scale=c.value_scale)[0]
    base = dict(output=out, query=q, key_cache=c.key_cache, query_scale=qs, key_scale_cache=c.key_scale_cache,
                num_kv_heads=s["H_kv"], scale=0.1, block_tables=s["block_table"],
                context_lens=torch.tensor(s["k_lens"], dtype=torch.int32), block_size=s["bs"],
                cu_query_lens=s["cu_q"], max_query_len=max(s["q_lens"]), value_cache=c.value_cache,
                value_scale_cache=c.value_scale, save_key=i8_key, save_value=i8_value, save_key_scale=key_scale)
    before = c.kv.clone(), c.key_scale_cache.clone()
    for change, name in ((dict(query=s["query"]), "query"), (dict(query_scale=qs.t()), "query_scale"),
                         (dict(num_kv_heads=s["H_kv"] + 1), "num_kv_heads"), (dict(block_size=8), "block_size"),
                         (dict(value_scale_cache=None), "value_scale_cache"),
                         (dict(value_scale_cache=c.value_scale[:, :4]), "value_scale_cache"),
                         (dict(key_scale_cache=c.key_scale_cache.double()), "key_scale_cache"),
                         (dict(block_tables=s["block_table"].long()), "block_tables"),
                         (dict(max_query_len=0), "max_query_len"),
                         (dict(save_value=None), "save_value"),
                         (dict(save_key=s["key"]), "save_key"),
                         (dict(save_value=s["value"]), "save_value"),
                         (dict(save_key_scale=key_scale[:-1]), "save_key_scale")):
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            ixf.vllm_paged_attention_int8(**{**base, **change})
    assert out.isnan().all()  # rejected calls write neither the output nor the cache
    assert torch.equal(c.kv, before[0]) and torch.equal(c.key_scale_cache.nan_to_num(7.0), before[1].nan_to_num(7.0))


def test_varlen_int8_bad_inputs():
    s = fork_step(np.random.default_rng(4), "cpu", False, torch.bfloat16)
    c = s["c"]
    q, qs = ixf.scaled_int8_quant_for_attn(s["query"], 2, transpose_scale=True)
    out = torch.full((q.shape[0], s["H"], s["D"]), NAN, dtype=torch.bfloat16)
    base = dict(q=q, k=c.key_cache, v=c.value_cache, q_scale=qs, k_scale=c.key_scale_cache, v_scale=None,
                cu_seqlens_q=s["cu_q"], cu_seqlens_k=s["cu_k"], max_seqlen_q=max(s["q_lens"]),
                max_seqlen_k=1, out=out, block_table=s["block_table"], causal=True)
    for change, name, exc in ((dict(q=s["query"]), "q", ValueError), (dict(q_scale=qs.t()), "q_scale", ValueError),
                              (dict(k_scale=c.key_scale_cache[:, :, :4]), "k_scale", ValueError),
                              (dict(v_scale=torch.ones(s["H_kv"], s["D"])), "v_scale", ValueError),
                              (dict(window_size=(1, 2, 3)), "window_size", ValueError),
                              (dict(output_dtype=torch.float16), "output_dtype", ValueError),
                              (dict(cu_seqlens_k=s["cu_k"].long()), "cu_seqlens_k", ValueError),
                              (dict(softmax_scale=0.0), "softmax_scale", NotImplementedError)):
        with pytest.raises(exc, match=f"^{name}: expected" if exc is ValueError else f"^{name}:"):
            ixf.flash_attn_varlen_int8_func(**{**base, **change})
    assert out.isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_fork_flash_attn_varlen_func_hnd_sinks_sqrt_alibi(rng, device):
    """quant_type 0: 16-bit HND caches through the fork's flash_attn_varlen_func with sinks and
    sqrt_alibi; its flash_attn_with_kvcache over the same cache with cu_query_lens."""
    g = gen(rng)
    dtype = torch.bfloat16
    H_kv, H, D, bs, B = 2, 4, 64, 16, int(rng.integers(1, 4))
    q_lens = [int(rng.integers(1, 6)) for _ in range(B)]
    k_lens = [q + int(rng.integers(0, 40)) for q in q_lens]
    max_blocks = max(math.ceil(n / bs) for n in k_lens)
    nb = B * max_blocks + 1
    kv = randn(g, 2, nb, H_kv, bs, D, dtype=dtype, device=device)
    key_cache, value_cache = kv.unbind(0)
    block_table = torch.randperm(nb, generator=g)[:B * max_blocks].view(B, max_blocks).to(torch.int32).to(device)
    q = randn(g, sum(q_lens), H, D, dtype=dtype, device=device)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32, device=device)
    sinks = randn(g, H, device=device)
    alibi = slopes(g, H, device)
    out = torch.full_like(q, NAN)
    ixf.flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=max(q_lens), max_seqlen_k=max(q_lens), softmax_scale=0.125,
                               causal=True, window_size=(-1, -1), alibi_slopes=alibi, softcap=0.0,
                               sqrt_alibi=True, sinks=sinks, out=out, block_table=block_table)
    want = torch.zeros(q.shape, dtype=torch.float64, device=device)
    lo = 0
    for b in range(B):
        t = torch.arange(k_lens[b], device=device)
        ids = block_table[b].long()[t // bs]
        k, v = key_cache[ids, :, t % bs], value_cache[ids, :, t % bs]
        o, _ = attention_ref(q[lo:lo + q_lens[b]], k, v, scale=0.125, causal=True, alibi=alibi.to(device),
                             alibi_sqrt=True, sink=sinks)
        want[lo:lo + q_lens[b]] = o.double()
        lo += q_lens[b]
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    # the decode call: q unsqueezed to [T, 1, H, D], cu_query_lens, cache_seqlens
    out2 = torch.full_like(q, NAN)
    ixf.flash_attn_with_kvcache(q=q.unsqueeze(1), k_cache=key_cache, v_cache=value_cache, block_table=block_table,
                                cache_seqlens=torch.tensor(k_lens, dtype=torch.int32, device=device),
                                max_query_len=max(q_lens), cu_query_lens=cu_q, softmax_scale=0.125, causal=True,
                                window_size=(-1, -1), alibi_slopes=alibi, softcap=0.0, use_sqrt_alibi=True,
                                sinks=sinks, out=out2.unsqueeze(1), use_cuda_graph=False, max_context_len=max(k_lens))
    torch.testing.assert_close(out2.double(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="^sinks: expected"):
        ixf.flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=max(q_lens), max_seqlen_k=1, block_table=block_table,
                                   sinks=sinks[:2])


@pytest.mark.parametrize("device", DEVICES)
def test_merge_attn_states_fork_order(rng, device):
    g = gen(rng)
    T, H, D = 7, 3, 16
    po, so = randn(g, T, H, D, device=device), randn(g, T, H, D, device=device)
    pl, sl = randn(g, H, T, device=device), randn(g, H, T, device=device)
    out = torch.full_like(po, NAN)
    assert ixf.merge_attn_states(po, pl, so, sl, out) is out
    m = torch.maximum(pl, sl)
    wa, wb = torch.exp(pl - m).double(), torch.exp(sl - m).double()
    want = (wa.T[..., None] * po.double() + wb.T[..., None] * so.double()) / (wa + wb).T[..., None]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- inference_mode, compile, graphs


def fork_prefill_step(c, query, key, value, slots, cu_q, cu_k, block_table, max_q, out, dtype):
    """The fork's quant_type 1/2 prefill path: quantize, write, attend."""
    int8_query, query_scale = ixf.scaled_int8_quant_for_attn(query, 2, transpose_scale=True)
    c.write(key, value, slots)
    ixf.flash_attn_varlen_int8_func(q=int8_query, k=c.key_cache, v=c.value_cache, q_scale=query_scale,
                                    k_scale=c.key_scale_cache, v_scale=c.value_scale, cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_q, softmax_scale=0.1,
                                    causal=True, window_size=(-1, -1), alibi_slopes=None, softcap=0.0,
                                    sqrt_alibi=False, out=out, block_table=block_table, output_dtype=dtype)
    return out


def _clone_caches(c, own_values: bool = False):
    """A copy of c. own_values (K8V16): the 16-bit values in a tensor of their own, not a dtype
    view of the int8 planes: aot_autograd (torch.compile) does not handle input mutations on
    views with different dtypes (its limitation, not the op's)."""
    d = object.__new__(ForkCaches)
    d.__dict__.update(c.__dict__)
    d.kv = c.kv.clone()
    d.own_values = c.value_cache.clone() if own_values and not c.k8v8 else None
    d.key_scale_cache = c.key_scale_cache.clone()
    return d


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k8v8", [True, False], ids=["k8v8", "k8v16"])
@pytest.mark.parametrize("how", ["inference_mode", "compile", "cuda_graph"])
def test_fork_step_inference_mode_compile_graph(rng, device, k8v8, how):
    if how == "cuda_graph" and device != "cuda":
        pytest.skip("CUDA-graph capture needs CUDA")
    dtype = torch.float16
    s = fork_step(rng, device, k8v8, dtype)
    args = (s["query"], s["key"], s["value"], s["slots"], s["cu_q"], s["cu_k"], s["block_table"],
            max(s["q_lens"]))
    own = how == "compile"
    eager_c = _clone_caches(s["c"], own)
    eager = fork_prefill_step(eager_c, *args, torch.full_like(s["query"], NAN), dtype)
    c = _clone_caches(s["c"], own)
    out = torch.full_like(s["query"], NAN)
    if how == "inference_mode":
        with torch.inference_mode():
            fork_prefill_step(c, *args, out, dtype)
    elif how == "compile":
        torch._dynamo.reset()
        step = torch.compile(fork_prefill_step, fullgraph=True,
                             backend="aot_eager" if device == "cpu" else "inductor")
        step(c, *args, out, dtype)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fork_prefill_step(_clone_caches(s["c"]), *args, torch.empty_like(out), dtype)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fork_prefill_step(c, *args, out, dtype)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(c.kv, eager_c.kv) and torch.equal(c.value_cache.view(torch.int16), eager_c.value_cache.view(torch.int16))
    assert torch.equal(c.key_scale_cache.nan_to_num(7.0), eager_c.key_scale_cache.nan_to_num(7.0))


@pytest.mark.parametrize("device", DEVICES)
def test_fork_decode_compile_and_graph(rng, device):
    """vllm_paged_attention_int8 with the fused save_* write under torch.compile(fullgraph) and
    (CUDA) graph capture equals eager, caches included."""
    dtype = torch.float16
    s = fork_step(rng, device, True, dtype, q_hi=3)
    seq_lens = torch.tensor(s["k_lens"], dtype=torch.int32, device=device)

    def step(c, query, key, value, out):
        int8_query, query_scale = ixf.scaled_int8_quant_for_attn(query, 2, transpose_scale=False)
        i8_key, key_scale = ixf.scaled_int8_quant_for_attn(key, 2, transpose_scale=False)
        i8_value, _ = ixf.scaled_int8_quant_for_attn(value, 0, transpose_scale=False, scale=c.value_scale)
        ixf.vllm_paged_attention_int8(output=out, query=int8_query, key_cache=c.key_cache, query_scale=query_scale,
                                      key_scale_cache=c.key_scale_cache, num_kv_heads=s["H_kv"], scale=0.1,
                                      block_tables=s["block_table"], context_lens=seq_lens, block_size=s["bs"],
                                      softcap=0.0, alibi_slopes=None, causal=True, window_left=-1,
                                      window_right=-1, use_sqrt_alibi=False, use_cuda_graph=True,
                                      max_context_len=max(s["k_lens"]), cu_query_lens=s["cu_q"],
                                      max_query_len=max(s["q_lens"]), value_cache=c.value_cache,
                                      value_scale_cache=c.value_scale, save_key=i8_key, save_value=i8_value,
                                      save_key_scale=key_scale)
        return out

    eager_c = _clone_caches(s["c"])
    eager = step(eager_c, s["query"], s["key"], s["value"], torch.full_like(s["query"], NAN))
    torch._dynamo.reset()
    backend = os.environ.get("FLASHSERVE_TEST_COMPILE_BACKEND") or ("aot_eager" if device == "cpu" else "inductor")
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    c = _clone_caches(s["c"])
    got = compiled(c, s["query"], s["key"], s["value"], torch.full_like(s["query"], NAN))
    assert torch.equal(got, eager) and torch.equal(c.kv, eager_c.kv)
    if device == "cuda":
        c2 = _clone_caches(s["c"])
        out = torch.full_like(s["query"], NAN)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(_clone_caches(s["c"]), s["query"], s["key"], s["value"], torch.empty_like(out))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(c2, s["query"], s["key"], s["value"], out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(c2.kv, eager_c.kv)


def test_top_level_exports():
    for name in ("flash_attn_varlen_int8_func", "scaled_int8_quant_for_attn", "reshape_and_cache_flash_int8",
                 "reshape_and_cache_flash_mix", "vllm_paged_attention_int8", "vllm_paged_attention_mix"):
        assert getattr(flashserve, name) is getattr(ixf, name)


def _opcheck(name, args):
    op = getattr(torch.ops.flashserve, name).default
    result = torch.library.opcheck(op, args, {})
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("k8v8", [True, False], ids=["k8v8", "k8v16"])
def test_opcheck_int8_ops(rng, k8v8):
    """torch.library.opcheck of flashserve::quantize_int8, quantize_int8_static,
    reshape_and_cache_int8 and fork_varlen_fwd (schema and aliasing, fake tensors, AOT dispatch)."""
    s = fork_step(rng, "cpu", k8v8, torch.float16)
    c = s["c"]
    x = s["query"]
    for transpose in (False, True):
        T, H = x.shape[:2]
        _opcheck("quantize_int8", (x, torch.empty(x.shape, dtype=torch.int8),
                                   torch.empty((H, T) if transpose else (T, H)), transpose))
    for compute in (False, True):  # mode 0, given and computed scales
        _opcheck("quantize_int8_static", (x, torch.rand(x.shape[1:]) + 0.01,
                                          torch.empty(x.shape, dtype=torch.int8), compute))
    i8_key, key_scale = ixf.scaled_int8_quant_for_attn(s["key"], 2)
    value = (ixf.scaled_int8_quant_for_attn(s["value"], 0, scale=c.value_scale)[0] if k8v8 else s["value"])
    value_cache = c.value_cache if k8v8 else c.value_cache.clone()  # opcheck clones inputs: no dtype views
    _opcheck("reshape_and_cache_int8", (i8_key, value, c.key_cache, value_cache, c.key_scale_cache.nan_to_num(0.0),
                                        key_scale, s["slots"], "int8_k8v8" if k8v8 else "int8_k8v16"))
    q, qs = ixf.scaled_int8_quant_for_attn(x, 2, transpose_scale=True)
    ksc = c.key_scale_cache.nan_to_num(1.0)
    out = torch.zeros(x.shape, dtype=torch.float16)
    _opcheck("fork_varlen_fwd", (q, c.key_cache, value_cache if not k8v8 else c.value_cache, out, s["cu_q"],
                                 max(s["q_lens"]), 4096, None, s["cu_k"], None, s["block_table"], True, 0.1, True,
                                 -1, -1, 0.0, None, False, None, None, None, None, qs.t(), ksc, c.value_scale))


@pytest.mark.parametrize("device", DEVICES)
def test_fork_reshape_and_cache_flash_hnd_and_encoder_call(rng, device):
    """quant_type 0's ops.reshape_and_cache_flash into the fork's HND caches, then the fork's
    flash_attn_varlen_func over contiguous q/k/v (its encoder call) and over the paged cache."""
    g = gen(rng)
    H_kv, H, D, bs, nb = 2, 4, 32, 16, 5
    dtype = torch.float16
    kv = torch.full((2, nb, H_kv, bs, D), NAN, dtype=dtype, device=device)
    key_cache, value_cache = kv.unbind(0)
    T = int(rng.integers(1, 2 * bs))
    slots = torch.randperm(nb * bs, generator=g)[:T].to(device)
    key, value = randn(g, T, H_kv, D, dtype=dtype, device=device), randn(g, T, H_kv, D, dtype=dtype, device=device)
    one = torch.tensor(1.0, device=device)
    ixf.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", one, one)
    b, o = slots // bs, slots % bs
    assert torch.equal(key_cache[b, :, o], key) and torch.equal(value_cache[b, :, o], value)
    assert int(kv.isnan().sum()) == 2 * (nb * bs - T) * H_kv * D
    q = randn(g, T, H, D, dtype=dtype, device=device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    out = ixf.flash_attn_varlen_func(q=q, k=key, v=value, out=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=T, max_seqlen_k=T, softmax_scale=0.2, causal=False)
    want, _ = attention_ref(q, key, value, scale=0.2)
    torch.testing.assert_close(out.double(), want.double(), atol=4e-3, rtol=4e-3)
    # the paged cache as one sequence over every block, in block-table order
    kv.nan_to_num_(0.0)
    table = torch.arange(nb, dtype=torch.int32, device=device)[None]
    full_k = key_cache.permute(0, 2, 1, 3).reshape(nb * bs, H_kv, D)
    full_v = value_cache.permute(0, 2, 1, 3).reshape(nb * bs, H_kv, D)
    cu_k = torch.tensor([0, nb * bs], dtype=torch.int32, device=device)
    out2, lse = ixf.flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, cu_seqlens_q=cu, cu_seqlens_k=cu_k,
                                           max_seqlen_q=T, max_seqlen_k=1, softmax_scale=0.2, causal=False,
                                           block_table=table, return_softmax_lse=True)
    want2, want_lse = attention_ref(q, full_k, full_v, scale=0.2)
    torch.testing.assert_close(out2.double(), want2.double(), atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


def test_fa_utils_queries():
    assert ixf.is_flash_attn_varlen_func_available() and ixf.flash_attn_supports_sinks()
    assert ixf.flash_attn_supports_fp8()
    assert ixf.get_flash_attn_version() == 2 and ixf.get_flash_attn_version(requires_alibi=True, head_size=128) == 2
    assert ixf.get_flash_attn_version(head_size=12) is None
    assert ixf.get_scheduler_metadata is flashserve.get_scheduler_metadata


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["inference_mode", "compile", "cuda_graph"])
def test_fork_float_and_mix_calls_inference_mode_compile_graph(rng, device, how):
    """The rest of the fork's calls in one step: ops.reshape_and_cache_flash into HND caches,
    flash_attn_varlen_func (sinks, sqrt_alibi, lse) and flash_attn_with_kvcache
    (cu_query_lens) merged by merge_attn_states, and the K8V16 decode vllm_paged_attention_mix
    with its fused write; equal to eager under inference_mode, torch.compile(fullgraph=True)
    and CUDA-graph capture."""
    if how == "cuda_graph" and device != "cuda":
        pytest.skip("CUDA-graph capture needs CUDA")
    g = gen(rng)
    dtype = torch.float16
    s = fork_step(rng, device, False, dtype, q_hi=3)
    H_kv, H, D, bs = s["H_kv"], s["H"], s["D"], s["bs"]
    nb = s["c"].key_cache.shape[0]
    kv16 = randn(g, 2, nb, H_kv, bs, D, dtype=dtype, device=device)
    sinks = randn(g, H, device=device)
    alibi = slopes(g, H, device).to(device)
    seq_lens = torch.tensor(s["k_lens"], dtype=torch.int32, device=device)
    one = torch.tensor(1.0, device=device)
    max_q = max(s["q_lens"])

    def step(kv16, c_key, c_val, c_ksc, query, key, value, out, out2):
        key_cache, value_cache = kv16.unbind(0)
        ixf.reshape_and_cache_flash(key, value, key_cache, value_cache, s["slots"], "auto", one, one)
        a, la = ixf.flash_attn_varlen_func(q=query, k=key_cache, v=value_cache, cu_seqlens_q=s["cu_q"],
                                           cu_seqlens_k=s["cu_k"], max_seqlen_q=max_q, max_seqlen_k=max_q,
                                           softmax_scale=0.1, causal=True, alibi_slopes=alibi, sqrt_alibi=True,
                                           sinks=sinks, block_table=s["block_table"], return_softmax_lse=True)
        b = ixf.flash_attn_with_kvcache(q=query.unsqueeze(1), k_cache=key_cache, v_cache=value_cache,
                                        block_table=s["block_table"], cache_seqlens=seq_lens, max_query_len=max_q,
                                        cu_query_lens=s["cu_q"], softmax_scale=0.1, causal=True, softcap=20.0,
                                        use_sqrt_alibi=False, use_cuda_graph=True,
                                        max_context_len=max(s["k_lens"])).squeeze(1)
        ixf.merge_attn_states(a, la, b, la, out)
        int8_query, query_scale = ixf.scaled_int8_quant_for_attn(query, 2, transpose_scale=False)
        i8_key, key_scale = ixf.scaled_int8_quant_for_attn(key, 2, transpose_scale=False)
        ixf.vllm_paged_attention_mix(output=out2, query=int8_query, key_cache=c_key, query_scale=query_scale,
                                     key_scale_cache=c_ksc, num_kv_heads=H_kv, scale=0.1,
                                     block_tables=s["block_table"], context_lens=seq_lens, block_size=bs,
                                     softcap=0.0, alibi_slopes=alibi, causal=True, window_left=-1, window_right=-1,
                                     use_sqrt_alibi=True, use_cuda_graph=True, max_context_len=max(s["k_lens"]),
                                     cu_query_lens=s["cu_q"], max_query_len=max_q, value_cache=c_val,
                                     save_key=i8_key, save_value=value.contiguous(), save_key_scale=key_scale)
        return out, out2

    def fresh():
        c = _clone_caches(s["c"], own_values=True)
        return [kv16.clone(), c.key_cache, c.value_cache, c.key_scale_cache, s["query"], s["key"], s["value"],
                torch.full_like(s["query"], NAN), torch.full_like(s["query"], NAN)]

    eager_args = fresh()
    eager = step(*eager_args)
    assert not eager[0].isnan().any() and not eager[1].isnan().any()
    args = fresh()
    if how == "inference_mode":
        with torch.inference_mode():
            got = step(*args)
    elif how == "compile":
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(*args)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*fresh())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step(*args)
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    for a, b in zip(args[:4], eager_args[:4]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fork_float_calls_bad_inputs():
    q = torch.randn(3, 4, 32, dtype=torch.float16)
    kv = torch.randn(2, 4, 2, 16, 32, dtype=torch.float16)
    k, v = kv.unbind(0)
    table = torch.zeros(3, 2, dtype=torch.int32)
    lens = torch.full((3,), 5, dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)
    out = torch.full((3, 1, 4, 32), NAN, dtype=torch.float16)
    ok = dict(q=q.unsqueeze(1), k_cache=k, v_cache=v, block_table=table, cache_seqlens=lens, out=out)
    for change, name, exc in ((dict(cache_seqlens=None), "cache_seqlens", ValueError),
                              (dict(block_table=None), "block_table", NotImplementedError),
                              (dict(cache_seqlens=lens.long()), "cache_seqlens", ValueError),
                              (dict(cu_query_lens=cu.long()), "cu_query_lens", ValueError),
                              (dict(use_sqrt_alibi=1), "use_sqrt_alibi", ValueError),
                              (dict(sinks=torch.zeros(4), s_aux=torch.zeros(4)), "sinks", ValueError),
                              (dict(k=q), "k", NotImplementedError)):
        with pytest.raises(exc, match=f"^{name}:"):
            ixf.flash_attn_with_kvcache(**{**ok, **change})
    assert out.isnan().all()
    with pytest.raises(NotImplementedError, match="^q_v:"):
        ixf.flash_attn_varlen_func(q, k, v, 1, cu, 1, block_table=table, q_v=q)
    with pytest.raises(ValueError, match="^sqrt_alibi:"):
        ixf.flash_attn_varlen_func(q, k, v, 1, cu, 1, block_table=table, seqused_k=lens, sqrt_alibi="yes")
    with pytest.raises(ValueError, match="^key_cache:"):
        ixf.reshape_and_cache_flash(q, q, k[0], v, torch.zeros(3, dtype=torch.int64), "auto", None, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k8v8", [True, False], ids=["k8v8", "k8v16"])
def test_flash_attn_varlen_int8_func_contiguous_kv(rng, device, k8v8):
    """Without block_table: int8 k [total_k, H_kv, D] with k_scale [total_k, H_kv] (the
    quantizer's layout), v int8 with its static scale or 16-bit."""
    g = gen(rng)
    H_kv, H, D, B = 2, 4, 64, int(rng.integers(1, 4))
    q_lens = [int(rng.integers(1, 8)) for _ in range(B)]
    k_lens = [q + int(rng.integers(0, 20)) for q in q_lens]
    dtype = torch.bfloat16
    query = randn(g, sum(q_lens), H, D, dtype=dtype, device=device)
    key = randn(g, sum(k_lens), H_kv, D, dtype=dtype, device=device)
    value = randn(g, sum(k_lens), H_kv, D, dtype=dtype, device=device)
    q, qs = ixf.scaled_int8_quant_for_attn(query, 2, transpose_scale=True)
    k, ks = ixf.scaled_int8_quant_for_attn(key, 2)
    vs = (torch.rand(H_kv, D, generator=g) * 0.02 + 0.01).to(device) if k8v8 else None
    v = ixf.scaled_int8_quant_for_attn(value, 0, scale=vs)[0] if k8v8 else value
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32, device=device)
    out = ixf.flash_attn_varlen_int8_func(q, k, v, qs, ks, vs, cu_q, cu_k, max(q_lens), max(k_lens),
                                          softmax_scale=0.1, causal=True)
    assert out.dtype == (torch.float16 if k8v8 else dtype)
    qd = q.double() * qs.t().double()[..., None]
    kd = k.double() * ks.double()[..., None]
    vd = v.double() * vs.double()[None] if k8v8 else v.double()
    want = torch.zeros(out.shape, dtype=torch.float64, device=device)
    for (qa, qb), (ka, kb) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        want[qa:qb] = attention_ref(qd[qa:qb], kd[ka:kb], vd[ka:kb], scale=0.1, causal=True)[0].double()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
