"""Every drop-in of PYTHON_API.md called with numpy arrays on the CPU (what CI checks: numpy
only, no torch), against a float64 numpy reference written here; plus the exact signatures,
NotImplementedError for each unimplemented keyword and ValueError naming the bad argument."""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest

import flashserve as fs

NAN = np.nan
TOL = {np.float32: (3e-5, 1e-4), np.float16: (4e-3, 4e-3)}  # (atol, rtol) of outputs


# ---------------------------------------------------------------- the reference

def ref_seq(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None, sink=None, qv=None):
    """Attention of one sequence (SPEC.md §2) in float64: q [sq, H, D], k [sk, Hk, D],
    v [sk, Hk, Dv] -> out [sq, H, Dv], lse [H, sq]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    kk, vv = np.repeat(k, h // hk, axis=1), np.repeat(v, h // hk, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kk)
    if qv is not None:
        s += np.einsum("ihd,jhd->hij", np.asarray(qv, np.float64), vv)
    s *= scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    if slopes is not None:
        s -= np.asarray(slopes, np.float64)[:, None, None] * np.abs(i - j)[None]
    vis = np.ones((sq, sk), bool)
    if causal:
        vis &= j <= i
    if window[0] >= 0:
        vis &= j >= i - window[0]
    if window[1] >= 0:
        vis &= j <= i + window[1]
    s = np.where(vis[None], s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, np.asarray(sink, np.float64)[:, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m[..., None])
    den = e.sum(-1) + (np.exp(np.asarray(sink, np.float64)[:, None] - m) if sink is not None else 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(den > 0, np.log(den) + m, -np.inf)
        p = np.where(den[..., None] > 0, e / den[..., None], 0.0)
    return np.einsum("hij,jhd->ihd", p, vv), lse


def ref_merge(a, la, b, lb):
    """SPEC.md §4 in float64: states [T, H, D], LSEs [H, T]."""
    la, lb = (np.where(x == np.inf, -np.inf, np.asarray(x, np.float64)) for x in (la, lb))
    m = np.maximum(la, lb)
    m0 = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp(la - m0), np.exp(lb - m0)
    den = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        o = (wa.T[..., None] * a + wb.T[..., None] * b) / den.T[..., None]
        lse = np.where(den > 0, np.log(den) + m0, -np.inf)
    return np.where(den.T[..., None] > 0, o, 0.0), lse


def check_close(got, want, dtype, what, seed_msg=""):
    atol, rtol = TOL[dtype]
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in the output (unwritten?) {seed_msg}"
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"{what} {seed_msg}")


def check_lse(got, want, what):
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{what}: -inf positions differ"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=1e-4, rtol=1e-5, err_msg=what)


# ---------------------------------------------------------------- inputs

def cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def paged(rng, seqs, block_size, layout="nhd", interleaved=False, extra_cols=2):
    """seqs: list of [n, Hk, D] arrays -> (k_cache view, block_table slice) holding them in
    shuffled blocks; every slot no sequence owns is NaN."""
    n_blocks = [-(-len(s) // block_size) for s in seqs]
    total = sum(n_blocks) + 3
    hk, d = seqs[0].shape[1:]
    shape = (total, block_size, hk, d) if layout == "nhd" else (total, hk, block_size, d)
    store = np.full((total, 2) + shape[1:], NAN, seqs[0].dtype) if interleaved else np.full(shape, NAN, seqs[0].dtype)
    cache = store[:, 0] if interleaved else store
    view = cache if layout == "nhd" else cache.transpose(0, 2, 1, 3)
    width = max(n_blocks) + extra_cols
    table = np.full((len(seqs), width + 3), -7, np.int32)  # the engine's wider table; a slice is passed
    order = rng.permutation(total)
    used = 0
    for b, s in enumerate(seqs):
        for c in range(n_blocks[b]):
            blk = order[used]
            used += 1
            table[b, c] = blk
            rows = s[c * block_size:(c + 1) * block_size]
            view[blk, :len(rows)] = rows
    for b in range(len(seqs)):
        table[b, n_blocks[b]:] = order[used:used + 1]  # valid but unused block ids
    return view, table[:, :width]


def batch(rng, n, max_q=5, max_k=40, causal=False):
    q_lens = rng.integers(0, max_q + 1, n)
    k_lens = rng.integers(0, max_k + 1, n)
    if causal:
        k_lens = np.maximum(k_lens, q_lens)
    return [int(x) for x in q_lens], [int(x) for x in k_lens]


FEATURES = ["plain", "causal", "window", "softcap", "alibi", "sinks", "all"]


def feature_kwargs(rng, feature, h):
    kw, ref = {}, {}
    if feature in ("causal", "all"):
        kw["causal"] = ref["causal"] = True
    if feature in ("window", "all"):
        w = (int(rng.integers(0, 6)), int(rng.integers(-1, 3)))
        kw["window_size"] = ref["window"] = w
    if feature in ("softcap", "all"):
        kw["softcap"] = ref["softcap"] = 2.5
    if feature in ("alibi", "all"):
        kw["alibi_slopes"] = ref["slopes"] = rng.uniform(0.0, 0.5, h).astype(np.float32)
    if feature in ("sinks", "all"):
        kw["s_aux"] = ref["sink"] = rng.uniform(-1.0, 2.0, h).astype(np.float32)
    return kw, ref


# ---------------------------------------------------------------- attention

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_contiguous(rng, dtype, feature):
    hk, g, d = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4])), int(rng.choice([32, 40, 64]))
    h = hk * g
    q_lens, k_lens = batch(rng, int(rng.integers(1, 5)), causal=rng.random() < 0.5)
    q = rand(rng, (sum(q_lens), h, d), dtype)
    k, v = rand(rng, (sum(k_lens), hk, d), dtype), rand(rng, (sum(k_lens), hk, d), dtype)
    kw, ref_kw = feature_kwargs(rng, feature, h)
    scale = float(rng.uniform(0.05, 0.3))
    out, lse = fs.flash_attn_varlen_func(q, k, v, max(q_lens), cu(q_lens), max(k_lens), cu_seqlens_k=cu(k_lens),
                                         softmax_scale=scale, return_softmax_lse=True, **kw)
    assert out.shape == (sum(q_lens), h, d) and out.dtype == dtype and lse.shape == (h, sum(q_lens))
    cq, ck = cu(q_lens), cu(k_lens)
    for b in range(len(q_lens)):
        o, l = ref_seq(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], scale, **ref_kw)
        check_close(out[cq[b]:cq[b + 1]], o, dtype, f"seq {b} {q_lens} {k_lens}")
        check_lse(lse[:, cq[b]:cq[b + 1]], l, f"lse seq {b}")


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("layout", ["nhd", "hnd", "interleaved"])
def test_varlen_paged(rng, block_size, layout):
    hk, g, d = 2, int(rng.choice([1, 3])), 32
    h = hk * g
    q_lens, k_lens = batch(rng, 3, causal=True)
    seqs_k = [rand(rng, (n, hk, d)) for n in k_lens]
    seqs_v = [rand(rng, (n, hk, d)) for n in k_lens]
    inter = layout == "interleaved"
    lay = "nhd" if inter else layout
    k_cache, table = paged(np.random.default_rng(1), seqs_k, block_size, lay, inter)
    v_cache, _ = paged(np.random.default_rng(1), seqs_v, block_size, lay, inter)
    q = rand(rng, (sum(q_lens), h, d))
    kw, ref_kw = feature_kwargs(rng, str(rng.choice(FEATURES)), h)
    out = np.full((sum(q_lens), h, d), NAN, np.float32)
    res = fs.flash_attn_varlen_func(q, k_cache, v_cache, max(q_lens), cu(q_lens), max(k_lens),
                                    seqused_k=np.array(k_lens, np.int32), block_table=table, out=out,
                                    num_splits=int(rng.choice([0, 1, 3])), **kw)
    assert res is out
    cq = cu(q_lens)
    for b in range(len(q_lens)):
        o, _ = ref_seq(q[cq[b]:cq[b + 1]], seqs_k[b], seqs_v[b], d ** -0.5, **ref_kw)
        check_close(out[cq[b]:cq[b + 1]], o, np.float32, f"seq {b} {q_lens} {k_lens} {kw}")


def test_varlen_mla_shapes(rng):
    """D=192/Dv=128 (MLA prefill) and the absorbed decode form D=64 + q_v with Dv=512."""
    k_lens, q_lens = [7, 3], [2, 1]
    q, k, v = rand(rng, (3, 2, 192)), rand(rng, (10, 1, 192)), rand(rng, (10, 1, 128))
    out = fs.flash_attn_varlen_func(q, k, v, 2, cu(q_lens), 7, cu_seqlens_k=cu(k_lens), causal=True)
    for b, (qs, ks) in enumerate(((slice(0, 2), slice(0, 7)), (slice(2, 3), slice(7, 10)))):
        check_close(out[qs], ref_seq(q[qs], k[ks], v[ks], 192 ** -0.5, causal=True)[0], np.float32, f"mla seq {b}")
    q, qv = rand(rng, (3, 2, 64)), rand(rng, (3, 2, 512))
    k, v = rand(rng, (10, 1, 64)), rand(rng, (10, 1, 512))
    out = fs.flash_attn_varlen_func(q, k, v, 2, cu(q_lens), 7, cu_seqlens_k=cu(k_lens), q_v=qv)
    want = ref_seq(q[:2], k[:7], v[:7], (64 + 512) ** -0.5, qv=qv[:2])[0]
    check_close(out[:2], want, np.float32, "q_v")


@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
def test_kvcache(rng, paged_cache):
    b, sq, hk, g, d = 3, int(rng.integers(1, 4)), 2, 2, 32
    h = hk * g
    lens = [int(x) for x in rng.integers(sq, 30, b)]
    seqs_k = [rand(rng, (n, hk, d)) for n in lens]
    seqs_v = [rand(rng, (n, hk, d)) for n in lens]
    q = rand(rng, (b, sq, h, d))
    kw, ref_kw = feature_kwargs(rng, str(rng.choice(FEATURES)), h)
    extra = {}
    if paged_cache:
        k_cache, table = paged(np.random.default_rng(2), seqs_k, 16)
        v_cache, _ = paged(np.random.default_rng(2), seqs_v, 16)
        extra["block_table"] = table
    else:
        rows = list(rng.permutation(b + 2)[:b])  # cache rows of each sequence
        k_cache = np.full((b + 2, 32, hk, d), NAN, np.float32)
        v_cache = np.full((b + 2, 32, hk, d), NAN, np.float32)
        for i, r in enumerate(rows):
            k_cache[r, :lens[i]], v_cache[r, :lens[i]] = seqs_k[i], seqs_v[i]
        extra["cache_batch_idx"] = np.array(rows, np.int32)
    out, lse = fs.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array(lens, np.int32),
                                          return_softmax_lse=True, **extra, **kw)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    for i in range(b):
        o, l = ref_seq(q[i], seqs_k[i], seqs_v[i], d ** -0.5, **ref_kw)
        check_close(out[i], o, np.float32, f"seq {i} {lens} {kw}")
        check_lse(lse[i], l, f"lse seq {i}")


def test_kvcache_int_cache_seqlens(rng):
    """An int cache_seqlens is the length of every sequence (FlashAttention's form)."""
    q, k_cache, v_cache = rand(rng, (2, 1, 2, 16)), rand(rng, (2, 9, 1, 16)), rand(rng, (2, 9, 1, 16))
    out = fs.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=6)
    for i in range(2):
        check_close(out[i], ref_seq(q[i], k_cache[i, :6], v_cache[i, :6], 0.25)[0], np.float32, f"seq {i}")


