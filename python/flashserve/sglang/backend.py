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
- top-k > 1's expand metadata (draft decode and target verify) and the sliding-window
  page-table concatenation of top-k > 1 verify come from flashserve's operations
  (spec_metadata.py over include/flashserve/spec_metadata.hpp: CPU and CUDA) instead of torch
  ops and a Triton kernel (same values);
- with top-k > 1, sinks enter the prefix pass only (SGLang passes them to both passes of the
  merge, which counts the sink twice).
Not implemented (NotImplementedError naming the feature): speculative top-k > 1 and
cross attention with page_size > 1 (SGLang's expand page tables hold token slots), forward
modes other than the six above.

Forward calls never synchronize with the device; metadata construction does where SGLang's
does (max lengths read from seq_lens_cpu; chunked local attention on the host).

The class is split by role: metadata.py (mode predicates, metadata dataclasses, local attention
batches, page-table helpers), spec_metadata.py (top-k > 1's metadata), forward.py (the
attention calls), cuda_graph.py (graph buffers, capture, replay); this module holds the eager
metadata construction and the classes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .cuda_graph import _DECODE, _CudaGraphMixin
from .forward import _ForwardMixin
from .metadata import (FlashAttentionMetadata, LocalAttentionMetadata, _cumsum0, _host_max, _is_decode_or_idle,
                       _is_extend_like, _is_target_verify, _mode, local_virtual_batches)
from .metadata import cdiv, make_local_attention_virtual_batches, normal_decode_set_metadata
from .spec_metadata import (draft_decode_expand, new_expand_buffers, new_lengths, prepare_swa_spec_page_table,
                            verify_expand, window_page_table)


# the public names backend.py defined before its split, importable from here as before
__all__ = ["FlashAttentionBackend", "FlashAttentionMetadata", "FlashAttentionMultiStepBackend",
           "LocalAttentionMetadata", "cdiv", "local_virtual_batches", "make_local_attention_virtual_batches",
           "normal_decode_set_metadata", "prepare_swa_spec_page_table"]


def _fixed_q_metadata(metadata: FlashAttentionMetadata, cache_seqlens_int32: torch.Tensor, max_seq_len_k: int,
                      q_per_request: int, req_to_token: torch.Tensor, rows: torch.Tensor, batch_size: int) -> None:
    """Eager metadata of the modes with q_per_request queries per request (decode, draft
    decode, target verify): lengths, cu_seqlens and the token-granular page table."""
    metadata.cache_seqlens_int32 = cache_seqlens_int32
    metadata.max_seq_len_q = q_per_request
    metadata.max_seq_len_k = max_seq_len_k
    metadata.cu_seqlens_q = torch.arange(0, batch_size * q_per_request + 1, q_per_request, dtype=torch.int32,
                                         device=cache_seqlens_int32.device)
    metadata.cu_seqlens_k = _cumsum0(cache_seqlens_int32)
    metadata.page_table = req_to_token[rows, :max_seq_len_k]


class FlashAttentionBackend(_ForwardMixin, _CudaGraphMixin):
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
                    _fixed_q_metadata(metadata, (seqlens_in_batch + step).to(torch.int32), max_seq_cpu + step, 1,
                                      req_to_token, rows, batch_size)
                else:
                    _fixed_q_metadata(metadata, seqlens_in_batch.to(torch.int32), max_seq_cpu, self.topk,
                                      req_to_token, rows, batch_size)
                    self.forward_metadata_spec_decode_expand = self._draft_decode_expand(
                        forward_batch.out_cache_loc, seqlens_in_batch.numel(), device)
            else:  # normal decode
                _fixed_q_metadata(metadata, seqlens_in_batch.to(torch.int32), max_seq_cpu, 1, req_to_token, rows,
                                  batch_size)
                local = True
        elif _is_target_verify(mode):
            n_draft = self._num_draft_tokens()
            if self.topk <= 1:
                _fixed_q_metadata(metadata, (seqlens_in_batch + n_draft).to(torch.int32), max_seq_cpu + n_draft,
                                  n_draft, req_to_token, rows, batch_size)
                local = True
            else:
                _fixed_q_metadata(metadata, seqlens_in_batch.to(torch.int32), max_seq_cpu, n_draft, req_to_token,
                                  rows, batch_size)
                metadata_expand = FlashAttentionMetadata()
                metadata_expand.max_seq_len_q = 1
                metadata_expand.cu_seqlens_q = torch.arange(0, seqlens_in_batch.numel() * n_draft + 1,
                                                            dtype=torch.int32, device=device)
                (metadata_expand.page_table, metadata_expand.cache_seqlens_int32,
                 metadata_expand.cu_seqlens_k) = new_expand_buffers(seqlens_in_batch.numel() * n_draft, n_draft,
                                                                    device)
                self._verify_expand(metadata_expand, req_to_token, rows, seqlens_in_batch, forward_batch.spec_info,
                                    None)
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
        decode_length = self._draft_decode_length()
        expand = FlashAttentionMetadata()
        n = bs * self.topk
        expand.max_seq_len_q = 1
        expand.cu_seqlens_q = torch.arange(0, n + 1, dtype=torch.int32, device=device)
        self._require_draft_slots(out_cache_loc, n)
        expand.page_table, expand.cache_seqlens_int32, expand.cu_seqlens_k = new_expand_buffers(n, decode_length,
                                                                                                 device)
        draft_decode_expand(out_cache_loc, self.speculative_num_steps, decode_length, expand.page_table,
                            expand.cache_seqlens_int32, expand.cu_seqlens_k)
        return expand

    def _draft_decode_length(self) -> int:
        """step_id + 1: the draft tokens a branch has at this step."""
        decode_length = self.speculative_step_id + 1
        if self.speculative_num_steps < decode_length:
            raise ValueError(f"speculative_num_steps: expected >= speculative_step_id + 1 = {decode_length}, "
                             f"got {self.speculative_num_steps}")
        return decode_length

    def _require_draft_slots(self, out_cache_loc: Optional[torch.Tensor], n: Optional[int]) -> None:
        """out_cache_loc holds num_steps slots per branch (n branches; None: any count)."""
        steps = self.speculative_num_steps
        count = None if out_cache_loc is None else out_cache_loc.numel()
        if count is None or count % steps or (n is not None and count != n * steps):
            got = None if out_cache_loc is None else list(out_cache_loc.shape)
            want = "bs * topk * speculative_num_steps" + ("" if n is None else f" = {n * steps}")
            raise ValueError(f"out_cache_loc: expected {want} slots for draft decode with top-k > 1, got {got}")

    def _verify_expand(self, expand: FlashAttentionMetadata, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, spec_info: Any,
                       mask_rows: Optional[int]) -> None:
        """Target verify, top-k > 1: fills expand's page_table, cache_seqlens_int32 and
        cu_seqlens_k in place: for each draft token (row), the slots of the draft tokens its
        custom mask shows, valid ones first in draft order, and their count. spec_info.custom_mask
        is SGLang's flattened per-request [n_draft, seq_len + n_draft] mask; mask_rows (graph
        replay): the rows of the real requests, the padded ones read mask element 0."""
        custom_mask = getattr(spec_info, "custom_mask", None)
        if custom_mask is None:
            raise ValueError("spec_info.custom_mask: expected the draft tree's mask for TARGET_VERIFY with top-k > 1, "
                             "got None")
        verify_expand(custom_mask, req_to_token, req_pool_indices, seq_lens, self._num_draft_tokens(), mask_rows,
                      expand.page_table, expand.cache_seqlens_int32, expand.cu_seqlens_k)

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
        if metadata_swa is None:
            rows = metadata_expand.cache_seqlens_int32.shape[0]
            metadata_swa = FlashAttentionMetadata()
            metadata_swa.max_seq_len_q = 1
            metadata_swa.cu_seqlens_q = metadata_expand.cu_seqlens_q
            metadata_swa.page_table = metadata.page_table.new_zeros(
                (rows, metadata.page_table.shape[1] + metadata_expand.page_table.shape[1]))
            metadata_swa.cache_seqlens_int32, metadata_swa.cu_seqlens_k = new_lengths(rows, metadata.page_table.device)
        window_page_table(metadata.page_table, metadata_expand.page_table, metadata.cache_seqlens_int32,
                          metadata_expand.cache_seqlens_int32, n_draft, metadata_swa.page_table,
                          metadata_swa.cache_seqlens_int32, metadata_swa.cu_seqlens_k)
        metadata.swa_spec_metadata = metadata_swa


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
