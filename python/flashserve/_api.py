"""The attention drop-ins of PYTHON_API.md: flash_attn_varlen_func, flash_attn_with_kvcache,
get_scheduler_metadata and the FA-version queries, with FlashAttention's (vllm_flash_attn's)
names, argument order, defaults and return conventions, and SPEC.md's semantics.

Keywords flashserve does not implement raise NotImplementedError naming the keyword when given
a value that would change the result: dropout_p != 0, return_attn_probs=True, output_scale,
softmax_scale=0, k/v appends, rotary_cos/sin, cache_leftpad; for get_scheduler_metadata
cu_seqlens_k_new, cache_leftpad, max_seqlen_k_new != 0 and sm_margin != 0. Keywords that only
tune speed or the backward pass are accepted: deterministic (the forward is deterministic for
a given shape and num_splits), pack_gqa (the planner
packs GQA heads itself), rotary_interleaved (no rotary) and has_softcap (plans depend on
shapes alone). get_scheduler_metadata's qkv_dtype counts for its width: a 1-byte cache (fp8)
can be served by other kernels, with another split count (MLA's absorbed decode); a call given
metadata made with another qkv_dtype runs with its split count, as FlashAttention-3 does.

batch_invariant=True (flashserve's keyword on both calls; vLLM's VLLM_BATCH_INVARIANT, SGLang's
enable_deterministic_inference): a request's output is bitwise the same whatever else the
call holds. Calls with max_seqlen_q (flash_attn_with_kvcache: q's sq) <= 16 (decode and
verify) split each sequence's KV at multiples of a fixed 1024 keys; longer calls are not
split; num_splits must be 0 or 1 (none). A request gets the same bits in every call of its
class (keep decode/verify steps and prefills in separate calls, as the engines' backends do).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from . import _C, _calls, _dispatch
from ._tensors import device_of as _device_of
from ._tensors import empty, float32_of, int32_of, is_torch, not_a_tensor, renamed, torch

DEFAULT_FA_VERSION = 2
_FA_VERSIONS = (2, 3)
_BF16: Any = torch.bfloat16 if torch is not None else "bfloat16"

# C++ argument names -> the drop-ins' names, for error messages.
_VARLEN_NAMES = {"window": "window_size"}
_KVCACHE_NAMES = {"k": "k_cache", "v": "v_cache", "seqused_k": "cache_seqlens", "window": "window_size"}


def _not_implemented(keyword: str, value: Any) -> NotImplementedError:
    return NotImplementedError(f"{keyword}: not implemented by flashserve (got {value!r})")


def _window(window_size: Optional[Sequence[int]]) -> tuple:
    if window_size is None:
        return -1, -1
    if len(window_size) != 2:
        raise ValueError(f"window_size: expected None or (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _scale(softmax_scale: Optional[float]) -> float:
    """The C++ API's softmax_scale: 0 selects the default, so an explicit 0 cannot be passed."""
    if softmax_scale is None:
        return 0.0
    if softmax_scale == 0.0:
        raise _not_implemented("softmax_scale", softmax_scale)
    return softmax_scale


def _check_fa_version(fa_version: int) -> None:
    if fa_version not in _FA_VERSIONS:
        raise ValueError(f"fa_version: expected 2 or 3, got {fa_version!r}")


def _out_dtype(q: Any) -> Any:
    """out has q's dtype; bfloat16 when q is fp8 (SPEC.md §1)."""
    if is_torch(q) and q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.bfloat16
    return q.dtype


