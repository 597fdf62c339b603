"""The calls behind the drop-ins, one function per torch custom op (same arguments, same order
as the op's schema in _ops.py): each hands its arguments to the extension, which validates
and runs the C++ API. Outputs are allocated by the callers."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _C
from ._tensors import cuda_stream, device_of, is_torch, schedule, torch, workspace_allocator

_RUN = 0
VALIDATE = 1  # mode=VALIDATE: check every argument as the call would, run nothing


def varlen_fwd(q: Any, k: Any, v: Any, out: Any, cu_seqlens_q: Any, max_seqlen_q: int, max_seqlen_k: int,
               softmax_lse: Optional[Any] = None, cu_seqlens_k: Optional[Any] = None,
               seqused_k: Optional[Any] = None, block_table: Optional[Any] = None,
               q_v: Optional[Any] = None, softmax_scale: float = 0.0, causal: bool = False,
               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
               alibi_slopes: Optional[Any] = None, s_aux: Optional[Any] = None,
               q_descale: Optional[Any] = None, k_descale: Optional[Any] = None,
               v_descale: Optional[Any] = None, num_splits: int = 0,
               scheduler_metadata: Optional[Any] = None, cp_world_size: int = 1, cp_rank: int = 0,
               cp_tot_seqused_k: Optional[Any] = None, chunk_size: int = 0, batch_invariant: bool = False,
               *, mode: int = _RUN) -> None:
    """Varlen attention into out (and softmax_lse [H, total_q] when given). softmax_scale 0:
    the default scale; chunk_size > 0: chunked local attention. mode=VALIDATE (not part of the
    op's schema): check the arguments only."""
    plan, num_splits = schedule(scheduler_metadata, num_splits)
    _C.attention(mode, False, q, q_v, out, softmax_lse, k, v, False,
                 cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, None, max_seqlen_q, max_seqlen_k,
                 softmax_scale, softcap, alibi_slopes, False, causal, window_left, window_right, chunk_size,
                 s_aux, q_descale, k_descale, v_descale, None, None, None,
                 cp_world_size, cp_rank, cp_tot_seqused_k,
                 num_splits, bool(batch_invariant), plan, workspace_allocator(q), cuda_stream(q))


def kvcache_fwd(q: Any, k_cache: Any, v_cache: Any, out: Any, softmax_lse: Optional[Any] = None,
                cache_seqlens: Optional[Any] = None, cache_batch_idx: Optional[Any] = None,
                block_table: Optional[Any] = None, softmax_scale: float = 0.0, causal: bool = False,
                window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                alibi_slopes: Optional[Any] = None, s_aux: Optional[Any] = None,
                q_descale: Optional[Any] = None, k_descale: Optional[Any] = None,
                v_descale: Optional[Any] = None, num_splits: int = 0,
                scheduler_metadata: Optional[Any] = None, cp_world_size: int = 1, cp_rank: int = 0,
                cp_tot_seqused_k: Optional[Any] = None, q_v: Optional[Any] = None,
                chunk_size: int = 0, batch_invariant: bool = False, *, mode: int = _RUN) -> None:
    """Batched attention over a KV cache into out (and softmax_lse [B, H, sq] when given)."""
    plan, num_splits = schedule(scheduler_metadata, num_splits)
    _C.attention(mode, True, q, q_v, out, softmax_lse, k_cache, v_cache, False,
                 None, None, cache_seqlens, block_table, cache_batch_idx, 0, 0,
                 softmax_scale, softcap, alibi_slopes, False, causal, window_left, window_right, chunk_size,
                 s_aux, q_descale, k_descale, v_descale, None, None, None,
                 cp_world_size, cp_rank, cp_tot_seqused_k,
                 num_splits, bool(batch_invariant), plan, workspace_allocator(q), cuda_stream(q))


def merge_attn_states(output: Any, output_lse: Optional[Any], prefix_output: Any, prefix_lse: Any,
                      suffix_output: Any, suffix_lse: Any, prefill_tokens_with_context: Optional[int],
                      output_scale: Optional[Any]) -> None:
    """Merge of two [T, H, D] states with head-major [H, T] LSEs into output (and output_lse)."""
    _C.merge_states(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, False,
                    prefill_tokens_with_context, output_scale, cuda_stream(output))


def merge_state_v2(v_a: Any, s_a: Any, v_b: Any, s_b: Any, v_merged: Any, s_merged: Any) -> None:
    """Merge of two [T, H, D] states with token-major [T, H] LSEs into v_merged and s_merged."""
    _C.merge_states(v_merged, s_merged, v_a, s_a, v_b, s_b, True, None, None, cuda_stream(v_merged))


def reshape_and_cache_flash(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any,
                            kv_cache_dtype: str, k_scale: Any, v_scale: Any) -> None:
    """key/value rows into their slots of the paged caches (any strides, last dim contiguous)."""
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                         None, None, False, cuda_stream(key_cache))


def scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int,
                       num_heads_kv: int, headdim: int, headdim_v: int, cache_seqlens: Any,
                       cu_seqlens_q: Optional[Any], page_size: int, causal: bool, local: bool,
                       num_splits: int, batch_invariant: bool = False, kv_8bit: bool = False) -> Any:
    """The plan of a call with this shape (_C.plan_for_shape) as PLAN_WORDS int32 words on
    cache_seqlens' device (host metadata is decoded by the call; CUDA metadata is not read:
    _tensors.schedule). A fixed length: it fits the persistent buffers engines size for
    FlashAttention-3's metadata, 1 + 4 * round_up(max_batch, 4) words."""
    total_q = batch_size * max_seqlen_q  # a bound on the rows (not part of the plan's shape)
    kind, index = device_of(cache_seqlens)
    words = list(_C.plan_for_shape(kind, index, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                                   headdim, headdim_v, total_q, page_size, causal, local, num_splits,
                                   bool(batch_invariant), bool(kv_8bit)))
    if not is_torch(cache_seqlens):
        return np.asarray(words, dtype=np.int32)
    return _on_device(words, cache_seqlens.device)


def _on_device(words: list, device: Any) -> Any:
    """The int32 words on the metadata's device. Inside CUDA-graph capture a host-to-device
    copy cannot run (from pageable memory it synchronizes; the graph would replay a freed host
    buffer), so the words are written by fills, whose values the graph keeps: a captured
    get_scheduler_metadata replays the same plan."""
    host = torch.tensor(words, dtype=torch.int32)
    if host.device == torch.device(device) or not torch.cuda.is_current_stream_capturing():
        return host.to(device)
    metadata = torch.zeros(len(words), dtype=torch.int32, device=device)
    for i, word in enumerate(words):
        if word:
            metadata[i].fill_(word)
    return metadata


def quantize_int8(x: Any, out: Any, scale: Any, transpose_scale: bool) -> None:
    """Dynamic int8 quantization per (token, head): x [T, H, D] -> out int8 [T, H, D], scale
    fp32 [T, H], or [H, T] with transpose_scale."""
    _C.quantize_int8(x, out, scale.t() if transpose_scale else scale, cuda_stream(x))


def quantize_int8_static(x: Any, scale: Any, out: Any, compute_scale: bool) -> None:
    """int8 quantization per (head, channel), the int8 fork's mode 0: with compute_scale,
    scale [H, D] = absmax over the tokens / 127 (1 where 0) is written first; out int8 [T, H,
    D] = round-half-even(x / scale) clamped to +-127 (NaN to 0). torch arithmetic, as one op so
    that torch.compile keeps it as it runs eagerly (inductor would recompile the division with
    another rounding); the divisors are tensors (torch divides by a Python scalar through its
    reciprocal on CUDA)."""
    xf = x.float()
    if compute_scale:
        amax = xf.abs().amax(dim=0) if x.shape[0] > 0 else torch.zeros_like(scale)
        scale.copy_(torch.where(amax > 0, amax / torch.full_like(amax, 127.0), torch.ones_like(amax)))
    out.copy_(torch.nan_to_num(torch.round(xf / scale), nan=0.0).clamp_(-127.0, 127.0).to(torch.int8))


