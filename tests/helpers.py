"""Helpers shared by the tests (importable as `helpers`: pytest puts tests/ on sys.path)."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN in out gives NaN, which fails every bound)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or 0xFF bytes for integer/fp8 dtypes) before a run."""
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0xFF).view(t.dtype) if t.element_size() == 1 else t.fill_(-1)
