"""Tensor plumbing shared by the drop-ins: which library a tensor belongs to, allocation with
that library on the tensor's device, the current CUDA stream, the attention workspace
allocator, host copies of scheduler metadata, and errors renamed to the caller's argument
names. Everything per call is a few attribute reads; what can be cached is."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

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


def host_plan(metadata: Any) -> Any:
    """Scheduler metadata the extension can read: host arrays as given; a CUDA tensor through
    the host copy made when it was created (get_scheduler_metadata) or at its first use since
    its last write. During CUDA graph capture a copy cannot be made (it would synchronize):
    None is returned and the call plans from its own shape and num_splits, which is what
    get_scheduler_metadata computed for the same shape (engines pass both the same values)."""
    if metadata is None or not isinstance(metadata, _TorchTensor) or not metadata.is_cuda:
        return metadata
    cached = getattr(metadata, "_flashserve_plan", None)
    if cached is not None and cached[0] == metadata._version:
        return cached[1]
    if torch.cuda.is_current_stream_capturing():
        return None
    words = metadata.cpu()
    attach_plan(metadata, words)
    return words


def attach_plan(metadata: Any, words: Any) -> None:
    """Remembers the host copy of a CUDA metadata tensor, valid until the tensor is written."""
    metadata._flashserve_plan = (metadata._version, words)


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
