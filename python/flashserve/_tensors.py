"""Tensor plumbing shared by the drop-ins: which library a tensor belongs to, allocation with
that library on the tensor's device, the current CUDA stream, the attention workspace
allocator, the schedule that scheduler metadata carries, and errors renamed to the caller's argument
names. Everything per call is a few attribute reads; what can be cached is."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from . import _C

try:
    import torch
except ImportError:  # CI installs numpy only
    torch = None

if torch is not None:
    _TorchTensor = torch.Tensor
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
else:
    _TorchTensor = ()
    _raw_stream = None


def is_torch(x: Any) -> bool:
    """Whether x is a torch tensor (False without torch)."""
    return isinstance(x, _TorchTensor)


def empty(shape: tuple, dtype: Any, like: Any) -> Any:
    """An uninitialized array of `shape`/`dtype` with like's library, on like's device."""
    if isinstance(like, _TorchTensor):
        return torch.empty(shape, dtype=dtype, device=like.device)
    return np.empty(shape, dtype=dtype)


def float32_of(like: Any) -> Any:
    """The float32 dtype of like's library."""
    return torch.float32 if isinstance(like, _TorchTensor) else np.float32


def int32_of(like: Any) -> Any:
    """The int32 dtype of like's library."""
    return torch.int32 if isinstance(like, _TorchTensor) else np.int32


def cuda_stream(x: Any) -> Optional[int]:
    """The current CUDA stream (as an int) of x's device, or None for host arrays."""
    if not isinstance(x, _TorchTensor) or not x.is_cuda:
        return None
    index = x.get_device()
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


_ALLOCATORS: dict = {}


def workspace_allocator(x: Any) -> Optional[Callable[[int], Any]]:
    """bytes -> uint8 tensor on x's CUDA device (the attention workspace); None on the host,
    where plans need no workspace. Called by the extension only when a plan needs one."""
    if not isinstance(x, _TorchTensor) or not x.is_cuda:
        return None
    device = x.device
    alloc = _ALLOCATORS.get(device)
    if alloc is None:
        def alloc(nbytes: int, device=device) -> Any:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        _ALLOCATORS[device] = alloc
    return alloc


PLAN_WORDS: int = _C.PLAN_WORDS  # int32 words of an encoded plan


def schedule(metadata: Any, num_splits: int) -> tuple:
    """(plan, num_splits) for the extension from a call's scheduler_metadata.

    Host metadata (numpy, CPU torch) goes to the extension as it is: it decodes the plan and
    rejects one made for another shape. A CUDA tensor's contents are never read (that would
    synchronize the stream, and cannot be done during CUDA graph capture), and no attribute or
    version counter of the tensor is used (inference tensors have none; an engine copies the
    metadata into a slice of its persistent buffer): the call plans its own shape with the
    call's num_splits, which is what get_scheduler_metadata computed for the same shape and
    num_splits (the planner is a pure function of them). Engines pass the same num_splits to
    both (vLLM's max_num_splits, SGLang's num_splits); a metadata made with a split bound and
    a call without one plans with the heuristic: the same result up to rounding."""
    if metadata is None or not isinstance(metadata, _TorchTensor) or not metadata.is_cuda:
        return metadata, num_splits
    if metadata.dim() != 1 or metadata.dtype != torch.int32 or int(metadata.shape[0]) < PLAN_WORDS:
        raise ValueError(f"scheduler_metadata: expected an int32 1-D tensor of >= {PLAN_WORDS} words from "
                         f"get_scheduler_metadata, got {metadata.dtype} {list(metadata.shape)}")
    return None, num_splits

def device_of(x: Any) -> tuple:
    """("cpu" | "cuda", index) of a tensor, an array, a torch.device, a string ("cuda:1"), a
    CUDA index, or None (the current CUDA device, or the CPU without one)."""
    if x is None:
        if torch is not None and torch.cuda.is_available():
            return "cuda", torch.cuda.current_device()
        return "cpu", 0
    if isinstance(x, int):
        return "cuda", x
    if isinstance(x, np.ndarray):
        return "cpu", 0
    device = x.device if is_torch(x) else x
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind is None:
        kind, _, number = str(device).partition(":")
        if number and not number.isdigit():
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
        index = int(number) if number else None
    if kind == "cuda" and index is None:
        index = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
    return kind, index or 0


def not_a_tensor(**named: Any) -> ValueError:
    """The error for the first of `named` that is not an array (the drop-ins read shapes
    before the extension sees the arguments)."""
    for name, x in named.items():
        if not hasattr(x, "shape"):
            return ValueError(f"{name}: expected a torch tensor or numpy array, got {type(x).__name__}")
    return ValueError("expected torch tensors or numpy arrays")


def renamed(error: Exception, names: dict) -> Exception:
    """error with its leading "<arg>:" renamed to the caller's argument name."""
    message = str(error)
    arg, sep, rest = message.partition(":")
    if sep and arg in names:
        return type(error)(names[arg] + ":" + rest)
    return error
