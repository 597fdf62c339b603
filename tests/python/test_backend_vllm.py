"""FlashServeImpl / FlashServeBackend as vLLM's v1 backend and its int8 fork drive them: the
capability queries vLLM asks, fp8 queries descaled by the layer's _q_scale (per tensor and per
KV head) over fp8 caches with per-head scales, the fork's int8 K8V8 / K8V16 caches in its
(2|3, num_blocks, H_kv, block_size, D) shape with its kv_cache_scale, sqrt-ALiBi, the cache
write split from the forward (do_kv_cache_update), and caches whose shape fits two layouts
(H_kv == block_size): read in the declared one, rejected when their strides say the other.

Each step writes its context through do_kv_cache_update, then runs the forward (which writes
the new tokens, or not when the engine updates the cache itself); the reference reads the
cache back with its own dequantization (fp64 attention over what the cache holds) and the new
tokens' slots are compared bit for bit with their expected quantization. Outputs start NaN.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from flashserve.backend import (AttentionCGSupport, CommonAttentionMetadata,  # noqa: E402
                                FlashServeBackend, FlashServeEngineConfig, FlashServeImpl,
                                FlashServeKVCacheSpec, FlashServeMetadataBuilder, MultipleOf)
from helpers_torch import DEVICES, Case, check_bits, check_close, check_out, poisoned  # noqa: E402
from torch_reference import attention_ref  # noqa: E402

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


@pytest.fixture
def case(request):
    return Case(request)


# ---------------------------------------------------------------- one step over a fork-style cache

@dataclass
class Cfg:
    device: str
    cache_dtype: str = "auto"      # auto, fp8, int8 (K8V8), int8_k8v16
    shape_layout: str = "NHD"      # get_kv_cache_shape's dims order: vLLM's NHD or the fork's HND
    layout: str = "NHD"            # physical layout
    heads: int = 8
    heads_kv: int = 4
    head_size: int = 64
    block_size: int = 4            # == heads_kv: the shape alone does not tell the layouts apart
    per_head: bool = False         # fp8 scales per KV head
    fp8_query: bool = False
    forward_writes: bool = True    # False: the engine calls do_kv_cache_update for the new tokens


@dataclass
class Run:
    cfg: Cfg
    q_lens: list
    seq_lens: list
    tables: list = field(default_factory=list)
    kv_cache: object = None
    layer: object = None
    keys: list = field(default_factory=list)     # per request [seq, H_kv, D] bf16 (inputs)
    values: list = field(default_factory=list)
    q: object = None
    common: object = None
    new_slots: object = None


def allocate(case: Case, cfg: Cfg, num_blocks: int):
    """get_kv_cache_shape permuted by the stride order, as engines allocate; garbage content."""
    saved = FlashServeBackend.kv_cache_layout, FlashServeBackend.kv_cache_shape_layout
    FlashServeBackend.kv_cache_layout, FlashServeBackend.kv_cache_shape_layout = cfg.layout, cfg.shape_layout
    try:
        shape = FlashServeBackend.get_kv_cache_shape(num_blocks, cfg.block_size, cfg.heads_kv, cfg.head_size,
                                                     cache_dtype_str=cfg.cache_dtype)
        order = FlashServeBackend.get_kv_cache_stride_order()
    finally:
        FlashServeBackend.kv_cache_layout, FlashServeBackend.kv_cache_shape_layout = saved
    physical = [shape[i] for i in order]
    if cfg.cache_dtype == "fp8":
        raw = torch.randint(0, 0x7F, physical, generator=case.gen, dtype=torch.uint8)
    elif cfg.cache_dtype.startswith("int8"):
        raw = torch.randint(-127, 128, physical, generator=case.gen, dtype=torch.int8)
    else:
        raw = (torch.randn(physical, generator=case.gen) * 3).to(BF16)
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return raw.to(cfg.device).permute(*inverse)


def cache_planes(cfg: Cfg, kv_cache):
    """(key_cache, value_cache) in get_kv_cache_shape's logical dims (the test's own reading)."""
    if cfg.cache_dtype != "int8_k8v16":
        return kv_cache[0], kv_cache[1]
    hnd_view = cfg.shape_layout == "NHD" and cfg.layout == "HND"
    phys = kv_cache.transpose(2, 3) if hnd_view else kv_cache
    values = phys[1:].view(BF16).reshape(phys[0].shape)
    return kv_cache[0], values.transpose(1, 2) if hnd_view else values


def at_slots(cfg: Cfg, t, slots):
    """Rows [n, H_kv, ...] of a per-block tensor at token slots."""
    blk, off = slots // cfg.block_size, slots % cfg.block_size
    return t[blk, :, off] if cfg.shape_layout == "HND" else t[blk, off]


def make_layer(case: Case, cfg: Cfg, num_blocks: int, all_values):
    """The layer's scales as vLLM / the fork keep them."""
    dev, hk = cfg.device, cfg.heads_kv
    def scale(lo, hi):
        if cfg.per_head:
            return (torch.rand(hk, generator=case.gen) * (hi - lo) + lo).to(dev)
        return torch.tensor(lo + (hi - lo) * case.rng.random()).to(dev)
    layer = types.SimpleNamespace(_k_scale=scale(0.02, 0.04), _v_scale=scale(0.02, 0.04),
                                  _q_scale=scale(0.01, 0.03))
    if cfg.cache_dtype.startswith("int8"):
        k_scale_cache = (torch.rand(num_blocks, hk, cfg.block_size, generator=case.gen) + 0.5).to(dev)
        if cfg.cache_dtype == "int8":  # static per (head, channel), calibrated on the values
            v_scale = (torch.cat(all_values).float().abs().amax(0) / 127).clamp_min(1e-3).to(dev)
            layer.kv_cache_scale = [k_scale_cache, v_scale]
        else:
            layer.kv_cache_scale = k_scale_cache
    return layer


