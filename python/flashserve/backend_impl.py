"""FlashServeImpl: one attention layer's forward (vLLM's AttentionImpl shape) over
flashserve._C.AttentionLayer (SPEC.md §6): write the new K/V into the paged cache, then the
decode / prefill / cascade / local / tree passes the metadata selects.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from ._tensors import cuda_stream
from .backend_types import (KV_CACHE_LAYOUTS, FlashServeMetadata, attn_type_name, cache_dtype_name,
                            check_positive, dtype_name)

try:
    import torch
except ImportError:
    torch = None

_ENCODERS = ("encoder", "encoder_only")


def _float(arg: str, value: Any, default: float = 0.0) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{arg}: expected a float, got {value!r}")
    return float(value)


class FlashServeImpl:
    """One layer. kv_cache is the engine's tensor of FlashServeBackend.get_kv_cache_shape,
    [2, num_blocks, block_size, H_kv, D] in the backend's stride order; unbind(0) gives the
    key and value caches. `layer` carries _k_scale / _v_scale (fp8 caches), as in vLLM."""

    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: Any = "decoder", kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Any = None, *, head_size_v: Optional[int] = None,
                 attention_chunk_size: Optional[int] = None, kv_cache_layout: Optional[str] = None,
                 dtype: Any = "bfloat16") -> None:
        if torch is None:
            raise ImportError("FlashServeImpl needs torch")
        from .backend import FlashServeBackend
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_size = check_positive("head_size", head_size)
        self.head_size_v = check_positive("head_size_v", head_size_v or head_size)
        self.num_kv_heads = num_heads if num_kv_heads is None else check_positive(
            "num_kv_heads", num_kv_heads)
        if not _C.Capabilities.supports_head_size(self.head_size, self.head_size_v):
            raise ValueError(f"head_size: expected one of FlashServeBackend.get_supported_head_sizes() "
                             f"(V the same) or an MLA pair, got {self.head_size}/{self.head_size_v}")
        self.scale = _float("scale", scale)
        self.logits_soft_cap = _float("logits_soft_cap", logits_soft_cap)
        self.sliding_window = 0 if sliding_window is None else check_positive(
            "sliding_window", sliding_window)
        self.attention_chunk_size = 0 if attention_chunk_size is None else check_positive(
            "attention_chunk_size", attention_chunk_size)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type_name(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache_layout = kv_cache_layout or FlashServeBackend.kv_cache_layout
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: expected NHD or HND, got {self.kv_cache_layout!r}")
        self.alibi_slopes = None if alibi_slopes is None else torch.as_tensor(
            alibi_slopes, dtype=torch.float32)
        self.sinks = sinks
        self.dtype = dtype_name(dtype)
        self._cache_dtype = cache_dtype_name(kv_cache_dtype)
        self._layer = self._make_layer(None)  # validates every argument now
        self._layer_device: Any = None
        self._ws_builder: Any = None
        self._ws_bytes = 0

    def _make_layer(self, device: Any) -> Any:
        """The C++ layer with alibi_slopes / sinks on `device` (None: where they are)."""
        def on(t: Any) -> Any:
            return t if t is None or device is None else t.to(device)

        spec = _C.LayerSpec(
            self.num_heads, self.num_kv_heads, self.head_size, head_size_v=self.head_size_v,
            scale=self.scale, attn_type=self.attn_type, sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size, softcap=self.logits_soft_cap,
            alibi_slopes=on(self.alibi_slopes), sinks=on(self.sinks),
            kv_cache_dtype=self._cache_dtype, kv_layout=self.kv_cache_layout, dtype=self.dtype,
            writes_kv_cache=self.kv_sharing_target_layer_name is None)
        return _C.AttentionLayer(spec)

    def _layer_on(self, device: Any) -> Any:
        if device != self._layer_device:
            self._layer = self._make_layer(device)
            self._layer_device = device
        return self._layer

    def _caches(self, kv_cache: Any) -> tuple[Any, Any]:
        """(key_cache, value_cache) in the layer's layout order (views, any strides)."""
        if self.attn_type in _ENCODERS:
            return None, None
        if kv_cache is None:
            raise ValueError("kv_cache: expected the layer's [2, num_blocks, block_size, H_kv, D] cache, "
                             "got None")
        key_cache, value_cache = kv_cache.unbind(0)
        if self.kv_cache_layout == "HND":
            return key_cache.transpose(1, 2), value_cache.transpose(1, 2)
        return key_cache, value_cache

    def _scales(self, layer: Any) -> tuple[Any, Any, Any]:
        """(k_scale, v_scale, k_scale_cache) the cache format reads from the layer."""
        if self._cache_dtype.startswith("fp8"):
            return getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None), None
        if self._cache_dtype.startswith("int8"):
            return None, getattr(layer, "_v_scale", None), getattr(layer, "_k_scale_cache", None)
        return None, None, None

    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Optional[FlashServeMetadata], output: Any = None,
                output_scale: Any = None, output_block_scale: Any = None) -> Any:
        """query [T, H, D], key/value [T, H_kv, D(v)] (None: nothing to write), output
        [T, H, Dv] (or the same flattened to [T, H * D]); writes output and returns it."""
        if output is None:
            raise ValueError("output: expected the engine's output buffer [num_tokens, num_heads, "
                             "head_size_v], got None")
        if output_scale is not None:
            raise NotImplementedError("output_scale: fused output quantization is not implemented")
        if output_block_scale is not None:
            raise NotImplementedError("output_block_scale: fused output quantization is not implemented")
        if attn_metadata is None:  # the engine's profiling run
            return output
        md = attn_metadata
        builder = md.builder
        if md.generation != builder._generation:
            raise ValueError(f"attn_metadata: expected the builder's latest metadata (build "
                             f"{builder._generation}), got build {md.generation}")
        q = query.view(-1, self.num_heads, self.head_size) if query.dim() == 2 else query
        out = output.view(-1, self.num_heads, self.head_size_v) if output.dim() == 2 else output
        if key is not None and key.dim() == 2:
            key = key.view(-1, self.num_kv_heads, self.head_size)
        if value is not None and value.dim() == 2:
            value = value.view(-1, self.num_kv_heads, self.head_size_v)
        key_cache, value_cache = self._caches(kv_cache)
        k_scale, v_scale, k_scale_cache = self._scales(layer)
        c_layer = self._layer_on(q.device)
        if builder is not self._ws_builder:
            self._ws_bytes = c_layer.workspace_bytes(builder._c)
            self._ws_builder = builder
        stream = cuda_stream(q)
        c_layer.forward(md.handle, q, key, value, key_cache, value_cache, out,
                        builder.workspace(self._ws_bytes), k_scale=k_scale, v_scale=v_scale,
                        k_scale_cache=k_scale_cache, stream=stream)
        return output
