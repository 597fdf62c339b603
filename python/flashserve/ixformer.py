"""The vLLM int8 fork's attention surface (its v1 FlashAttention backend, PYTHON_API.md "The
vLLM fork's int8 entry"): the functions that backend imports from ixformer
(`ixformer.inference.functions`, used there as `ixf_ops`, and
`ixformer.contrib.vllm_flash_attn.merge_attn_states`) and from its `fa_utils` /
`vllm._custom_ops`, with the names, arguments and return values of its calls, so that the
backend switches by its imports:

    import flashserve.ixformer as ixf_ops
    from flashserve.ixformer import merge_attn_states               # ixformer.contrib.vllm_flash_attn
    from flashserve.ixformer import (flash_attn_supports_sinks,     # vllm...fa_utils
        flash_attn_varlen_func, flash_attn_with_kvcache, reshape_and_cache_flash,
        flash_attn_varlen_int8_func, flash_attn_supports_fp8, get_flash_attn_version,
        is_flash_attn_varlen_func_available)
    import flashserve.ixformer as ops                                # ops.reshape_and_cache_flash

The fork's caches are in its shape order (get_kv_cache_shape (2|3, num_blocks, H_kv,
block_size, D)): every paged cache here is [num_blocks, H_kv, block_size, D] (HND); the int8
key scales are key_scale_cache fp32 [num_blocks, H_kv, block_size]; K8V8's static value scales
fp32 [H_kv, D].

int8 semantics (SPEC.md §5): q and k int8 with fp32 per-(token, head) scales (dynamic:
scale = absmax / 127, 1 for an all-zero row; x_int8 = round-half-even(x / scale) clamped to
±127); v int8 with a static per-(KV head, channel) scale (K8V8) or 16-bit (K8V16); attention
over the dequantized values q_int8 * q_scale, k_int8 * k_scale, v_int8 * v_scale in fp32.

Every function works under torch.inference_mode(), torch.compile(fullgraph=True) (through the
torch custom ops flashserve::quantize_int8, reshape_and_cache_int8, fork_varlen_fwd,
reshape_and_cache_flash, merge_attn_states) and CUDA-graph capture (no host reads of device
tensors; the lengths bounds the fork passes (max_seqlen_k, max_context_len) are hints: a paged
call plans for the block table's capacity, which bounds every length). Bad input raises
ValueError naming the argument (the fork's name) before anything is written.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _calls, _dispatch
from ._api import _check_fa_version, _not_implemented, _out_dtype, _scale, _window
from ._api import get_scheduler_metadata  # noqa: F401  (the fork imports it from fa_utils)
from ._tensors import renamed, torch

__all__ = [
    "flash_attn_supports_fp8", "flash_attn_supports_sinks", "flash_attn_varlen_func", "flash_attn_varlen_int8_func",
    "flash_attn_with_kvcache", "get_flash_attn_version", "get_scheduler_metadata",
    "is_flash_attn_varlen_func_available", "merge_attn_states", "reshape_and_cache_flash",
    "reshape_and_cache_flash_int8", "reshape_and_cache_flash_mix", "scaled_int8_quant_for_attn",
    "vllm_paged_attention_int8", "vllm_paged_attention_mix",
]

_SIXTEEN = () if torch is None else (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- the fork's fa_utils queries


def is_flash_attn_varlen_func_available() -> bool:
    """fa_utils' query: the varlen function is importable (always, with flashserve)."""
    return True


def get_flash_attn_version(requires_alibi: bool = False, head_size: Optional[int] = None) -> Optional[int]:
    """fa_utils' version query: 2 (flashserve.DEFAULT_FA_VERSION; ALiBi and every head size
    of FlashServeBackend serve at it), None for a head size flashserve does not support."""
    from . import _C
    if head_size is not None and not _C.Capabilities.supports_head_size(int(head_size), int(head_size)):
        return None
    return 2


def flash_attn_supports_sinks() -> bool:
    """Sinks (s_aux / sinks=) are implemented at every version, on the CPU and on the GPU."""
    return True


