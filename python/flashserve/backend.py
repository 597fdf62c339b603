"""flashserve as an engine's attention backend (SPEC.md §6), shaped like vLLM's
FlashAttentionBackend: capabilities, the KV-cache shape and stride order, and the classes an
engine instantiates (the metadata builder once per KV-cache group, the impl once per layer).

    backend = FlashServeBackend
    builder = backend.get_builder_cls()(kv_cache_spec, layer_names, engine_config, device)
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, ...)
    md = builder.build(common_prefix_len, common_attn_metadata)   # once per step
    impl.forward(layer, q, k, v, kv_cache, md, output)             # once per layer
"""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from .backend_builder import FlashServeMetadataBuilder, device_props
from .backend_impl import FlashServeImpl
from .backend_variants import (FlashServeDifferentialBackend, FlashServeDifferentialImpl,
                               FlashServeMLAPrefillBackend, FlashServeMLAPrefillImpl,
                               MLAChunkedContextMetadata, MLAPrefillMetadata, _BuilderBackendBase)
from .backend_types import (KV_CACHE_LAYOUTS, AttentionCGSupport, AttentionType,
                            CommonAttentionMetadata, DraftTree, FlashServeEngineConfig,
                            FlashServeKVCacheSpec, FlashServeMetadata, MultipleOf, check_positive,
                            dtype_name)

try:
    import torch
except ImportError:
    torch = None

__all__ = [
    "AttentionCGSupport", "AttentionType", "CommonAttentionMetadata", "MultipleOf", "DraftTree", "FlashServeBackend",
    "FlashServeEngineConfig", "FlashServeImpl", "FlashServeKVCacheSpec", "FlashServeMetadata",
    "FlashServeMetadataBuilder", "reorder_decodes_first", "FlashServeDifferentialBackend",
    "FlashServeDifferentialImpl", "FlashServeMLAPrefillBackend", "FlashServeMLAPrefillImpl",
    "MLAChunkedContextMetadata", "MLAPrefillMetadata",
]

_ANY_GPU = _C.DeviceProps.cuda(0, 1, 8, 0)  # what every supported CUDA device supports


def _as_dtype(name: str) -> Any:
    return getattr(torch, name) if torch is not None else name


def _capability_props(capability: Any) -> Any:
    """DeviceProps of a compute capability: (major, minor), an int like 90, an object with
    major/minor (vLLM's DeviceCapability), or None for the CPU."""
    if capability is None:
        return _C.DeviceProps.cpu()
    if isinstance(capability, int) and not isinstance(capability, bool):
        major, minor = divmod(capability, 10)
    elif isinstance(capability, (tuple, list)) and len(capability) == 2:
        major, minor = capability
    elif hasattr(capability, "major") and hasattr(capability, "minor"):
        major, minor = capability.major, capability.minor
    else:
        raise ValueError(f"capability: expected (major, minor), an int like 90 or None, got {capability!r}")
    return _C.DeviceProps.cuda(0, 1, int(major), int(minor))


def reorder_decodes_first(query_lens: Any, threshold: int = 1) -> list[int]:
    """The batch order that puts requests with query_len <= threshold first (stable), as
    indices into the old order. query_lens: host int32 array."""
    return _C.reorder_decodes_first(query_lens, threshold)