def test_num_splits_and_scheduler_metadata(rng):
    q_lens, k_lens = [1, 1, 1], [200, 90, 150]
    q, k, v = rand(rng, (3, 4, 32)), rand(rng, (440, 2, 32)), rand(rng, (440, 2, 32))
    args = (q, k, v, 1, cu(q_lens), 200)
    kw = dict(cu_seqlens_k=cu(k_lens), return_softmax_lse=True)
    one = fs.flash_attn_varlen_func(*args, num_splits=1, **kw)
    again = fs.flash_attn_varlen_func(*args, num_splits=1, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(one, again)), "num_splits=1 is not deterministic"
    split = fs.flash_attn_varlen_func(*args, num_splits=5, **kw)
    check_close(split[0], one[0], np.float32, "5 splits vs 1")
    md = fs.get_scheduler_metadata(3, 1, 200, 4, 2, 32, np.array(k_lens, np.int32), cu_seqlens_q=cu(q_lens),
                                   num_splits=5)
    assert md.dtype == np.int32 and md.ndim == 1
    planned = fs.flash_attn_varlen_func(*args, scheduler_metadata=md, **kw)
    assert np.array_equal(planned[0], split[0]) and np.array_equal(planned[1], split[1])
    out = np.full_like(q, NAN)
    with pytest.raises(ValueError, match="^scheduler_metadata: expected a plan made for"):
        fs.flash_attn_varlen_func(q, k, v, 1, cu(q_lens), 201, cu_seqlens_k=cu(k_lens), scheduler_metadata=md, out=out)
    assert np.isnan(out).all(), "a rejected call wrote out"
    with pytest.raises(ValueError, match="^scheduler_metadata:"):
        fs.flash_attn_varlen_func(*args, cu_seqlens_k=cu(k_lens), scheduler_metadata=np.zeros(40, np.int32))
    # qkv_dtype's width is part of the plan (flag word 4, bit 4), and metadata made with another
    # width serves the call with its split count (as FlashAttention-3 runs it)
    md8 = fs.get_scheduler_metadata(3, 1, 200, 4, 2, 32, np.array(k_lens, np.int32), cu_seqlens_q=cu(q_lens),
                                    num_splits=5, qkv_dtype="float8_e4m3fn")
    assert md8[4] & 16 and not md[4] & 16 and np.array_equal(np.delete(md8, 4), np.delete(md, 4))
    planned8 = fs.flash_attn_varlen_func(*args, scheduler_metadata=md8, **kw)
    assert np.array_equal(planned8[0], split[0]) and np.array_equal(planned8[1], split[1])