def quant_int8(x):
    """Dynamic per-(token, head) int8: scale = absmax / 127, ties to even."""
    amax = x.float().abs().amax(-1, keepdim=True)
    # A tensor divisor: torch divides by a Python scalar through its reciprocal on CUDA (off by
    # an ulp from absmax / 127, which the library rounds correctly on both devices).
    s = amax / torch.full_like(amax, 127.0)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x.float() / s).clamp(-127, 127).to(torch.int8), s


def per_kv_head(cfg: Cfg, s):
    """A [] or [H_kv] scale broadcast over [n, H_kv, D]."""
    return s.float().reshape(-1, 1) if s.dim() == 1 else s.float()


def stored(cfg: Cfg, layer, key, value):
    """key/value [n, H_kv, D] as the cache format stores them (and int8 key scales)."""
    if cfg.cache_dtype == "fp8":
        return ((key.float() / per_kv_head(cfg, layer._k_scale)).to(FP8).view(torch.uint8),
                (value.float() / per_kv_head(cfg, layer._v_scale)).to(FP8).view(torch.uint8), None)
    if cfg.cache_dtype.startswith("int8"):
        k8, ks = quant_int8(key)
        if cfg.cache_dtype == "int8":
            v_scale = layer.kv_cache_scale[1]
            v = torch.round(value.float() / v_scale).clamp(-127, 127).to(torch.int8)
        else:
            v = value
        return k8, v, ks[..., 0]
    return key, value, None


