"""SGLang's FlashAttention backend over flashserve: `FlashAttentionBackend` (and
`FlashAttentionMultiStepBackend` for EAGLE draft workers) with the methods, metadata and CUDA
graph buffers of sglang/srt/layers/attention/flashattention_backend.py, calling
flashserve.fa3 (flash_attn_with_kvcache, flash_attn_varlen_func) and flashserve's
merge_state_v2 where SGLang calls sgl_kernel. Requires torch; SGLang itself is not imported:
the model runner, forward batch, layer and pools are read by their attribute names."""

from .backend import (FlashAttentionBackend, FlashAttentionMetadata, FlashAttentionMultiStepBackend,
                      local_virtual_batches, make_local_attention_virtual_batches, prepare_swa_spec_page_table)

__all__ = ["FlashAttentionBackend", "FlashAttentionMetadata", "FlashAttentionMultiStepBackend",
           "local_virtual_batches", "make_local_attention_virtual_batches", "prepare_swa_spec_page_table"]