# ---------------------------------------------------------------- merge and cache

@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("prefill", [None, 3])
def test_merge_attn_states(rng, with_lse, prefill):
    t, h, d = 6, 3, 16
    a, b = rand(rng, (t, h, d)), rand(rng, (t, h, d))
    la, lb = rand(rng, (h, t)) * 3, rand(rng, (h, t)) * 3
    la[0, 0], lb[0, 0] = -np.inf, -np.inf  # both empty
    la[1, 1], lb[2, 2] = np.inf, -np.inf   # +inf counts as -inf
    out = np.full((t, h, d), NAN, np.float32)
    out_lse = np.full((h, t), NAN, np.float32) if with_lse else None
    assert fs.merge_attn_states(out, a, la, b, lb, output_lse=out_lse, prefill_tokens_with_context=prefill) is None
    o, l = ref_merge(a, la, b, lb)
    if prefill is not None:
        o[prefill:], l[:, prefill:] = b[prefill:], lb[:, prefill:]
    check_close(out, o, np.float32, "merged output")
    if with_lse:
        check_lse(out_lse, l, "merged lse")


@pytest.mark.parametrize("given", [False, True])
def test_merge_state_v2(rng, given):
    t, h, d = 5, 2, 8
    a, b = rand(rng, (t, h, d)), rand(rng, (t, h, d))
    sa, sb = rand(rng, (t, h)), rand(rng, (t, h))
    vm = np.full((t, h, d), NAN, np.float32) if given else None
    sm = np.full((t, h), NAN, np.float32) if given else None
    v_merged, s_merged = fs.merge_state_v2(a, sa, b, sb, vm, sm)
    if given:
        assert v_merged is vm and s_merged is sm
    assert s_merged.shape == (t, h)
    o, l = ref_merge(a, sa.T, b, sb.T)
    check_close(v_merged, o, np.float32, "v_merged")
    check_lse(s_merged, l.T, "s_merged")


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_reshape_and_cache_flash(rng, layout):
    n, hk, d, blocks, bs = 5, 2, 16, 4, 4
    fused = rand(rng, (n + 2, 3, hk, d))        # q/k/v of a fused projection: token stride > row
    key, value = fused[:, 1], fused[:, 2]
    store_k = rand(rng, (blocks, bs, hk, d) if layout == "nhd" else (blocks, hk, bs, d))
    store_v = rand(rng, store_k.shape)
    k_cache = store_k if layout == "nhd" else store_k.transpose(0, 2, 1, 3)
    v_cache = store_v if layout == "nhd" else store_v.transpose(0, 2, 1, 3)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    slots = rng.permutation(blocks * bs)[:n].astype(np.int64)
    slots[2] = -1
    scale = np.array(1.0, np.float32)
    fs.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, "auto", scale, scale)
    want_k, want_v = before_k.copy(), before_v.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s // bs, s % bs], want_v[s // bs, s % bs] = key[i], value[i]
    assert np.array_equal(k_cache, want_k) and np.array_equal(v_cache, want_v)


