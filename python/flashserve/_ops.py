"""Torch custom ops under the namespace `flashserve`, registered on import (torch required).

Each attention, cache, merge and metadata op writes its outputs in place (`Tensor!` in the schema) and
returns nothing, so torch.compile and CUDA graph capture see an opaque, correctly aliased call;
their fake implementations do nothing (the outputs exist already, with their shapes).
`scheduler_metadata` returns a new tensor (get_scheduler_metadata's). None of the ops
has a backward: autograd raises if gradients are requested through them.

The drop-ins call these ops when torch.compile traces them; in eager mode they call the same
functions (flashserve._calls) directly, which skips the dispatcher's per-call overhead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _calls
from ._tensors import PLAN_WORDS

_SCORE_AND_EXEC = (
    "float softmax_scale=0.0, bool causal=False, int window_left=-1, int window_right=-1, "
    "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? s_aux=None, Tensor? q_descale=None, "
    "Tensor? k_descale=None, Tensor? v_descale=None, int num_splits=0, "
    "Tensor? scheduler_metadata=None, int cp_world_size=1, int cp_rank=0, "
    "Tensor? cp_tot_seqused_k=None")

SCHEMAS = {
    "reshape_and_cache_flash": (
        "(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, Tensor slot_mapping, "
        "str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()"),
    "merge_attn_states": (
        "(Tensor! output, Tensor!? output_lse, Tensor prefix_output, Tensor prefix_lse, "
        "Tensor suffix_output, Tensor suffix_lse, int? prefill_tokens_with_context, "
        "Tensor? output_scale) -> ()"),
    "merge_state_v2": (
        "(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, Tensor! v_merged, Tensor! s_merged) -> ()"),
    "varlen_fwd": (
        "(Tensor q, Tensor k, Tensor v, Tensor! out, Tensor cu_seqlens_q, int max_seqlen_q, "
        "int max_seqlen_k, Tensor!? softmax_lse=None, Tensor? cu_seqlens_k=None, "
        "Tensor? seqused_k=None, Tensor? block_table=None, Tensor? q_v=None, "
        + _SCORE_AND_EXEC + ", int chunk_size=0, bool batch_invariant=False) -> ()"),
    "kvcache_fwd": (
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor! out, Tensor!? softmax_lse=None, "
        "Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, Tensor? block_table=None, "
        + _SCORE_AND_EXEC + ", Tensor? q_v=None, int chunk_size=0, bool batch_invariant=False) -> ()"),
    "quantize_int8": "(Tensor x, Tensor! out, Tensor! scale, bool transpose_scale) -> ()",
    "quantize_int8_static": "(Tensor x, Tensor! scale, Tensor! out, bool compute_scale) -> ()",
    "reshape_and_cache_int8": (
        "(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, Tensor! key_scale_cache, "
        "Tensor key_scale, Tensor slot_mapping, str kv_cache_dtype) -> ()"),
    "fork_varlen_fwd": (
        "(Tensor q, Tensor k, Tensor v, Tensor! out, Tensor cu_seqlens_q, int max_seqlen_q, "
        "int max_seqlen_k, Tensor!? softmax_lse=None, Tensor? cu_seqlens_k=None, "
        "Tensor? seqused_k=None, Tensor? block_table=None, bool kv_hnd=True, "
        "float softmax_scale=0.0, bool causal=False, int window_left=-1, int window_right=-1, "
        "float softcap=0.0, Tensor? alibi_slopes=None, bool alibi_sqrt=False, Tensor? s_aux=None, "
        "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
        "Tensor? q_scale=None, Tensor? k_scale_cache=None, Tensor? v_scale=None) -> ()"),
    "scheduler_metadata": (
        "(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads_q, int num_heads_kv, "
        "int headdim, int headdim_v, Tensor cache_seqlens, Tensor? cu_seqlens_q, int page_size, "
        "bool causal, bool local, int num_splits, bool batch_invariant=False, bool kv_8bit=False) -> Tensor"),
    "spec_draft_expand": (
        "(Tensor out_cache_loc, int decode_length, Tensor! page_table, Tensor! cache_seqlens, "
        "Tensor! cu_seqlens_k) -> ()"),
    "spec_verify_expand": (
        "(Tensor custom_mask, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "int num_draft_tokens, int? mask_rows, Tensor! page_table, Tensor! cache_seqlens, "
        "Tensor! cu_seqlens_k) -> ()"),
    "spec_window_page_table": (
        "(Tensor page_table_a, Tensor page_table_b, Tensor seq_len_a, Tensor seq_len_b, "
        "int num_draft_tokens, Tensor! page_table, Tensor! cache_seqlens, Tensor! cu_seqlens_k) -> ()"),
}

_MUTATES = {
    "reshape_and_cache_flash": ("key_cache", "value_cache"),
    "merge_attn_states": ("output", "output_lse"),
    "merge_state_v2": ("v_merged", "s_merged"),
    "varlen_fwd": ("out", "softmax_lse"),
    "kvcache_fwd": ("out", "softmax_lse"),
    "scheduler_metadata": (),
    "quantize_int8": ("out", "scale"),
    "quantize_int8_static": ("scale", "out"),
    "reshape_and_cache_int8": ("key_cache", "value_cache", "key_scale_cache"),
    "fork_varlen_fwd": ("out", "softmax_lse"),
    "spec_draft_expand": ("page_table", "cache_seqlens", "cu_seqlens_k"),
    "spec_verify_expand": ("page_table", "cache_seqlens", "cu_seqlens_k"),
    "spec_window_page_table": ("page_table", "cache_seqlens", "cu_seqlens_k"),
}


def _nothing(*args: Any, **kwargs: Any) -> None:
    """The fake implementation of every op: outputs are written in place, none is created."""
    return None


def _metadata_fake(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, headdim_v,
                   cache_seqlens, cu_seqlens_q, page_size, causal, local, num_splits,
                   batch_invariant=False, kv_8bit=False) -> torch.Tensor:
    """scheduler_metadata's output: PLAN_WORDS words, whatever the shape."""
    return cache_seqlens.new_empty((PLAN_WORDS,), dtype=torch.int32)


def _register(name: str, impl: Callable[..., Any], fake: Callable[..., Any] = _nothing) -> Any:
    op = torch.library.custom_op(f"flashserve::{name}", impl, mutates_args=_MUTATES[name],
                                 schema=SCHEMAS[name])
    op.register_fake(fake)
    return getattr(torch.ops.flashserve, name).default


reshape_and_cache_flash = _register("reshape_and_cache_flash", _calls.reshape_and_cache_flash)
merge_attn_states = _register("merge_attn_states", _calls.merge_attn_states)
merge_state_v2 = _register("merge_state_v2", _calls.merge_state_v2)
varlen_fwd = _register("varlen_fwd", _calls.varlen_fwd)
kvcache_fwd = _register("kvcache_fwd", _calls.kvcache_fwd)
scheduler_metadata = _register("scheduler_metadata", _calls.scheduler_metadata, _metadata_fake)
quantize_int8 = _register("quantize_int8", _calls.quantize_int8)
reshape_and_cache_int8 = _register("reshape_and_cache_int8", _calls.reshape_and_cache_int8)
fork_varlen_fwd = _register("fork_varlen_fwd", _calls.fork_varlen_fwd)
quantize_int8_static = _register("quantize_int8_static", _calls.quantize_int8_static)
spec_draft_expand = _register("spec_draft_expand", _calls.spec_draft_expand)
spec_verify_expand = _register("spec_verify_expand", _calls.spec_verify_expand)
spec_window_page_table = _register("spec_window_page_table", _calls.spec_window_page_table)
