"""bench_moe_router: the MoE router from hidden states — ops.moe_router (router GEMV + top-k in one
launch) beside the unfused path it replaces (cuBLAS F.linear, then ops.moe_route) and the GEMV
alone, CUDA-graph replayed, L2-warm (as in a decode step's graph: 1 MB of gate rows) and cold
(gate copies rotated past the L2).

    python bench/bench_moe_router.py

Shapes: [router | shared gate] of Qwen3.5/3.6-35B-A3B (R = 257, h = 2048, top-8, shared slot)
and Qwen3-Next-80B-A3B (R = 513, h = 2048, top-10); T ∈ {1, 8, 32} tokens.
Floor: (R·h + T·h + T·R)·2 bytes / measured copy bandwidth — far below one launch: the op is
latency-bound, the point is one launch with programmatic dependent launch instead of two.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from atlas import ops  # noqa: E402
from common import Rotator, floor_us, require_kernels, rotation_count, time_cuda_graph, write_results  # noqa: E402

MODELS = [("35B-A3B", 256, 8, 2048), ("Qwen3-Next-80B", 512, 10, 2048)]   # (name, E, k, h); + shared gate
TOKENS = [1, 8, 32]


def main() -> None:
    require_kernels("bench_moe_router")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, e, k, h in MODELS:
        r = e + 1
        nbytes = r * h * 2
        copies = rotation_count(nbytes)
        gates = [(torch.randn(r, h, device=dev, generator=g) * h ** -0.5).bfloat16() for _ in range(copies)]
        for t in TOKENS:
            x = torch.randn(t, h, device=dev, generator=g).bfloat16()
            fused = lambda i: ops.moe_router(x, gates[i], k, num_experts=e, shared_slot=True)  # noqa: E731
            unfused = lambda i: ops.moe_route(F.linear(x, gates[i]), k, shared_slot=True)   # noqa: E731
            gemv = lambda i: F.linear(x, gates[i])                                           # noqa: E731
            row = dict(model=name, R=r, h=h, k=k, T=t, floor_us=floor_us(nbytes + (t * h + t * r) * 2))
            for label, fn in (("moe_router", fused), ("F.linear+moe_route", unfused), ("F.linear", gemv)):
                row[f"{label}_warm_us"] = time_cuda_graph(lambda fn=fn: fn(0))
                row[f"{label}_cold_us"] = time_cuda_graph(Rotator(copies, fn), calls_per_graph=copies)
            row["speedup_warm"] = row["F.linear+moe_route_warm_us"] / row["moe_router_warm_us"]
            rows.append(row)
    write_results("bench_moe_router", rows, meta=dict(
        note="graph-replayed µs per call; warm = one gate matrix (L2-resident), cold = rotated copies; "
             "peer = cuBLAS F.linear then ops.moe_route"))


if __name__ == "__main__":
    main()
