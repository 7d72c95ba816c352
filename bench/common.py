"""Timing and reporting helpers shared by every bench script (GPU only).

Rules (../shared/STYLE.md, METHOD.md): CUDA events, warm-up, medians, CUDA-graph replay for
small launches, L2 defeated by rotating inputs, and every time shown beside the floor =
bytes moved / measured copy bandwidth.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Callable, Sequence

import torch

from atlas import _timing
from atlas._timing import time_events  # noqa: F401  (the bench scripts import it from here)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
L2_BYTES = 60 * 2**20  # H200 L2 (read off the device in gpu_name(); this is the fallback)


def gpu_name() -> str:
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"


def time_cuda_graph(fn: Callable[[], object], *, warmup: int = 3, iters: int = 20,
                    calls_per_graph: int = 20) -> float:
    """Median µs per fn() call, with `calls_per_graph` calls captured in one CUDA graph and the
    graph replayed `iters` times (launch gaps shrink to what a decode step's graph sees).
    fn must be capturable (no host syncs, no allocations that change between calls)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    del graph
    return statistics.median(times)


def rotation_count(bytes_per_copy: int, *, budget_bytes: int = 2 * 2**30) -> int:
    """How many copies of an input to rotate through so the set is ≥ 4× the L2 (and ≤ budget)."""
    want = max(1, -(-4 * L2_BYTES // max(bytes_per_copy, 1)))
    return int(max(1, min(want, budget_bytes // max(bytes_per_copy, 1))))


class Rotator:
    """Calls fn(i) with i cycling over n input sets: with n copies whose total exceeds the L2,
    each call reads from device memory, not from the cache."""

    def __init__(self, n: int, fn: Callable[[int], object]):
        self.n, self.fn, self.i = n, fn, 0

    def __call__(self):
        out = self.fn(self.i)
        self.i = (self.i + 1) % self.n
        return out


_COPY_BW: float | None = None


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read + written (the
    ceiling every floor in bench/ divides by; ≈ 4300 GB/s on the H200)."""
    global _COPY_BW
    if _COPY_BW is None:
        _COPY_BW = _timing.copy_bandwidth_gbs(nbytes)
    return _COPY_BW


def floor_us(nbytes: float) -> float:
    """µs to move nbytes at the measured copy bandwidth."""
    return nbytes / (copy_bandwidth_gbs() * 1e9) * 1e6


def write_results(name: str, rows: Sequence[dict], meta: dict | None = None,
                  columns: Sequence[str] | None = None) -> str:
    """Write bench/results/<name>.json and .md (a table, GPU named) and print the table.
    Returns the markdown text."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    meta = dict(meta or {})
    if torch.cuda.is_available():
        meta.setdefault("gpu", gpu_name())
        meta.setdefault("copy_bandwidth_gbs", round(copy_bandwidth_gbs(), 1))
    meta.setdefault("torch", torch.__version__)
    columns = list(columns or (rows[0].keys() if rows else []))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = [f"# {name}", "", " · ".join(f"{k}: {v}" for k, v in meta.items()), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": list(rows)}, f, indent=1)
    print(text, flush=True)
    return text


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU; nothing to measure here", file=sys.stderr)
        sys.exit(0)


def require_kernels(script: str) -> None:
    """require_cuda, and the atlas._C extension built (else exit 0 with a message)."""
    require_cuda(script)
    import atlas
    if not atlas.kernels_available():
        print(f"{script}: atlas._C not built; nothing to measure", file=sys.stderr)
        sys.exit(0)
