"""Which function a drop-in calls: the torch custom op (flashserve._ops) while torch.compile
traces, so the graph holds an opaque, correctly aliased op; else the same call directly
(flashserve._calls), without the dispatcher's per-call cost."""

from __future__ import annotations

from typing import Callable

from . import _calls
from ._tensors import torch

if torch is not None:
    from . import _ops
    _compiling = torch.compiler.is_compiling
else:
    _ops = None

    def _compiling() -> bool:
        return False


def call(name: str) -> Callable:
    """The function `name` of flashserve._calls, or its torch op while torch.compile traces."""
    return getattr(_ops if _compiling() else _calls, name)
