"""SGLang's FlashAttentionBackend (sglang/srt/layers/attention/flashattention_backend.py, the
2025-09 version) over flashserve.

The class keeps SGLang's method names, arguments, metadata fields and CUDA graph buffers, and
builds its metadata the way SGLang does: page tables gathered from `req_to_token` (token
granular; strided by page_size and divided into page ids when page_size > 1), `cu_seqlens_q`
from `extend_seq_lens`, two metadata sets for speculative decoding with top-k > 1 (the shared
prefix through the page table, causal=False, and each draft branch's own tokens through an
"expand" page table of token slots), merged by LSE with merge_state_v2; sliding-window layers
under top-k > 1 verify take one concatenated page table per draft token (prefix + the draft
tokens its custom mask lets it see); chunked local attention splits requests into virtual
batches (make_local_attention_virtual_batches); MLA runs in the absorbed form (q_rope against
the rope part of the latent cache, qv = q_nope against its compressed part) or, for the MHA
prefill of MLA models (forward_batch.attn_attend_prefix_cache not None), through
flash_attn_varlen_func with D=192 / Dv=128 and the LSE returned for the model's merge.
Every attention call is flashserve.fa3's flash_attn_with_kvcache / flash_attn_varlen_func.

The engine objects are read by attribute name (duck-typed), as SGLang names them:
model_runner (device, page_size, sliding_window_size, is_hybrid, attention_chunk_size,
model_config.{context_len, attention_arch, is_encoder_decoder}, server_args.{kv_cache_dtype,
speculative_eagle_topk, speculative_num_draft_tokens, enable_deterministic_inference},
kv_cache_dtype, req_to_token_pool.req_to_token, token_to_kv_pool), forward_batch
(forward_mode with an enum `.name` among EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY,
DRAFT_EXTEND; batch_size, seq_lens, seq_lens_cpu, req_pool_indices, out_cache_loc,
extend_prefix_lens_cpu, extend_seq_lens(_cpu), spec_info, encoder_lens,
encoder_out_cache_loc, attn_attend_prefix_cache, req_to_token_pool, token_to_kv_pool), the
RadixAttention layer (layer_id, tp_q_head_num, tp_k_head_num, tp_v_head_num, head_dim,
v_head_dim, scaling, logit_cap, sliding_window_size, is_cross_attention, k_scale, v_scale,
use_irope) and the KV pool (set_kv_buffer, get_kv_buffer, set_mla_kv_buffer, get_key_buffer).

Differences from SGLang, each a correction or a generalization:
- chunked local attention's virtual batches come from flashserve's C++ planner
  (local_virtual_batches over _C.local_virtual_batches; SGLang's numpy version,
  make_local_attention_virtual_batches, is kept and gives the same batches whenever the
  longest sequence reaches the chunk, where SGLang does not shrink the chunk), built from the
  page table after its conversion to page ids (SGLang converts after, right only for
  page_size 1);
- encoder-decoder batches may hold more than one request (SGLang asserts one): each
  request's decoder tokens start at its own encoder length in req_to_token;
- the sliding-window page-table concatenation of top-k > 1 verify is torch ops instead of a
  Triton kernel (same result, works on the CPU);
- with top-k > 1, sinks enter the prefix pass only (SGLang passes them to both passes of the
  merge, which counts the sink twice).
Not implemented (NotImplementedError naming the feature): speculative top-k > 1 and
cross attention with page_size > 1 (SGLang's expand page tables hold token slots), forward
modes other than the six above.

Forward calls never synchronize with the device; metadata construction does where SGLang's
does (max lengths read from seq_lens_cpu; chunked local attention on the host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .. import _C
from .._cache_merge import merge_state_v2
from ..fa3 import flash_attn_varlen_func, flash_attn_with_kvcache

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


def prepare_swa_spec_page_table(page_table_dst: torch.Tensor, page_table_a: torch.Tensor,
                                page_table_b: torch.Tensor, seq_len_a: torch.Tensor, seq_len_b: torch.Tensor,
                                speculative_num_draft_tokens: int) -> None:
    """Row r of page_table_dst = the first seq_len_a[r // n] entries of page_table_a's row
    r // n, then the first seq_len_b[r] entries of page_table_b's row r (n = draft tokens per
    request); SGLang's prepare_swa_spec_page_table_triton as torch ops (no host sync)."""
    bs, bs_expand = seq_len_a.numel(), seq_len_b.numel()
    if bs_expand != bs * speculative_num_draft_tokens:
        raise ValueError(f"seq_len_b: expected {bs} * {speculative_num_draft_tokens} entries, got {bs_expand}")
    len_a, len_b = page_table_a.shape[1], page_table_b.shape[1]
    width = min(len_a + len_b, page_table_dst.shape[1])
    device = page_table_dst.device
    n = torch.arange(width, device=device)[None, :]
    rows_a = page_table_a.repeat_interleave(speculative_num_draft_tokens, dim=0)
    la = seq_len_a.long().repeat_interleave(speculative_num_draft_tokens)[:, None]
    lb = seq_len_b.long()[:, None]
    va = rows_a.gather(1, n.clamp(max=len_a - 1).expand(bs_expand, width))
    vb = page_table_b.gather(1, (n - la).clamp(0, len_b - 1))
    val = torch.where(n < la, va, torch.where(n - la < lb, vb, torch.zeros_like(vb)))
    page_table_dst[:bs_expand, :width].copy_(val)


