"""One function per op: validate the inputs, then run the CUDA kernel (inputs on a GPU and
`atlas._C` built) or the plain-torch reference (atlas/reference.py).

Every kernel path is also a torch custom op (namespace `atlas`, `torch.ops.atlas.*`) with a
fake implementation, so torch.compile and CUDA graphs see through it. Validation happens
here, before the custom op, and raises TypeError (wrong type/dtype) or ValueError (wrong
shape, device, layout, index range) naming the argument. Decode-path ops never sync the host.
"""
from __future__ import annotations

import math
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

GEMV_MAX_M = 32  # w4a16_gemv serves 1..32 rows of x (four mma n8 tiles); more rows take a GEMM


def _check_gemv_weight(op: str, name: str, q) -> tuple[int, int]:
    from atlas.nvfp4 import NVFP4Weight  # atlas.nvfp4 imports this module
    if not isinstance(q, NVFP4Weight):
        raise TypeError(f"{op}: {name} must be an atlas.NVFP4Weight, got {type(q).__name__}")
    return q.shape


def _check_gemv_x(op: str, name: str, x, k: int, device) -> int:
    """x bf16 [M, K] with 1 ≤ M ≤ 32, K % 16 == 0 and K equal to the weight's; returns M."""
    check_tensor(op, name, x, dtype=torch.bfloat16, ndim=2, what="bf16 [M, K]")
    m, kx = x.shape
    if kx % 16 != 0:
        raise ValueError(f"{op}: {name} must have K % 16 == 0, got shape {list(x.shape)}")
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"{op}: {name} must have 1 ≤ M ≤ {GEMV_MAX_M} rows, got shape {list(x.shape)}")
    if kx != k:
        raise ValueError(f"{op}: {name} must have K = {k} columns like the weight, got shape {list(x.shape)}")
    check_tensor(op, name, x, device=device)
    return m


def _gemv_ready(t: Tensor) -> Tensor:
    """A contiguous tensor whose data starts 16-byte aligned (a fresh copy otherwise)."""
    if t.is_contiguous() and (t.storage_offset() * t.element_size()) % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def w4a16_gemv(x: Tensor, q, *, out_dtype: torch.dtype = torch.bfloat16, n_rows: Optional[int] = None,
               out: Optional[Tensor] = None) -> Tensor:
    """y = x · Wᵀ for an NVFP4 weight W: the decode / verify GEMV (the weight is read once for
    all M rows; each row's result is bitwise the same whatever M it runs in).

    Args:
        x: [M, K] bf16, 1 ≤ M ≤ 32, K % 16 == 0 (a non-contiguous or misaligned x is copied).
        q: atlas.NVFP4Weight [N, K] (checkpoint layout, never padded; any N, odd included).
        out_dtype: bf16 (default) or torch.float32 (e.g. logits for sampling).
        n_rows: compute only the first n_rows weight rows (1 ≤ n_rows ≤ N; a truncated-vocab LM
            head, no copy). None means N.
        out: optional [M, n_rows] buffer of out_dtype, contiguous, on x's device, written in place.
    Returns:
        y [M, n_rows] of out_dtype (`out` when given): float32 accumulation, one rounding.
    Raises:
        TypeError: x not bf16, q not an NVFP4Weight, out_dtype/out dtype not bf16|float32.
        ValueError: x not [M, K] with 1 ≤ M ≤ 32 and K % 16 == 0 and K equal to q's, devices
            differ, n_rows out of range, out of the wrong shape / layout.
    Example:
        >>> q = atlas.quantize_nvfp4(torch.randn(48, 64))
        >>> w4a16_gemv(torch.randn(3, 64).bfloat16(), q).shape
        torch.Size([3, 48])
    """
    op = "w4a16_gemv"
    n, k = _check_gemv_weight(op, "q", q)
    m = _check_gemv_x(op, "x", x, k, q.device)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if n_rows is None:
        n_rows = n
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or not 1 <= n_rows <= n:
        raise ValueError(f"{op}: n_rows must be an int in [1, {n}] (rows of q), got {n_rows!r}")
    if out is not None:
        check_tensor(op, "out", out, dtype=out_dtype, shape=(m, n_rows), device=x.device, contiguous=True,
                     what=f"{str(out_dtype).replace('torch.', '')} [M, n_rows] = [{m}, {n_rows}]")
    if use_kernel(x, q.packed):
        if out is None:
            return torch.ops.atlas.w4a16_gemv(x, *q.gemv_operands(), q.global_scale, out_dtype, n_rows, 0)
        torch.ops.atlas.w4a16_gemv_out(x, *q.gemv_operands(), q.global_scale, out)
        return out
    y = reference.w4a16_gemv(x, q.packed[:n_rows], q.block_scale[:n_rows], q.global_scale, out_dtype)
    return y if out is None else out.copy_(y)


def w4a16_gemv_qg(x: Tensor, q, num_heads: int, head_dim: int) -> Tensor:
    """Gated-attention q_proj: y = x · Wᵀ with the per-head [q | gate] rows de-interleaved on the
    store (no extra pass).

    Args:
        x: [M, K] bf16, 1 ≤ M ≤ 32, K % 16 == 0.
        q: NVFP4Weight [N, K], N = 2·num_heads·head_dim, rows per head [q (hd) | gate (hd)]
            (the HF checkpoint order of Qwen3-Next / 3.5 / 3.6 q_proj).
        num_heads, head_dim: nq and hd.
    Returns:
        [M, 2·nq·hd] bf16 = [Q of all heads (nq·hd) | G of all heads (nq·hd)], each head's block
        contiguous (head h of Q at columns h·hd .. h·hd + hd).
    Raises:
        TypeError / ValueError as w4a16_gemv; ValueError if N != 2·num_heads·head_dim.
    Example:
        >>> q = atlas.quantize_nvfp4(torch.randn(2 * 2 * 16, 64))
        >>> w4a16_gemv_qg(torch.randn(1, 64).bfloat16(), q, 2, 16).shape
        torch.Size([1, 64])
    """
    op = "w4a16_gemv_qg"
    n, k = _check_gemv_weight(op, "q", q)
    _check_gemv_x(op, "x", x, k, q.device)
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
    if n != 2 * num_heads * head_dim:
        raise ValueError(f"{op}: q must have N = 2·num_heads·head_dim = {2 * num_heads * head_dim} rows, "
                         f"got N = {n}")
    if use_kernel(x, q.packed):
        return torch.ops.atlas.w4a16_gemv(x, *q.gemv_operands(), q.global_scale, torch.bfloat16, n,
                                          head_dim)
    y = reference.w4a16_gemv(x, q.packed, q.block_scale, q.global_scale, torch.bfloat16)
    return reference.qg_deinterleave(y, num_heads, head_dim)


