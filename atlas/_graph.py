"""CUDA-graph capture shared by the layers' captured steps (DecodeGraph, ProposeGraph)."""
from __future__ import annotations

import gc
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(graph: torch.cuda.CUDAGraph, body: Callable[[], T]) -> T:
    """Capture body() into `graph` and return its result (the static outputs).

    Dead reference cycles are collected first, and the cyclic GC stays off during the capture.
    Recent torch no longer collects when a capture begins (only with
    torch.compiler.config.force_cudagraph_gc), so the GC could otherwise run inside the capture
    and free a dead object's CUDA graph and memory pool there — a call not permitted while a
    stream captures, which invalidates this capture (seen on the H200 in session 14: bench_mtp's
    21st propose capture failed once earlier heads, each in a cycle with its ProposeGraphs, had
    been deleted)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()                       # and no collection inside: a cycle may die during body()
    try:
        with torch.cuda.graph(graph):
            return body()
    finally:
        if enabled:
            gc.enable()