def read_back(cfg: Cfg, run: Run, r: int):
    """What the cache holds for request r's tokens, dequantized (fp32)."""
    key_cache, value_cache = cache_planes(cfg, run.kv_cache)
    seq = run.seq_lens[r]
    pos = torch.arange(seq)
    slots = (torch.tensor(run.tables[r])[pos // cfg.block_size] * cfg.block_size
             + pos % cfg.block_size).to(cfg.device)
    k, v = at_slots(cfg, key_cache, slots), at_slots(cfg, value_cache, slots)
    layer = run.layer
    if cfg.cache_dtype == "fp8":
        return (k.view(FP8).float() * per_kv_head(cfg, layer._k_scale),
                v.view(FP8).float() * per_kv_head(cfg, layer._v_scale))
    if cfg.cache_dtype.startswith("int8"):
        ksc = layer.kv_cache_scale[0] if cfg.cache_dtype == "int8" else layer.kv_cache_scale
        blk, off = slots // cfg.block_size, slots % cfg.block_size
        kd = k.float() * ksc[blk, :, off][..., None]
        vd = v.float() * layer.kv_cache_scale[1] if cfg.cache_dtype == "int8" else v.float()
        return kd, vd
    return k.float(), v.float()


def query_read(cfg: Cfg, run: Run):
    """The query as attention reads it."""
    q = run.q
    if cfg.fp8_query:
        group = cfg.heads // cfg.heads_kv
        s = run.layer._q_scale.float()
        s = s.repeat_interleave(group).reshape(-1, 1) if s.dim() == 1 else s
        return q.float() * s
    if cfg.cache_dtype.startswith("int8"):
        q8, s = quant_int8(q)
        return q8.float() * s
    return q.float()


def make_run(case: Case, cfg: Cfg, decodes: int = 2, prefills: int = 2) -> tuple[Run, FlashServeImpl, object]:
    """The batch, the cache with every request's context written through do_kv_cache_update,
    the impl and the builder."""
    q_lens = [1] * decodes + [case.rng.randint(2, 12) for _ in range(prefills)]
    seq_lens = [q + case.rng.randint(0, 40) for q in q_lens]
    run = Run(cfg, q_lens, seq_lens)
    bs, dev = cfg.block_size, cfg.device
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 2
    run.kv_cache = allocate(case, cfg, num_blocks)
    ids = case.perm(num_blocks)
    for n in need:
        run.tables.append(ids[:n])
        ids = ids[n:]
    run.keys = [case.randn(n, cfg.heads_kv, cfg.head_size, dtype=BF16, device=dev) for n in seq_lens]
    run.values = [case.randn(n, cfg.heads_kv, cfg.head_size, dtype=BF16, device=dev) for n in seq_lens]
    run.layer = make_layer(case, cfg, num_blocks, run.values)

    def slots(r, first, end):
        pos = torch.arange(first, end)
        return (torch.tensor(run.tables[r], dtype=torch.int64)[pos // bs] * bs + pos % bs).to(dev)

    impl = FlashServeImpl(cfg.heads, cfg.head_size, cfg.head_size ** -0.5, cfg.heads_kv,
                          kv_cache_dtype=cfg.cache_dtype, kv_cache_layout=cfg.layout,
                          kv_cache_shape_layout=cfg.shape_layout, dtype=BF16,
                          forward_includes_kv_cache_update=cfg.forward_writes)
    ctx = [(r, 0, s - q) for r, (q, s) in enumerate(zip(q_lens, seq_lens))]
    new = [(r, s - q, s) for r, (q, s) in enumerate(zip(q_lens, seq_lens))]
    ctx_slots = torch.cat([slots(*c) for c in ctx])
    impl.do_kv_cache_update(run.layer, torch.cat([run.keys[r][a:b] for r, a, b in ctx]),
                            torch.cat([run.values[r][a:b] for r, a, b in ctx]), run.kv_cache, ctx_slots)
    run.new_slots = torch.cat([slots(*n) for n in new])
    run.key = torch.cat([run.keys[r][a:b] for r, a, b in new])
    run.value = torch.cat([run.values[r][a:b] for r, a, b in new])
    t = sum(q_lens)
    q = case.randn(t, cfg.heads, cfg.head_size, dtype=BF16, device=dev)
    if cfg.fp8_query:
        group = cfg.heads // cfg.heads_kv
        s = run.layer._q_scale.float()
        s = s.repeat_interleave(group).reshape(-1, 1) if s.dim() == 1 else s
        q = (q.float() / s).to(FP8)
    run.q = q
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    table = torch.zeros(len(q_lens) + 1, max(need) + 2, dtype=torch.int32)
    for r, row in enumerate(run.tables):
        table[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
    qsl, sl = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    run.common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=sl.to(dev), seq_lens_cpu=sl,
        num_reqs=len(q_lens), num_actual_tokens=t, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table.to(dev), slot_mapping=run.new_slots)
    spec = FlashServeKVCacheSpec(block_size=bs, num_kv_heads=cfg.heads_kv, head_size=cfg.head_size, dtype=BF16,
                                 kv_cache_dtype=cfg.cache_dtype)
    config = FlashServeEngineConfig(num_heads=cfg.heads, max_num_seqs=16, max_num_batched_tokens=256,
                                    max_model_len=256)
    builder = FlashServeMetadataBuilder(spec, ["model.layers.0.attn"], config, dev)
    return run, impl, builder


def reference(run: Run, **kw):
    cfg, q = run.cfg, query_read(run.cfg, run)
    out = torch.zeros(q.shape[0], cfg.heads, cfg.head_size, device=cfg.device)
    lo = 0
    for r, n in enumerate(run.q_lens):
        k, v = read_back(cfg, run, r)
        out[lo:lo + n] = attention_ref(q[lo:lo + n], k, v, scale=cfg.head_size ** -0.5, causal=True, **kw)[0]
        lo += n
    return out


def check_new_tokens(case: Case, run: Run):
    """The new tokens' slots hold key/value as the format stores them (int8: and their scales)."""
    cfg = run.cfg
    key_cache, value_cache = cache_planes(cfg, run.kv_cache)
    k_exp, v_exp, ks_exp = stored(cfg, run.layer, run.key, run.value)
    check_bits(case, "key_cache", at_slots(cfg, key_cache, run.new_slots), k_exp)
    check_bits(case, "value_cache", at_slots(cfg, value_cache, run.new_slots), v_exp)
    if ks_exp is not None:
        ksc = run.layer.kv_cache_scale[0] if cfg.cache_dtype == "int8" else run.layer.kv_cache_scale
        blk, off = run.new_slots // cfg.block_size, run.new_slots % cfg.block_size
        check_bits(case, "key_scale_cache", ksc[blk, :, off], ks_exp)


def step(case: Case, cfg: Cfg, **forward_kw):
    run, impl, builder = make_run(case, cfg)
    case.desc = f"{cfg} q_lens={run.q_lens} seq_lens={run.seq_lens}"
    md = builder.build(0, run.common)
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, cfg.device)
    if not cfg.forward_writes:
        impl.do_kv_cache_update(run.layer, run.key, run.value, run.kv_cache, run.new_slots)
    if case.call(impl.forward, run.layer, run.q, run.key, run.value, run.kv_cache, md, out, **forward_kw) is None:
        return None, None
    return run, out


# ---------------------------------------------------------------- forwards

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", ["int8", "int8_k8v16"])
@pytest.mark.parametrize("scales_from", ["forward", "layer"])
@pytest.mark.parametrize("shape_layout,layout", [("HND", "HND"), ("NHD", "NHD"), ("NHD", "HND")])
def test_int8_caches(case, device, cache_dtype, scales_from, shape_layout, layout):
    """int8 K8V8 / K8V16 caches, the fork's (2|3, num_blocks, H_kv, block_size, D) shape order
    or vLLM's, with H_kv == block_size; scales from forward's kv_cache_scale or the layer's."""
    cfg = Cfg(device, cache_dtype=cache_dtype, shape_layout=shape_layout, layout=layout)
    run, impl, builder = make_run(case, cfg)
    case.desc = f"{cache_dtype} {shape_layout}/{layout} q_lens={run.q_lens} seq_lens={run.seq_lens}"
    assert run.kv_cache.shape == (2 if cache_dtype == "int8" else 3, run.kv_cache.shape[1], 4, 4, 64)
    md = builder.build(0, run.common)
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, device)
    kw = {}
    if scales_from == "forward":
        kw["kv_cache_scale"] = run.layer.kv_cache_scale
        del run.layer.kv_cache_scale
    if case.call(impl.forward, run.layer, run.q, run.key, run.value, run.kv_cache, md, out, **kw) is not None:
        if scales_from == "forward":
            run.layer.kv_cache_scale = kw["kv_cache_scale"]
        check_out(case, "output", out, reference(run), max(run.seq_lens))
        check_new_tokens(case, run)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape_layout,layout", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "HND")])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_query_and_cache_scales(case, device, shape_layout, layout, per_head):
    """fp8 q descaled by layer._q_scale, fp8 caches with _k_scale / _v_scale, per tensor or
    per KV head ([H_kv])."""
    cfg = Cfg(device, cache_dtype="fp8", shape_layout=shape_layout, layout=layout, per_head=per_head,
              fp8_query=True)
    run, out = step(case, cfg)
    if run is not None:
        check_out(case, "output", out, reference(run), max(run.seq_lens))
        check_new_tokens(case, run)
    case.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape_layout,layout", [("NHD", "HND"), ("HND", "HND")])
def test_sqrt_alibi(case, device, shape_layout, layout):
    """The fork's sqrt_alibi forward flag (and use_sqrt_alibi as the layer's default)."""
    cfg = Cfg(device, shape_layout=shape_layout, layout=layout)
    run, impl, builder = make_run(case, cfg)
    slopes = [2.0 ** (-(h + 1) / 2) for h in range(cfg.heads)]
    impl = FlashServeImpl(cfg.heads, cfg.head_size, cfg.head_size ** -0.5, cfg.heads_kv, alibi_slopes=slopes,
                          kv_cache_layout=layout, kv_cache_shape_layout=shape_layout, dtype=BF16)
    case.desc = f"q_lens={run.q_lens} seq_lens={run.seq_lens}"
    alibi = torch.tensor(slopes, device=device)
    for sqrt in (True, False):
        md = builder.build(0, run.common)
        out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, device)
        impl.forward(run.layer, run.q, run.key, run.value, run.kv_cache, md, out, sqrt_alibi=sqrt)
        check_out(case, f"output sqrt_alibi={sqrt}", out, reference(run, alibi=alibi, alibi_sqrt=sqrt),
                  max(run.seq_lens))
    default_sqrt = FlashServeImpl(cfg.heads, cfg.head_size, cfg.head_size ** -0.5, cfg.heads_kv,
                                  alibi_slopes=slopes, kv_cache_layout=layout, kv_cache_shape_layout=shape_layout,
                                  dtype=BF16, use_sqrt_alibi=True)
    md = builder.build(0, run.common)
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, device)
    default_sqrt.forward(run.layer, run.q, run.key, run.value, run.kv_cache, md, out)
    check_out(case, "output use_sqrt_alibi", out, reference(run, alibi=alibi, alibi_sqrt=True), max(run.seq_lens))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "int8"])
