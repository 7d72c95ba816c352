"""One projection y = x · Wᵀ in "bf16" | "fp8" | "nvfp4", built from any checkpoint dialect.

Dialects (detected per module from its keys, DESIGN "Formats"):
    BF16                 {p}weight (bf16 | f16 | f32)             → torch.Tensor
    ModelOpt NVFP4       {p}weight uint8, weight_scale, weight_scale_2 → NVFP4Weight
    compressed-tensors   {p}weight_packed, weight_scale, weight_global_scale → NVFP4Weight
    Qwen FP8             {p}weight e4m3, weight_scale_inv         → FP8BlockWeight
A weight already in the requested `weight_format` is used as it is (never re-quantized); any
other is converted once at load:
    → "bf16":  NVFP4 / FP8 dequantized (float32 math, one rounding to bf16)
    → "nvfp4": BF16 quantized with atlas.quantize_nvfp4; FP8 dequantized to BF16, then quantized
    → "fp8":   BF16 / NVFP4 (via its BF16 dequantization) quantized 128×128 block-wise

How each format runs (x [T, K] bf16 → y [T, N] bf16):
    "nvfp4"  T ≤ 32: atlas.ops.w4a16_gemv (the decode / verify GEMV, weights read once).
             32 < T ≤ 128: the same GEMV over 32-row chunks (a batched verify step, e.g. 32
             sequences × 4 rows): each chunk re-reads the weight (N·K·9/16 bytes) instead of
             paying the dequantization below (~20 bytes of traffic per weight), keeps the step
             graph-capturable without scratch, and gives each row bitwise the result it gets at
             T ≤ 32 (the GEMV's rows do not depend on M). Crossover: with w4a16_gemv v1 (H200,
             bench/results/gemv.md: 35B-A3B q_proj 8192×2048 at M = 32 in 22.7 µs) four chunks
             cost about what dequantize + cuBLAS does (~150 µs for a 35B-A3B layer, estimated);
             at the GEMV's targets (M = 32 within 2.5× of M = 1) chunks win up to ~1000 rows.
             Re-measure and move GEMV_CHUNKED_MAX_ROWS with the GEMV.
             T > 128: GEMM through torch (cuBLAS) on the BF16 dequantization of the weight,
             made on the fly in row chunks of ≤ 8 M weights (≤ 16 MB bf16), so no full BF16
             copy is ever kept: prefill pays the dequantization, decode memory stays 4-bit.
    "bf16"   F.linear.
    "fp8"    F.linear on a BF16 dequantization cached ONCE at load on the device (derived from
             the FP8BlockWeight). Chosen over per-call dequantization because a decode GEMV
             then streams 2 bytes per weight instead of 1 (read fp8) + 2 (write) + 2 (read
             bf16) = 5; the price is 3 bytes per weight of device memory. There is no FP8
             GEMV kernel in atlas; "fp8" exists so FP8 checkpoints run at their own precision.
"""
from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from atlas import ops, reference
from atlas._validate import check_tensor
from atlas.fp8 import FP8BlockWeight, dequantize_fp8_block, quantize_fp8_block
from atlas.nvfp4 import NVFP4Weight, quantize_nvfp4

WEIGHT_FORMATS = ("bf16", "fp8", "nvfp4")
GEMV_MAX_ROWS = 32                   # w4a16_gemv serves M ≤ 32 rows per launch
GEMV_CHUNKED_MAX_ROWS = 128          # up to here: 32-row GEMV chunks; beyond: dequantize + GEMM
_GEMM_CHUNK_ELEMS = 1 << 23          # NVFP4 → BF16 dequantization chunk for the GEMM path

AnyWeight = Union[Tensor, NVFP4Weight, FP8BlockWeight]


# =============================================================================================
# dialect detection and conversion (load time: host reads are fine here)
# =============================================================================================

def detect_dialect(state_dict: Mapping[str, Tensor], prefix: str) -> str:
    """Which checkpoint dialect holds the module at `prefix` (e.g. "model.layers.3.self_attn.q_proj.").

    Returns "bf16" | "modelopt_nvfp4" | "ct_nvfp4" | "fp8". Raises KeyError naming the keys
    looked for when none is present."""
    has = lambda name: f"{prefix}{name}" in state_dict
    if has("weight_packed"):
        return "ct_nvfp4"
    if has("weight"):
        w = state_dict[f"{prefix}weight"]
        if w.dtype == torch.uint8:
            return "modelopt_nvfp4"
        if w.dtype == torch.float8_e4m3fn:
            return "fp8"
        return "bf16"
    raise KeyError(f"linear: no weight for module '{prefix}': looked for '{prefix}weight' and "
                   f"'{prefix}weight_packed'")


