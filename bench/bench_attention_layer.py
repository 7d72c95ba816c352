"""bench_attention_layer: one decode step of one Qwen3AttentionLayer (NVFP4 projections, paged KV)
at Qwen3.6-35B-A3B and Qwen3.5-27B attention shapes, eager and CUDA-graph replayed, against the
floor and against the same layer built from the HF module (BF16 weights, torch SDPA).

    python bench/bench_attention_layer.py [--quick] [--iters N]

Grid: model {35b-a3b: h 2048, 16/2 heads; 27b: h 5120, 24/4 heads; hd 256, gated, partial RoPE}
× B ∈ {1, 8, 32} × L ∈ {1K, 32K} cached tokens × KV {bf16, fp8}. --quick: 35b-a3b, B ∈ {1, 8}.

Floor = (projection weight bytes (NVFP4: N·K·9/16 for q, k, v, o) + KV bytes read
(B·(L+1)·nkv·hd·2 (K and V)·elem, + FP8 scales B·(L+1)·nkv·2·4)) / measured copy bandwidth.
35b-a3b, B = 1, L = 32K, BF16 KV: 15.3 MB + 67.1 MB = 82.4 MB → 19.2 µs at 4.3 TB/s.
Goal: graph-replayed step within 1.5× of the floor at B = 1, L = 32K.

Implementations, same random weights and the same cached context:
  atlas-eager   attn(hidden, meta, cache, layer) launched eagerly (Python + launch overhead)
  atlas-graph   the same call captured in a CUDA graph and replayed (bench/common.time_cuda_graph)
  hf-graph      transformers' Qwen3_5MoeAttention in BF16 (dense weights = the NVFP4 weights
                dequantized) with a static contiguous KV cache [B, nkv, L+1, hd] and torch SDPA,
                captured in a CUDA graph (RoPE tables computed outside). BF16 KV only.
L2: every implementation rotates over n layer copies (own weights, own KV pools), n from
bench/common.rotation_count, so each step reads device memory as a real model's next layer
would. The cached context is random data written straight into the pools (blocks allocated by
cache.plan), not computed by a prefill: only its bytes matter here.
Breakdown (bench_attention_layer_parts): at B = 1, L = 32K each launch of the graph-replayed step
timed alone (same rotation), so the step's distance from the floor can be attributed: projections
(one w4a16_gemv_dual, q|gate de-interleaved on the store), qk_norm_rope, paged_decode with the
output gate on its stores, o_proj (plain GEMV); plus, for comparison, the two launches the gated
paged_decode replaced (ungated paged_decode, sigmoid_gate_mul), which are not part of the step, and
the whole step both ways (as the layer runs it; with the gate as its own launch).
Writes bench/results/bench_attention_layer.{md,json} and bench_attention_layer_parts.{md,json}.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

import atlas  # noqa: E402
from atlas import ops  # noqa: E402
from atlas.kv_cache import PagedKvCache  # noqa: E402
from atlas.layers.attention import Qwen3AttentionLayer, hf_attention  # noqa: E402
from atlas.testing import paged_decode_gate_as_own_launch  # noqa: E402
from common import (Rotator, copy_bandwidth_gbs, floor_us, require_cuda, rotation_count,  # noqa: E402
                    time_cuda_graph, time_events, write_results)

FIXTURES = os.path.join(os.path.dirname(HERE), "tests", "fixtures")
MODELS = {"35b-a3b": "qwen3_6_35b_a3b.json", "27b": "qwen3_5_27b.json"}
BATCHES = [1, 8, 32]
LENGTHS = [1024, 32768]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
MAX_COPIES = 16
MEMORY_BUDGET = 40 * 2**30      # all rotated copies of one grid point (weights + KV pools)
CALLS_PER_GRAPH = 16            # steps per captured graph (copies cycled): the graph launch is amortized
                                # (v1 captured n = 1..16 copies once, so n = 1..2 points carried 2–4 µs of it)


def random_layer(cfg, seed: int) -> Qwen3AttentionLayer:
    """Random BF16 attention weights (unit-RMS rows) quantized to NVFP4 at load (K and V with one
    global scale, so they run fused, as ModelOpt exports do)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"q_proj": (nq * hd * 2, h), "k_proj": (nkv * hd, h), "v_proj": (nkv * hd, h), "o_proj": (h, nq * hd)}
    sd = {f"{n}.weight": (torch.randn(*s, generator=g, device="cuda") / s[1] ** 0.5).to(torch.bfloat16)
          for n, s in shapes.items()}
    for n in ("q_norm", "k_norm"):
        sd[f"{n}.weight"] = (0.1 * torch.randn(hd, generator=g, device="cuda")).to(torch.bfloat16)
    return Qwen3AttentionLayer.from_state_dict(cfg, sd, "", "nvfp4", "cuda")