def test_cache_update_split_from_forward(case, device, cache_dtype):
    """forward_includes_kv_cache_update=False: the forward writes nothing (the cache keeps its
    bytes without do_kv_cache_update), and reads what do_kv_cache_update wrote."""
    shape_layout = "HND" if cache_dtype == "int8" else "NHD"
    cfg = Cfg(device, cache_dtype=cache_dtype, shape_layout=shape_layout, layout="HND", forward_writes=False)
    run, impl, builder = make_run(case, cfg)
    case.desc = f"{cache_dtype} q_lens={run.q_lens} seq_lens={run.seq_lens}"
    before = run.kv_cache.clone()
    md = builder.build(0, run.common)
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, device)
    if case.call(impl.forward, run.layer, run.q, run.key, run.value, run.kv_cache, md, out) is None:
        return case.done()
    check_bits(case, "kv_cache after a forward that does not write", run.kv_cache, before)
    writing = FlashServeImpl(cfg.heads, cfg.head_size, cfg.head_size ** -0.5, cfg.heads_kv,
                             kv_cache_dtype=cfg.cache_dtype, kv_cache_layout=cfg.layout,
                             kv_cache_shape_layout=cfg.shape_layout, dtype=BF16)
    md = builder.build(0, run.common)
    writing.forward(run.layer, run.q, run.key, run.value, run.kv_cache, md, out, kv_cache_updated=True)
    check_bits(case, "kv_cache after a forward told kv_cache_updated=True", run.kv_cache, before)
    impl.do_kv_cache_update(run.layer, run.key, run.value, run.kv_cache, run.new_slots)
    check_new_tokens(case, run)
    md = builder.build(0, run.common)
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, device)
    impl.forward(run.layer, run.q, run.key, run.value, run.kv_cache, md, out)
    check_out(case, "output", out, reference(run), max(run.seq_lens))
    case.done()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given,declared", [
    (("HND", "HND"), ("NHD", "HND")),   # the fork's cache to a vLLM HND layer
    (("NHD", "HND"), ("HND", "HND")),   # a vLLM HND cache to a fork layer
    (("NHD", "HND"), ("NHD", "NHD")),   # a vLLM HND cache to a vLLM NHD layer
])
def test_ambiguous_shape_read_by_declared_layout(case, device, given, declared):
    """H_kv == block_size: the given cache has the declared shape, but its strides say the other
    layout: rejected naming kv_cache, before anything is written."""
    cfg = Cfg(device, shape_layout=given[0], layout=given[1])
    run, _, builder = make_run(case, cfg)
    impl = FlashServeImpl(cfg.heads, cfg.head_size, cfg.head_size ** -0.5, cfg.heads_kv,
                          kv_cache_shape_layout=declared[0], kv_cache_layout=declared[1], dtype=BF16)
    case.desc = f"given {given} declared {declared} shape {tuple(run.kv_cache.shape)}"
    before = run.kv_cache.clone()
    md = builder.build(0, run.common)
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, device)
    with pytest.raises(ValueError, match="kv_cache: expected the declared"):
        impl.forward(run.layer, run.q, run.key, run.value, run.kv_cache, md, out)
    with pytest.raises(ValueError, match="kv_cache: expected the declared"):
        impl.do_kv_cache_update(run.layer, run.key, run.value, run.kv_cache, run.new_slots)
    check_bits(case, "kv_cache after rejected calls", run.kv_cache, before)
    assert torch.isnan(out.float()).all(), case.where()