def normal_decode_set_metadata(cache_seqlens_int32: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               page_table: torch.Tensor, req_to_token: torch.Tensor,
                               req_pool_indices: torch.Tensor, strided_indices: torch.Tensor, max_seq_pages: int,
                               seq_lens: torch.Tensor, seq_len_delta: int, page_size: int) -> None:
    """In-place update of the decode graph buffers (SGLang's function of the same name)."""
    cache_seqlens_int32.copy_(seq_lens + seq_len_delta)
    cu_seqlens_k[1:].copy_(torch.cumsum(cache_seqlens_int32, dim=0, dtype=torch.int32))
    page_indices = req_to_token[req_pool_indices[:, None], strided_indices[:max_seq_pages][None, :]]
    page_table[:, :max_seq_pages].copy_(page_indices // page_size)


class FlashAttentionBackend:
    """SGLang's FlashAttentionBackend over flashserve (see the module docstring).

    init_forward_metadata(forward_batch) once per step; forward_extend / forward_decode (or
    forward) once per layer; init_cuda_graph_state once, then
    init_forward_metadata_capture_cuda_graph per captured batch size and
    init_forward_metadata_replay_cuda_graph before each replay (preallocated metadata tensors
    updated in place)."""

    def __init__(self, model_runner: Any, skip_prefill: bool = False, speculative_step_id: int = 0, topk: int = 0,
                 speculative_num_steps: int = 0, fa_impl_ver: int = 3) -> None:
        if fa_impl_ver not in (3, 4):
            raise ValueError(f"fa_impl_ver: expected 3 or 4, got {fa_impl_ver!r}")
        config = model_runner.model_config
        if model_runner.sliding_window_size is not None and getattr(config, "is_encoder_decoder", False):
            raise NotImplementedError("sliding window attention together with cross attention "
                                      "(SGLang's FlashAttention backend does not support it either)")
        self.forward_metadata: Optional[FlashAttentionMetadata] = None
        self.forward_metadata_spec_decode_expand: Optional[FlashAttentionMetadata] = None
        self.max_context_len = config.context_len
        self.device = model_runner.device
        self.decode_cuda_graph_metadata: dict = {}
        self.target_verify_metadata: dict = {}
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.kv_cache_dtype_str = model_runner.server_args.kv_cache_dtype
        self.page_size = model_runner.page_size
        arch = getattr(config, "attention_arch", None)
        self.use_mla = getattr(arch, "name", arch) == "MLA"
        self.skip_prefill = skip_prefill
        self.is_hybrid = bool(getattr(model_runner, "is_hybrid", False))
        if self.is_hybrid:
            self.full_to_swa_index_mapping = model_runner.token_to_kv_pool.full_to_swa_index_mapping
        self.topk = model_runner.server_args.speculative_eagle_topk or 0
        self.speculative_num_steps = speculative_num_steps
        self.speculative_num_draft_tokens = model_runner.server_args.speculative_num_draft_tokens
        self.speculative_step_id = speculative_step_id
        self.fa_impl_ver = fa_impl_ver
        self.attention_chunk_size = getattr(model_runner, "attention_chunk_size", None)
        self.sliding_window_size = model_runner.sliding_window_size
        self.has_swa = self.sliding_window_size is not None and self.sliding_window_size > -1
        self.num_splits = 1 if getattr(model_runner.server_args, "enable_deterministic_inference", False) else 0
        if self.topk > 1 and self.page_size > 1:
            raise NotImplementedError(f"speculative decoding with top-k > 1 (topk={self.topk}) and page_size > 1 "
                                      f"(page_size={self.page_size}): the draft branches' page tables hold token slots")

    # ---------------------------------------------------------------- metadata, eager

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Metadata of one step, reused by every layer (SGLang's init_forward_metadata)."""
        metadata = FlashAttentionMetadata()
        seqlens_in_batch = forward_batch.seq_lens
        batch_size = forward_batch.batch_size
        device = seqlens_in_batch.device
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices
        mode = forward_batch.forward_mode
        name = _mode(mode)
        max_seq_cpu = _host_max(forward_batch.seq_lens_cpu)
        local = False
        if _is_decode_or_idle(mode):
            if forward_batch.spec_info is not None:  # draft decode
                if self.topk <= 1:
                    step = self.speculative_step_id + 1
                    metadata.cache_seqlens_int32 = (seqlens_in_batch + step).to(torch.int32)
                    metadata.max_seq_len_k = max_seq_cpu + step
                    metadata.cu_seqlens_q = torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
                    metadata.cu_seqlens_k = _cumsum0(metadata.cache_seqlens_int32)
                    metadata.page_table = req_to_token[rows, :metadata.max_seq_len_k]
                else:
                    metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
                    metadata.max_seq_len_q = self.topk
                    metadata.max_seq_len_k = max_seq_cpu
                    metadata.cu_seqlens_q = torch.arange(0, batch_size * self.topk + 1, step=self.topk,
                                                         dtype=torch.int32, device=device)
                    metadata.cu_seqlens_k = _cumsum0(metadata.cache_seqlens_int32)
                    metadata.page_table = req_to_token[rows, :metadata.max_seq_len_k]
                    self.forward_metadata_spec_decode_expand = self._draft_decode_expand(
                        forward_batch.out_cache_loc, seqlens_in_batch.numel(), device)
            else:  # normal decode
                metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
                metadata.max_seq_len_k = max_seq_cpu
                metadata.cu_seqlens_q = torch.arange(0, batch_size + 1, dtype=torch.int32, device=device)
                metadata.cu_seqlens_k = _cumsum0(seqlens_in_batch)
                metadata.page_table = req_to_token[rows, :metadata.max_seq_len_k]
                local = True
        elif _is_target_verify(mode):
            n_draft = self._num_draft_tokens()
            if self.topk <= 1:
                metadata.cache_seqlens_int32 = (seqlens_in_batch + n_draft).to(torch.int32)
                metadata.max_seq_len_q = n_draft
                metadata.max_seq_len_k = max_seq_cpu + n_draft
                metadata.cu_seqlens_q = torch.arange(0, batch_size * n_draft + 1, n_draft, dtype=torch.int32,
                                                     device=device)
                metadata.cu_seqlens_k = _cumsum0(metadata.cache_seqlens_int32)
                metadata.page_table = req_to_token[rows, :metadata.max_seq_len_k]
                local = True
            else:
                metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
                metadata.max_seq_len_q = n_draft
                metadata.max_seq_len_k = max_seq_cpu
                metadata.cu_seqlens_q = torch.arange(0, batch_size * n_draft + 1, step=n_draft, dtype=torch.int32,
                                                     device=device)
                metadata.cu_seqlens_k = _cumsum0(metadata.cache_seqlens_int32)
                metadata.page_table = req_to_token[rows, :metadata.max_seq_len_k]
                metadata_expand = FlashAttentionMetadata()
                metadata_expand.max_seq_len_q = 1
                metadata_expand.cu_seqlens_q = torch.arange(0, seqlens_in_batch.numel() * n_draft + 1,
                                                            dtype=torch.int32, device=device)
                page_table, lens = self._verify_expand_page_table(req_to_token, rows, seqlens_in_batch,
                                                                  forward_batch.spec_info, None)
                metadata_expand.page_table = page_table
                metadata_expand.cache_seqlens_int32 = lens
                metadata_expand.cu_seqlens_k = _cumsum0(lens)
                self.forward_metadata_spec_decode_expand = metadata_expand
                if self.has_swa:
                    self._init_sliding_window_attn_spec_metadata(metadata, metadata_expand)
        elif _is_extend_like(mode):
            metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
            metadata.max_seq_len_k = max_seq_cpu
            metadata.cu_seqlens_k = _cumsum0(seqlens_in_batch)
            metadata.page_table = req_to_token[rows, :metadata.max_seq_len_k]
            if any(forward_batch.extend_prefix_lens_cpu) or name == "DRAFT_EXTEND":
                metadata.max_seq_len_q = _host_max(forward_batch.extend_seq_lens_cpu)
                metadata.cu_seqlens_q = _cumsum0(forward_batch.extend_seq_lens)
            else:
                metadata.max_seq_len_q = metadata.max_seq_len_k
                metadata.cu_seqlens_q = metadata.cu_seqlens_k
            local = name == "EXTEND"

        encoder_lens = getattr(forward_batch, "encoder_lens", None)
        if encoder_lens is not None:
            if self.page_size > 1:
                raise NotImplementedError(f"cross attention (encoder_lens) with page_size > 1 "
                                          f"(page_size={self.page_size})")
            metadata.encoder_lens_int32 = encoder_lens.to(torch.int32)
            metadata.encoder_cu_seqlens_k = _cumsum0(metadata.encoder_lens_int32)
            metadata.encoder_max_seq_len_k = _host_max(encoder_lens.cpu())
            metadata.encoder_page_table = req_to_token[rows, :metadata.encoder_max_seq_len_k]
            metadata.page_table = self._decoder_page_table(rows, metadata.encoder_lens_int32,
                                                           metadata.max_seq_len_k)

        if self.page_size > 1:  # token slots -> page ids, one per page
            self.strided_indices = torch.arange(0, metadata.page_table.shape[1], self.page_size, device=device)
            metadata.page_table = metadata.page_table[:, self.strided_indices] // self.page_size
        if local:
            self._init_local_attn_metadata(forward_batch, metadata, device)
        self.forward_metadata = metadata

    def _num_draft_tokens(self) -> int:
        n = self.speculative_num_draft_tokens
        if not n or n < 1:
            raise ValueError(f"speculative_num_draft_tokens: expected >= 1 for TARGET_VERIFY, got {n!r}")
        return int(n)

    def _draft_decode_expand(self, out_cache_loc: torch.Tensor, bs: int, device: Any) -> FlashAttentionMetadata:
        """Draft decode, top-k > 1: one query per branch against its own draft tokens
        (out_cache_loc [bs, topk, num_steps] -> rows bs * topk, the first step_id + 1 columns)."""
        decode_length = self.speculative_step_id + 1
        if self.speculative_num_steps < decode_length:
            raise ValueError(f"speculative_num_steps: expected >= speculative_step_id + 1 = {decode_length}, "
                             f"got {self.speculative_num_steps}")
        expand = FlashAttentionMetadata()
        n = bs * self.topk
        expand.cache_seqlens_int32 = torch.full((n,), decode_length, device=device, dtype=torch.int32)
        expand.max_seq_len_q = 1
        expand.cu_seqlens_q = torch.arange(0, n + 1, dtype=torch.int32, device=device)
        expand.cu_seqlens_k = torch.arange(0, n * decode_length + 1, step=decode_length, dtype=torch.int32,
                                           device=device)
        if out_cache_loc is None or out_cache_loc.numel() != n * self.speculative_num_steps:
            got = None if out_cache_loc is None else list(out_cache_loc.shape)
            raise ValueError(f"out_cache_loc: expected bs * topk * speculative_num_steps = "
                             f"{n * self.speculative_num_steps} slots for draft decode with top-k > 1, got {got}")
        cache_loc = out_cache_loc.view(-1, self.speculative_num_steps)
        expand.page_table = cache_loc[:, :decode_length].contiguous().to(torch.int32)
        return expand

    def _verify_expand_page_table(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                  seq_lens: torch.Tensor, spec_info: Any, n_rows: Optional[int]) -> tuple:
        """Target verify, top-k > 1: for each draft token (row), the slots of the draft tokens its
        custom mask shows, valid ones first in draft order, and their count. spec_info.custom_mask
        is SGLang's flattened per-request [n_draft, seq_len + n_draft] mask."""
        n_draft = self._num_draft_tokens()
        device = seq_lens.device
        bs = seq_lens.numel()
        offsets = torch.arange(n_draft, device=device).unsqueeze(0)
        cols = offsets.expand(bs, -1) + seq_lens.unsqueeze(1)
        cum_len = torch.nn.functional.pad(
            torch.cumsum((seq_lens + n_draft).repeat_interleave(n_draft), dim=0), (1, 0))[:-1]
        idx = (cols.repeat_interleave(n_draft, dim=0) + cum_len[:, None]).view(1, -1)
        if n_rows is not None:  # graph replay: the padded requests' rows read element 0
            idx[:, n_rows * n_draft:].fill_(0)
        custom_mask = getattr(spec_info, "custom_mask", None)
        if custom_mask is None:
            raise ValueError("spec_info.custom_mask: expected the draft tree's mask for TARGET_VERIFY with top-k > 1, "
                             "got None")
        mask = custom_mask[idx].view(-1, n_draft).bool()
        col_indices = offsets.expand(mask.shape[0], n_draft)
        keys = torch.where(mask, col_indices, col_indices + n_draft)
        _, sort_order = torch.sort(keys, dim=1)
        non_masked = req_to_token[req_pool_indices, :].gather(1, cols).repeat_interleave(n_draft, dim=0)
        return non_masked.gather(1, sort_order), mask.sum(dim=1).to(torch.int32)

    def _decoder_page_table(self, rows: torch.Tensor, encoder_lens: torch.Tensor, width: int) -> torch.Tensor:
        """req_to_token[row, encoder_len + j] for j < width: each request's decoder tokens follow
        its encoder tokens."""
        cols = encoder_lens.long()[:, None] + torch.arange(width, device=encoder_lens.device)[None, :]
        cols = cols.clamp(max=self.req_to_token.shape[1] - 1)
        return self.req_to_token[rows].gather(1, cols)

    def _init_local_attn_metadata(self, forward_batch: Any, metadata: FlashAttentionMetadata, device: Any) -> None:
        if self.attention_chunk_size is None:
            metadata.local_attn_metadata = None
            return
        cu_seqlens_q, seqlens, page_table = metadata.cu_seqlens_q, metadata.cache_seqlens_int32, metadata.page_table
        if self.is_hybrid:
            page_table = self.full_to_swa_index_mapping[page_table].to(torch.int32)
        if cu_seqlens_q is None or seqlens is None or page_table is None or seqlens.numel() == 0:
            metadata.local_attn_metadata = None
            return
        q_local, cu_q_local, k_local, table_local = local_virtual_batches(
            self.attention_chunk_size, cu_seqlens_q.cpu().numpy(), seqlens.cpu().numpy(), page_table, self.page_size)
        metadata.local_attn_metadata = LocalAttentionMetadata(
            local_query_start_loc=torch.from_numpy(cu_q_local).to(device),
            local_seqused_k=torch.from_numpy(k_local).to(device),
            local_block_table=table_local.to(device),
            local_max_query_len=int(q_local.max()),
            local_max_seq_len=int(k_local.max()))

    def _init_sliding_window_attn_spec_metadata(self, metadata: FlashAttentionMetadata,
                                                metadata_expand: FlashAttentionMetadata,
                                                metadata_swa: Optional[FlashAttentionMetadata] = None) -> None:
        """Sliding-window layers under top-k > 1 verify: one query per draft token over the
        prefix then the draft tokens its mask shows (one page table row each), causal, so the
        window counts back from the draft token itself."""
        n_draft = self._num_draft_tokens()
        cache_seqlens = (metadata.cache_seqlens_int32.repeat_interleave(n_draft)
                         + metadata_expand.cache_seqlens_int32)
        cu_seqlens_k = _cumsum0(cache_seqlens)
        rows = cache_seqlens.shape[0]
        if metadata_swa is None:
            page_table = metadata.page_table.new_zeros(
                (rows, metadata.page_table.shape[1] + metadata_expand.page_table.shape[1]))
        else:
            page_table = metadata_swa.page_table
        prepare_swa_spec_page_table(page_table, metadata.page_table, metadata_expand.page_table,
                                    metadata.cache_seqlens_int32, metadata_expand.cache_seqlens_int32, n_draft)
        if metadata_swa is None:
            metadata_swa = FlashAttentionMetadata()
            metadata_swa.max_seq_len_q = 1
            metadata_swa.cu_seqlens_q = metadata_expand.cu_seqlens_q
            metadata_swa.cache_seqlens_int32 = cache_seqlens
            metadata_swa.cu_seqlens_k = cu_seqlens_k
            metadata_swa.page_table = page_table
        else:
            metadata_swa.cache_seqlens_int32.copy_(cache_seqlens)
            metadata_swa.cu_seqlens_k.copy_(cu_seqlens_k)
        metadata.swa_spec_metadata = metadata_swa

    # ---------------------------------------------------------------- forward

    def forward(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                **kwargs: Any) -> Any:
        """SGLang's AttentionBackend.forward: IDLE gives an empty output, DECODE goes to
        forward_decode, the others to forward_extend."""
        name = _mode(forward_batch.forward_mode)
        if name == "IDLE":
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if name == "DECODE":
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def _metadata(self) -> FlashAttentionMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("forward_metadata: call init_forward_metadata (or the CUDA graph capture/replay "
                               "metadata calls) before the forward")
        return self.forward_metadata

    def _save_kv(self, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool, k_rope: Any) -> None:
        if k is None:
            return
        if v is None:
            raise ValueError("v: expected a tensor with k, got None")
        if not save_kv_cache:
            return
        loc = forward_batch.encoder_out_cache_loc if layer.is_cross_attention else forward_batch.out_cache_loc
        pool = forward_batch.token_to_kv_pool
        if not self.use_mla:
            pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)
        else:
            pool.set_mla_kv_buffer(layer, loc, k, k_rope)

    def _descales(self, layer: Any, forward_batch: Any, q: Any, q_rope: Any, allow: bool) -> tuple:
        """fp8 caches: (q, q_rope, k_descale, v_descale) as SGLang derives them."""
        k_descale = v_descale = None
        if self.kv_cache_dtype_str != "auto" and layer.head_dim <= 256 and allow:
            if layer.k_scale is not None:
                shape = (forward_batch.batch_size, layer.tp_k_head_num)
                k_descale = layer.k_scale.expand(shape)
                v_descale = layer.v_scale.expand(shape)
            q = q.to(self.kv_cache_dtype)
            q_rope = q_rope.to(self.kv_cache_dtype) if q_rope is not None else None
        return q, q_rope, k_descale, v_descale

    def _kwargs(self, sinks: Any) -> dict:
        kwargs = {}
        if self.fa_impl_ver != 3:
            kwargs["ver"] = self.fa_impl_ver
        if sinks is not None:
            kwargs["sinks"] = sinks
        return kwargs

    @staticmethod
    def _window(layer: Any) -> tuple:
        # SGLang's layer.sliding_window_size is already w - 1 (both ends inclusive)
        w = getattr(layer, "sliding_window_size", None)
        return (w, 0) if w is not None and w > -1 else (-1, -1)

    @staticmethod
    def _check_q(q: Any, layer: Any, width: int, name: str = "q") -> None:
        if not isinstance(q, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(q).__name__}")
        per_token = layer.tp_q_head_num * width
        if q.numel() % per_token != 0:
            raise ValueError(f"{name}: expected [num_tokens, {layer.tp_q_head_num} * {width}] "
                             f"(tp_q_head_num * head size), got shape {list(q.shape)}")

    @staticmethod
    def _kv_buffers(layer: Any, forward_batch: Any) -> tuple:
        """The layer's K/V buffers [tokens, H_kv, D], checked against the layer's head counts."""
        key_cache, value_cache = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        for name, buf, heads in (("key", key_cache, layer.tp_k_head_num), ("value", value_cache, layer.tp_v_head_num)):
            if buf.dim() < 2 or buf.shape[-1] != layer.head_dim or buf.numel() % (heads * layer.head_dim) != 0 or (
                    buf.dim() >= 3 and buf.shape[-2] != heads):
                raise ValueError(f"token_to_kv_pool.get_kv_buffer({layer.layer_id}): the {name} buffer "
                                 f"{list(buf.shape)} does not hold layer.tp_{name[0]}_head_num={heads} heads of "
                                 f"layer.head_dim={layer.head_dim}")
        return key_cache, value_cache

    def _mla_caches(self, layer: Any, forward_batch: Any, q: Any, q_rope: Any) -> tuple:
        """Views of the latent cache [tokens, 1, kv_lora_rank + rope] as (k_rope_cache
        [pages, page_size, 1, rope], c_kv_cache [pages, page_size, 1, kv_lora_rank]) and the
        query halves (q_rope, q_nope)."""
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        rope = layer.head_dim - layer.v_head_dim
        k_rope_cache = kv_cache[:, :, layer.v_head_dim:].view(-1, self.page_size, layer.tp_k_head_num, rope)
        c_kv_cache = kv_cache[:, :, :layer.v_head_dim].view(-1, self.page_size, layer.tp_v_head_num,
                                                            layer.v_head_dim)
        if q_rope is not None:
            self._check_q(q, layer, layer.v_head_dim)
            self._check_q(q_rope, layer, rope, "q_rope")
            q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            q_rope = q_rope.view(-1, layer.tp_q_head_num, rope)
        else:
            self._check_q(q, layer, layer.head_dim)
            q_all = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
            q_nope = q_all[:, :, :layer.v_head_dim]
            q_rope = q_all[:, :, layer.v_head_dim:]
        return k_rope_cache, c_kv_cache, q_rope, q_nope

    def _attend(self, q: Any, k_cache: Any, v_cache: Any, md: FlashAttentionMetadata, layer: Any, *, causal: bool,
                window: tuple, k_descale: Any, v_descale: Any, kwargs: dict, qv: Any = None, lse: bool = False,
                table: Any = None, seqlens: Any = None, cu_q: Any = None, cu_k: Any = None,
                max_q: Optional[int] = None) -> Any:
        """One flash_attn_with_kvcache call as SGLang makes it, over md's tables (or the ones given)."""
        return flash_attn_with_kvcache(
            q=q, k_cache=k_cache, v_cache=v_cache, qv=qv,
            page_table=md.page_table if table is None else table,
            cache_seqlens=md.cache_seqlens_int32 if seqlens is None else seqlens,
            cu_seqlens_q=md.cu_seqlens_q if cu_q is None else cu_q,
            cu_seqlens_k_new=md.cu_seqlens_k if cu_k is None else cu_k,
            max_seqlen_q=md.max_seq_len_q if max_q is None else max_q,
            softmax_scale=layer.scaling, causal=causal, window_size=window, softcap=layer.logit_cap,
            k_descale=k_descale, v_descale=v_descale, return_softmax_lse=lse, num_splits=self.num_splits,
            **kwargs)

    def _cascade(self, first: Any, q: Any, k_cache: Any, v_cache: Any, layer: Any, window: tuple, k_descale: Any,
                 v_descale: Any, kwargs: dict, qv: Any = None) -> Any:
        """Top-k > 1: merge the prefix pass (first = (o, lse)) with the pass over each branch's
        own draft tokens (the expand metadata), by LSE. The sink logits (kwargs' sinks) enter
        the prefix pass only: one sink per softmax (SPEC.md §2), where SGLang passes them to
        both passes and so counts them twice."""
        o, softmax_lse, *_ = first
        kwargs = {key: val for key, val in kwargs.items() if key != "sinks"}
        expand = self.forward_metadata_spec_decode_expand
        if expand is None:
            raise RuntimeError("forward_metadata_spec_decode_expand: missing for speculative top-k > 1; "
                               "init_forward_metadata was not called for this step")
        o_expand, lse_expand, *_ = self._attend(q, k_cache, v_cache, expand, layer, causal=False, window=window,
                                                k_descale=k_descale, v_descale=v_descale, kwargs=kwargs, qv=qv,
                                                lse=True)
        o, _ = merge_state_v2(o, softmax_lse.T.contiguous(), o_expand, lse_expand.T.contiguous())
        return o

    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                       q_rope: Any = None, k_rope: Any = None, sinks: Any = None) -> Any:
        """EXTEND / MIXED / DRAFT_EXTEND / TARGET_VERIFY: writes k/v at out_cache_loc
        (encoder_out_cache_loc for cross attention), then attends. Returns
        [num_tokens, tp_q_head_num * v_head_dim], or (out, lse [tokens, H]) from the MLA MHA
        path when forward_batch.mha_return_lse."""
        self._save_kv(k, v, layer, forward_batch, save_kv_cache, k_rope)
        metadata = self._metadata()
        mode = forward_batch.forward_mode
        window = self._window(layer)
        is_swa = window != (-1, -1)
        q, q_rope, k_descale, v_descale = self._descales(layer, forward_batch, q, q_rope, self.fa_impl_ver != 4)
        causal = not layer.is_cross_attention
        use_local_attn = (self.attention_chunk_size is not None and metadata.local_attn_metadata is not None
                          and getattr(layer, "use_irope", False))
        use_cascade_attn = _is_target_verify(mode) and self.topk > 1 and not is_swa
        kwargs = self._kwargs(sinks)

        cu_seqlens_k = None
        if use_local_attn:
            local = metadata.local_attn_metadata
            page_table, cu_seqlens_q = local.local_block_table, local.local_query_start_loc
            cache_seqlens, max_seqlen_q = local.local_seqused_k, local.local_max_query_len
        elif is_swa and metadata.swa_spec_metadata is not None:
            swa = metadata.swa_spec_metadata
            page_table, cu_seqlens_q = swa.page_table, swa.cu_seqlens_q
            cache_seqlens, max_seqlen_q, cu_seqlens_k = swa.cache_seqlens_int32, swa.max_seq_len_q, swa.cu_seqlens_k
        else:
            page_table, cu_seqlens_q = metadata.page_table, metadata.cu_seqlens_q
            cache_seqlens, max_seqlen_q = metadata.cache_seqlens_int32, metadata.max_seq_len_q
            cu_seqlens_k = metadata.cu_seqlens_k

        if not self.use_mla:
            self._check_q(q, layer, layer.head_dim)
            key_cache, value_cache = self._kv_buffers(layer, forward_batch)
            key_cache = key_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
            value_cache = value_cache.view(-1, self.page_size, layer.tp_v_head_num, layer.head_dim)
            if layer.is_cross_attention:
                if metadata.encoder_page_table is None:
                    raise ValueError("forward_batch.encoder_lens: expected the encoder lengths for a cross-attention "
                                     "layer, got None")
                page_table, cache_seqlens = metadata.encoder_page_table, metadata.encoder_lens_int32
                cu_seqlens_k = metadata.encoder_cu_seqlens_k
                window = (-1, -1)
            q3 = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
            result = self._attend(q3, key_cache, value_cache, metadata, layer,
                                  causal=False if use_cascade_attn else causal, window=window, k_descale=k_descale,
                                  v_descale=v_descale, kwargs=kwargs,
                                  lse=use_cascade_attn, table=page_table, seqlens=cache_seqlens, cu_q=cu_seqlens_q,
                                  cu_k=cu_seqlens_k if not use_local_attn else None, max_q=max_seqlen_q)
            o = (self._cascade(result, q3, key_cache, value_cache, layer, window, k_descale, v_descale, kwargs)
                 if use_cascade_attn else result)
        elif (getattr(forward_batch, "attn_attend_prefix_cache", None) is not None
              and not _is_target_verify(mode) and not _is_draft_extend(mode)):
            return self._mla_mha(q, k, v, layer, forward_batch, metadata, kwargs)
        else:
            k_rope_cache, c_kv_cache, q_rope, q_nope = self._mla_caches(layer, forward_batch, q, q_rope)
            result = self._attend(q_rope, k_rope_cache, c_kv_cache, metadata, layer, qv=q_nope,
                                  causal=False if use_cascade_attn else causal, window=(-1, -1), k_descale=k_descale,
                                  v_descale=v_descale, kwargs={}, lse=use_cascade_attn, table=page_table,
                                  seqlens=cache_seqlens, cu_q=cu_seqlens_q,
                                  cu_k=cu_seqlens_k if not use_local_attn else None, max_q=max_seqlen_q)
            o = (self._cascade(result, q_rope, k_rope_cache, c_kv_cache, layer, window, k_descale, v_descale, {},
                               qv=q_nope) if use_cascade_attn else result)
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _mla_mha(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, metadata: FlashAttentionMetadata,
                 kwargs: dict) -> Any:
        """MLA models' MHA prefill (D = qk_nope + rope, e.g. 192; Dv e.g. 128): with
        attn_attend_prefix_cache True, the new tokens against one chunk of the decompressed
        prefix (non-causal, with LSE); False, the new tokens against themselves (causal). The
        model merges the two with merge_state_v2."""
        if k is None or v is None:
            raise ValueError("k: expected the decompressed k and v for the MLA MHA prefill, got None")
        self._check_q(q, layer, layer.head_dim)
        q3 = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        k3 = k.view(-1, layer.tp_k_head_num, layer.head_dim).to(q.dtype)
        v3 = v.view(-1, layer.tp_k_head_num, layer.v_head_dim).to(q.dtype)
        if forward_batch.attn_attend_prefix_cache:
            chunk_idx = getattr(forward_batch, "prefix_chunk_idx", None)
            if chunk_idx is None or chunk_idx < 0:
                raise ValueError(f"forward_batch.prefix_chunk_idx: expected a chunk index >= 0 with "
                                 f"attn_attend_prefix_cache, got {chunk_idx!r}")
            if not forward_batch.mha_return_lse:
                raise ValueError("forward_batch.mha_return_lse: expected True with attn_attend_prefix_cache "
                                 "(the prefix chunks' states are merged by LSE)")
            output = flash_attn_varlen_func(
                q=q3, k=k3, v=v3, cu_seqlens_q=metadata.cu_seqlens_q,
                cu_seqlens_k=forward_batch.prefix_chunk_cu_seq_lens[chunk_idx], max_seqlen_q=metadata.max_seq_len_q,
                max_seqlen_k=forward_batch.prefix_chunk_max_seq_lens[chunk_idx], softmax_scale=layer.scaling,
                causal=False, return_softmax_lse=True, **kwargs)
        else:
            output = flash_attn_varlen_func(
                q=q3, k=k3, v=v3, cu_seqlens_q=metadata.cu_seqlens_q, cu_seqlens_k=metadata.cu_seqlens_q,
                max_seqlen_q=metadata.max_seq_len_q, max_seqlen_k=metadata.max_seq_len_q,
                softmax_scale=layer.scaling, causal=True, return_softmax_lse=bool(forward_batch.mha_return_lse),
                **kwargs)
        if forward_batch.mha_return_lse:
            output, lse, *_ = output
            return output, torch.transpose(lse, 0, 1).contiguous()
        return output

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                       q_rope: Any = None, k_rope: Any = None, sinks: Any = None) -> Any:
        """DECODE (normal, and draft decode with spec_info: top-k 1 through the page table,
        top-k > 1 as prefix pass + per-branch pass merged by LSE), cross attention and chunked
        local attention. Returns [num_tokens, tp_q_head_num * v_head_dim]."""
        self._save_kv(k, v, layer, forward_batch, save_kv_cache, k_rope)
        metadata = self._metadata()
        local_md = metadata.local_attn_metadata
        use_local_attn = (self.attention_chunk_size is not None and local_md is not None
                          and getattr(layer, "use_irope", False))
        use_cascade_attn = forward_batch.spec_info is not None and self.topk > 1
        window = self._window(layer)
        causal = not layer.is_cross_attention
        kwargs = self._kwargs(sinks)
        q, q_rope, k_descale, v_descale = self._descales(layer, forward_batch, q, q_rope, True)
        if not self.use_mla:
            self._check_q(q, layer, layer.head_dim)
            key_cache, value_cache = self._kv_buffers(layer, forward_batch)
            key_cache = key_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
            value_cache = value_cache.view(-1, self.page_size, layer.tp_v_head_num, layer.head_dim)
            q3 = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
            if layer.is_cross_attention:
                if metadata.encoder_page_table is None:
                    raise ValueError("forward_batch.encoder_lens: expected the encoder lengths for a cross-attention "
                                     "layer, got None")
                o = self._attend(q3, key_cache, value_cache, metadata, layer, causal=False, window=(-1, -1),
                                 k_descale=k_descale, v_descale=v_descale, kwargs=kwargs,
                                 table=metadata.encoder_page_table, seqlens=metadata.encoder_lens_int32,
                                 cu_k=metadata.encoder_cu_seqlens_k, max_q=1)
            elif use_local_attn:
                o = self._attend(q3, key_cache, value_cache, metadata, layer, causal=True, window=(-1, -1),
                                 k_descale=k_descale, v_descale=v_descale, kwargs=kwargs,
                                 table=local_md.local_block_table, seqlens=local_md.local_seqused_k,
                                 cu_q=local_md.local_query_start_loc, cu_k=None, max_q=local_md.local_max_query_len)
            else:
                result = self._attend(q3, key_cache, value_cache, metadata, layer,
                                      causal=False if use_cascade_attn else causal, window=window,
                                      k_descale=k_descale, v_descale=v_descale, kwargs=kwargs, lse=use_cascade_attn)
                o = (self._cascade(result, q3, key_cache, value_cache, layer, window, k_descale, v_descale, kwargs)
                     if use_cascade_attn else result)
        else:
            k_rope_cache, c_kv_cache, q_rope, q_nope = self._mla_caches(layer, forward_batch, q, q_rope)
            result = self._attend(q_rope, k_rope_cache, c_kv_cache, metadata, layer, qv=q_nope,
                                  causal=False if use_cascade_attn else causal, window=(-1, -1), k_descale=k_descale,
                                  v_descale=v_descale, kwargs={}, lse=use_cascade_attn)
            o = (self._cascade(result, q_rope, k_rope_cache, c_kv_cache, layer, window, k_descale, v_descale, {},
                               qv=q_nope) if use_cascade_attn else result)
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    # ---------------------------------------------------------------- CUDA graphs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed metadata buffers for the largest captured batch (decode, draft decode,
        target verify, draft extend, encoder), reused by every capture and replay."""
        dev, i32 = self.device, torch.int32
        max_num_pages = (self.max_context_len + self.page_size - 1) // self.page_size

        def zeros(*shape):
            return torch.zeros(*shape, dtype=i32, device=dev)

        def arange(end, step=1):
            return torch.arange(0, end, step, dtype=i32, device=dev)

        strided = torch.arange(0, self.max_context_len, self.page_size, device=dev)
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": zeros(max_bs), "cu_seqlens_q": arange(max_bs + 1), "cu_seqlens_k": zeros(max_bs + 1),
            "page_table": zeros(max_bs, max_num_pages), "strided_indices": strided}
        if self.attention_chunk_size is not None:
            chunk = self.attention_chunk_size
            max_virtual = max_bs * ((self.max_context_len + chunk - 1) // chunk)
            max_pages_per_block = (chunk + (self.page_size or 1) - 1) // (self.page_size or 1)
            self.decode_cuda_graph_local_attn_metadata = {
                "local_query_start_loc": zeros(max_virtual + 1), "local_seqused_k": zeros(max_virtual),
                "local_block_table": zeros(max_virtual, max_pages_per_block)}
        if self.topk > 1:
            decode_length = self.speculative_step_id + 1
            self.draft_decode_metadata_topk_normal = {
                "cache_seqlens": zeros(max_bs), "cu_seqlens_q": arange(max_bs * self.topk + 1, self.topk),
                "cu_seqlens_k": zeros(max_bs + 1), "page_table": zeros(max_bs, self.max_context_len)}
            self.draft_decode_metadata_topk_expand = {
                "cache_seqlens": torch.full((max_bs * self.topk,), decode_length, device=dev, dtype=i32),
                "cu_seqlens_q": arange(max_bs * self.topk + 1),
                "cu_seqlens_k": arange(max_bs * self.topk * decode_length + 1, decode_length),
                "page_table": zeros(max_bs * self.topk, decode_length)}
        n_draft = self.speculative_num_draft_tokens
        if n_draft is not None and n_draft > 0:
            self.decode_cuda_graph_metadata["page_table_draft_decode"] = zeros(max_bs, max_num_pages)
            self.target_verify_metadata = {
                "cache_seqlens": zeros(max_bs), "cu_seqlens_q": arange(max_bs * n_draft + 1, n_draft),
                "cu_seqlens_k": zeros(max_bs + 1), "page_table": zeros(max_bs, max_num_pages),
                "strided_indices": strided}
            self.draft_extend_metadata = {
                "cache_seqlens": zeros(max_bs), "cu_seqlens_q": zeros(max_bs + 1), "cu_seqlens_k": zeros(max_bs + 1),
                "page_table": zeros(max_bs, max_num_pages), "strided_indices": strided}
        if self.topk > 1:
            self.target_verify_metadata_topk_normal = {
                "cache_seqlens": zeros(max_bs), "cu_seqlens_q": arange(max_bs * n_draft + 1, n_draft),
                "cu_seqlens_k": zeros(max_bs + 1), "page_table": zeros(max_bs, self.max_context_len)}
            self.target_verify_metadata_topk_expand = {
                "cache_seqlens": zeros(max_bs * n_draft), "cu_seqlens_k": zeros(max_bs * n_draft + 1),
                "cu_seqlens_q": arange(max_bs * n_draft + 1), "page_table": zeros(max_bs * n_draft, n_draft)}
            if self.has_swa:
                self.target_verify_metadata_topk_swa = {
                    "cache_seqlens": zeros(max_bs * n_draft), "cu_seqlens_k": zeros(max_bs * n_draft + 1),
                    "cu_seqlens_q": arange(max_bs * n_draft + 1),
                    "page_table": zeros(max_bs * n_draft, self.max_context_len + n_draft)}
        self.encoder_metadata = {
            "encoder_page_table": zeros(max_bs, self.max_context_len), "encoder_lens_int32": zeros(max_bs),
            "encoder_cu_seqlens_k": zeros(max_bs + 1)}

    def _require_graph_state(self, what: str) -> None:
        if not self.decode_cuda_graph_metadata:
            raise RuntimeError(f"{what}: call init_cuda_graph_state(max_bs, max_num_tokens) first")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, encoder_lens: Optional[torch.Tensor],
                                                 forward_mode: Any, spec_info: Any) -> None:
        """Metadata of a captured batch size: views of the graph buffers (so that replays
        update what the captured kernels read)."""
        self._require_graph_state("init_forward_metadata_capture_cuda_graph")
        metadata = FlashAttentionMetadata()
        metadata_expand = FlashAttentionMetadata()
        device = seq_lens.device
        dm = self.decode_cuda_graph_metadata
        if _is_decode_or_idle(forward_mode):
            if spec_info is not None:
                if self.topk <= 1:
                    metadata.cache_seqlens_int32 = dm["cache_seqlens"][:bs]
                    metadata.max_seq_len_k = int(seq_lens.max().item()) + self.speculative_step_id + 1
                    metadata.cu_seqlens_q = dm["cu_seqlens_q"][:bs + 1]
                    metadata.cu_seqlens_k = _cumsum0(metadata.cache_seqlens_int32)
                    if "page_table_draft_decode" not in dm:
                        raise ValueError("speculative_num_draft_tokens: expected >= 1 for draft decode graphs")
                    metadata.page_table = dm["page_table_draft_decode"][:bs, :]
                    dm[bs] = metadata
                else:
                    normal, expand = self.draft_decode_metadata_topk_normal, self.draft_decode_metadata_topk_expand
                    metadata.cache_seqlens_int32 = normal["cache_seqlens"][:bs]
                    metadata.max_seq_len_q = self.topk
                    metadata.max_seq_len_k = int(seq_lens.max().item())
                    metadata.cu_seqlens_q = normal["cu_seqlens_q"][:bs + 1]
                    metadata.cu_seqlens_k = normal["cu_seqlens_k"][:bs + 1]
                    metadata.page_table = normal["page_table"][:bs, :]
                    metadata_expand.cache_seqlens_int32 = expand["cache_seqlens"][:bs * self.topk]
                    metadata_expand.max_seq_len_q = 1
                    metadata_expand.cu_seqlens_q = expand["cu_seqlens_q"][:bs * self.topk + 1]
                    metadata_expand.cu_seqlens_k = expand["cu_seqlens_k"][:bs * self.topk + 1]
                    metadata_expand.page_table = expand["page_table"][:bs * self.topk]
                    normal[bs] = metadata
                    expand[bs] = metadata_expand
            else:
                metadata.cache_seqlens_int32 = dm["cache_seqlens"][:bs]
                metadata.cache_seqlens_int32.copy_(seq_lens[:bs])
                metadata.cu_seqlens_k = dm["cu_seqlens_k"][:bs + 1]
                metadata.cu_seqlens_k[1:].copy_(torch.cumsum(seq_lens[:bs], dim=0, dtype=torch.int32))
                metadata.max_seq_len_k = int(seq_lens.max().item())
                metadata.page_table = dm["page_table"][:bs, :]
                metadata.cu_seqlens_q = dm["cu_seqlens_q"][:bs + 1]
                dm[bs] = metadata
                if self.attention_chunk_size is not None:
                    self._update_local_attn_metadata_for_capture(metadata, bs)
        elif _is_target_verify(forward_mode):
            n_draft = self._num_draft_tokens()
            if self.topk <= 1:
                tv = self.target_verify_metadata
                metadata.cache_seqlens_int32 = tv["cache_seqlens"][:bs]
                metadata.cache_seqlens_int32.copy_(seq_lens + n_draft)
                metadata.max_seq_len_q = n_draft
                metadata.max_seq_len_k = int(seq_lens.max().item()) + n_draft
                metadata.cu_seqlens_q = tv["cu_seqlens_q"][:bs + 1]
                metadata.cu_seqlens_k = tv["cu_seqlens_k"][:bs + 1]
                metadata.page_table = tv["page_table"][:bs, :]
                tv[bs] = metadata
            else:
                normal, expand = self.target_verify_metadata_topk_normal, self.target_verify_metadata_topk_expand
                metadata.cache_seqlens_int32 = normal["cache_seqlens"][:bs]
                metadata.max_seq_len_q = n_draft
                metadata.max_seq_len_k = int(seq_lens.max().item())
                metadata.cu_seqlens_q = normal["cu_seqlens_q"][:bs + 1]
                metadata.cu_seqlens_k = normal["cu_seqlens_k"][:bs + 1]
                metadata.page_table = normal["page_table"][:bs, :]
                metadata_expand.cache_seqlens_int32 = expand["cache_seqlens"][:bs * n_draft]
                metadata_expand.max_seq_len_q = 1
                metadata_expand.cu_seqlens_q = expand["cu_seqlens_q"][:bs * n_draft + 1]
                metadata_expand.cu_seqlens_k = expand["cu_seqlens_k"][:bs * n_draft + 1]
                metadata_expand.page_table = expand["page_table"][:bs * n_draft]
                normal[bs] = metadata
                expand[bs] = metadata_expand
                if self.has_swa:
                    swa_buf = self.target_verify_metadata_topk_swa
                    swa = FlashAttentionMetadata()
                    swa.cache_seqlens_int32 = swa_buf["cache_seqlens"][:bs * n_draft]
                    swa.max_seq_len_q = 1
                    swa.cu_seqlens_q = swa_buf["cu_seqlens_q"][:bs * n_draft + 1]
                    swa.cu_seqlens_k = swa_buf["cu_seqlens_k"][:bs * n_draft + 1]
                    swa.page_table = swa_buf["page_table"][:bs * n_draft]
                    swa_buf[bs] = swa
                    metadata.swa_spec_metadata = swa
        elif _is_draft_extend(forward_mode):
            de = self.draft_extend_metadata
            metadata.cache_seqlens_int32 = de["cache_seqlens"][:bs]
            metadata.cache_seqlens_int32.copy_(seq_lens)
            per_bs = num_tokens // bs
            metadata.max_seq_len_q = per_bs
            metadata.max_seq_len_k = int(seq_lens.max().item())
            metadata.cu_seqlens_q = torch.arange(0, bs * per_bs + 1, per_bs, dtype=torch.int32, device=device)
            metadata.cu_seqlens_k = de["cu_seqlens_k"][:bs + 1]
            metadata.page_table = de["page_table"][:bs, :]
            de[bs] = metadata
        else:
            raise NotImplementedError(f"forward_mode: CUDA graphs of {_mode(forward_mode)} (SGLang captures DECODE, "
                                      f"TARGET_VERIFY and DRAFT_EXTEND)")
        if encoder_lens is not None:
            if self.page_size > 1:
                raise NotImplementedError(f"cross attention (encoder_lens) with page_size > 1 "
                                          f"(page_size={self.page_size})")
            enc_bs = encoder_lens.numel()
            em = self.encoder_metadata
            metadata.encoder_lens_int32 = em["encoder_lens_int32"][:enc_bs]
            metadata.encoder_cu_seqlens_k = em["encoder_cu_seqlens_k"][:enc_bs + 1]
            metadata.encoder_page_table = em["encoder_page_table"][:bs, :]
        self.forward_metadata = metadata
        self.forward_metadata_spec_decode_expand = metadata_expand

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                                                seq_lens_sum: int, encoder_lens: Optional[torch.Tensor],
                                                forward_mode: Any, spec_info: Any,
                                                seq_lens_cpu: Optional[torch.Tensor],
                                                out_cache_loc: Optional[torch.Tensor] = None) -> None:
        """Updates the captured batch size's buffers in place for this step's batch (the first
        bs entries of req_pool_indices / seq_lens / seq_lens_cpu)."""
        self._require_graph_state("init_forward_metadata_replay_cuda_graph")
        seq_lens = seq_lens[:bs]
        seq_lens_cpu = seq_lens_cpu[:bs]
        req_pool_indices = req_pool_indices[:bs]
        metadata = metadata_expand = None
        dm = _Captured(self.decode_cuda_graph_metadata, bs)
        if _is_decode_or_idle(forward_mode):
            if spec_info is not None:
                if self.topk <= 1:
                    metadata = dm[bs]
                    metadata.max_seq_len_k = _host_max(seq_lens_cpu) + self.speculative_step_id + 1
                    max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
                    normal_decode_set_metadata(metadata.cache_seqlens_int32, metadata.cu_seqlens_k,
                                               metadata.page_table, self.req_to_token, req_pool_indices,
                                               dm["strided_indices"], max_seq_pages, seq_lens,
                                               self.speculative_step_id + 1, self.page_size)
                else:
                    metadata = _Captured(self.draft_decode_metadata_topk_normal, bs)[bs]
                    metadata.cache_seqlens_int32.copy_(seq_lens)
                    metadata.max_seq_len_k = _host_max(seq_lens_cpu)
                    metadata.cu_seqlens_k[1:].copy_(torch.cumsum(metadata.cache_seqlens_int32, dim=0,
                                                                 dtype=torch.int32))
                    page_table = self.req_to_token[req_pool_indices, :metadata.max_seq_len_k]
                    metadata.page_table[:, :metadata.max_seq_len_k].copy_(page_table)
                    metadata_expand = _Captured(self.draft_decode_metadata_topk_expand, bs)[bs]
                    decode_length = self.speculative_step_id + 1
                    if out_cache_loc is None:
                        raise ValueError("out_cache_loc: expected the draft tokens' slots for draft decode with "
                                         "top-k > 1, got None")
                    cache_loc = out_cache_loc.view(-1, self.speculative_num_steps)
                    metadata_expand.page_table[:cache_loc.shape[0]].copy_(cache_loc[:, :decode_length])
            else:
                metadata = dm[bs]
                max_len = _host_max(seq_lens_cpu)
                metadata.max_seq_len_k = max_len
                normal_decode_set_metadata(metadata.cache_seqlens_int32, metadata.cu_seqlens_k, metadata.page_table,
                                           self.req_to_token, req_pool_indices, dm["strided_indices"],
                                           (max_len + self.page_size - 1) // self.page_size, seq_lens, 0,
                                           self.page_size)
                self._update_local_attn_metadata_for_replay(metadata, bs)
        elif _is_target_verify(forward_mode):
            n_draft = self._num_draft_tokens()
            if self.topk <= 1:
                metadata = _Captured(self.target_verify_metadata, bs)[bs]
                metadata.cache_seqlens_int32.copy_(seq_lens + n_draft)
                metadata.max_seq_len_k = _host_max(seq_lens_cpu) + n_draft
                metadata.cu_seqlens_k[1:].copy_(torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32))
                max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
                page_indices = self.req_to_token[req_pool_indices[:, None], dm["strided_indices"][:max_seq_pages]]
                metadata.page_table[:, :max_seq_pages].copy_(page_indices // self.page_size)
            else:
                metadata = _Captured(self.target_verify_metadata_topk_normal, bs)[bs]
                metadata.cache_seqlens_int32.copy_(seq_lens)
                metadata.max_seq_len_k = _host_max(seq_lens_cpu)
                metadata.cu_seqlens_k[1:].copy_(torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32))
                page_table = self.req_to_token[req_pool_indices, :metadata.max_seq_len_k]
                metadata.page_table[:, :metadata.max_seq_len_k].copy_(page_table)
                metadata_expand = _Captured(self.target_verify_metadata_topk_expand, bs)[bs]
                positions = getattr(spec_info, "positions", None)
                page_table_e, lens = self._verify_expand_page_table(
                    self.req_to_token, req_pool_indices, seq_lens, spec_info,
                    None if positions is None else positions.numel())
                metadata_expand.page_table.copy_(page_table_e)
                metadata_expand.cache_seqlens_int32.copy_(lens)
                metadata_expand.cu_seqlens_k[1:].copy_(torch.cumsum(metadata_expand.cache_seqlens_int32, dim=0,
                                                                    dtype=torch.int32))
                if self.has_swa:
                    swa = _Captured(self.target_verify_metadata_topk_swa, bs)[bs]
                    self._init_sliding_window_attn_spec_metadata(metadata, metadata_expand, swa)
        elif _is_draft_extend(forward_mode):
            metadata = _Captured(self.draft_extend_metadata, bs)[bs]
            metadata.cache_seqlens_int32.copy_(seq_lens)
            metadata.max_seq_len_k = _host_max(seq_lens_cpu)
            metadata.cu_seqlens_k[1:].copy_(torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32))
            accept_length = spec_info.accept_length[:bs]
            accept_cpu = getattr(spec_info, "accept_length_cpu", None)
            metadata.max_seq_len_q = (max(accept_cpu) + 1) if accept_cpu else 1
            metadata.cu_seqlens_q[1:].copy_(torch.cumsum(accept_length, dim=0, dtype=torch.int32))
            max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
            page_indices = self.req_to_token[req_pool_indices[:, None],
                                             self.draft_extend_metadata["strided_indices"][:max_seq_pages]]
            metadata.page_table[:, :max_seq_pages].copy_(page_indices // self.page_size)
        else:
            raise NotImplementedError(f"forward_mode: CUDA graphs of {_mode(forward_mode)} (SGLang replays DECODE, "
                                      f"TARGET_VERIFY and DRAFT_EXTEND)")
        if encoder_lens is not None:
            enc = encoder_lens[:bs]
            metadata.encoder_max_seq_len_k = self.max_context_len  # bounded by encoder_lens_int32 per request
            metadata.encoder_lens_int32.copy_(enc)
            metadata.encoder_cu_seqlens_k[1:].copy_(torch.cumsum(metadata.encoder_lens_int32, dim=0,
                                                                 dtype=torch.int32))
            width = min(metadata.encoder_page_table.shape[1], self.req_to_token.shape[1])
            metadata.encoder_page_table[:, :width].copy_(self.req_to_token[req_pool_indices, :width])
            table = self._decoder_page_table(req_pool_indices, metadata.encoder_lens_int32, metadata.max_seq_len_k)
            metadata.page_table[:, :metadata.max_seq_len_k].copy_(table)
        self.forward_metadata = metadata
        self.forward_metadata_spec_decode_expand = metadata_expand

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_lens value of the padded requests of a replayed batch."""
        return 1

    def _update_local_attn_metadata_for_capture(self, metadata: FlashAttentionMetadata, bs: int) -> None:
        seq_lens_capture = metadata.cache_seqlens_int32
        max_seq_len = int(seq_lens_capture.max().item())
        q_local, cu_q_local, k_local, table_local = local_virtual_batches(
            self.attention_chunk_size, metadata.cu_seqlens_q.cpu().numpy(), seq_lens_capture.cpu().numpy(),
            metadata.page_table, self.page_size)
        buf = self.decode_cuda_graph_local_attn_metadata
        b0 = table_local.shape[0] if table_local.shape[0] > 0 else bs
        b1 = table_local.shape[1] if table_local.shape[1] > 0 else 1
        metadata.local_attn_metadata = LocalAttentionMetadata(
            local_query_start_loc=buf["local_query_start_loc"][:len(cu_q_local)],
            local_seqused_k=buf["local_seqused_k"][:len(k_local)],
            local_block_table=buf["local_block_table"][:b0, :b1],
            local_max_query_len=1, local_max_seq_len=max_seq_len)

    def _update_local_attn_metadata_for_replay(self, metadata: FlashAttentionMetadata, bs: int) -> None:
        """Decode replays with chunked local attention: the virtual batches are rebuilt on the
        host (as SGLang does) and copied into the captured buffers. A decode query has one
        virtual batch, so the captured shapes (bs virtual batches) still hold."""
        if self.attention_chunk_size is None:
            return
        buf = self.decode_cuda_graph_local_attn_metadata
        local_q_buf, local_k_buf, local_block_buf = (buf["local_query_start_loc"], buf["local_seqused_k"],
                                                     buf["local_block_table"])
        cu_seqlens_q = torch.arange(bs + 1, dtype=torch.int32)
        seqlens = metadata.cache_seqlens_int32[:bs]
        max_seq_len = int(seqlens.max().item())
        page_table = metadata.page_table[:bs, :max_seq_len]
        if self.is_hybrid:
            page_table = self.full_to_swa_index_mapping[page_table].to(torch.int32)
        q_local, cu_q_local, k_local, table_local = local_virtual_batches(
            self.attention_chunk_size, cu_seqlens_q.numpy(), seqlens.cpu().numpy(), page_table, self.page_size)
        device = local_q_buf.device
        cu_q_local_t = torch.from_numpy(cu_q_local).to(device)
        k_local_t = torch.from_numpy(k_local).to(device)
        table_local = table_local.to(device)
        q_len, k_len = cu_q_local_t.shape[0], k_local_t.shape[0]
        b0, b1 = table_local.shape
        local_q_buf[:q_len].copy_(cu_q_local_t)
        local_q_buf[q_len:].fill_(0)
        local_k_buf[:k_len].copy_(k_local_t)
        local_k_buf[k_len:].fill_(0)
        local_block_buf[:b0, :b1].copy_(table_local)
        local_block_buf[b0:, :].fill_(0)
        local_block_buf[:b0, b1:].fill_(0)
        if metadata.local_attn_metadata is not None:
            lam = metadata.local_attn_metadata
            lam.local_max_query_len = int(q_local.max())
            lam.local_max_seq_len = int(k_local.max())


