"""The KV-cache maintenance drop-ins of vLLM v0 (SPEC.md §3): `swap_blocks`, `copy_blocks` and
`advance_step` (vLLM's `ops.swap_blocks`, `ops.copy_blocks`, `ops.advance_step_flashattn`, same
arguments in the same order), over the extension's copy, swap and advance-step calls.

Tensors are torch (CPU or CUDA) or numpy (CPU). CUDA calls run on the current stream of the
tensors' device, allocate nothing and never wait for the device (swap_blocks' block_mapping
lives on the host, as in vLLM). Bad input raises ValueError naming the argument before
anything is written.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from . import _C
from ._tensors import cuda_stream, is_torch

_CACHE_INDEX = re.compile(r"^caches\[(\d+)\]")


def swap_blocks(src, dst, block_mapping) -> None:
    """Copies block s of `src` to block d of `dst` for each row (s, d) of block_mapping (int64
    [n, 2] on the CPU), between device and host caches (or within one device). src and dst
    have one dtype and block shape (dims 1..); block indices are dim 0."""
    cuda = src if is_torch(src) and src.is_cuda else dst
    _C.swap_blocks(src, dst, block_mapping, cuda_stream(cuda))


def copy_blocks(key_caches: Sequence[Any], value_caches: Sequence[Any], block_mapping) -> None:
    """Copy-on-write: block s to block d of every cache in key_caches and value_caches (one per
    layer, all with the same number of blocks, on one device), for each row (s, d) of
    block_mapping (int64 [n, 2], on the caches' device). A destination must not be the source
    or the destination of another row."""
    keys, values = list(key_caches), list(value_caches)
    if len(values) != len(keys):
        raise ValueError(f"value_caches: expected {len(keys)} caches (one per key cache), got {len(values)}")
    caches = keys + values
    try:
        _C.copy_blocks(caches, block_mapping, cuda_stream(caches[0] if caches else block_mapping))
    except ValueError as e:
        raise _cache_named(e, len(keys)) from None


def _cache_named(error: ValueError, num_keys: int) -> ValueError:
    """The extension's "caches[i]: ..." as key_caches[i] / value_caches[i - num_keys]."""
    message = str(error)
    match = _CACHE_INDEX.match(message)
    if match is None:
        return error
    i = int(match.group(1))
    name = f"key_caches[{i}]" if i < num_keys else f"value_caches[{i - num_keys}]"
    return ValueError(name + message[match.end():])


def advance_step(num_seqs: int, num_queries: int, block_size: int, input_tokens, sampled_token_ids,
                 input_positions, seq_lens, slot_mapping, block_tables, *,
                 turn_prefills_into_decodes: bool = False) -> None:
    """Advances decode metadata by one token in place, on the device (multi-step decode), as
    vLLM's advance_step_flashattn. For each query i < num_queries: input_tokens[i] =
    sampled_token_ids[i, 0]; input_positions[i] = seq_lens[i]; seq_lens[i] += 1; slot_mapping[i]
    = the slot of that position through block_tables[i] (block_size tokens a block). Rows
    num_queries <= i < num_seqs are CUDA-graph padding: input_tokens 0, input_positions 0,
    slot_mapping -1, seq_lens untouched.

    input_tokens, input_positions (int64), seq_lens (int32), slot_mapping (int64) and
    block_tables (int32 [num_seqs, max_blocks]) have num_seqs rows, sampled_token_ids is int64
    [num_queries, 1]. turn_prefills_into_decodes: the first step after a mixed step whose
    prefills now decode (vLLM v0's FlashAttentionMetadata.advance_step with
    turn_prefills_into_decodes=True): input_tokens, input_positions and slot_mapping may
    still hold that step's rows, more than num_seqs; their first num_seqs rows become the next
    step's, one per sequence, and the rest are left alone.

    On CUDA a row whose next position has no block in block_tables is written as a padding row
    (the host cannot check device contents without a synchronization); on the CPU it raises."""
    for name, t in (("input_tokens", input_tokens), ("input_positions", input_positions),
                    ("slot_mapping", slot_mapping), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        shape = tuple(getattr(t, "shape", ()))
        longer_ok = turn_prefills_into_decodes and name not in ("seq_lens", "block_tables")
        if shape and shape[0] != num_seqs and not (longer_ok and shape[0] > num_seqs):
            rows = f">= num_seqs = {num_seqs}" if longer_ok else f"num_seqs = {num_seqs}"
            hint = "" if longer_ok or name in ("seq_lens", "block_tables") else \
                " (more only with turn_prefills_into_decodes=True)"
            raise ValueError(f"{name}: expected {rows} rows{hint}, got {list(shape)}")
    _C.advance_step(num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions,
                    seq_lens, slot_mapping, block_tables, cuda_stream(seq_lens))


advance_step_flashattn = advance_step  # vLLM v0's name of the op