def test_extension_block_and_step_ops(rng):
    """The extension's other operations (flashserve._C), used by the backend layer."""
    from flashserve import _C
    caches = [rand(rng, (6, 4, 2, 8)) for _ in range(2)]
    before = [c.copy() for c in caches]
    mapping = np.array([[0, 3], [5, 1]], np.int64)
    _C.copy_blocks(caches, mapping, None)
    for c, b in zip(caches, before):
        b[3], b[1] = b[0], b[5]
        assert np.array_equal(c, b)
    dst = np.zeros_like(caches[0])
    _C.swap_blocks(caches[0], dst, mapping, None)
    assert np.array_equal(dst[3], caches[0][0]) and np.array_equal(dst[1], caches[0][5]) and not dst[0].any()

    seq_lens = np.array([5, 16, 9], np.int32)
    tables = np.array([[4, 1], [2, 7], [0, 3]], np.int32)
    tokens, positions, slots = np.full(3, 99, np.int64), np.full(3, 99, np.int64), np.full(3, 99, np.int64)
    sampled = np.array([[11], [12]], np.int64)
    _C.advance_step(3, 2, 16, tokens, sampled, positions, seq_lens, slots, tables, None)
    assert list(tokens) == [11, 12, 0] and list(seq_lens) == [6, 17, 9] and list(positions) == [5, 16, 0]
    assert list(slots) == [4 * 16 + 5, 7 * 16 + 0, -1]


