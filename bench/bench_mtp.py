"""MtpHead.propose latency at Qwen3.6-35B-A3B (MoE) and Qwen3.5-27B (dense) MTP shapes.

Grid: model × projections (NVFP4, BF16) × LM-head vocab (full 248 320, truncated 32 768) ×
B ∈ {1, 8, 32} × k ∈ {1, 3}. Each point: B sequences with a 512-token drafter prefill, then the
whole propose (k batched draft positions) captured as one CUDA graph and replayed; reported as
µs per draft position next to the floor.

Floor per draft position = (weight bytes the position must read: fc + attention projections +
FFN (router + the experts B rows hit, at most all; or the dense MLP) + the LM-head prefix, at the
head's format; the LM head is NVFP4 in the NVFP4 rows, BF16 otherwise) + drafter KV bytes read
(B · ctx · nkv · hd · 2 · 2) / measured copy bandwidth. 35B-A3B NVFP4 full vocab, B = 1:
LM head 286 MB + 33 MB of layer weights ≈ 319 MB → ≈ 74 µs at 4.3 TB/s.
Goals: B = 1, k = 1, NVFP4, full vocab within 1.25× of the floor; B = 32 within 2× of B = 1.

Usage: python bench/bench_mtp.py [--quick | --goal | --parts]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import atlas  # noqa: E402
from atlas import ops  # noqa: E402
from atlas.layers.mtp import MtpHead, _draft_metas, random_state_dict  # noqa: E402
from atlas._timing import l2_flusher  # noqa: E402
from common import copy_bandwidth_gbs, floor_us, require_cuda, time_cuda_graph, time_events, write_results  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures")
MODELS = {"35b-a3b": "qwen3_6_35b_a3b.json", "27b": "qwen3_5_27b.json"}
CONTEXT = 512          # drafter prefill per sequence before proposing
TRUNCATED_VOCAB = 32768


def build(model: str, weight_format: str, max_seqs: int) -> MtpHead:
    cfg = atlas.ModelConfig.from_hf(os.path.join(FIXTURES, MODELS[model]))
    dev = torch.device("cuda")
    sd = random_state_dict(cfg, seed=0, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, device=dev)
               * cfg.hidden_size ** -0.5).to(torch.bfloat16)
    if weight_format == "nvfp4":
        lm_head = atlas.quantize_nvfp4(lm_head)
    head = MtpHead.from_state_dict(cfg, sd, embed, lm_head, weight_format, torch.bfloat16,
                                   max_seq_len=CONTEXT + 64, max_seqs=max_seqs, device=dev)
    del sd
    return head


def with_vocab(head: MtpHead, vocab: int) -> MtpHead:
    """The same head (shared weights and drafter KV) drafting over the first `vocab` ids."""
    h = copy.copy(head)
    h.vocab, h._graphs, h._pending = vocab, {}, {}
    return h


def measure(head: MtpHead, b: int, k: int, iters: int) -> tuple[float, float]:
    """(µs per draft position, floor µs per draft position)."""
    dev = head.device
    cfg = head.cfg
    g = torch.Generator(device=dev).manual_seed(b * 100 + k)
    seqs = [("bench", i) for i in range(b)]
    for s in seqs:
        if s in head.cache:
            head.cache.free(s)
        head._pending.pop(s, None)
        tokens = torch.randint(0, cfg.vocab_size, (CONTEXT,), generator=g, device=dev)
        hidden = torch.randn(CONTEXT, cfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
        head.prefill(s, tokens, hidden)
    last = torch.randint(0, cfg.vocab_size, (b,), generator=g, device=dev)
    hid = torch.randn(b, cfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    head.propose(seqs, last, hid, k)                       # captures the (B, k) graph
    graph = head.capture_propose(b, k)
    # Every propose starts from a cold L2, as in decoding, where the target model's forward runs
    # between two of them (the floor counts every weight byte as read from device memory).
    us = time_events(graph.replay, warmup=5, iters=iters, setup=l2_flusher(dev)) / k
    for s in seqs:
        head.free(s)
    kv = b * (CONTEXT + k) * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    return us, floor_us(head.weight_nbytes(b) + kv)


def bench_parts(head: MtpHead, b: int, iters: int) -> list[dict]:
    """Each launch group of one draft position's forward over B decode rows, timed alone under
    graph replay (20 calls per graph: weights ≤ 50 MB stay L2-warm, so small parts read
    optimistic; the point is to find which part dominates, e.g. why B = 32 costs 4.5× B = 1).
    The residual rms_norms update their residual in place on every call (values drift; the
    timing does not depend on them)."""
    dev, cfg, h = head.device, head.cfg, head.hidden_size
    g = torch.Generator(device=dev).manual_seed(7 + b)
    seqs = [("parts", i) for i in range(b)]
    for s in seqs:
        tokens = torch.randint(0, cfg.vocab_size, (CONTEXT,), generator=g, device=dev)
        hidden = torch.randn(CONTEXT, h, generator=g, device=dev).to(torch.bfloat16)
        head.prefill(s, tokens, hidden)
    meta = head._plan({s: 1 for s in seqs})
    (meta,) = _draft_metas(meta, b, 1, {})
    tok = torch.randint(0, cfg.vocab_size, (b,), generator=g, device=dev)
    hid = torch.randn(b, h, generator=g, device=dev).to(torch.bfloat16)
    eps, zc = head.eps, head.zero_centered
    x0 = ops.embedding_norm_concat(head.embed_tokens, tok, hid, head.norm_embedding, head.norm_hidden, eps, zc)
    x = head.fc(x0)
    xn = ops.rms_norm(x, head.input_layernorm, eps, zc)
    a = head.attn(xn, meta, head.cache, 0)
    fin = ops.rms_norm(a, head.post_attention_layernorm, eps, zc, residual=x.clone())
    ffn = head.ffn
    # the attention layer's launches one by one (its __call__: projections, qk_norm_rope with the
    # KV write, the gated paged decode, o_proj)
    attn = head.attn
    kc, vc, ks, vs = head.cache.layer(0)
    q, gate, k, v = attn._project_qkv(xn)
    qn = ops.qk_norm_rope(q, k, v, attn.q_norm_weight, attn.k_norm_weight, meta.positions, kc, vc,
                          meta.slot_mapping, ks, vs, **attn.norm_kwargs)
    o = attn._attend(qn, gate, meta, kc, vc, ks, vs).reshape(b, -1)
    parts = {
        "embedding_norm_concat": lambda: ops.embedding_norm_concat(head.embed_tokens, tok, hid, head.norm_embedding,
                                                                   head.norm_hidden, eps, zc),
        "fc (gemv)": lambda: head.fc(x0),
        "input rms_norm": lambda: ops.rms_norm(x, head.input_layernorm, eps, zc),
        "attention layer": lambda: head.attn(xn, meta, head.cache, 0),
        "  attention: projections": lambda: attn._project_qkv(xn),
        "  attention: qk_norm_rope + KV write": lambda: ops.qk_norm_rope(
            q, k, v, attn.q_norm_weight, attn.k_norm_weight, meta.positions, kc, vc, meta.slot_mapping, ks, vs,
            **attn.norm_kwargs),
        "  attention: paged decode (gated)": lambda: attn._attend(qn, gate, meta, kc, vc, ks, vs),
        "  attention: o_proj": lambda: attn.o_proj(o),
        "residual + rms_norm": lambda: ops.rms_norm(a, head.post_attention_layernorm, eps, zc, residual=x),
    }
    if hasattr(ffn, "gate_logits"):
        slot = ffn.experts.has_shared_slot
        logits = ffn.gate_logits(fin)
        _, ids, w = ffn.route(fin, shared_slot=slot)
        parts["moe_router (router gemv + top-k, one launch)"] = lambda: ffn.route(fin, shared_slot=slot)
        parts["  unfused: router gemv (F.linear)"] = lambda: ffn.gate_logits(fin)
        parts["  unfused: moe_route"] = lambda: ops.moe_route(logits, ffn.top_k, ffn.renormalize, shared_slot=slot)
        parts["moe_experts (T·k ≤ 36: gate_up, down, combine; above: + group)"] = lambda: ffn.experts(
            fin, ids, w, path="kernel", out_dtype=torch.bfloat16)
        parts["whole ffn"] = lambda: ffn(fin)
    else:
        parts["dense mlp"] = lambda: ffn(fin)
    f = ffn(fin)
    normed = ops.rms_norm(f, head.norm, eps, zc, residual=x.clone())
    lg = head.logits(normed)
    parts["final residual + rms_norm"] = lambda: ops.rms_norm(f, head.norm, eps, zc, residual=x)
    parts["lm head (gemv)"] = lambda: head.logits(normed)
    parts["argmax"] = lambda: ops.argmax(lg)
    rows = []
    for name, fn in parts.items():
        us = time_cuda_graph(fn, warmup=2, iters=iters, calls_per_graph=20)
        rows.append(dict(B=b, part=name, us=us))
    for s in seqs:
        head.free(s)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="35B-A3B NVFP4 full vocab, B ∈ {1, 32}, k = 1 only")
    ap.add_argument("--goal", action="store_true",
                    help="the goal's points only: both models, NVFP4, full vocab, B ∈ {1, 8, 32}, k ∈ {1, 3}")
    ap.add_argument("--parts", action="store_true",
                    help="only the per-launch-group breakdown (35B-A3B NVFP4 full vocab, B ∈ {1, 32})")
    args = ap.parse_args()
    require_cuda("bench_mtp")
    if args.parts:
        head = build("35b-a3b", "nvfp4", 32)
        rows = [r for b in (1, 32) for r in bench_parts(head, b, iters=10)]
        write_results("bench_mtp_parts", rows, meta=dict(context=CONTEXT, note="graph-replayed, 20 calls per graph "
                                                         "(L2-warm weights); µs per call"),
                      columns=["B", "part", "us"])
        return
    bw = copy_bandwidth_gbs()
    models = ["35b-a3b"] if args.quick else list(MODELS)
    formats = ["nvfp4"] if args.quick or args.goal else ["nvfp4", "bf16"]
    batches = [1, 32] if args.quick else [1, 8, 32]
    drafts = [1] if args.quick else [1, 3]
    vocabs = [0] if args.quick or args.goal else [0, TRUNCATED_VOCAB]
    rows = []
    for model in models:
        for fmt in formats:
            base = build(model, fmt, max(batches))
            for vocab in vocabs:
                head = base if vocab == 0 else with_vocab(base, vocab)
                b1 = {}
                for k in drafts:
                    for b in batches:
                        us, fl = measure(head, b, k, iters=10 if args.quick else 20)
                        b1.setdefault(k, us) if b == 1 else None
                        rows.append(dict(model=model, weights=fmt, vocab=head.vocab, B=b, k=k,
                                         us_per_draft=us, floor_us=fl, x_floor=us / fl,
                                         GBps=fl * bw / us, x_B1=us / b1[k] if k in b1 else float("nan")))
                        print(f"{model} {fmt} vocab {head.vocab} B={b} k={k}: {us:.1f} us/draft "
                              f"({us / fl:.2f}x floor)", flush=True)
            del base, head
            torch.cuda.empty_cache()
    write_results("bench_mtp_goal" if args.goal else "bench_mtp", rows,
                  meta=dict(context=CONTEXT, note="graph-replayed propose from a cold L2; µs per draft position"),
                  columns=["model", "weights", "vocab", "B", "k", "us_per_draft", "floor_us", "x_floor", "GBps", "x_B1"])
    goal = [r for r in rows if r["model"] == "35b-a3b" and r["weights"] == "nvfp4" and r["vocab"] == 248320
            and r["B"] == 1 and r["k"] == 1]
    if goal:
        print(f"goal B=1 k=1 NVFP4 full vocab: {goal[0]['x_floor']:.2f}x floor (target <= 1.25x)")


if __name__ == "__main__":
    main()