def load_weight(state_dict: Mapping[str, Tensor], prefix: str) -> AnyWeight:
    """The module's weight as its dialect's container (tensors untouched, on their device)."""
    dialect = detect_dialect(state_dict, prefix)

    def get(name: str) -> Tensor:
        key = f"{prefix}{name}"
        if key not in state_dict:
            raise KeyError(f"linear: module '{prefix}' is {dialect} but '{key}' is missing")
        return state_dict[key]

    if f"{prefix}bias" in state_dict:
        raise ValueError(f"linear: '{prefix}bias' present; atlas projections have no bias "
                         "(Qwen3 attention_bias is False)")
    if dialect == "ct_nvfp4":
        return NVFP4Weight.from_compressed_tensors(get("weight_packed"), get("weight_scale"),
                                                   get("weight_global_scale"))
    if dialect == "modelopt_nvfp4":
        return NVFP4Weight.from_modelopt(get("weight"), get("weight_scale"), get("weight_scale_2"))
    if dialect == "fp8":
        return FP8BlockWeight.from_checkpoint(get("weight"), get("weight_scale_inv"))
    w = get("weight")
    check_tensor("linear", f"{prefix}weight", w, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                 ndim=2, what="[N, K] float")
    return w


def weight_shape(w: AnyWeight) -> tuple[int, int]:
    return tuple(w.shape)  # type: ignore[return-value]


