"""FlashServeMetadataBuilder: per-step attention metadata from the engine's common metadata
(vLLM's AttentionMetadataBuilder shape), over flashserve._C.MetadataBuilder (SPEC.md §6).

The builder owns fixed buffers sized once from the engine's limits; each build rewrites them
in place (CUDA-graph replay reads the captured pointers), so the metadata of one build is valid
until the next. It also owns the layers' shared workspace: layers of a group run one after
another on one stream, so one buffer serves them all.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from . import _C
from .backend_types import (AttentionCGSupport, CommonAttentionMetadata, DraftTree, FlashServeEngineConfig,
                            FlashServeKVCacheSpec, FlashServeMetadata, attn_type_name,
                            cache_dtype_name, check_positive, dtype_name)

try:
    import torch
except ImportError:  # the builder works on numpy host arrays without torch
    torch = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def device_props(device: Any) -> Any:
    """flashserve._C.DeviceProps of a device ('cpu', 'cuda', 'cuda:1' or a torch.device), as
    the planner sees it (the drop-in functions' view of the same device)."""
    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return _C.DeviceProps.cpu()
    if kind != "cuda":
        raise ValueError(f"device: expected cpu or cuda, got {device!r}")
    if index:
        index = int(index)
    else:
        index = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
    num_sms, cc_major, cc_minor = _C.device_info("cuda", index)
    return _C.DeviceProps.cuda(index, num_sms, cc_major, cc_minor)


def _host_array(arg: str, value: Any) -> Any:
    """A host array the builder reads; a device tensor is an error (no hidden sync)."""
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"{arg}: expected a host (CPU) int32 array, got a tensor on {device}")
    return value


def _layer_spec(spec: FlashServeKVCacheSpec, config: FlashServeEngineConfig) -> Any:
    """The group's flashserve._C.LayerSpec (what the builder reads of its layers)."""
    slopes = None
    if spec.alibi_slopes is not None:
        import numpy as np
        slopes = np.asarray(spec.alibi_slopes, dtype=np.float32)
    return _C.LayerSpec(
        check_positive("num_heads", config.num_heads),
        check_positive("num_kv_heads", spec.num_kv_heads),
        check_positive("head_size", spec.head_size),
        head_size_v=spec.head_size_v or 0,
        attn_type=attn_type_name(spec.attn_type),
        sliding_window=spec.sliding_window or 0,
        attention_chunk_size=spec.attention_chunk_size or 0,
        alibi_slopes=slopes,
        kv_cache_dtype=cache_dtype_name(spec.kv_cache_dtype),
        dtype=dtype_name(spec.dtype),
    )


