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


def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None) -> None:
    """Write this step's K/V rows into the paged KV cache, in place (DESIGN "Paged KV cache").

    Token t goes to slot s = slot_mapping[t] = block · bs + offset, i.e. k_cache[s // bs, s % bs];
    tokens with s < 0 (padding) are skipped. BF16 cache: an exact copy. FP8 cache: each
    (token, kv head) row x is stored as e4m3_rne_satfinite(x / scale) with
    scale = amax(|x|) / 448 (1.0 for an all-zero row) written to k_scale / v_scale beside it,
    so no calibration is needed and any finite magnitude keeps E4M3's ~2^-4 relative precision.
    Kernel and reference agree bit for bit. No host sync on CUDA; CUDA-graph capturable.

    Args:
        key: [T, nkv, hd] bf16, hd % 8 == 0, 8 ≤ hd ≤ 1024. Rows may be strided (a view into a
            fused qkv buffer): the two inner dims contiguous, row stride ≥ nkv·hd and a multiple
            of 8 elements, storage offset a multiple of 8 elements (16-byte aligned rows).
        value: [T, nkv, hd] bf16, same rules as key (its own row stride).
        k_cache: [num_blocks, bs, nkv, hd] bf16 | float8_e4m3fn, contiguous; any bs (16, 528...).
        v_cache: like k_cache (same shape and dtype).
        slot_mapping: int64 [T], distinct slots < num_blocks · bs, or negative to skip. On CPU a
            slot ≥ num_blocks · bs raises; on CUDA checking would sync, so the kernel skips it.
        k_scale, v_scale: float32 [num_blocks, bs, nkv], contiguous: required (written) for an
            FP8 cache, must be None for a BF16 cache.
    Returns:
        None; k_cache, v_cache (and k_scale, v_scale) are updated at the named slots only.
    Raises:
        TypeError: a wrong dtype. ValueError: wrong shapes, strides, alignment, devices, a
            missing or unexpected scale, or (CPU) a slot ≥ num_blocks · bs.
    Example:
        >>> key = torch.randn(3, 2, 64).bfloat16(); value = torch.randn(3, 2, 64).bfloat16()
        >>> kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16); vc = torch.zeros_like(kc)
        >>> reshape_and_cache(key, value, kc, vc, torch.tensor([17, -1, 40]))
        >>> torch.equal(kc[1, 1], key[0])
        True
    """
    op = "reshape_and_cache"
    check_tensor(op, "key", key, dtype=torch.bfloat16, ndim=3, what="[T, nkv, hd]")
    t, nkv, hd = key.shape
    if hd % 8 != 0 or not 8 <= hd <= 1024:
        raise ValueError(f"{op}: key must have head_dim hd % 8 == 0 and 8 ≤ hd ≤ 1024, "
                         f"got shape {list(key.shape)}")
    check_tensor(op, "value", value, dtype=torch.bfloat16, shape=(t, nkv, hd), device=key.device,
                 what="[T, nkv, hd] like key")
    for name, rows in (("key", key), ("value", value)):
        _check_kv_rows(op, name, rows)
    check_tensor(op, "k_cache", k_cache, dtypes=(torch.bfloat16, torch.float8_e4m3fn), ndim=4,
                 device=key.device, what="[num_blocks, bs, nkv, hd]")
    num_blocks, bs = k_cache.shape[:2]
    check_tensor(op, "k_cache", k_cache, shape=(None, None, nkv, hd), contiguous=True,
                 what=f"[num_blocks, bs, nkv={nkv}, hd={hd}] (nkv, hd of key)")
    check_tensor(op, "v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape),
                 device=key.device, contiguous=True, what="like k_cache")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.storage_offset() * cache.element_size()) % 16 != 0:
            raise ValueError(f"{op}: {name} must start 16-byte aligned, got storage offset "
                             f"{cache.storage_offset()}")
    check_tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, shape=(t,), device=key.device,
                 what="[T]")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            if scale is not None:
                raise ValueError(f"{op}: {name} must be None for a bf16 cache, got a tensor")
            continue
        if scale is None:
            raise ValueError(f"{op}: {name} float32 [num_blocks, bs, nkv] is required for a "
                             f"float8_e4m3fn cache, got None")
        check_tensor(op, name, scale, dtype=torch.float32, shape=(num_blocks, bs, nkv),
                     device=key.device, contiguous=True, what="[num_blocks, bs, nkv]")
    if not slot_mapping.is_cuda and t > 0:  # a CUDA tensor would need a sync: the kernel skips
        top = int(slot_mapping.max())
        if top >= num_blocks * bs:
            raise ValueError(f"{op}: slot_mapping must hold slots < num_blocks·bs = "
                             f"{num_blocks}·{bs} = {num_blocks * bs}, got {top}")
    if use_kernel(key, value, k_cache, v_cache, slot_mapping):
        torch.ops.atlas.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _check_kv_rows(op: str, name: str, x: Tensor) -> None:
    """[T, nkv, hd] bf16 rows the kernel reads with 16-byte loads: inner dims contiguous, rows
    ≥ nkv·hd apart (no overlap) and 16-byte aligned. Strides of size-1 dims do not matter."""
    t, nkv, hd = x.shape
    if x.stride(2) != 1 or (nkv > 1 and x.stride(1) != hd):
        raise ValueError(f"{op}: {name} must have contiguous [nkv, hd] rows (strides (*, {hd}, 1)), "
                         f"got strides {x.stride()}")
    if t > 1 and (x.stride(0) < nkv * hd or x.stride(0) % 8 != 0):
        raise ValueError(f"{op}: {name} must have a row stride ≥ nkv·hd = {nkv * hd} and a multiple "
                         f"of 8 elements, got strides {x.stride()}")
    if x.storage_offset() % 8 != 0:
        raise ValueError(f"{op}: {name} must start 16-byte aligned (storage offset a multiple of 8 "
                         f"elements), got storage offset {x.storage_offset()}")


@torch.library.custom_op("atlas::reshape_and_cache",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _reshape_and_cache_kernel(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                              slot_mapping: Tensor, k_scale: Optional[Tensor],
                              v_scale: Optional[Tensor]) -> None:
    _C.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_reshape_and_cache_kernel.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return None


# =============================================================================================
# paged_decode (paged KV work: insert below)
# =============================================================================================


# =============================================================================================
# small layer ops: rms_norm, rope, sigmoid gate, argmax, embedding, moe routing (insert below)
# =============================================================================================

# ---- argmax / moe_route / embedding (MTP work) ---------------------------------------------

ARGMAX_CHUNK = 4096  # logits per CTA in the split pass; must equal atlas::kArgmaxChunk (csrc/argmax.h)
MAX_GRID_ROWS = 65535  # argmax rows / embedding ids: one CUDA grid.y index each


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
    if logits.shape[0] > MAX_GRID_ROWS:
        raise ValueError(f"{op}: logits must have R ≤ {MAX_GRID_ROWS} rows, got {logits.shape[0]}")
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
    if ids.shape[0] > MAX_GRID_ROWS:
        raise ValueError(f"{op}: ids must have T ≤ {MAX_GRID_ROWS} entries, got {ids.shape[0]}")
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