def flash_attn_supports_fp8() -> bool:
    """fp8 KV caches (descales per (sequence, KV head)) and fp8 queries are implemented."""
    return True


def _need_torch() -> None:
    if torch is None:
        raise ImportError("flashserve.ixformer needs torch")


def _tensor(name: str, x: Any) -> Any:
    if torch is None or not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    return x


def _dtype(name: str, x: Any, allowed: tuple, what: str) -> None:
    if _tensor(name, x).dtype not in allowed:
        raise ValueError(f"{name}: expected {what}, got {x.dtype}")


_MOVED: dict = {}


def _on(x: Any, device: Any) -> Any:
    """x on `device`: the fork keeps alibi_slopes on the host (torch.tensor(list)) while q is
    on the GPU. Copies are made once per (tensor, device) (the engine's warm-up, before any
    CUDA-graph capture) and kept."""
    if x is None or not isinstance(x, torch.Tensor) or x.device == device:
        return x
    key = (id(x), device)
    hit = _MOVED.get(key)
    if hit is None or hit[0] is not x:
        hit = _MOVED[key] = (x, x.to(device))
    return hit[1]


def _cache_dtype(name: str, kv_cache_dtype: Any, default: str, accepted: tuple) -> str:
    """The fork passes kv_cache_dtype="" (the function names the format)."""
    if kv_cache_dtype in ("", None) or kv_cache_dtype in accepted:
        return default
    raise ValueError(f"{name}: expected '' or one of {', '.join(accepted)}, got {kv_cache_dtype!r}")


def _paged_bound(max_seqlen_k: int, block_table: Any, k: Any) -> int:
    """max_seqlen_k for a paged call: at least the block table's capacity (HND: block_size is
    k's dim 2). The fork passes its metadata's max_query_len; the bound covers every length
    without reading one."""
    if block_table is None:
        return int(max_seqlen_k)
    return max(int(max_seqlen_k), int(block_table.shape[1]) * int(k.shape[2]))


# ---------------------------------------------------------------- quantization


def scaled_int8_quant_for_attn(x: Any, mode: int, transpose_scale: bool = False, scale: Any = None) -> tuple:
    """(x_int8, scale) as the fork's ixf_ops.scaled_int8_quant_for_attn.

    x [num_tokens, H, D] float16/bfloat16/float32.
    mode 2: dynamic per (token, head): scale = absmax / 127 (1 for an all-zero row), returned
    fp32 [num_tokens, H], or [H, num_tokens] with transpose_scale=True (the layout
    flash_attn_varlen_int8_func's q_scale takes). `scale` must be None.
    mode 0: per (head, channel): with `scale` fp32 [H, D] given (the fork's static value scale)
    x / scale rounded half to even and clamped to ±127, `scale` returned as it is; without,
    scale = absmax over the tokens / 127 (1 where 0), computed and returned.
    x_int8 = round-half-even(x / scale) clamped to ±127 in both modes."""
    _need_torch()
    _dtype("x", x, _SIXTEEN + (torch.float32,), "float16, bfloat16 or float32")
    if x.dim() != 3:
        raise ValueError(f"x: expected [num_tokens, num_heads, head_size], got shape {list(x.shape)}")
    if not isinstance(transpose_scale, bool):
        raise ValueError(f"transpose_scale: expected a bool, got {transpose_scale!r}")
    T, H, D = x.shape
    if mode == 2:
        if scale is not None:
            raise ValueError("scale: expected None with mode 2 (dynamic per-(token, head) scales), got a tensor")
        out = torch.empty((T, H, D), dtype=torch.int8, device=x.device)
        s = torch.empty((H, T) if transpose_scale else (T, H), dtype=torch.float32, device=x.device)
        try:
            _dispatch.call("quantize_int8")(x, out, s, transpose_scale)
        except ValueError as e:
            raise renamed(e, {"out": "x"}) from None
        return out, s
    if mode == 0:
        if transpose_scale:
            raise _not_implemented("transpose_scale", "True with mode 0 (per-(head, channel) scales)")
        compute = scale is None
        if compute:
            scale = torch.empty((H, D), dtype=torch.float32, device=x.device)
        else:
            _dtype("scale", scale, (torch.float32,), "float32 [num_heads, head_size]")
            if tuple(scale.shape) != (H, D):
                raise ValueError(f"scale: expected float32 [num_heads, head_size] = [{H}, {D}], got shape "
                                 f"{list(scale.shape)}")
            if scale.device != x.device:
                raise ValueError(f"scale: expected device {x.device} (as x), got {scale.device}")
        q = torch.empty((T, H, D), dtype=torch.int8, device=x.device)
        _dispatch.call("quantize_int8_static")(x, scale, q, compute)
        return q, scale
    raise _not_implemented("mode", mode)


