"""`python -m atlas <command>`: the command line.

    info         versions, the GPU, whether atlas._C is built and which kernels it holds
    check        every kernel against its reference on this GPU, in seconds (quantize_nvfp4
                 bit-exact, ...); without a GPU, checks that the reference path runs
    draft-bench  MTP drafter: prefill over a prompt, then repeated graph-replayed proposes;
                 prints µs per draft, achieved bandwidth and the floor, writes JSON and a PNG

Examples:
    python -m atlas info
    python -m atlas check
    python -m atlas draft-bench --batch 1,8,32 --drafts 3 --weight-format nvfp4
    python -m atlas draft-bench --model /ckpt/Qwen3.6-35B-A3B-NVFP4 --kv-dtype fp8
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

import atlas
from atlas import _ext
from atlas._timing import copy_bandwidth_gbs, time_events

# =============================================================================================
# info
# =============================================================================================


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return "not installed"


def cmd_info(args) -> int:
    print(f"atlas {atlas.__version__} ({Path(atlas.__file__).parent})")
    print(f"python {platform.python_version()}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda or 'none: CPU build'})")
    print("packages: " + ", ".join(f"{m} {_version(m)}" for m in
                                   ("numpy", "safetensors", "tqdm", "matplotlib", "compressed_tensors",
                                    "transformers")))
    if _ext.extension_built():
        names = sorted(n for n in dir(_ext._C) if not n.startswith("_"))
        print(f"extension: atlas._C built ({getattr(_ext._C, '__file__', '?')})")
        print(f"kernels: {', '.join(names) if names else '(none)'}")
    else:
        print(f"extension: atlas._C not built ({_ext._IMPORT_ERROR}); every op runs its reference")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB)")
    else:
        print("GPU: none (CPU only: every op runs its plain-torch reference)")
    print(f"kernels_available: {atlas.kernels_available()}")
    return 0


# =============================================================================================
# check: each op on the GPU against the same op on CPU tensors (= its reference)
# =============================================================================================


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _Check:
    """One op check: `run(device)` builds fixed inputs (CPU generator, then moved) and returns
    the outputs; `compare(gpu, cpu)` returns (ok, detail)."""

    def __init__(self, op: str, run: Callable[[str], tuple], compare: Callable[[tuple, tuple], tuple[bool, str]]):
        self.op, self.run, self.compare = op, run, compare


def _exact(gpu: tuple, cpu: tuple) -> tuple[bool, str]:
    same = all(torch.equal(_bits(g.cpu()), _bits(c)) for g, c in zip(gpu, cpu))
    return same, "bit-exact" if same else "outputs differ (must be bit-exact)"


def _close(bound: float, why: str):
    def compare(gpu: tuple, cpu: tuple) -> tuple[bool, str]:
        errs = [_rel(g.float(), c.float()) for g, c in zip(gpu, cpu) if g.is_floating_point()]
        worst = max(errs) if errs else 0.0
        return worst <= bound, f"rel err {worst:.2e} (bound {bound:.0e}, {why})"
    return compare


def _ids_then_close(bound: float):
    def compare(gpu: tuple, cpu: tuple) -> tuple[bool, str]:
        ids_ok = torch.equal(gpu[0].cpu().long(), cpu[0].long())
        err = _rel(gpu[1].float(), cpu[1].float())
        return ids_ok and err <= bound, f"ids {'equal' if ids_ok else 'DIFFER'}, weights rel err {err:.2e}"
    return compare


def _router_compare(gpu: tuple, cpu: tuple) -> tuple[bool, str]:
    """moe_router: (logits, ids, weights); logits one bf16 rounding apart, so ids on well-separated
    logits must match and weights agree to that rounding."""
    ids_ok = torch.equal(gpu[1].cpu().long(), cpu[1].long())
    err = max(_rel(gpu[0].float(), cpu[0].float()), _rel(gpu[2].float(), cpu[2].float()))
    return ids_ok and err <= 1e-2, f"ids {'equal' if ids_ok else 'DIFFER'}, logits/weights rel err {err:.2e}"


def _checks() -> list[_Check]:
    from atlas import ops
    from atlas.nvfp4 import NVFP4Weight
    bf16, f32 = torch.bfloat16, torch.float32
    out: list[_Check] = []

    def quantize(dev):
        w = (torch.randn(256, 512, generator=_gen(1)) * 0.02).to(bf16)
        return tuple(ops.quantize_nvfp4(w.to(dev)))
    out.append(_Check("quantize_nvfp4", quantize, _exact))

    def gemv(dev):
        from atlas.reference import quantize_nvfp4 as ref_q
        w = torch.randn(384, 512, generator=_gen(2)) * 0.02
        q = NVFP4Weight(*ref_q(w)).to(dev)
        x = torch.randn(5, 512, generator=_gen(3)).to(bf16)
        return (ops.w4a16_gemv(x.to(dev), q),)
    out.append(_Check("w4a16_gemv", gemv, _close(1e-2, "bf16 output, fp32 accumulation order")))

    def nvfp4(n: int, k: int, seed: int) -> NVFP4Weight:
        from atlas.reference import quantize_nvfp4 as ref_q
        return NVFP4Weight(*ref_q(torch.randn(n, k, generator=_gen(seed)) * 0.02))

    def x_rows(m: int, k: int, seed: int) -> torch.Tensor:
        return torch.randn(m, k, generator=_gen(seed)).to(bf16)

    def gemv_head(dev):                      # float32 logits over a truncated vocab (n_rows)
        return (ops.w4a16_gemv(x_rows(17, 256, 31).to(dev), nvfp4(1000, 256, 30).to(dev), out_dtype=f32,
                               n_rows=777),)
    out.append(_Check("w4a16_gemv[f32,n_rows]", gemv_head, _close(1e-5, "fp32 output, accumulation order")))
    out.append(_Check("w4a16_gemv_qg", lambda dev: (ops.w4a16_gemv_qg(
        x_rows(3, 256, 33).to(dev), nvfp4(2 * 4 * 64, 256, 32).to(dev), 4, 64),), _close(1e-2, "bf16 output")))
    out.append(_Check("w4a16_gemv_dual", lambda dev: tuple(ops.w4a16_gemv_dual(
        x_rows(2, 256, 36).to(dev), nvfp4(128, 256, 34).to(dev), nvfp4(96, 256, 35).to(dev))),
        _close(1e-2, "bf16 outputs")))
    out.append(_Check("w4a16_gemv_silu", lambda dev: (ops.w4a16_gemv_silu(
        x_rows(4, 256, 38).to(dev), x_rows(4, 256, 39).to(dev), nvfp4(192, 256, 37).to(dev)),),
        _close(1e-2, "bf16 output")))
    out.append(_Check("w4a16_gemv_gated", lambda dev: (ops.w4a16_gemv_gated(   # gate: G half of [Q | G]
        x_rows(3, 256, 44).to(dev), x_rows(3, 512, 45).to(dev)[:, 256:], nvfp4(160, 256, 43).to(dev)),),
        _close(1e-2, "bf16 output")))

    def experts(dev, fmt="bf16"):
        e, i, h = 8, 64, 256
        x = x_rows(4, h, 40)
        ids = torch.randint(0, e, (4, 2), generator=_gen(41)).to(torch.int32)
        w = torch.rand(4, 2, generator=_gen(42))
        stacks = []
        for role, (n, k) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            dense = torch.randn(e, n, k, generator=_gen(43 + len(stacks))) * 0.05
            if fmt == "bf16":
                stacks.append(dense.to(bf16).to(dev))
            else:
                from atlas.reference import quantize_nvfp4 as ref_q
                qs = [ref_q(dense[j]) for j in range(e)]
                stacks.append(tuple(torch.stack([q[t] for q in qs]).to(dev) for t in range(3)))
        return (ops.moe_experts(x.to(dev), ids.to(dev), w.to(dev), *stacks),)
    out.append(_Check("moe_experts", experts, _close(1e-2, "bf16 intermediates")))
    out.append(_Check("moe_experts[nvfp4]", lambda dev: experts(dev, "nvfp4"), _close(1e-2, "bf16 intermediates")))

    def cache(dev, kv_dtype=bf16):
        key = torch.randn(6, 2, 128, generator=_gen(4)).to(bf16) * 30    # large magnitudes: fixed scales fail
        value = torch.randn(6, 2, 128, generator=_gen(5)).to(bf16)
        kc = torch.zeros(8, 16, 2, 128, dtype=kv_dtype)
        vc = torch.zeros_like(kc)
        slots = torch.tensor([17, -1, 40, 3, 127, 64])
        scales = (torch.zeros(8, 16, 2), torch.zeros(8, 16, 2)) if kv_dtype != bf16 else (None, None)
        t = [x.to(dev) if x is not None else None for x in (key, value, kc, vc, slots, *scales)]
        ops.reshape_and_cache(*t)
        return tuple(x for x in t[2:4] + t[5:] if x is not None)
    out.append(_Check("reshape_and_cache", cache, _exact))
    out.append(_Check("reshape_and_cache[fp8]", lambda dev: cache(dev, torch.float8_e4m3fn), _exact))

    def decode(dev):
        q = torch.randn(3, 8, 128, generator=_gen(6)).to(bf16)
        kc = torch.randn(16, 16, 2, 128, generator=_gen(7)).to(bf16)
        vc = torch.randn(16, 16, 2, 128, generator=_gen(8)).to(bf16)
        bt = torch.randperm(16, generator=_gen(9))[:12].reshape(3, 4).to(torch.int32)
        sl = torch.tensor([1, 17, 64], dtype=torch.int32)
        return (ops.paged_decode(q.to(dev), kc.to(dev), vc.to(dev), bt.to(dev), sl.to(dev), 128 ** -0.5),)
    out.append(_Check("paged_decode", decode, _close(1e-2, "bf16 output, split-K merge order")))

    def norm(dev):
        x = torch.randn(6, 256, generator=_gen(10)).to(bf16)
        w = torch.randn(256, generator=_gen(11)) * 0.1
        return (ops.rms_norm(x.to(dev), w.to(dev), 1e-6, zero_centered=True),)
    out.append(_Check("rms_norm", norm, _close(1e-2, "one bf16 rounding")))

    def qknr(dev):
        q = torch.randn(3, 4, 128, generator=_gen(12)).to(bf16)
        k = torch.randn(3, 2, 128, generator=_gen(13)).to(bf16)
        v = torch.randn(3, 2, 128, generator=_gen(14)).to(bf16)
        qw, kw = torch.randn(128, generator=_gen(15)) * 0.1, torch.randn(128, generator=_gen(16)) * 0.1
        kc = torch.zeros(4, 16, 2, 128, dtype=bf16)
        vc = torch.zeros_like(kc)
        pos, slots = torch.tensor([0, 7, 1000]), torch.tensor([5, 16, 63])
        t = [x.to(dev) for x in (q, k, v, qw, kw, pos, kc, vc, slots)]
        qo = ops.qk_norm_rope(*t, eps=1e-6, zero_centered=True, rotary_dim=32, rope_theta=1e7)
        return (qo, t[6], t[7])
    out.append(_Check("qk_norm_rope", qknr, _close(1e-2, "one bf16 rounding")))

    def gate(dev):
        x = torch.randn(4, 4, 128, generator=_gen(17)).to(bf16)
        qg = torch.randn(4, 4, 256, generator=_gen(18)).to(bf16).to(dev)   # per head [q | gate]
        return (ops.sigmoid_gate_mul(x.to(dev), qg[..., 128:]),)
    out.append(_Check("sigmoid_gate_mul", gate, _close(1e-2, "one bf16 rounding")))

    def amax(dev):
        logits = torch.randn(4, 1000, generator=_gen(19)) * 3
        return tuple(ops.argmax(logits.to(dev)))
    out.append(_Check("argmax", amax, _ids_then_close(1e-4)))

    def route(dev):
        logits = torch.randn(5, 64, generator=_gen(20))
        return tuple(ops.moe_route(logits.to(dev), 8))
    out.append(_Check("moe_route", route, _ids_then_close(1e-4)))

    def router(dev):
        x = torch.randn(5, 256, generator=_gen(22)).to(bf16)
        v = torch.randn(256, generator=_gen(23))
        scale = torch.arange(1, 66, dtype=f32).unsqueeze(1) / 65     # row r's logit ∝ r + 1: no near-ties
        gates = (scale * v).to(bf16)                                   # 64 experts + the shared gate row
        return tuple(ops.moe_router(x.to(dev), gates.to(dev), 8, shared_slot=True))
    out.append(_Check("moe_router", router, _router_compare))

    def embed(dev):
        table = torch.randn(100, 256, generator=_gen(21)).to(bf16)
        ids = torch.tensor([3, 99, 0, 3, 42])
        return (ops.embedding(table.to(dev), ids.to(dev)),)
    out.append(_Check("embedding", embed, _exact))
    return out


def cmd_check(args) -> int:
    from atlas import ops
    gpu = atlas.kernels_available()
    if gpu:
        print(f"checking kernels on {torch.cuda.get_device_name(0)} against their references (CPU path)")
    else:
        why = "no CUDA device" if not torch.cuda.is_available() else "atlas._C not built"
        print(f"no GPU kernels to check ({why}): checking that each op's reference path runs on CPU")
    failed = 0
    checked = set()
    for c in _checks():
        base = c.op.split("[")[0]
        if not hasattr(ops, base):
            continue
        checked.add(base)
        t0 = time.perf_counter()
        try:
            cpu = c.run("cpu")
            if gpu:
                got = c.run("cuda")
                torch.cuda.synchronize()
                ok, detail = c.compare(got, cpu)
            else:
                ok = all(not t.is_floating_point() or bool(torch.isfinite(t.float()).all()) for t in cpu)
                detail = "reference ran" if ok else "reference produced non-finite values"
        except Exception as e:  # report and go on: one broken op must not hide the others
            ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0][:200]
        failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {c.op:24s} {detail}  ({(time.perf_counter() - t0) * 1e3:.0f} ms)")
    registered = sorted(n for n in dir(torch.ops.atlas) if not n.startswith("_") and hasattr(ops, n)
                        and n not in checked) if hasattr(torch.ops, "atlas") else []
    if registered:
        print(f"  no check registered for: {', '.join(registered)}")
    print(f"{'all checks passed' if not failed else f'{failed} check(s) FAILED'}")
    return 1 if failed else 0


# =============================================================================================
# draft-bench
# =============================================================================================

_DIALECT_OF_FORMAT = {"nvfp4": "modelopt_nvfp4", "fp8": "fp8", "bf16": "bf16"}
_BYTES_PER_WEIGHT = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0 + 4 / (128 * 128), "bf16": 2.0}
_KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def draft_bytes(cfg, *, batch: int, context: int, weight_format: str, kv_dtype: str, vocab_rows: int,
                head_bytes: int | None = None) -> dict:
    """Bytes one draft step of `batch` sequences must read at least (the floor's numerator).

    Weights are read once per step whatever the batch: fc [h, 2h], q/k/v/o, the router and
    shared expert, the LM head rows the drafter scores, and the routed experts that at least
    one row picks — E·(1 − (1 − k/E)^B) distinct experts expected for B independent rows.
    The LM head counts at `weight_format` unless `head_bytes` (what the loaded head streams) is given.
    Each row also reads its KV: context × nkv × hd × 2 (K and V) × element size (FP8 adds one
    float32 scale per token and KV head). Norm vectors and activations are negligible.
    """
    b = _BYTES_PER_WEIGHT[weight_format]
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gate = 2 if cfg.attn_output_gate else 1
    attn = (nq * hd * gate * h + 2 * nkv * hd * h + h * nq * hd) * b
    fc = 2 * h * h * b
    if cfg.is_moe:
        e, k, i = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        distinct = e * (1 - (1 - k / e) ** batch)
        ffn = distinct * 3 * i * h * b + 3 * cfg.shared_expert_intermediate_size * h * b + (e + 1) * h * 2
    else:
        ffn = 3 * cfg.intermediate_size * h * b
    head = vocab_rows * h * b if head_bytes is None else head_bytes     # the head as loaded, if known
    kv_elem = 1 if kv_dtype == "fp8" else 2
    kv = batch * context * nkv * (2 * hd * kv_elem + (8 if kv_dtype == "fp8" else 0))
    return {"weights": attn + fc + ffn + head, "kv": kv, "total": attn + fc + ffn + head + kv}


def _time_wall(fn: Callable[[], object], iters: int, sync: bool) -> float:
    """Median wall-clock µs of fn() including its host work (and the device work when sync)."""
    fn()
    times = []
    for _ in range(iters):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _format_table(rows: list[dict]) -> str:
    cols = [("batch", "batch", "{}"), ("drafts", "drafts", "{}"), ("us_per_propose", "µs/propose", "{:.1f}"),
            ("us_per_draft", "µs/draft", "{:.1f}"), ("mb_per_draft", "MB/draft", "{:.1f}"),
            ("achieved_gbs", "GB/s", "{:.0f}"), ("floor_us_per_draft", "floor µs", "{}"),
            ("pct_of_floor", "% floor", "{}"), ("us_per_cycle", "µs/cycle", "{:.0f}"), ("mode", "timing", "{}")]
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else f.format(r[k])) for k, _, f in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path, title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return "matplotlib not installed: no plot written"
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [r["us_per_draft"] for r in rows], "o-", label="measured µs / draft")
    if all(r.get("floor_us_per_draft") is not None for r in rows):
        ax.plot(xs, [r["floor_us_per_draft"] for r in rows], "k--", label="floor (bytes / copy bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("µs per draft step")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def cmd_draft_bench(args) -> int:
    from atlas import testing as T
    from atlas.checkpoint import load_mtp_head, open_checkpoint
    gpu = atlas.kernels_available()
    device = "cuda" if gpu else "cpu"
    batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise SystemExit(f"draft-bench: --batch must list positive sizes, got {args.batch!r}")
    prompt_len, drafts, iters = args.prompt_len, args.drafts, args.iters
    if not gpu:
        why = "no CUDA device" if not torch.cuda.is_available() else "atlas._C not built"
        print(f"draft-bench: {why}: running a tiny config through the reference path on CPU "
              "(timings are not kernel timings)")
        batches = [b for b in batches if b <= 2] or [1]
        prompt_len, iters = min(prompt_len, 16), min(iters, 3)
    if args.quick:
        iters = min(iters, 5)

    tmp = None
    if args.model:
        path = Path(args.model)
        source = str(path)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="atlas-draft-bench-")
        config = T.qwen36_35b_a3b_config() if gpu else T.tiny_config()
        dialect = _DIALECT_OF_FORMAT[args.weight_format]
        t0 = time.perf_counter()
        # The drafter runs its LM head in the projections' format when that is NVFP4 (as the seed
        # engine does), so the synthetic checkpoint quantizes lm_head too; BF16/FP8 keep it BF16.
        quantize_head = args.weight_format == "nvfp4"
        path = T.write_checkpoint(tmp.name, config, dialect, layers="mtp", device=device, progress=gpu,
                                  quantize_lm_head=quantize_head)
        source = (f"synthetic {'Qwen3.6-35B-A3B' if gpu else 'tiny'} {dialect} "
                  f"({'NVFP4' if quantize_head else 'BF16'} lm_head, random weights)")
        print(f"draft-bench: wrote {source} to {path} in {time.perf_counter() - t0:.1f} s")
    try:
        ckpt = open_checkpoint(path)
        cfg = ckpt.model_config
        max_seqs = sum(batches)
        max_seq_len = prompt_len + drafts * (iters + 16) + 64
        t0 = time.perf_counter()
        mtp = load_mtp_head(ckpt, weight_format=args.weight_format, kv_dtype=_KV_DTYPES[args.kv_dtype],
                            max_seq_len=max_seq_len, max_seqs=max_seqs, mtp_vocab_size=args.mtp_vocab_size,
                            device=device)
        print(f"draft-bench: loaded the MTP head ({args.weight_format}, KV {args.kv_dtype}) in "
              f"{time.perf_counter() - t0:.1f} s")
        bw = copy_bandwidth_gbs() if gpu else None
        vocab_rows = args.mtp_vocab_size or cfg.vocab_size
        gen = torch.Generator().manual_seed(0)
        rows, next_seq = [], 0
        for b in batches:
            seq_ids = list(range(next_seq, next_seq + b))
            next_seq += b
            for s in seq_ids:
                tokens = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).to(device)
                hidden = torch.randn(prompt_len, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)
                mtp.prefill(s, tokens, hidden)
            last = torch.randint(0, cfg.vocab_size, (b,), generator=gen).to(device)
            hid = torch.randn(b, cfg.hidden_size, generator=gen).to(device, torch.bfloat16)

            def settle():                        # undo the propose entirely: KV back to P rows, so
                for s in seq_ids:                # every timed propose repeats the same work
                    try:
                        mtp.cancel_propose([s])
                    except ValueError:           # nothing pending (a failed capture)
                        pass

            # Graph replay: the first propose captures the (B, k) graph; replaying it re-runs the
            # same drafts over the same slots (device work only: the kernel-time number).
            mode, us = "graph replay", None
            try:
                mtp.propose(seq_ids, last, hid, drafts)
                if gpu:
                    us = time_events(mtp.capture_propose(b, drafts).replay, warmup=3, iters=iters)
            except Exception as e:
                if not gpu:
                    raise
                mode = f"eager ({type(e).__name__} capturing the propose graph)"
            settle()
            use_graph = gpu and mode == "graph replay"

            def cycle():                         # one full propose() + cancel_propose(): host planning included
                mtp.propose(seq_ids, last, hid, drafts, use_graph=use_graph)
                settle()

            cycle_us = _time_wall(cycle, iters, sync=gpu)
            if us is None:
                us = cycle_us
                mode = mode if gpu else "eager (CPU reference)"
            head_bytes = getattr(mtp, "lm_head_nbytes", None)
            nbytes = draft_bytes(cfg, batch=b, context=prompt_len + drafts, weight_format=args.weight_format,
                                 kv_dtype=args.kv_dtype, vocab_rows=vocab_rows,
                                 head_bytes=head_bytes if isinstance(head_bytes, int) else None)
            per_draft = us / drafts
            floor = nbytes["total"] / (bw * 1e9) * 1e6 if bw else None
            rows.append({"batch": b, "drafts": drafts, "us_per_propose": us, "us_per_draft": per_draft,
                         "mb_per_draft": nbytes["total"] / 1e6, "weight_mb": nbytes["weights"] / 1e6,
                         "kv_mb": nbytes["kv"] / 1e6,
                         "achieved_gbs": nbytes["total"] / (per_draft * 1e-6) / 1e9,
                         "floor_us_per_draft": None if floor is None else round(floor, 1),
                         "pct_of_floor": None if floor is None else round(100 * floor / per_draft, 1),
                         "us_per_cycle": cycle_us, "mode": mode})
            free = getattr(mtp, "free", None)
            if callable(free):
                for s in seq_ids:
                    free(s)
    finally:
        if tmp is not None:
            tmp.cleanup()

    title = (f"MTP draft: {source}, {args.weight_format} weights, KV {args.kv_dtype}, "
             f"prompt {prompt_len}, {drafts} drafts")
    print(title)
    print(_format_table(rows))
    if bw:
        print(f"floor = bytes per draft / measured copy bandwidth {bw:.0f} GB/s; bytes = weights read once "
              "per step (distinct experts expected for the batch) + each row's KV; µs/cycle = one "
              "propose() + cancel_propose() on the host clock (planning, copies and replay)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source": source, "device": torch.cuda.get_device_name(0) if gpu else "cpu (reference path)",
            "weight_format": args.weight_format, "kv_dtype": args.kv_dtype, "prompt_len": prompt_len,
            "drafts": drafts, "iters": iters, "mtp_vocab_size": args.mtp_vocab_size, "copy_bandwidth_gbs": bw,
            "torch": torch.__version__, "atlas": atlas.__version__}
    # A CPU run (tiny reference config) never overwrites the GPU results committed beside it.
    stem = "draft_bench" if gpu else "draft_bench_cpu"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"results: {out / f'{stem}.json'}")
    print(_plot(rows, out / f"{stem}.png", title))
    return 0


# =============================================================================================
# entry point
# =============================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atlas", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, built kernels")
    sub.add_parser("check", help="each kernel against its reference on this GPU")
    d = sub.add_parser("draft-bench", help="MTP drafter benchmark (prefill + graph-replayed proposes)")
    d.add_argument("--model", help="checkpoint directory (default: a synthetic Qwen3.6-35B-A3B written to a temp dir)")
    d.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    d.add_argument("--drafts", type=int, default=3, help="drafts per propose (default 3)")
    d.add_argument("--weight-format", choices=sorted(_DIALECT_OF_FORMAT), default="nvfp4",
                   help="what the MTP projections run in (default nvfp4)")
    d.add_argument("--kv-dtype", choices=sorted(_KV_DTYPES), default="bf16", help="drafter KV cache dtype")
    d.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens prefilled per sequence")
    d.add_argument("--mtp-vocab-size", type=int, default=0, help="LM-head rows the drafter scores (0 = all)")
    d.add_argument("--iters", type=int, default=20, help="timed proposes per batch size")
    d.add_argument("--out", default="bench/results", help="directory for draft_bench.json / .png")
    d.add_argument("--quick", action="store_true", help="fewer iterations")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "drafts", 1) < 1 or getattr(args, "prompt_len", 2) < 2:
        raise SystemExit("draft-bench: --drafts must be ≥ 1 and --prompt-len ≥ 2")
    return {"info": cmd_info, "check": cmd_check, "draft-bench": cmd_draft_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