# ---------------------------------------------------------------- bad arguments

def test_bad_scales_and_sinks_raise_naming_them(case):
    cfg = Cfg("cpu", cache_dtype="fp8", fp8_query=True)
    run, impl, builder = make_run(case, cfg)
    before = run.kv_cache.clone()
    out = poisoned((sum(run.q_lens), cfg.heads, cfg.head_size), BF16, "cpu")
    run.layer._q_scale = torch.ones(3)
    with pytest.raises(ValueError, match="q_descale"):
        impl.forward(run.layer, run.q, run.key, run.value, run.kv_cache, builder.build(0, run.common), out)
    check_bits(case, "kv_cache after a rejected forward", run.kv_cache, before)

    cfg8 = Cfg("cpu", cache_dtype="int8", shape_layout="HND", layout="HND")
    run8, impl8, builder8 = make_run(case, cfg8)
    del run8.layer.kv_cache_scale
    with pytest.raises(ValueError, match="kv_cache_scale"):
        impl8.forward(run8.layer, run8.q, run8.key, run8.value, run8.kv_cache, builder8.build(0, run8.common),
                      poisoned((sum(run8.q_lens), 8, 64), BF16, "cpu"))
    with pytest.raises(ValueError, match="sinks"):
        FlashServeImpl(8, 64, 0.125, 4, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="sqrt_alibi"):
        impl.forward(run.layer, run.q, run.key, run.value, run.kv_cache, builder.build(0, run.common), out,
                     sqrt_alibi="yes")
    with pytest.raises(ValueError, match="kv_cache_layout"):
        FlashServeImpl(8, 64, 0.125, 4, kv_cache_shape_layout="HND", kv_cache_layout="NHD")
    with pytest.raises(ValueError, match="kv_cache: expected \\[3, num_blocks"):
        FlashServeImpl(8, 64, 0.125, 4, kv_cache_dtype="int8_k8v16", dtype=BF16).do_kv_cache_update(
            run.layer, run.key, run.value, torch.zeros(2, 4, 4, 4, 64, dtype=torch.int8), run.new_slots)