# ---------------------------------------------------------------- cache writes


_WRITE_NAMES = {"key_scale": "k_scale", "k_scale_cache": "key_scale_cache"}
_SAVE_NAMES = {"key": "save_key", "value": "save_value", "key_scale": "save_key_scale",
               "k_scale_cache": "key_scale_cache"}


def _write_int8(key: Any, value: Any, k_scale: Any, key_cache: Any, value_cache: Any, key_scale_cache: Any,
                slot_mapping: Any, cache_dtype: str, names: dict = _WRITE_NAMES) -> None:
    _dtype(names.get("key", "key"), key, (torch.int8,), "int8 (quantized by scaled_int8_quant_for_attn mode 2)")
    try:
        _dispatch.call("reshape_and_cache_int8")(key, value, key_cache, value_cache, key_scale_cache, k_scale,
                                                 slot_mapping, cache_dtype)
    except ValueError as e:
        raise renamed(e, names) from None


def reshape_and_cache_flash_int8(key: Any, value: Any, k_scale: Any, key_cache: Any, value_cache: Any,
                                 key_scale_cache: Any, slot_mapping: Any, kv_cache_dtype: str = "") -> None:
    """K8V8 cache write of already-quantized rows: key int8 [>= n, H_kv, D] with k_scale fp32
    [>= n, H_kv] (scaled_int8_quant_for_attn mode 2), value int8 [>= n, H_kv, D] (mode 0 with
    the static value scale), at slot_mapping int64 [n] (< 0 skipped) into key_cache /
    value_cache int8 [num_blocks, H_kv, block_size, D] and key_scale_cache fp32 [num_blocks,
    H_kv, block_size]. kv_cache_dtype: "" (the fork's), "int8" or "int8_k8v8"."""
    _need_torch()
    mode = _cache_dtype("kv_cache_dtype", kv_cache_dtype, "int8_k8v8", ("int8", "int8_k8v8"))
    _write_int8(key, value, k_scale, key_cache, value_cache, key_scale_cache, slot_mapping, mode)


def reshape_and_cache_flash_mix(key: Any, value: Any, k_scale: Any, key_cache: Any, value_cache: Any,
                                key_scale_cache: Any, slot_mapping: Any, kv_cache_dtype: str = "") -> None:
    """K8V16 cache write: key int8 with k_scale as reshape_and_cache_flash_int8, value
    float16/bfloat16 [>= n, H_kv, D] into value_cache [num_blocks, H_kv, block_size, D] of
    value's dtype (the fork's view of planes 1-2 of its int8 (3, ...) cache).
    kv_cache_dtype: "" (the fork's) or "int8_k8v16"."""
    _need_torch()
    mode = _cache_dtype("kv_cache_dtype", kv_cache_dtype, "int8_k8v16", ("int8_k8v16",))
    _write_int8(key, value, k_scale, key_cache, value_cache, key_scale_cache, slot_mapping, mode)


def reshape_and_cache_flash(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any,
                            kv_cache_dtype: str, k_scale: Any, v_scale: Any) -> None:
    """The fork's ops.reshape_and_cache_flash (vLLM's arguments) over its HND caches
    [num_blocks, H_kv, block_size, D]: flashserve.reshape_and_cache_flash on their
    [num_blocks, block_size, H_kv, D] views."""
    _need_torch()
    from ._cache_merge import reshape_and_cache_flash as write
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if _tensor(name, c).dim() != 4:
            raise ValueError(f"{name}: expected [num_blocks, num_kv_heads, block_size, head_size], got shape "
                             f"{list(c.shape)}")
    write(key, value, key_cache.transpose(1, 2), value_cache.transpose(1, 2), slot_mapping, kv_cache_dtype,
          k_scale, v_scale)


