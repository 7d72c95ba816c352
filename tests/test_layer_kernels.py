"""rms_norm, qk_norm_rope and sigmoid_gate_mul: references against independent oracles (HF's
RMSNorm and rotary modules, reshape_and_cache) and validation (CPU); kernels against the
references on fresh random data with poisoned outputs, strided inputs, FP8 caches and a
CUDA-graph replay (CUDA)."""
import zlib

import pytest
import torch

from atlas import ops, reference as ref
from helpers import poison_, rel_err


def _gen(*key):
    """A generator seeded from the case's parameters (crc32: stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _close_after_cancellation(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 step of want, or within 2^-20 of the tensor's amax: RoPE's x1·c − x2·s can
    cancel to a tiny value whose float32 rounding noise (~1e-7 of the operands) is many bf16 steps
    of the result; the absolute term admits exactly that and nothing larger."""
    atol = want.float().abs().max() * 2.0**-20
    return bool(((_bf16_ulps(out, want) <= 1.0) | ((out.float() - want.float()).abs() <= atol)).all())


def _bf16_ulps(out: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|out − want| in units of want's bf16 ulp (2^-7 · 2^floor(log2|want|), at least 2^-133)."""
    w = want.float()
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(2.0**-126)).exponent - 8)
    return (out.float() - w).abs() / ulp


# ---- CPU: references against independent oracles --------------------------------------------

@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_reference_matches_hf(zero_centered):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
    g = _gen("rms", zero_centered)
    x = (torch.randn(5, 256, generator=g) * 30).to(torch.bfloat16)
    w = 0.3 * torch.randn(256, generator=g)
    hf = (Qwen3_5MoeRMSNorm if zero_centered else Qwen3RMSNorm)(256, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x.float())                  # float32 HF: the exact value before our one rounding
    out = ops.rms_norm(x, w, 1e-6, zero_centered)
    assert out.dtype == torch.bfloat16 and bool((_bf16_ulps(out, want) <= 0.5 + 1e-3).all())


def test_rms_norm_residual_reference():
    """residual ← bf16(x + residual) (a bf16 torch add), output = rms_norm of that rounded value."""
    g = _gen("rmsres")
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    res = (torch.randn(4, 64, generator=g) * 8).to(torch.bfloat16)
    w = 0.2 * torch.randn(64, generator=g)
    h = x + res
    out = ops.rms_norm(x, w, 1e-6, True, residual=res)
    assert torch.equal(res, h) and torch.equal(out, ops.rms_norm(h, w, 1e-6, True))
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(x, w, 1e-6, True, residual=res[:2])
    with pytest.raises(TypeError, match="residual"):
        ops.rms_norm(x, w, 1e-6, True, residual=res.float())


def test_rope_reference_matches_hf_rotary():
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    cfg = m.Qwen3NextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    rot = m.Qwen3NextRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 100, 999])
    x = torch.randn(5, 3, 64, generator=_gen("rope"))
    cos, sin = rot(x, pos[None])                                   # float32 [1, T, 16]
    want, _ = m.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    c, s = ref.rope_cos_sin(pos, 16, 1e4)
    got = ref.apply_rope_neox(x, c, s)
    # HF's float32 angle at position 999 is off by up to ~6e-5 rad (ours is float64): |x| ≤ 5 → 3e-4
    assert torch.allclose(got, want[0].transpose(0, 1), atol=5e-4)


def _qk_inputs(t, nq, nkv, hd, g, *, gated_layout=False, magnitude=1.0):
    """q as a strided view like the layer's (gated: per-head [q | gate] rows), k/v as views into
    one [T, 2·nkv·hd] buffer."""
    if gated_layout:
        q = (torch.randn(t, nq, 2 * hd, generator=g) * magnitude).to(torch.bfloat16)[..., :hd]
    else:
        q = (torch.randn(t, nq, hd, generator=g) * magnitude).to(torch.bfloat16)
    kv = (torch.randn(t, 2 * nkv * hd, generator=g) * magnitude).to(torch.bfloat16)
    return q, kv[:, :nkv * hd].view(t, nkv, hd), kv[:, nkv * hd:].view(t, nkv, hd)