def test_v0_cache_ops(rng):
    """vLLM v0's ops as public drop-ins (swap_blocks, copy_blocks, advance_step), on numpy
    caches shaped like kv_cache[0] / kv_cache[1] of a (2, num_blocks, block_size, H_kv, D) cache."""
    kv = [rand(rng, (2, 8, 4, 2, 16)) for _ in range(2)]  # two layers
    before = [c.copy() for c in kv]
    mapping = np.array([[int(rng.integers(0, 4)), 5], [int(rng.integers(0, 4)), 7]], np.int64)
    fs.copy_blocks([c[0] for c in kv], [c[1] for c in kv], mapping)
    for c, b in zip(kv, before):
        for s, d in mapping:
            b[:, d] = b[:, s]
        assert np.array_equal(c, b)
    with pytest.raises(ValueError, match="^value_caches: expected 2 caches"):
        fs.copy_blocks([c[0] for c in kv], [kv[0][1]], mapping)
    with pytest.raises(ValueError, match="^block_mapping: expected"):
        fs.copy_blocks([c[0] for c in kv], [c[1] for c in kv], np.array([[0, 8]], np.int64))
    assert all(np.array_equal(c, b) for c, b in zip(kv, before)), "written by a rejected call"

    dst = np.full((3, 4, 2, 16), NAN, np.float32)
    fs.swap_blocks(kv[0][1], dst, np.array([[6, 2], [1, 0]], np.int64))
    assert np.array_equal(dst[2], kv[0][1][6]) and np.array_equal(dst[0], kv[0][1][1]) and np.isnan(dst[1]).all()
    with pytest.raises(ValueError, match="^block_mapping: expected"):
        fs.swap_blocks(kv[0][1], dst, np.array([[6, 3]], np.int64))

    # advance_step: 2 queries, 1 CUDA-graph padding row; after prefills turned into decodes the
    # token/position/slot rows still hold the mixed step's tokens (6 rows): only 3 are written.
    for turn in (False, True):
        rows = 6 if turn else 3
        seq_lens = np.array([5, 16, 9], np.int32)
        tables = np.array([[4, 1, 0], [2, 7, 0], [0, 3, 0]], np.int32)[:, :2]
        tokens, positions, slots = (np.full(rows, 99, np.int64) for _ in range(3))
        fs.advance_step(3, 2, 16, tokens, np.array([[11], [12]], np.int64), positions, seq_lens, slots, tables,
                        turn_prefills_into_decodes=turn)
        assert list(tokens) == [11, 12, 0] + [99] * (rows - 3) and list(seq_lens) == [6, 17, 9]
        assert list(positions) == [5, 16, 0] + [99] * (rows - 3)
        assert list(slots) == [4 * 16 + 5, 7 * 16 + 0, -1] + [99] * (rows - 3)
    with pytest.raises(ValueError, match="^input_tokens: expected num_seqs = 3 rows"):
        fs.advance_step(3, 2, 16, np.zeros(6, np.int64), np.zeros((2, 1), np.int64), np.zeros(3, np.int64),
                        np.zeros(3, np.int32), np.zeros(3, np.int64), np.zeros((3, 2), np.int32))
    lens = np.array([5, 32, 9], np.int32)  # sequence 1's next position needs a third block
    with pytest.raises(ValueError, match="^block_tables: expected"):
        fs.advance_step(3, 2, 16, np.zeros(3, np.int64), np.zeros((2, 1), np.int64), np.zeros(3, np.int64),
                        lens, np.zeros(3, np.int64), np.zeros((3, 2), np.int32))
    assert list(lens) == [5, 32, 9]


