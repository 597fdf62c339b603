"""flashserve.fa3 (continued from test_fa3.py): flash_attn_with_kvcache (batched and varlen q,
paged and contiguous caches, cache_batch_idx, cache_leftpad, appending k/v with rotary inside the
call, fp8), flash_attn_combine and get_scheduler_metadata against the float reference of
torch_reference.py; keywords that are not implemented and bad inputs raise naming the argument;
every entry under torch.inference_mode, torch.compile(fullgraph=True) and CUDA graph capture
(skipped without CUDA)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
flashserve = pytest.importorskip("flashserve")
fa3 = pytest.importorskip("flashserve.fa3")

from helpers_torch import (HAS_CUDA, DEVICES, HALF_DTYPES, Case, capture, check_bits, check_close, check_lse,  # noqa: E402
                           check_out, cu_seqlens, fp8_descale, n_cases, poisoned, seq_lens)
from torch_reference import attention_ref, batched_ref, gather_paged, per_seq, varlen_ref  # noqa: E402
from fa3_cases import E4M3, draw_features, heads_dims, scaled  # noqa: E402


@pytest.fixture
def case(request) -> Case:
    return Case(request)


# ---------------------------------------------------------------- flash_attn_with_kvcache


class KvCase:
    """A KV cache (paged or contiguous) holding `lens` tokens per sequence, in rows chosen by
    cache_batch_idx (contiguous) or page_table rows (paged), with room for `extra` more."""

    def __init__(self, case: Case, device: str, dtype, batch: int, heads_kv: int, d: int, paged: bool,
                 lens: list[int], extra: int, batch_idx: bool, leftpad: bool) -> None:
        self.paged, self.batch, self.lens = paged, batch, lens
        cap = max(lens) + extra + case.rng.randint(0, 5)
        self.idx = None
        if paged:
            page = case.rng.choice([1, 4, 16])
            width = -(-cap // page)
            n_rows = batch + (2 if batch_idx else 0)
            num_pages = n_rows * width + 2
            self.k_cache, self.v_cache = (case.randn(num_pages, page, heads_kv, d, dtype=dtype, device=device)
                                          for _ in range(2))
            ids = torch.tensor(case.perm(num_pages)[: n_rows * width], dtype=torch.int32)
            self.table_all = ids.view(n_rows, width).to(device)
            if batch_idx:
                self.idx = torch.tensor(case.perm(n_rows)[:batch], dtype=torch.int32, device=device)
            self.page_table = self.table_all
            self.capacity = width * page
        else:
            n_rows = batch + (2 if batch_idx else 0)
            self.k_cache, self.v_cache = (case.randn(n_rows, cap, heads_kv, d, dtype=dtype, device=device)
                                          for _ in range(2))
            if batch_idx:
                self.idx = torch.tensor(case.perm(n_rows)[:batch], dtype=torch.int32, device=device)
            self.page_table = None
            self.capacity = cap
        self.leftpad = None
        if leftpad and not paged:
            self.leftpad = torch.tensor([case.rng.randint(0, n) for n in lens], dtype=torch.int32, device=device)

    def row(self, b: int) -> int:
        return int(self.idx[b]) if self.idx is not None else b

    def gather(self, cache: torch.Tensor, b: int, lo: int, hi: int) -> torch.Tensor:
        """Cache positions [lo, hi) of sequence b, float32 [n, H_kv, D]."""
        if self.paged:
            return gather_paged(cache, self.page_table[self.row(b)], hi)[lo:]
        return cache[self.row(b), lo:hi].float()

    def kw(self) -> dict:
        return dict(page_table=self.page_table, cache_batch_idx=self.idx, cache_leftpad=self.leftpad)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               interleaved: bool, compute=torch.float64) -> torch.Tensor:
    """x [n, H, D] rotated on its first 2 * cos.shape[1] channels at positions pos [n], in
    `compute` precision."""
    rd = 2 * cos.shape[1]
    inside = (pos < cos.shape[0])[:, None, None]
    idx = pos.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside, cos[idx].to(compute)[:, None, :], 1.0)
    s = torch.where(inside, sin[idx].to(compute)[:, None, :], 0.0)
    x = x.to(compute)
    head = x[..., :rd]
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
    else:
        x1, x2 = head[..., : rd // 2], head[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1)
    return torch.cat((rot, x[..., rd:]), -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qform", ["batched", "varlen"])
def test_kvcache(case: Case, device: str, paged: bool, qform: str) -> None:
    """flash_attn_with_kvcache without an append: batched q or varlen q (cu_seqlens_q,
    max_seqlen_q) over paged or contiguous caches, cache_seqlens tensor or int,
    cache_batch_idx, cache_leftpad (contiguous), qv-free features; out and lse layout."""
    dtype = torch.bfloat16
    for i in range(n_cases(device, 3, 10)):
        heads, heads_kv, d = heads_dims(case)
        batch = case.rng.randint(1, 3)
        lens = seq_lens(case, batch, 40, lo=4)
        kc = KvCase(case, device, dtype, batch, heads_kv, d, paged, lens, 0, case.rng.random() < 0.5,
                    case.rng.random() < 0.4)
        api, ref = draw_features(case, heads, device, chunk_ok=kc.leftpad is None)
        want_lse = case.rng.random() < 0.5
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        if qform == "batched":
            sq = case.rng.randint(1, 4)
            q_lens = [sq] * batch
            q = case.randn(batch, sq, heads, d, dtype=dtype, device=device)
            extra = {}
        else:
            q_lens = [case.rng.randint(0, 4) for _ in range(batch)]
            q = case.randn(sum(q_lens), heads, d, dtype=dtype, device=device)
            extra = dict(cu_seqlens_q=cu_seqlens(q_lens, device), max_seqlen_q=max(q_lens))
        cache_seqlens = seqlens
        if kc.leftpad is None and len(set(lens)) == 1 and case.rng.random() < 0.5:
            cache_seqlens = lens[0]
        case.desc = (f"case {i}: {qform} paged={paged} lens={lens} q_lens={q_lens} H={heads}/{heads_kv} D={d} "
                     f"idx={kc.idx} leftpad={kc.leftpad} {api} lse={want_lse}")
        res = fa3.flash_attn_with_kvcache(q, kc.k_cache, kc.v_cache, cache_seqlens=cache_seqlens,
                                          return_softmax_lse=want_lse, **kc.kw(), **extra, **api)
        out, lse = res if want_lse else (res, None)
        lo = [int(kc.leftpad[b]) if kc.leftpad is not None else 0 for b in range(batch)]
        keys = [kc.gather(kc.k_cache, b, lo[b], lens[b]) for b in range(batch)]
        values = [kc.gather(kc.v_cache, b, lo[b], lens[b]) for b in range(batch)]
        if qform == "batched":
            ref_o, ref_l = batched_ref(q, keys, values, **scaled(ref, d))
        else:
            ref_o, ref_l = varlen_ref(q, q_lens, keys, values, **scaled(ref, d))
        check_out(case, "out", out, ref_o, max(lens))
        if want_lse:
            check_lse(case, "softmax_lse", lse, ref_l)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("knew", ["batched", "varlen"])
def test_kvcache_append(case: Case, device: str, paged: bool, knew: str) -> None:
    """k/v appended inside the call at cache_seqlens (batched [B, s_new] or varlen with
    cu_seqlens_k_new), rotary on k and q (interleaved or not, rotary_dim <= D,
    rotary_seqlens), cache_batch_idx, cache_leftpad; the caches hold the new (rotated) tokens
    and nothing else changed; out is attention over the updated cache with the rotated q."""
    dtype = case.rng.choice(HALF_DTYPES)
    for i in range(n_cases(device, 4, 12)):
        heads, heads_kv, d = heads_dims(case)
        batch = case.rng.randint(1, 3)
        lens = seq_lens(case, batch, 30, lo=1)
        if knew == "batched":
            new = [case.rng.randint(1, 4)] * batch
        else:
            new = [case.rng.randint(0, 4) for _ in range(batch)]
        kc = KvCase(case, device, dtype, batch, heads_kv, d, paged, lens, max(new), case.rng.random() < 0.5,
                    case.rng.random() < 0.4)
        api, ref = draw_features(case, heads, device, chunk_ok=False)
        rotary = case.rng.random() < 0.7
        interleaved = case.rng.random() < 0.5
        rot_kw, base = {}, list(lens)
        if rotary:
            rd = case.rng.choice([d, d // 2, 32])
            n_ro = max(lens) + max(new) + case.rng.choice([0, 8])
            cos, sin = (torch.randn(n_ro, rd // 2, generator=case.gen).to(device) for _ in range(2))
            rot_kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
            if case.rng.random() < 0.3:
                base = [case.rng.randint(0, 20) for _ in range(batch)]
                rot_kw["rotary_seqlens"] = torch.tensor(base, dtype=torch.int32, device=device)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        if knew == "batched":
            k, v = (case.randn(batch, new[0], heads_kv, d, dtype=dtype, device=device) for _ in range(2))
            k_rows, v_rows = [k[b] for b in range(batch)], [v[b] for b in range(batch)]
            extra = {}
        else:
            k, v = (case.randn(sum(new), heads_kv, d, dtype=dtype, device=device) for _ in range(2))
            k_rows = [k[a:b] for a, b in per_seq(new)]
            v_rows = [v[a:b] for a, b in per_seq(new)]
            extra = dict(cu_seqlens_k_new=cu_seqlens(new, device))
        qform = case.rng.choice(["batched", "varlen"]) if knew == "batched" else "varlen"
        if qform == "batched":
            q = case.randn(batch, new[0], heads, d, dtype=dtype, device=device)
            q_lens = [new[0]] * batch
        else:
            q_lens = list(new)
            q = case.randn(sum(q_lens), heads, d, dtype=dtype, device=device)
            extra.update(cu_seqlens_q=cu_seqlens(q_lens, device), max_seqlen_q=max(max(q_lens), 1))
        case.desc = (f"case {i}: {dtype} paged={paged} k={knew} q={qform} lens={lens} new={new} H={heads}/{heads_kv} "
                     f"D={d} idx={kc.idx} leftpad={kc.leftpad} rotary={bool(rotary)} il={interleaved} "
                     f"base={base} {api}")
        k_before, v_before = kc.k_cache.clone(), kc.v_cache.clone()
        out = fa3.flash_attn_with_kvcache(q, kc.k_cache, kc.v_cache, k, v, cache_seqlens=seqlens,
                                          **kc.kw(), **extra, **rot_kw, **api)
        per_row = api["causal"] or "window_size" in api
        # Expected caches: the old ones with the new (rotated) rows at lens[b] + t.
        k_exp, v_exp = k_before.clone(), v_before.clone()
        for b in range(batch):
            pos = torch.arange(lens[b], lens[b] + new[b], device=device)
            kr = k_rows[b].float()
            if rotary:
                kr = rotate_ref(kr, cos, sin, pos - lens[b] + base[b], interleaved).float()
            for t in range(new[b]):
                p = lens[b] + t
                if paged:
                    blk = kc.page_table[kc.row(b), p // kc.k_cache.shape[1]]
                    k_exp[blk, p % kc.k_cache.shape[1]] = kr[t].to(dtype)
                    v_exp[blk, p % kc.k_cache.shape[1]] = v_rows[b][t]
                else:
                    k_exp[kc.row(b), p] = kr[t].to(dtype)
                    v_exp[kc.row(b), p] = v_rows[b][t]
        check_close(case, "k_cache", kc.k_cache, k_exp, *((1e-2, 1e-2) if dtype == torch.bfloat16 else (2e-3, 2e-3)))
        check_bits(case, "v_cache", kc.v_cache, v_exp)
        # Expected attention over the updated cache with q rotated at base + i (or base).
        lo = [int(kc.leftpad[b]) if kc.leftpad is not None else 0 for b in range(batch)]
        keys = [kc.gather(kc.k_cache, b, lo[b], lens[b] + new[b]) for b in range(batch)]
        values = [kc.gather(kc.v_cache, b, lo[b], lens[b] + new[b]) for b in range(batch)]
        q_rot = q
        if rotary:
            rows = q.reshape(-1, heads, d)
            pos = []
            for b in range(batch):
                pos += [base[b] + (j if per_row else 0) for j in range(q_lens[b])]
            q_rot = rotate_ref(rows, cos, sin, torch.tensor(pos, dtype=torch.long, device=device),
                               interleaved).to(dtype).view(q.shape)
        if qform == "batched":
            ref_o, _ = batched_ref(q_rot, keys, values, **scaled(ref, d))
        else:
            ref_o, _ = varlen_ref(q_rot, q_lens, keys, values, **scaled(ref, d))
        check_out(case, "out", out, ref_o, max(lens))


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_append_fp8(case: Case, device: str) -> None:
    """fp8 (e4m3) q, k, v and caches with descales [B, H_kv]: rotated new tokens appended to
    the fp8 cache, bf16 output."""
    for i in range(n_cases(device, 2, 6)):
        heads, heads_kv, d = heads_dims(case)
        batch = case.rng.randint(1, 3)
        lens = seq_lens(case, batch, 30, lo=1)
        kc = KvCase(case, device, E4M3, batch, heads_kv, d, True, lens, 1, False, False)
        k, v = (case.randn(batch, 1, heads_kv, d, device=device, scale=2.0).to(E4M3) for _ in range(2))
        q = case.randn(batch, 1, heads, d, device=device, scale=2.0).to(E4M3)
        cos = torch.cos(torch.rand(64, d // 4, generator=case.gen) * 6).to(device)
        sin = torch.sin(torch.rand(64, d // 4, generator=case.gen) * 6).to(device)
        q_ds, k_ds, v_ds = (fp8_descale(case, batch, heads_kv, device, True) for _ in range(3))
        case.desc = f"case {i}: lens={lens} H={heads}/{heads_kv} D={d}"
        out = case.call(fa3.flash_attn_with_kvcache, q, kc.k_cache, kc.v_cache, k, v, rotary_cos=cos,
                        rotary_sin=sin, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                        page_table=kc.page_table, causal=True, q_descale=q_ds, k_descale=k_ds, v_descale=v_ds)
        if out is None:
            continue
        assert out.dtype == torch.bfloat16
        for b in range(batch):
            got = kc.gather(kc.k_cache, b, lens[b], lens[b] + 1)
            # fp32 rotation (as the call computes it), rounded to the cache's fp8: bit-exact
            exp = rotate_ref(k[b].float(), cos, sin, torch.tensor([lens[b]], device=device), True, torch.float32)
            check_bits(case, f"k_cache row of sequence {b}", got.to(E4M3), exp.to(E4M3))
        keys = [kc.gather(kc.k_cache, b, 0, lens[b] + 1) * k_ds[b].float()[None, :, None] for b in range(batch)]
        values = [kc.gather(kc.v_cache, b, 0, lens[b] + 1) * v_ds[b].float()[None, :, None] for b in range(batch)]
        q_rot = torch.stack([rotate_ref(q[b].float(), cos, sin, torch.tensor([lens[b]], device=device), True,
                                        torch.float32).to(E4M3) for b in range(batch)])
        ref_o, _ = batched_ref(q_rot, keys, values, q_descale=q_ds, scale=d ** -0.5, causal=True)
        check_out(case, "out", out, ref_o, max(lens))
    case.done()


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_cu_seqlens_k_new_without_k(case: Case, device: str) -> None:
    """SGLang passes cu_seqlens_k_new without k/v: ignored, as FA3 does (bit-equal results)."""
    kc = KvCase(case, device, torch.bfloat16, 2, 2, 64, True, [5, 17], 0, False, False)
    q = case.randn(3, 4, 64, dtype=torch.bfloat16, device=device)
    kw = dict(cache_seqlens=torch.tensor([5, 17], dtype=torch.int32, device=device), page_table=kc.page_table,
              cu_seqlens_q=cu_seqlens([1, 2], device), max_seqlen_q=2, causal=True, num_splits=1)
    a = fa3.flash_attn_with_kvcache(q, kc.k_cache, kc.v_cache, **kw)
    b = fa3.flash_attn_with_kvcache(q, kc.k_cache, kc.v_cache, cu_seqlens_k_new=cu_seqlens([5, 17], device), **kw)
    check_bits(case, "out", b, a)


# ---------------------------------------------------------------- flash_attn_combine

@pytest.mark.parametrize("device", DEVICES)
def test_combine(case: Case, device: str) -> None:
    """Partial states over the split axis merge as SPEC.md §4 (split attention over KV ranges
    equals attention over the whole range); empty rows give 0 / -inf; out= and out_dtype."""
    heads, d, sq = 4, 64, 5
    sk = 40
    q = case.randn(sq, heads, d, device=device)
    k, v = (case.randn(sk, heads, d, device=device) for _ in range(2))
    bounds = sorted(case.rng.sample(range(1, sk), 2))
    parts = [(0, bounds[0]), (bounds[0], bounds[1]), (bounds[1], sk), (sk, sk)]  # the last one empty
    outs, lses = [], []
    for lo, hi in parts:
        o, l = attention_ref(q, k[lo:hi], v[lo:hi], scale=d ** -0.5)
        outs.append(o)
        lses.append(l.T)  # [sq, H]
    out_partial, lse_partial = torch.stack(outs), torch.stack(lses)
    lse_partial[3, 0, 0] = math.inf  # +inf counts as -inf
    full_o, full_l = attention_ref(q, k, v, scale=d ** -0.5)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == torch.float32 and tuple(out.shape) == (sq, heads, d) and tuple(lse.shape) == (sq, heads)
    check_close(case, "out", out, full_o, 1e-5, 1e-5)
    check_close(case, "lse", lse, full_l.T, 1e-5, 1e-5)
    given = poisoned((sq, heads, d), torch.bfloat16, device)
    res, _ = fa3.flash_attn_combine(out_partial, lse_partial, out=given)
    assert res is given
    check_out(case, "out=", given, full_o)
    res, _ = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    assert res.dtype == torch.float16
    empty_o, empty_l = fa3.flash_attn_combine(out_partial[3:], lse_partial[3:])
    assert (empty_o == 0).all() and (empty_l == -math.inf).all()


# ---------------------------------------------------------------- scheduler metadata

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_scheduler_metadata_inference_mode_and_copy(case: Case, device: str, num_splits: int) -> None:
    """get_scheduler_metadata under torch.inference_mode, copied into a slice of a persistent
    buffer (as engines do), then passed to the call: the same result as with num_splits."""
    kc = KvCase(case, device, torch.bfloat16, 3, 2, 64, True, [7, 30, 12], 0, False, False)
    q = case.randn(3, 1, 8, 64, dtype=torch.bfloat16, device=device)
    seqlens = torch.tensor([7, 30, 12], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=seqlens, page_table=kc.page_table, causal=True)
    with torch.inference_mode():
        md = fa3.get_scheduler_metadata(3, 1, kc.capacity, 8, 2, 64, seqlens, page_size=kc.k_cache.shape[1],
                                        causal=True, num_splits=num_splits)
        assert md.dtype == torch.int32 and md.dim() == 1 and md.device.type == device
        buffer = torch.zeros(400, dtype=torch.int32, device=device)
        n = md.shape[0]
        buffer[:n] = md
        buffer[n:] = 0
        got = fa3.flash_attn_with_kvcache(q, kc.k_cache, kc.v_cache, scheduler_metadata=buffer[:n], **kw)
        direct = fa3.flash_attn_with_kvcache(q, kc.k_cache, kc.v_cache, scheduler_metadata=md, **kw)
    check_bits(case, "copied metadata vs the original", got, direct)
    keys = [kc.gather(kc.k_cache, b, 0, n_) for b, n_ in enumerate([7, 30, 12])]
    values = [kc.gather(kc.v_cache, b, 0, n_) for b, n_ in enumerate([7, 30, 12])]
    ref_o, _ = batched_ref(q, keys, values, scale=64 ** -0.5, causal=True)
    check_out(case, "out", got, ref_o)


# ---------------------------------------------------------------- errors

def _small(device: str):
    bf16 = torch.bfloat16
    q = torch.randn(2, 1, 4, 64, dtype=bf16, device=device)
    kc, vc = (torch.randn(6, 16, 2, 64, dtype=bf16, device=device) for _ in range(2))
    pt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    return q, kc, vc, pt, seqlens


@pytest.mark.parametrize("device", DEVICES)
def test_not_implemented_keywords(device: str) -> None:
    """Keywords flashserve does not implement raise NotImplementedError naming them."""
    q, kc, vc, pt, seqlens = _small(device)
    cu = cu_seqlens([1, 1], device)
    cases = [
        ("seqused_q", lambda: fa3.flash_attn_varlen_func(q[:, 0], kc, vc, cu, None, 1, 32, seqused_q=seqlens,
                                                         seqused_k=seqlens, page_table=pt)),
        ("sm_margin", lambda: fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=pt,
                                                          sm_margin=4)),
        ("sm_margin", lambda: fa3.flash_attn_func(q, kc[:2], vc[:2], sm_margin=1)),
        ("sm_margin", lambda: fa3.get_scheduler_metadata(2, 1, 32, 4, 2, 64, seqlens, sm_margin=1)),
        ("cache_leftpad", lambda: fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=pt,
                                                              cache_leftpad=seqlens)),
    ]
    for name, call in cases:
        with pytest.raises(NotImplementedError, match=f"^{name}:"):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_name_the_argument(device: str) -> None:
    """Invalid inputs raise ValueError naming FA3's argument, before anything is written."""
    q, kc, vc, pt, seqlens = _small(device)
    k_new = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16, device=device)
    cos = torch.randn(32, 16, device=device)
    cases = [
        ("page_table", dict(page_table=pt.long())),
        ("cache_seqlens", dict(page_table=pt, cache_seqlens=seqlens.long())),
        ("sinks", dict(page_table=pt, sinks=torch.zeros(3, device=device))),
        ("window_size", dict(page_table=pt, window_size=(1, 2, 3))),
        ("ver", dict(page_table=pt, ver=2)),
        ("attention_chunk", dict(page_table=pt, attention_chunk=-1)),
        ("rotary_cos", dict(page_table=pt, rotary_cos=cos, rotary_sin=cos)),
        ("rotary_sin", dict(page_table=pt, rotary_cos=cos, k=k_new, v=k_new)),
        ("v", dict(page_table=pt, k=k_new)),
        ("k", dict(page_table=pt, k=k_new.half(), v=k_new.half())),
        ("cu_seqlens_k_new", dict(page_table=pt, k=k_new[:, 0], v=k_new[:, 0])),
        ("max_seqlen_q", dict(page_table=pt, cu_seqlens_q=cu_seqlens([1, 1], device))),
    ]
    for name, kw in cases:
        kw.setdefault("cache_seqlens", seqlens)
        before = kc.clone()
        with pytest.raises(ValueError, match=f"^{name}:"):
            fa3.flash_attn_with_kvcache(q, kc, vc, **kw)
            pytest.fail(f"{name}: no error")
        assert torch.equal(kc, before), f"{name}: a rejected call wrote the cache"
    # The append is checked with the attention: a bad q rejects the call before the write.
    before = kc.clone()
    with pytest.raises(ValueError, match="^k_cache: expected a number of KV heads"):
        fa3.flash_attn_with_kvcache(q[..., :3, :], kc, vc, k_new, k_new, cache_seqlens=seqlens, page_table=pt)
    assert torch.equal(kc, before), "a rejected append wrote the cache"
    with pytest.raises(ValueError, match="^page_table:"):
        fa3.flash_attn_varlen_func(q[:, 0], kc, vc, cu_seqlens([1, 1], device), None, 1, 32, seqused_k=seqlens,
                                   page_table=pt.long())
    with pytest.raises(ValueError, match="^lse_partial:"):
        fa3.flash_attn_combine(torch.zeros(2, 3, 4, 8, device=device), torch.zeros(2, 3, 5, device=device))


