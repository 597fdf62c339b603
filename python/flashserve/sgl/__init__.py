"""An `sgl_kernel`-shaped entry: SGLang's FlashAttention backend switches to flashserve by
changing its imports to

    from flashserve.sgl import merge_state_v2
    from flashserve.sgl.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

`flash_attn` holds FlashAttention-3's functions with SGLang's keywords (flashserve.fa3);
`merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None) -> (v_merged, s_merged)`
merges two states [T, H, D] with token-major LSEs [T, H] (SPEC.md §4). Requires torch."""

from .. import merge_state_v2
from . import flash_attn

__all__ = ["flash_attn", "merge_state_v2"]