class FlashServeMetadataBuilder:
    """Builds FlashServeMetadata once per step for one KV-cache group."""

    reorder_batch_threshold: int = 1
    supports_update_block_table: bool = True
    # CUDA graphs: the builder writes every build into the same device buffers and a forward
    # never allocates or synchronizes, so a captured step replays over any lengths; the launch
    # shapes (request count, query rows, split count) are those of the capture, so a graph
    # serves batches of its captured shape: uniform query lengths, padded to the captured size.
    _cudagraph_support: AttentionCGSupport = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any = None, kv_cache_spec: Any = None) -> AttentionCGSupport:
        """vLLM's query: UNIFORM_BATCH (decode and uniform verify steps capture whole;
        mixed prefill / decode batches run eagerly)."""
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec: FlashServeKVCacheSpec, layer_names: list[str],
                 vllm_config: FlashServeEngineConfig, device: Any = "cpu") -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.vllm_config = config = vllm_config
        # Decode context parallelism: world size and rank from the engine's dcp group (as vLLM's
        # builder reads get_dcp_group()), else from the config (metadata only: a forward needs
        # the group).
        self.dcp_group = None
        self.dcp_world_size = check_positive("dcp_world_size", config.dcp_world_size)
        self.dcp_rank = config.dcp_rank
        if config.dcp_group is not None:
            from .dcp import DcpGroup
            self.dcp_group = DcpGroup(config.dcp_group)
            for name, given, actual in (("dcp_world_size", config.dcp_world_size, self.dcp_group.world_size),
                                        ("dcp_rank", config.dcp_rank, self.dcp_group.rank)):
                if config.dcp_world_size != 1 and given != actual:
                    raise ValueError(f"{name}: expected the dcp group's {actual}, got {given}")
            self.dcp_world_size, self.dcp_rank = self.dcp_group.world_size, self.dcp_group.rank
        self.cp_kv_cache_interleave_size = check_positive("cp_kv_cache_interleave_size",
                                                          config.cp_kv_cache_interleave_size)
        self.device = torch.device(device) if torch is not None else device
        self.block_size = check_positive("block_size", kv_cache_spec.block_size)
        self.reorder_batch_threshold = 1 + check_positive(
            "num_speculative_tokens", config.num_speculative_tokens, 0)
        self._props = device_props(device)
        self._stream = None
        if self._props.device.startswith("cuda"):
            self._stream = torch.cuda.current_stream(self.device)
        self._spec = _layer_spec(kv_cache_spec, config)
        self._c = _C.MetadataBuilder(
            self._spec,
            block_size=self.block_size,
            reorder_batch_threshold=self.reorder_batch_threshold,
            enable_cascade=config.enable_cascade,
            device=self._props,
            max_num_reqs=config.max_num_seqs,
            max_num_tokens=config.max_num_batched_tokens,
            max_blocks_per_req=_cdiv(check_positive("max_model_len", config.max_model_len), self.block_size),
            max_num_splits=config.max_num_splits,
            num_splits=check_positive("num_splits", config.num_splits, 0),
            max_draft_depth=config.max_draft_depth,
            stream=None if self._stream is None else self._stream.cuda_stream,
            dcp_world_size=self.dcp_world_size,
            dcp_rank=self.dcp_rank,
            dcp_interleave=self.cp_kv_cache_interleave_size,
            batch_invariant=bool(config.batch_invariant),
        )
        self._generation = 0
        self._last: Optional[CommonAttentionMetadata] = None
        self._workspace = None

    # ------------------------------------------------------------------ building

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False, *, draft_tree: Optional[DraftTree] = None) -> FlashServeMetadata:
        """The step's metadata. common_prefix_len: the scheduler's shared-prefix tokens (the
        builder rounds to whole blocks and takes cascade only when it pays). fast_build is
        accepted for vLLM's interface; the build is the same either way."""
        cm = common_attn_metadata
        if not isinstance(cm.causal, bool):
            raise NotImplementedError("causal: per-request causal flags are not implemented (pass a bool)")
        seq_lens = cm.seq_lens_cpu if cm.seq_lens_cpu is not None else cm.seq_lens
        with self._on_builder_stream():
            handle = self._c.build(
                _host_array("query_start_loc_cpu", cm.query_start_loc_cpu),
                _host_array("seq_lens_cpu", seq_lens),
                cm.block_table_tensor,
                cm.slot_mapping,
                num_reqs=cm.num_reqs,
                num_actual_tokens=cm.num_actual_tokens,
                max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len,
                causal=cm.causal,
                common_prefix_len=common_prefix_len,
                encoder_seq_lens=_host_array("encoder_seq_lens_cpu", cm.encoder_seq_lens_cpu),
                draft_parents=None if draft_tree is None else draft_tree.parents,
                num_drafts=None if draft_tree is None else draft_tree.num_drafts,
            )
        return self._metadata(handle, cm, draft_tree)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> FlashServeMetadata:
        """Capture builds use the same fixed buffers that replay rewrites."""
        return self.build(0, common_attn_metadata)

    def update_block_table(self, metadata: FlashServeMetadata, blk_table: Any,
                           slot_mapping: Any = None) -> FlashServeMetadata:
        """metadata with another block table (another KV-cache group of the same shapes). The
        builder's own latest metadata with its slot mapping is updated in place; any other is
        rebuilt from its common metadata."""
        if metadata.builder is self and metadata.generation == self._generation and (
                slot_mapping is None or slot_mapping is metadata.slot_mapping):
            with self._on_builder_stream():
                handle = self._c.update_block_table(blk_table)
            common = replace(metadata.common, block_table_tensor=blk_table)
            return self._metadata(handle, common, metadata.draft_tree)
        common = replace(metadata.common, block_table_tensor=blk_table,
                         slot_mapping=metadata.slot_mapping if slot_mapping is None else slot_mapping)
        return self.build(metadata.common_prefix_len, common, draft_tree=metadata.draft_tree)

    def advance_decode_step(self) -> FlashServeMetadata:
        """Multi-step decode: the last decode-only build advanced by one token per request
        (slots from the block table into the builder's own buffer; on CUDA computed on the device)."""
        if self._generation == 0:
            raise ValueError("advance_decode_step: expected a build first, got none")
        with self._on_builder_stream():
            handle = self._c.advance_decode_step()
        last = self._last
        seq_lens = last.seq_lens_cpu if last.seq_lens_cpu is not None else last.seq_lens
        common = replace(last, seq_lens=seq_lens + 1, seq_lens_cpu=seq_lens + 1,
                         max_seq_len=last.max_seq_len + 1, slot_mapping=None)
        return self._metadata(handle, common, None)

    def use_cascade_attention(self, common_prefix_len: int, query_lens: Any, *args: Any,
                              **kwargs: Any) -> bool:
        """Whether cascade pays for this batch. vLLM's other arguments describe this group's
        layers and device, which the builder was made with; the decision is the builder's."""
        return _C.use_cascade(common_prefix_len, query_lens, self._spec, self.dcp_world_size, self._props)

    def max_workspace_bytes(self) -> int:
        """Split-KV workspace bytes the largest batch of the limits can need."""
        return self._c.max_workspace_bytes()

    # ------------------------------------------------------------------ internals

    def workspace(self, nbytes: int) -> Any:
        """The layers' shared workspace, allocated on first use and grown only when a layer
        needs more (never per forward)."""
        ws = self._workspace
        if ws is None or ws.numel() < nbytes:
            ws = self._workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return ws

    def _on_builder_stream(self) -> Any:
        return _StreamOrder(self._stream)

    def _metadata(self, handle: Any, cm: CommonAttentionMetadata,
                  draft_tree: Optional[DraftTree]) -> FlashServeMetadata:
        self._generation += 1
        self._last = cm
        return FlashServeMetadata(
            num_actual_tokens=handle.num_actual_tokens, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping, causal=cm.causal,
            common_prefix_len=handle.common_prefix_len, use_cascade=handle.use_cascade,
            use_local=handle.use_local, use_tree=handle.use_tree, num_reqs=handle.num_reqs,
            num_decodes=handle.num_decodes, num_decode_tokens=handle.num_decode_tokens,
            num_prefills=handle.num_prefills, num_prefill_tokens=handle.num_prefill_tokens,
            common=cm, draft_tree=draft_tree, builder=self, handle=handle,
            generation=self._generation)


class _StreamOrder:
    """Orders the builder's upload stream (fixed at construction) with the current stream when
    they differ: the upload waits for earlier work reading the old metadata, and later work
    waits for the upload. Nothing when they are the same stream or on the CPU."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.current = None

    def __enter__(self) -> None:
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            if current != self.stream:
                self.current = current
                self.stream.wait_stream(current)

    def __exit__(self, *exc: Any) -> None:
        if self.current is not None:
            self.current.wait_stream(self.stream)
