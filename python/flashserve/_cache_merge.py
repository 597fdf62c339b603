"""The cache and merge drop-ins of PYTHON_API.md: vLLM's reshape_and_cache_flash and
merge_attn_states, SGLang's merge_state_v2 (SPEC.md §3, §4)."""

from __future__ import annotations

from . import _dispatch
from ._tensors import empty, float32_of, not_a_tensor, renamed

# C++ argument names -> the drop-ins' names, for error messages.
_MERGE_NAMES = {"out": "output", "out_lse": "output_lse", "a_out": "prefix_output", "a_lse": "prefix_lse",
                "b_out": "suffix_output", "b_lse": "suffix_lse"}
_MERGE_V2_NAMES = {"out": "v_merged", "out_lse": "s_merged", "a_out": "v_a", "a_lse": "s_a",
                   "b_out": "v_b", "b_lse": "s_b"}


def reshape_and_cache_flash(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
) -> None:
    """Writes key/value [num_tokens, H_kv, D] (token stride free) into the paged caches
    [num_blocks, block_size, H_kv, D] (any strides: HND caches are permuted views) at
    slot_mapping (int64 [num_tokens]; negative slots are skipped). kv_cache_dtype "auto",
    "fp8", "fp8_e4m3" or "fp8_e5m2"; fp8 caches store x / scale (k_scale, v_scale fp32 [] or
    [H_kv]; ignored for "auto")."""
    call = _dispatch.call("reshape_and_cache_flash")
    call(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


def merge_attn_states(
    output, prefix_output, prefix_lse, suffix_output, suffix_lse,
    output_lse=None, prefill_tokens_with_context=None, output_scale=None,
) -> None:
    """output = merge((prefix_output, prefix_lse), (suffix_output, suffix_lse)), states
    [T, H, D], LSEs fp32 [H, T]; output_lse [H, T] when given. Rows at or past
    prefill_tokens_with_context copy the suffix state. With output_scale (fp32 [] or [1])
    output is fp8 and stores clamp(x / scale)."""
    call = _dispatch.call("merge_attn_states")
    try:
        call(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
             prefill_tokens_with_context, output_scale)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _MERGE_NAMES) from None


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None) -> tuple:
    """SGLang's merge: states [T, H, D], LSEs fp32 [T, H]. Returns (v_merged, s_merged),
    allocated like v_a / s_a when not given."""
    try:
        if v_merged is None:
            v_merged = empty(tuple(v_a.shape), v_a.dtype, v_a)
        if s_merged is None:
            s_merged = empty(tuple(s_a.shape), float32_of(s_a), s_a)
    except AttributeError:
        raise not_a_tensor(v_a=v_a, s_a=s_a) from None
    call = _dispatch.call("merge_state_v2")
    try:
        call(v_a, s_a, v_b, s_b, v_merged, s_merged)
    except (ValueError, NotImplementedError) as e:
        raise renamed(e, _MERGE_V2_NAMES) from None
    return v_merged, s_merged
