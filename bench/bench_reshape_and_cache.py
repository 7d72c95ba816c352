"""bench_reshape_and_cache: write T tokens' K/V rows into the paged cache (BF16 copy, FP8 with
per-row scales), CUDA-graph replay, achieved GB/s against the measured copy bandwidth.

    python bench/bench_reshape_and_cache.py [--quick]

Shapes: Qwen3-Next-80B / Qwen3.5 (nq 16, nkv 2, hd 256) and Qwen3.5-27B-like (nq 24, nkv 4,
hd 256); key/value are strided views into a fused qkv buffer [T, (nq + 2·nkv)·hd], as the QKV
projection leaves them. Slots follow a real allocation: each sequence's tokens fill shuffled
blocks of 16 in order. Bytes per call = T·nkv·hd·2·(2 + c) + FP8 scales T·nkv·2·4 + slots T·8
(c = 2 BF16 | 1 FP8). Inputs and cache regions rotate over enough sets to exceed the L2 at
large T; at small T the step is launch-bound and L2-resident anyway, as in decode.
Beside each point: torch's own D2D copy of the same traffic (torch_copy_us), graph-replayed the
same way — the fraction of big-copy bandwidth a plain copy reaches at that size.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from atlas import ops  # noqa: E402
from common import (Rotator, copy_bandwidth_gbs, floor_us, require_kernels, rotation_count,  # noqa: E402
                    time_cuda_graph, write_results)

MODELS = [("Qwen3-Next/3.5 nkv2", 16, 2, 256), ("Qwen3.5-27B nkv4", 24, 4, 256)]  # (name, nq, nkv, hd)
TOKENS = [1, 64, 4096, 16384]
BLOCK_SIZE = 16
MAX_CALLS_PER_GRAPH = 200


def step_bytes(t: int, nkv: int, hd: int, dtype: torch.dtype) -> int:
    c = torch.empty((), dtype=dtype).element_size()
    scales = t * nkv * 2 * 4 if dtype == torch.float8_e4m3fn else 0
    return t * nkv * hd * 2 * (2 + c) + scales + t * 8


def same_traffic_copy_us(nbytes: int, iters: int) -> float:
    """Graph-replayed µs of torch's own D2D copy moving the same bytes (nbytes / 2 read, as many
    written), rotated like the op: what a plain copy reaches at this size, next to the big-copy
    bandwidth the fraction is taken against (a one-wave copy pays the same launch/drain)."""
    half = max(16, nbytes // 2 // 16 * 16)
    n = min(rotation_count(2 * half), MAX_CALLS_PER_GRAPH)
    src = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(n)]
    dst = [torch.empty_like(s) for s in src]
    us = time_cuda_graph(Rotator(n, lambda i: dst[i].copy_(src[i])), warmup=3, iters=iters,
                         calls_per_graph=max(20, n))
    del src, dst
    return us


def make_case(t: int, nq: int, nkv: int, hd: int, dtype: torch.dtype):
    """n input sets (qkv views + disjoint slot sets) over one cache big enough for all of them."""
    n = rotation_count(step_bytes(t, nkv, hd, dtype))
    n = min(n, MAX_CALLS_PER_GRAPH)
    blocks_per_set = -(-t // BLOCK_SIZE)
    num_blocks = n * blocks_per_set
    gen = torch.Generator(device="cuda").manual_seed(t * 131 + nkv)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, nkv, hd, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    fp8 = dtype == torch.float8_e4m3fn
    k_scale = torch.zeros(num_blocks, BLOCK_SIZE, nkv, device="cuda") if fp8 else None
    v_scale = torch.zeros_like(k_scale) if fp8 else None
    order = torch.randperm(num_blocks, device="cuda", generator=gen).view(n, blocks_per_set)
    pos = torch.arange(t, device="cuda")
    sets = []
    for i in range(n):
        qkv = torch.randn(t, (nq + 2 * nkv) * hd, device="cuda", generator=gen).bfloat16()
        key = qkv[:, nq * hd:(nq + nkv) * hd].view(t, nkv, hd)
        value = qkv[:, (nq + nkv) * hd:].view(t, nkv, hd)
        slots = (order[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(torch.int64)
        sets.append((key, value, slots))

    def call(i: int):
        key, value, slots = sets[i]
        ops.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)

    return Rotator(n, call), n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T ∈ {1, 4096} only, fewer replays")
    args = parser.parse_args()
    require_kernels("bench_reshape_and_cache")
    tokens = [1, 4096] if args.quick else TOKENS
    iters = 5 if args.quick else 20
    bw = copy_bandwidth_gbs()
    rows = []
    for name, nq, nkv, hd in MODELS:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for t in tokens:
                fn, n = make_case(t, nq, nkv, hd, dtype)
                us = time_cuda_graph(fn, warmup=3, iters=iters,
                                     calls_per_graph=max(20, min(n, MAX_CALLS_PER_GRAPH)))
                nbytes = step_bytes(t, nkv, hd, dtype)
                gbs = nbytes / (us * 1e-6) / 1e9
                copy_us = same_traffic_copy_us(nbytes, iters)
                rows.append(dict(model=name, nkv=nkv, hd=hd, cache="bf16" if dtype == torch.bfloat16 else "fp8",
                                 T=t, MB=nbytes / 1e6, us=us, floor_us=floor_us(nbytes), GBps=gbs,
                                 frac_copy_bw=gbs / bw, torch_copy_us=copy_us, vs_torch_copy=copy_us / us,
                                 rotated_sets=n))
                del fn
                torch.cuda.empty_cache()
    write_results("reshape_and_cache", rows,
                  meta=dict(block_size=BLOCK_SIZE, timing="CUDA-graph replay, median per call",
                            target="≥ 0.80 of copy bandwidth at T ≥ 4096"))


if __name__ == "__main__":
    main()
