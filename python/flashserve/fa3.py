"""FlashAttention-3's `flash_attn_interface` (hopper/flash_attn_interface.py), which sgl_kernel
re-exports: the same function names, argument order, defaults and return conventions, plus
SGLang's keywords `sinks` (per-head sink logits, flashserve's s_aux) and `ver`
(PYTHON_API.md, "The FlashAttention-3 / SGLang surface"). `from flashserve.fa3 import ...`
replaces either import. Requires torch.

Each function is an adapter: it translates FA3's conventions into one call of the package's
attention operations (torch ops flashserve::varlen_fwd / kvcache_fwd while torch.compile
traces, the same functions directly otherwise); flash_attn_with_kvcache's appended tokens
(k, v) are written through flashserve::reshape_and_cache_flash, with the rotary embedding
computed by torch ops on the device (no host synchronization, a few small allocations), so
the calls work under torch.inference_mode, torch.compile(fullgraph=True) and CUDA graph
capture. Forward only: inputs that require grad are read without recording a graph.

Keywords that change nothing in flashserve's result are accepted: pack_gqa (the planner packs
GQA heads itself), deterministic (the forward is deterministic), ver 3 or 4 (one
implementation); as in FA3, cu_seqlens_k_new without k/v, rotary_seqlens and
rotary_interleaved without rotary tensors, and max_seqlen_q with a batched q have no effect.
flash_attn_with_kvcache(return_softmax_lse=True) returns (out, softmax_lse); FA3 appends its
split accumulators, which callers unpack as `out, lse, *rest`. Not implemented
(NotImplementedError naming the keyword): seqused_q, sm_margin != 0, cache_leftpad with
page_table. Errors name FA3's arguments (page_table, sinks, qv, attention_chunk, ...).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _calls, _dispatch
from ._api import _not_implemented, _out_dtype, _scale
from ._api import _window as _api_window
from ._tensors import not_a_tensor, renamed

_VERSIONS = (3, 4)
_FP8_CACHE = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}

# C++ argument names -> FA3's, for error messages.
_NAMES = {"window": "window_size", "block_table": "page_table", "s_aux": "sinks", "q_v": "qv",
          "chunk_size": "attention_chunk"}
_KVCACHE_NAMES = dict(_NAMES, k="k_cache", v="v_cache", seqused_k="cache_seqlens")
_WRITE_NAMES = {"key": "k", "value": "v", "key_cache": "k_cache", "value_cache": "v_cache"}


def _window(window_size: Any) -> tuple:
    """(left, right) from None, a tuple, a list (_api._window) or a 2-element tensor (read on
    the host)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2:
            raise ValueError(f"window_size: expected (left, right), got a tensor of shape {list(window_size.shape)}")
        window_size = window_size.tolist()
    return _api_window(window_size)