# ---------------------------------------------------------------- attention

_FORK_NAMES = {"window": "window_size", "s_aux": "sinks", "alibi_sqrt": "sqrt_alibi"}
_INT8_NAMES = {"window": "window_size", "k_scale_cache": "k_scale", "alibi_sqrt": "sqrt_alibi"}
_KVCACHE_NAMES = dict(_FORK_NAMES, alibi_sqrt="use_sqrt_alibi", k="k_cache", v="v_cache",
                      seqused_k="cache_seqlens", cu_seqlens_q="cu_query_lens", max_seqlen_q="max_query_len",
                      out="out")


def _out_for(q: Any, v: Any, out: Any, dtype: Any, shape: tuple) -> Any:
    if out is not None:
        _tensor("out", out)
        if dtype is not None and out.dtype != dtype:
            raise ValueError(f"output_dtype: expected out's dtype {out.dtype} (or None), got {dtype}")
        return out
    return torch.empty(shape, dtype=dtype, device=q.device)


def flash_attn_varlen_int8_func(q, k, v, q_scale, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, softcap=0.0, sqrt_alibi=False,
                                out=None, block_table=None, output_dtype=None) -> Any:
    """The fork's int8 prefill: q int8 [total_q, H, D] with q_scale fp32 [H, total_q]
    (scaled_int8_quant_for_attn(query, 2, transpose_scale=True), sliced [:, start:]); k int8,
    paged [num_blocks, H_kv, block_size, D] with block_table int32 [B, max_blocks] and
    k_scale = key_scale_cache fp32 [num_blocks, H_kv, block_size] (or contiguous [total_k,
    H_kv, D] with k_scale [total_k, H_kv] without block_table); v int8 like k with v_scale fp32
    [H_kv, D] (K8V8), or float16/bfloat16 with v_scale None (K8V16). cu_seqlens_q / cu_seqlens_k
    int32 [B + 1]: query and KV lengths (KV lengths include the new tokens; causal aligns the
    queries to the end). Writes and returns out [total_q, H, D] (output_dtype; default: v's
    dtype for K8V16, float16 for K8V8). sqrt_alibi: ALiBi over sqrt(distance)."""
    _need_torch()
    _dtype("q", q, (torch.int8,), "int8 (scaled_int8_quant_for_attn mode 2)")
    _tensor("q_scale", q_scale)
    if q.dim() != 3:
        raise ValueError(f"q: expected [total_q, num_heads, head_size], got shape {list(q.shape)}")
    if q_scale.dim() != 2 or tuple(q_scale.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"q_scale: expected float32 [num_heads, total_q] = [{q.shape[1]}, {q.shape[0]}] "
                         f"(transpose_scale=True), got shape {list(q_scale.shape)}")
    if not isinstance(sqrt_alibi, bool):
        raise ValueError(f"sqrt_alibi: expected a bool, got {sqrt_alibi!r}")
    left, right = _window(window_size)
    _tensor("v", v)
    if output_dtype is None and out is None:
        output_dtype = v.dtype if v.dtype in _SIXTEEN else torch.float16
    out = _out_for(q, v, out, output_dtype, tuple(q.shape[:-1]) + (v.shape[-1],))
    try:
        _dispatch.call("fork_varlen_fwd")(
            q, k, v, out, cu_seqlens_q, int(max_seqlen_q), _paged_bound(max_seqlen_k, block_table, k), None,
            cu_seqlens_k, None, block_table, True, _scale(softmax_scale), bool(causal), left, right,
            float(softcap or 0.0), _on(alibi_slopes, q.device), sqrt_alibi, None, None, None, None,
            q_scale.t(), k_scale, v_scale)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _INT8_NAMES) from None
    return out


