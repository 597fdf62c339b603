"""Decode context parallelism (DCP) in Python: the collectives over torch.distributed (or vLLM's
dcp group) around the C++ per-rank phases of flashserve._C.DcpAttentionLayer.

W ranks share every sequence's KV cache: position t lives on rank (t // I) % W at local index
(t // (I * W)) * I + t % I, I = cp_kv_cache_interleave_size (I = 1: rank t % W, index t // W).
Each rank holds H_local query heads. One layer's step:

    write_kv         the new K/V into this rank's shard (the engine's local slot_mapping: -1 for
                     the positions other ranks own; dcp_slot_mapping computes it)
    all_gather       q [T, H_local, D] -> q_all [W * T, H_local, D]
    attend           q_all over the local shard with LSE -> out_all fp32 [W, T, H_local, Dv],
                     lse_local fp32 [W * H_local, T]                                   (C++)
    all_gather       lse_local -> lse_all [W, W * H_local, T]
    correct          out_all *= exp(lse_local - logsumexp over ranks)                  (C++)
    reduce_scatter   out_all -> this rank's heads [T, H_local, Dv] (fp32 sum), then out's dtype

Why the orchestration is in Python rather than a Python communicator called back from C++:
each C++ phase only enqueues kernels on the current stream (no allocation, no host sync), and
the collectives are the engine's own (torch.distributed's NCCL, or vLLM's GroupCoordinator whose
device communicator is CUDA-graph aware), so the whole step, collectives included, is captured
in one CUDA graph exactly as the engine captures its other collectives. A callback from C++
would hold the GIL inside the forward, wrap raw workspace pointers as tensors for every call,
and hide the collectives from torch.compile / graph tooling; the C++ NcclCommunicator
(flashserve/nccl.hpp, FLASHSERVE_NCCL) is the C++ engines' path.
"""

from __future__ import annotations

from typing import Any

from . import _C
from ._tensors import cuda_stream

try:
    import torch
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    torch = dist = None

__all__ = ["DcpGroup", "dcp_local_seq_lens", "dcp_slot_mapping", "dcp_forward"]


class DcpGroup:
    """The two collectives DCP needs, over a torch.distributed ProcessGroup (None: the default
    group) or vLLM's GroupCoordinator (get_dcp_group(): has world_size, rank_in_group,
    all_gather(t, dim) and reduce_scatter(t, dim))."""

    def __init__(self, group: Any = None) -> None:
        if isinstance(group, DcpGroup):
            group = group.group
        self.group = group
        if group is not None and hasattr(group, "rank_in_group") and hasattr(group, "reduce_scatter"):
            self._coordinator = True
            self.world_size = int(group.world_size)
            self.rank = int(group.rank_in_group)
        else:
            if dist is None or not dist.is_initialized():
                raise ValueError("dcp_group: expected a torch.distributed process group (initialized) or "
                                 f"vLLM's GroupCoordinator, got {group!r}")
            self._coordinator = False
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)

    def all_gather(self, out: Any, inp: Any) -> None:
        """out [W * n, ...] = every rank's inp [n, ...] (contiguous), in rank order."""
        if self._coordinator:
            out.copy_(self.group.all_gather(inp, dim=0))
        else:
            dist.all_gather_into_tensor(out, inp, group=self.group)

    def reduce_scatter(self, out: Any, inp: Any) -> None:
        """out [n, ...] = the sum over ranks of rows [rank * n, (rank + 1) * n) of inp [W * n, ...]."""
        if self._coordinator:
            out.copy_(self.group.reduce_scatter(inp, dim=0))
        else:
            dist.reduce_scatter_tensor(out, inp, group=self.group)


def dcp_local_seq_lens(seq_lens: Any, world_size: int, rank: int, interleave: int = 1) -> Any:
    """This rank's share of global KV lengths (vLLM's get_dcp_local_seq_lens), elementwise."""
    base = seq_lens // (interleave * world_size) * interleave
    rem = seq_lens - base * world_size - rank * interleave
    return base + rem.clip(0, interleave)


