"""Loading of the compiled extension `atlas._C` (optional: without it every op runs its reference)."""
from __future__ import annotations

import torch

try:  # built by setup.py when nvcc and a CUDA build of torch were present
    from atlas import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - depends on the build
    _C = None
    _IMPORT_ERROR = e


def extension_built() -> bool:
    """True when `atlas._C` imported (it imports without a GPU)."""
    return _C is not None


def kernels_available() -> bool:
    """True when the extension is built and a CUDA device is present: ops on CUDA tensors then
    run our kernels; otherwise every op runs its plain-torch reference."""
    return _C is not None and torch.cuda.is_available()


def use_kernel(*tensors: torch.Tensor) -> bool:
    """True when the inputs live on a CUDA device and the kernels can serve them."""
    return _C is not None and all(t.is_cuda for t in tensors)