def flash_attn_varlen_func(
    q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
    cu_seqlens_k=None, seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
    scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
    num_splits=0, output_scale=None, fa_version=2, s_aux=None,
    cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, *, sqrt_alibi=False, sinks=None,
) -> Any:
    """The fork's fa_utils.flash_attn_varlen_func: vLLM's signature plus `sqrt_alibi` (ALiBi
    over sqrt(distance)) and `sinks` (per-head sink logits [H], = s_aux), over the fork's paged
    caches [num_blocks, H_kv, block_size, D] (block_table given; contiguous k/v [total_k, H_kv,
    D] otherwise). Returns out [total_q, H, Dv], or (out, softmax_lse [H, total_q]) with
    return_softmax_lse. q_v, scheduler_metadata, num_splits > 1 and context parallelism are
    not part of the fork's calls: they raise NotImplementedError."""
    _need_torch()
    for keyword, value, unset in (("dropout_p", dropout_p, 0.0), ("return_attn_probs", return_attn_probs, False),
                                  ("output_scale", output_scale, None), ("q_v", q_v, None),
                                  ("scheduler_metadata", scheduler_metadata, None),
                                  ("cp_tot_seqused_k", cp_tot_seqused_k, None)):
        if value is not unset and value != unset:
            raise _not_implemented(keyword, value if not hasattr(value, "shape") else "a tensor")
    if cp_world_size != 1 or cp_rank != 0:
        raise _not_implemented("cp_world_size", cp_world_size)
    if num_splits not in (0, 1):
        raise _not_implemented("num_splits", num_splits)
    _check_fa_version(fa_version)
    if sinks is not None and s_aux is not None:
        raise ValueError("sinks: expected None when s_aux is given (the same per-head sink logits), got a tensor")
    if not isinstance(sqrt_alibi, bool):
        raise ValueError(f"sqrt_alibi: expected a bool, got {sqrt_alibi!r}")
    _tensor("q", q)
    _tensor("v", v)
    left, right = _window(window_size)
    out = _out_for(q, v, out, None if out is not None else _out_dtype(q), tuple(q.shape[:-1]) + (v.shape[-1],))
    lse = torch.empty((q.shape[-2], q.shape[0]), dtype=torch.float32, device=q.device) if return_softmax_lse else None
    try:
        _dispatch.call("fork_varlen_fwd")(
            q, k, v, out, cu_seqlens_q, int(max_seqlen_q), _paged_bound(max_seqlen_k, block_table, k), lse,
            cu_seqlens_k, seqused_k, block_table, True, _scale(softmax_scale), bool(causal), left, right,
            float(softcap or 0.0), _on(alibi_slopes, q.device), sqrt_alibi,
            _on(sinks if sinks is not None else s_aux, q.device), q_descale, k_descale, v_descale, None, None, None)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _FORK_NAMES) from None
    return (out, lse) if return_softmax_lse else out


