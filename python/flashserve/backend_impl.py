"""FlashServeImpl: one attention layer's forward (vLLM's AttentionImpl shape) over
flashserve._C.AttentionLayer (SPEC.md §6): write the new K/V into the paged cache (in the
forward, or separately through do_kv_cache_update), then the decode / prefill / cascade /
local / tree passes the metadata selects.

The caches it reads (each from the engine's one kv_cache tensor per layer):

- vLLM's: get_kv_cache_shape (2, num_blocks, block_size, H_kv, D) in the stride order of the
  layout (NHD: as is; HND: physically (2, num_blocks, H_kv, block_size, D));
- the int8 fork's (kv_cache_shape_layout="HND"): the shape itself (2, num_blocks, H_kv,
  block_size, D), contiguous; int8 K8V8 caches as that in int8, K8V16 as (3, num_blocks, H_kv,
  block_size, D) int8 whose planes 1-2 hold the 16-bit values; the int8 scales are the fork's
  `kv_cache_scale` ([key_scale_cache [num_blocks, H_kv, block_size], value_scale [H_kv, D]] for
  K8V8, key_scale_cache alone for K8V16), passed to forward or kept on the layer.

A cache whose shape would fit either order (H_kv == block_size) is read in the declared one,
and one whose strides say the other is rejected (never read transposed).

Decode context parallelism: when the metadata's builder has dcp_world_size > 1 (the engine's
dcp group in FlashServeEngineConfig.dcp_group, as vLLM's get_dcp_group()), kv_cache is this
rank's shard, num_heads the heads of this rank, and the forward runs flashserve.dcp.dcp_forward:
the shard's K/V written at the engine's local slot_mapping, queries all-gathered, the local
attention with LSE, the LSE correction and the reduce-scatter back to this rank's heads.
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
_FP8 = () if torch is None else tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _float(arg: str, value: Any, default: float = 0.0) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{arg}: expected a float, got {value!r}")
    return float(value)


class FlashServeImpl:
    """One layer. kv_cache is the engine's tensor of FlashServeBackend.get_kv_cache_shape in the
    backend's stride order (see the module docstring for the forms it takes). `layer` carries
    vLLM's scales: _k_scale / _v_scale (fp8 caches; [] or per KV head [H_kv]), _q_scale (read
    when the engine quantized the query to fp8), kv_cache_scale (the int8 fork's)."""

    can_return_lse_for_decode: bool = True       # DCP: decode attention with the LSE (vLLM's check)
    supports_quant_query_input: bool = True      # q may come as fp8 (descaled by layer._q_scale)
    supports_per_head_quant_scales: bool = True  # _q_scale / _k_scale / _v_scale of [H_kv]

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: Any = "decoder", kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Any = None, *, head_size_v: Optional[int] = None,
                 attention_chunk_size: Optional[int] = None, kv_cache_layout: Optional[str] = None,
                 kv_cache_shape_layout: Optional[str] = None, use_sqrt_alibi: bool = False,
                 forward_includes_kv_cache_update: Optional[bool] = None,
                 dcp_world_size: int = 1,
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
        self.kv_cache_shape_layout = kv_cache_shape_layout or FlashServeBackend.kv_cache_shape_layout
        if self.kv_cache_shape_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_shape_layout: expected NHD or HND, got {self.kv_cache_shape_layout!r}")
        self.kv_cache_layout = kv_cache_layout or (
            "HND" if self.kv_cache_shape_layout == "HND" else FlashServeBackend.kv_cache_layout)
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: expected NHD or HND, got {self.kv_cache_layout!r}")
        if self.kv_cache_shape_layout == "HND" and self.kv_cache_layout != "HND":
            raise ValueError("kv_cache_layout: expected HND with kv_cache_shape_layout HND (a cache shaped "
                             f"(2, num_blocks, H_kv, block_size, D) is HND in memory), got {self.kv_cache_layout!r}")
        if not isinstance(use_sqrt_alibi, bool):
            raise ValueError(f"use_sqrt_alibi: expected a bool, got {use_sqrt_alibi!r}")
        self.use_sqrt_alibi = use_sqrt_alibi
        if forward_includes_kv_cache_update is None:
            forward_includes_kv_cache_update = FlashServeBackend.forward_includes_kv_cache_update
        self.forward_includes_kv_cache_update = bool(forward_includes_kv_cache_update)
        self.alibi_slopes = None if alibi_slopes is None else torch.as_tensor(
            alibi_slopes, dtype=torch.float32)
        if sinks is not None and (not hasattr(sinks, "shape") or tuple(sinks.shape) != (self.num_heads,)):
            raise ValueError(f"sinks: expected a tensor [num_heads={self.num_heads}], got "
                             f"{tuple(sinks.shape) if hasattr(sinks, 'shape') else sinks!r}")
        self.sinks = sinks
        self.dtype = dtype_name(dtype)
        self._cache_dtype = cache_dtype_name(kv_cache_dtype)
        self._layers: dict = {}
        # vLLM's impl knows its dcp world size (get_dcp_group()); under DCP the KV heads of this
        # rank need only divide the heads of the whole group (e.g. GQA 32/8 over 8 GPUs: 4 query
        # heads and 8 KV heads per rank).
        self.dcp_world_size = check_positive("dcp_world_size", dcp_world_size)
        if self.dcp_world_size > 1:  # validates every argument now
            _C.DcpAttentionLayer(self._layer_spec(None, self.use_sqrt_alibi, True),
                                 world_size=self.dcp_world_size, rank=0)
        else:
            self._make_layer(None, self.use_sqrt_alibi)
        self._ws_builder: Any = None
        self._ws_bytes = 0

    # ------------------------------------------------------------------ the C++ layer

    def _make_layer(self, device: Any, sqrt_alibi: bool, writes: bool = True) -> Any:
        """The C++ layer with alibi_slopes / sinks on `device` (None: where they are); `writes`:
        whether its forward writes the new K/V (also needs forward_includes_kv_cache_update and
        no KV sharing)."""
        return _C.AttentionLayer(self._layer_spec(device, sqrt_alibi, writes))

    def _dcp_layer_on(self, device: Any, sqrt_alibi: bool, group: Any) -> Any:
        """The C++ DCP phases of this rank (flashserve._C.DcpAttentionLayer)."""
        key = ("dcp", device, sqrt_alibi, group.world_size, group.rank)
        layer = self._layers.get(key)
        if layer is None:
            layer = self._layers[key] = _C.DcpAttentionLayer(self._layer_spec(device, sqrt_alibi, True),
                                                             world_size=group.world_size, rank=group.rank)
        return layer

    def _layer_spec(self, device: Any, sqrt_alibi: bool, writes: bool) -> Any:
        def on(t: Any) -> Any:
            return t if t is None or device is None else t.to(device)

        return _C.LayerSpec(
            self.num_heads, self.num_kv_heads, self.head_size, head_size_v=self.head_size_v,
            scale=self.scale, attn_type=self.attn_type, sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size, softcap=self.logits_soft_cap,
            alibi_slopes=on(self.alibi_slopes), sinks=on(self.sinks),
            kv_cache_dtype=self._cache_dtype, kv_layout=self.kv_cache_layout, dtype=self.dtype,
            writes_kv_cache=writes and self._forward_writes,
            alibi_sqrt=sqrt_alibi)

    @property
    def _forward_writes(self) -> bool:
        """Whether the forward writes the new K/V (not a layer sharing another's cache, and
        forward_includes_kv_cache_update)."""
        return self.kv_sharing_target_layer_name is None and self.forward_includes_kv_cache_update

    def _layer_on(self, device: Any, sqrt_alibi: bool, writes: bool = True) -> Any:
        key = (device, sqrt_alibi, writes)
        layer = self._layers.get(key)
        if layer is None:
            layer = self._layers[key] = self._make_layer(device, sqrt_alibi, writes)
        return layer

    # ------------------------------------------------------------------ caches and scales

    def _caches(self, kv_cache: Any) -> tuple[Any, Any]:
        """(key_cache, value_cache) in the layer's layout order (views, any strides)."""
        if self.attn_type in _ENCODERS:
            return None, None
        planes = 3 if self._cache_dtype == "int8_k8v16" else 2
        shape_order = ("num_blocks", "num_kv_heads", "block_size") if self.kv_cache_shape_layout == "HND" \
            else ("num_blocks", "block_size", "num_kv_heads")
        expected = f"[{planes}, {', '.join(shape_order)}, head_size]"
        if kv_cache is None:
            raise ValueError(f"kv_cache: expected the layer's {expected} cache, got None")
        if kv_cache.dim() != 5 or kv_cache.shape[0] != planes:
            raise ValueError(f"kv_cache: expected {expected} ({self.kv_cache_dtype} cache), got shape "
                             f"{tuple(kv_cache.shape)}")
        # physical order (planes, num_blocks, A, B, D): NHD (block_size, H_kv), HND (H_kv, block_size)
        phys = kv_cache.transpose(2, 3) if (self.kv_cache_shape_layout == "NHD" and
                                            self.kv_cache_layout == "HND") else kv_cache
        head_dim = 3 if self.kv_cache_layout == "NHD" else 2
        if phys.shape[head_dim] != self.num_kv_heads:
            raise ValueError(f"kv_cache: expected {expected} with num_kv_heads={self.num_kv_heads}, got shape "
                             f"{tuple(kv_cache.shape)}")
        a, b = phys.shape[2], phys.shape[3]
        if a > 1 and b > 1 and phys.stride(2) < phys.stride(3) * b:
            raise ValueError(
                f"kv_cache: expected the declared {self.kv_cache_layout} layout of shape order "
                f"{self.kv_cache_shape_layout} ({expected}, "
                f"{'block_size' if self.kv_cache_layout == 'NHD' else 'num_kv_heads'} the outer of the two in "
                f"memory), got shape {tuple(kv_cache.shape)} strides {tuple(kv_cache.stride())}: a cache of the "
                f"other layout (not read transposed)")
        key_cache = phys[0]
        if planes == 2:
            return key_cache, phys[1]
        values = phys[1:]
        if not values.is_contiguous():
            raise NotImplementedError("kv_cache: an int8_k8v16 cache whose two value planes are not one "
                                      "contiguous run (e.g. with a leading layers dimension) is not implemented")
        act = getattr(torch, self.dtype)
        if act.itemsize != 2:
            raise ValueError(f"dtype: expected float16 or bfloat16 for an int8_k8v16 cache (16-bit values), "
                             f"got {self.dtype}")
        return key_cache, values.view(act).reshape(key_cache.shape)

    def _int8_scales(self, layer: Any, kv_cache_scale: Any) -> tuple[Any, Any]:
        """(key_scale_cache, value_scale) of an int8 cache: the forward's kv_cache_scale, else
        the layer's kv_cache_scale (the int8 fork keeps them there)."""
        scales = kv_cache_scale if kv_cache_scale is not None else getattr(layer, "kv_cache_scale", None)
        if self._cache_dtype == "int8_k8v16":
            if isinstance(scales, (list, tuple)) and len(scales) == 1:
                scales = scales[0]
            if not hasattr(scales, "shape"):
                raise ValueError("kv_cache_scale: expected the int8_k8v16 cache's key_scale_cache fp32 "
                                 f"[num_blocks, H_kv, block_size] (forward's kv_cache_scale or "
                                 f"layer.kv_cache_scale), got {type(scales).__name__}")
            return scales, None
        if not isinstance(scales, (list, tuple)) or len(scales) != 2:
            raise ValueError("kv_cache_scale: expected the int8 cache's [key_scale_cache fp32 [num_blocks, H_kv, "
                             "block_size], value_scale fp32 [H_kv, D]] (forward's kv_cache_scale or "
                             f"layer.kv_cache_scale), got {type(scales).__name__}")
        return scales[0], scales[1]

    def _scales(self, layer: Any, kv_cache_scale: Any = None) -> tuple[Any, Any, Any]:
        """(k_scale, v_scale, k_scale_cache) the cache format reads."""
        if self._cache_dtype.startswith("fp8"):
            return getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None), None
        if self._cache_dtype.startswith("int8"):
            k_scale_cache, v_scale = self._int8_scales(layer, kv_cache_scale)
            return None, v_scale, k_scale_cache
        return None, None, None

    def _views(self, key: Any, value: Any) -> tuple[Any, Any]:
        if key is not None and key.dim() == 2:
            key = key.view(-1, self.num_kv_heads, self.head_size)
        if value is not None and value.dim() == 2:
            value = value.view(-1, self.num_kv_heads, self.head_size_v)
        return key, value

    # ------------------------------------------------------------------ the engine's calls

    def do_kv_cache_update(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        """Writes key/value [>= n, H_kv, D] at slot_mapping int64 [n] into the cache (vLLM's
        split of the cache write from the forward; a layer that shares another layer's cache,
        and encoder layers, write nothing)."""
        if self.attn_type in _ENCODERS or self.kv_sharing_target_layer_name is not None:
            return
        if key is None or value is None:
            raise ValueError(f"{'key' if key is None else 'value'}: expected the new tokens' "
                             f"[num_tokens, H_kv, D] tensor, got None")
        key, value = self._views(key, value)
        key_cache, value_cache = self._caches(kv_cache)
        k_scale, v_scale, k_scale_cache = self._scales(layer)
        self._layer_on(key.device, self.use_sqrt_alibi).update_kv_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
            k_scale_cache=k_scale_cache, stream=cuda_stream(key))

    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Optional[FlashServeMetadata], output: Any = None,
                output_scale: Any = None, output_block_scale: Any = None, *,
                sqrt_alibi: Optional[bool] = None, kv_cache_scale: Any = None,
                kv_cache_updated: bool = False) -> Any:
        """query [T, H, D] (fp8 when the engine quantized it: descaled by layer._q_scale),
        key/value [T, H_kv, D(v)] (None: nothing to write), output [T, H, Dv] (or the same
        flattened to [T, H * D]); writes output and returns it. The new K/V are written unless
        the layer shares another's cache, forward_includes_kv_cache_update is False or this call
        says kv_cache_updated=True (the engine called do_kv_cache_update). sqrt_alibi (the fork's): ALiBi over sqrt(distance)
        for this call (None: use_sqrt_alibi); kv_cache_scale: the fork's int8 scales."""
        if output is None:
            raise ValueError("output: expected the engine's output buffer [num_tokens, num_heads, "
                             "head_size_v], got None")
        if output_scale is not None:
            raise NotImplementedError("output_scale: fused output quantization is not implemented")
        if output_block_scale is not None:
            raise NotImplementedError("output_block_scale: fused output quantization is not implemented")
        if sqrt_alibi is None:
            sqrt_alibi = self.use_sqrt_alibi
        if not isinstance(sqrt_alibi, bool):
            raise ValueError(f"sqrt_alibi: expected a bool, got {sqrt_alibi!r}")
        if not isinstance(kv_cache_updated, bool):
            raise ValueError(f"kv_cache_updated: expected a bool, got {kv_cache_updated!r}")
        if attn_metadata is None:  # the engine's profiling run
            return output
        md = attn_metadata
        md.check_current()
        builder = md.builder
        q = query.view(-1, self.num_heads, self.head_size) if query.dim() == 2 else query
        out = output.view(-1, self.num_heads, self.head_size_v) if output.dim() == 2 else output
        key, value = self._views(key, value)
        key_cache, value_cache = self._caches(kv_cache)
        k_scale = v_scale = k_scale_cache = q_descale = None
        if key_cache is not None:
            k_scale, v_scale, k_scale_cache = self._scales(layer, kv_cache_scale)
            if q.dtype in _FP8:
                q_descale = getattr(layer, "_q_scale", None)
        if builder.dcp_world_size > 1 or self.dcp_world_size > 1:
            if builder.dcp_world_size != self.dcp_world_size and self.dcp_world_size > 1:
                raise ValueError(f"attn_metadata: expected a builder of dcp_world_size={self.dcp_world_size} "
                                 f"(the layer's), got {builder.dcp_world_size}")
            return self._forward_dcp(md, q, key, value, key_cache, value_cache, out, output, sqrt_alibi,
                                     kv_cache_updated, k_scale, v_scale, k_scale_cache, q_descale)
        c_layer = self._layer_on(q.device, sqrt_alibi, not kv_cache_updated)
        if builder is not self._ws_builder:
            self._ws_bytes = c_layer.workspace_bytes(builder._c)
            self._ws_builder = builder
        stream = cuda_stream(q)
        c_layer.forward(md.handle, q, key, value, key_cache, value_cache, out,
                        builder.workspace(self._ws_bytes), k_scale=k_scale, v_scale=v_scale,
                        k_scale_cache=k_scale_cache, q_descale=q_descale, stream=stream)
        return output

    def _forward_dcp(self, md: FlashServeMetadata, q: Any, key: Any, value: Any, key_cache: Any, value_cache: Any,
                     out: Any, output: Any, sqrt_alibi: bool, kv_cache_updated: bool, k_scale: Any, v_scale: Any,
                     k_scale_cache: Any, q_descale: Any) -> Any:
        """Decode context parallelism (vLLM's _forward_with_dcp): flashserve.dcp.dcp_forward over
        the builder's dcp group."""
        from .dcp import dcp_forward
        builder = md.builder
        if builder.dcp_group is None:
            raise ValueError(f"dcp_group: expected the engine's dcp group in FlashServeEngineConfig.dcp_group "
                             f"(dcp_world_size={builder.dcp_world_size}), got None")
        if self.attn_type != "decoder":
            raise NotImplementedError(f"decode context parallelism for a {self.attn_type} layer")
        layer = self._dcp_layer_on(q.device, sqrt_alibi, builder.dcp_group)
        ws_key = ("dcp", builder)
        if self._ws_builder != ws_key:
            self._ws_bytes = layer.attend_workspace_bytes(builder._c)
            self._ws_builder = ws_key
        write = not kv_cache_updated and self._forward_writes
        dcp_forward(layer, md.handle, q, key, value, key_cache, value_cache, out, builder.dcp_group,
                    builder.workspace(self._ws_bytes), write=write, k_scale=k_scale, v_scale=v_scale,
                    k_scale_cache=k_scale_cache, q_descale=q_descale, fused_heads=self.sinks is None)
        return output