# ---------------------------------------------------------------- inference mode, compile, graphs

def every_entry(q, k_cache, v_cache, page_table, seqlens, k_new, v_new, cos, sin, cu_q, md):
    """One call of each fa3 entry (and merge_state_v2 through flashserve.sgl) on a decode step."""
    from flashserve.sgl import merge_state_v2
    batch, _, heads, d = q.shape
    out1, lse1 = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=seqlens, page_table=page_table, causal=True,
                                             return_softmax_lse=True, num_splits=1, scheduler_metadata=md)
    out2, lse2 = fa3.flash_attn_varlen_func(q.view(batch, heads, d), k_cache, v_cache, cu_q, None, 1,
                                            page_table.shape[1] * k_cache.shape[1], seqused_k=seqlens + 1,
                                            page_table=page_table, causal=True, return_softmax_lse=True)
    out3 = fa3.flash_attn_func(q, q, q, causal=True)
    comb, comb_lse = fa3.flash_attn_combine(torch.stack([out1[:, 0].float(), out2.float()]),
                                            torch.stack([lse1[:, :, 0], lse2.T]))
    merged, merged_lse = merge_state_v2(out2, lse2.T.contiguous(), out1[:, 0], lse1[:, :, 0].contiguous())
    return out1, lse1, out2, lse2, out3, comb, comb_lse, merged, merged_lse


