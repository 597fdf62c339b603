"""The backend classes (FlashServeBackend, FlashServeMetadataBuilder, FlashServeImpl) driven the
way an engine drives them, against the torch reference of torch_reference.py: a step of decodes
and prefills, cascade over a shared prefix, chunked local attention, sliding windows, sinks /
soft-cap / ALiBi, fp8 caches, HND caches, draft-tree verify, multi-step decode, another group's
block table; the capability methods, cache shape and stride order; bad arguments.

Caches are allocated as engines allocate them (get_kv_cache_shape permuted by the stride
order); an unowned block holds NaN and the unwritten rest finite garbage; outputs start NaN.
"""

from __future__ import annotations

import gc
import types
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from flashserve.backend import (AttentionType, CommonAttentionMetadata, DraftTree,
                                FlashServeBackend, FlashServeEngineConfig, FlashServeImpl,
                                FlashServeKVCacheSpec, FlashServeMetadata,
                                FlashServeMetadataBuilder, reorder_decodes_first)

try:
    import torch
    from helpers_torch import DEVICES, Case, check_bits, check_out, poisoned
    from torch_reference import attention_ref, quantize_fp8
    FP8 = torch.float8_e4m3fn
except ImportError:  # CI: the builder, capabilities and cache layout on numpy only
    torch = None
    DEVICES = ["cpu"]

needs_torch = pytest.mark.skipif(torch is None, reason="the layer forward takes torch tensors")


@pytest.fixture
def case(request):
    return Case(request)


def act_dtype(device: str):
    """fp32 on the CPU reference (tight tolerance); bf16 on CUDA (what the kernels serve)."""
    return torch.float32 if device == "cpu" else torch.bfloat16


# ---------------------------------------------------------------- one engine step

