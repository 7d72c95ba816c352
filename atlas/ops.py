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

# ---- argmax / moe_route / embedding (MTP work) ---------------------------------------------

ARGMAX_CHUNK = 4096  # logits per CTA in the split pass; must equal atlas::kArgmaxChunk (csrc/argmax.h)


def argmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy token of each row and its top-1 softmax probability (the draft confidence).

    Args:
        logits: [R, V] bf16 | f32, last dim contiguous (a row stride ≥ V is allowed).
    Returns:
        ids int64 [R] (lowest index among the maxima), prob float32 [R] =
        1 / Σ_v exp(logits[r, v] − max_r). NaN logits never win; they make prob NaN.
    Raises:
        TypeError: logits not bf16/f32. ValueError: not 2-D, V == 0, inner dim not contiguous.
    Example:
        >>> ids, p = argmax(torch.tensor([[0.0, 2.0, 2.0]]))   # ids [1]: lowest index wins
    """
    op = "argmax"
    check_tensor(op, "logits", logits, dtypes=(torch.bfloat16, torch.float32), ndim=2,
                 what="bf16|f32 [R, V]")
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits must have V > 0, got shape {list(logits.shape)}")
    if logits.shape[0] > 0 and logits.stride(1) != 1:
        raise ValueError(f"{op}: logits must have a contiguous last dim, got strides {logits.stride()}")
    if use_kernel(logits):
        return torch.ops.atlas.argmax(logits)
    return reference.argmax(logits)


@torch.library.custom_op("atlas::argmax", mutates_args=())
def _argmax_kernel(logits: Tensor) -> tuple[Tensor, Tensor]:
    r, v = logits.shape
    ids = torch.empty(r, dtype=torch.int64, device=logits.device)
    prob = torch.empty(r, dtype=torch.float32, device=logits.device)
    splits = -(-v // ARGMAX_CHUNK)
    partials = torch.empty(3, r, splits, dtype=torch.float32, device=logits.device)
    if r > 0:
        _C.argmax(logits, ids, prob, partials)
    return ids, prob


@_argmax_kernel.register_fake
def _(logits):
    r = logits.shape[0]
    return logits.new_empty(r, dtype=torch.int64), logits.new_empty(r, dtype=torch.float32)


MOE_ROUTE_MAX_EXPERTS = 1024  # one warp per row, ≤ 32 logits per lane (csrc/moe_route.h)
MOE_ROUTE_MAX_TOP_K = 32


def moe_route(logits: Tensor, top_k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """MoE routing on the device (no host sync): softmax over all E experts in float32, top-k
    by logit with the lowest expert index winning ties, renormalized when `renormalize`.

    Args:
        logits: [T, E] bf16 | f32 router logits (x · W_gate^T), E ≤ 1024, contiguous.
        top_k: experts per row, 1 ≤ top_k ≤ min(E, 32).
        renormalize: divide the k weights by their sum (Qwen3 `norm_topk_prob`); default True.
    Returns:
        ids int32 [T, k] (slot j = j-th best expert), weights float32 [T, k].
    Raises:
        TypeError: wrong dtype or top_k not an int. ValueError: wrong rank, E, top_k.
    Example:
        >>> ids, w = moe_route(torch.randn(3, 8), 2)
    """
    op = "moe_route"
    check_tensor(op, "logits", logits, dtypes=(torch.bfloat16, torch.float32), ndim=2,
                 what="bf16|f32 [T, E]")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"{op}: top_k must be an int, got {type(top_k).__name__}")
    e = logits.shape[1]
    if not 1 <= e <= MOE_ROUTE_MAX_EXPERTS:
        raise ValueError(f"{op}: logits must have 1 ≤ E ≤ {MOE_ROUTE_MAX_EXPERTS} experts, got E = {e}")
    if not 1 <= top_k <= min(e, MOE_ROUTE_MAX_TOP_K):
        raise ValueError(f"{op}: top_k must be in [1, {min(e, MOE_ROUTE_MAX_TOP_K)}] for E = {e}, got {top_k}")
    if use_kernel(logits):
        return torch.ops.atlas.moe_route(logits.contiguous(), top_k, bool(renormalize))
    return reference.moe_route(logits, top_k, bool(renormalize))


@torch.library.custom_op("atlas::moe_route", mutates_args=())
def _moe_route_kernel(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    t = logits.shape[0]
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t > 0:
        _C.moe_route(logits, ids, weights, renormalize)
    return ids, weights


@_moe_route_kernel.register_fake
def _(logits, top_k, renormalize):
    t = logits.shape[0]
    return (logits.new_empty(t, top_k, dtype=torch.int32), logits.new_empty(t, top_k, dtype=torch.float32))


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    """Rows of an embedding table picked by device ids (the drafted token's embedding, no sync).

    Args:
        table: [V, h] bf16, contiguous (the target's embed_tokens, shared, never copied).
        ids: int32 | int64 [T], each in [0, V). Checked on CPU; on the GPU an id outside
            [0, V) yields a zero row instead of a read out of range (checking would sync).
    Returns:
        [T, h] bf16, exact copies of the rows.
    Example:
        >>> embedding(torch.randn(10, 4).bfloat16(), torch.tensor([3, 3, 0])).shape
        torch.Size([3, 4])
    """
    op = "embedding"
    check_tensor(op, "table", table, dtype=torch.bfloat16, ndim=2, contiguous=True, what="bf16 [V, h]")
    check_tensor(op, "ids", ids, dtypes=(torch.int32, torch.int64), ndim=1, device=table.device,
                 what="int32|int64 [T]")
    if not ids.is_cuda and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.shape[0]:
            raise ValueError(f"{op}: ids must be in [0, {table.shape[0]}), got values in [{lo}, {hi}]")
    if use_kernel(table, ids):
        return torch.ops.atlas.embedding(table, ids.contiguous())
    return reference.embedding(table, ids)


@torch.library.custom_op("atlas::embedding", mutates_args=())
def _embedding_kernel(table: Tensor, ids: Tensor) -> Tensor:
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    if ids.shape[0] > 0:
        _C.embedding(table, ids, out)
    return out


@_embedding_kernel.register_fake
def _(table, ids):
    return table.new_empty(ids.shape[0], table.shape[1])
