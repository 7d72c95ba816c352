"""FP8 block-scaled weight container (Qwen FP8 checkpoints) and its (de)quantization.

Layout (DESIGN "Formats", fixed): W[N, K]
    weight            float8_e4m3fn  [N, K]
    weight_scale_inv  float32        [ceil(N/128), ceil(K/128)]   one scale per 128×128 block
    W[n, k] = float(weight[n, k]) · weight_scale_inv[n // 128, k // 128]
The name says "inv" because the checkpoint stores the dequantization multiplier (the inverse
of the quantization scale), exactly as DeepSeek-V3 / Qwen3 FP8 exports do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from atlas import reference
from atlas._validate import check_tensor

FP8_BLOCK = 128                      # rows and columns per scale block in Qwen FP8 checkpoints
FP8_MAX = reference.E4M3_MAX         # 448: largest finite E4M3 magnitude
_DEQUANT_CHUNK_ELEMS = 1 << 24       # dequantize in row chunks of ≤ 16 M weights (64 MB fp32 temp)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class FP8BlockWeight:
    """A Qwen FP8 block-scaled weight W[N, K] in the checkpoint layout.

    Attributes:
        weight: float8_e4m3fn [N, K].
        weight_scale_inv: float32 [ceil(N/128), ceil(K/128)], W = fp8 · scale of the block.
    Kernels or layers that want another device layout (e.g. a BF16 copy for cuBLAS) derive it
    once through `derived()`; the tensors above are never changed.

    Example:
        >>> q = FP8BlockWeight(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(1, 1))
        >>> q.shape
        (4, 8)
    """

    weight: Tensor
    weight_scale_inv: Tensor
    _derived: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        op = "FP8BlockWeight"
        check_tensor(op, "weight", self.weight, dtype=torch.float8_e4m3fn, ndim=2, what="e4m3 [N, K]")
        n, k = self.weight.shape
        check_tensor(op, "weight_scale_inv", self.weight_scale_inv, dtype=torch.float32,
                     shape=(_ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK)), device=self.weight.device,
                     what="float32 [ceil(N/128), ceil(K/128)]")
        self.weight = self.weight.contiguous()
        self.weight_scale_inv = self.weight_scale_inv.contiguous()

    @classmethod
    def from_checkpoint(cls, weight: Tensor, weight_scale_inv: Tensor) -> "FP8BlockWeight":
        """Qwen FP8 tensors as stored (`weight`, `weight_scale_inv`), with the load-time value
        check: scales must be finite and ≥ 0 (ValueError otherwise; reads one flag back)."""
        q = cls(weight, weight_scale_inv)
        s = q.weight_scale_inv
        if not bool((torch.isfinite(s) & (s >= 0)).all()):
            raise ValueError("FP8BlockWeight: weight_scale_inv must be finite and >= 0, "
                             "got NaN, Inf or negative values")
        return q

    # ---- properties -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.weight.shape[1])

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """Bytes of the checkpoint form: N·K (e4m3) + 4 per 128×128 block."""
        return self.weight.numel() + 4 * self.weight_scale_inv.numel()

    def to(self, device) -> "FP8BlockWeight":
        return FP8BlockWeight(self.weight.to(device), self.weight_scale_inv.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_fp8_block(self, dtype)

    def derived(self, name: str, make: Callable[["FP8BlockWeight"], object]):
        """A device layout derived once from this weight and cached under `name`."""
        if name not in self._derived:
            self._derived[name] = make(self)
        return self._derived[name]


def dequantize_fp8_block(q: FP8BlockWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """FP8BlockWeight → dense [N, K] of dtype: float32 product fp8 · scale, rounded once to dtype.

    Works in chunks of whole 128-row blocks so the float32 temporary stays ≤ 64 MB."""
    if not isinstance(q, FP8BlockWeight):
        raise TypeError(f"dequantize_fp8_block: q must be an FP8BlockWeight, got {type(q).__name__}")
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    rows_per_chunk = max(FP8_BLOCK, (_DEQUANT_CHUNK_ELEMS // max(k, 1)) // FP8_BLOCK * FP8_BLOCK)
    col_scale_idx = torch.arange(k, device=q.device) // FP8_BLOCK                  # [K]
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        row_scale_idx = torch.arange(r0, r1, device=q.device) // FP8_BLOCK         # [r]
        scale = q.weight_scale_inv[row_scale_idx][:, col_scale_idx]                 # [r, K] f32
        out[r0:r1] = (q.weight[r0:r1].float() * scale).to(dtype)
    return out


def quantize_fp8_block(w: Tensor) -> FP8BlockWeight:
    """Quantize a float weight [N, K] to the Qwen FP8 block format (tests, format conversion).

    Per 128×128 block: scale = amax(|block|) / 448 (1.0 for an all-zero block), element =
    e4m3_rne_satfinite(x / scale). Partial edge blocks use their own amax. Raises ValueError
    for NaN/Inf input (load-time op: reads one flag back)."""
    op = "quantize_fp8_block"
    check_tensor(op, "w", w, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                 what="[N, K] float")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{op}: w must be finite, got NaN or Inf values")
    n, k = w.shape
    nb, kb = _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK)
    padded = torch.zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK)                              # [nb, 128, kb, 128]
    amax = blocks.abs().amax(dim=(1, 3))                                            # [nb, kb]
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = reference.e4m3_rne_satfinite(blocks / scale[:, None, :, None])
    q = q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous()
    return FP8BlockWeight(q, scale.contiguous())
