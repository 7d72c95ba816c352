"""Qwen3AttentionLayer against the HF modules it reproduces (Qwen3NextAttention, Qwen3_5MoeAttention,
Qwen3Attention) given the same weights, across chunkings and mixed batches: CPU through the
reference path with tiny configs, CUDA through the kernels with real shapes; CUDA-graph decode."""
import zlib

import pytest
import torch

import atlas
from atlas.config import ModelConfig
from atlas.kv_cache import PagedKvCache
from atlas.layers.attention import Qwen3AttentionLayer, hf_attention, plan_attention, DecodeRun
from helpers import rel_err
from test_linear import module_state_dict

QWEN3_PLAIN = dict(model_type="qwen3", zero_centered_norm=False, attn_output_gate=False, partial_rotary_factor=1.0)
TINY = {  # head_dim 64: the smallest paged_decode serves (rotary_dim 16 with the 0.25 factor)
    "qwen3_next": ModelConfig.tiny(head_dim=64),
    "qwen3_5_moe": ModelConfig.tiny(head_dim=64, model_type="qwen3_5_moe"),
    "qwen3_5": ModelConfig.tiny(head_dim=64, model_type="qwen3_5", num_experts=0),
    "qwen3": ModelConfig.tiny(head_dim=64, **QWEN3_PLAIN),
}

# Schedules: per step, {seq: new rows}. Each sequence's rows are consecutive tokens of its prompt.
SCHEDULES = {
    "whole_prompt": [{"a": 21}],
    "prefill_then_decode": [{"a": 13}] + [{"a": 1}] * 5,
    "uneven_chunks": [{"a": 5}, {"a": 11}, {"a": 1}, {"a": 3}, {"a": 9}, {"a": 16}],
    "verify_groups": [{"a": 10}, {"a": 3}, {"a": 1}, {"a": 8}, {"a": 2}],
    "mixed_batch": [{"a": 12, "b": 5}, {"a": 1, "b": 3, "c": 17}, {"c": 1, "a": 4, "b": 1},
                    {"a": 1, "b": 1, "c": 1}, {"b": 9, "c": 2, "a": 1}],
}