def test_vllm_v1_padded_batch_and_descales(rng):
    """What vLLM's v1 backend passes: q/out rows past cu_seqlens_q[-1] (a batch padded for a CUDA
    graph; NaN there), descales for 16-bit (here fp32) operands (unused, FlashAttention's
    behaviour), and the schedule of the unpadded batch. The padding rows of out stay untouched."""
    hk, h, d, bs = 2, 4, 32, 16
    q_lens, k_lens = [1, 3, 1], [20, 9, 33]
    seqs_k = [rand(rng, (n, hk, d)) for n in k_lens]
    seqs_v = [rand(rng, (n, hk, d)) for n in k_lens]
    k_cache, table = paged(np.random.default_rng(3), seqs_k, bs)
    v_cache, _ = paged(np.random.default_rng(3), seqs_v, bs)
    pad = int(rng.integers(1, 5))
    total = sum(q_lens)
    q = np.full((total + pad, h, d), NAN, np.float32)
    q[:total] = rand(rng, (total, h, d))
    scale = np.array([float(rng.uniform(2.0, 4.0))], np.float32)
    descale = np.lib.stride_tricks.as_strided(scale, shape=(3, hk), strides=(0, 0))  # _k_scale.expand(B, H_kv)
    seqused = np.array(k_lens, np.int32)
    md = fs.get_scheduler_metadata(3, max(q_lens), max(k_lens), h, hk, d, seqused, cu_seqlens_q=cu(q_lens),
                                   page_size=bs, causal=True)
    out = np.full((total + pad, h, d), NAN, np.float32)
    fs.flash_attn_varlen_func(q, k_cache, v_cache, max(q_lens), cu(q_lens), max(k_lens), seqused_k=seqused,
                              block_table=table, causal=True, out=out, scheduler_metadata=md, fa_version=3,
                              q_descale=descale, k_descale=descale, v_descale=descale)
    cq = cu(q_lens)
    for b in range(3):
        o, _ = ref_seq(q[cq[b]:cq[b + 1]], seqs_k[b], seqs_v[b], d ** -0.5, causal=True)
        check_close(out[cq[b]:cq[b + 1]], o, np.float32, f"seq {b}")
    assert np.isnan(out[total:]).all(), "padding rows of out were written"
    with pytest.raises(ValueError, match="^k_descale: expected"):
        fs.flash_attn_varlen_func(q, k_cache, v_cache, max(q_lens), cu(q_lens), max(k_lens), seqused_k=seqused,
                                  block_table=table, causal=True, out=out, k_descale=np.ones((3, h), np.float32))