def dense_weight(w: AnyWeight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Any weight container → dense [N, K] of dtype (float32 math, one rounding)."""
    if isinstance(w, NVFP4Weight):
        return w.dequantize(dtype)
    if isinstance(w, FP8BlockWeight):
        return dequantize_fp8_block(w, dtype)
    return w.to(dtype)


def convert_weight(w: AnyWeight, weight_format: str, device) -> AnyWeight:
    """Move `w` to `device` and convert it to `weight_format` (module docstring: the rules)."""
    _check_format("convert_weight", weight_format)
    if weight_format == "nvfp4":
        if isinstance(w, NVFP4Weight):
            return w.to(device)
        return quantize_nvfp4(dense_weight(w.to(device), torch.bfloat16))
    if weight_format == "fp8":
        if isinstance(w, FP8BlockWeight):
            return w.to(device)
        return quantize_fp8_block(dense_weight(w.to(device), torch.bfloat16))
    return dense_weight(w.to(device), torch.bfloat16).contiguous()


def _check_format(op: str, weight_format) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"{op}: weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")


# =============================================================================================
# Linear
# =============================================================================================

class Linear:
    """One projection W[N, K] (no bias) running in its weight's format.

    Args:
        weight: torch.Tensor bf16 [N, K] ("bf16"), FP8BlockWeight ("fp8") or NVFP4Weight
            ("nvfp4"); the format is the container's. Use `from_state_dict` / `from_weight` to
            build one from a checkpoint dialect with conversion.
    Call:
        y = linear(x): x [T, K] bf16 → y [T, N] bf16 (module docstring: which path for which T).
    Example:
        >>> lin = Linear.from_weight(torch.randn(32, 64), "nvfp4", "cpu")
        >>> lin(torch.randn(3, 64, dtype=torch.bfloat16)).shape
        torch.Size([3, 32])
    """

    def __init__(self, weight: AnyWeight):
        if isinstance(weight, NVFP4Weight):
            self.weight_format = "nvfp4"
            weight.prepare_gemv()        # the tiled layout the decode GEMV streams (CUDA, K % 128 == 0)
        elif isinstance(weight, FP8BlockWeight):
            self.weight_format = "fp8"
            weight.derived("bf16", lambda q: dequantize_fp8_block(q, torch.bfloat16))
        elif isinstance(weight, Tensor):
            check_tensor("Linear", "weight", weight, dtype=torch.bfloat16, ndim=2, what="bf16 [N, K]")
            weight = weight.contiguous()
            self.weight_format = "bf16"
        else:
            raise TypeError(f"Linear: weight must be a bf16 Tensor, FP8BlockWeight or NVFP4Weight, "
                            f"got {type(weight).__name__}")
        self.weight = weight
        self.out_features, self.in_features = weight_shape(weight)

    @classmethod
    def from_weight(cls, weight: AnyWeight, weight_format: str, device) -> "Linear":
        """Any container (or a float tensor) → Linear in `weight_format` on `device`."""
        return cls(convert_weight(weight, weight_format, device))

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Tensor], prefix: str, weight_format: str,
                        device, *, shape: Sequence[int] | None = None) -> "Linear":
        """The module at `prefix` (keys `{prefix}weight`, ...; dialect detected from them),
        converted to `weight_format` on `device`. `shape` = expected (N, K): ValueError naming
        the module when it differs."""
        lin = cls.from_weight(load_weight(state_dict, prefix), weight_format, device)
        if shape is not None and (lin.out_features, lin.in_features) != tuple(shape):
            raise ValueError(f"linear: '{prefix}' must have shape [N, K] = {list(shape)}, "
                             f"got {[lin.out_features, lin.in_features]}")
        return lin

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Weight bytes one forward streams: NVFP4 N·K·9/16 (+4), BF16 and FP8 (its cached BF16
        copy) 2·N·K."""
        if self.weight_format == "nvfp4":
            return self.weight.nbytes
        return 2 * self.out_features * self.in_features

    def dense(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The weight as a dense [N, K] tensor (what an HF module would be given)."""
        return dense_weight(self.weight, dtype)

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, K] bf16 → [T, N] bf16."""
        check_tensor("Linear", "x", x, dtype=torch.bfloat16, shape=(None, self.in_features),
                     device=self.device, what="bf16 [T, K]")
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self.weight_format == "bf16":
            return F.linear(x, self.weight)
        if self.weight_format == "fp8":
            return F.linear(x, self.weight.derived("bf16", None))
        if x.shape[0] <= GEMV_CHUNKED_MAX_ROWS:
            return gemv(x.contiguous(), self.weight)
        return nvfp4_gemm(x, self.weight)

    def __repr__(self) -> str:
        return f"Linear({self.weight_format}, N={self.out_features}, K={self.in_features})"


def _row_chunks(t: int) -> list[tuple[int, int]]:
    return [(r, min(t, r + GEMV_MAX_ROWS)) for r in range(0, t, GEMV_MAX_ROWS)]


def gemv(x: Tensor, q: NVFP4Weight) -> Tensor:
    """atlas.ops.w4a16_gemv: x [T, K] bf16 (contiguous), q [N, K] → [T, N] bf16, one launch per
    32 rows, each chunk written in place."""
    t = x.shape[0]
    if t <= GEMV_MAX_ROWS:
        return ops.w4a16_gemv(x, q)
    y = torch.empty(t, q.shape[0], dtype=torch.bfloat16, device=x.device)
    for r0, r1 in _row_chunks(t):
        ops.w4a16_gemv(x[r0:r1], q, out=y[r0:r1])
    return y


def gemv_dual(x: Tensor, q1: NVFP4Weight, q2: NVFP4Weight, *, qg_head_dim: int = 0) -> tuple[Tensor, Tensor]:
    """atlas.ops.w4a16_gemv_dual: two weights (each with its own global scale) read in one launch
    per 32 rows of x [T, K] → ([T, N1], [T, N2]) bf16; qg_head_dim > 0 stores y1 as
    [Q all heads | G all heads] (a gated q_proj, see ops.w4a16_gemv_dual)."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return ops.w4a16_gemv_dual(x, q1, q2, qg_head_dim=qg_head_dim)
    parts = [ops.w4a16_gemv_dual(x[r0:r1], q1, q2, qg_head_dim=qg_head_dim) for r0, r1 in _row_chunks(x.shape[0])]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def nvfp4_gemm(x: Tensor, q: NVFP4Weight) -> Tensor:
    """x [T, K] bf16 · dequant(q)ᵀ → [T, N] bf16 through torch (cuBLAS on the GPU), dequantizing
    ≤ 8 M weights at a time into a BF16 scratch so no full BF16 copy of the weight is kept."""
    n, k = q.shape
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    rows = max(1, _GEMM_CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = reference.dequantize_nvfp4(q.packed[r0:r1], q.block_scale[r0:r1], q.global_scale,
                                       torch.bfloat16)
        y[:, r0:r1] = x @ w.t()
    return y


def load_linears(state_dict: Mapping[str, Tensor], prefixes: Sequence[str], weight_format: str,
                 device, *, share_global_scale: bool = False) -> list[Linear]:
    """Several modules that read the same input (k_proj and v_proj, gate_proj and up_proj).

    With `share_global_scale` and weight_format "nvfp4", modules that must be QUANTIZED here
    (they arrived as BF16 or FP8) are quantized together — one global scale = amax over all of
    them, as ModelOpt / llm-compressor exports do — so they can run as one fused launch.
    Modules that arrived as NVFP4 are used as they are (their global scales may differ)."""
    _check_format("load_linears", weight_format)
    src = [load_weight(state_dict, p) for p in prefixes]
    if (share_global_scale and weight_format == "nvfp4" and len(src) > 1
            and not any(isinstance(w, NVFP4Weight) for w in src)):
        dense = [dense_weight(w.to(device), torch.bfloat16) for w in src]
        if len({d.shape[1] for d in dense}) == 1:
            joint = quantize_nvfp4(torch.cat(dense, 0))
            out, r0 = [], 0
            for d in dense:
                out.append(Linear(joint.rows(r0, r0 + d.shape[0])))
                r0 += d.shape[0]
            return out
    return [Linear.from_weight(w, weight_format, device) for w in src]
