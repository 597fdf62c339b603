"""`sgl_kernel.flash_attn` as SGLang calls it: FlashAttention-3's flash_attn_with_kvcache and
flash_attn_varlen_func (with `sinks`, `ver`, and `return_softmax_lse` on the varlen call),
from flashserve.fa3; `is_fa3_supported` answers for flashserve's one implementation."""

from __future__ import annotations

from typing import Any

from .._api import is_fa_version_supported
from ..fa3 import (flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                   get_scheduler_metadata)


def is_fa3_supported(device: Any = None) -> bool:
    """Whether flashserve serves FA3's calls on `device` (None: the current CUDA device, or
    the CPU without one)."""
    return is_fa_version_supported(3, device)


__all__ = ["flash_attn_combine", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "get_scheduler_metadata", "is_fa3_supported"]