def _gen(*key):
    """A generator seeded from the case's parameters (crc32: stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def attention_state_dict(cfg: ModelConfig, dialect: str, prefix: str, g: torch.Generator, device="cpu") -> dict:
    """Random HF-named attention weights of a config in one checkpoint dialect (unit-RMS rows, so
    activations stay O(1); norm weights around 0 for zero-centered norms, around 1 otherwise).
    Quantized on `device` (the GPU kernels for real shapes)."""
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"q_proj": (nq * hd * (2 if cfg.attn_output_gate else 1), h), "k_proj": (nkv * hd, h),
              "v_proj": (nkv * hd, h), "o_proj": (h, nq * hd)}
    sd = {}
    for name, (n, k) in shapes.items():
        sd.update(module_state_dict((torch.randn(n, k, generator=g) / k ** 0.5).to(device), dialect, f"{prefix}{name}."))
    base = 0.0 if cfg.zero_centered_norm else 1.0
    for name in ("q_norm", "k_norm"):
        sd[f"{prefix}{name}.weight"] = (base + 0.2 * torch.randn(hd, generator=g)).to(torch.bfloat16)
    return sd


def run_schedule(attn, cfg, schedule, *, kv_dtype, device, block_size, g, num_blocks=64):
    """Feed each sequence's prompt through `attn` step by step. Returns ({seq: hidden [L, h] bf16},
    {seq: out [L, h]}) with out in token order."""
    lens = {}
    for step in schedule:
        for s, n in step.items():
            lens[s] = lens.get(s, 0) + n
    hidden = {s: torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16).to(device) for s, n in lens.items()}
    done = {s: 0 for s in lens}
    outs = {s: [] for s in lens}
    cache = PagedKvCache(cfg, 1, num_blocks, kv_dtype, device, block_size=block_size)
    for step in schedule:
        meta = cache.plan(step)
        x = torch.cat([hidden[s][done[s]:done[s] + n] for s, n in step.items()])
        y = attn(x, meta, cache, layer=0)
        r = 0
        for s, n in step.items():
            outs[s].append(y[r:r + n])
            r += n
            done[s] += n
    return hidden, {s: torch.cat(o) for s, o in outs.items()}


def hf_outputs(cfg, attn, hidden: dict, device) -> dict:
    """The HF module over each whole sequence (positions 0..L-1, causal), float32."""
    module, rotary = hf_attention(cfg, attn, dtype=torch.float32, device=device)
    out = {}
    with torch.no_grad():
        for s, x in hidden.items():
            xf = x.float()[None]
            cos, sin = rotary(xf, torch.arange(x.shape[0], device=device)[None])
            out[s] = module(xf, (cos, sin), None)[0][0]
    return out


# Error budget vs the float32 HF module: q, k, v, the attention output, the gated output and
# o_proj's output are each rounded to bf16 once (2^-9 relative each, accumulating to ~5e-3);
# FP8 KV adds E4M3's 2^-4 relative rounding of every K and V element (~2e-2 after averaging).
BOUND = {torch.bfloat16: 1.5e-2, torch.float8_e4m3fn: 6e-2}


@pytest.mark.parametrize("model", list(TINY))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_matches_hf_bf16(model, schedule):
    cfg = TINY[model]
    g = _gen(model, schedule)
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "l.", g), "l.", "bf16", "cpu")
    hidden, got = run_schedule(attn, cfg, SCHEDULES[schedule], kv_dtype=torch.bfloat16, device="cpu",
                               block_size=4, g=g)
    want = hf_outputs(cfg, attn, hidden, "cpu")
    for s in hidden:
        assert rel_err(got[s], want[s]) < BOUND[torch.bfloat16], s


@pytest.mark.parametrize("dialect,weight_format", [
    ("modelopt_nvfp4", "nvfp4"), ("ct_nvfp4", "nvfp4"), ("bf16", "nvfp4"), ("fp8", "nvfp4"),
    ("fp8", "fp8"), ("bf16", "fp8"), ("modelopt_nvfp4", "bf16"),
])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_matches_hf_formats(dialect, weight_format, kv_dtype):
    cfg = TINY["qwen3_next"]
    g = _gen(dialect, weight_format, str(kv_dtype))
    sd = attention_state_dict(cfg, dialect, "l.", g)
    attn = Qwen3AttentionLayer.from_state_dict(cfg, sd, "l.", weight_format, "cpu")
    assert attn.weight_format == weight_format
    hidden, got = run_schedule(attn, cfg, SCHEDULES["mixed_batch"], kv_dtype=kv_dtype, device="cpu",
                               block_size=16, g=g)
    want = hf_outputs(cfg, attn, hidden, "cpu")     # HF gets the dequantized weights
    for s in hidden:
        assert rel_err(got[s], want[s]) < BOUND[kv_dtype], s


def test_kv_fusion_rule():
    cfg = TINY["qwen3_next"]
    g = _gen("fuse")
    # converted here: K and V quantized with one global scale → fused
    assert Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "", g), "", "nvfp4", "cpu").kv_fused
    # exported separately (different global scales) → used as they are, run separately
    sd = attention_state_dict(cfg, "modelopt_nvfp4", "", g)
    attn = Qwen3AttentionLayer.from_state_dict(cfg, sd, "", "nvfp4", "cpu")
    assert not attn.kv_fused and attn.k_proj.weight.packed.data_ptr() == sd["k_proj.weight"].data_ptr()
    assert not Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "", g), "", "bf16", "cpu").kv_fused


def test_plan_attention():
    runs, prefill = plan_attention([1, 1, 3, 3, 12, 1, 0, 1, 9])
    assert runs == [DecodeRun(0, 2, 0, 2, 1), DecodeRun(2, 4, 2, 8, 3), DecodeRun(5, 6, 20, 21, 1), DecodeRun(7, 8, 21, 22, 1)]
    assert prefill == [(4, 8, 12), (8, 22, 9)]


def test_errors_name_the_argument():
    cfg = TINY["qwen3_next"]
    g = _gen("errors")
    sd = attention_state_dict(cfg, "bf16", "l.", g)
    with pytest.raises(KeyError, match="l.k_norm.weight"):
        Qwen3AttentionLayer.from_state_dict(cfg, {k: v for k, v in sd.items() if "k_norm" not in k}, "l.", "bf16", "cpu")
    bad = dict(sd, **{"l.o_proj.weight": sd["l.o_proj.weight"][:, :-8]})
    with pytest.raises(ValueError, match="o_proj"):
        Qwen3AttentionLayer.from_state_dict(cfg, bad, "l.", "bf16", "cpu")
    attn = Qwen3AttentionLayer.from_state_dict(cfg, sd, "l.", "bf16", "cpu")
    cache = PagedKvCache(cfg, 1, 8, device="cpu")
    meta = cache.plan({"a": 3})
    with pytest.raises(TypeError, match="hidden"):
        attn(torch.zeros(3, cfg.hidden_size), meta, cache)
    with pytest.raises(ValueError, match="num_tokens"):
        attn(torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16), meta, cache)
    with pytest.raises(ValueError, match="cache"):
        attn(torch.zeros(3, cfg.hidden_size, dtype=torch.bfloat16), meta,
             PagedKvCache(ModelConfig.tiny(head_dim=128), 1, 8, device="cpu"))


# ---- CUDA: real shapes through the kernels ---------------------------------------------------

REAL = {  # attention shapes of real checkpoints (h, nq/nkv, hd 256, partial RoPE 64, theta 1e7)
    "35b_a3b": dict(model_type="qwen3_5_moe", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=256, rope_theta=1e7, mrope_section=(11, 11, 10)),
    "27b": dict(model_type="qwen3_5", hidden_size=5120, num_attention_heads=24, num_key_value_heads=4,
                head_dim=256, rope_theta=1e7, mrope_section=(11, 11, 10)),
    "qwen3_8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1e6, **QWEN3_PLAIN),
}


def real_config(name):
    return ModelConfig.tiny(num_experts=0, **REAL[name])


@pytest.mark.cuda
@pytest.mark.parametrize("model", list(REAL))
@pytest.mark.parametrize("schedule,dialect", [("prefill_then_decode", "bf16"), ("mixed_batch", "modelopt_nvfp4"),
                                              ("verify_groups", "bf16")])   # bf16 → K/V fused (dual GEMV)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_matches_hf(model, schedule, dialect, kv_dtype):
    cfg = real_config(model)
    g = _gen("cuda", model, schedule, str(kv_dtype))
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, dialect, "l.", g, "cuda"), "l.",
                                               "nvfp4", "cuda")
    assert attn.kv_fused == (dialect == "bf16")
    hidden, got = run_schedule(attn, cfg, SCHEDULES[schedule], kv_dtype=kv_dtype, device="cuda", block_size=16, g=g)
    want = hf_outputs(cfg, attn, hidden, "cuda")
    for s in hidden:
        assert rel_err(got[s], want[s]) < BOUND[kv_dtype], s


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["35b_a3b", "27b"])
@pytest.mark.parametrize("schedule", [[{"a": 10}, {"a": 1}], [{"a": 5, "b": 3}, {"a": 4, "b": 4}],
                                      [{"a": 70}, {"a": 1, "b": 40}]])      # 70, 41 rows: 32-row GEMV chunks
def test_cuda_gate_in_paged_decode_bitwise_vs_unfused(monkeypatch, model, schedule):
    """Steps of one decode / verify run take the output gate inside paged_decode; the layer's
    outputs are bitwise those of paged_decode + sigmoid_gate_mul (the mixed-step path), for
    decode, verify and prefill steps, and within the bound of HF."""
    from atlas import ops
    from atlas.testing import paged_decode_gate_as_own_launch
    cfg = real_config(model)
    g = _gen("gated_bitwise", model, repr(schedule))
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "l.", g, "cuda"), "l.",
                                               "nvfp4", "cuda")
    assert attn.gated
    real = ops.paged_decode
    calls = {"gated": 0}

    def counted(*args, gate=None, **kw):
        calls["gated"] += gate is not None
        return real(*args, gate=gate, **kw)

    monkeypatch.setattr(ops, "paged_decode", counted)
    hidden, got = run_schedule(attn, cfg, schedule, kv_dtype=torch.bfloat16, device="cuda", block_size=16,
                               g=_gen("gated_bitwise_x", model, repr(schedule)))
    one_run = sum(len(set(step.values())) == 1 and max(step.values()) <= 8 for step in schedule)
    assert calls["gated"] == one_run                                # steps of one decode / verify run
    monkeypatch.setattr(ops, "paged_decode", paged_decode_gate_as_own_launch)
    _, want = run_schedule(attn, cfg, schedule, kv_dtype=torch.bfloat16, device="cuda", block_size=16,
                           g=_gen("gated_bitwise_x", model, repr(schedule)))
    for s in hidden:
        assert torch.equal(got[s], want[s]), s
    ref = hf_outputs(cfg, attn, hidden, "cuda")
    for s in hidden:
        assert rel_err(got[s], ref[s]) < BOUND[torch.bfloat16], s


@pytest.mark.cuda
def test_cuda_long_prefill_then_decode():
    """A 1000-token prompt in uneven chunks (GEMM path, many pseudo-sequences), then decode."""
    cfg = real_config("35b_a3b")
    g = _gen("long")
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "l.", g, "cuda"), "l.", "nvfp4", "cuda")
    schedule = [{"a": 333}, {"a": 500}, {"a": 167}] + [{"a": 1}] * 4
    hidden, got = run_schedule(attn, cfg, schedule, kv_dtype=torch.bfloat16, device="cuda", block_size=16, g=g)
    want = hf_outputs(cfg, attn, hidden, "cuda")
    assert rel_err(got["a"], want["a"]) < BOUND[torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.parametrize("query_len", [1, 4])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_graph_decode_equals_eager(query_len, kv_dtype):
    cfg = real_config("35b_a3b")
    g = _gen("graph", query_len, str(kv_dtype))
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "l.", g, "cuda"), "l.", "nvfp4", "cuda")
    b, width = 3, 8
    caches = [PagedKvCache(cfg, 1, 64, kv_dtype, "cuda") for _ in range(2)]   # eager, graph
    prompts = {s: torch.randn(10 + 7 * i, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()
               for i, s in enumerate("xyz")}
    for cache in caches:
        for s, x in prompts.items():
            attn(x, cache.plan({s: x.shape[0]}, max_blocks_per_seq=width), cache)
    graph = attn.capture_decode(b, caches[1], max_blocks_per_seq=width, query_len=query_len)
    for step in range(3):
        x = torch.randn(b * query_len, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()
        want = attn(x, caches[0].plan({s: query_len for s in prompts}, max_blocks_per_seq=width), caches[0])
        got = graph(x, caches[1].plan({s: query_len for s in prompts}, max_blocks_per_seq=width)).clone()
        assert torch.equal(got, want), step
    k0, v0, _, _ = caches[0].layer(0)
    k1, v1, _, _ = caches[1].layer(0)
    assert torch.equal(k0.view(torch.uint8), k1.view(torch.uint8)) and torch.equal(v0.view(torch.uint8), v1.view(torch.uint8))


@pytest.mark.parametrize("model,dialect,launches", [
    ("qwen3_next", "bf16", {"dual": 1, "gemv": 1, "gated_attention": 1}),            # q|g+kv, o_proj
    ("qwen3_next", "modelopt_nvfp4", {"dual": 1, "gemv": 2, "gated_attention": 1}),  # q|g+k, v, o_proj
    ("qwen3", "bf16", {"dual": 1, "gemv": 1, "gated_attention": 0}),                 # q+kv, o_proj
])
@pytest.mark.parametrize("rows", [1, 2])
def test_decode_projection_launches(monkeypatch, model, dialect, launches, rows):
    """A decode step reads q_proj, k_proj and v_proj in one GEMV launch when K and V share a
    global scale (else q+k and v), and o_proj in one more; a gated layer's output gate rides in
    paged_decode (no sigmoid_gate_mul launch). The stand-ins run the reference, so the output is
    also checked against the unpatched layer's."""
    from atlas import ops, reference as ref
    calls = {"dual": 0, "gemv": 0, "gated_attention": 0, "sigmoid_gate_mul": 0}
    real = {name: getattr(ops, name) for name in ("w4a16_gemv_dual", "paged_decode", "sigmoid_gate_mul")}

    def gemv(x, q, **kw):
        calls["gemv"] += 1
        return ref.w4a16_gemv(x, q.packed, q.block_scale, q.global_scale)

    def dual(x, q1, q2, *, qg_head_dim=0):
        calls["dual"] += 1
        return real["w4a16_gemv_dual"](x, q1, q2, qg_head_dim=qg_head_dim)

    def paged_decode(*args, gate=None, **kw):
        calls["gated_attention"] += gate is not None
        return real["paged_decode"](*args, gate=gate, **kw)

    def sigmoid_gate_mul(x, gate):
        calls["sigmoid_gate_mul"] += 1
        return real["sigmoid_gate_mul"](x, gate)

    cfg = TINY[model]
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, dialect, "", _gen("launch", dialect)),
                                               "", "nvfp4", "cpu")
    x = torch.randn(rows, cfg.hidden_size, generator=_gen("launch_x", model)).to(torch.bfloat16)
    caches = [PagedKvCache(cfg, 1, 8, device="cpu") for _ in range(2)]
    step = {"a": 1, "b": 1} if rows == 2 else {"a": 1}
    want = attn(x, caches[0].plan(step), caches[0])
    for name, fn in (("w4a16_gemv", gemv), ("w4a16_gemv_dual", dual), ("paged_decode", paged_decode),
                     ("sigmoid_gate_mul", sigmoid_gate_mul)):
        monkeypatch.setattr(ops, name, fn)
    got = attn(x, caches[1].plan(step), caches[1])
    assert calls == dict(launches, sigmoid_gate_mul=0)
    assert torch.equal(got, want)