def entry_inputs(case: Case, device: str):
    batch, heads, heads_kv, d = 3, 4, 2, 64
    kc = KvCase(case, device, torch.bfloat16, batch, heads_kv, d, True, [9, 30, 1], 1, False, False)
    kc.page_table = kc.page_table.contiguous()
    q = case.randn(batch, 1, heads, d, dtype=torch.bfloat16, device=device)
    k_new, v_new = (case.randn(batch, 1, heads_kv, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    cos, sin = (torch.randn(64, d // 2, generator=case.gen).to(device) for _ in range(2))
    seqlens = torch.tensor([9, 30, 1], dtype=torch.int32, device=device)
    md = fa3.get_scheduler_metadata(batch, 1, kc.capacity, heads, heads_kv, d, seqlens, page_size=kc.k_cache.shape[1],
                                    causal=True, num_splits=1)
    return kc, dict(q=q, page_table=kc.page_table, seqlens=seqlens, k_new=k_new, v_new=v_new, cos=cos, sin=sin,
                    cu_q=cu_seqlens([1] * batch, device), md=md)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode(case: Case, device: str) -> None:
    """Every entry under torch.inference_mode equals the same calls outside it (bit for bit)."""
    kc, args = entry_inputs(case, device)
    caches = [(kc.k_cache.clone(), kc.v_cache.clone()) for _ in range(2)]
    eager = every_entry(k_cache=caches[0][0], v_cache=caches[0][1], **args)
    with torch.inference_mode():
        args_inf = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        k_c, v_c = caches[1][0].clone(), caches[1][1].clone()
        got = every_entry(k_cache=k_c, v_cache=v_c, **args_inf)
    for i, (a, b) in enumerate(zip(got, eager)):
        check_bits(case, f"inference_mode result {i}", a, b)
    check_bits(case, "k_cache", k_c, caches[0][0])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(case: Case, device: str) -> None:
    """torch.compile(fullgraph=True) of every entry (append + rotary included) equals eager,
    caches included (CPU: aot_eager, bit for bit; CUDA: inductor, within rounding of the
    rotary and combine math it fuses); get_scheduler_metadata compiles too."""
    kc, args = entry_inputs(case, device)
    caches = [(kc.k_cache.clone(), kc.v_cache.clone()) for _ in range(2)]
    torch._dynamo.reset()
    backend = "aot_eager" if device == "cpu" else "inductor"
    compiled = torch.compile(every_entry, fullgraph=True, backend=backend)
    eager = every_entry(k_cache=caches[0][0], v_cache=caches[0][1], **args)
    got = compiled(k_cache=caches[1][0], v_cache=caches[1][1], **args)

    def same(what, a, b):  # inductor may contract the rotary / combine math into FMAs
        if device == "cpu":
            check_bits(case, what, a, b)
        else:
            check_close(case, what, a, b, 2e-2, 2e-2)
    for i, (a, b) in enumerate(zip(got, eager)):
        same(f"compiled result {i}", a, b)
    same("compiled k_cache", caches[1][0], caches[0][0])
    check_bits(case, "compiled v_cache", caches[1][1], caches[0][1])

    def metadata(seqlens):
        return fa3.get_scheduler_metadata(3, 1, 64, 4, 2, 64, seqlens, page_size=16, causal=True, num_splits=0)
    md_c = torch.compile(metadata, fullgraph=True, backend=backend)(args["seqlens"])
    md_e = metadata(args["seqlens"])
    assert torch.equal(md_c.cpu(), md_e.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_new_arguments(case: Case, device: str) -> None:
    """torch.library.opcheck of flashserve::scheduler_metadata and of kvcache_fwd with q_v and
    chunk_size (the arguments the fa3 entries added)."""
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flashserve.scheduler_metadata.default,
                          (2, 1, 32, 4, 2, 64, 64, seqlens, None, 16, True, False, 0), test_utils=tests)
    q = case.randn(2, 1, 4, 64, dtype=torch.bfloat16, device=device)
    qv = case.randn(2, 1, 4, 512, dtype=torch.bfloat16, device=device)
    k = case.randn(2, 12, 1, 64, dtype=torch.bfloat16, device=device)
    v = case.randn(2, 12, 1, 512, dtype=torch.bfloat16, device=device)
    out = torch.empty(2, 1, 4, 512, dtype=torch.bfloat16, device=device)
    args = (q, k, v, out, None, seqlens, None, None, 0.0, True, -1, -1, 0.0, None, None, None, None, None, 1, None,
            1, 0, None, qv, 4)
    try:
        torch.ops.flashserve.kvcache_fwd.default(*args)
    except NotImplementedError as e:
        pytest.skip(f"not implemented on this device: {e}")
    torch.library.opcheck(torch.ops.flashserve.kvcache_fwd.default, args, test_utils=tests)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graph capture needs CUDA")
@pytest.mark.parametrize("append", [False, True], ids=["read", "append_rotary"])
def test_cuda_graph_capture(case: Case, append: bool) -> None:
    """SGLang's decode call captured with every length 0 and replayed with real lengths: the
    varlen-q form (cu_seqlens_q, cu_seqlens_k_new, page_table), with or without appending
    rotated k/v inside the call; each replay equals the reference."""
    device, batch, heads, heads_kv, d, page, width = "cuda", 4, 8, 2, 128, 16, 8
    num_pages = batch * width + 4
    k_cache, v_cache = (torch.zeros(num_pages, page, heads_kv, d, dtype=torch.bfloat16, device=device)
                        for _ in range(2))
    page_table = torch.zeros(batch, width, dtype=torch.int32, device=device)
    seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    q = torch.zeros(batch, heads, d, dtype=torch.bfloat16, device=device)
    k_new, v_new = (torch.zeros(batch, 1, heads_kv, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    cos, sin = (torch.randn(width * page, d // 2, generator=case.gen).to(device) for _ in range(2))
    cu_q = cu_seqlens([1] * batch, device)
    md = fa3.get_scheduler_metadata(batch, 1, width * page, heads, heads_kv, d, seqlens, page_size=page,
                                    causal=True, cu_seqlens_q=cu_q)
    result = {}

    def call():
        kw = dict(k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin) if append else dict(cu_seqlens_k_new=cu_k)
        result["out"] = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=page_table,
                                                    cu_seqlens_q=cu_q, max_seqlen_q=1, causal=True,
                                                    scheduler_metadata=md, **kw)

    graph = capture(call, warmup=1)
    for step in range(3):
        lens = [case.rng.randint(0, width * page - 1) for _ in range(batch)]
        case.desc = f"step {step}: lens={lens}"
        k_cache.copy_(torch.randn(k_cache.shape, generator=case.gen).to(k_cache))
        v_cache.copy_(torch.randn(v_cache.shape, generator=case.gen).to(v_cache))
        page_table.copy_(torch.tensor(case.perm(num_pages)[: batch * width], dtype=torch.int32).view(batch, width))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        cu_k.copy_(cu_seqlens(lens, "cpu"))
        q.copy_(torch.randn(q.shape, generator=case.gen).to(q))
        k_new.copy_(torch.randn(k_new.shape, generator=case.gen).to(k_new))
        v_new.copy_(torch.randn(v_new.shape, generator=case.gen).to(v_new))
        graph.replay()
        torch.cuda.synchronize()
        total = [n + (1 if append else 0) for n in lens]
        keys = [gather_paged(k_cache, page_table[b], n) for b, n in enumerate(total)]
        values = [gather_paged(v_cache, page_table[b], n) for b, n in enumerate(total)]
        q_ref = q
        if append:
            q_ref = rotate_ref(q, cos, sin, torch.tensor(lens, device=device), True).to(q.dtype)
            for b, n in enumerate(lens):
                exp = rotate_ref(k_new[b].float(), cos, sin, torch.tensor([n], device=device), True).float()
                check_close(case, f"appended k of sequence {b}", keys[b][n:], exp, 1e-2, 1e-2)
        ref_o, _ = varlen_ref(q_ref, [1] * batch, keys, values, scale=d ** -0.5, causal=True)
        check_out(case, "replayed out", result["out"], ref_o, max(total))
