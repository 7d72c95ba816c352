"""bench_gemv: the NVFP4 w4a16_gemv family against cuBLAS BF16 (F.linear) and the copy-bandwidth
floor, CUDA-graph replay, weights rotated over copies so every call reads device memory.

    python bench/bench_gemv.py [--quick]

Shapes (N×K): Qwen3.6-27B q+gate+k+v 14336×5120, o 5120×6144, gate_up 34816×5120, down
5120×17408, lm_head 248320×5120; Qwen3.5/3.6-35B-A3B q+gate 8192×2048 (labelled q+gate+k+v
before session 21; the layer runs it dual with k+v 1024×2048), shared expert
512×2048, o 2048×4096, expert gate_up 1024×2048, expert down 2048×512, lm_head 248320×2048.
Floor = (N·K/2 + N·K/16 weight + scale bytes) / measured copy bandwidth; GB/s counts the same
bytes. Targets (M = 1): ≥ 3.0× cuBLAS where the BF16 weight is ≥ 4 MB, ≤ 2.5 µs below that,
≥ 0.85 of copy bandwidth for weights ≥ 40 MB; M = 8 within 1.25× of M = 1, M = 32 within 2.5×.
Also times the fused variants (qg, dual, silu, gated o_proj) on 27B shapes (gated also on
35B-A3B's o_proj), and draws
results/gemv_bandwidth.png (achieved GB/s vs weight MB, atlas and cuBLAS, per M).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import atlas  # noqa: E402
from atlas import ops  # noqa: E402
from atlas.nvfp4 import NVFP4Weight  # noqa: E402
from common import (RESULTS_DIR, Rotator, copy_bandwidth_gbs, floor_us, require_kernels,  # noqa: E402
                    time_cuda_graph, write_results)

SHAPES = [  # (model, what, N, K)
    ("27B", "q+gate+k+v", 14336, 5120),
    ("27B", "o_proj", 5120, 6144),
    ("27B", "gate_up", 34816, 5120),
    ("27B", "down", 5120, 17408),
    ("27B", "lm_head", 248320, 5120),
    ("35B-A3B", "q+gate", 8192, 2048),
    ("35B-A3B", "shared expert", 512, 2048),
    ("35B-A3B", "o_proj", 2048, 4096),
    ("35B-A3B", "expert gate_up", 1024, 2048),
    ("35B-A3B", "expert down", 2048, 512),
    ("35B-A3B", "lm_head", 248320, 2048),
]
QUICK = {("27B", "q+gate+k+v"), ("27B", "o_proj"), ("27B", "lm_head"), ("35B-A3B", "expert down"),
         ("35B-A3B", "expert gate_up")}
ROWS_M = [1, 8, 32]
MIN_ROTATED_BYTES = 256 * 2**20      # rotate ≥ 8 copies totalling > 200 MB where it fits
MAX_ROTATED_BYTES = 3 * 2**30
MAX_CALLS_PER_GRAPH = 512


def nvfp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def copies_for(nbytes: int) -> int:
    want = max(8, -(-MIN_ROTATED_BYTES // nbytes))
    return int(max(1, min(want, MAX_ROTATED_BYTES // nbytes, MAX_CALLS_PER_GRAPH)))


def random_nvfp4(n: int, k: int, gen: torch.Generator) -> NVFP4Weight:
    """Random codes and finite e4m3 scales (timing does not depend on the values), with the tiled
    GEMV layout derived as the layers do at load (NVFP4Weight.prepare_gemv)."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, device="cuda", dtype=torch.uint8)
    scale = torch.randint(0x20, 0x50, (n, k // 16), generator=gen, device="cuda", dtype=torch.uint8)
    return NVFP4Weight(packed, scale.view(torch.float8_e4m3fn), torch.tensor(1e-3, device="cuda")).prepare_gemv()


def time_rotated(make, call, nbytes: int, iters: int) -> tuple[float, int]:
    """Median µs per call over copies made by make(i), each call on the next copy."""
    n = copies_for(nbytes)
    copies = [make(i) for i in range(n)]
    us = time_cuda_graph(Rotator(n, lambda i: call(copies[i])), warmup=3, iters=iters,
                         calls_per_graph=max(16, n))
    del copies
    torch.cuda.empty_cache()
    return us, n


def bench_shapes(shapes, rows_m, iters):
    bw = copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, what, n, k in shapes:
        nbytes = nvfp4_bytes(n, k)
        bf16_bytes = 2 * n * k
        m1 = {}
        for m in rows_m:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            us, copies = time_rotated(lambda i: random_nvfp4(n, k, gen), lambda q: ops.w4a16_gemv(x, q),
                                      nbytes, iters)
            cub_us, _ = time_rotated(lambda i: torch.randn(n, k, device="cuda", generator=gen).bfloat16(),
                                     lambda w: F.linear(x, w), bf16_bytes, iters)
            m1.setdefault("us", us)
            gbs = nbytes / (us * 1e-6) / 1e9
            rows.append(dict(model=model, proj=what, N=n, K=k, M=m, MB=nbytes / 1e6, us=us,
                             floor_us=floor_us(nbytes), GBps=gbs, frac_copy_bw=gbs / bw,
                             cublas_bf16_us=cub_us, cublas_GBps=bf16_bytes / (cub_us * 1e-6) / 1e9,
                             speedup=cub_us / us, vs_M1=us / m1["us"], copies=copies))
            del x
    return rows


def bench_variants(iters):
    """Fused variants at M = 1 and 8 on 27B shapes (gated o_proj also 35B-A3B's), each next to
    its unfused composition."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    nq, hd, kv, h, inter = 24, 256, 4 * 256, 5120, 17408
    for m in (1, 8):
        x = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
        g = torch.randn(m, inter, device="cuda", generator=gen).bfloat16()
        u = torch.randn(m, inter, device="cuda", generator=gen).bfloat16()

        def gated_case(n_out, k_in):
            """o_proj [n_out, k_in] of bf16(o · sigmoid(G)), G the strided half of a [M, Q | G]
            q_proj output as in the attention layer; unfused = sigmoid_gate_mul + w4a16_gemv."""
            o = torch.randn(m, k_in, device="cuda", generator=gen).bfloat16()
            gate = torch.randn(m, 2 * k_in, device="cuda", generator=gen).bfloat16()[:, k_in:]
            return (f"gated o_proj {n_out}x{k_in}", nvfp4_bytes(n_out, k_in),
                    lambda i: random_nvfp4(n_out, k_in, gen),
                    lambda q: ops.w4a16_gemv_gated(o, gate, q),
                    lambda q: ops.w4a16_gemv(ops.sigmoid_gate_mul(o.view(m, 1, k_in),
                                                                  gate.view(m, 1, k_in)).view(m, k_in), q))

        cases = [
            ("qg 12288x5120", nvfp4_bytes(2 * nq * hd, h), lambda i: random_nvfp4(2 * nq * hd, h, gen),
             lambda q: ops.w4a16_gemv_qg(x, q, nq, hd), lambda q: ops.w4a16_gemv(x, q)),
            ("dual k,v 2x1024x5120", 2 * nvfp4_bytes(kv, h),
             lambda i: (random_nvfp4(kv, h, gen), random_nvfp4(kv, h, gen)),
             lambda qq: ops.w4a16_gemv_dual(x, *qq), lambda qq: (ops.w4a16_gemv(x, qq[0]), ops.w4a16_gemv(x, qq[1]))),
            ("silu down 5120x17408", nvfp4_bytes(h, inter), lambda i: random_nvfp4(h, inter, gen),
             lambda q: ops.w4a16_gemv_silu(g, u, q),
             lambda q: ops.w4a16_gemv(atlas.reference.silu_mul(g, u), q)),
            gated_case(h, nq * hd),            # 27B o_proj 5120x6144
            gated_case(2048, 16 * 256),        # 35B-A3B o_proj 2048x4096
        ]
        for name, nbytes, make, fused, unfused in cases:
            us, _ = time_rotated(make, fused, nbytes, iters)
            un_us, _ = time_rotated(make, unfused, nbytes, iters)
            rows.append(dict(variant=name, M=m, MB=nbytes / 1e6, us=us, floor_us=floor_us(nbytes),
                             frac_copy_bw=nbytes / (us * 1e-6) / 1e9 / copy_bandwidth_gbs(),
                             unfused_us=un_us))
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib is optional
        print(f"bench_gemv: no plot ({e})", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for m, marker in zip(sorted({r["M"] for r in rows}), "os^"):
        rs = sorted((r for r in rows if r["M"] == m), key=lambda r: r["MB"])
        ax.plot([r["MB"] for r in rs], [r["GBps"] for r in rs], marker=marker, label=f"atlas NVFP4, M={m}")
        ax.plot([r["MB"] for r in rs], [r["cublas_GBps"] for r in rs], marker=marker, linestyle="--",
                alpha=0.6, label=f"cuBLAS BF16 (its own bytes), M={m}")
    ax.axhline(copy_bandwidth_gbs(), color="k", linewidth=0.8, label="copy bandwidth")
    ax.set_xscale("log")
    ax.set_xlabel("NVFP4 weight + scale MB")
    ax.set_ylabel("achieved GB/s")
    ax.set_title("w4a16_gemv vs cuBLAS BF16 (CUDA-graph replay, L2 defeated)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"bench_gemv: wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 shapes, M = 1 and 8, no variants")
    parser.add_argument("--m", type=int, nargs="+", help="these M only (results/gemv_m<M…>.md, no variants)")
    args = parser.parse_args()
    require_kernels("bench_gemv")
    shapes = [s for s in SHAPES if (s[0], s[1]) in QUICK] if args.quick else SHAPES
    rows_m = args.m or ([1, 8] if args.quick else ROWS_M)
    iters = 5 if args.quick else 20
    rows = bench_shapes(shapes, rows_m, iters)
    if args.m:
        write_results("gemv_m" + "_".join(map(str, args.m)), rows, meta=dict(timing="as gemv.md"))
        return
    write_results("gemv", rows, meta=dict(
        timing="CUDA-graph replay, median per call; weights rotated over ≥ 8 copies (> 200 MB) where they fit",
        targets="M=1: ≥3x cuBLAS (BF16 ≥ 4 MB), ≤2.5 µs below; ≥0.85 copy bw at ≥40 MB; M=8 ≤1.25x M=1; M=32 ≤2.5x"))
    plot(rows, os.path.join(RESULTS_DIR, "gemv_bandwidth.png"))
    if not args.quick:
        write_results("gemv_variants", bench_variants(iters),
                      meta=dict(timing="CUDA-graph replay, median per call", note="unfused = the composition it replaces"))


if __name__ == "__main__":
    main()
