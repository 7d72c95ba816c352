"""CUDA-event timing shared by ``python -m atlas draft-bench`` and bench/: medians of device
work between event pairs, and the measured copy bandwidth every floor divides by."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_events(fn: Callable[[], object], *, warmup: int = 10, iters: int = 50,
                setup: Callable[[], object] | None = None) -> float:
    """Median µs of fn() between CUDA events, one event pair per call (fn: device work only,
    e.g. a graph replay or eager launches). setup (optional) runs before each call, outside the
    events (e.g. l2_flusher(): every call then starts from a cold L2)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30, iters: int = 20) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read + written: one
    copy of nbytes / 2 bytes, timed by time_events (≈ 4100–4300 GB/s on the H200)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_events(lambda: dst.copy_(src), warmup=3, iters=iters)
    del src, dst
    return 2 * (nbytes // 2) / (us * 1e-6) / 1e9


def l2_flusher(device: torch.device | str = "cuda") -> Callable[[], object]:
    """A callable that reads twice the device's L2 worth of a buffer (reads, so the lines it
    leaves are clean: the timed work after it pays no write-back), evicting what was cached."""
    nbytes = 2 * torch.cuda.get_device_properties(device).L2_cache_size
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    return lambda: buf.sum()