def _assert_write_kv_equals_forward(attn, cfg, x, caches):
    """A forward over x into caches[0] and write_kv over x into caches[1] leave the same cache
    bytes (K/V and FP8 scales)."""
    t = x.shape[0]
    attn(x, caches[0].plan({"a": t}), caches[0])
    attn.write_kv(x, caches[1].plan({"a": t}), caches[1])
    for a, b in zip(caches[0].layer(0), caches[1].layer(0)):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else \
                torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("dialect,weight_format", [("bf16", "nvfp4"), ("modelopt_nvfp4", "nvfp4"), ("bf16", "bf16")])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("t", [3, 40])
def test_write_kv_equals_forward_kv(dialect, weight_format, kv_dtype, t):
    cfg = TINY["qwen3_next"]
    g = _gen("write_kv", dialect, weight_format, str(kv_dtype), t)
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, dialect, "", g), "", weight_format, "cpu")
    x = torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16)
    _assert_write_kv_equals_forward(attn, cfg, x, [PagedKvCache(cfg, 1, 16, kv_dtype, "cpu", block_size=4)
                                                   for _ in range(2)])


@pytest.mark.cuda
@pytest.mark.parametrize("dialect", ["bf16", "modelopt_nvfp4"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("t", [1, 8, 100])
def test_cuda_write_kv_equals_forward_kv(dialect, kv_dtype, t):
    """Bitwise, through the kernels: rests on w4a16_gemv_dual's outputs equalling w4a16_gemv's."""
    cfg = real_config("35b_a3b")
    g = _gen("cuda_write_kv", dialect, str(kv_dtype), t)
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, dialect, "", g, "cuda"), "", "nvfp4", "cuda")
    x = torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()
    _assert_write_kv_equals_forward(attn, cfg, x, [PagedKvCache(cfg, 1, 16, kv_dtype, "cuda") for _ in range(2)])


@pytest.mark.cuda
@pytest.mark.parametrize("step", [{"x": 1, "y": 1, "z": 1}, {"x": 4, "y": 4, "z": 4}, {"x": 1, "y": 3, "z": 12}])
def test_cuda_forward_never_syncs(step):
    """Decode, verify and mixed steps issue no host sync (torch's sync debug mode raises on one)."""
    cfg = real_config("35b_a3b")
    g = _gen("nosync", tuple(step.values()))
    attn = Qwen3AttentionLayer.from_state_dict(cfg, attention_state_dict(cfg, "bf16", "l.", g, "cuda"), "l.", "nvfp4", "cuda")
    cache = PagedKvCache(cfg, 1, 64, torch.float8_e4m3fn, "cuda")
    for s in step:
        attn(torch.randn(20, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda(), cache.plan({s: 20}), cache)
    x = torch.randn(sum(step.values()), cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()
    attn(x, cache.plan(step), cache)                        # warm-up (lazy inits may sync once)
    meta = cache.plan(step)                                  # plan() may sync: outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn(x, meta, cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