class FlashServeBackend(_BuilderBackendBase):
    """The backend's static description (vLLM's AttentionBackend interface)."""

    # False: the engine calls FlashServeImpl.do_kv_cache_update and the forward does not write
    # (read by each FlashServeImpl at construction).
    forward_includes_kv_cache_update: bool = True
    kv_cache_layout: str = "NHD"  # physical layout of the caches the engine allocates (or "HND")
    # The dims order of get_kv_cache_shape: "NHD" is vLLM's (2, num_blocks, block_size, H_kv, D)
    # (HND caches then come from the stride order); "HND" is the int8 fork's (2, num_blocks,
    # H_kv, block_size, D), physically HND (identity stride order; kv_cache_layout "HND").
    kv_cache_shape_layout: str = "NHD"
    supported_dtypes: list = [_as_dtype(n) for n in _C.Capabilities.supported_dtypes(_ANY_GPU)]
    supported_kv_cache_dtypes: list = [*_C.Capabilities.supported_kv_cache_dtypes(), "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "FLASHSERVE"

    @staticmethod
    def get_impl_cls() -> type:
        return FlashServeImpl

    @classmethod
    def get_supported_dtypes(cls, device: Any = None) -> list:
        """Activation dtypes on `device` (None: any CUDA device; the CPU adds float32)."""
        props = _ANY_GPU if device is None else device_props(device)
        return [_as_dtype(n) for n in _C.Capabilities.supported_dtypes(props)]

    @classmethod
    def supports_head_size(cls, head_size: int, head_size_v: Optional[int] = None) -> bool:
        """Multiples of 8 up to 256 (V the same), or an MLA pair with head_size_v."""
        return _C.Capabilities.supports_head_size(head_size, head_size_v or 0)

    @classmethod
    def supports_dtype(cls, dtype: Any, device: Any = None) -> bool:
        return dtype_name(dtype) in [dtype_name(d) for d in cls.get_supported_dtypes(device)]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Optional[str]) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_block_size(cls, block_size: Optional[int]) -> bool:
        return block_size is None or _C.Capabilities.supports_block_size(block_size)

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return _C.Capabilities.supports_compute_capability(_capability_props(capability))

    @classmethod
    def supports_sink(cls) -> bool:
        return _C.Capabilities.supports_sinks()

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        """q/k/v descales per KV head ([H_kv]), as well as per tensor."""
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def get_required_kv_cache_layout(cls) -> Optional[str]:
        """The layout the engine must allocate: HND with the fork's shape order, else None
        (either; the engine's choice goes in kv_cache_layout)."""
        return "HND" if cls.kv_cache_shape_layout == "HND" else None

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: Any, kv_cache_dtype: Optional[str],
                               block_size: Optional[int], use_mla: bool, has_sink: bool,
                               use_sparse: bool, device_capability: Any) -> list[str]:
        """vLLM's list of reasons a configuration is invalid (empty: valid)."""
        reason = cls.supports_combination(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                          use_sparse, device_capability)
        return [] if reason is None else [reason]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        """Any block size (the kernels read any page size, 1 included)."""
        return [MultipleOf(1)]

    @classmethod
    def supports_combination(cls, head_size: int, dtype: Any, kv_cache_dtype: Optional[str],
                             block_size: Optional[int], use_mla: bool, has_sink: bool,
                             use_sparse: bool, device_capability: Any) -> Optional[str]:
        """None when the combination runs, else the reason naming the feature (vLLM's query)."""
        if use_mla:
            return "MLA: not served by this backend (FlashServeMLAPrefillBackend serves MLA prefill)"
        if use_sparse:
            return "sparse attention: not implemented"
        if has_sink and not cls.supports_sink():
            return "sinks: not supported"
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            return f"kv_cache_dtype {kv_cache_dtype}: expected one of {', '.join(cls.supported_kv_cache_dtypes)}"
        if not cls.supports_compute_capability(device_capability):
            return f"compute capability {device_capability}: expected sm80 or newer"
        if not cls.supports_head_size(head_size):
            return f"head size {head_size}: expected a multiple of 8 in [8, 256]"
        name = dtype_name(dtype)
        if name not in ("float16", "bfloat16"):
            return f"dtype {name}: expected float16 or bfloat16"
        if block_size is not None and not cls.supports_block_size(block_size):
            return f"block size {block_size}: expected >= 1"
        return None

    @classmethod
    def supports_attn_type(cls, attn_type: Any) -> bool:
        return getattr(attn_type, "value", attn_type) in [t.value for t in AttentionType]

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def unsupported_reason(cls, num_heads: int, num_kv_heads: int, head_size: int, dtype: Any,
                           block_size: int, device: Any = None,
                           head_size_v: Optional[int] = None) -> Optional[str]:
        """None when a layer of this shape runs on `device` (None: any sm80+ GPU), else the
        first reason ("head size 20: expected ...")."""
        spec_dtype = dtype_name(dtype)
        if spec_dtype not in ("float16", "bfloat16", "float32"):
            return f"dtype {spec_dtype}: expected float16 or bfloat16 (or float32 on the CPU)"
        spec = _C.LayerSpec(num_heads, num_kv_heads, head_size, head_size_v=head_size_v or 0,
                            dtype=spec_dtype)
        props = _ANY_GPU if device is None else device_props(device)
        return _C.Capabilities.unsupported_reason(spec, block_size, props) or None

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """(2, num_blocks, block_size, num_kv_heads, head_size): unbind(0) gives K and V; with
        kv_cache_shape_layout "HND" (the int8 fork's) (2, num_blocks, num_kv_heads, block_size,
        head_size). int8_k8v16 caches (int8 keys, 16-bit values in one int8 tensor) have 3
        planes: the key, then the values' two bytes."""
        check_positive("num_blocks", num_blocks, 0)
        if not cls.supports_block_size(check_positive("block_size", block_size, 0)):
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        check_positive("num_kv_heads", num_kv_heads)
        check_positive("head_size", head_size)
        if not cls.supports_kv_cache_dtype(cache_dtype_str):
            names = ", ".join(cls.supported_kv_cache_dtypes)
            raise ValueError(f"cache_dtype_str: expected one of {names}, got {cache_dtype_str!r}")
        if cls.kv_cache_shape_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_shape_layout: expected NHD or HND, got {cls.kv_cache_shape_layout!r}")
        shape = _C.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        planes = 3 if cache_dtype_str == "int8_k8v16" else 2
        if cls.kv_cache_shape_layout == "HND":
            return (planes, num_blocks, num_kv_heads, block_size, head_size)
        return (planes, *shape[1:])

    @classmethod
    def get_kv_cache_stride_order(cls, include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """The permutation from get_kv_cache_shape's logical order (with a leading layers
        dimension when asked) to the physical layout of cls.kv_cache_layout. The fork's shape
        order (kv_cache_shape_layout "HND") is already physical: the identity, and with layers
        (num_blocks, H_kv, num_layers, 2, block_size, D) as vLLM's HND."""
        if cls.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: expected NHD or HND, got {cls.kv_cache_layout!r}")
        if cls.kv_cache_shape_layout == "HND":
            if cls.kv_cache_layout != "HND":
                raise ValueError("kv_cache_layout: expected HND with kv_cache_shape_layout HND, got "
                                 f"{cls.kv_cache_layout!r}")
            return (2, 3, 0, 1, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)
        return _C.kv_cache_stride_order(cls.kv_cache_layout, bool(include_num_layers_dimension))