class FlashAttentionMultiStepBackend:
    """The EAGLE draft worker's backend: one FlashAttentionBackend per draft step
    (speculative_step_id 0 .. num_steps - 1), as SGLang's class of the same name."""

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        self.model_runner = model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [FlashAttentionBackend(model_runner, speculative_step_id=i, topk=topk,
                                                    speculative_num_steps=speculative_num_steps)
                              for i in range(speculative_num_steps)]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        for backend in self.attn_backends:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: Any) -> None:
        if forward_batch.spec_info is None:
            raise ValueError("forward_batch.spec_info: expected the draft input, got None")
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_capture_cuda_graph(
                forward_batch.batch_size, forward_batch.batch_size * self.topk, forward_batch.req_pool_indices,
                forward_batch.seq_lens, encoder_lens=forward_batch.encoder_lens,
                forward_mode=_DECODE, spec_info=forward_batch.spec_info)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: Any, bs: int) -> None:
        if forward_batch.spec_info is None:
            raise ValueError("forward_batch.spec_info: expected the draft input, got None")
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_replay_cuda_graph(
                bs, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.seq_lens_sum,
                encoder_lens=forward_batch.encoder_lens, forward_mode=_DECODE, spec_info=forward_batch.spec_info,
                seq_lens_cpu=forward_batch.seq_lens_cpu, out_cache_loc=forward_batch.out_cache_loc)


class _Captured(dict):
    """A graph-buffer dict whose [bs] names the batch size when it was not captured."""

    def __init__(self, buffers: dict, bs: int) -> None:
        super().__init__()
        self.buffers, self.bs = buffers, bs

    def __getitem__(self, key: Any) -> Any:
        try:
            return self.buffers[key]
        except KeyError:
            if key == self.bs:
                raise ValueError(f"bs: batch size {self.bs} was not captured "
                                 f"(init_forward_metadata_capture_cuda_graph) for this forward mode") from None
            raise


class _Decode:
    name = "DECODE"


_DECODE = _Decode()