def _check_common(sm_margin: int, ver: int, attention_chunk: int) -> None:
    if ver not in _VERSIONS:
        raise ValueError(f"ver: expected 3 or 4, got {ver!r}")
    if sm_margin != 0:
        raise _not_implemented("sm_margin", sm_margin)
    if attention_chunk < 0:
        raise ValueError(f"attention_chunk: expected >= 0, got {attention_chunk}")


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False, sinks=None) -> Any:
    """Dense batch: q [B, Sq, H, D], k [B, Sk, H_kv, D], v [B, Sk, H_kv, Dv]. Returns out
    [B, Sq, H, Dv], or (out, softmax_lse [B, H, Sq] fp32) with return_attn_probs."""
    _check_common(sm_margin, 3, attention_chunk)
    left, right = _window(window_size)
    q, k, v, qv, sinks = (_detach(x) for x in (q, k, v, qv, sinks))
    try:
        out = torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=_out_dtype(q), device=q.device)
        lse = (torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
               if return_attn_probs else None)
    except (AttributeError, TypeError):
        raise not_a_tensor(q=q, v=v) from None
    call = _dispatch.call("kvcache_fwd")
    try:
        call(q, k, v, out, lse, None, None, None, _scale(softmax_scale), causal, left, right, softcap,
             None, sinks, q_descale, k_descale, v_descale, num_splits, None, 1, 0, None, qv, attention_chunk)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, dict(_NAMES, k="k", v="v", seqused_k="k")) from None
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, return_softmax_lse=False, sinks=None, ver=3,
                           page_table=None) -> Any:
    """Varlen: q [total_q, H, D]; k/v contiguous [total_k, H_kv, D] (cu_seqlens_k, seqused_k
    optional) or paged caches [num_blocks, page_size, H_kv, D] with page_table and seqused_k.
    Returns out [total_q, H, Dv], or (out, softmax_lse [H, total_q] fp32) with
    return_softmax_lse or return_attn_probs."""
    _check_common(sm_margin, ver, attention_chunk)
    if seqused_q is not None:
        raise _not_implemented("seqused_q", "a tensor")
    left, right = _window(window_size)
    q, k, v, qv, sinks = (_detach(x) for x in (q, k, v, qv, sinks))
    want_lse = return_softmax_lse or return_attn_probs
    try:
        out = torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=_out_dtype(q), device=q.device)
        lse = torch.empty((q.shape[-2], q.shape[0]), dtype=torch.float32, device=q.device) if want_lse else None
    except (AttributeError, TypeError):
        raise not_a_tensor(q=q, v=v) from None
    call = _dispatch.call("varlen_fwd")
    try:
        call(q, k, v, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, lse, cu_seqlens_k, seqused_k, page_table,
             qv, _scale(softmax_scale), causal, left, right, softcap, None, sinks, q_descale, k_descale,
             v_descale, num_splits, None, 1, 0, None, attention_chunk)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _NAMES) from None
    return (out, lse) if want_lse else out


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None) -> tuple:
    """Merges partial states over the leading split axis (SPEC.md §4): out_partial
    [splits, ..., Dv] fp32, lse_partial [splits, ...] fp32. Returns (out [..., Dv] in out_dtype
    (default out_partial's dtype; out= when given), lse [...] fp32). +inf LSEs count as -inf;
    rows with no state give out 0, lse -inf."""
    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise not_a_tensor(out_partial=out_partial, lse_partial=lse_partial)
    if out_partial.dim() < 2 or tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial: expected shape {list(out_partial.shape[:-1])} (out_partial without its "
                         f"last dim), got {list(lse_partial.shape)}")
    if lse_partial.dtype != torch.float32:
        raise ValueError(f"lse_partial: expected float32, got {lse_partial.dtype}")
    if out is not None and tuple(out.shape) != tuple(out_partial.shape[1:]):
        raise ValueError(f"out: expected shape {list(out_partial.shape[1:])}, got {list(out.shape)}")
    out_partial, lse_partial = out_partial.detach(), lse_partial.detach()
    lse_in = lse_partial.masked_fill(lse_partial == float("inf"), float("-inf"))
    top = lse_in.amax(dim=0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse_in - top)
    total = weights.sum(dim=0)
    lse = torch.where(total > 0, top + torch.log(total), torch.full_like(top, float("-inf")))
    scale = torch.where(total > 0, weights / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    merged = (scale.unsqueeze(-1) * out_partial.float()).sum(dim=0)
    if out is not None:
        out.copy_(merged)
        return out, lse
    return merged.to(out_partial.dtype if out_dtype is None else out_dtype), lse


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
    cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
    cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
    q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False,
    sinks=None, ver=3,
) -> Any:
    """Attention over a KV cache, appending k/v first when given.

    q: batched [B, sq, H, D], or varlen [total_q, H, D] with cu_seqlens_q and max_seqlen_q.
    Caches: contiguous [B_cache, S_cache, H_kv, D] (rows chosen by cache_batch_idx) or paged
    [num_blocks, page_size, H_kv, D] with page_table [B, max_pages] (its rows chosen by
    cache_batch_idx). cache_seqlens: int32 [B] or an int; None: the whole cache.
    k, v: [B, s_new, H_kv, D] or, with cu_seqlens_k_new, [total_new, H_kv, D]: written at cache
    positions cache_seqlens[b] + t, then attended to. rotary_cos/sin [seqlen_ro, rotary_dim / 2]
    rotate k and q (interleaved or GPT-NeoX halves) at positions (rotary_seqlens or
    cache_seqlens)[b] + t; q rows at + i when causal or local, else all at the base. With
    cache_leftpad (contiguous caches), sequence b's keys are positions [leftpad[b], end).
    Returns out [.., H, Dv] (bf16 for fp8 q), or (out, softmax_lse) with return_softmax_lse:
    [B, H, sq] batched, [H, total_q] varlen."""
    _check_common(sm_margin, ver, attention_chunk)
    left, right = _window(window_size)
    q, k_cache, v_cache, k, v, qv, sinks, rotary_cos, rotary_sin = (
        _detach(x) for x in (q, k_cache, v_cache, k, v, qv, sinks, rotary_cos, rotary_sin))
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise not_a_tensor(**{name: x})
    varlen = cu_seqlens_q is not None
    if varlen:
        if max_seqlen_q is None:
            raise ValueError("max_seqlen_q: expected an int with cu_seqlens_q, got None")
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
            raise ValueError(f"cu_seqlens_q: expected an int32 [B+1] tensor, got {cu_seqlens_q!r}")
        batch = cu_seqlens_q.shape[0] - 1
    else:
        if q.dim() != 4:
            raise ValueError(f"q: expected [B, sq, H, D] (or [total_q, H, D] with cu_seqlens_q), got {list(q.shape)}")
        batch = q.shape[0]
    paged = page_table is not None
    if paged and cache_leftpad is not None:
        raise _not_implemented("cache_leftpad", "a tensor with page_table")
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if v is None else 'k'}: expected a tensor with {'k' if v is None else 'v'}, got None")
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError(f"{'rotary_sin' if rotary_sin is None else 'rotary_cos'}: expected a tensor with "
                             f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'}, got None")
        if k is None:
            raise ValueError("rotary_cos: applies to appended tokens: expected k and v, got None")
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens: expected the cache lengths before the append (k, v given), got None")
    device = q.device
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    rows = cache_batch_idx
    if paged and cache_batch_idx is not None:
        page_table = page_table.index_select(0, cache_batch_idx.long())
        rows = None  # the gathered page_table rows are the batch's

    # Keys each sequence attends to: [leftpad, end) of its cache row.
    seqused = cache_seqlens
    new_rows = None
    if k is not None:
        new_rows = _new_rows(k, cu_seqlens_k_new, batch, device)
        seqused = cache_seqlens + new_rows[2]
    k_attn, v_attn, table, batch_idx = k_cache, v_cache, page_table, rows
    if cache_leftpad is not None:
        k_attn, v_attn, table, seqused = _leftpad_view(k_cache, v_cache, cache_leftpad, rows, seqused, batch, device)
        batch_idx = None
    if varlen and table is None:  # a contiguous cache is paged with one page of S_cache per row
        table = (rows if rows is not None else torch.arange(batch, dtype=torch.int32, device=device)).int()[:, None]
        batch_idx = None
        if seqused is None:
            seqused = torch.full((batch,), k_cache.shape[1], dtype=torch.int32, device=device)
    if table is not None and seqused is None:  # paged without lengths: the whole table
        seqused = torch.full((batch,), table.shape[1] * k_attn.shape[1], dtype=torch.int32, device=device)

    out = torch.empty(tuple(q.shape[:-1]) + (v_cache.shape[-1],), dtype=_out_dtype(q), device=device)
    lse = None
    if return_softmax_lse:
        lse_shape = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
    scale = _scale(softmax_scale)

    def attend(query: Any, mode: Optional[int] = None) -> None:
        if varlen:
            args = (query, k_attn, v_attn, out, cu_seqlens_q, max_seqlen_q, table.shape[1] * k_attn.shape[1], lse,
                    None, seqused, table, qv, scale, causal, left, right, softcap, None, sinks, q_descale,
                    k_descale, v_descale, num_splits, scheduler_metadata, 1, 0, None, attention_chunk)
            name = "varlen_fwd"
        else:
            args = (query, k_attn, v_attn, out, lse, seqused, batch_idx, table, scale, causal, left, right,
                    softcap, None, sinks, q_descale, k_descale, v_descale, num_splits, scheduler_metadata,
                    1, 0, None, qv, attention_chunk)
            name = "kvcache_fwd"
        try:
            if mode is None:
                _dispatch.call(name)(*args)
            else:
                getattr(_calls, name)(*args, mode=mode)
        except (ValueError, NotImplementedError) as e:
            raise renamed(e, _KVCACHE_NAMES) from None

    if k is None:
        attend(q)
    else:
        if not _compiling():  # a rejected call writes nothing: check the attention before the append
            attend(q, _calls.VALIDATE)
        base = rotary_seqlens if rotary_seqlens is not None else cache_seqlens
        rotary = None
        if rotary_cos is not None:
            rotary = _Rotary(rotary_cos, rotary_sin, rotary_interleaved, q.shape[-1])
        _append(k, v, k_cache, v_cache, page_table, rows, cache_seqlens, new_rows, base, rotary)
        if rotary is not None:
            q = _rotate_q(q, rotary, base, cu_seqlens_q, causal or (left, right) != (-1, -1) or attention_chunk > 0)
        attend(q)
    return (out, lse) if return_softmax_lse else out


def _new_rows(k: Any, cu_seqlens_k_new: Any, batch: int, device: Any) -> tuple:
    """(sequence of each new token, its index t in the sequence, new tokens per sequence):
    k [B, s_new, H_kv, D], or [total_new, H_kv, D] with cu_seqlens_k_new."""
    if k.dim() == 4:
        if k.shape[0] != batch:
            raise ValueError(f"k: expected [B={batch}, s_new, H_kv, D], got {list(k.shape)}")
        s_new = k.shape[1]
        token = torch.arange(batch * s_new, device=device)
        return token // s_new, token % s_new, torch.full((batch,), s_new, dtype=torch.int32, device=device)
    if k.dim() != 3 or cu_seqlens_k_new is None:
        raise ValueError(f"cu_seqlens_k_new: expected an int32 [B+1] tensor with k [total_new, H_kv, D] "
                         f"(k {list(k.shape)})")
    if cu_seqlens_k_new.dim() != 1 or cu_seqlens_k_new.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k_new: expected [B+1={batch + 1}], got {list(cu_seqlens_k_new.shape)}")
    token = torch.arange(k.shape[0], device=device)
    starts = cu_seqlens_k_new.long()
    seq = torch.searchsorted(starts, token, right=True) - 1
    return seq, token - starts[seq], (starts[1:] - starts[:-1]).int()


class _Rotary:
    """cos/sin [seqlen_ro, rotary_dim / 2] and the rotation of the first rotary_dim channels."""

    def __init__(self, cos: Any, sin: Any, interleaved: bool, head_dim: int) -> None:
        if cos.dim() != 2 or tuple(sin.shape) != tuple(cos.shape):
            raise ValueError(f"rotary_sin: expected the shape of rotary_cos {list(cos.shape)} "
                             f"([seqlen_ro, rotary_dim / 2]), got {list(sin.shape)}")
        if 2 * cos.shape[1] > head_dim:
            raise ValueError(f"rotary_cos: expected rotary_dim / 2 <= D / 2 = {head_dim // 2}, got {cos.shape[1]}")
        self.cos, self.sin, self.interleaved, self.dim = cos, sin, interleaved, 2 * cos.shape[1]

    def __call__(self, x: Any, pos: Any) -> Any:
        """x [N, H, D] rotated at positions pos [N] (beyond seqlen_ro: unrotated), in fp32."""
        n_ro = self.cos.shape[0]
        inside = (pos < n_ro)[:, None, None]
        idx = pos.clamp(0, n_ro - 1)
        cos = torch.where(inside, self.cos[idx].float()[:, None, :], 1.0)
        sin = torch.where(inside, self.sin[idx].float()[:, None, :], 0.0)
        xf = x.float()
        head, tail = xf[..., :self.dim], xf[..., self.dim:]
        if self.interleaved:
            x1, x2 = head[..., 0::2], head[..., 1::2]
            rot = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            x1, x2 = head[..., :self.dim // 2], head[..., self.dim // 2:]
            rot = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return torch.cat((rot, tail), dim=-1)


def _rotate_q(q: Any, rotary: _Rotary, base: Any, cu_seqlens_q: Any, per_row: bool) -> Any:
    """q rotated at base[b] + i (per_row) or base[b], back in q's dtype."""
    base = base.long()
    if cu_seqlens_q is None:
        batch, sq = q.shape[0], q.shape[1]
        i = torch.arange(sq, device=q.device)
        pos = base[:, None] + (i[None, :] if per_row else 0 * i[None, :])
        rows = q.reshape(batch * sq, q.shape[2], q.shape[3])
        return rotary(rows, pos.reshape(-1)).to(q.dtype).view(q.shape)
    starts = cu_seqlens_q.long()
    token = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(starts, token, right=True) - 1
    seq = seq.clamp(0, starts.shape[0] - 2)
    pos = base[seq] + ((token - starts[seq]) if per_row else 0)
    return rotary(q, pos).to(q.dtype)


def _append(k: Any, v: Any, k_cache: Any, v_cache: Any, page_table: Any, rows: Any, cache_seqlens: Any,
            new_rows: tuple, base: Any, rotary: Optional[_Rotary]) -> None:
    """Writes the new tokens (rotated k) at cache positions cache_seqlens[b] + t through
    flashserve::reshape_and_cache_flash; positions past the cache are skipped."""
    seq, t, _ = new_rows
    pos = cache_seqlens.long()[seq] + t
    if page_table is not None:
        page_size, width = k_cache.shape[1], page_table.shape[1]
        page = pos // page_size
        inside = page < width
        slot = page_table[seq, page.clamp(max=width - 1)].long() * page_size + pos % page_size
    else:
        length = k_cache.shape[1]
        row = rows.long()[seq] if rows is not None else seq
        inside = pos < length
        slot = row * length + pos
    slot = torch.where(inside, slot, -1)
    k_rows = k.reshape(-1, k.shape[-2], k.shape[-1])
    v_rows = v.reshape(-1, v.shape[-2], v.shape[-1])
    if rotary is not None:
        k_rows = rotary(k_rows, base.long()[seq] + t)
    fp8 = _FP8_CACHE.get(k_cache.dtype)
    if fp8 is None:
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise ValueError(f"k: expected the caches' dtype {k_cache.dtype}, got k {k.dtype}, v {v.dtype}")
        kv_dtype, one = "auto", k_cache.new_ones((), dtype=torch.float32)
        k_rows = k_rows.to(k_cache.dtype)
    else:
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise ValueError(f"k: expected the caches' dtype {k_cache.dtype}, got k {k.dtype}, v {v.dtype}")
        # fp8 tokens go in unchanged (x / 1 is exact); rotated ones are rounded to the cache's fp8.
        kv_dtype, one = fp8, k_cache.new_ones((), dtype=torch.float32)
        k_rows, v_rows = k_rows.float(), v_rows.float()
    try:
        _dispatch.call("reshape_and_cache_flash")(k_rows, v_rows, k_cache, v_cache, slot, kv_dtype, one, one)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _WRITE_NAMES) from None


def _leftpad_view(k_cache: Any, v_cache: Any, leftpad: Any, rows: Any, seqused: Any, batch: int,
                  device: Any) -> tuple:
    """A contiguous cache [B_cache, S, H_kv, D] as a paged one of page size 1 whose page table
    starts each sequence at its cache_leftpad: (k, v, table [B, S], lengths)."""
    length = k_cache.shape[1]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(0) != length * c.stride(1):
            raise _not_implemented("cache_leftpad", f"a tensor with a {name} whose rows are not evenly strided")
    if seqused is None:
        seqused = torch.full((batch,), length, dtype=torch.int32, device=device)
    row = rows.long() if rows is not None else torch.arange(batch, device=device)
    pad = leftpad.long()
    j = torch.arange(length, device=device)
    table = (row[:, None] * length + (pad[:, None] + j[None, :]).clamp(max=length - 1)).int()
    k_tok = k_cache.flatten(0, 1).unsqueeze(1)
    v_tok = v_cache.flatten(0, 1).unsqueeze(1)
    return k_tok, v_tok, table, (seqused.long() - pad).clamp(min=0).int()


def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
    qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
    cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
    attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0,
) -> Any:
    """The schedule of a later call with this shape (flashserve.get_scheduler_metadata's
    int32 tensor). cu_seqlens_k_new, cache_leftpad, max_seqlen_k_new, has_softcap and pack_gqa
    do not change flashserve's schedule; qkv_dtype's width does (a 1-byte cache)."""
    from ._api import scheduler_metadata
    return scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                              cache_seqlens, headdim_v, cu_seqlens_q, page_size, causal, _window(window_size),
                              attention_chunk, num_splits, sm_margin, qkv_dtype=qkv_dtype)


__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "get_scheduler_metadata"]