def reshape_and_cache_int8(key: Any, value: Any, key_cache: Any, value_cache: Any, key_scale_cache: Any,
                           key_scale: Any, slot_mapping: Any, kv_cache_dtype: str) -> None:
    """int8 rows already quantized (key int8 with key_scale [num_tokens, H_kv]; value int8 for
    int8_k8v8, 16-bit for int8_k8v16) into the int8 fork's HND caches [num_blocks, H_kv,
    block_size, D], key_scale into key_scale_cache [num_blocks, H_kv, block_size]."""
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, None, None,
                         key_scale_cache, key_scale, True, cuda_stream(key_cache))


def fork_varlen_fwd(q: Any, k: Any, v: Any, out: Any, cu_seqlens_q: Any, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_lse: Optional[Any] = None, cu_seqlens_k: Optional[Any] = None,
                    seqused_k: Optional[Any] = None, block_table: Optional[Any] = None, kv_hnd: bool = True,
                    softmax_scale: float = 0.0, causal: bool = False, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Any] = None,
                    alibi_sqrt: bool = False, s_aux: Optional[Any] = None, q_descale: Optional[Any] = None,
                    k_descale: Optional[Any] = None, v_descale: Optional[Any] = None,
                    q_scale: Optional[Any] = None, k_scale_cache: Optional[Any] = None,
                    v_scale: Optional[Any] = None, *, mode: int = _RUN) -> None:
    """Varlen attention as the int8 fork calls it: paged caches in the order kv_hnd says,
    sqrt-ALiBi, sinks (s_aux) and the int8 operands' scales (q_scale [total_q, H], any
    strides; k_scale_cache; v_scale [H_kv, Dv] for an int8 v)."""
    _C.attention(mode, False, q, None, out, softmax_lse, k, v, kv_hnd,
                 cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, None, max_seqlen_q, max_seqlen_k,
                 softmax_scale, softcap, alibi_slopes, alibi_sqrt, causal, window_left, window_right, 0,
                 s_aux, q_descale, k_descale, v_descale, q_scale, k_scale_cache, v_scale,
                 1, 0, None, 0, False, None, workspace_allocator(q), cuda_stream(q))


def spec_draft_expand(out_cache_loc: Any, decode_length: int, page_table: Any, cache_seqlens: Any,
                      cu_seqlens_k: Any) -> None:
    """Tree draft decode's expand metadata (spec_metadata.hpp): page_table[r, :decode_length] =
    out_cache_loc [R, num_steps]'s first decode_length slots, cache_seqlens = decode_length,
    cu_seqlens_k[r] = r * decode_length."""
    _C.spec_draft_expand(out_cache_loc, decode_length, page_table, cache_seqlens, cu_seqlens_k,
                         cuda_stream(page_table))


def spec_verify_expand(custom_mask: Any, req_to_token: Any, req_pool_indices: Any, seq_lens: Any,
                       num_draft_tokens: int, mask_rows: Optional[int], page_table: Any, cache_seqlens: Any,
                       cu_seqlens_k: Any) -> None:
    """Tree verify's expand metadata (spec_metadata.hpp): per draft row the slots of the drafts
    its custom_mask row shows, then the hidden ones; the shown count; its running sum. Draft
    rows from mask_rows on (a padded graph batch) read every mask bit from custom_mask[0]."""
    _C.spec_verify_expand(_mask_bytes(custom_mask), req_to_token, req_pool_indices, seq_lens, num_draft_tokens,
                          mask_rows, page_table, cache_seqlens, cu_seqlens_k, cuda_stream(page_table))


def spec_window_page_table(page_table_a: Any, page_table_b: Any, seq_len_a: Any, seq_len_b: Any,
                           num_draft_tokens: int, page_table: Any, cache_seqlens: Any, cu_seqlens_k: Any) -> None:
    """Sliding-window tree verify (spec_metadata.hpp): per draft row r, page_table_a's row
    r // n then page_table_b's row r concatenated by seq_len_a / seq_len_b; the summed lengths
    and their running sum."""
    _C.spec_window_page_table(page_table_a, page_table_b, seq_len_a, seq_len_b, num_draft_tokens, page_table,
                              cache_seqlens, cu_seqlens_k, cuda_stream(page_table))


def _mask_bytes(mask: Any) -> Any:
    """A bool mask as the uint8 bytes it is stored in (DLPack has no bool the extension takes)."""
    if is_torch(mask):
        return mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    return mask.view(np.uint8) if getattr(mask, "dtype", None) == np.bool_ else mask