def test_extension_variant_ops(rng):
    from flashserve import _C
    t, h, d = 3, 4, 8
    a1, a2 = rand(rng, (t, h, d)), rand(rng, (t, h, d))
    lq1, lk1, lq2, lk2 = (rand(rng, (d,)) * 0.1 for _ in range(4))
    weight = rand(rng, (2 * d,))
    out = np.full_like(a1, NAN)
    _C.differential_combine(a1, a2, lq1, lk1, lq2, lk2, weight, 0.8, 1e-5, out, None)
    lam = np.exp(lq1 @ lk1) - np.exp(lq2 @ lk2) + 0.8
    x = (a1 - lam * a2).reshape(t, h // 2, 2 * d).astype(np.float64)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * weight * (1 - 0.8)
    check_close(out, want.reshape(t, h, d), np.float32, "differential_combine")

    lse_all = rand(rng, (2, h, t))
    part = rand(rng, (t, h, d))
    out = part.copy()
    lse_out = np.full((h, t), NAN, np.float32)
    _C.lse_correct(out, lse_all, 1, lse_out, False, None)
    g = np.logaddexp(lse_all[0], lse_all[1])
    check_close(out, part * np.exp(lse_all[1] - g).T[..., None], np.float32, "lse_correct out")
    check_lse(lse_out, g, "lse_correct lse")

    cache = rand(rng, (4, 2, 3))  # [num_blocks, block_size, width]
    table = np.array([[2, 0], [3, 1]], np.int32)
    dst = np.full((8, 3), NAN, np.float32)
    cu_dst = np.full(3, -1, np.int32)
    _C.gather_cache(cache, table, np.array([3, 2], np.int32), None, 0, None, dst, cu_dst, None)
    assert list(cu_dst) == [0, 3, 5]
    rows = np.concatenate([cache[2], cache[0, :1], cache[3]])
    assert np.array_equal(dst[:5], rows) and np.isnan(dst[5:]).all()


# ---------------------------------------------------------------- the surface

API = {
    "flash_attn_varlen_func": (
        "q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None, q_v=None, "
        "dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0, alibi_slopes=None, "
        "deterministic=False, return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None, "
        "scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None, num_splits=0, "
        "output_scale=None, fa_version=DEFAULT_FA_VERSION, s_aux=None, cp_world_size=1, cp_rank=0, "
        "cp_tot_seqused_k=None, batch_invariant=False"),
    "flash_attn_with_kvcache": (
        "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, "
        "cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, "
        "window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
        "return_softmax_lse=False, *, out=None, scheduler_metadata=None, q_descale=None, k_descale=None, "
        "v_descale=None, fa_version=DEFAULT_FA_VERSION, s_aux=None, cp_world_size=1, cp_rank=0, "
        "cp_tot_seqused_k=None, batch_invariant=False"),
    "get_scheduler_metadata": (
        "batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens, "
        "qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None, "
        "cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1), "
        "has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0, batch_invariant=False"),
    "is_fa_version_supported": "fa_version, device=None",
    "fa_version_unsupported_reason": "fa_version, device=None",
    "merge_attn_states": (
        "output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None, "
        "prefill_tokens_with_context=None, output_scale=None"),
    "merge_state_v2": "v_a, s_a, v_b, s_b, v_merged=None, s_merged=None",
    "reshape_and_cache_flash": "key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale",
    "swap_blocks": "src, dst, block_mapping",
    "copy_blocks": "key_caches, value_caches, block_mapping",
    "advance_step": (
        "num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions, seq_lens, "
        "slot_mapping, block_tables, *, turn_prefills_into_decodes=False"),
}


@pytest.mark.parametrize("name", sorted(API))
def test_signature(name):
    try:
        import torch
        bf16 = torch.bfloat16
    except ImportError:
        bf16 = "bfloat16"
    env = {"DEFAULT_FA_VERSION": 2, "torch": types.SimpleNamespace(bfloat16=bf16)}
    want = inspect.signature(eval(f"lambda {API[name]}: None", env)).parameters  # noqa: S307
    got = inspect.signature(getattr(fs, name)).parameters
    assert list(got) == list(want), name
    for p in want.values():
        q = got[p.name]
        assert (q.kind, q.default) == (p.kind, p.default), f"{name}({p.name}): {q} != {p}"
    assert fs.DEFAULT_FA_VERSION == 2


def small_varlen(rng):
    q, k, v = rand(rng, (3, 2, 16)), rand(rng, (7, 1, 16)), rand(rng, (7, 1, 16))
    return (q, k, v, 2, cu([2, 1]), 4), {"cu_seqlens_k": cu([4, 3])}


@pytest.mark.parametrize("keyword, value", [("dropout_p", 0.1), ("return_attn_probs", True),
                                            ("output_scale", np.ones(1, np.float32)), ("softmax_scale", 0.0)])
def test_varlen_not_implemented(rng, keyword, value):
    args, kw = small_varlen(rng)
    with pytest.raises(NotImplementedError, match=f"^{keyword}:"):
        fs.flash_attn_varlen_func(*args, **kw, **{keyword: value})


@pytest.mark.parametrize("keyword", ["k", "v", "rotary_cos", "rotary_sin", "cache_leftpad"])
def test_kvcache_not_implemented(rng, keyword):
    q, kc, vc = rand(rng, (1, 1, 2, 16)), rand(rng, (1, 8, 1, 16)), rand(rng, (1, 8, 1, 16))
    with pytest.raises(NotImplementedError, match=f"^{keyword}:"):
        fs.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, **{keyword: rand(rng, (1, 1, 1, 16))})


