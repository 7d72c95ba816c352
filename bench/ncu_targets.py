"""ncu_targets: one cold call of each named kernel shape inside a cudaProfilerStart/Stop window,
for Nsight Compute (no timing here: timing lives in the bench_*.py scripts).

    ncu --profile-from-start off --clock-control none --cache-control all --csv \
        --metrics $(tr -d "\\n" < bench/ncu_metrics.txt) \
        python bench/ncu_targets.py gemv:248320x5120 gemv:14336x5120:1 paged:1x32768:16/2:bf16

Targets:
  gemv:NxK[:M]             ops.w4a16_gemv, random NVFP4 weight [N, K], x [M, K] (M = 1 default)
  paged:BxL:NQ/NKV:DTYPE   ops.paged_decode, hd 256, page 16, shuffled blocks, DTYPE bf16 | fp8
  moe:T[:E/K/H/I]          ops.moe_experts (its 4 launches), random NVFP4 stacks, T tokens routed
                           top-K of E by random logits through ops.moe_route (default
                           256/8/2048/512: Qwen3.6-35B-A3B)
  router:T[:E/K/H]         ops.moe_router over [E router rows | shared gate] bf16, T tokens, top-K,
                           shared slot (default 256/8/2048)
Each target is called once before the window (instantiation, smem opt-in), then once inside it.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from atlas import ops  # noqa: E402
from bench_attention import Point  # noqa: E402
from bench_gemv import random_nvfp4  # noqa: E402
from common import require_cuda  # noqa: E402


def make(spec: str, gen: torch.Generator):
    kind, _, rest = spec.partition(":")
    parts = rest.split(":")
    if kind == "gemv":
        n, k = (int(v) for v in parts[0].split("x"))
        m = int(parts[1]) if len(parts) > 1 else 1
        w = random_nvfp4(n, k, gen)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        return lambda: ops.w4a16_gemv(x, w)
    if kind == "paged":
        b, length = (int(v) for v in parts[0].split("x"))
        nq, nkv = (int(v) for v in parts[1].split("/"))
        dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[parts[2]]
        pt = Point(b, length, nq, nkv, dtype, sets=1)
        return lambda: pt.atlas(0)
    if kind == "moe":
        t = int(parts[0])
        e, top_k, h, inter = (int(v) for v in parts[1].split("/")) if len(parts) > 1 else (256, 8, 2048, 512)
        stacks = []   # NVFP4 (packed [E, N, K/2], e4m3 [E, N, K/16], f32 [E]): random codes, finite scales
        for n, k in ((inter, h), (inter, h), (h, inter)):
            packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, device="cuda", dtype=torch.uint8)
            scale = torch.randint(0x20, 0x50, (e, n, k // 16), generator=gen, device="cuda", dtype=torch.uint8)
            stacks.append((packed, scale.view(torch.float8_e4m3fn), torch.full((e,), 1e-3, device="cuda")))
        x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(t, e, device="cuda", generator=gen)
        ids, w = ops.moe_route(logits, top_k)
        return lambda: ops.moe_experts(x, ids, w, *stacks)
    if kind == "router":
        t = int(parts[0])
        e, top_k, h = (int(v) for v in parts[1].split("/")) if len(parts) > 1 else (256, 8, 2048)
        x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
        gates = (torch.randn(e + 1, h, device="cuda", generator=gen) * h ** -0.5).bfloat16()
        return lambda: ops.moe_router(x, gates, top_k, shared_slot=True)
    raise SystemExit(f"ncu_targets: unknown target {spec!r} "
                     "(gemv:NxK[:M] | paged:BxL:NQ/NKV:DTYPE | moe:T[:E/K/H/I] | router:T[:E/K/H])")


def main() -> None:
    require_cuda("ncu_targets")
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = [(spec, make(spec, gen)) for spec in sys.argv[1:]]
    for _, fn in calls:
        fn()
    torch.cuda.synchronize()
    for spec, fn in calls:
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"ncu_targets: profiled {spec}", file=sys.stderr)


if __name__ == "__main__":
    main()
