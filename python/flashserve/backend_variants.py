"""Backend classes for the layer variants (SPEC.md §6), shaped like the engines' own:

- differential attention (vLLM's DifferentialFlashAttentionBackend / Impl): heads in
  interleaved pairs, two half caches in one (2, 2, num_blocks, block_size, H_kv / 2, D) tensor,
  out = RMSNorm(a1 - λ a2) * (1 - λ_init) re-interleaved; over flashserve._C.DifferentialAttentionLayer
  with the metadata of a FlashServeMetadataBuilder;
- MLA prefill through FlashAttention (vLLM's FlashAttnPrefillBackend / Impl): q/k 192 wide, v
  128, new tokens causal, each context chunk non-causal with its LSE; forward_prefill merges the
  chunks and the new tokens in fp32 by LSE in one call (flashserve._C.MlaLayer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from . import _C
from ._tensors import cuda_stream
from .backend_builder import FlashServeMetadataBuilder
from .backend_types import FlashServeMetadata, attn_type_name, cache_dtype_name, check_positive, dtype_name

try:
    import torch
except ImportError:
    torch = None


def _float(arg: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{arg}: expected a float, got {value!r}")
    return float(value)


# ---------------------------------------------------------------- differential attention

class _BuilderBackendBase:
    """The vLLM AttentionBackend static interface shared by the backends whose metadata comes
    from a FlashServeMetadataBuilder (FlashServeBackend, FlashServeDifferentialBackend)."""

    accept_output_buffer: bool = True

    @staticmethod
    def get_builder_cls() -> type:
        return FlashServeMetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type:
        return FlashServeMetadata

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(_C.Capabilities.supported_head_sizes())


class FlashServeDifferentialBackend(_BuilderBackendBase):
    """vLLM's DifferentialFlashAttentionBackend: the cache holds the two head halves."""

    @staticmethod
    def get_name() -> str:
        return "FLASHSERVE_DIFFERENTIAL"

    @staticmethod
    def get_impl_cls() -> type:
        return FlashServeDifferentialImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """(2 halves, 2 (K, V), num_blocks, block_size, num_kv_heads / 2, head_size)."""
        check_positive("num_blocks", num_blocks, 0)
        check_positive("block_size", block_size)
        check_positive("head_size", head_size)
        if check_positive("num_kv_heads", num_kv_heads) % 2:
            raise ValueError(f"num_kv_heads: expected an even count (interleaved pairs), got {num_kv_heads}")
        return (2, 2, num_blocks, block_size, num_kv_heads // 2, head_size)


def _rms_params(subln: Any, width: int) -> tuple[Any, float]:
    """(weight fp32 [width], eps) of the sub-layer norm: a module with .weight (None: ones) and
    .variance_epsilon (vLLM's RMSNorm) or .eps (torch's), or a (weight, eps) pair."""
    if isinstance(subln, (tuple, list)) and len(subln) == 2:
        weight, eps = subln
    elif hasattr(subln, "variance_epsilon") or hasattr(subln, "eps"):
        weight = getattr(subln, "weight", None)
        eps = getattr(subln, "variance_epsilon", None)
        if eps is None:
            eps = getattr(subln, "eps", None)
        if eps is None:  # torch.nn.RMSNorm(eps=None): the dtype's machine epsilon
            eps = torch.finfo(weight.dtype if weight is not None else torch.float32).eps
    else:
        raise ValueError("differential_flash_attention_config['subln']: expected an RMSNorm module "
                         f"(weight, variance_epsilon or eps) or a (weight, eps) pair, got {type(subln).__name__}")
    if weight is None:
        weight = torch.ones(width)
    weight = torch.as_tensor(weight).detach().float().reshape(-1).cpu()
    if weight.numel() != width:
        raise ValueError(f"differential_flash_attention_config['subln']: expected a weight of 2 * head_size="
                         f"{width}, got {weight.numel()}")
    return weight, _float("subln eps", eps)


class FlashServeDifferentialImpl:
    """One differential attention layer (vLLM's DifferentialFlashAttentionImpl arguments).
    differential_flash_attention_config: lambda_init, lambda_q1 / lambda_k1 / lambda_q2 /
    lambda_k2 ([head_size] each) and subln (the RMSNorm over 2 * head_size)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: Any = "decoder", kv_sharing_target_layer_name: Optional[str] = None,
                 use_irope: bool = False, differential_flash_attention_config: Optional[dict] = None,
                 *, dtype: Any = "bfloat16") -> None:
        if torch is None:
            raise ImportError("FlashServeDifferentialImpl needs torch")
        if alibi_slopes is not None:
            raise NotImplementedError("alibi_slopes: differential attention with ALiBi is not implemented")
        if use_irope:
            raise NotImplementedError("use_irope: chunked local differential attention is not implemented")
        cfg = differential_flash_attention_config
        if not isinstance(cfg, dict):
            raise ValueError("differential_flash_attention_config: expected a dict with lambda_init, lambda_q1, "
                             f"lambda_k1, lambda_q2, lambda_k2 and subln, got {cfg!r}")
        for name in ("lambda_init", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln"):
            if name not in cfg:
                raise ValueError(f"differential_flash_attention_config: expected key {name!r}, got keys "
                                 f"{sorted(cfg)}")
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_size = check_positive("head_size", head_size)
        self.num_kv_heads = num_heads if num_kv_heads is None else check_positive("num_kv_heads", num_kv_heads)
        self.scale = _float("scale", scale)
        self.logits_soft_cap = 0.0 if logits_soft_cap is None else _float("logits_soft_cap", logits_soft_cap)
        self.sliding_window = 0 if sliding_window is None else check_positive("sliding_window", sliding_window)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type_name(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.dtype = dtype_name(dtype)
        self.lambda_init = _float("lambda_init", cfg["lambda_init"])
        self._lambdas = [torch.as_tensor(cfg[n]).detach().float().reshape(-1).cpu()
                         for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
        self._subln_weight, self.rms_eps = _rms_params(cfg["subln"], 2 * self.head_size)
        self._layers: dict = {}
        self._layer_on(None)  # validates every argument now
        self._ws_builder: Any = None
        self._ws_bytes = 0

    @property
    def lambda_full(self) -> float:
        """λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init (from host copies of the vectors)."""
        return self._layer_on(None).lambda_full()

    def _layer_on(self, device: Any) -> Any:
        layer = self._layers.get(device)
        if layer is None:
            def on(t: Any) -> Any:
                return t if device is None else t.to(device)
            spec = _C.LayerSpec(
                self.num_heads, self.num_kv_heads, self.head_size, scale=self.scale, attn_type=self.attn_type,
                sliding_window=self.sliding_window, softcap=self.logits_soft_cap,
                kv_cache_dtype=cache_dtype_name(self.kv_cache_dtype), dtype=self.dtype,
                writes_kv_cache=self.kv_sharing_target_layer_name is None)
            q1, k1, q2, k2 = (on(t) for t in self._lambdas)
            layer = self._layers[device] = _C.DifferentialAttentionLayer(
                spec, lambda_q1=q1, lambda_k1=k1, lambda_q2=q2, lambda_k2=k2,
                subln_weight=on(self._subln_weight), lambda_init=self.lambda_init, rms_eps=self.rms_eps)
        return layer

    def forward(self, layer: Any, q: Any, k: Any, v: Any, kv_cache: Any,
                attn_metadata: Optional[FlashServeMetadata], output: Any = None,
                output_scale: Any = None, output_block_scale: Any = None) -> Any:
        """q [T, H, D] (or [T, H * D]), k/v [T, H_kv, D] (None: nothing to write), kv_cache
        [2, 2, num_blocks, block_size, H_kv / 2, D]; returns output [T, H * D] (written into
        `output` when given)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("output_scale: fused output quantization is not implemented")
        H, D = self.num_heads, self.head_size
        q = q.view(-1, H, D)
        if output is None:
            output = torch.empty(q.shape[0], H, D, dtype=q.dtype, device=q.device)
        out = output.view(-1, H, D)
        if attn_metadata is None:  # the engine's profiling run
            return output.view(-1, H * D)
        attn_metadata.check_current()
        if k is not None:
            k = k.view(-1, self.num_kv_heads, D)
        if v is not None:
            v = v.view(-1, self.num_kv_heads, D)
        caches = [None] * 4
        if self.attn_type not in ("encoder", "encoder_only"):
            expected = (2, 2, self.num_kv_heads // 2, D)
            if kv_cache is None or kv_cache.dim() != 6 or (kv_cache.shape[0], kv_cache.shape[1],
                                                           kv_cache.shape[4], kv_cache.shape[5]) != expected:
                raise ValueError(f"kv_cache: expected [2, 2, num_blocks, block_size, num_kv_heads / 2="
                                 f"{self.num_kv_heads // 2}, head_size={D}], got "
                                 f"{None if kv_cache is None else tuple(kv_cache.shape)}")
            caches = [kv_cache[0][0], kv_cache[0][1], kv_cache[1][0], kv_cache[1][1]]
        k_scale = v_scale = None
        if self.kv_cache_dtype.startswith("fp8"):
            k_scale, v_scale = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        c_layer = self._layer_on(q.device)
        builder = attn_metadata.builder
        if builder is not self._ws_builder:
            self._ws_bytes = c_layer.workspace_bytes(builder._c)
            self._ws_builder = builder
        c_layer.forward(attn_metadata.handle, q, k, v, *caches, out, builder.workspace(self._ws_bytes),
                        k_scale=k_scale, v_scale=v_scale, stream=cuda_stream(q))
        return output.view(-1, H * D)


# ---------------------------------------------------------------- MLA prefill

@dataclass
class MLAChunkedContextMetadata:
    """The context chunks of a prefill (vLLM's ChunkedContextMetadata): per chunk, its
    cu_seq_lens int32 [num_prefills + 1] (device) and max_seq_lens."""

    cu_seq_lens: list = field(default_factory=list)
    max_seq_lens: list = field(default_factory=list)


@dataclass
class MLAPrefillMetadata:
    """The prefill part of an MLA step (vLLM's MLACommonPrefillMetadata fields the FlashAttention
    prefill reads): query_start_loc int32 [num_prefills + 1] relative to the first prefill token."""

    query_start_loc: Any
    max_query_len: int
    chunked_context: Optional[MLAChunkedContextMetadata] = None


class FlashServeMLAPrefillBackend:
    """vLLM's FlashAttnPrefillBackend."""

    @staticmethod
    def get_name() -> str:
        return "FLASHSERVE_MLA_PREFILL"

    @staticmethod
    def get_prefill_impl_cls() -> type:
        return FlashServeMLAPrefillImpl

    @classmethod
    def is_available(cls) -> bool:
        return True


class FlashServeMLAPrefillImpl:
    """MLA prefill (vLLM's FlashAttnPrefillImpl): q/k [T, H, qk_nope + qk_rope], v [T, H,
    v_head_dim]; V is never padded (the kernels take D != Dv)."""

    requires_v_padding: bool = False

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, vllm_config: Any = None, device: Any = "cpu") -> None:
        if torch is None:
            raise ImportError("FlashServeMLAPrefillImpl needs torch")
        self.num_heads = check_positive("num_heads", num_heads)
        self.scale = _float("scale", scale)
        self.kv_lora_rank = check_positive("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = check_positive("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = check_positive("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = check_positive("v_head_dim", v_head_dim)
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if not _C.Capabilities.supports_head_size(self.qk_head_dim, self.v_head_dim):
            raise ValueError(f"qk_nope_head_dim + qk_rope_head_dim: expected head sizes the kernels serve "
                             f"(e.g. 192 with v_head_dim 128), got {self.qk_head_dim}/{self.v_head_dim}")
        self.device = torch.device(device)
        self._layer = _C.MlaLayer(num_heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                                  qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, scale=self.scale)
        max_tokens = getattr(vllm_config, "max_num_batched_tokens", None)
        self._workspace = None
        if isinstance(max_tokens, int) and max_tokens > 0:  # sized once from the engine's limit
            self._workspace_for(max_tokens)

    def _workspace_for(self, num_tokens: int) -> Any:
        nbytes = self._layer.workspace_bytes(max(num_tokens, 1))
        if self._workspace is None or self._workspace.numel() < nbytes:
            self._workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _varlen(self, q: Any, k: Any, v: Any, cu_seqlens_k: Any, max_seqlen_k: int, md: MLAPrefillMetadata,
                causal: bool, return_softmax_lse: bool) -> Any:
        from . import flash_attn_varlen_func
        return flash_attn_varlen_func(q, k, v, md.max_query_len, md.query_start_loc, max_seqlen_k,
                                      cu_seqlens_k=cu_seqlens_k, softmax_scale=self.scale, causal=causal,
                                      return_softmax_lse=return_softmax_lse)

    def run_prefill_new_tokens(self, prefill_metadata: MLAPrefillMetadata, q: Any, k: Any, v: Any,
                               return_softmax_lse: bool) -> Any:
        """The new tokens over themselves, causal: out [T, H, Dv] (and lse [H, T] fp32)."""
        md = prefill_metadata
        return self._varlen(q, k, v, md.query_start_loc, md.max_query_len, md, True, return_softmax_lse)

    def run_prefill_context_chunk(self, prefill_metadata: MLAPrefillMetadata, chunk_idx: int, q: Any, k: Any,
                                  v: Any) -> tuple[Any, Any]:
        """The new tokens over context chunk chunk_idx, non-causal: (out, lse [H, T])."""
        cc = prefill_metadata.chunked_context
        if cc is None or not 0 <= chunk_idx < len(cc.cu_seq_lens):
            raise ValueError(f"chunk_idx: expected a chunk of prefill_metadata.chunked_context "
                             f"({0 if cc is None else len(cc.cu_seq_lens)} chunks), got {chunk_idx}")
        return self._varlen(q, k, v, cc.cu_seq_lens[chunk_idx], cc.max_seq_lens[chunk_idx], prefill_metadata,
                            False, True)

    def forward_prefill(self, prefill_metadata: MLAPrefillMetadata, q: Any, k: Any, v: Any,
                        context: Optional[list] = None, output: Any = None) -> Any:
        """The whole prefill in one call: each context chunk (k_i [n_i, H, 192], v_i [n_i, H,
        128], the chunk i of prefill_metadata.chunked_context) non-causal with its LSE, the new
        tokens causal, the partial outputs merged in fp32 by LSE; writes output [T, H, 128]."""
        md = prefill_metadata
        context = list(context or [])
        cc = md.chunked_context
        n_chunks = 0 if cc is None else len(cc.cu_seq_lens)
        if len(context) != n_chunks:
            raise ValueError(f"context: expected one (k, v) per chunk of prefill_metadata.chunked_context "
                             f"({n_chunks}), got {len(context)}")
        if output is None:
            output = torch.empty(q.shape[0], self.num_heads, self.v_head_dim, dtype=q.dtype, device=q.device)
        chunks = [(ck, cv, cc.cu_seq_lens[i], int(cc.max_seq_lens[i])) for i, (ck, cv) in enumerate(context)]
        ws = self._workspace_for(q.shape[0]) if chunks else None
        self._layer.prefill(q, k, v, md.query_start_loc, int(md.max_query_len), chunks, output, ws,
                            stream=cuda_stream(q))
        return output