def _decode_batch(q_rows: Any, cu_query_lens: Any, cache_seqlens: Any) -> Any:
    """cu_seqlens_q of a decode batch: cu_query_lens, or one query per sequence."""
    if cu_query_lens is not None:
        return cu_query_lens
    return torch.arange(int(cache_seqlens.shape[0]) + 1, dtype=torch.int32, device=q_rows.device)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
    cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    *, out=None, max_query_len=None, cu_query_lens=None, use_sqrt_alibi=False, sinks=None,
    use_cuda_graph=False, max_context_len=None, s_aux=None, fa_version=2,
) -> Any:
    """The fork's decode call: q [T, 1, H, D] (its decode rows unsqueezed), paged caches
    [num_blocks, H_kv, block_size, D] through block_table int32 [B, max_blocks], cache_seqlens
    int32 [B] (the KV lengths, new tokens included), cu_query_lens int32 [B + 1] (queries per
    sequence: speculative/MTP decode; None: one per sequence, T == B) and max_query_len;
    use_sqrt_alibi, sinks [H]. Without cu_query_lens, q [B, sq, H, D] is the usual batch of sq
    queries per sequence. Writes out (shaped like q, width Dv) and returns it, or (out,
    softmax_lse [B, H, sq]) with return_softmax_lse (only without cu_query_lens).
    max_context_len and use_cuda_graph are hints (the call plans for the block table's
    capacity and is always capture-safe). k/v appends, rotary and cache_leftpad /
    cache_batch_idx are not part of the fork's calls: they raise NotImplementedError."""
    _need_torch()
    for keyword, value in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                           ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise _not_implemented(keyword, "a tensor")
    if num_splits not in (0, 1):
        raise _not_implemented("num_splits", num_splits)
    _check_fa_version(fa_version)
    if block_table is None:
        raise _not_implemented("block_table", "None (the fork's caches are paged)")
    if cache_seqlens is None or not hasattr(cache_seqlens, "shape"):
        raise ValueError(f"cache_seqlens: expected an int32 [batch] tensor, got {type(cache_seqlens).__name__}")
    if sinks is not None and s_aux is not None:
        raise ValueError("sinks: expected None when s_aux is given (the same per-head sink logits), got a tensor")
    if not isinstance(use_sqrt_alibi, bool):
        raise ValueError(f"use_sqrt_alibi: expected a bool, got {use_sqrt_alibi!r}")
    _tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q: expected [batch, seqlen_q, num_heads, head_size], got shape {list(q.shape)}")
    if cu_query_lens is not None and return_softmax_lse:
        raise _not_implemented("return_softmax_lse", "True with cu_query_lens")
    B, sq, H, D = q.shape
    Dv = v_cache.shape[-1]
    out = _out_for(q, v_cache, out, None if out is not None else _out_dtype(q), (B, sq, H, Dv))
    rows = q.reshape(B * sq, H, D)
    out_rows = out.view(B * sq, H, Dv)
    if cu_query_lens is not None:
        cu = cu_query_lens
        max_q = int(max_query_len) if max_query_len is not None else B * sq
    else:
        cu = torch.arange(0, (int(cache_seqlens.shape[0]) + 1) * sq, sq, dtype=torch.int32, device=q.device)
        max_q = sq
    lse = torch.empty((H, B * sq), dtype=torch.float32, device=q.device) if return_softmax_lse else None
    left, right = _window(window_size)
    try:
        _dispatch.call("fork_varlen_fwd")(
            rows, k_cache, v_cache, out_rows, cu, max_q, _paged_bound(max_context_len or 0, block_table, k_cache),
            lse, None, cache_seqlens, block_table, True, _scale(softmax_scale), bool(causal), left, right,
            float(softcap or 0.0), _on(alibi_slopes, q.device), use_sqrt_alibi,
            _on(sinks if sinks is not None else s_aux, q.device), None, None, None, None, None, None)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _KVCACHE_NAMES) from None
    if return_softmax_lse:
        return out, lse.view(H, B, sq).permute(1, 0, 2)
    return out


def _decode_slots(cu_query_lens: Any, context_lens: Any, block_tables: Any, block_size: int, num_tokens: int) -> Any:
    """The cache slot of each decode row (int64 [num_tokens], -1 for padding rows): request b's
    query j of n goes at position context_lens[b] - n + j through block_tables[b]. Device ops
    only (no host reads)."""
    device = context_lens.device
    t = torch.arange(num_tokens, dtype=torch.int64, device=device)
    ends = cu_query_lens[1:].to(torch.int64)
    b = torch.searchsorted(ends, t, right=True)
    bc = b.clamp(max=ends.shape[0] - 1)
    pos = context_lens.to(torch.int64)[bc] - (ends[bc] - t)
    col = pos // block_size
    # padding rows (past cu_query_lens[-1]) and positions outside the block table: skipped
    live = (b < ends.shape[0]) & (pos >= 0) & (col < block_tables.shape[1])
    pos = pos.clamp(min=0)
    col = col.clamp(min=0, max=block_tables.shape[1] - 1)
    block = block_tables.to(torch.int64)[bc, col]
    return torch.where(live, block * block_size + pos % block_size, torch.full_like(t, -1))


