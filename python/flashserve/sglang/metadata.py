"""The metadata of flashserve.sglang's FlashAttentionBackend: forward-mode predicates, the
metadata dataclasses (SGLang's FlashAttentionMetadata and its LocalAttentionMetadata), chunked
local attention's virtual batches and the in-place decode metadata update of CUDA graph
replay (top-k > 1's metadata: spec_metadata.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .. import _C

_MODES = ("EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND")


def _mode(forward_mode: Any) -> str:
    """The name of an SGLang ForwardMode (an enum member); NotImplementedError for modes this
    backend does not serve."""
    name = getattr(forward_mode, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"forward_mode: expected a ForwardMode (an enum member with .name), got {forward_mode!r}")
    if name not in _MODES:
        raise NotImplementedError(f"forward_mode: {name} is not implemented by flashserve.sglang "
                                  f"(implemented: {', '.join(_MODES)})")
    return name


def _is_decode_or_idle(mode: Any) -> bool:
    return _mode(mode) in ("DECODE", "IDLE")


def _is_target_verify(mode: Any) -> bool:
    return _mode(mode) == "TARGET_VERIFY"


def _is_extend_like(mode: Any) -> bool:
    return _mode(mode) in ("EXTEND", "DRAFT_EXTEND", "MIXED")


def _is_draft_extend(mode: Any) -> bool:
    return _mode(mode) == "DRAFT_EXTEND"


def _host_max(t: Any) -> int:
    """max of a host tensor / list (0 when empty)."""
    if isinstance(t, torch.Tensor):
        return int(t.max().item()) if t.numel() else 0
    return int(max(t)) if len(t) else 0


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    """[0, cumsum(x)...] as int32."""
    return torch.nn.functional.pad(torch.cumsum(x, dim=0, dtype=torch.int32), (1, 0))


def _cumsum_into(cu: torch.Tensor, x: torch.Tensor) -> None:
    """cu[1:] = cumsum(x) as int32, in place (cu[0] stays 0): the cu_seqlens of graph buffers."""
    cu[1:].copy_(torch.cumsum(x, dim=0, dtype=torch.int32))


@dataclass
class LocalAttentionMetadata:
    local_query_start_loc: Optional[torch.Tensor] = None  # cu_seqlens_q for local attention
    local_seqused_k: Optional[torch.Tensor] = None  # sequence lengths for local attention
    local_block_table: Optional[torch.Tensor] = None  # block table for local attention
    local_max_query_len: int = 0
    local_max_seq_len: int = 0


@dataclass
class FlashAttentionMetadata:
    """SGLang's per-step metadata, shared by every layer of the step."""
    cache_seqlens_int32: Optional[torch.Tensor] = None
    max_seq_len_q: int = 1
    max_seq_len_k: int = 0
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    window_size: tuple = (-1, -1)
    page_table: Optional[torch.Tensor] = None
    encoder_cu_seqlens_k: Optional[torch.Tensor] = None
    encoder_max_seq_len_k: int = 0
    encoder_lens_int32: Optional[torch.Tensor] = None
    encoder_page_table: Optional[torch.Tensor] = None
    local_attn_metadata: Optional[LocalAttentionMetadata] = None
    # sliding-window layers under speculative top-k > 1 verify
    swa_spec_metadata: Optional["FlashAttentionMetadata"] = None


FlashAttentionMetadata.LocalAttentionMetadata = LocalAttentionMetadata  # SGLang's nested name