def _cache(num_blocks, bs, nkv, hd, dtype):
    kc = torch.empty(num_blocks, bs, nkv, hd, dtype=dtype)
    vc = torch.empty_like(kc)
    poison_(kc), poison_(vc)
    if dtype == torch.float8_e4m3fn:
        return kc, vc, torch.full((num_blocks, bs, nkv), float("nan")), torch.full((num_blocks, bs, nkv), float("nan"))
    return kc, vc, None, None


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_qk_norm_rope_reference_is_norm_rope_then_reshape_and_cache(kv_dtype):
    g = _gen("qkref", str(kv_dtype))
    t, nq, nkv, hd, rot = 6, 4, 2, 64, 16
    q, k, v = _qk_inputs(t, nq, nkv, hd, g, gated_layout=True, magnitude=50.0)
    qw, kw = 0.2 * torch.randn(hd, generator=g), 0.2 * torch.randn(hd, generator=g)
    pos = torch.tensor([0, 3, 4, 5, 40, 41])
    slots = torch.tensor([0, 5, -1, 17, 30, 2])
    kc, vc, ks, vs = _cache(4, 8, nkv, hd, kv_dtype)
    q_out = ops.qk_norm_rope(q, k, v, qw, kw, pos, kc, vc, slots, ks, vs, eps=1e-6, zero_centered=True,
                             rotary_dim=rot, rope_theta=1e7)
    # independent composition: HF-style norm (fp32) → rope → one rounding → reshape_and_cache
    c, s = ref.rope_cos_sin(pos, rot, 1e7)
    norm = lambda x, w: x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.equal(q_out, ref.apply_rope_neox(norm(q, qw), c, s).to(torch.bfloat16))
    kc2, vc2, ks2, vs2 = _cache(4, 8, nkv, hd, kv_dtype)
    ops.reshape_and_cache(ref.apply_rope_neox(norm(k, kw), c, s).to(torch.bfloat16), v.contiguous(), kc2, vc2,
                          slots, ks2, vs2)
    for a, b in ((kc, kc2), (vc, vc2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))   # NaN poison kept in unwritten slots
    if ks is not None:
        assert torch.equal(ks.nan_to_num(-1), ks2.nan_to_num(-1)) and torch.equal(vs.nan_to_num(-1), vs2.nan_to_num(-1))


def test_sigmoid_gate_reference():
    g = _gen("sig")
    x = torch.randn(3, 2, 16, generator=g).to(torch.bfloat16)
    gate = (torch.randn(3, 2, 32, generator=g) * 4).to(torch.bfloat16)[..., 16:]
    out = ops.sigmoid_gate_mul(x, gate)
    want = x.double() / (1 + torch.exp(-gate.double()))
    assert bool((_bf16_ulps(out, want) <= 0.5 + 1e-3).all())


