"""The plain data the backend classes exchange with an engine (shaped like vLLM's): the KV-cache
group's description, the engine's limits, the per-step common metadata, the built metadata.

Nothing here imports an engine; an engine adapter fills these from its own config objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

ATTN_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")
KV_CACHE_LAYOUTS = ("NHD", "HND")


class AttentionCGSupport(enum.IntEnum):
    """vLLM's CUDA-graph support levels of a metadata builder (higher supports more)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # decode-only batches of one query token per request
    UNIFORM_BATCH = 2                # batches whose requests all have the same query length
    ALWAYS = 3                       # any batch, mixed prefill and decode included


@dataclass(frozen=True)
class MultipleOf:
    """vLLM's MultipleOf: a supported kernel block size is any multiple of `base`."""

    base: int


class AttentionType(str, enum.Enum):
    """vLLM's attention types; plain strings with the same values are accepted everywhere."""

    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


def attn_type_name(attn_type: Any) -> str:
    """The string value of an attention type (an enum member of any engine, or a string)."""
    name = getattr(attn_type, "value", attn_type)
    if name not in ATTN_TYPES:
        raise ValueError(f"attn_type: expected one of {', '.join(ATTN_TYPES)}, got {attn_type!r}")
    return name


def dtype_name(dtype: Any, arg: str = "dtype") -> str:
    """'float16' / 'bfloat16' / 'float32' from a torch dtype, a numpy dtype or a string."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    name = str(dtype)
    if name.startswith("torch."):
        return name.removeprefix("torch.")
    dtype_attr = getattr(dtype, "name", None)  # numpy dtypes and scalar types
    if isinstance(dtype_attr, str):
        return dtype_attr
    try:
        import numpy as np
        return np.dtype(dtype).name
    except (ImportError, TypeError) as exc:
        raise ValueError(f"{arg}: expected a torch or numpy dtype, got {dtype!r}") from exc


def cache_dtype_name(kv_cache_dtype: str) -> str:
    """The library's name of an engine's cache dtype: vLLM's explicit unquantized ones
    ('float16', 'bfloat16') store the activations as they are ('auto'); the cache write checks
    that the cache has the activations' dtype."""
    return "auto" if kv_cache_dtype in ("float16", "bfloat16") else kv_cache_dtype


def check_positive(arg: str, value: Any, minimum: int = 1) -> int:
    """value as an int >= minimum, else ValueError naming arg."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg}: expected an int >= {minimum}, got {value!r}")
    return value


@dataclass
class FlashServeKVCacheSpec:
    """One KV-cache group (vLLM's AttentionSpec plus what its layers share)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any = "bfloat16"               # activations (torch dtype or name)
    head_size_v: Optional[int] = None     # None: head_size
    kv_cache_dtype: str = "auto"
    sliding_window: Optional[int] = None
    attention_chunk_size: Optional[int] = None
    attn_type: Any = "decoder"
    alibi_slopes: Optional[list[float]] = None  # the builder reads only whether there are slopes


@dataclass
class FlashServeEngineConfig:
    """The engine's limits (vLLM's model / scheduler / speculative / parallel config)."""

    num_heads: int                        # query heads per rank
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    num_speculative_tokens: int = 0       # > 0: verify steps count as decodes
    enable_cascade: bool = True
    max_num_splits: int = 16              # bounds the split-KV workspace (CUDA graphs)
    num_splits: int = 0                   # > 0: every part's split count fixed at this (capped
                                          # by the keys), so a captured step's split count
                                          # never depends on the lengths (FA3's max_num_splits)
    # Batch-invariant mode (vLLM's VLLM_BATCH_INVARIANT, SGLang's
    # enable_deterministic_inference): a request's output is bitwise the same whatever else
    # the batch holds: fixed-size KV splits for decode/verify steps, none for prefill, no
    # cascade. num_splits 0 or 1; num_speculative_tokens + 1 <= 16.
    batch_invariant: bool = False
    # Decode context parallelism (vLLM's decode_context_parallel_size, get_dcp_group() and
    # parallel_config.cp_kv_cache_interleave_size): dcp_group is the group's torch.distributed
    # ProcessGroup or vLLM's GroupCoordinator (world size and rank then come from it); the
    # builder's metadata and the layers' forward use it. num_heads stays the heads per rank.
    dcp_world_size: int = 1
    dcp_rank: int = 0
    cp_kv_cache_interleave_size: int = 1
    dcp_group: Any = field(default=None, repr=False)
    max_draft_depth: int = 32


@dataclass
class CommonAttentionMetadata:
    """Per-step batch description (vLLM's CommonAttentionMetadata). Requests with the short
    queries come first (see reorder_decodes_first). The *_cpu arrays are what the builder reads:
    int32 CPU tensors or numpy arrays."""

    query_start_loc: Any                 # int32 [num_reqs + 1], on the device
    query_start_loc_cpu: Any             # the same on the host
    seq_lens: Any                        # int32 [num_reqs]: KV length after this step
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: Any              # int32 [>= num_reqs, max_blocks]
    slot_mapping: Any                    # int64 [>= num_actual_tokens]
    causal: bool = True
    seq_lens_cpu: Any = None             # host seq_lens; None: seq_lens when it is on the CPU
    encoder_seq_lens: Any = None
    encoder_seq_lens_cpu: Any = None     # cross-attention: host encoder lengths


@dataclass
class DraftTree:
    """A speculative verify step's draft tree: per request its number of drafts (the last query
    tokens), and per draft its parent among the request's earlier drafts (-1: the committed
    tip). Host int32 arrays."""

    parents: Any
    num_drafts: Any


@dataclass
class FlashServeMetadata:
    """What build() returns: the engine's view of the step plus the builder's handle.

    The handle is the builder's own metadata, rewritten by its next build: a forward with
    metadata from an earlier build raises ValueError."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: Any
    seq_lens: Any
    block_table: Any
    slot_mapping: Any
    causal: bool
    common_prefix_len: int               # tokens the cascade shares (0: no cascade)
    use_cascade: bool
    use_local: bool
    use_tree: bool
    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    common: CommonAttentionMetadata = field(repr=False)
    draft_tree: Optional[DraftTree] = field(default=None, repr=False)
    builder: Any = field(default=None, repr=False)  # the FlashServeMetadataBuilder that built it
    handle: Any = field(default=None, repr=False)   # flashserve._C.AttentionMetadata
    generation: int = 0                  # the builder's build count when it was built

    def check_current(self) -> None:
        """ValueError unless this is the builder's latest metadata (its handle is rewritten by
        each build)."""
        if self.generation != self.builder._generation:
            raise ValueError(f"attn_metadata: expected the builder's latest metadata (build "
                             f"{self.builder._generation}), got build {self.generation}")