def _paged_int8(name: str, output, query, key_cache, query_scale, key_scale_cache, num_kv_heads, scale,
                block_tables, context_lens, block_size, softcap, alibi_slopes, causal, window_left,
                window_right, use_sqrt_alibi, max_context_len, cu_query_lens, max_query_len, value_cache,
                value_scale_cache, save_key, save_value, save_key_scale) -> Any:
    _need_torch()
    _dtype("query", query, (torch.int8,), "int8 (scaled_int8_quant_for_attn mode 2)")
    _tensor("key_cache", key_cache)
    if query.dim() != 3:
        raise ValueError(f"query: expected [num_tokens, num_heads, head_size], got shape {list(query.shape)}")
    if key_cache.dim() != 4 or int(key_cache.shape[1]) != int(num_kv_heads):
        raise ValueError(f"num_kv_heads: expected key_cache's [num_blocks, num_kv_heads, block_size, head_size] "
                         f"dim 1 = {list(key_cache.shape)}, got {num_kv_heads}")
    if int(key_cache.shape[2]) != int(block_size):
        raise ValueError(f"block_size: expected key_cache's dim 2 ({int(key_cache.shape[2])}), got {block_size}")
    if not isinstance(use_sqrt_alibi, bool):
        raise ValueError(f"use_sqrt_alibi: expected a bool, got {use_sqrt_alibi!r}")
    _tensor("context_lens", context_lens)
    T = int(query.shape[0])
    cu = _decode_batch(query, cu_query_lens, context_lens)
    if query_scale is None or not hasattr(query_scale, "shape") or tuple(query_scale.shape) != (T, query.shape[1]):
        raise ValueError(f"query_scale: expected float32 [num_tokens, num_heads] = [{T}, {query.shape[1]}], got "
                         f"{list(query_scale.shape) if hasattr(query_scale, 'shape') else query_scale!r}")
    max_q = int(max_query_len) if max_query_len is not None else T
    args = (query, key_cache, value_cache, output, cu, max_q,
            _paged_bound(max_context_len or 0, block_tables, key_cache), None, None, context_lens, block_tables,
            True, _scale(scale), bool(causal), int(window_left), int(window_right), float(softcap or 0.0),
            _on(alibi_slopes, query.device), use_sqrt_alibi, None, None, None, None, query_scale,
            key_scale_cache, value_scale_cache)

    def attend(mode: Optional[int] = None) -> None:
        try:
            if mode is None:
                _dispatch.call("fork_varlen_fwd")(*args)
            else:
                _calls.fork_varlen_fwd(*args, mode=mode)
        except (ValueError, NotImplementedError) as e:
            raise renamed(e, {"q": "query", "k": "key_cache", "v": "value_cache", "out": "output",
                              "q_scale": "query_scale", "k_scale_cache": "key_scale_cache",
                              "v_scale": "value_scale_cache", "seqused_k": "context_lens",
                              "block_table": "block_tables", "cu_seqlens_q": "cu_query_lens",
                              "max_seqlen_q": "max_query_len", "alibi_sqrt": "use_sqrt_alibi",
                              "window": "window_left"}) from None

    saves = (save_key, save_value, save_key_scale)
    if any(s is not None for s in saves):
        if any(s is None for s in saves):
            missing = ("save_key", "save_value", "save_key_scale")[[s is None for s in saves].index(True)]
            raise ValueError(f"{missing}: expected a tensor (save_key, save_value and save_key_scale go together), "
                             f"got None")
        if not torch.compiler.is_compiling():  # a rejected call writes nothing: check the attention first
            attend(_calls.VALIDATE)
        slots = _decode_slots(cu, context_lens, block_tables, int(block_size), T)
        _write_int8(save_key, save_value, save_key_scale, key_cache, value_cache, key_scale_cache, slots,
                    "int8_k8v8" if value_scale_cache is not None else "int8_k8v16", _SAVE_NAMES)
    attend()
    return output