# ---------------------------------------------------------------- what vLLM asks the classes

def test_vllm_capability_queries():
    B = FlashServeBackend
    assert B.get_supported_kernel_block_sizes() == [MultipleOf(1)]
    assert B.supports_per_head_quant_scales() is True
    assert FlashServeImpl.supports_quant_query_input and FlashServeImpl.supports_per_head_quant_scales
    assert B.supports_combination(128, BF16, "auto", 16, False, True, False, (9, 0)) is None
    assert B.supports_combination(128, torch.float16, "int8_k8v16", 1, False, False, False, (8, 0)) is None
    assert "sparse" in B.supports_combination(128, BF16, "auto", 16, False, False, True, (9, 0))
    assert "MLA" in B.supports_combination(576, BF16, "auto", 16, True, False, False, (9, 0))
    assert "kv_cache_dtype" in B.supports_combination(128, BF16, "fp4", 16, False, False, False, (9, 0))
    assert "compute capability" in B.supports_combination(128, BF16, "auto", 16, False, False, False, (7, 5))
    assert "head size" in B.supports_combination(20, BF16, "auto", 16, False, False, False, (9, 0))
    assert "dtype" in B.supports_combination(128, torch.float32, "auto", 16, False, False, False, (9, 0))
    assert B.validate_configuration(128, BF16, "auto", 16, False, False, False, (9, 0)) == []
    assert B.validate_configuration(128, BF16, "auto", 16, False, False, True, (9, 0)) == [
        "sparse attention: not implemented"]
    assert B.is_sparse() is False and B.get_required_kv_cache_layout() is None
    assert FlashServeMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH
    assert AttentionCGSupport.UNIFORM_BATCH.name == "UNIFORM_BATCH"