def flash_attn_varlen_func(
    q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
    cu_seqlens_k=None, seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
    scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
    num_splits=0, output_scale=None, fa_version=DEFAULT_FA_VERSION, s_aux=None,
    cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None, batch_invariant=False,
) -> Any:
    """Attention over a varlen batch: q [total_q, H, D]; KV contiguous (cu_seqlens_k) or paged
    (block_table + seqused_k). Returns out [total_q, H, Dv], or (out, softmax_lse [H, total_q]
    fp32) with return_softmax_lse. softmax_scale None: D^-0.5 ((D + Dv)^-0.5 with q_v).

    Rows of q past cu_seqlens_q[-1] are padding (a batch padded for a CUDA graph): never read,
    and their rows of out / softmax_lse never written. q/k/v_descale (fp32 [B, H_kv], stride-0
    expansions allowed) scale fp8 operands; given for a 16-bit operand they are checked and left
    unused, as FlashAttention does (vLLM passes its layer's scales whatever the dtype)."""
    if dropout_p != 0.0:
        raise _not_implemented("dropout_p", dropout_p)
    if return_attn_probs:
        raise _not_implemented("return_attn_probs", return_attn_probs)
    if output_scale is not None:
        raise _not_implemented("output_scale", "a tensor")
    _check_fa_version(fa_version)
    left, right = _window(window_size)
    try:
        if out is None:
            out = empty(tuple(q.shape[:-1]) + (v.shape[-1],), _out_dtype(q), q)
        lse = empty((q.shape[-2], q.shape[0]), float32_of(q), q) if return_softmax_lse else None
    except AttributeError:
        raise not_a_tensor(q=q, v=v) from None
    call = _dispatch.call("varlen_fwd")
    try:
        call(q, k, v, out, cu_seqlens_q, max_seqlen_q, max_seqlen_k, lse, cu_seqlens_k, seqused_k,
             block_table, q_v, _scale(softmax_scale), causal,
             left, right, softcap, alibi_slopes, s_aux, q_descale, k_descale, v_descale, num_splits,
             scheduler_metadata, cp_world_size, cp_rank, cp_tot_seqused_k, batch_invariant=bool(batch_invariant))
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _VARLEN_NAMES) from None
    return (out, lse) if return_softmax_lse else out


def _cache_seqlens(cache_seqlens: Any, q: Any, k_cache: Any, block_table: Any) -> Any:
    """FlashAttention's forms: an int for every sequence, or None for a full cache."""
    if isinstance(cache_seqlens, int):
        lengths = empty((q.shape[0],), int32_of(q), q)
        lengths[:] = cache_seqlens
        return lengths
    if cache_seqlens is None and block_table is not None:
        return _cache_seqlens(int(block_table.shape[1] * k_cache.shape[1]), q, k_cache, None)
    return cache_seqlens


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
    cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    *, out=None, scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
    fa_version=DEFAULT_FA_VERSION, s_aux=None, cp_world_size=1, cp_rank=0,
    cp_tot_seqused_k=None, batch_invariant=False,
) -> Any:
    """Batched attention over a KV cache: q [B, sq, H, D]; caches paged (block_table) or
    contiguous [B_cache, S_cache, H_kv, D]; cache_seqlens int32 [B] or an int. Returns out
    [B, sq, H, Dv], or (out, softmax_lse [B, H, sq] fp32) with return_softmax_lse."""
    for keyword, value in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                           ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise _not_implemented(keyword, "a tensor")
    _check_fa_version(fa_version)
    left, right = _window(window_size)
    try:
        cache_seqlens = _cache_seqlens(cache_seqlens, q, k_cache, block_table)
        if out is None:
            out = empty(tuple(q.shape[:-1]) + (v_cache.shape[-1],), _out_dtype(q), q)
        lse = empty((q.shape[0], q.shape[2], q.shape[1]), float32_of(q), q) if return_softmax_lse else None
    except AttributeError:
        raise not_a_tensor(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table) from None
    call = _dispatch.call("kvcache_fwd")
    try:
        call(q, k_cache, v_cache, out, lse, cache_seqlens, cache_batch_idx, block_table,
             _scale(softmax_scale), causal, left, right, softcap,
             alibi_slopes, s_aux, q_descale, k_descale, v_descale, num_splits, scheduler_metadata,
             cp_world_size, cp_rank, cp_tot_seqused_k, batch_invariant=bool(batch_invariant))
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _KVCACHE_NAMES) from None
    return (out, lse) if return_softmax_lse else out