def dcp_slot_mapping(positions: Any, block_table_rows: Any, block_size: int, world_size: int, rank: int,
                     interleave: int = 1) -> Any:
    """This rank's slots of tokens at global `positions` whose requests' local block table rows are
    `block_table_rows` [num_tokens, max_blocks]: -1 for the positions other ranks own (the
    slot_mapping vLLM's block table computes under DCP)."""
    owner = positions // interleave % world_size
    local = positions // (interleave * world_size) * interleave + positions % interleave
    block = block_table_rows.gather(1, (local // block_size).clamp(max=block_table_rows.shape[1] - 1)
                                    .unsqueeze(1).long()).squeeze(1).long()
    slots = block * block_size + local % block_size
    return torch.where(owner == rank, slots, torch.full_like(slots, -1))


def dcp_forward(layer: Any, metadata: Any, q: Any, key: Any, value: Any, key_cache: Any, value_cache: Any,
                out: Any, group: DcpGroup, workspace: Any, *, write: bool = True, k_scale: Any = None,
                v_scale: Any = None, k_scale_cache: Any = None, q_descale: Any = None,
                fused_heads: bool = True) -> Any:
    """One DCP layer step. layer: flashserve._C.DcpAttentionLayer of this rank; metadata: the
    builder's (a builder with this rank's dcp_world_size / dcp_rank / dcp_interleave); q [>= T,
    H_local, D]; key/value [>= T, H_kv, D(v)] (written to the shard when `write`); out [>= T,
    H_local, Dv], rows [0, T) written; workspace: attend's (layer.attend_workspace_bytes).
    fused_heads: attend in one call over all W * H_local heads (the gathered q and the partial
    outputs transposed token-major around it: copies of T x H rows, a view for T = 1) rather
    than one call per rank's slice; False for layers with sinks."""
    W, T = group.world_size, metadata.num_actual_tokens
    if layer.world_size != W or layer.rank != group.rank:
        raise ValueError(f"dcp_group: expected the layer's group (rank {layer.rank} of {layer.world_size}), got "
                         f"rank {group.rank} of {W}")
    if q.dim() != 3 or out.dim() != 3:
        raise ValueError(f"q/out: expected [T, H_local, D] tensors, got {tuple(q.shape)} / {tuple(out.shape)}")
    Hl, D, Dv = q.shape[1], q.shape[2], out.shape[2]
    stream = cuda_stream(q)
    if write and key is not None and value is not None:
        layer.write_kv(metadata, key, value, key_cache, value_cache, k_scale=k_scale, v_scale=v_scale,
                       k_scale_cache=k_scale_cache, stream=stream)
    q_all = torch.empty((W, T, Hl, D), dtype=q.dtype, device=q.device)
    group.all_gather(q_all.view(W * T, Hl, D), q[:T].contiguous())
    f32 = torch.float32
    lse_local = torch.empty((W * Hl, T), dtype=f32, device=q.device)
    scales = dict(k_scale=k_scale, v_scale=v_scale, k_scale_cache=k_scale_cache, q_descale=q_descale)
    if fused_heads:
        out_tok = torch.empty((T, W * Hl, Dv), dtype=f32, device=q.device)
        layer.attend(metadata, q_all.transpose(0, 1).reshape(T, W * Hl, D), key_cache, value_cache, out_tok,
                     lse_local, workspace, stream=stream, **scales)
    else:
        out_all = torch.empty((W, T, Hl, Dv), dtype=f32, device=q.device)
        layer.attend(metadata, q_all, key_cache, value_cache, out_all, lse_local, workspace, stream=stream,
                     **scales)
    lse_all = torch.empty((W * W * Hl, T), dtype=f32, device=q.device)
    group.all_gather(lse_all, lse_local)
    if fused_heads:
        layer.correct(out_tok, lse_all.view(W, W * Hl, T), stream=stream)
        out_all = out_tok.view(T, W, Hl, Dv).transpose(0, 1).contiguous()
    else:
        layer.correct(out_all, lse_all.view(W, W * Hl, T), stream=stream)
    dst = out[:T]
    if dst.dtype == f32 and dst.is_contiguous():
        group.reduce_scatter(dst, out_all.view(W * T, Hl, Dv))
    else:
        summed = torch.empty((T, Hl, Dv), dtype=f32, device=q.device)
        group.reduce_scatter(summed, out_all.view(W * T, Hl, Dv))
        dst.copy_(summed)
    return out


def make_layer(spec: Any, group: DcpGroup) -> Any:
    """flashserve._C.DcpAttentionLayer of this rank for a flashserve._C.LayerSpec (H_local heads)."""
    return _C.DcpAttentionLayer(spec, world_size=group.world_size, rank=group.rank)
