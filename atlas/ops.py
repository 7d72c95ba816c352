"""One function per op: validate the inputs, then run the CUDA kernel (inputs on a GPU and
`atlas._C` built) or the plain-torch reference (atlas/reference.py).

Every kernel path is also a torch custom op (namespace `atlas`, `torch.ops.atlas.*`) with a
fake implementation, so torch.compile and CUDA graphs see through it. Validation happens
here, before the custom op, and raises TypeError (wrong type/dtype) or ValueError (wrong
shape, device, layout, index range) naming the argument. Decode-path ops never sync the host.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atlas import reference
from atlas._ext import _C, use_kernel
from atlas._validate import check_tensor

# =============================================================================================
# quantize_nvfp4
# =============================================================================================


def quantize_nvfp4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize a weight to NVFP4 (DESIGN "Formats"); bit-exact between kernel and reference.

    Args:
        w: [N, K] bf16 | f16 | f32, K % 16 == 0, finite (not checked here: this op never syncs;
            `atlas.quantize_nvfp4` checks).
    Returns:
        packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16], global_scale float32 [].
    Raises:
        TypeError: w is not a float tensor. ValueError: w is not 2-D, or K % 16 != 0.
    Example:
        >>> packed, scale, gs = quantize_nvfp4(torch.randn(32, 64))
    """
    op = "quantize_nvfp4"
    check_tensor(op, "w", w, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                 what="[N, K] float")
    if w.shape[1] % 16 != 0:
        raise ValueError(f"{op}: w must have K % 16 == 0, got shape {list(w.shape)}")
    if use_kernel(w):
        w = w.contiguous()
        if w.data_ptr() % 16:  # the kernel reads 16-byte vectors
            w = w.clone()
        return torch.ops.atlas.quantize_nvfp4(w)
    return reference.quantize_nvfp4(w)


@torch.library.custom_op("atlas::quantize_nvfp4", mutates_args=())
def _quantize_nvfp4_kernel(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    n, k = w.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    block_scale = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device=w.device)
    global_scale = torch.empty((), dtype=torch.float32, device=w.device)
    amax = torch.empty(1, dtype=torch.float32, device=w.device)
    _C.quantize_nvfp4(w, packed, block_scale, global_scale, amax)
    return packed, block_scale, global_scale


@_quantize_nvfp4_kernel.register_fake
def _(w):
    n, k = w.shape
    return (w.new_empty(n, k // 2, dtype=torch.uint8), w.new_empty(n, k // 16, dtype=torch.float8_e4m3fn),
            w.new_empty((), dtype=torch.float32))


# =============================================================================================
# w4a16_gemv family (GEMV work: insert below)
# =============================================================================================


# =============================================================================================
# reshape_and_cache (paged KV work: insert below)
# =============================================================================================


# =============================================================================================
# paged_decode (paged KV work: insert below)
# =============================================================================================


# =============================================================================================
# small layer ops: rms_norm, rope, sigmoid gate, argmax, embedding, moe routing (insert below)
# =============================================================================================