def kv_bytes(cfg, b: int, n: int, kv: str) -> int:
    elem = 2 if kv == "bf16" else 1
    scales = 0 if kv == "bf16" else b * n * cfg.num_key_value_heads * 2 * 4
    return b * n * cfg.num_key_value_heads * cfg.head_dim * 2 * elem + scales


def fill_pools(cache: PagedKvCache) -> None:
    """Random K/V in every pool (finite: bf16 normal; fp8 bytes below the NaN code, scales 1/64)."""
    for i in range(cache.num_layers):
        k, v, ks, vs = cache.layer(i)
        for pool in (k, v):
            if pool.dtype == torch.bfloat16:
                pool.normal_()
            else:
                pool.view(torch.uint8).random_(0, 0x7E)
        for s in (ks, vs):
            if s is not None:
                s.fill_(1 / 64)


class HfStaticCache:
    """The minimal cache object HF attention modules call: a contiguous [B, nkv, L+1, hd] K/V per
    layer with the context already in place; update() writes the new token at position L."""

    def __init__(self, b, nkv, length, hd):
        self.k = torch.randn(b, nkv, length + 1, hd, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        self.length = length

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.k[:, :, self.length:self.length + 1].copy_(key)
        self.v[:, :, self.length:self.length + 1].copy_(value)
        return self.k, self.v


def bench_point(cfg, layers, b: int, length: int, kv: str, iters: int) -> dict:
    nkv, hd, h = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    weight_bytes = layers[0].weight_nbytes
    step_bytes = weight_bytes + kv_bytes(cfg, b, length + 1, kv)
    n = min(len(layers), rotation_count(step_bytes), max(1, MEMORY_BUDGET // step_bytes))
    bs = 16
    width = -(-(length + 1) // bs)
    cache = PagedKvCache(cfg, n, b * width + 1, KV_DTYPES[kv], "cuda", block_size=bs)
    fill_pools(cache)
    seqs = list(range(b))
    cache.plan({s: length for s in seqs}, max_blocks_per_seq=width)      # the context's blocks
    meta = cache.plan({s: 1 for s in seqs}, max_blocks_per_seq=width)    # this decode step
    hidden = torch.randn(b, h, device="cuda").to(torch.bfloat16)
    step = Rotator(n, lambda i: layers[i](hidden, meta, cache, i))
    eager = time_events(step, warmup=3, iters=iters)
    graph = time_cuda_graph(step, warmup=2, iters=iters, calls_per_graph=max(CALLS_PER_GRAPH, n))
    floor = floor_us(step_bytes)
    row = dict(model=cfg.model_type, B=b, L=length, kv=kv, copies=n,
               weights_mb=round(weight_bytes / 1e6, 1), kv_mb=round(kv_bytes(cfg, b, length + 1, kv) / 1e6, 1),
               floor_us=floor, eager_us=eager, graph_us=graph, graph_over_floor=graph / floor,
               graph_tbs=step_bytes / graph / 1e6)
    del cache
    torch.cuda.empty_cache()
    return row


@contextlib.contextmanager
def gate_as_own_launch(enabled: bool):
    """While enabled, the layer's gated paged_decode calls run ungated, then sigmoid_gate_mul."""
    real = ops.paged_decode
    if enabled:
        ops.paged_decode = paged_decode_gate_as_own_launch
    try:
        yield
    finally:
        ops.paged_decode = real


def bench_parts(cfg, layers, length: int, kv: str, iters: int) -> list[dict]:
    """Each launch of a B = 1 decode step timed alone under graph replay, rotated like the step."""
    nq, nkv, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    step_bytes = layers[0].weight_nbytes + kv_bytes(cfg, 1, length + 1, kv)
    n = min(len(layers), rotation_count(step_bytes), max(1, MEMORY_BUDGET // step_bytes))
    bs, width = 16, -(-(length + 1) // 16)
    cache = PagedKvCache(cfg, n, width + 1, KV_DTYPES[kv], "cuda", block_size=bs)
    fill_pools(cache)
    cache.plan({0: length}, max_blocks_per_seq=width)
    meta = cache.plan({0: 1}, max_blocks_per_seq=width)
    x = torch.randn(1, h, device="cuda").to(torch.bfloat16)
    y, kvp = ops.w4a16_gemv_dual(x, layers[0].q_proj.weight, layers[0].kv_weight, qg_head_dim=hd)
    q, gate = y[:, :nq * hd].view(1, nq, hd), y[:, nq * hd:]            # [1, Q | G] as in the layer
    k, v = kvp[:, :nkv * hd].view(1, nkv, hd), kvp[:, nkv * hd:].view(1, nkv, hd)
    a = layers[0]
    qn = ops.qk_norm_rope(q, k, v, a.q_norm_weight, a.k_norm_weight, meta.positions, *cache.layer(0)[:2],
                          meta.slot_mapping, *cache.layer(0)[2:], **a.norm_kwargs)
    gate = gate.view(1, nq, hd)
    o = ops.paged_decode(qn, *cache.layer(0)[:2], meta.block_tables, meta.seq_lens, a.softmax_scale,
                         *cache.layer(0)[2:])
    og = ops.sigmoid_gate_mul(o, gate).view(1, nq * hd)
    parts = {
        "projections (dual gemv)": (lambda i: ops.w4a16_gemv_dual(x, layers[i].q_proj.weight, layers[i].kv_weight,
                                                                  qg_head_dim=hd),
                                    a.q_proj.nbytes + a.k_proj.nbytes + a.v_proj.nbytes),
        "qk_norm_rope": (lambda i: ops.qk_norm_rope(q, k, v, layers[i].q_norm_weight, layers[i].k_norm_weight,
                                                    meta.positions, *cache.layer(i)[:2], meta.slot_mapping,
                                                    *cache.layer(i)[2:], **a.norm_kwargs), 0),
        "paged_decode (gated)": (lambda i: ops.paged_decode(qn, *cache.layer(i)[:2], meta.block_tables,
                                                            meta.seq_lens, a.softmax_scale, *cache.layer(i)[2:],
                                                            gate=gate),
                                 kv_bytes(cfg, 1, length + 1, kv)),
        "o_proj (gemv)": (lambda i: ops.w4a16_gemv(og, layers[i].o_proj.weight), a.o_proj.nbytes),
        "replaced: paged_decode (ungated)": (lambda i: ops.paged_decode(qn, *cache.layer(i)[:2], meta.block_tables,
                                                                        meta.seq_lens, a.softmax_scale,
                                                                        *cache.layer(i)[2:]),
                                             kv_bytes(cfg, 1, length + 1, kv)),
        "replaced: sigmoid_gate_mul": (lambda i: ops.sigmoid_gate_mul(o, gate), 0),
    }
    rows = []
    for name, (fn, nbytes) in parts.items():
        us = time_cuda_graph(Rotator(n, fn), warmup=2, iters=iters, calls_per_graph=max(CALLS_PER_GRAPH, n))
        rows.append(dict(model=cfg.model_type, L=length, kv=kv, part=name, us=us,
                         floor_us=floor_us(nbytes) if nbytes else 0.0))
    # The whole step as the layer runs it, and with the output gate as its own launch after an
    # ungated paged_decode (the routing before the gate moved into paged_decode): A/B in one run.
    step_floor = floor_us(step_bytes)
    for name, unfused in (("whole step", False), ("whole step, gate as sigmoid_gate_mul", True)):
        with gate_as_own_launch(unfused):
            us = time_cuda_graph(Rotator(n, lambda i: layers[i](x, meta, cache, i)), warmup=2, iters=iters,
                                 calls_per_graph=max(CALLS_PER_GRAPH, n))
        rows.append(dict(model=cfg.model_type, L=length, kv=kv, part=name, us=us, floor_us=step_floor))
    del cache
    torch.cuda.empty_cache()
    return rows


def bench_hf(cfg, layers, b: int, length: int, iters: int) -> float:
    """Graph-replayed µs of the HF module's decode step (BF16 weights and KV, SDPA)."""
    step_bytes = 2 * layers[0].weight_nbytes * 16 // 9 + kv_bytes(cfg, b, length + 1, "bf16")
    n = min(len(layers), rotation_count(step_bytes), max(1, MEMORY_BUDGET // step_bytes))
    mods = [hf_attention(cfg, layers[i], dtype=torch.bfloat16, device="cuda") for i in range(n)]
    caches = [HfStaticCache(b, cfg.num_key_value_heads, length, cfg.head_dim) for _ in range(n)]
    x = torch.randn(b, 1, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    cos, sin = mods[0][1](x, torch.full((b, 1), length, device="cuda"))
    key = "cache" if "cache" in inspect.signature(mods[0][0].forward).parameters else "past_key_values"

    def run(i):
        with torch.no_grad():
            return mods[i][0](x, (cos, sin), None, **{key: caches[i]})[0]

    us = time_cuda_graph(Rotator(n, run), warmup=2, iters=iters, calls_per_graph=max(CALLS_PER_GRAPH, n))
    del mods, caches
    torch.cuda.empty_cache()
    return us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="35b-a3b only, B in {1, 8}")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    require_cuda("bench_attention_layer")
    models = ["35b-a3b"] if args.quick else list(MODELS)
    batches = [1, 8] if args.quick else BATCHES
    rows, parts = [], []
    for name in models:
        cfg = atlas.ModelConfig.from_hf(os.path.join(FIXTURES, MODELS[name]))
        layers = [random_layer(cfg, seed) for seed in range(MAX_COPIES)]
        for kv in KV_DTYPES:
            for r in bench_parts(cfg, layers, LENGTHS[-1], kv, args.iters):
                parts.append(dict(r, model=name))
        for b in batches:
            for length in LENGTHS:
                try:
                    hf_us = bench_hf(cfg, layers, b, length, args.iters)
                except Exception as e:   # the baseline must not take the atlas rows down with it
                    print(f"HF baseline failed at B={b} L={length}: {type(e).__name__}: {e}", flush=True)
                    hf_us = float("nan")
                    torch.cuda.empty_cache()
                for kv in KV_DTYPES:
                    row = bench_point(cfg, layers, b, length, kv, args.iters)
                    row["model"] = name
                    row["hf_graph_us"] = hf_us
                    row["speedup_vs_hf"] = hf_us / row["graph_us"]
                    rows.append(row)
                    print(f"{name} B={b} L={length} {kv}: graph {row['graph_us']:.1f} µs "
                          f"({row['graph_over_floor']:.2f}× floor), eager {row['eager_us']:.1f} µs, "
                          f"HF {hf_us:.1f} µs", flush=True)
        del layers
        torch.cuda.empty_cache()
    write_results("bench_attention_layer_parts", parts,
                  meta={"what": "each launch of a B=1, L=32K decode step alone, graph-replayed"})
    write_results("bench_attention_layer", rows,
                  meta={"what": "one decode step of one attention layer, NVFP4 projections",
                        "goal": "graph_us <= 1.5 x floor at B=1, L=32K",
                        "copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 1)})


if __name__ == "__main__":
    main()