def w4a16_gemv_dual(x: Tensor, q1, q2, *, qg_head_dim: int = 0) -> tuple[Tensor, Tensor]:
    """Two weights sharing one input in one launch (k_proj and v_proj; gate and up; a gated
    q_proj and [k_proj; v_proj]): each output is bitwise equal to its own w4a16_gemv(x, q_i)
    (y1 to w4a16_gemv_qg(x, q1, N1 / 2hd, hd) when qg_head_dim = hd > 0). One launch when both
    weights are in the same layout (both prepare_gemv'd, as the layers hold them, or neither);
    two otherwise.

    Args:
        x: [M, K] bf16, 1 ≤ M ≤ 32, K % 16 == 0.
        q1, q2: NVFP4Weight [N1, K] and [N2, K] (N may differ; each has its own global scale).
        qg_head_dim: 0 (default): y1 = x · W1ᵀ. hd > 0: q1 is a gated q_proj whose rows are per
            head [q (hd) | gate (hd)] (N1 a multiple of 2·hd), and y1 is de-interleaved on the
            store to [Q of all heads | G of all heads] as in w4a16_gemv_qg.
    Returns:
        (y1 [M, N1], y2 [M, N2]) bf16.
    Raises:
        TypeError / ValueError as w4a16_gemv (naming q1 / q2); ValueError for a qg_head_dim that
        is negative, not an int, or does not divide N1 into heads of 2·hd rows.
    Example:
        >>> q1, q2 = atlas.quantize_nvfp4(torch.randn(16, 64)), atlas.quantize_nvfp4(torch.randn(32, 64))
        >>> [t.shape[1] for t in w4a16_gemv_dual(torch.randn(2, 64).bfloat16(), q1, q2)]
        [16, 32]
        >>> y1, _ = w4a16_gemv_dual(torch.randn(2, 64).bfloat16(), q1, q2, qg_head_dim=4)  # 2 heads
    """
    op = "w4a16_gemv_dual"
    n1, k = _check_gemv_weight(op, "q1", q1)
    n2, k2 = _check_gemv_weight(op, "q2", q2)
    if k2 != k:
        raise ValueError(f"{op}: q2 must have K = {k} columns like q1, got shape [{n2}, {k2}]")
    if q2.device != q1.device:
        raise ValueError(f"{op}: q2 is on {q2.device} but q1 is on {q1.device}")
    _check_gemv_x(op, "x", x, k, q1.device)
    if isinstance(qg_head_dim, bool) or not isinstance(qg_head_dim, int) or qg_head_dim < 0:
        raise ValueError(f"{op}: qg_head_dim must be an int ≥ 0, got {qg_head_dim!r}")
    if qg_head_dim and n1 % (2 * qg_head_dim) != 0:
        raise ValueError(f"{op}: q1 must have N1 a multiple of 2·qg_head_dim = {2 * qg_head_dim} rows "
                         f"(per head [q | gate]), got N1 = {n1}")
    if use_kernel(x, q1.packed, q2.packed):
        p1, p2 = q1.gemv_operands(), q2.gemv_operands()
        if p1[0].dim() != p2[0].dim():   # one tiled (prepare_gemv), one not: a launch reads one layout
            y1 = w4a16_gemv_qg(x, q1, n1 // (2 * qg_head_dim), qg_head_dim) if qg_head_dim else w4a16_gemv(x, q1)
            return y1, w4a16_gemv(x, q2)
        return torch.ops.atlas.w4a16_gemv_dual(x, *p1, q1.global_scale, *p2, q2.global_scale, qg_head_dim)
    y1 = reference.w4a16_gemv(x, q1.packed, q1.block_scale, q1.global_scale)
    if qg_head_dim:
        y1 = reference.qg_deinterleave(y1, n1 // (2 * qg_head_dim), qg_head_dim)
    return y1, reference.w4a16_gemv(x, q2.packed, q2.block_scale, q2.global_scale)


def w4a16_gemv_silu(gate: Tensor, up: Tensor, q) -> Tensor:
    """Down projection with the SwiGLU activation computed as it is loaded:
    y = bf16(silu(gate) · up) · Wᵀ, bitwise equal to w4a16_gemv(reference.silu_mul(gate, up), q).

    Rounding: silu(g) = g / (1 + exp(−g)) and the product with up in float32 (IEEE division,
    accurate exp), rounded once to bf16 before the dot product, exactly like the unfused
    composition (reference.silu_mul). No other rounding differs from w4a16_gemv.
    Args:
        gate, up: [M, K] bf16 each (same shape), 1 ≤ M ≤ 32, K % 16 == 0.
        q: NVFP4Weight [N, K].
    Returns:
        [M, N] bf16.
    Raises:
        TypeError / ValueError as w4a16_gemv (naming gate / up).
    Example:
        >>> q = atlas.quantize_nvfp4(torch.randn(8, 32))
        >>> g, u = torch.randn(2, 32).bfloat16(), torch.randn(2, 32).bfloat16()
        >>> w4a16_gemv_silu(g, u, q).shape
        torch.Size([2, 8])
    """
    _check_gemv_pair("w4a16_gemv_silu", ("gate", gate), ("up", up), q)
    if use_kernel(gate, up, q.packed):
        return torch.ops.atlas.w4a16_gemv_silu(gate, up, *q.gemv_operands(), q.global_scale)
    return reference.w4a16_gemv(reference.silu_mul(gate, up), q.packed, q.block_scale, q.global_scale)


def w4a16_gemv_gated(x: Tensor, gate: Tensor, q) -> Tensor:
    """o_proj of a gated attention layer with the output gate computed as it is loaded:
    y = bf16(x · sigmoid(gate)) · Wᵀ, bitwise equal to the unfused composition
    w4a16_gemv(sigmoid_gate_mul(x, gate), q) (one launch instead of two).

    Rounding: x · (1 / (1 + exp(−gate))) in float32 (the sigmoid_gate_mul kernel's expression:
    accurate exp, IEEE reciprocal, then the product), rounded once to bf16 before the dot
    product. On the CPU the reference composition (reference.sigmoid_gate_mul, torch.sigmoid).
    Args:
        x: [M, K] bf16, 1 ≤ M ≤ 32, K % 16 == 0: the attention output, heads concatenated
            (a non-contiguous or misaligned x is copied).
        gate: [M, K] bf16, the gate half of the q_proj output. Rows may be strided (e.g.
            y[:, nq·hd:] of a [M, Q | G] buffer: row stride 2K, read in place); a gate whose
            last dim is not contiguous, whose row stride is not a multiple of 8 elements or
            whose start is not 16-byte aligned is copied.
        q: NVFP4Weight [N, K] (o_proj).
    Returns:
        [M, N] bf16.
    Raises:
        TypeError / ValueError as w4a16_gemv (naming x / gate); ValueError if gate's shape
        differs from x's.
    Example:
        >>> q = atlas.quantize_nvfp4(torch.randn(8, 32))
        >>> x, g = torch.randn(2, 32).bfloat16(), torch.randn(2, 32).bfloat16()
        >>> w4a16_gemv_gated(x, g, q).shape
        torch.Size([2, 8])
    """
    _check_gemv_pair("w4a16_gemv_gated", ("x", x), ("gate", gate), q)
    if use_kernel(x, gate, q.packed):
        return torch.ops.atlas.w4a16_gemv_gated(x, gate, *q.gemv_operands(), q.global_scale)
    return reference.w4a16_gemv(reference.sigmoid_gate_mul(x, gate), q.packed, q.block_scale, q.global_scale)


def _check_gemv_pair(op: str, first: tuple[str, Tensor], second: tuple[str, Tensor], q) -> None:
    """The two activation operands of a fused-input GEMV (silu's gate / up, gated's x / gate):
    each a valid [M, K] GEMV input for q, the second with the first's row count."""
    (name1, a), (name2, b) = first, second
    _, k = _check_gemv_weight(op, "q", q)
    m = _check_gemv_x(op, name1, a, k, q.device)
    _check_gemv_x(op, name2, b, k, q.device)
    if b.shape[0] != m:
        raise ValueError(f"{op}: {name2} must have the shape of {name1} {list(a.shape)}, got {list(b.shape)}")


def _gemv_weight_ready(packed: Tensor) -> Tensor:
    # NVFP4Weight rows start 8-byte aligned (K/2 is a multiple of 8); anything else is copied.
    return packed if packed.storage_offset() % 8 == 0 else packed.clone()


@torch.library.custom_op("atlas::w4a16_gemv", mutates_args=())
def _w4a16_gemv_kernel(x: Tensor, packed: Tensor, block_scale: Tensor, global_scale: Tensor,
                       out_dtype: torch.dtype, n_rows: int, qg_head_dim: int) -> Tensor:
    out = torch.empty(x.shape[0], n_rows, dtype=out_dtype, device=x.device)
    _C.w4a16_gemv(_gemv_ready(x), None, _gemv_weight_ready(packed), block_scale, global_scale, out,
                  n_rows, qg_head_dim)
    return out


@_w4a16_gemv_kernel.register_fake
def _(x, packed, block_scale, global_scale, out_dtype, n_rows, qg_head_dim):
    return x.new_empty(x.shape[0], n_rows, dtype=out_dtype)


@torch.library.custom_op("atlas::w4a16_gemv_out", mutates_args=("out",))
def _w4a16_gemv_out_kernel(x: Tensor, packed: Tensor, block_scale: Tensor, global_scale: Tensor,
                           out: Tensor) -> None:
    _C.w4a16_gemv(_gemv_ready(x), None, _gemv_weight_ready(packed), block_scale, global_scale, out,
                  out.shape[1], 0)


@_w4a16_gemv_out_kernel.register_fake
def _(x, packed, block_scale, global_scale, out):
    return None


@torch.library.custom_op("atlas::w4a16_gemv_dual", mutates_args=())
def _w4a16_gemv_dual_kernel(x: Tensor, packed1: Tensor, block_scale1: Tensor, global_scale1: Tensor,
                            packed2: Tensor, block_scale2: Tensor, global_scale2: Tensor,
                            qg_head_dim1: int) -> tuple[Tensor, Tensor]:
    m = x.shape[0]
    y1 = torch.empty(m, packed1.shape[0], dtype=torch.bfloat16, device=x.device)
    y2 = torch.empty(m, packed2.shape[0], dtype=torch.bfloat16, device=x.device)
    _C.w4a16_gemv_dual(_gemv_ready(x), _gemv_weight_ready(packed1), block_scale1, global_scale1, y1,
                       _gemv_weight_ready(packed2), block_scale2, global_scale2, y2, qg_head_dim1)
    return y1, y2


@_w4a16_gemv_dual_kernel.register_fake
def _(x, packed1, block_scale1, global_scale1, packed2, block_scale2, global_scale2, qg_head_dim1):
    m = x.shape[0]
    return x.new_empty(m, packed1.shape[0]), x.new_empty(m, packed2.shape[0])


@torch.library.custom_op("atlas::w4a16_gemv_silu", mutates_args=())
def _w4a16_gemv_silu_kernel(gate: Tensor, up: Tensor, packed: Tensor, block_scale: Tensor,
                            global_scale: Tensor) -> Tensor:
    out = torch.empty(gate.shape[0], packed.shape[0], dtype=torch.bfloat16, device=gate.device)
    _C.w4a16_gemv(_gemv_ready(gate), _gemv_ready(up), _gemv_weight_ready(packed), block_scale,
                  global_scale, out, packed.shape[0], 0)
    return out


@_w4a16_gemv_silu_kernel.register_fake
def _(gate, up, packed, block_scale, global_scale):
    return gate.new_empty(gate.shape[0], packed.shape[0])


def _gate_ready(gate: Tensor) -> Tensor:
    """A gate the kernel reads in place: contiguous rows, row stride ≥ K and a multiple of 8
    elements (16 bytes), 16-byte aligned start; any other layout is copied."""
    m, k = gate.shape
    rows_ok = gate.stride(1) == 1 and (m == 1 or (gate.stride(0) >= k and gate.stride(0) % 8 == 0))
    if rows_ok and (gate.storage_offset() * gate.element_size()) % 16 == 0:
        return gate
    return gate.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("atlas::w4a16_gemv_gated", mutates_args=())
def _w4a16_gemv_gated_kernel(x: Tensor, gate: Tensor, packed: Tensor, block_scale: Tensor,
                             global_scale: Tensor) -> Tensor:
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.bfloat16, device=x.device)
    _C.w4a16_gemv_gated(_gemv_ready(x), _gate_ready(gate), _gemv_weight_ready(packed), block_scale,
                        global_scale, out)
    return out


@_w4a16_gemv_gated_kernel.register_fake
def _(x, gate, packed, block_scale, global_scale):
    return x.new_empty(x.shape[0], packed.shape[0])



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
    fp8 = _check_kv_scales(op, k_cache, k_scale, v_scale, nkv, key.device)
    if not slot_mapping.is_cuda and t > 0:  # a CUDA tensor would need a sync: the kernel skips
        top = int(slot_mapping.max())
        if top >= num_blocks * bs:
            raise ValueError(f"{op}: slot_mapping must hold slots < num_blocks·bs = "
                             f"{num_blocks}·{bs} = {num_blocks * bs}, got {top}")
    if use_kernel(key, value, k_cache, v_cache, slot_mapping):
        torch.ops.atlas.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _check_kv_scales(op: str, k_cache: Tensor, k_scale, v_scale, nkv: int, device) -> bool:
    """FP8 caches need k_scale / v_scale float32 [num_blocks, bs, nkv] (one scale per (token,
    kv head)); BF16 caches take none. Returns whether the cache is FP8."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    num_blocks, bs = k_cache.shape[:2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8:
            if scale is not None:
                raise ValueError(f"{op}: {name} must be None for a bf16 cache, got a tensor")
            continue
        if scale is None:
            raise ValueError(f"{op}: {name} float32 [num_blocks, bs, nkv] is required for a "
                             f"float8_e4m3fn cache, got None")
        check_tensor(op, name, scale, dtype=torch.float32, shape=(num_blocks, bs, nkv), device=device,
                     contiguous=True, what="float32 [num_blocks, bs, nkv]")
    return fp8


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

# ---- paged_decode: decode / verify attention over the paged KV cache ------------------------

PAGED_DECODE_HEAD_DIMS = (64, 128, 256)   # kernel instances (csrc/paged_decode.cu); CPU: the same
PAGED_DECODE_MAX_Q_LEN = 8                # verify groups of up to 8 rows (kPagedDecodeMaxQLen)
# Split-K rule, mirrored from csrc/paged_decode.h (paged_decode_split_cap / _max_splits): only
# the workspace size depends on it here; the binding checks the size against the C++ rule.
_PAGED_DECODE_MIN_SPLIT_LEN = 256
_PAGED_DECODE_SHORT_SPLIT_LEN = 128
_PAGED_DECODE_SHORT_SPLITS = 16
_PAGED_DECODE_MAX_SPLITS = 128
_PAGED_DECODE_TARGET_CTAS = 256


def paged_decode_max_splits(capacity: int, num_kv_heads: int) -> int:
    """Split slots the workspace needs for sequences of ≤ capacity = max_blocks · bs tokens:
    max(ceil(capacity / 256), min(ceil(capacity / 128), 16)) capped at clamp(256 // nkv, 16, 128)."""
    cap = max(16, min(_PAGED_DECODE_MAX_SPLITS, _PAGED_DECODE_TARGET_CTAS // max(num_kv_heads, 1)))
    n = max(-(-capacity // _PAGED_DECODE_MIN_SPLIT_LEN),
            min(-(-capacity // _PAGED_DECODE_SHORT_SPLIT_LEN), _PAGED_DECODE_SHORT_SPLITS))
    return max(1, min(cap, n))


def paged_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, softmax_scale: float, k_scale: Optional[Tensor] = None,
                 v_scale: Optional[Tensor] = None, *, return_lse: bool = False,
                 out: Optional[Tensor] = None, gate: Optional[Tensor] = None):
    """Causal GQA attention of each sequence's q_len newest tokens over its paged KV cache.

    Query token j ∈ [0, q_len) of sequence b sits at position seq_lens[b] − q_len + j and
    attends to cache positions 0..that position (causal among the new tokens, whose K/V
    reshape_and_cache already wrote); query head h reads kv head h // (nq / nkv). Position p
    of sequence b is k_cache[block_tables[b, p // bs], p % bs]. FP8 caches hold
    float(k8) · k_scale per (token, kv head) row. CUDA: one tensor-core split-K kernel (+ a
    small combine kernel when a sequence may span several splits of 128–256 positions), no host sync,
    CUDA-graph capturable; a sequence's output does not depend on the rest of the batch, bit
    for bit (the splits of a sequence depend on its seq_len only).

    Args:
        query: [B, nq, hd] (one token per sequence) or [B, q_len, nq, hd] (q_len ≤ 8, a
            speculative verify group) bf16; the (nq, hd) dims contiguous, B and q_len may be
            strided (e.g. a view into a fused qkv buffer). hd ∈ {64, 128, 256}.
        k_cache: [num_blocks, bs, nkv, hd] bf16 | float8_e4m3fn, contiguous, any bs; nq % nkv == 0.
        v_cache: like k_cache (same shape and dtype).
        block_tables: int32 [B, max_blocks], contiguous: physical block of each logical block.
        seq_lens: int32 [B]: tokens in the cache for each sequence, the q_len new ones included;
            0 gives out = 0, lse = −inf. A query row whose position is < 0 (seq_len < q_len)
            attends nothing likewise.
        softmax_scale: Python float > 0 (1/sqrt(hd) for Qwen3).
        k_scale, v_scale: float32 [num_blocks, bs, nkv], contiguous: required for an FP8 cache,
            None for a BF16 cache.
        return_lse: also return lse.
        out: optional bf16 output, contiguous, shaped like query; written and returned.
        gate: optional bf16 output gate shaped like query (Qwen3-Next gated attention): out is
            then sigmoid_gate_mul(attention, gate), bit for bit, in the same launches (one
            fewer than the two ops). Last dim contiguous, 16-byte aligned, other strides any
            multiple of 8 (e.g. the G half of the de-interleaved q_proj output, or the gate
            half of per-head [q | gate] rows).
    Returns:
        out bf16 [B, (q_len,) nq, hd] shaped like query; with return_lse also lse float32
        [B, (q_len,) nq], the natural-log logsumexp of the scaled scores (of the attention,
        not affected by gate).
    Raises:
        TypeError: a wrong dtype, or softmax_scale not a Python number. ValueError: wrong
            shapes, strides, devices, head_dim, q_len, nq % nkv, a missing or unexpected
            scale, or (CPU tensors only: checking CUDA ones would sync) seq_lens outside
            [0, max_blocks · bs] or a block id used by a sequence outside [0, num_blocks).
            On CUDA the kernel clamps seq_lens to [0, max_blocks · bs] and never reads a block
            id outside [0, num_blocks): such a position reads as K = V = 0 (the result is then
            meaningless, but memory-safe).
    Example:
        >>> q = torch.randn(2, 8, 64).bfloat16()
        >>> kc = torch.randn(4, 16, 2, 64).bfloat16(); vc = torch.randn(4, 16, 2, 64).bfloat16()
        >>> bt = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
        >>> out = paged_decode(q, kc, vc, bt, torch.tensor([5, 20], dtype=torch.int32), 0.125)
        >>> out.shape
        torch.Size([2, 8, 64])
    """
    op = "paged_decode"
    check_tensor(op, "query", query, dtype=torch.bfloat16, ndim=(3, 4),
                 what="[B, nq, hd] or [B, q_len, nq, hd]")
    q4 = query if query.dim() == 4 else query.unsqueeze(1)
    b, q_len, nq, hd = q4.shape
    if not 1 <= q_len <= PAGED_DECODE_MAX_Q_LEN:
        raise ValueError(f"{op}: query must have 1 ≤ q_len ≤ {PAGED_DECODE_MAX_Q_LEN}, got shape "
                         f"{list(query.shape)}")
    if hd not in PAGED_DECODE_HEAD_DIMS:
        raise ValueError(f"{op}: query must have head_dim in {PAGED_DECODE_HEAD_DIMS}, got shape "
                         f"{list(query.shape)}")
    if b < 1 or b > 65535 or nq < 1:
        raise ValueError(f"{op}: query must have 1 ≤ B ≤ 65535 and nq ≥ 1, got shape {list(query.shape)}")
    if q4.stride(3) != 1 or (nq > 1 and q4.stride(2) != hd):
        raise ValueError(f"{op}: query must have contiguous [nq, hd] rows (strides (..., {hd}, 1)), "
                         f"got strides {query.stride()}")
    dev = query.device
    check_tensor(op, "k_cache", k_cache, dtypes=(torch.bfloat16, torch.float8_e4m3fn), ndim=4,
                 device=dev, what="[num_blocks, bs, nkv, hd]")
    num_blocks, bs, nkv = k_cache.shape[:3]
    check_tensor(op, "k_cache", k_cache, shape=(None, None, None, hd), contiguous=True,
                 what=f"[num_blocks, bs, nkv, hd={hd}] (hd of query)")
    if nkv < 1 or nq % nkv != 0:
        raise ValueError(f"{op}: query heads nq = {nq} must be a multiple of the cache's kv heads "
                         f"nkv = {nkv} (k_cache shape {list(k_cache.shape)})")
    check_tensor(op, "v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=dev,
                 contiguous=True, what="like k_cache")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.storage_offset() * cache.element_size()) % 16 != 0:
            raise ValueError(f"{op}: {name} must start 16-byte aligned, got storage offset "
                             f"{cache.storage_offset()}")
    check_tensor(op, "block_tables", block_tables, dtype=torch.int32, ndim=2, device=dev,
                 what="int32 [B, max_blocks]")
    check_tensor(op, "block_tables", block_tables, shape=(b, None), contiguous=True,
                 what=f"int32 [B={b}, max_blocks], contiguous")
    max_blocks = block_tables.shape[1]
    if max_blocks < 1 or max_blocks * bs >= 2 ** 31:
        raise ValueError(f"{op}: block_tables must have 1 ≤ max_blocks and max_blocks · bs < 2^31, "
                         f"got shape {list(block_tables.shape)} with bs = {bs}")
    check_tensor(op, "seq_lens", seq_lens, dtype=torch.int32, shape=(b,), device=dev, contiguous=True,
                 what=f"int32 [B={b}]")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{op}: softmax_scale must be a Python float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"{op}: softmax_scale must be finite and > 0, got {softmax_scale}")
    fp8 = _check_kv_scales(op, k_cache, k_scale, v_scale, nkv, dev)
    if out is not None:
        check_tensor(op, "out", out, dtype=torch.bfloat16, shape=tuple(query.shape), device=dev,
                     contiguous=True, what="bf16 shaped like query, contiguous")
    if gate is not None:
        check_tensor(op, "gate", gate, dtype=torch.bfloat16, shape=tuple(query.shape), device=dev,
                     what="bf16 shaped like query")
        g4 = gate if gate.dim() == 4 else gate.unsqueeze(1)
        strides = [g4.stride(i) for i in range(3) if g4.shape[i] > 1]   # a size-1 dim's stride is unused
        if g4.stride(3) != 1 or any(st % 8 != 0 or st < 0 for st in strides) or g4.data_ptr() % 16 != 0:
            raise ValueError(f"{op}: gate must have a contiguous last dim, strides that are multiples of "
                             f"8 and a 16-byte aligned start, got strides {gate.stride()}, address "
                             f"{g4.data_ptr():#x}")
    if not seq_lens.is_cuda and not block_tables.is_cuda:   # CUDA tensors would need a sync
        _check_paged_decode_indices(op, block_tables, seq_lens, bs, num_blocks)

    if use_kernel(query, k_cache, v_cache, block_tables, seq_lens):
        if out is None:
            out = torch.empty(query.shape, dtype=torch.bfloat16, device=dev)
        lse = torch.ops.atlas.paged_decode(q4, k_cache, v_cache, block_tables, seq_lens,
                                           float(softmax_scale), k_scale, v_scale, out.view(b, q_len, nq, hd),
                                           None if gate is None else g4)
        lse = lse if query.dim() == 4 else lse.view(b, nq)
    else:
        ref_out, lse = reference.paged_decode(query, k_cache, v_cache, block_tables, seq_lens,
                                              float(softmax_scale), k_scale, v_scale)
        if gate is not None:
            ref_out = reference.sigmoid_gate_mul(ref_out, gate)
        if out is None:
            out = ref_out
        else:
            out.copy_(ref_out)
    return (out, lse) if return_lse else out


def _check_paged_decode_indices(op: str, block_tables: Tensor, seq_lens: Tensor, bs: int,
                                num_blocks: int) -> None:
    """CPU inputs: seq_lens within [0, max_blocks · bs], used block ids within [0, num_blocks)."""
    max_blocks = block_tables.shape[1]
    if seq_lens.numel() == 0:
        return
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > max_blocks * bs:
        raise ValueError(f"{op}: seq_lens must lie in [0, max_blocks·bs] = [0, {max_blocks * bs}], "
                         f"got values in [{lo}, {hi}]")
    used = torch.arange(max_blocks)[None, :] < ((seq_lens.long() + bs - 1) // bs)[:, None]  # [B, max_blocks]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{op}: block_tables must hold block ids in [0, num_blocks = {num_blocks}) "
                         f"for the blocks seq_lens uses, got ids in [{int(ids.min())}, {int(ids.max())}]")


@torch.library.custom_op("atlas::paged_decode", mutates_args=("out",))
def _paged_decode_kernel(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         seq_lens: Tensor, softmax_scale: float, k_scale: Optional[Tensor],
                         v_scale: Optional[Tensor], out: Tensor, gate: Optional[Tensor] = None) -> Tensor:
    """query [B, q_len, nq, hd] → out [B, q_len, nq, hd] (written, gated when gate [B, q_len, nq,
    hd] is given); returns lse [B, q_len, nq]."""
    b, q_len, nq, hd = query.shape
    nkv = k_cache.shape[2]
    rows = (nq // nkv) * q_len
    splits = paged_decode_max_splits(block_tables.shape[1] * k_cache.shape[1], nkv)
    lse = torch.empty(b, q_len, nq, dtype=torch.float32, device=query.device)
    if splits > 1:   # graph-safe: allocated from the caching allocator, never read uninitialized
        partial_o = torch.empty(b, nkv, splits, rows, hd, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(b, nkv, splits, rows, dtype=torch.float32, device=query.device)
    else:
        partial_o = partial_lse = lse.new_empty(0)
    _C.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                    out, lse, partial_o, partial_lse, splits, gate)
    return lse


@_paged_decode_kernel.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, out, gate=None):
    b, q_len, nq, _ = query.shape
    return query.new_empty(b, q_len, nq, dtype=torch.float32)


# =============================================================================================
# small layer ops: rms_norm, rope, sigmoid gate, argmax, embedding, moe routing (insert below)
# =============================================================================================

# ---- rms_norm / qk_norm_rope / sigmoid_gate_mul (attention layer work) ----------------------

QK_NORM_ROPE_HEAD_DIMS = (64, 128, 256)  # kernel instances (csrc/qk_norm_rope.cu); CPU: any


def _check_aligned_rows(op: str, name: str, x: Tensor) -> None:
    """bf16 rows the kernels read with up-to-16-byte vectors: last dim contiguous, every other
    stride and the storage offset multiples of 8 elements."""
    if x.stride(-1) != 1 or any(s % 8 != 0 for s, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1):
        raise ValueError(f"{op}: {name} must have a contiguous last dim and other strides that are "
                         f"multiples of 8 elements, got strides {x.stride()}")
    if x.storage_offset() % 8 != 0:
        raise ValueError(f"{op}: {name} must start 16-byte aligned (storage offset a multiple of 8 "
                         f"elements), got storage offset {x.storage_offset()}")


def _check_norm_weight(op: str, name: str, w: Tensor, dim: int, device) -> None:
    check_tensor(op, name, w, dtypes=(torch.bfloat16, torch.float32), shape=(dim,), device=device,
                 contiguous=True, what=f"bf16 | f32 [{dim}]")


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False, *,
             residual: Optional[Tensor] = None) -> Tensor:
    """RMSNorm of each row: y = x · rsqrt(mean(x²) + eps) · w, float32 math, one bf16 rounding.

    With `residual` (a decoder layer's `hidden = hidden + sublayer_out; normed = norm(hidden)` in
    one launch): h = bf16(x + residual) (float32 add, one rounding, as a bf16 torch add) is
    written to residual in place and y = rms_norm(h): the norm sees exactly the bf16 value the
    residual stream keeps, as in HF decoder layers.

    Args:
        x: [R, D] bf16, D % 8 == 0; rows may be strided (row stride a multiple of 8 elements,
            last dim contiguous, 16-byte aligned start).
        weight: [D] bf16 | f32 (HF norm weight as stored).
        eps: added to mean(x²) (config rms_norm_eps, 1e-6 for Qwen3).
        zero_centered: w = 1 + weight (Qwen3-Next / 3.5 / 3.6 norms, weights stored around 0)
            if True, else w = weight (Qwen3). Default False.
        residual: None (default) or [R, D] bf16, contiguous, updated in place (see above).
    Returns:
        [R, D] bf16, contiguous.
    Raises:
        TypeError: wrong dtypes. ValueError: shapes, strides, alignment, devices.
    Example:
        >>> rms_norm(torch.randn(2, 16).bfloat16(), torch.zeros(16), 1e-6, zero_centered=True).shape
        torch.Size([2, 16])
    """
    op = "rms_norm"
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, what="bf16 [R, D]")
    if x.shape[1] % 8 != 0:
        raise ValueError(f"{op}: x must have D % 8 == 0, got shape {list(x.shape)}")
    _check_aligned_rows(op, "x", x)
    _check_norm_weight(op, "weight", weight, x.shape[1], x.device)
    if residual is not None:
        check_tensor(op, "residual", residual, dtype=torch.bfloat16, shape=tuple(x.shape), device=x.device,
                     contiguous=True, what="bf16 [R, D] like x, contiguous")
    if use_kernel(x, weight):
        if residual is not None:
            return torch.ops.atlas.rms_norm_residual(x, residual, weight, float(eps), bool(zero_centered))
        return torch.ops.atlas.rms_norm(x, weight, float(eps), bool(zero_centered))
    return reference.rms_norm(x, weight, float(eps), bool(zero_centered), residual)


@torch.library.custom_op("atlas::rms_norm", mutates_args=())
def _rms_norm_kernel(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if x.shape[0] > 0:
        _C.rms_norm(x, weight, out, None, eps, zero_centered)
    return out


@_rms_norm_kernel.register_fake
def _(x, weight, eps, zero_centered):
    return x.new_empty(x.shape)


@torch.library.custom_op("atlas::rms_norm_residual", mutates_args=("residual",))
def _rms_norm_residual_kernel(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                              zero_centered: bool) -> Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if x.shape[0] > 0:
        _C.rms_norm(x, weight, out, residual, eps, zero_centered)
    return out


@_rms_norm_residual_kernel.register_fake
def _(x, residual, weight, eps, zero_centered):
    return x.new_empty(x.shape)


def qk_norm_rope(q: Tensor, k: Tensor, v: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
                 positions: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                 k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None, *, eps: float,
                 zero_centered: bool, rotary_dim: int, rope_theta: float) -> Tensor:
    """The attention prologue in one launch: per-head RMSNorm of q and k, partial NeoX RoPE on
    both, and K (normed, rotated) and V (as given) written into the paged cache.

    Each output value is rounded to bf16 once. K's bf16 row is what a BF16 cache stores and
    what an FP8 cache quantizes, exactly as reshape_and_cache does (scale = amax / 448 per
    (token, kv head), IEEE division), so an FP8 cache holds the same bytes either way.
    No host sync; CUDA-graph capturable. Launched with programmatic dependent launch: positions,
    slot_mapping and the norm weights are read before the kernel waits for the previous one, so
    they must be complete by the time that kernel lets its dependents launch — never its own
    outputs (q, k, v may be). In the layer that kernel is the q/k/v projection, which triggers
    only after its own wait, and positions / slots are step inputs.

    Args:
        q: [T, nq, hd] bf16, last dim contiguous, other strides multiples of 8 elements (a view
            into a [T, nq, 2·hd] q+gate projection or a [T, 2·nq·hd] q|gate buffer is fine).
        k, v: [T, nkv, hd] bf16, same stride rules.
        q_norm_weight, k_norm_weight: [hd] bf16 | f32, one dtype.
        positions: int64 [T], RoPE position of each token (AttentionMetadata.positions).
        k_cache, v_cache: [num_blocks, bs, nkv, hd] bf16 | float8_e4m3fn, contiguous.
        slot_mapping: int64 [T]; slot < 0 skips the token's write. Slots ≥ num_blocks·bs raise
            on CPU; the kernel skips them (checking would sync).
        k_scale, v_scale: float32 [num_blocks, bs, nkv] for an FP8 cache (written), else None.
        eps: RMSNorm epsilon. zero_centered: norm weight is 1 + w (Qwen3-Next family) or w.
        rotary_dim: rotated dims (even, ≤ hd; hd for full RoPE, hd/4 for Qwen3-Next).
        rope_theta: RoPE base.
    Returns:
        q_out [T, nq, hd] bf16, contiguous.
    Raises:
        TypeError: wrong dtypes. ValueError: shapes, strides, devices, scales, rotary_dim,
            head_dim not in (64, 128, 256) on the GPU, slots out of range on the CPU.
    Example:
        >>> q, k = torch.randn(1, 2, 64).bfloat16(), torch.randn(1, 1, 64).bfloat16()
        >>> kc = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
        >>> qo = qk_norm_rope(q, k, k.clone(), torch.ones(64), torch.ones(64), torch.tensor([5]),
        ...                   kc, kc.clone(), torch.tensor([3]), eps=1e-6, zero_centered=False,
        ...                   rotary_dim=64, rope_theta=1e6)
    """
    op = "qk_norm_rope"
    check_tensor(op, "q", q, dtype=torch.bfloat16, ndim=3, what="bf16 [T, nq, hd]")
    t, nq, hd = q.shape
    dev = q.device
    check_tensor(op, "k", k, dtype=torch.bfloat16, ndim=3, device=dev, what="bf16 [T, nkv, hd]")
    check_tensor(op, "k", k, shape=(t, None, hd), what=f"bf16 [T={t}, nkv, hd={hd}] (T, hd of q)")
    nkv = k.shape[1]
    check_tensor(op, "v", v, dtype=torch.bfloat16, shape=(t, nkv, hd), device=dev, what="bf16 [T, nkv, hd] like k")
    if hd % 8 != 0:
        raise ValueError(f"{op}: q must have hd % 8 == 0, got shape {list(q.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_aligned_rows(op, name, x)
    _check_norm_weight(op, "q_norm_weight", q_norm_weight, hd, dev)
    check_tensor(op, "k_norm_weight", k_norm_weight, dtype=q_norm_weight.dtype, shape=(hd,), device=dev,
                 contiguous=True, what=f"[{hd}] of q_norm_weight's dtype")
    check_tensor(op, "positions", positions, dtype=torch.int64, shape=(t,), device=dev, what="int64 [T]")
    check_tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, shape=(t,), device=dev, what="int64 [T]")
    check_tensor(op, "k_cache", k_cache, dtypes=(torch.bfloat16, torch.float8_e4m3fn),
                 shape=(None, None, nkv, hd), device=dev, contiguous=True,
                 what=f"bf16 | float8_e4m3fn [num_blocks, bs, nkv={nkv}, hd={hd}]")
    check_tensor(op, "v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=dev,
                 contiguous=True, what="like k_cache")
    num_blocks, bs = k_cache.shape[:2]
    fp8 = _check_kv_scales(op, k_cache, k_scale, v_scale, nkv, dev)
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise TypeError(f"{op}: rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim < 0 or rotary_dim % 2 != 0 or rotary_dim > hd:
        raise ValueError(f"{op}: rotary_dim must be even and in [0, hd={hd}], got {rotary_dim}")
    if not slot_mapping.is_cuda and t > 0 and int(slot_mapping.max()) >= num_blocks * bs:
        raise ValueError(f"{op}: slot_mapping must hold slots < num_blocks·bs = {num_blocks * bs}, "
                         f"got {int(slot_mapping.max())}")
    if use_kernel(q, k_cache):
        if hd not in QK_NORM_ROPE_HEAD_DIMS:
            raise ValueError(f"{op}: q must have hd in {QK_NORM_ROPE_HEAD_DIMS} on the GPU, got {hd}")
        return torch.ops.atlas.qk_norm_rope(q, k, v, q_norm_weight, k_norm_weight, positions, k_cache,
                                            v_cache, slot_mapping, k_scale, v_scale, float(eps),
                                            bool(zero_centered), int(rotary_dim), float(rope_theta))
    return reference.qk_norm_rope(q, k, v, q_norm_weight, k_norm_weight, positions, k_cache, v_cache,
                                  slot_mapping, k_scale, v_scale, eps=float(eps),
                                  zero_centered=bool(zero_centered), rotary_dim=int(rotary_dim),
                                  rope_theta=float(rope_theta))


@torch.library.custom_op("atlas::qk_norm_rope", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _qk_norm_rope_kernel(q: Tensor, k: Tensor, v: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
                         positions: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                         k_scale: Optional[Tensor], v_scale: Optional[Tensor], eps: float,
                         zero_centered: bool, rotary_dim: int, rope_theta: float) -> Tensor:
    q_out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if q.shape[0] > 0:
        _C.qk_norm_rope(q, k, v, q_norm_weight, k_norm_weight, positions, k_cache, v_cache, slot_mapping,
                        k_scale, v_scale, q_out, eps, zero_centered, rotary_dim, rope_theta)
    return q_out


@_qk_norm_rope_kernel.register_fake
def _(q, k, v, q_norm_weight, k_norm_weight, positions, k_cache, v_cache, slot_mapping, k_scale, v_scale,
      eps, zero_centered, rotary_dim, rope_theta):
    return q.new_empty(q.shape)


def sigmoid_gate_mul(x: Tensor, gate: Tensor) -> Tensor:
    """Gated attention output: out = x · sigmoid(gate), float32 math, one bf16 rounding.

    Args:
        x: [T, H, hd] bf16, contiguous (attention output, heads concatenated per token).
        gate: [T, H, hd] bf16; last dim contiguous, other strides multiples of 8 elements (the
            gate half of a per-head [q | gate] projection is a view with head stride 2·hd).
    Returns:
        [T, H, hd] bf16, contiguous.
    Raises:
        TypeError: wrong dtypes. ValueError: shapes, strides, devices, hd % 8 != 0.
    Example:
        >>> sigmoid_gate_mul(torch.ones(1, 2, 8).bfloat16(), torch.zeros(1, 2, 8).bfloat16())[0, 0, 0]
        tensor(0.5000, dtype=torch.bfloat16)
    """
    op = "sigmoid_gate_mul"
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=3, contiguous=True, what="bf16 [T, H, hd]")
    check_tensor(op, "gate", gate, dtype=torch.bfloat16, shape=tuple(x.shape), device=x.device,
                 what="bf16 [T, H, hd] like x")
    if x.shape[2] % 8 != 0:
        raise ValueError(f"{op}: x must have hd % 8 == 0, got shape {list(x.shape)}")
    _check_aligned_rows(op, "gate", gate)
    if use_kernel(x, gate):
        return torch.ops.atlas.sigmoid_gate_mul(x, gate)
    return reference.sigmoid_gate_mul(x, gate)


@torch.library.custom_op("atlas::sigmoid_gate_mul", mutates_args=())
def _sigmoid_gate_mul_kernel(x: Tensor, gate: Tensor) -> Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _C.sigmoid_gate_mul(x, gate, out)
    return out


@_sigmoid_gate_mul_kernel.register_fake
def _(x, gate):
    return x.new_empty(x.shape)


# ---- argmax / moe_route / moe_router / embedding (MTP work) ---------------------------------------------

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


def moe_route(logits: Tensor, top_k: int, renormalize: bool = True, *, shared_slot: bool = False) -> tuple[Tensor, Tensor]:
    """MoE routing on the device (no host sync): softmax over all E experts in float32, top-k
    by logit with the lowest expert index winning ties, renormalized when `renormalize`.

    Args:
        logits: [T, E] bf16 | f32 router logits (x · W_gate^T), E ≤ 1024, last dim contiguous
            (a row stride > E is fine: e.g. the first E columns of [router | shared gate] logits).
        top_k: experts per row, 1 ≤ top_k ≤ min(E, 32).
        renormalize: divide the k weights by their sum (Qwen3 `norm_topk_prob`); default True.
        shared_slot: logits are [T, E + 1] = [router | shared-expert gate logit]; routing uses
            the first E columns and one more slot k = (id E, weight sigmoid(logits[:, E])) is
            appended, so ops.moe_experts runs the shared expert (stored as expert E) as one more
            pair. Needs top_k ≤ 31. Default False.
    Returns:
        ids int32 [T, k (+1)] (slot j = j-th best expert), weights float32 [T, k (+1)].
    Raises:
        TypeError: wrong dtype or top_k not an int. ValueError: wrong rank, E, top_k.
    Example:
        >>> ids, w = moe_route(torch.randn(3, 8), 2)
    """
    op = "moe_route"
    check_tensor(op, "logits", logits, dtypes=(torch.bfloat16, torch.float32), ndim=2,
                 what="bf16|f32 [T, E]")
    if logits.shape[0] > 0 and logits.stride(1) != 1:
        logits = logits.contiguous()
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"{op}: top_k must be an int, got {type(top_k).__name__}")
    e = logits.shape[1] - (1 if shared_slot else 0)
    if shared_slot and top_k >= MOE_ROUTE_MAX_TOP_K:
        raise ValueError(f"{op}: top_k must be < {MOE_ROUTE_MAX_TOP_K} with shared_slot, got {top_k}")
    if not 1 <= e <= MOE_ROUTE_MAX_EXPERTS:
        raise ValueError(f"{op}: logits must have 1 ≤ E ≤ {MOE_ROUTE_MAX_EXPERTS} experts, got E = {e}")
    if not 1 <= top_k <= min(e, MOE_ROUTE_MAX_TOP_K):
        raise ValueError(f"{op}: top_k must be in [1, {min(e, MOE_ROUTE_MAX_TOP_K)}] for E = {e}, got {top_k}")
    if use_kernel(logits):
        return torch.ops.atlas.moe_route(logits, top_k, bool(renormalize), bool(shared_slot))   # rows may be strided
    return reference.moe_route(logits, top_k, bool(renormalize), bool(shared_slot))


@torch.library.custom_op("atlas::moe_route", mutates_args=())
def _moe_route_kernel(logits: Tensor, top_k: int, renormalize: bool, shared_slot: bool) -> tuple[Tensor, Tensor]:
    t, k = logits.shape[0], top_k + (1 if shared_slot else 0)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    if t > 0:
        _C.moe_route(logits, ids, weights, renormalize, shared_slot)
    return ids, weights


@_moe_route_kernel.register_fake
def _(logits, top_k, renormalize, shared_slot):
    t, k = logits.shape[0], top_k + (1 if shared_slot else 0)
    return (logits.new_empty(t, k, dtype=torch.int32), logits.new_empty(t, k, dtype=torch.float32))


MOE_ROUTER_TOKEN_TILE = 16   # tokens per CTA cluster (csrc/moe_router.cu); grid.y ≤ 65535 tiles


def moe_router(x: Tensor, gates: Tensor, top_k: int, renormalize: bool = True, *,
               num_experts: Optional[int] = None, shared_slot: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The MoE router from the hidden states in one launch: router GEMV, then moe_route's
    selection (softmax over E in float32, top-k, lowest index first among equal logits).

    Args:
        x: [T, h] bf16, h % 8 == 0 (a non-contiguous or misaligned x is copied).
        gates: [R, h] bf16 contiguous: the E router rows, or E + 1 with the shared-expert gate
            row last (SparseMoE's [router | shared gate] matrix).
        top_k: experts per token, 1 ≤ top_k ≤ min(E, 32) (< 32 with shared_slot).
        renormalize: divide the k weights by their sum (Qwen3 `norm_topk_prob`); default True.
        num_experts: E, the rows routed over (default R − shared_slot); R must be E or E + 1.
        shared_slot: also emit slot k = (id E, weight sigmoid(logit of row E)), as moe_route.
    Returns:
        logits bf16 [T, R] = F.linear(x, gates) to float32 summation order (every row's logit,
        the shared gate's included), ids int32 [T, k (+1)], weights float32 [T, k (+1)]; ids and
        weights equal moe_route(logits) exactly (the same device code on CUDA).
    Raises:
        TypeError: wrong dtype or top_k not an int. ValueError: wrong shapes, E, top_k, h.
    Example:
        >>> logits, ids, w = moe_router(x, moe.gates, 8, shared_slot=True)   # 35B-A3B: R = 257
    """
    op = "moe_router"
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, what="bf16 [T, h]")
    check_tensor(op, "gates", gates, dtype=torch.bfloat16, ndim=2, device=x.device, what="bf16 [R, h]")
    t, h = x.shape
    r = gates.shape[0]
    if gates.shape[1] != h:
        raise ValueError(f"{op}: gates must be [R, h = {h}] like x, got shape {list(gates.shape)}")
    if h < 8 or h % 8:
        raise ValueError(f"{op}: x must have h ≥ 8, a multiple of 8, got shape {list(x.shape)}")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"{op}: top_k must be an int, got {type(top_k).__name__}")
    e = r - int(bool(shared_slot)) if num_experts is None else num_experts
    if not isinstance(e, int) or isinstance(e, bool) or not 1 <= e <= MOE_ROUTE_MAX_EXPERTS:
        raise ValueError(f"{op}: num_experts must be in [1, {MOE_ROUTE_MAX_EXPERTS}], got {e}")
    if r not in (e, e + 1) or (shared_slot and r != e + 1):
        raise ValueError(f"{op}: gates must have R = E{' + 1' if shared_slot else ' or E + 1'} rows "
                         f"(E = {e}{', shared_slot' if shared_slot else ''}), got R = {r}")
    if shared_slot and top_k >= MOE_ROUTE_MAX_TOP_K:
        raise ValueError(f"{op}: top_k must be < {MOE_ROUTE_MAX_TOP_K} with shared_slot, got {top_k}")
    if not 1 <= top_k <= min(e, MOE_ROUTE_MAX_TOP_K):
        raise ValueError(f"{op}: top_k must be in [1, {min(e, MOE_ROUTE_MAX_TOP_K)}] for E = {e}, got {top_k}")
    if -(-t // MOE_ROUTER_TOKEN_TILE) > MAX_GRID_ROWS:
        raise ValueError(f"{op}: x must have at most {MAX_GRID_ROWS * MOE_ROUTER_TOKEN_TILE} rows, got {t}")
    if not gates.is_contiguous():
        raise ValueError(f"{op}: gates must be contiguous, got strides {gates.stride()}")
    if use_kernel(x):
        return torch.ops.atlas.moe_router(_gemv_ready(x), _gemv_ready(gates), top_k, bool(renormalize), e,
                                          bool(shared_slot))
    return reference.moe_router(x, gates, top_k, bool(renormalize), e, bool(shared_slot))


@torch.library.custom_op("atlas::moe_router", mutates_args=())
def _moe_router_kernel(x: Tensor, gates: Tensor, top_k: int, renormalize: bool, num_experts: int,
                       shared_slot: bool) -> tuple[Tensor, Tensor, Tensor]:
    t, k = x.shape[0], top_k + (1 if shared_slot else 0)
    logits = torch.empty(t, gates.shape[0], dtype=torch.bfloat16, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=x.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    if t > 0:
        _C.moe_router(x, gates, logits, ids, weights, num_experts, renormalize, shared_slot)
    return logits, ids, weights


@_moe_router_kernel.register_fake
def _(x, gates, top_k, renormalize, num_experts, shared_slot):
    t, k = x.shape[0], top_k + (1 if shared_slot else 0)
    return (x.new_empty(t, gates.shape[0]), x.new_empty(t, k, dtype=torch.int32),
            x.new_empty(t, k, dtype=torch.float32))


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


def embedding_norm_concat(table: Tensor, ids: Tensor, hidden: Tensor, w_embed: Tensor, w_hidden: Tensor,
                          eps: float, zero_centered: bool) -> Tensor:
    """The MTP head's fc input in one launch: [rms_norm(table[ids], w_embed) | rms_norm(hidden, w_hidden)].

    Args:
        table: [V, h] bf16 contiguous (embed_tokens); ids: int32|int64 [T] in [0, V) (checked on
            CPU; on the GPU a bad id normalizes a zero row); hidden: [T, h] bf16, last dim
            contiguous (row stride % 8 == 0); w_embed, w_hidden: [h] float32 norm weights;
            eps; zero_centered: weight 1 + w (Qwen3-Next family) or w. h % 8 == 0, ≤ 8192.
    Returns:
        [T, 2h] bf16 (reference.embedding_norm_concat; each half equals ops.rms_norm of it up to
        float32 summation order).
    """
    op = "embedding_norm_concat"
    check_tensor(op, "table", table, dtype=torch.bfloat16, ndim=2, contiguous=True, what="bf16 [V, h]")
    v, h = table.shape
    check_tensor(op, "ids", ids, dtypes=(torch.int32, torch.int64), ndim=1, device=table.device,
                 what="int32|int64 [T]")
    t = ids.shape[0]
    check_tensor(op, "hidden", hidden, dtype=torch.bfloat16, shape=(t, h), device=table.device, what="bf16 [T, h]")
    for name, w in (("w_embed", w_embed), ("w_hidden", w_hidden)):
        check_tensor(op, name, w, dtype=torch.float32, shape=(h,), device=table.device, contiguous=True,
                     what="float32 [h]")
    if h % 8 or h > 8192 or t > MAX_GRID_ROWS:
        raise ValueError(f"{op}: needs h % 8 == 0, h ≤ 8192 and T ≤ {MAX_GRID_ROWS}, got h = {h}, T = {t}")
    if t > 0 and (hidden.stride(1) != 1 or (t > 1 and hidden.stride(0) % 8) or hidden.data_ptr() % 16):
        hidden = hidden.clone(memory_format=torch.contiguous_format)   # the kernel loads 16-byte vectors
    if not ids.is_cuda and t > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= v:
            raise ValueError(f"{op}: ids must be in [0, {v}), got values in [{lo}, {hi}]")
    if use_kernel(table, ids, hidden):
        return torch.ops.atlas.embedding_norm_concat(table, ids.contiguous(), hidden, w_embed, w_hidden,
                                                     float(eps), bool(zero_centered))
    return reference.embedding_norm_concat(table, ids, hidden, w_embed, w_hidden, eps, zero_centered)


@torch.library.custom_op("atlas::embedding_norm_concat", mutates_args=())
def _embedding_norm_concat_kernel(table: Tensor, ids: Tensor, hidden: Tensor, w_embed: Tensor, w_hidden: Tensor,
                                  eps: float, zero_centered: bool) -> Tensor:
    out = torch.empty(ids.shape[0], 2 * table.shape[1], dtype=torch.bfloat16, device=table.device)
    if ids.shape[0] > 0:
        _C.embedding_norm_concat(table, ids, hidden, w_embed, w_hidden, out, eps, zero_centered)
    return out


@_embedding_norm_concat_kernel.register_fake
def _(table, ids, hidden, w_embed, w_hidden, eps, zero_centered):
    return table.new_empty(ids.shape[0], 2 * table.shape[1])


def _tiled_view_ok(t: Tensor, n: int, k: int, b: int) -> bool:
    """t is [E, n, k/128, b] with strides (n·k/128·b, b, n·b, 1) (any stride on a size-1 dim):
    nvfp4.tile_expert_stack's views."""
    from atlas.nvfp4 import GEMV_CHUNK_K   # (nvfp4 imports this module)
    c = k // GEMV_CHUNK_K
    want = (n * c * b, b, n * b, 1)
    return (t.dim() == 4 and k % GEMV_CHUNK_K == 0 and tuple(t.shape[1:]) == (n, c, b)
            and all(size == 1 or st == w for size, st, w in zip(t.shape, t.stride(), want)))


def _expert_stack(op: str, name: str, s, shape_nk, device):
    """A stack of E expert weights [E, N, K]: bf16 Tensor, or (packed uint8 [E, N, K/2] —
    or [E, N, K/8, 4], the words in the GEMV bit order (nvfp4.expert_words_for_gemv) —,
    block_scale e4m3 [E, N, K/16], global_scale f32 [E]), or the tiled views of
    nvfp4.tile_expert_stack (packed [E, N, K/128, 64], block_scale [E, N, K/128, 8]) with
    global_scale. Returns (tensors, layout): layout "bf16" | "words" (checkpoint) | "gemv" | "tiled"."""
    if isinstance(s, Tensor):
        check_tensor(op, name, s, dtype=torch.bfloat16, shape=(None, *shape_nk), device=device, contiguous=True,
                     what=f"bf16 [E, {shape_nk[0]}, {shape_nk[1]}]")
        return (s,), "bf16"
    if not (isinstance(s, (tuple, list)) and len(s) == 3):
        raise TypeError(f"{op}: {name} must be a bf16 tensor or a (packed, block_scale, global_scale) tuple")
    n, k = shape_nk
    from atlas.nvfp4 import is_tiled_expert_stack   # (nvfp4 imports this module)
    packed, scale, gs = s
    layout = "words"
    if isinstance(packed, Tensor) and is_tiled_expert_stack(packed):
        layout = "tiled"
        what = f"uint8 [E, {n}, {k // 128}, 64] (tile_expert_stack's view)"
        check_tensor(op, f"{name}[0]", packed, dtype=torch.uint8, device=device, what=what)
        if not _tiled_view_ok(packed, n, k, 64):
            raise ValueError(f"{op}: {name}[0] must be {what}, got shape {list(packed.shape)}, "
                             f"strides {packed.stride()}")
    elif isinstance(packed, Tensor) and packed.dim() == 4:   # GEMV word order
        layout = "gemv"
        check_tensor(op, f"{name}[0]", packed, dtype=torch.uint8, shape=(None, n, k // 8, 4), device=device,
                     contiguous=True, what=f"uint8 [E, {n}, {k // 8}, 4] (GEMV word order)")
    else:
        check_tensor(op, f"{name}[0]", packed, dtype=torch.uint8, shape=(None, n, k // 2), device=device,
                     contiguous=True, what=f"uint8 [E, {n}, {k // 2}], [E, {n}, {k // 8}, 4] or tiled")
    e = packed.shape[0]
    if layout == "tiled":
        what = f"e4m3 [E, {n}, {k // 128}, 8] (tile_expert_stack's view)"
        check_tensor(op, f"{name}[1]", scale, dtype=torch.float8_e4m3fn, device=device, what=what)
        if scale.shape[0] != e or not _tiled_view_ok(scale, n, k, 8):
            raise ValueError(f"{op}: {name}[1] must be {what}, got shape {list(scale.shape)}, "
                             f"strides {scale.stride()}")
    else:
        check_tensor(op, f"{name}[1]", scale, dtype=torch.float8_e4m3fn, shape=(e, n, k // 16), device=device,
                     contiguous=True, what=f"e4m3 [E, {n}, {k // 16}]")
    check_tensor(op, f"{name}[2]", gs, dtype=torch.float32, shape=(e,), device=device, contiguous=True,
                 what="f32 [E]")
    return (packed, scale, gs), layout


def _used_experts(stacks: tuple, ids: Tensor) -> tuple[tuple, Tensor]:
    """The stacks cut to the experts ids names (in ascending id order) and ids renumbered to
    match (−1 for ids outside [0, E): they still contribute nothing). Same results, a fraction
    of the dequantization when T·k ≪ E."""
    e = stacks[0][0].shape[0]
    valid = (ids >= 0) & (ids < e)
    used = torch.unique(ids[valid].long())
    if used.numel() == 0:   # keep one expert: the dequantizers cannot reshape an empty stack
        used = used.new_zeros(1)
    remap = torch.full((e,), -1, dtype=ids.dtype)
    remap[used] = torch.arange(used.numel(), dtype=ids.dtype)
    ids = torch.where(valid, remap[ids.long().clamp(0, e - 1)], torch.full_like(ids, -1))
    return tuple(tuple(t.index_select(0, used) for t in s) for s in stacks), ids


def _dense_stack(t: tuple) -> Tensor:
    if len(t) == 1:
        return t[0]
    from atlas.nvfp4 import dequantize_expert_stack   # (nvfp4 imports this module)
    return dequantize_expert_stack(*t)


MOE_EXPERTS_MAX_EXPERTS = 4096  # E of the stacks: the grouping kernel counts pairs per expert in smem (csrc/moe_experts.h)


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, gate, up, down, *, shared: Optional[Tensor] = None,
                shared_gate: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Routed SwiGLU experts as grouped GEMVs over device-side expert ids (no host sync).

    Args:
        x: [T, h] bf16 contiguous, h % 32 == 0, h ≤ 8192.
        ids: int32 [T, k] (from moe_route), k ≤ 32, T·k ≤ 65535. An id outside [0, E)
            contributes nothing (checked nowhere: reading it would sync). Repeated ids in a row
            are allowed (each pair counts).
        weights: float32 [T, k] routing weights.
        gate, up: expert stacks [E, I, h]; down: [E, h, I] (I % 32 == 0). Each is a bf16
            tensor, or an NVFP4 tuple (packed uint8 [E, N, K/2], block_scale e4m3 [E, N, K/16],
            global_scale f32 [E]); all three in the same format; E ≤ 4096. NVFP4 packed may
            instead be uint8 [E, N, K/8, 4], each 32-bit word's codes in the GEMV bit order
            (nvfp4.expert_words_for_gemv: the kernels then skip the activation permutation), or
            packed and block_scale the tiled views of nvfp4.tile_expert_stack (GEMV words, each
            expert chunk-major; h and I multiples of 128: what the layers hold on CUDA, streamed
            fastest); all three in the same layout.
        shared: optional [T, h] bf16, the shared expert's output, combined in the epilogue;
        shared_gate: [T] bf16 (any stride) shared-expert gate logits, required with shared.
        out_dtype: float32 (default without shared) or bfloat16 (the sum rounded once; the only
            choice with shared).
    Returns:
        float32 [T, h] = Σ_j weights[t, j] · bf16(down_e · bf16(silu(bf16(gate_e·x))·bf16(up_e·x)))
        (reference.moe_experts); with `shared`: bf16 [T, h] = bf16(that + sigmoid(shared_gate) ·
        shared), the whole MoE block's output.
    Example:
        >>> out = moe_experts(x, ids, w, gate_bf16, up_bf16, down_bf16)
    """
    op = "moe_experts"
    check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, contiguous=True, what="bf16 [T, h]")
    t, h = x.shape
    check_tensor(op, "ids", ids, dtype=torch.int32, ndim=2, shape=(t, None), device=x.device, contiguous=True,
                 what="int32 [T, k]")
    k = ids.shape[1]
    check_tensor(op, "weights", weights, dtype=torch.float32, shape=(t, k), device=x.device, contiguous=True,
                 what="float32 [T, k]")
    if isinstance(gate, Tensor):
        inter = gate.shape[1] if gate.dim() == 3 else -1
    else:
        inter = gate[0].shape[1] if isinstance(gate, (tuple, list)) and len(gate) == 3 else -1
    g, g_layout = _expert_stack(op, "gate", gate, (inter, h), x.device)
    u, u_layout = _expert_stack(op, "up", up, (inter, h), x.device)
    d, d_layout = _expert_stack(op, "down", down, (h, inter), x.device)
    g4 = g_layout != "bf16"
    if not g4 == (u_layout != "bf16") == (d_layout != "bf16"):
        raise TypeError(f"{op}: gate, up and down must share one format (all bf16 or all NVFP4)")
    if not g_layout == u_layout == d_layout:
        raise ValueError(f"{op}: gate, up and down must share one NVFP4 layout (packed all [E, N, K/2], "
                         f"all [E, N, K/8, 4] or all tiled), got {g_layout}, {u_layout}, {d_layout}")
    if len({s[0].shape[0] for s in (g, u, d)}) != 1:
        raise ValueError(f"{op}: gate, up and down must hold the same number of experts E")
    if not 1 <= g[0].shape[0] <= MOE_EXPERTS_MAX_EXPERTS:
        raise ValueError(f"{op}: gate, up and down must hold 1 ≤ E ≤ {MOE_EXPERTS_MAX_EXPERTS} experts, "
                         f"got {g[0].shape[0]}")
    if h % 32 or inter % 32 or not 32 <= h <= 8192 or not 32 <= inter <= 8192:
        raise ValueError(f"{op}: h and I must be multiples of 32 in [32, 8192], got h = {h}, I = {inter}")
    if not 1 <= k <= 32 or t * k > 65535:
        raise ValueError(f"{op}: ids must have 1 ≤ k ≤ 32 and T·k ≤ 65535, got T = {t}, k = {k}")
    if (shared is None) != (shared_gate is None):
        raise ValueError(f"{op}: shared and shared_gate must be given together")
    if out_dtype is None:
        out_dtype = torch.float32 if shared is None else torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16) or (shared is not None and out_dtype != torch.bfloat16):
        raise TypeError(f"{op}: out_dtype must be float32 or bfloat16 (bfloat16 with shared), got {out_dtype}")
    if shared is not None:
        check_tensor(op, "shared", shared, dtype=torch.bfloat16, shape=(t, h), device=x.device, contiguous=True,
                     what="bf16 [T, h]")
        check_tensor(op, "shared_gate", shared_gate, dtype=torch.bfloat16, shape=(t,), device=x.device,
                     what="bf16 [T]")
    if use_kernel(x):
        if x.data_ptr() % 16:   # the kernel streams x rows with 16-byte copies
            raise ValueError(f"{op}: x must start 16-byte aligned on CUDA (a fresh or row-sliced tensor), "
                             f"got address {x.data_ptr():#x}")
        s4 = (g[1], g[2], u[0], u[1], u[2], d[0], d[1], d[2]) if g4 else (None, None, u[0], None, None, d[0], None, None)
        # the kernel groups the pairs by expert itself (csrc/moe_experts.cu: no torch sort)
        return torch.ops.atlas.moe_experts(x, ids, weights, g[0], *s4, shared, shared_gate,
                                           out_dtype == torch.bfloat16)
    if x.device.type == "cpu":   # dequantize only the experts the ids name (host-side: the CPU path)
        (g, u, d), ids = _used_experts((g, u, d), ids)
    out = reference.moe_experts(x, ids, weights, _dense_stack(g), _dense_stack(u), _dense_stack(d))
    if shared is not None:
        out = out + torch.sigmoid(shared_gate.float()).unsqueeze(-1) * shared.float()
    return out.to(out_dtype)


@torch.library.custom_op("atlas::moe_experts", mutates_args=())
def _moe_experts_kernel(x: Tensor, ids: Tensor, weights: Tensor, gate: Tensor, gate_scale: Optional[Tensor],
                        gate_gs: Optional[Tensor], up: Tensor, up_scale: Optional[Tensor], up_gs: Optional[Tensor],
                        down: Tensor, down_scale: Optional[Tensor], down_gs: Optional[Tensor],
                        shared: Optional[Tensor], shared_gate: Optional[Tensor], out_bf16: bool) -> Tensor:
    t, h = x.shape
    out = torch.empty(t, h, dtype=torch.bfloat16 if out_bf16 else torch.float32, device=x.device)
    _C.moe_experts(x, ids, weights, gate, gate_scale, gate_gs, up, up_scale, up_gs, down, down_scale, down_gs,
                   shared, shared_gate, out)   # scratch (groups, act, d) allocated by the binding
    return out


@_moe_experts_kernel.register_fake
def _(x, ids, weights, gate, gate_scale, gate_gs, up, up_scale, up_gs, down, down_scale, down_gs, shared, shared_gate,
      out_bf16):
    return x.new_empty(x.shape, dtype=torch.bfloat16 if out_bf16 else torch.float32)