def test_validation_names_the_argument():
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="rms_norm: x"):
        ops.rms_norm(x.float(), torch.zeros(16), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: weight"):
        ops.rms_norm(x, torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: x must have D % 8"):
        ops.rms_norm(torch.zeros(2, 12, dtype=torch.bfloat16), torch.zeros(12), 1e-6)
    with pytest.raises(ValueError, match="sigmoid_gate_mul: gate"):
        ops.sigmoid_gate_mul(torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sigmoid_gate_mul: x must be contiguous"):
        ops.sigmoid_gate_mul(torch.zeros(1, 2, 16, dtype=torch.bfloat16)[..., :8], torch.zeros(1, 2, 8, dtype=torch.bfloat16))
    q, k, v = _qk_inputs(2, 4, 2, 64, _gen("val"))
    kc, vc, _, _ = _cache(2, 4, 2, 64, torch.bfloat16)
    fkc, fvc, fks, fvs = _cache(2, 4, 2, 64, torch.float8_e4m3fn)
    w, pos, slots = torch.zeros(64), torch.tensor([0, 1]), torch.tensor([0, 1])
    kw = dict(eps=1e-6, zero_centered=True, rotary_dim=16, rope_theta=1e7)
    cases = [
        (ValueError, "k must have shape", dict(k=k[:, :, :32])),
        (ValueError, "v must have shape", dict(v=v[:1])),
        (TypeError, "positions", dict(pos=pos.int())),
        (ValueError, "slot_mapping must hold slots", dict(slots=torch.tensor([0, 8]))),
        (ValueError, "rotary_dim must be even", dict(kw=dict(kw, rotary_dim=15))),
        (ValueError, "rotary_dim must be even", dict(kw=dict(kw, rotary_dim=128))),
        (TypeError, "k_norm_weight", dict(kw_=w.bfloat16())),
        (ValueError, "k_scale float32", dict(caches=(fkc, fvc, None, fvs))),
        (ValueError, "v_scale must be None", dict(caches=(kc, vc, None, fvs))),
        (ValueError, "q must have a contiguous last dim", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2))),
    ]
    for err, msg, over in cases:
        c = over.get("caches", (kc, vc, None, None))
        with pytest.raises(err, match=msg):
            ops.qk_norm_rope(over.get("q", q), over.get("k", k), over.get("v", v), w, over.get("kw_", w),
                             over.get("pos", pos), c[0], c[1], over.get("slots", slots), c[2], c[3],
                             **over.get("kw", kw))


# ---- CUDA: kernels against the references ----------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("dim", [256, 2048, 5120])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_cuda_rms_norm(rows, dim, zero_centered, weight_dtype):
    g = _gen("crms", rows, dim, zero_centered, str(weight_dtype))
    x = (torch.randn(rows, dim + 16, generator=g) * 1e3).to(torch.bfloat16)[:, 8:dim + 8]   # strided rows
    w = (0.3 * torch.randn(dim, generator=g)).to(weight_dtype)
    want = ref.rms_norm(x, w, 1e-6, zero_centered)
    out = ops.rms_norm(x.cuda(), w.cuda(), 1e-6, zero_centered).cpu()
    # fp32 math in both; rsqrtf and the summation order differ by a few fp32 ulps → at most one
    # bf16 rounding step apart
    assert bool((_bf16_ulps(out, want) <= 1.0).all()) and rel_err(out, want) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("rows,dim", [(1, 2048), (9, 5120), (33, 256)])
def test_cuda_rms_norm_residual(rows, dim):
    g = _gen("crmsres", rows, dim)
    x = torch.randn(rows, dim, generator=g).to(torch.bfloat16)
    res = (torch.randn(rows, dim, generator=g) * 30).to(torch.bfloat16)
    w = (0.3 * torch.randn(dim, generator=g)).to(torch.bfloat16)
    res_ref = res.clone()
    want = ref.rms_norm(x, w, 1e-6, True, res_ref)
    res_d = res.cuda()
    out = ops.rms_norm(x.cuda(), w.cuda(), 1e-6, True, residual=res_d).cpu()
    assert torch.equal(res_d.cpu(), res_ref)                     # fp32 add + one rounding: exact
    assert bool((_bf16_ulps(out, want) <= 1.0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 5, 64])
@pytest.mark.parametrize("heads,hd,rot", [((16, 2), 256, 64), ((24, 4), 256, 64), ((32, 8), 128, 128), ((8, 8), 64, 64)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("gated_layout", [False, True])
def test_cuda_qk_norm_rope(t, heads, hd, rot, kv_dtype, gated_layout):
    nq, nkv = heads
    g = _gen("cqk", t, heads, hd, str(kv_dtype), gated_layout)
    q, k, v = _qk_inputs(t, nq, nkv, hd, g, gated_layout=gated_layout, magnitude=300.0)
    qw, kw = 0.2 * torch.randn(hd, generator=g), 0.2 * torch.randn(hd, generator=g)
    pos = torch.randint(0, 40000, (t,), generator=g)
    num_blocks, bs = 2 * t + 2, 16
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[0] = -1                                                   # a padding row: no write
    kc, vc, ks, vs = _cache(num_blocks, bs, nkv, hd, kv_dtype)
    kw_ = dict(eps=1e-6, zero_centered=True, rotary_dim=rot, rope_theta=1e7)
    want_q = ref.qk_norm_rope(q, k, v, qw, kw, pos, kc, vc, slots, ks, vs, **kw_)
    kc_d, vc_d, ks_d, vs_d = _cache(num_blocks, bs, nkv, hd, kv_dtype)
    kc_d, vc_d = kc_d.cuda(), vc_d.cuda()
    ks_d, vs_d = (ks_d.cuda(), vs_d.cuda()) if ks_d is not None else (None, None)
    got_q = ops.qk_norm_rope(q.cuda(), k.cuda(), v.cuda(), qw.cuda(), kw.cuda(), pos.cuda(), kc_d, vc_d,
                             slots.cuda(), ks_d, vs_d, **kw_).cpu()
    # fp32 math with float64 angles in both; rsqrtf/order differences → ≤ 1 bf16 step
    assert _close_after_cancellation(got_q, want_q), "q"
    # V is copied (bf16) or quantized from the same bf16 input: bit-exact; unwritten slots keep NaN
    assert torch.equal(vc_d.cpu().view(torch.uint8), vc.view(torch.uint8))
    if kv_dtype == torch.bfloat16:
        assert _close_after_cancellation(kc_d.cpu().nan_to_num(0), kc.nan_to_num(0))
        assert torch.equal(kc_d.cpu().isnan(), kc.isnan())
    else:
        assert torch.equal(vs_d.cpu().nan_to_num(-1), vs.nan_to_num(-1))
        written = slots[slots >= 0]
        kd = ref.dequantize_kv_fp8(kc_d.cpu().view(-1, nkv, hd)[written], ks_d.cpu().view(-1, nkv)[written])
        kr = ref.dequantize_kv_fp8(kc.view(-1, nkv, hd)[written], ks.view(-1, nkv)[written])
        assert rel_err(kd, kr) < 2e-2              # a one-ulp bf16 difference can flip an e4m3 rounding


@pytest.mark.cuda
@pytest.mark.parametrize("t,heads,hd", [(1, 16, 256), (7, 24, 256), (300, 32, 128)])
def test_cuda_sigmoid_gate_mul(t, heads, hd):
    g = _gen("csg", t, heads, hd)
    x = torch.randn(t, heads, hd, generator=g).to(torch.bfloat16)
    gate = (torch.randn(t, heads, 2 * hd, generator=g) * 6).to(torch.bfloat16)[..., hd:]
    want = ref.sigmoid_gate_mul(x, gate)
    out = ops.sigmoid_gate_mul(x.cuda(), gate.cuda()).cpu()
    assert bool((_bf16_ulps(out, want) <= 1.0).all())


@pytest.mark.cuda
def test_cuda_graph_replay():
    """The three kernels captured in one graph, replayed with new inputs copied into the static
    buffers, equal eager launches."""
    g = _gen("graph")
    t, nq, nkv, hd = 4, 16, 2, 256
    q, k, v = [x.cuda() for x in _qk_inputs(t, nq, nkv, hd, g, gated_layout=True)]
    w = (0.2 * torch.randn(hd, generator=g)).cuda()
    pos, slots = torch.arange(t).cuda() + 100, torch.arange(t).cuda() + 3
    kc = torch.zeros(2, 16, nkv, hd, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    kw = dict(eps=1e-6, zero_centered=True, rotary_dim=64, rope_theta=1e7)

    def step():
        qo = ops.qk_norm_rope(q, k, v, w, w, pos, kc, vc, slots, **kw)
        return ops.sigmoid_gate_mul(ops.rms_norm(qo.view(t * nq, hd), w, 1e-6, True).view(t, nq, hd), qo)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g).to(torch.bfloat16))
        pos.add_(7)
        graph.replay()
        got, kc_g = out.clone(), kc.clone()
        assert torch.equal(got, step()) and torch.equal(kc_g, kc), i