@dataclass
class Step:
    """A batch over a paged cache as an engine holds it (decode requests first)."""
    q_lens: list[int]
    seq_lens: list[int]
    device: str
    heads: int = 8
    heads_kv: int = 2
    head_size: int = 64
    block_size: int = 16
    cache_dtype: str = "auto"
    layout: str = "NHD"
    prefix: int = 0                          # tokens shared by every request (whole blocks)
    room: int = 0                            # tokens of blocks reserved past each sequence
    dtype: object = None
    keys: list = field(default_factory=list)    # per request [seq_len, H_kv, D]: what attention reads
    values: list = field(default_factory=list)
    tables: list = field(default_factory=list)  # per request its block ids
    kv_cache: object = None
    layer: object = None                     # carries _k_scale / _v_scale
    q: object = None
    key: object = None
    value: object = None
    common: CommonAttentionMetadata = None

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def starts(self) -> list[int]:
        out = [0]
        for n in self.q_lens:
            out.append(out[-1] + n)
        return out

    def slots(self, r: int, first: int, end: int) -> torch.Tensor:
        """Slots of positions [first, end) of request r."""
        pos = torch.arange(first, end)
        return torch.tensor(self.tables[r], dtype=torch.int64)[pos // self.block_size] * self.block_size \
            + pos % self.block_size


def allocate_cache(case: Case, num_blocks: int, s: Step) -> torch.Tensor:
    """get_kv_cache_shape permuted by the stride order (as engines allocate), finite garbage."""
    FlashServeBackend.kv_cache_layout = s.layout
    try:
        shape = FlashServeBackend.get_kv_cache_shape(num_blocks, s.block_size, s.heads_kv, s.head_size,
                                                     cache_dtype_str=s.cache_dtype)
        order = FlashServeBackend.get_kv_cache_stride_order()
    finally:
        FlashServeBackend.kv_cache_layout = "NHD"
    physical = [shape[i] for i in order]
    if s.cache_dtype == "fp8":  # bytes below 0x7f, the e4m3 NaN pattern
        raw = torch.randint(0, 0x7F, physical, generator=case.gen, dtype=torch.uint8)
    else:
        raw = (torch.randn(physical, generator=case.gen) * 3.0).to(s.dtype)
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return raw.to(s.device).permute(*inverse)


def stored(s: Step, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows x as the cache stores them (fp8 bytes for fp8 caches)."""
    if s.cache_dtype == "fp8":
        return quantize_fp8(x.float().cpu(), scale.cpu(), FP8).view(torch.uint8).to(s.device)
    return x.to(s.dtype).to(s.device)


def read_back(s: Step, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What attention reads for rows x (fp32 on the CPU)."""
    if s.cache_dtype == "fp8":
        return quantize_fp8(x, scale.cpu(), FP8).float() * scale.cpu()
    return x.float()


def make_step(case: Case, s: Step) -> Step:
    """The cache with every request's context, the new tokens as views of one fused
    projection, and the common metadata."""
    s.dtype = s.dtype or act_dtype(s.device)
    bs, nreq, prefix_blocks = s.block_size, len(s.q_lens), s.prefix // s.block_size
    need = [-(-(n + s.room) // bs) for n in s.seq_lens]
    num_blocks = prefix_blocks + sum(n - prefix_blocks for n in need) + 1
    s.kv_cache = allocate_cache(case, num_blocks, s)
    ids = case.perm(num_blocks)
    s.kv_cache[:, ids.pop()] = 0x7F if s.cache_dtype == "fp8" else float("nan")
    shared = ids[:prefix_blocks]
    ids = ids[prefix_blocks:]
    for n in need:
        s.tables.append(shared + ids[:n - prefix_blocks])
        ids = ids[n - prefix_blocks:]
    scale = torch.tensor(0.05 if s.cache_dtype == "fp8" else 1.0)
    s.layer = types.SimpleNamespace(_k_scale=scale.to(s.device), _v_scale=(scale * 0.8).to(s.device))
    rows = [[case.randn(n, s.heads_kv, s.head_size).to(s.dtype).float() for n in s.seq_lens] for _ in "kv"]
    for r in range(1, nreq):
        for part in rows:
            part[r][:s.prefix] = part[0][:s.prefix]
    key_cache, value_cache = s.kv_cache.unbind(0)
    for r, (q_len, seq) in enumerate(zip(s.q_lens, s.seq_lens)):
        ctx = s.slots(r, 0, seq - q_len).to(s.device)
        key_cache[ctx // bs, ctx % bs] = stored(s, rows[0][r][:seq - q_len], s.layer._k_scale)
        value_cache[ctx // bs, ctx % bs] = stored(s, rows[1][r][:seq - q_len], s.layer._v_scale)
    s.keys = [read_back(s, k, s.layer._k_scale) for k in rows[0]]
    s.values = [read_back(s, v, s.layer._v_scale) for v in rows[1]]
    h, hk, d, t = s.heads, s.heads_kv, s.head_size, s.num_tokens
    fused = case.randn(t, (h + 2 * hk) * d + 8, dtype=s.dtype, device=s.device)
    s.q = fused[:, :h * d].view(t, h, d)
    s.key = fused[:, h * d:(h + hk) * d].view(t, hk, d)
    s.value = fused[:, (h + hk) * d:(h + 2 * hk) * d].view(t, hk, d)
    for dst, part in ((s.key, rows[0]), (s.value, rows[1])):
        dst.copy_(torch.cat([x[seq - q:] for x, q, seq in zip(part, s.q_lens, s.seq_lens)]))
    slots = torch.cat([s.slots(r, seq - q, seq) for r, (q, seq) in enumerate(zip(s.q_lens, s.seq_lens))])
    table = torch.zeros(nreq + 2, max(need) + 3, dtype=torch.int32)
    for r, row in enumerate(s.tables):
        table[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
    qsl = torch.tensor(s.starts(), dtype=torch.int32)
    seq_lens = torch.tensor(s.seq_lens, dtype=torch.int32)
    s.common = CommonAttentionMetadata(
        query_start_loc=qsl.to(s.device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(s.device),
        num_reqs=nreq, num_actual_tokens=t, max_query_len=max(s.q_lens), max_seq_len=max(s.seq_lens),
        block_table_tensor=table.to(s.device), slot_mapping=slots.to(s.device), seq_lens_cpu=seq_lens)
    return s


def reference(s: Step, *, scale: float, window: tuple[int, int] = (-1, -1), chunk: int = 0,
              **kw) -> torch.Tensor:
    """Each request's queries over its whole sequence, causal; chunked local: each query over
    its chunk up to itself."""
    q = s.q.float()
    out = torch.zeros(s.num_tokens, s.heads, s.head_size, device=s.device)
    st = s.starts()
    for r, seq in enumerate(s.seq_lens):
        lo, hi = st[r], st[r + 1]
        k, v = s.keys[r].to(s.device), s.values[r].to(s.device)
        if not chunk:
            out[lo:hi] = attention_ref(q[lo:hi], k, v, scale=scale, causal=True, window=window, **kw)[0]
            continue
        for row in range(lo, hi):
            pos = seq - (hi - lo) + row - lo
            c0 = pos // chunk * chunk
            keys, values = k[c0:pos + 1], v[c0:pos + 1]
            out[row:row + 1] = attention_ref(q[row:row + 1], keys, values, scale=scale, **kw)[0]
    return out


def make_classes(s: Step, *, engine: dict | None = None, **layer) -> tuple:
    """(builder, impl) for the step; `layer` holds FlashServeImpl keywords, the ones the
    group shares (window, chunk, ALiBi) also go to the builder's spec."""
    spec = FlashServeKVCacheSpec(
        block_size=s.block_size, num_kv_heads=s.heads_kv, head_size=s.head_size, dtype=s.dtype,
        kv_cache_dtype=s.cache_dtype, sliding_window=layer.get("sliding_window"),
        attention_chunk_size=layer.get("attention_chunk_size"), alibi_slopes=layer.get("alibi_slopes"))
    config = FlashServeEngineConfig(num_heads=s.heads, max_num_seqs=16, max_num_batched_tokens=512,
                                    max_model_len=1024, **(engine or {}))
    builder = FlashServeMetadataBuilder(spec, ["model.layers.0.attn"], config, s.device)
    impl = FlashServeImpl(s.heads, s.head_size, s.head_size ** -0.5, s.heads_kv, kv_cache_dtype=s.cache_dtype,
                          kv_cache_layout=s.layout, dtype=s.dtype, **layer)
    return builder, impl


def forward(s: Step, impl: FlashServeImpl, md: FlashServeMetadata) -> torch.Tensor:
    out = poisoned((s.num_tokens, s.heads, s.head_size), s.dtype, s.device)
    returned = impl.forward(s.layer, s.q, s.key, s.value, s.kv_cache, md, out)
    assert returned is out
    return out


def check_cache_written(case: Case, s: Step) -> None:
    """The new tokens' slots hold key/value as the cache format stores them."""
    key_cache, value_cache = s.kv_cache.unbind(0)
    slots = s.common.slot_mapping
    blk, off = slots // s.block_size, slots % s.block_size
    check_bits(case, "key_cache", key_cache[blk, off], stored(s, s.key, s.layer._k_scale))
    check_bits(case, "value_cache", value_cache[blk, off], stored(s, s.value, s.layer._v_scale))


def random_lens(case: Case, decodes: int, prefills: int, max_seq: int = 200) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens), decode requests first."""
    q_lens = [1] * decodes + [case.rng.randint(2, 40) for _ in range(prefills)]
    seq_lens = [q + case.rng.randint(0, max_seq) for q in q_lens]
    return q_lens, seq_lens


# ---------------------------------------------------------------- steps through the classes

@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("features", ["plain", "sinks_softcap", "alibi"])
def test_decode_and_prefill_step(case, device, layout, features):
    q_lens, seq_lens = random_lens(case, case.rng.randint(1, 4), case.rng.randint(1, 3))
    s = make_step(case, Step(q_lens, seq_lens, device, layout=layout))
    case.desc = f"q_lens={q_lens} seq_lens={seq_lens} {layout} {features}"
    layer, ref_kw = {}, {}
    if features == "sinks_softcap":
        sinks = case.randn(s.heads, device=device)
        layer = {"sinks": sinks, "logits_soft_cap": 5.0}
        ref_kw = {"sink": sinks, "softcap": 5.0}
    elif features == "alibi":
        slopes = [2.0 ** (-(h + 1)) for h in range(s.heads)]
        layer = {"alibi_slopes": slopes}
        ref_kw = {"alibi": torch.tensor(slopes, device=device)}
    builder, impl = make_classes(s, **layer)
    md = builder.build(0, s.common)
    assert (md.num_decodes, md.num_prefills, md.num_actual_tokens) == (
        sum(q == 1 for q in q_lens), sum(q > 1 for q in q_lens), s.num_tokens), case.where()
    assert not (md.use_cascade or md.use_local or md.use_tree)
    out = forward(s, impl, md)
    check_out(case, "output", out, reference(s, scale=impl.scale, **ref_kw), max(seq_lens))
    check_cache_written(case, s)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_cascade_shared_prefix(case, device):
    prefix = 16 * case.rng.randint(16, 20)
    q_lens = [1] * 8 + [case.rng.randint(2, 24)]
    seq_lens = [prefix + q + case.rng.randint(0, 40) for q in q_lens]
    s = make_step(case, Step(q_lens, seq_lens, device, prefix=prefix))
    case.desc = f"prefix={prefix} q_lens={q_lens} seq_lens={seq_lens}"
    builder, impl = make_classes(s)
    md = builder.build(prefix + 5, s.common)  # the scheduler's count; the builder rounds to blocks
    assert md.use_cascade and md.common_prefix_len == prefix, case.where()
    out = forward(s, impl, md)
    check_out(case, "output", out, reference(s, scale=impl.scale), max(seq_lens))
    check_cache_written(case, s)

    no_cascade, impl2 = make_classes(s, engine={"enable_cascade": False})
    md2 = no_cascade.build(prefix, s.common)
    assert not md2.use_cascade and md2.common_prefix_len == 0
    check_out(case, "output without cascade", forward(s, impl2, md2), out.float(), max(seq_lens))


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_local(case, device):
    chunk = 32
    q_lens, seq_lens = random_lens(case, 2, 2, max_seq=150)
    s = make_step(case, Step(q_lens, seq_lens, device))
    case.desc = f"chunk={chunk} q_lens={q_lens} seq_lens={seq_lens}"
    builder, impl = make_classes(s, attention_chunk_size=chunk)
    md = builder.build(0, s.common)
    assert md.use_local and not md.use_cascade, case.where()
    out = forward(s, impl, md)
    check_out(case, "output", out, reference(s, scale=impl.scale, chunk=chunk), chunk)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_sliding_window(case, device):
    window = case.rng.choice([1, 16, 40])
    q_lens, seq_lens = random_lens(case, 2, 2)
    s = make_step(case, Step(q_lens, seq_lens, device))
    case.desc = f"window={window} q_lens={q_lens} seq_lens={seq_lens}"
    builder, impl = make_classes(s, sliding_window=window)
    out = forward(s, impl, builder.build(0, s.common))
    check_out(case, "output", out, reference(s, scale=impl.scale, window=(window - 1, 0)), window)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache(case, device):
    q_lens, seq_lens = random_lens(case, 3, 2)
    s = make_step(case, Step(q_lens, seq_lens, device, cache_dtype="fp8"))
    case.desc = f"q_lens={q_lens} seq_lens={seq_lens}"
    assert s.kv_cache.dtype == torch.uint8
    builder, impl = make_classes(s)
    out = forward(s, impl, builder.build(0, s.common))
    check_out(case, "output", out, reference(s, scale=impl.scale), max(seq_lens))
    check_cache_written(case, s)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_encoder_only(case, device):
    """No cache: each sequence attends over itself, non-causal, window (w - 1, w - 1)."""
    lens = [case.rng.randint(1, 40) for _ in range(3)]
    window, dtype = case.rng.choice([None, 8]), act_dtype(device)
    case.desc = f"lens={lens} window={window}"
    spec = FlashServeKVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=dtype,
                                 attn_type="encoder_only", sliding_window=window)
    config = FlashServeEngineConfig(num_heads=8, max_num_seqs=16, max_num_batched_tokens=512)
    builder = FlashServeMetadataBuilder(spec, ["encoder.layers.0.attn"], config, device)
    impl = FlashServeImpl(8, 64, 0.125, 2, sliding_window=window, attn_type=AttentionType.ENCODER_ONLY,
                          dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(starts[-1])
    no_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)  # CUDA: device metadata
    common = CommonAttentionMetadata(
        query_start_loc=starts.to(device), query_start_loc_cpu=starts, seq_lens=starts.diff().to(device),
        seq_lens_cpu=starts.diff(), num_reqs=3, num_actual_tokens=tokens, max_query_len=max(lens),
        max_seq_len=max(lens), block_table_tensor=None, slot_mapping=no_slots, causal=False)
    md = builder.build(0, common)
    q = case.randn(tokens, 8, 64, dtype=dtype, device=device)
    k, v = (case.randn(tokens, 2, 64, dtype=dtype, device=device) for _ in "kv")
    out = poisoned((tokens, 8, 64), dtype, device)
    impl.forward(None, q, k, v, None, md, out)
    w = (-1, -1) if window is None else (window - 1, window - 1)
    ref = torch.cat([attention_ref(q[a:b], k[a:b], v[a:b], scale=0.125, window=w)[0]
                     for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())])
    check_out(case, "output", out, ref, max(lens))


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_draft_tree_verify(case, device):
    """Each draft sees the committed tokens and its own path; a chain equals causal."""
    committed = [case.rng.randint(5, 60) for _ in range(3)]
    parents = [[-1, 0, 1], [-1, -1, 0, 1, 2], [-1]]  # a chain, a branching tree, one draft
    q_lens = [1 + len(p) for p in parents]
    seq_lens = [c + q for c, q in zip(committed, q_lens)]
    s = make_step(case, Step(q_lens, seq_lens, device))
    case.desc = f"q_lens={q_lens} seq_lens={seq_lens} parents={parents}"
    builder, impl = make_classes(s, engine={"num_speculative_tokens": max(map(len, parents))})
    flat = torch.tensor([p for ps in parents for p in ps], dtype=torch.int32)
    tree = DraftTree(parents=flat, num_drafts=torch.tensor(list(map(len, parents)), dtype=torch.int32))
    md = builder.build(0, s.common, draft_tree=tree)
    assert md.use_tree and md.num_decodes == len(q_lens), case.where()
    out = forward(s, impl, md)
    ref = torch.zeros_like(out, dtype=torch.float32)
    st = s.starts()
    for r, ps in enumerate(parents):
        tip = seq_lens[r] - len(ps) - 1  # position of the non-draft query token
        for row in range(st[r], st[r + 1]):
            d = row - st[r] - 1
            visible = list(range(tip + 1))
            while d >= 0:
                visible.append(tip + 1 + d)
                d = ps[d]
            keys, values = s.keys[r], s.values[r]  # the step's host copies
            idx = torch.tensor(sorted(visible), device=keys.device)
            ref[row:row + 1] = attention_ref(s.q[row:row + 1].float().to(keys.device), keys[idx], values[idx],
                                             scale=impl.scale)[0].to(ref.device)
    check_out(case, "output", out, ref, max(seq_lens))
    chain = reference(s, scale=impl.scale)[st[0]:st[1]]
    check_out(case, "chain output (causal)", out[st[0]:st[1]], chain, max(seq_lens))


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_multi_step_decode_and_group_table(case, device):
    """advance_decode_step's next step, and update_block_table's table of another KV group."""
    q_lens, seq_lens = [1] * 4, [case.rng.randint(1, 60) for _ in range(4)]
    s = make_step(case, Step(q_lens, seq_lens, device, room=1))
    case.desc = f"seq_lens={seq_lens}"
    builder, impl = make_classes(s)
    md = builder.build(0, s.common)
    first = forward(s, impl, md)
    check_out(case, "step 1", first, reference(s, scale=impl.scale), max(seq_lens))

    md_same = builder.update_block_table(md, s.common.block_table_tensor.clone())  # in place
    check_out(case, "same table", forward(s, impl, md_same), first.float(), max(seq_lens))

    # Another group: its own cache (a block permutation of this one) and table; same output.
    perm = torch.randperm(s.kv_cache.shape[1], generator=case.gen).to(device)
    other_cache = torch.empty_like(s.kv_cache)
    other_cache[:, perm] = s.kv_cache
    other_table = perm.to(torch.int32)[s.common.block_table_tensor.long()]
    slots, bs = s.common.slot_mapping, s.block_size
    other_slots = perm[slots // bs] * bs + slots % bs
    md_other = builder.update_block_table(md_same, other_table, other_slots)
    out = poisoned(first.shape, s.dtype, device)
    impl.forward(s.layer, s.q, s.key, s.value, other_cache, md_other, out)
    check_out(case, "other group", out, first.float(), max(seq_lens))
    with pytest.raises(ValueError, match="attn_metadata"):
        forward(s, impl, md)  # an earlier build's metadata

    builder.build(0, s.common)
    md = builder.advance_decode_step()
    assert md.max_seq_len == max(seq_lens) + 1
    nxt = make_next_token(case, s)
    check_out(case, "step 2", forward(nxt, impl, md), reference(nxt, scale=impl.scale), max(seq_lens) + 1)


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_metadata_keeps_builder_alive(case, device):
    s = make_step(case, Step([1, 7], [30, 40], device))
    builder, impl = make_classes(s)
    md = builder.build(0, s.common)
    del builder
    gc.collect()
    check_out(case, "output", forward(s, impl, md), reference(s, scale=impl.scale), 40)


def make_next_token(case: Case, s: Step) -> Step:
    """The step after a decode step: one more token per request, the same cache and blocks."""
    nxt = Step(s.q_lens, [n + 1 for n in s.seq_lens], s.device, dtype=s.dtype, kv_cache=s.kv_cache,
               layer=s.layer, tables=s.tables)
    nxt.q = case.randn(*s.q.shape, dtype=s.dtype, device=s.device)
    nxt.key = case.randn(*s.key.shape, dtype=s.dtype, device=s.device)
    nxt.value = case.randn(*s.value.shape, dtype=s.dtype, device=s.device)
    nxt.keys = [torch.cat([k, nk[None].float().cpu()]) for k, nk in zip(s.keys, nxt.key)]
    nxt.values = [torch.cat([v, nv[None].float().cpu()]) for v, nv in zip(s.values, nxt.value)]
    return nxt


# ---------------------------------------------------------------- the builder on numpy (CI)

def test_batch_reorder():
    order = reorder_decodes_first(np.array([3, 1, 5, 1, 2], dtype=np.int32), 2)
    assert order == [1, 3, 4, 0, 2]


def numpy_common(q_lens: list[int], seq_lens: list[int], table: np.ndarray,
                 **changes) -> CommonAttentionMetadata:
    """A step's common metadata as numpy arrays (block size 16)."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seqs = np.array(seq_lens, dtype=np.int32)
    slots = np.concatenate([table[r, np.arange(s - q, s) // 16] * 16 + np.arange(s - q, s) % 16
                            for r, (q, s) in enumerate(zip(q_lens, seq_lens))]).astype(np.int64)
    fields = dict(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seqs, num_reqs=len(q_lens),
                  num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                  block_table_tensor=table, slot_mapping=slots)
    return CommonAttentionMetadata(**{**fields, **changes})


def test_builder_decisions_on_numpy():
    """Decode / prefill split, the cascade decision with its block rounding, chunked local
    virtual requests (SPEC.md §6's example), bad host arrays; numpy only."""
    spec = FlashServeKVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    config = FlashServeEngineConfig(num_heads=8, max_num_seqs=16, max_num_batched_tokens=256)
    builder = FlashServeMetadataBuilder(spec, ["layer"], config)
    table = np.arange(16 * 64, dtype=np.int32).reshape(16, 64)
    md = builder.build(0, numpy_common([1, 1, 7], [20, 33, 7], table))
    assert (md.num_reqs, md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (3, 2, 1, 7)
    assert not (md.use_cascade or md.use_local or md.use_tree)

    table[:, :20] = np.arange(20, dtype=np.int32)  # every request shares its first 20 blocks
    common = numpy_common([1] * 8 + [9], [330 + r for r in range(9)], table)
    md = builder.build(300, common)
    assert md.use_cascade and md.common_prefix_len == 288  # whole blocks
    assert not builder.build(200, common).use_cascade     # under 256 tokens
    query_lens = np.array([1] * 8 + [9], dtype=np.int32)
    assert builder.use_cascade_attention(300, query_lens)
    assert not builder.use_cascade_attention(200, query_lens)

    chunked = FlashServeKVCacheSpec(block_size=4, num_kv_heads=2, head_size=64, attention_chunk_size=4)
    local = FlashServeMetadataBuilder(chunked, ["layer"], config)
    local_table = np.arange(60, dtype=np.int32).reshape(3, 20)
    md = local.build(0, numpy_common([4, 10, 5], [6, 17, 9], local_table,
                                     slot_mapping=np.zeros(19, dtype=np.int64)))
    assert md.use_local and md.handle.num_local_reqs == 8

    bad_qsl = np.array([0, 1, 8], dtype=np.int64)
    with pytest.raises(ValueError, match="^query_start_loc"):
        builder.build(0, numpy_common([1, 7], [9, 20], table, query_start_loc_cpu=bad_qsl))
    with pytest.raises(ValueError, match="^seq_lens"):
        builder.build(0, numpy_common([1, 7], [9, 20], table, seq_lens_cpu=np.array([9, 3], dtype=np.int32)))
    with pytest.raises(ValueError, match="^slot_mapping"):
        builder.build(0, numpy_common([1, 7], [9, 20], table, slot_mapping=np.zeros(8, dtype=np.int32)))


def test_capabilities_without_torch():
    b = FlashServeBackend
    assert b.get_name() == "FLASHSERVE"
    assert b.get_impl_cls() is FlashServeImpl and b.get_builder_cls() is FlashServeMetadataBuilder
    assert b.get_metadata_cls() is FlashServeMetadata
    assert b.get_supported_head_sizes() == list(range(8, 257, 8))
    assert b.supports_head_size(128) and not b.supports_head_size(20) and not b.supports_head_size(264)
    assert b.supports_head_size(192, 128) and not b.supports_head_size(128, 64)
    for dt in ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "bfloat16", None]:
        assert b.supports_kv_cache_dtype(dt), dt
    assert not b.supports_kv_cache_dtype("fp4")
    assert b.supports_block_size(1) and b.supports_block_size(48) and not b.supports_block_size(0)
    assert b.supports_compute_capability((8, 0)) and b.supports_compute_capability(90)
    assert not b.supports_compute_capability((7, 5)) and b.supports_compute_capability(None)
    assert b.supports_compute_capability(types.SimpleNamespace(major=10, minor=0))
    assert b.supports_sink() and not b.is_mla()
    assert all(b.supports_attn_type(t) for t in AttentionType)
    assert b.supports_dtype("bfloat16") and not b.supports_dtype("float32")
    assert b.supports_dtype("float32", device="cpu")
    assert b.unsupported_reason(8, 2, 128, "bfloat16", 16) is None
    assert b.unsupported_reason(8, 2, 20, "bfloat16", 16).startswith("head size 20:")
    assert b.unsupported_reason(8, 3, 128, "bfloat16", 16).startswith("num_kv_heads 3:")
    assert b.unsupported_reason(8, 2, 128, "float32", 16).startswith("dtype float32:")
    assert b.unsupported_reason(8, 2, 128, "float32", 16, device="cpu") is None
    with pytest.raises(ValueError, match="^capability"):
        b.supports_compute_capability("sm90")


@needs_torch
def test_capabilities_torch_dtypes():
    b = FlashServeBackend
    assert b.get_supported_dtypes() == [torch.float16, torch.bfloat16] == b.supported_dtypes
    assert b.get_supported_dtypes("cpu") == [torch.float16, torch.bfloat16, torch.float32]
    assert b.supports_dtype(torch.bfloat16) and not b.supports_dtype(torch.float32)
    assert b.unsupported_reason(8, 2, 128, torch.float16, 16) is None


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_cache_shape_and_stride_order(layout):
    b = FlashServeBackend
    assert b.get_kv_cache_shape(100, 16, 4, 128) == (2, 100, 16, 4, 128)
    assert b.get_kv_cache_shape(0, 1, 1, 8, cache_dtype_str="fp8") == (2, 0, 1, 1, 8)
    b.kv_cache_layout = layout
    try:
        order = b.get_kv_cache_stride_order()
        layered = b.get_kv_cache_stride_order(include_num_layers_dimension=True)
    finally:
        b.kv_cache_layout = "NHD"
    assert sorted(order) == list(range(5)) and sorted(layered) == list(range(6))
    shape = (2, 5, 16, 4, 32)
    raw = np.zeros([shape[i] for i in order], dtype=np.float32)
    key_cache = raw.transpose(sorted(range(5), key=lambda i: order[i]))[0]  # [blocks, block_size, H, D]
    assert key_cache.shape == shape[1:] and key_cache.strides[3] == 4
    assert (key_cache.strides[2] < key_cache.strides[1]) == (layout == "NHD")
    shape6 = (3, *shape)  # (layers, 2, blocks, block_size, H, D): blocks outermost
    view = np.zeros([shape6[i] for i in layered], dtype=np.float32).transpose(
        sorted(range(6), key=lambda i: layered[i]))
    assert view.shape == shape6 and max(view.strides) == view.strides[2] and view.strides[5] == 4


# ---------------------------------------------------------------- bad arguments

@needs_torch
def test_bad_arguments_raise_value_error_naming_them(case):
    def raises(arg, fn, *a, **kw):
        with pytest.raises(ValueError, match=f"^{arg}"):
            fn(*a, **kw)

    raises("num_kv_heads", FlashServeImpl, 8, 64, 0.125, 3)
    raises("head_size", FlashServeImpl, 8, 20, 0.125, 2)
    raises("kv_cache_dtype", FlashServeImpl, 8, 64, 0.125, 2, kv_cache_dtype="fp4")
    raises("attn_type", FlashServeImpl, 8, 64, 0.125, 2, attn_type="cross")
    raises("sliding_window", FlashServeImpl, 8, 64, 0.125, 2, sliding_window=0)
    raises("kv_cache_layout", FlashServeImpl, 8, 64, 0.125, 2, kv_cache_layout="NDH")
    raises("block_size", FlashServeBackend.get_kv_cache_shape, 10, 0, 2, 64)
    raises("cache_dtype_str", FlashServeBackend.get_kv_cache_shape, 10, 16, 2, 64, "fp4")

    s = make_step(case, Step([1, 5], [9, 20], "cpu"))
    spec = FlashServeKVCacheSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    raises("max_model_len", FlashServeMetadataBuilder, spec, [], FlashServeEngineConfig(8, max_model_len=0))
    raises("block_size", FlashServeMetadataBuilder, FlashServeKVCacheSpec(0, 2, 64), [],
           FlashServeEngineConfig(8))
    builder, impl = make_classes(s)
    common = s.common
    int32 = torch.int32
    raises("query_start_loc", builder.build, 0,
           replace(common, query_start_loc_cpu=common.query_start_loc_cpu.long()))
    decode_last = replace(common, query_start_loc_cpu=torch.tensor([0, 5, 6], dtype=int32), max_query_len=5)
    raises("query_start_loc", builder.build, 0, decode_last)
    raises("seq_lens", builder.build, 0, replace(common, seq_lens_cpu=torch.tensor([9, 2], dtype=int32)))
    raises("seq_lens_cpu", builder.build, 0, replace(common, seq_lens_cpu=None, seq_lens=FakeDeviceTensor()))
    raises("block_table", builder.build, 0,
           replace(common, block_table_tensor=common.block_table_tensor.long()))
    raises("common_prefix_len", builder.build, -1, common)
    md = builder.build(0, common)
    raises("output", impl.forward, s.layer, s.q, s.key, s.value, s.kv_cache, md, None)
    raises("q", impl.forward, s.layer, s.q[:, :4], s.key, s.value, s.kv_cache, md,
           poisoned((6, 8, 64), torch.float32, "cpu"))
    with pytest.raises(NotImplementedError, match="output_scale"):
        impl.forward(s.layer, s.q, s.key, s.value, s.kv_cache, md, torch.empty(6, 8, 64), torch.ones(()))
    assert impl.forward(s.layer, s.q, s.key, s.value, s.kv_cache, None, s.q) is s.q  # profiling run


class FakeDeviceTensor:
    """Stands for a tensor on a device: the builder must not read it on the host."""
    device = types.SimpleNamespace(type="cuda")