def vllm_paged_attention_int8(output, query, key_cache, query_scale, key_scale_cache, num_kv_heads, scale,
                              block_tables, context_lens, block_size, softcap=0.0, alibi_slopes=None,
                              causal=True, window_left=-1, window_right=-1, use_sqrt_alibi=False,
                              use_cuda_graph=False, max_context_len=None, cu_query_lens=None,
                              max_query_len=None, value_cache=None, value_scale_cache=None, save_key=None,
                              save_value=None, save_key_scale=None) -> Any:
    """The fork's K8V8 decode (ixf_ops.vllm_paged_attention_int8, keywords as its call):
    query int8 [T, H, D] with query_scale fp32 [T, H]; key_cache / value_cache int8
    [num_blocks, H_kv, block_size, D], key_scale_cache fp32 [num_blocks, H_kv, block_size],
    value_scale_cache fp32 [H_kv, D]; block_tables int32 [B, max_blocks], context_lens int32
    [B] (KV lengths, new tokens included), cu_query_lens int32 [B + 1] (None: one query per
    sequence), max_query_len. save_key int8 / save_value int8 / save_key_scale fp32 [T, H_kv]
    (the fork's fused cache write, decode-only steps): the new rows are first stored at
    their positions (request b's query j of n at context_lens[b] - n + j). Writes output
    [T, H, D] (float16/bfloat16) and returns it. use_cuda_graph and max_context_len are hints."""
    if value_cache is None or value_scale_cache is None:
        raise ValueError(f"{'value_cache' if value_cache is None else 'value_scale_cache'}: expected a tensor "
                         f"(K8V8: int8 values with static [H_kv, D] scales), got None")
    return _paged_int8("vllm_paged_attention_int8", output, query, key_cache, query_scale, key_scale_cache,
                       num_kv_heads, scale, block_tables, context_lens, block_size, softcap, alibi_slopes, causal,
                       window_left, window_right, use_sqrt_alibi, max_context_len, cu_query_lens, max_query_len,
                       value_cache, value_scale_cache, save_key, save_value, save_key_scale)


def vllm_paged_attention_mix(output, query, key_cache, query_scale, key_scale_cache, num_kv_heads, scale,
                             block_tables, context_lens, block_size, softcap=0.0, alibi_slopes=None,
                             causal=True, window_left=-1, window_right=-1, use_sqrt_alibi=False,
                             use_cuda_graph=False, max_context_len=None, cu_query_lens=None,
                             max_query_len=None, value_cache=None, save_key=None, save_value=None,
                             save_key_scale=None) -> Any:
    """The fork's K8V16 decode (ixf_ops.vllm_paged_attention_mix): as vllm_paged_attention_int8
    with value_cache float16/bfloat16 [num_blocks, H_kv, block_size, D] and no value scales;
    save_value (fused write) 16-bit."""
    if value_cache is None:
        raise ValueError("value_cache: expected a float16/bfloat16 [num_blocks, H_kv, block_size, D] tensor, got None")
    return _paged_int8("vllm_paged_attention_mix", output, query, key_cache, query_scale, key_scale_cache,
                       num_kv_heads, scale, block_tables, context_lens, block_size, softcap, alibi_slopes, causal,
                       window_left, window_right, use_sqrt_alibi, max_context_len, cu_query_lens, max_query_len,
                       value_cache, None, save_key, save_value, save_key_scale)


# ---------------------------------------------------------------- merge


def merge_attn_states(prefix_output: Any, prefix_lse: Any, suffix_output: Any, suffix_lse: Any,
                      output: Any = None, output_lse: Any = None) -> Any:
    """ixformer.contrib.vllm_flash_attn.merge_attn_states in the fork's argument order
    (prefix_output, prefix_lse, suffix_output, suffix_lse, output): states [T, H, D] with
    head-major LSEs [H, T] fp32 merged into output (allocated when None; output_lse [H, T]
    when given). Returns output."""
    _need_torch()
    from ._cache_merge import merge_attn_states as merge
    _tensor("prefix_output", prefix_output)
    if output is None:
        output = torch.empty_like(prefix_output)
    merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=output_lse)
    return output
