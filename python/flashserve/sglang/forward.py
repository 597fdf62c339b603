"""The attention calls of flashserve.sglang's FlashAttentionBackend (forward, forward_extend,
forward_decode and their KV-cache writes, descales, cascade merge and MLA paths), a mixin of
FlashAttentionBackend reading the metadata that init_forward_metadata built."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._cache_merge import merge_state_v2
from ..fa3 import flash_attn_varlen_func, flash_attn_with_kvcache
from .metadata import FlashAttentionMetadata, _is_draft_extend, _is_target_verify, _mode


class _ForwardMixin:
    """FlashAttentionBackend's forward paths (see backend.py)."""

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
