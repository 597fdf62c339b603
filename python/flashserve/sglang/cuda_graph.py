"""The CUDA graph state of flashserve.sglang's FlashAttentionBackend: the preallocated
metadata buffers (init_cuda_graph_state) and their capture and in-place replay updates, a
mixin of FlashAttentionBackend."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .metadata import (FlashAttentionMetadata, LocalAttentionMetadata, _cumsum0, _cumsum_into, _host_max,
                       _is_decode_or_idle, _is_draft_extend, _is_target_verify, _mode, local_virtual_batches,
                       normal_decode_set_metadata)
from .spec_metadata import draft_decode_expand


class _CudaGraphMixin:
    """FlashAttentionBackend's CUDA graph state, capture and replay (see backend.py)."""

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
                    _view_buffers(metadata, normal, bs, max_seq_len_q=self.topk)
                    metadata.max_seq_len_k = int(seq_lens.max().item())
                    _view_buffers(metadata_expand, expand, bs * self.topk, max_seq_len_q=1)
                    normal[bs] = metadata
                    expand[bs] = metadata_expand
            else:
                metadata.cache_seqlens_int32 = dm["cache_seqlens"][:bs]
                metadata.cache_seqlens_int32.copy_(seq_lens[:bs])
                metadata.cu_seqlens_k = dm["cu_seqlens_k"][:bs + 1]
                _cumsum_into(metadata.cu_seqlens_k, seq_lens[:bs])
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
                _view_buffers(metadata, normal, bs, max_seq_len_q=n_draft)
                metadata.max_seq_len_k = int(seq_lens.max().item())
                _view_buffers(metadata_expand, expand, bs * n_draft, max_seq_len_q=1)
                normal[bs] = metadata
                expand[bs] = metadata_expand
                if self.has_swa:
                    swa_buf = self.target_verify_metadata_topk_swa
                    swa = FlashAttentionMetadata()
                    _view_buffers(swa, swa_buf, bs * n_draft, max_seq_len_q=1)
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
                    self._replay_topk_normal(metadata, req_pool_indices, seq_lens, seq_lens_cpu)
                    metadata_expand = _Captured(self.draft_decode_metadata_topk_expand, bs)[bs]
                    self._replay_draft_expand(metadata_expand, out_cache_loc)
            else:
                metadata = dm[bs]
                max_len = _host_max(seq_lens_cpu)
                metadata.max_seq_len_k = max_len
                normal_decode_set_metadata(metadata.cache_seqlens_int32, metadata.cu_seqlens_k, metadata.page_table,
                                           self.req_to_token, req_pool_indices, dm["strided_indices"],
                                           (max_len + self.page_size - 1) // self.page_size, seq_lens, 0,
                                           self.page_size)
                self._update_local_attn_metadata_for_replay(metadata, bs, seq_lens_cpu)
        elif _is_target_verify(forward_mode):
            n_draft = self._num_draft_tokens()
            if self.topk <= 1:
                metadata = _Captured(self.target_verify_metadata, bs)[bs]
                metadata.cache_seqlens_int32.copy_(seq_lens + n_draft)
                metadata.max_seq_len_k = _host_max(seq_lens_cpu) + n_draft
                _cumsum_into(metadata.cu_seqlens_k, metadata.cache_seqlens_int32)
                max_seq_pages = (metadata.max_seq_len_k + self.page_size - 1) // self.page_size
                page_indices = self.req_to_token[req_pool_indices[:, None], dm["strided_indices"][:max_seq_pages]]
                metadata.page_table[:, :max_seq_pages].copy_(page_indices // self.page_size)
            else:
                metadata = _Captured(self.target_verify_metadata_topk_normal, bs)[bs]
                self._replay_topk_normal(metadata, req_pool_indices, seq_lens, seq_lens_cpu)
                metadata_expand = _Captured(self.target_verify_metadata_topk_expand, bs)[bs]
                positions = getattr(spec_info, "positions", None)  # the real requests' draft tokens
                mask_rows = None if positions is None else min(positions.numel(), bs * n_draft)
                self._verify_expand(metadata_expand, self.req_to_token, req_pool_indices, seq_lens, spec_info,
                                    mask_rows)
                if self.has_swa:
                    swa = _Captured(self.target_verify_metadata_topk_swa, bs)[bs]
                    self._init_sliding_window_attn_spec_metadata(metadata, metadata_expand, swa)
        elif _is_draft_extend(forward_mode):
            metadata = _Captured(self.draft_extend_metadata, bs)[bs]
            metadata.cache_seqlens_int32.copy_(seq_lens)
            metadata.max_seq_len_k = _host_max(seq_lens_cpu)
            _cumsum_into(metadata.cu_seqlens_k, metadata.cache_seqlens_int32)
            accept_length = spec_info.accept_length[:bs]
            accept_cpu = getattr(spec_info, "accept_length_cpu", None)
            metadata.max_seq_len_q = (max(accept_cpu) + 1) if accept_cpu else 1
            _cumsum_into(metadata.cu_seqlens_q, accept_length)
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
            _cumsum_into(metadata.encoder_cu_seqlens_k, metadata.encoder_lens_int32)
            width = min(metadata.encoder_page_table.shape[1], self.req_to_token.shape[1])
            metadata.encoder_page_table[:, :width].copy_(self.req_to_token[req_pool_indices, :width])
            table = self._decoder_page_table(req_pool_indices, metadata.encoder_lens_int32, metadata.max_seq_len_k)
            metadata.page_table[:, :metadata.max_seq_len_k].copy_(table)
        self.forward_metadata = metadata
        self.forward_metadata_spec_decode_expand = metadata_expand

    def _replay_draft_expand(self, metadata_expand: FlashAttentionMetadata,
                             out_cache_loc: Optional[torch.Tensor]) -> None:
        """Replay of draft decode's expand metadata (top-k > 1): the page table rows of the
        branches in out_cache_loc ([bs, topk, num_steps] slots) rewritten in place (their
        lengths and offsets rewritten with the values they hold since capture)."""
        self._require_draft_slots(out_cache_loc, None)
        rows = out_cache_loc.numel() // self.speculative_num_steps
        draft_decode_expand(out_cache_loc, self.speculative_num_steps, self._draft_decode_length(),
                            metadata_expand.page_table[:rows], metadata_expand.cache_seqlens_int32[:rows],
                            metadata_expand.cu_seqlens_k[:rows + 1])

    def _replay_topk_normal(self, metadata: FlashAttentionMetadata, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor) -> None:
        """Replay of top-k > 1's prefix ("normal") metadata: lengths, cu_seqlens_k and the
        token-granular page table updated in place."""
        metadata.cache_seqlens_int32.copy_(seq_lens)
        metadata.max_seq_len_k = _host_max(seq_lens_cpu)
        _cumsum_into(metadata.cu_seqlens_k, metadata.cache_seqlens_int32)
        page_table = self.req_to_token[req_pool_indices, :metadata.max_seq_len_k]
        metadata.page_table[:, :metadata.max_seq_len_k].copy_(page_table)

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

    def _update_local_attn_metadata_for_replay(self, metadata: FlashAttentionMetadata, bs: int,
                                               seq_lens_cpu: torch.Tensor) -> None:
        """Decode replays with chunked local attention: the virtual batches are rebuilt on the
        host (as SGLang does) and copied into the captured buffers. A decode query has one
        virtual batch, so the captured shapes (bs virtual batches) still hold. The lengths are
        read from seq_lens_cpu (what cache_seqlens_int32[:bs] was just set to), not read back
        from the device."""
        if self.attention_chunk_size is None:
            return
        buf = self.decode_cuda_graph_local_attn_metadata
        local_q_buf, local_k_buf, local_block_buf = (buf["local_query_start_loc"], buf["local_seqused_k"],
                                                     buf["local_block_table"])
        cu_seqlens_q = torch.arange(bs + 1, dtype=torch.int32)
        seqlens = seq_lens_cpu[:bs].to(torch.int32)
        max_seq_len = _host_max(seqlens)
        page_table = metadata.page_table[:bs, :max_seq_len]
        if self.is_hybrid:
            page_table = self.full_to_swa_index_mapping[page_table].to(torch.int32)
        q_local, cu_q_local, k_local, table_local = local_virtual_batches(
            self.attention_chunk_size, cu_seqlens_q.numpy(), seqlens.numpy(), page_table, self.page_size)
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


def _view_buffers(md: FlashAttentionMetadata, buffers: dict, n: int, *, max_seq_len_q: int) -> None:
    """Points md's cache_seqlens_int32, cu_seqlens_q / _k and page_table at the first n rows
    (n + 1 for the cu_seqlens) of the graph buffers."""
    md.cache_seqlens_int32 = buffers["cache_seqlens"][:n]
    md.max_seq_len_q = max_seq_len_q
    md.cu_seqlens_q = buffers["cu_seqlens_q"][:n + 1]
    md.cu_seqlens_k = buffers["cu_seqlens_k"][:n + 1]
    md.page_table = buffers["page_table"][:n]


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