@pytest.mark.parametrize("keyword, value", [("cu_seqlens_k_new", np.zeros(2, np.int32)),
                                            ("cache_leftpad", np.zeros(1, np.int32)),
                                            ("max_seqlen_k_new", 3), ("sm_margin", 4)])
def test_scheduler_metadata_not_implemented(keyword, value):
    with pytest.raises(NotImplementedError, match=f"^{keyword}:"):
        fs.get_scheduler_metadata(1, 1, 8, 2, 1, 16, np.array([8], np.int32), **{keyword: value})


def test_accepted_tuning_keywords(rng):
    """deterministic, fa_version 3, pack_gqa and has_softcap change nothing."""
    args, kw = small_varlen(rng)
    base = fs.flash_attn_varlen_func(*args, **kw)
    same = fs.flash_attn_varlen_func(*args, **kw, deterministic=True, fa_version=3, window_size=(-1, -1))
    assert np.array_equal(base, same)
    fs.get_scheduler_metadata(1, 1, 8, 2, 1, 16, np.array([8], np.int32), pack_gqa=True, has_softcap=True)


def test_bad_inputs_name_the_argument(rng):
    args, kw = small_varlen(rng)
    q, k, v, mq, cq, mk = args
    out = np.full_like(q, NAN)
    cases = [
        ("cu_seqlens_q", lambda: fs.flash_attn_varlen_func(q, k, v, mq, cq.astype(np.int64), mk, **kw, out=out)),
        ("q", lambda: fs.flash_attn_varlen_func([[1.0]], k, v, mq, cq, mk, **kw)),
        ("window_size", lambda: fs.flash_attn_varlen_func(*args, **kw, window_size=(1, 2, 3))),
        ("window_size", lambda: fs.flash_attn_varlen_func(*args, **kw, window_size=(-2, 0), out=out)),
        ("fa_version", lambda: fs.flash_attn_varlen_func(*args, **kw, fa_version=4)),
        ("cu_seqlens_k", lambda: fs.flash_attn_varlen_func(*args, out=out)),
        ("out", lambda: fs.flash_attn_varlen_func(*args, **kw, out=np.zeros((3, 2, 8), np.float32))),
        ("k", lambda: fs.flash_attn_varlen_func(q, k.astype(np.float16), v.astype(np.float16), mq, cq, mk, **kw,
                                                out=out)),
        ("k_cache", lambda: fs.flash_attn_with_kvcache(q[None], k[None].astype(np.float16),
                                                        v[None].astype(np.float16), cache_seqlens=3)),
        ("cache_seqlens", lambda: fs.flash_attn_with_kvcache(q[None], k[None], v[None],
                                                             cache_seqlens=np.array([3], np.int64))),
        ("prefix_lse", lambda: fs.merge_attn_states(out, q, np.zeros((3, 2), np.float32), q,
                                                    np.zeros((2, 3), np.float32))),
        ("s_a", lambda: fs.merge_state_v2(q, np.zeros((2, 3), np.float32), q, np.zeros((3, 2), np.float32))),
        ("kv_cache_dtype", lambda: fs.reshape_and_cache_flash(k, v, k[None], v[None], np.zeros(1, np.int64),
                                                              "fp9", None, None)),
        ("slot_mapping", lambda: fs.reshape_and_cache_flash(k, v, k[None], v[None], np.zeros(1, np.int32),
                                                            "auto", None, None)),
        ("num_heads_kv", lambda: fs.get_scheduler_metadata(1, 1, 8, 3, 2, 16, np.array([8], np.int32))),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(arg + ":"), f"expected an error naming {arg}, got {e.value!r}"
    assert np.isnan(out).all(), "a rejected call wrote out"


def test_fa_versions():
    for v in (2, 3):
        assert fs.is_fa_version_supported(v, "cpu") and fs.fa_version_unsupported_reason(v, "cpu") is None
    for v in (1, 4):
        assert not fs.is_fa_version_supported(v)
        assert fs.fa_version_unsupported_reason(v).startswith("fa_version:")
    if not fs.WITH_CUDA:
        reason = fs.fa_version_unsupported_reason(2, "cuda:0")
        assert reason and "CUDA" in reason
