"""flashserve: attention for LLM serving engines, as drop-ins for FlashAttention's and the
engines' own functions (PYTHON_API.md), torch custom ops under `torch.ops.flashserve`
(registered on import when torch is installed), and a backend layer shaped like the engines'.

Tensors: torch (CPU or CUDA) or numpy (CPU), through DLPack. CPU tensors run the reference
implementation, CUDA tensors the kernels (when the extension was built with CUDA).
"""

from . import _C
from ._api import (DEFAULT_FA_VERSION, fa_version_unsupported_reason, flash_attn_varlen_func,
                   flash_attn_with_kvcache, get_scheduler_metadata, is_fa_version_supported)
from ._cache_merge import merge_attn_states, merge_state_v2, reshape_and_cache_flash
from ._cache_ops import advance_step, advance_step_flashattn, copy_blocks, swap_blocks
from .backend import *  # noqa: F401,F403
from .backend import __all__ as _backend_all

try:  # the int8 fork's surface (torch required); the fork-only names live in flashserve.ixformer
    from .ixformer import (flash_attn_varlen_int8_func, reshape_and_cache_flash_int8,
                           reshape_and_cache_flash_mix, scaled_int8_quant_for_attn,
                           vllm_paged_attention_int8, vllm_paged_attention_mix)
    _INT8 = ["flash_attn_varlen_int8_func", "reshape_and_cache_flash_int8", "reshape_and_cache_flash_mix",
             "scaled_int8_quant_for_attn", "vllm_paged_attention_int8", "vllm_paged_attention_mix"]
except ImportError:
    _INT8 = []

__version__ = "0.1.0"
WITH_CUDA: bool = _C.with_cuda  # whether the extension was built with the CUDA kernels

__all__ = [
    "DEFAULT_FA_VERSION", "advance_step", "advance_step_flashattn", "copy_blocks", "swap_blocks", "WITH_CUDA", "fa_version_unsupported_reason", "flash_attn_varlen_func",
    "flash_attn_with_kvcache", "get_scheduler_metadata", "is_fa_version_supported",
    "merge_attn_states", "merge_state_v2", "reshape_and_cache_flash",
] + list(_backend_all) + _INT8
