"""Argument checks shared by ops and layers. Messages name the op and the argument:
`paged_decode: block_tables must be int32 [B, max_blocks], got int64 [4, 9]`."""
from __future__ import annotations

from typing import Sequence

import torch


def describe(t: torch.Tensor) -> str:
    dt = str(t.dtype).replace("torch.", "")
    return f"{dt} {list(t.shape)} on {t.device}"


def check_tensor(op: str, name: str, t, *, dtype=None, dtypes: Sequence[torch.dtype] | None = None,
                 ndim: int | Sequence[int] | None = None, shape: Sequence[int | None] | None = None,
                 device: torch.device | None = None, contiguous: bool = False,
                 what: str = "") -> None:
    """Raise TypeError for a non-tensor or wrong dtype, ValueError for wrong rank/shape/device/layout.

    shape entries of None match any size. `what` is the expected form for the message
    (e.g. "bf16 [M, K]")."""
    expect = f" {what}" if what else ""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor{expect}, got {type(t).__name__}")
    allowed = [dtype] if dtype is not None else list(dtypes or [])
    if allowed and t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: {name} must be {names}{expect}, got {describe(t)}")
    if ndim is not None:
        ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ndims:
            raise ValueError(f"{op}: {name} must be{expect or f' {ndims}-D'}, got {describe(t)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{op}: {name} must have shape {want}{expect}, got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} must be on {device} like the other inputs, got {describe(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous{expect}, got strides {t.stride()}")


def check_same_device(op: str, **tensors: torch.Tensor) -> torch.device:
    """All named tensors on one device; returns it."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{op}: {k} is on {v.device} but {items[0][0]} is on {dev}")
    return dev