def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
    cache_seqlens, qkv_dtype=_BF16, headdim_v=None, cu_seqlens_q=None,
    cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
    causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0, pack_gqa=None,
    sm_margin=0, batch_invariant=False,
) -> Any:
    """The plan of a later call with these shapes, as an int32 1-D tensor on cache_seqlens'
    device (opaque; engines copy it into a persistent buffer): PLAN_WORDS (13) words whatever
    the shape, which fits the buffer engines size for FlashAttention-3's metadata. Calls with a
    CUDA tensor do not read it: they plan their own shape with their own num_splits, which is
    what the metadata computed for the same shape and bound (no synchronization; CUDA-graph
    capture and inference tensors work, and so does a copy into a slice of another buffer);
    calls with host metadata (numpy, CPU torch) decode the whole plan and raise ValueError
    naming scheduler_metadata when it was made for another shape. The rows of q are not part
    of the shape (a batch planned, then padded for a CUDA graph, keeps its plan) and no tensor
    is read (cu_seqlens_q may be a CUDA tensor: nothing synchronizes; inside CUDA-graph capture
    the words are written by fills). flash_attn_with_kvcache's shape: max_seqlen_k is the
    cache's capacity (block_table.shape[1] * page_size, or S_cache)."""
    for keyword, value in (("cu_seqlens_k_new", cu_seqlens_k_new), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise _not_implemented(keyword, "a tensor")
    if max_seqlen_k_new != 0:
        raise _not_implemented("max_seqlen_k_new", max_seqlen_k_new)
    return scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                              cache_seqlens, headdim_v, cu_seqlens_q, page_size, causal, window_size, 0,
                              num_splits, sm_margin, batch_invariant, qkv_dtype)


def _one_byte(dtype: Any) -> bool:
    """Whether qkv_dtype is a 1-byte type (torch.float8_e4m3fn, "fp8", ...)."""
    if isinstance(dtype, str):
        return dtype.startswith(("fp8", "float8", "int8", "uint8"))
    return getattr(dtype, "itemsize", 2) == 1


def scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                       cache_seqlens, headdim_v, cu_seqlens_q, page_size, causal, window_size,
                       attention_chunk, num_splits, sm_margin, batch_invariant=False, qkv_dtype=_BF16) -> Any:
    """get_scheduler_metadata's checks and call, shared with flashserve.fa3's."""
    if sm_margin != 0:
        raise _not_implemented("sm_margin", sm_margin)
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: expected an int32 [batch_size] tensor, got None")
    if num_heads_kv < 1 or num_heads_q % num_heads_kv != 0:
        raise ValueError(f"num_heads_kv: expected a divisor of num_heads_q={num_heads_q}, got {num_heads_kv}")
    left, right = _window(window_size)
    local = (left, right) != (-1, -1) or attention_chunk > 0
    call = _dispatch.call("scheduler_metadata") if is_torch(cache_seqlens) else _calls.scheduler_metadata
    return call(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                headdim if headdim_v is None else headdim_v, cache_seqlens, cu_seqlens_q,
                0 if page_size is None else page_size, bool(causal), local, num_splits,
                batch_invariant=bool(batch_invariant), kv_8bit=_one_byte(qkv_dtype))


def fa_version_unsupported_reason(fa_version: int, device: Union[None, int, str, Any] = None) -> Optional[str]:
    """Why flash-attention version `fa_version` cannot run on `device` (None: the current CUDA
    device, or the CPU without one), or None when it can. flashserve has one implementation
    that serves both 2 and 3, on the CPU (reference) and on sm80+ GPUs (kernels)."""
    if fa_version not in _FA_VERSIONS:
        return f"fa_version: expected 2 or 3, got {fa_version!r}"
    reason = _C.device_unsupported_reason(*_device_of(device))
    return reason or None


def is_fa_version_supported(fa_version: int, device: Union[None, int, str, Any] = None) -> bool:
    """Whether flash-attention version `fa_version` runs on `device` (see the reason query)."""
    return fa_version_unsupported_reason(fa_version, device) is None