def cdiv(a: Any, b: int) -> Any:
    return -(a // -b)


def make_local_attention_virtual_batches(attn_chunk_size: int, query_start_loc_np: np.ndarray,
                                         seq_lens_np: np.ndarray, block_table: torch.Tensor,
                                         page_size: int = 0) -> tuple:
    """SGLang's (from vLLM) split of each request into virtual requests, one per attention
    chunk: returns (seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local).
    Example (SPEC.md §6): chunk 4, q lens [4, 10, 5], k lens [6, 17, 9] -> q lens local
    [2, 2, 1, 4, 4, 1, 4, 1], k lens local [4, 2, 4, 4, 4, 1, 4, 1], k starts
    [0, 4, 4, 8, 12, 16, 4, 8]; block_table rows gathered from those starts."""
    page_size = max(1, page_size)
    max_seq_len = seq_lens_np.max()
    effective = min(attn_chunk_size, max_seq_len)
    effective = (effective // page_size) * page_size
    if effective < page_size:
        effective = page_size
    attn_chunk_size = int(effective)
    q_seqlens = query_start_loc_np[1:] - query_start_loc_np[:-1]
    batch = seq_lens_np.shape[0]
    q_tokens_in_first_block = np.minimum(attn_chunk_size - ((seq_lens_np - q_seqlens) % attn_chunk_size),
                                         q_seqlens).astype(np.int32)
    tokens_in_last_block = attn_chunk_size + (seq_lens_np % -attn_chunk_size)
    local_blocks = 1 + cdiv(q_seqlens - q_tokens_in_first_block, attn_chunk_size)
    cu_num_blocks = np.cumsum(local_blocks)
    virtual_batches = cu_num_blocks[-1]
    block_offsets = np.repeat(cu_num_blocks - local_blocks, local_blocks)
    arange = np.arange(virtual_batches, dtype=np.int32) - block_offsets
    rarange = np.repeat(local_blocks, local_blocks) - arange - 1
    seqlens_q_local = np.repeat(q_seqlens - q_tokens_in_first_block, local_blocks)
    seqlens_q_local[arange == 0] = q_tokens_in_first_block
    seqlens_q_local[arange > 0] = np.minimum(seqlens_q_local - attn_chunk_size * (arange - 1),
                                             attn_chunk_size)[arange > 0]
    cu_seqlens_q_local = np.pad(np.cumsum(seqlens_q_local), (1, 0)).astype(np.int32)
    seqlens_k_local = np.full(cu_num_blocks[-1], attn_chunk_size, dtype=np.int32)
    seqlens_k_local[cu_num_blocks - 1] = tokens_in_last_block
    k_seqstarts_absolute = np.repeat(seq_lens_np, local_blocks) - (
        rarange * attn_chunk_size + np.repeat(tokens_in_last_block, local_blocks))
    block_starts = k_seqstarts_absolute // page_size
    if attn_chunk_size % page_size != 0:
        raise ValueError(f"attention_chunk_size: {attn_chunk_size} is not divisible by page_size {page_size}")
    pages_per_local_batch = attn_chunk_size // page_size
    block_indices = np.broadcast_to(np.arange(pages_per_local_batch, dtype=np.int32),
                                    (virtual_batches, pages_per_local_batch)) + np.expand_dims(block_starts, axis=1)
    block_indices = block_indices.flatten().clip(max=block_table.shape[1] - 1)
    batch_indices = np.repeat(np.arange(batch, dtype=np.int32), local_blocks * pages_per_local_batch)
    bi = torch.from_numpy(batch_indices.astype(np.int64)).to(block_table.device)
    ki = torch.from_numpy(block_indices.astype(np.int64)).to(block_table.device)
    block_table_local = block_table[bi, ki].view(virtual_batches, -1)
    return seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local


def local_virtual_batches(attn_chunk_size: int, query_start_loc_np: np.ndarray, seq_lens_np: np.ndarray,
                          block_table: torch.Tensor, page_size: int = 1) -> tuple:
    """make_local_attention_virtual_batches' results from flashserve's C++ planner
    (_C.local_virtual_batches, src/planner/local_batches.cpp): one virtual request per
    (request, chunk touched by its queries), the block table rows gathered on block_table's
    device. Unlike SGLang's numpy version the chunk is never shrunk to the longest sequence
    (the same result whenever that sequence reaches the chunk), so the mask is always the
    chunked-local one. Returns (seqlens_q_local, cu_seqlens_q_local, seqlens_k_local,
    block_table_local [V, chunk / page_size])."""
    page_size = max(1, page_size)
    if attn_chunk_size % page_size != 0:
        raise ValueError(f"attention_chunk_size: expected a multiple of page_size {page_size}, got {attn_chunk_size}")
    cu, used, start, req = _C.local_virtual_batches(np.ascontiguousarray(query_start_loc_np, dtype=np.int32),
                                                    np.ascontiguousarray(seq_lens_np, dtype=np.int32),
                                                    int(attn_chunk_size))
    cu_np = np.asarray(cu, dtype=np.int32)
    width = attn_chunk_size // page_size
    device = block_table.device
    first = torch.tensor(start, dtype=torch.int64).div(page_size, rounding_mode="floor").to(device)
    cols = (first[:, None] + torch.arange(width, device=device)[None, :]).clamp(max=block_table.shape[1] - 1)
    rows = torch.tensor(req, dtype=torch.int64).to(device)
    return np.diff(cu_np), cu_np, np.asarray(used, dtype=np.int32), block_table[rows[:, None], cols]


def normal_decode_set_metadata(cache_seqlens_int32: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               page_table: torch.Tensor, req_to_token: torch.Tensor,
                               req_pool_indices: torch.Tensor, strided_indices: torch.Tensor, max_seq_pages: int,
                               seq_lens: torch.Tensor, seq_len_delta: int, page_size: int) -> None:
    """In-place update of the decode graph buffers (SGLang's function of the same name)."""
    cache_seqlens_int32.copy_(seq_lens + seq_len_delta)
    _cumsum_into(cu_seqlens_k, cache_seqlens_int32)
    page_indices = req_to_token[req_pool_indices[:, None], strided_indices[:max_seq_pages][None, :]]
    page_table[:, :max_seq_pages].copy_(page_indices // page_size)