@pytest.mark.parametrize("layers", [False, True])
def test_fork_cache_shape_and_stride_order(layers):
    """The fork's shape order: (2|3, num_blocks, H_kv, block_size, D), already physical."""
    saved = FlashServeBackend.kv_cache_layout, FlashServeBackend.kv_cache_shape_layout
    FlashServeBackend.kv_cache_layout, FlashServeBackend.kv_cache_shape_layout = "HND", "HND"
    try:
        assert FlashServeBackend.get_kv_cache_shape(10, 16, 4, 64) == (2, 10, 4, 16, 64)
        assert FlashServeBackend.get_kv_cache_shape(10, 16, 4, 64, "int8_k8v16") == (3, 10, 4, 16, 64)
        assert FlashServeBackend.get_required_kv_cache_layout() == "HND"
        order = FlashServeBackend.get_kv_cache_stride_order(include_num_layers_dimension=layers)
        if not layers:
            assert order == (0, 1, 2, 3, 4)
        else:  # logical (L, 2, nb, H, bs, D) -> physical (nb, H, L, 2, bs, D), as vLLM's HND
            logical = ("L", "2", "nb", "H", "bs", "D")
            assert tuple(logical[i] for i in order) == ("nb", "H", "L", "2", "bs", "D")
        FlashServeBackend.kv_cache_layout = "NHD"
        with pytest.raises(ValueError, match="kv_cache_layout"):
            FlashServeBackend.get_kv_cache_stride_order()
    finally:
        FlashServeBackend.kv_cache_layout, FlashServeBackend.kv_cache_shape_layout = saved
    assert FlashServeBackend.get_kv_cache_shape(10, 16, 4, 64, "int8_k8v16") == (3, 10, 16, 4, 64)
