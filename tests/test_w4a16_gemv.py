"""w4a16_gemv family: the reference against an independent float64 oracle and the op semantics
on CPU; validation errors; on a GPU the kernels against the reference, batch invariance over
M, every fused variant bitwise against its unfused composition, and CUDA-graph replay."""
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import atlas
from atlas import ops, reference
from atlas.nvfp4 import NVFP4Weight
from helpers import poison_, rel_err

# Tolerances (normwise, vs the float32 reference before any rounding):
#   bf16 out: rounding to bf16 is ≤ 2^-8 relative per element (half an ulp, ulp ≤ 2^-7·|v|),
#             so ≤ 2^-8 normwise (≈ 1.7e-3 typical); f32 accumulation adds < 1e-5.
#   f32 out : only the f32 summation differs (tensor-core k16 steps whose internal accumulation
#             may keep fewer than 24 bits, split-K order): ~1e-6 expected, 1e-4 allowed (still
#             17× below one bf16 rounding, so a bf16-rounded f32 path fails it).
TOL = {torch.bfloat16: 2.0 ** -8 + 1e-4, torch.float32: 1e-4}

# (N, K) of the issue: Qwen3.6-27B and Qwen3.5/3.6-35B-A3B projections (LM heads K-sliced in
# the CUDA sweep so the float32 reference stays small)
SHAPES_27B = [(14336, 5120), (5120, 6144), (34816, 5120), (5120, 17408)]
SHAPES_A3B = [(8192, 2048), (512, 2048), (2048, 4096), (1024, 2048), (2048, 512)]
LM_HEADS = [(248320, 1024), (248077, 256)]            # 248320×5120 / ×2048 K-sliced; odd vocab
AWKWARD = [(1, 16), (17, 48), (33, 4112), (100, 272), (7, 2064)]  # N = 1, 17; K % 128 != 0
M_ALL = [1, 2, 3, 4, 5, 8, 16, 32]


def _gen(*key, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(repr(key).encode()))


def random_e4m3(shape, gen, device="cpu") -> torch.Tensor:
    """Random finite, non-negative e4m3 block scales over the whole range: exponent field 0..15
    (0 = subnormal), random mantissa, the NaN code 0x7F avoided, some exact zeros."""
    b = torch.randint(0, 0x7F, shape, generator=gen, device=device, dtype=torch.int32)
    b = torch.where(torch.rand(shape, generator=gen, device=device) < 0.01, torch.zeros_like(b), b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def random_weight(n, k, *, key, device="cpu", global_scale=None) -> NVFP4Weight:
    """Random NVFP4 weight: every 4-bit code (−0 included), scales as random_e4m3 (zero-scale
    blocks get zero codes, as quantizers write them), a global scale near 1e-3 unless given."""
    gen = _gen("w", n, k, key, device=device)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    scale = random_e4m3((n, k // 16), gen, device)
    zero_blocks = (scale.view(torch.uint8) == 0).repeat_interleave(8, dim=1)
    packed = torch.where(zero_blocks, torch.zeros_like(packed), packed)
    if global_scale is None:
        global_scale = float(torch.rand((), generator=gen, device=device)) * 2e-3 + 1e-4
    return NVFP4Weight(packed, scale, torch.tensor(global_scale, dtype=torch.float32, device=device))


def random_x(m, k, *, key, device="cpu", scale=1.0) -> torch.Tensor:
    gen = _gen("x", m, k, key, device=device)
    return (torch.randn(m, k, generator=gen, device=device) * scale).to(torch.bfloat16)


def oracle(x: torch.Tensor, q: NVFP4Weight) -> torch.Tensor:
    """float64 x · Wᵀ with W decoded from the bits (independent of reference.dequantize_nvfp4)."""
    n, k = q.shape
    p = q.packed.cpu().long()
    codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(n, k)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    e2m1 = mags[codes & 7] * torch.where(codes & 8 != 0, -1.0, 1.0).double()
    b = q.block_scale.cpu().view(torch.uint8).long()
    e, mant = (b >> 3) & 15, (b & 7).double()
    s = torch.where(e == 0, mant / 8 * 2.0 ** -6, (1 + mant / 8) * torch.pow(2.0, (e - 7).double()))
    s = s * torch.where(b & 0x80 != 0, -1.0, 1.0).double()
    w = e2m1 * s.repeat_interleave(16, dim=1) * float(q.global_scale)
    return x.cpu().double() @ w.T


# =============================================================================================
# CPU: reference and op semantics
# =============================================================================================

@pytest.mark.parametrize("n,k", [(1, 16), (17, 48), (64, 256), (40, 2048)])
@pytest.mark.parametrize("m", [1, 3, 32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_reference_matches_oracle(n, k, m, out_dtype):
    q = random_weight(n, k, key="oracle")
    x = random_x(m, k, key="oracle")
    y = reference.w4a16_gemv(x, q.packed, q.block_scale, q.global_scale, out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    assert rel_err(y, oracle(x, q)) <= TOL[out_dtype]


@pytest.mark.parametrize("global_scale", [2.0 ** -120, 2.0 ** 100])
def test_reference_extreme_global_scales(global_scale):
    q = random_weight(32, 64, key=("gs", global_scale), global_scale=global_scale)
    x = random_x(4, 64, key="gs")
    y = reference.w4a16_gemv(x, q.packed, q.block_scale, q.global_scale, torch.float32)
    assert torch.isfinite(y).all() and rel_err(y, oracle(x, q)) <= TOL[torch.float32]


def test_quantized_weight_roundtrip():
    w = torch.randn(48, 96, generator=_gen("rt"))
    q = atlas.quantize_nvfp4(w)
    x = random_x(5, 96, key="rt")
    assert rel_err(ops.w4a16_gemv(x, q, out_dtype=torch.float32), oracle(x, q)) <= TOL[torch.float32]


def test_ops_semantics_cpu():
    q = random_weight(96, 64, key="sem")
    x = random_x(3, 64, key="sem")
    full = ops.w4a16_gemv(x, q, out_dtype=torch.float32)
    assert torch.equal(ops.w4a16_gemv(x, q), full.bfloat16())
    # (the CPU matmul may block a narrower N differently: prefixes agree to f32 rounding here,
    # bitwise in the kernel, see test_n_rows_prefix)
    assert rel_err(ops.w4a16_gemv(x, q, out_dtype=torch.float32, n_rows=37), full[:, :37]) <= 1e-6
    out = poison_(torch.empty(3, 50, dtype=torch.float32))
    assert ops.w4a16_gemv(x, q, out_dtype=torch.float32, n_rows=50, out=out) is out
    assert rel_err(out, full[:, :50]) <= 1e-6
    # qg: head h's q rows [h·2hd, h·2hd + hd) land at columns h·hd.., its gate rows at nq·hd + h·hd..
    nq, hd = 3, 16
    qg = ops.w4a16_gemv_qg(x, q, nq, hd)
    for h in range(nq):
        assert torch.equal(qg[:, h * hd:(h + 1) * hd], full[:, 2 * h * hd:2 * h * hd + hd].bfloat16())
        assert torch.equal(qg[:, nq * hd + h * hd:nq * hd + (h + 1) * hd],
                           full[:, 2 * h * hd + hd:2 * (h + 1) * hd].bfloat16())
    q2 = random_weight(40, 64, key="sem2", global_scale=7.0)
    y1, y2 = ops.w4a16_gemv_dual(x, q, q2)
    assert torch.equal(y1, ops.w4a16_gemv(x, q)) and torch.equal(y2, ops.w4a16_gemv(x, q2))
    g, u = random_x(3, 64, key="g"), random_x(3, 64, key="u")
    assert torch.equal(ops.w4a16_gemv_silu(g, u, q), ops.w4a16_gemv(reference.silu_mul(g, u), q))
    # dual with a gated q1: y1 is w4a16_gemv_qg's [Q | G]
    y1, y2 = ops.w4a16_gemv_dual(x, q, q2, qg_head_dim=hd)
    assert torch.equal(y1, qg) and torch.equal(y2, ops.w4a16_gemv(x, q2))
    # gated: the reference composition, the gate read in place from a strided [M, Q | G] half
    qg_buf = random_x(3, 128, key="qg_buf")
    gate = qg_buf[:, 64:]
    want = ops.w4a16_gemv(reference.sigmoid_gate_mul(x, gate), q)
    assert torch.equal(ops.w4a16_gemv_gated(x, gate, q), want)
    assert torch.equal(ops.w4a16_gemv_gated(x, gate.contiguous(), q), want)


def test_sigmoid_gate_mul_definition():
    """The gated activation: x · sigmoid(g) in float32, one rounding (values far from 1 too)."""
    x = torch.tensor([[3.0, -2.0, 1e4, 0.5, -7.0, 1.0, 0.0, 250.0]]).bfloat16()
    g = torch.tensor([[-100.0, -1.0, 0.0, 0.5, 3.0, 90.0, 1.0, -2.0]]).bfloat16()
    xf, gf = x.double(), g.double()
    assert torch.equal(reference.sigmoid_gate_mul(x, g), (xf / (1 + torch.exp(-gf))).bfloat16())


def test_silu_mul_definition():
    g = torch.tensor([[-100.0, -1.0, 0.0, 0.5, 3.0, 90.0, 1.0, 2.0]]).bfloat16()
    u = torch.tensor([[1.0, 2.0, 5.0, -1.0, 0.25, 1.0, 0.0, -3.0]]).bfloat16()
    gf = g.double()
    expect = (gf / (1 + torch.exp(-gf)) * u.double()).bfloat16()
    assert torch.equal(reference.silu_mul(g, u), expect)


# ---- validation: one negative test per rule, matched on the argument name ---------------------

def _q(n=32, k=64):
    return random_weight(n, k, key="val")


def _x(m=2, k=64, dtype=torch.bfloat16):
    return torch.zeros(m, k, dtype=dtype)


BAD_CALLS = [
    ("x dtype", lambda: ops.w4a16_gemv(_x(dtype=torch.float16), _q()), TypeError, "x must be bfloat16"),
    ("x rank", lambda: ops.w4a16_gemv(torch.zeros(2, 2, 64, dtype=torch.bfloat16), _q()), ValueError, "x must be"),
    ("x K % 16", lambda: ops.w4a16_gemv(_x(k=40), _q()), ValueError, "x must have K % 16 == 0"),
    ("x K mismatch", lambda: ops.w4a16_gemv(_x(k=32), _q()), ValueError, "x must have K = 64"),
    ("x M > 32", lambda: ops.w4a16_gemv(_x(m=33), _q()), ValueError, "x must have 1 ≤ M ≤ 32"),
    ("x M = 0", lambda: ops.w4a16_gemv(_x(m=0), _q()), ValueError, "x must have 1 ≤ M ≤ 32"),
    ("x not a tensor", lambda: ops.w4a16_gemv([[0.0] * 64], _q()), TypeError, "x must be a torch.Tensor"),
    ("q type", lambda: ops.w4a16_gemv(_x(), torch.zeros(32, 32, dtype=torch.uint8)), TypeError, "q must be an atlas.NVFP4Weight"),
    ("device", lambda: ops.w4a16_gemv(_x().to("meta"), _q()), ValueError, "x must be on cpu"),
    ("out_dtype", lambda: ops.w4a16_gemv(_x(), _q(), out_dtype=torch.float16), TypeError, "out_dtype must be"),
    ("n_rows 0", lambda: ops.w4a16_gemv(_x(), _q(), n_rows=0), ValueError, "n_rows must be"),
    ("n_rows > N", lambda: ops.w4a16_gemv(_x(), _q(), n_rows=33), ValueError, "n_rows must be"),
    ("out shape", lambda: ops.w4a16_gemv(_x(), _q(), out=torch.empty(2, 31, dtype=torch.bfloat16)), ValueError, "out must have shape"),
    ("out dtype", lambda: ops.w4a16_gemv(_x(), _q(), out=torch.empty(2, 32)), TypeError, "out must be bfloat16"),
    ("qg N", lambda: ops.w4a16_gemv_qg(_x(), _q(), 3, 8), ValueError, "q must have N = 2·num_heads·head_dim"),
    ("qg head_dim", lambda: ops.w4a16_gemv_qg(_x(), _q(), 2, 0), ValueError, "head_dim must be a positive int"),
    ("dual K", lambda: ops.w4a16_gemv_dual(_x(), _q(), _q(32, 32)), ValueError, "q2 must have K = 64"),
    ("dual q2 type", lambda: ops.w4a16_gemv_dual(_x(), _q(), None), TypeError, "q2 must be an atlas.NVFP4Weight"),
    ("dual x", lambda: ops.w4a16_gemv_dual(_x(m=40), _q(), _q()), ValueError, "x must have 1 ≤ M ≤ 32"),
    ("silu up shape", lambda: ops.w4a16_gemv_silu(_x(m=2), _x(m=3), _q()), ValueError, "up must have the shape of gate"),
    ("silu gate dtype", lambda: ops.w4a16_gemv_silu(_x(dtype=torch.float32), _x(), _q()), TypeError, "gate must be bfloat16"),
    ("silu up K", lambda: ops.w4a16_gemv_silu(_x(), _x(k=48), _q()), ValueError, "up must have K"),
    ("dual qg_head_dim < 0", lambda: ops.w4a16_gemv_dual(_x(), _q(), _q(), qg_head_dim=-1), ValueError,
     "qg_head_dim must be an int ≥ 0"),
    ("dual qg_head_dim type", lambda: ops.w4a16_gemv_dual(_x(), _q(), _q(), qg_head_dim=8.0), ValueError,
     "qg_head_dim must be an int ≥ 0"),
    ("dual qg heads", lambda: ops.w4a16_gemv_dual(_x(), _q(), _q(), qg_head_dim=12), ValueError,
     "q1 must have N1 a multiple of 2·qg_head_dim"),
    ("gated gate shape", lambda: ops.w4a16_gemv_gated(_x(m=2), _x(m=3), _q()), ValueError, "gate must have the shape of x"),
    ("gated gate dtype", lambda: ops.w4a16_gemv_gated(_x(), _x(dtype=torch.float16), _q()), TypeError, "gate must be bfloat16"),
    ("gated gate K", lambda: ops.w4a16_gemv_gated(_x(), _x(k=48), _q()), ValueError, "gate must have K"),
    ("gated x M", lambda: ops.w4a16_gemv_gated(_x(m=33), _x(m=33), _q()), ValueError, "x must have 1 ≤ M ≤ 32"),
    ("gated gate device", lambda: ops.w4a16_gemv_gated(_x(), _x().to("meta"), _q()), ValueError, "gate must be on cpu"),
    ("gated q type", lambda: ops.w4a16_gemv_gated(_x(), _x(), None), TypeError, "q must be an atlas.NVFP4Weight"),
]


@pytest.mark.parametrize("what,call,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_validation(what, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# =============================================================================================
# CUDA: kernels vs the reference, invariance, fused variants, graphs
# =============================================================================================

def _cuda_case(n, k, m, key, **kw):
    q = random_weight(n, k, key=key, device="cuda", **kw)
    x = random_x(m, k, key=key, device="cuda")
    return q, x


LAYOUTS = ["checkpoint", "tiled"]


def _in_layout(q: NVFP4Weight, layout: str) -> NVFP4Weight:
    """q as the layers hold it: the checkpoint tensors, or (tiled) a second handle with
    prepare_gemv's derived layout (K % 128 == 0; the caller skips other K)."""
    if layout == "checkpoint":
        return q
    if q.shape[1] % 128 != 0:
        pytest.skip("the tiled layout needs K % 128 == 0")
    return _tiled(q)


def _ref(x, q, out_dtype=torch.float32, n_rows=None):
    n_rows = q.shape[0] if n_rows is None else n_rows
    return reference.w4a16_gemv(x, q.packed[:n_rows], q.block_scale[:n_rows], q.global_scale, out_dtype)


def _check(y, x, q, out_dtype):
    ref = _ref(x, q)
    assert y.dtype == out_dtype and y.shape == ref.shape
    err = rel_err(y, ref)
    assert err <= TOL[out_dtype], f"rel err {err:.3e}"


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", SHAPES_A3B + AWKWARD + LM_HEADS[1:])
@pytest.mark.parametrize("m", M_ALL)
def test_gemv_matches_reference(n, k, m):
    q, x = _cuda_case(n, k, m, key="ref")
    out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
    _check(ops.w4a16_gemv(x, q, out=out), x, q, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("n,k", SHAPES_27B + LM_HEADS[:1])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_gemv_matches_reference_27b(n, k, m):
    q, x = _cuda_case(n, k, m, key="ref27")
    out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
    _check(ops.w4a16_gemv(x, q, out=out), x, q, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(2048, 4096), (17, 48), (248077, 256), (100, 272)])
@pytest.mark.parametrize("m", [1, 7, 32])
def test_gemv_fp32_out(n, k, m):
    q, x = _cuda_case(n, k, m, key="f32")
    out = poison_(torch.empty(m, n, dtype=torch.float32, device="cuda"))
    _check(ops.w4a16_gemv(x, q, out_dtype=torch.float32, out=out), x, q, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("global_scale", [2.0 ** -120, 2.0 ** 100, 1.0])
def test_gemv_extreme_scales(global_scale):
    """Tiny and huge global scales, activations far from 1: the 2^±bias factoring stays exact."""
    q = random_weight(160, 2048, key=("gs", global_scale), device="cuda", global_scale=global_scale)
    x = random_x(4, 2048, key="gs", device="cuda", scale=300.0)
    y = ops.w4a16_gemv(x, q, out_dtype=torch.float32)
    assert torch.isfinite(y).all()
    _check(y, x, q, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(5120, 6144), (512, 2048), (2048, 512), (33, 4112), (248077, 256),
                                 (1024, 1152), (2048, 2944), (5120, 17408), (14336, 5120)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_invariance(n, k, layout):
    """Row i of an M-row call is bitwise the 1-row result, for every M in 1..32, in both weight
    layouts (the one-row kernel and the staged kernel at every MT / TPW)."""
    q, x = _cuda_case(n, k, 32, key="inv")
    q = _in_layout(q, layout)
    y32 = ops.w4a16_gemv(x, q)
    for m in range(1, 33):
        assert torch.equal(ops.w4a16_gemv(x[:m], q), y32[:m]), f"M={m}"
    for i in range(32):
        assert torch.equal(ops.w4a16_gemv(x[i:i + 1].clone(), q), y32[i:i + 1]), f"row {i}"
    _check(y32, x, q, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k,n_rows", [(248077, 256, 151936), (2048, 512, 1), (1024, 2048, 999)])
@pytest.mark.parametrize("m", [1, 9])
def test_n_rows_prefix(n, k, n_rows, m):
    q, x = _cuda_case(n, k, m, key="nrows")
    full = ops.w4a16_gemv(x, q, out_dtype=torch.float32)
    out = poison_(torch.empty(m, n_rows, dtype=torch.float32, device="cuda"))
    y = ops.w4a16_gemv(x, q, out_dtype=torch.float32, n_rows=n_rows, out=out)
    assert torch.equal(y, full[:, :n_rows])


@pytest.mark.cuda
@pytest.mark.parametrize("k", [5120, 1024, 4112, 640, 1152, 2176, 8192, 8320, 20480, 20608])
@pytest.mark.parametrize("m", [1, 9, 32])
def test_split_policy_bitwise(k, m):
    """The launcher picks the split of K from N (one CTA per row group over all of K for a large
    N, 2 segments per CTA, or one; at M = 1 over the warps of one CTA when the CTA can stage all
    of K (K ≤ 20480), over a cluster above); row prefixes of one weight that land on each choice
    agree bitwise. K = 640, 1152, 2176 leave the last segment short or empty; 20480 / 20608 are
    both sides of the warp-split limit. The one-split M = 1 plan (> 24 tiles per SM) is the LM
    head shapes' (LM_HEADS)."""
    n = 25600 if k <= 8320 else 3200
    q, x = _cuda_case(n, k, m, key="splits")
    full = ops.w4a16_gemv(x, q, out_dtype=torch.float32)
    for n_rows in (6400, 640, 17):
        if n_rows >= n:
            continue
        out = poison_(torch.empty(m, n_rows, dtype=torch.float32, device="cuda"))
        y = ops.w4a16_gemv(x, q, out_dtype=torch.float32, n_rows=n_rows, out=out)
        assert torch.equal(y, full[:, :n_rows]), f"n_rows={n_rows}"
    # M ≤ 8 may pick 2-warp CTAs where M > 8 keeps 4: the first row is still the 1-row result
    assert torch.equal(ops.w4a16_gemv(x[:1].clone(), q, out_dtype=torch.float32), full[:1])
    _check(full, x, q, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("nq,hd,k", [(24, 256, 5120), (16, 256, 2048), (2, 16, 48)])
@pytest.mark.parametrize("m", [1, 4, 32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_qg_bitwise_vs_unfused(nq, hd, k, m, layout):
    q, x = _cuda_case(2 * nq * hd, k, m, key="qg")
    q = _in_layout(q, layout)
    _poison_allocator(m * 2 * nq * hd)
    y = ops.w4a16_gemv_qg(x, q, nq, hd)
    assert torch.equal(y, reference.qg_deinterleave(ops.w4a16_gemv(x, q), nq, hd))


@pytest.mark.cuda
@pytest.mark.parametrize("n1,n2,k", [(1024, 1024, 5120), (512, 512, 2048), (17, 100, 272), (1, 33, 4112)])
@pytest.mark.parametrize("m", [1, 3, 32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dual_bitwise_vs_unfused(n1, n2, k, m, layout):
    q1 = _in_layout(random_weight(n1, k, key="d1", device="cuda"), layout)
    q2 = _in_layout(random_weight(n2, k, key="d2", device="cuda", global_scale=3.0), layout)
    x = random_x(m, k, key="dual", device="cuda")
    _poison_allocator(m * max(n1, n2))
    y1, y2 = ops.w4a16_gemv_dual(x, q1, q2)
    assert torch.equal(y1, ops.w4a16_gemv(x, q1)) and torch.equal(y2, ops.w4a16_gemv(x, q2))
    _check(y2, x, q2, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(5120, 17408), (2048, 512), (512, 2048), (17, 48), (33, 4112)])
@pytest.mark.parametrize("m", [1, 5, 32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_silu_bitwise_vs_unfused(n, k, m, layout):
    q = _in_layout(random_weight(n, k, key="silu", device="cuda"), layout)
    g = random_x(m, k, key="g", device="cuda", scale=4.0)
    u = random_x(m, k, key="u", device="cuda")
    _poison_allocator(m * n)
    y = ops.w4a16_gemv_silu(g, u, q)
    assert torch.equal(y, ops.w4a16_gemv(reference.silu_mul(g, u), q))


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 6144), (17, 48), (33, 4112), (100, 272)])
@pytest.mark.parametrize("m", [1, 4, 32])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gated_bitwise_vs_unfused(n, k, m, strided, layout):
    """o_proj with the attention output gate on its load == sigmoid_gate_mul then w4a16_gemv,
    bitwise (35B-A3B and 27B o_proj, odd shapes; the gate contiguous or the G half of a
    [M, Q | G] buffer, read in place with row stride 2K), in both weight layouts."""
    q = _in_layout(random_weight(n, k, key="gated", device="cuda"), layout)
    x = random_x(m, k, key="gated_x", device="cuda", scale=30.0)          # far from 1
    buf = random_x(m, 2 * k, key="gated_g", device="cuda", scale=4.0)     # sigmoid saturates too
    gate = buf[:, k:] if strided else buf[:, k:].contiguous()
    unfused = ops.w4a16_gemv(ops.sigmoid_gate_mul(x.view(m, 1, k), gate.view(m, 1, k)).view(m, k), q)
    _poison_allocator(m * n)
    y = ops.w4a16_gemv_gated(x, gate, q)
    assert torch.equal(y, unfused)
    ref = _ref(reference.sigmoid_gate_mul(x, gate), q)
    assert rel_err(y, ref) <= TOL[torch.bfloat16] + 2.0 ** -8    # + sigmoid_gate_mul's ≤ 1-ulp expf


@pytest.mark.cuda
@pytest.mark.parametrize("nq,hd,n2,k", [(16, 256, 1024, 2048), (24, 256, 2048, 5120), (2, 16, 33, 272)])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_dual_qg_bitwise_vs_unfused(nq, hd, n2, k, m):
    """Dual launch with the gated q_proj de-interleaved on the store: y1 == w4a16_gemv_qg, y2 ==
    w4a16_gemv (35B-A3B and 27B q_proj + [k; v])."""
    q1 = random_weight(2 * nq * hd, k, key="dqg1", device="cuda")
    q2 = random_weight(n2, k, key="dqg2", device="cuda", global_scale=3.0)
    x = random_x(m, k, key="dqg", device="cuda")
    _poison_allocator(m * max(2 * nq * hd, n2))
    y1, y2 = ops.w4a16_gemv_dual(x, q1, q2, qg_head_dim=hd)
    assert torch.equal(y1, ops.w4a16_gemv_qg(x, q1, nq, hd)) and torch.equal(y2, ops.w4a16_gemv(x, q2))


@pytest.mark.cuda
def test_cuda_graph_replay_gated():
    """The gated GEMV captured with a strided gate reads the static buffers at replay."""
    m, k, n = 4, 4096, 2048
    q = random_weight(n, k, key="graph_gated", device="cuda")
    static_x = random_x(m, k, key="graph_gated_x", device="cuda")
    static_qg = random_x(m, 2 * k, key="graph_gated_qg", device="cuda")
    ops.w4a16_gemv_gated(static_x, static_qg[:, k:], q)        # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.w4a16_gemv_gated(static_x, static_qg[:, k:], q)
    for step in range(3):
        static_x.copy_(random_x(m, k, key=("graph_gated_x", step), device="cuda"))
        static_qg.copy_(random_x(m, 2 * k, key=("graph_gated_qg", step), device="cuda", scale=3.0))
        poison_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ops.w4a16_gemv_gated(static_x, static_qg[:, k:].contiguous(), q))


@pytest.mark.cuda
def test_cuda_graph_replay():
    q, x = _cuda_case(4096, 2048, 8, key="graph")
    q2 = random_weight(512, 2048, key="graph2", device="cuda")
    out = poison_(torch.empty(8, 4096, dtype=torch.bfloat16, device="cuda"))
    static_x = x.clone()
    ops.w4a16_gemv(static_x, q, out=out)  # warm-up (smem opt-in, lazy module load) outside capture
    ops.w4a16_gemv_dual(static_x, q, q2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.w4a16_gemv(static_x, q, out=out)
        y1, y2 = ops.w4a16_gemv_dual(static_x, q, q2)
    for step in range(3):
        static_x.copy_(random_x(8, 2048, key=("graph", step), device="cuda"))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.w4a16_gemv(static_x, q))
        assert torch.equal(y1, out) and torch.equal(y2, ops.w4a16_gemv(static_x, q2))


def _poison_allocator(numel: int) -> None:
    """Leave NaN in the caching allocator's free blocks so a fresh output starts poisoned."""
    t = torch.empty(max(numel, 1) * 2, dtype=torch.float32, device="cuda")
    t.fill_(float("nan"))
    del t


# =============================================================================================
# Built extension (no GPU needed): the SASS has no undefined cache-descriptor read
# =============================================================================================

def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    candidates = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"]
    try:
        import triton  # ships a cuobjdump for its own use
        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except Exception:
        pass
    return next((str(c) for c in candidates if c.is_file()), None)


def undefined_descriptor_reads(sass: str) -> list:
    """(function, [n]) for each function of a `cuobjdump -sass` listing that reads a cache
    descriptor desc[URn] with no instruction writing URn (64-bit writes cover URn and URn+1)."""
    bad = []
    for fn in re.split(r"\n\s+Function : ", sass)[1:]:
        name = fn.split("\n", 1)[0].strip()
        uses = {int(n) for n in re.findall(r"desc\[UR(\d+)\]", fn)}
        defs = set()
        for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?((?:U|R2UR|S2UR|LDCU)[\w.]*)\s+UR(\d+)", fn):
            defs.add(int(m.group(2)))
            if ".64" in m.group(1):
                defs.add(int(m.group(2)) + 1)
        missing = sorted(uses - defs)
        if missing:
            bad.append((name, missing))
    return bad


def test_undefined_descriptor_detector():
    """The detector flags the ptxas 13.x miscompile's signature and passes a defined read."""
    broken = ("\n        Function : k\n        /*0850*/  LDGSTS.E.BYPASS.128 [R21+UR0], "
              "desc[UR1][R12.64], !P5 ;\n")
    fine = ("\n        Function : k\n        /*0010*/  ULDC.64 UR4, c[0x0][0x208] ;\n"
            "        /*0560*/  LDGSTS.E.BYPASS.128 [R13], desc[UR4][R8.64], !P2 ;\n")
    assert undefined_descriptor_reads(broken) == [("k", [1])]
    assert undefined_descriptor_reads(fine) == []


@pytest.mark.skipif(not atlas._ext.extension_built(), reason="atlas._C is not built")
def test_sass_cache_descriptors_defined():
    """Every global access's cache descriptor desc[URn] in atlas._C is written in its function.
    ptxas 13.x on sm_90 can drop a createpolicy while keeping the cp.async.L2::cache_hint users,
    which then trap with cudaErrorIllegalInstruction (w4a16_gemv v2, H200 run 6; the same bug as
    IST-DASLab/marlin#44): this catches it on any machine that builds the extension."""
    exe = _cuobjdump()
    if exe is None:
        pytest.skip("no cuobjdump")
    so = atlas._ext._C.__file__
    sass = subprocess.run([exe, "-sass", so], capture_output=True, text=True, timeout=900).stdout
    if "Function : " not in sass:
        pytest.skip("no SASS in the extension")
    bad = undefined_descriptor_reads(sass)
    assert not bad, f"undefined cache-descriptor reads: {bad[:5]}"


# ---- the tiled weight layout (NVFP4Weight.prepare_gemv / nvfp4.tile_for_gemv) -----------------

def _tiled(q: NVFP4Weight) -> NVFP4Weight:
    """A second handle on q's tensors with the tiled GEMV layout derived (q itself stays on the
    checkpoint layout)."""
    t = NVFP4Weight(q.packed, q.block_scale, q.global_scale).prepare_gemv()
    assert t.gemv_operands()[0].dim() == 3
    return t


def test_tile_for_gemv_layout_cpu():
    """The tiled layout (csrc/w4a16_gemv.h): [N, C, b] views (b = 64 packed, 8 scales) of
    chunk-major buffers — element [n, c] is row n's chunk c (packed words in gemv_word_bits
    order), stored at c·N·b + n·b."""
    from atlas.nvfp4 import gemv_word_bits, tile_for_gemv
    for n, k in [(1, 128), (17, 256), (33, 384), (48, 128), (5, 512)]:
        q = random_weight(n, k, key=("tile", n, k))
        before = q.packed.clone()
        p, s = tile_for_gemv(q)
        assert torch.equal(q.packed, before)                # a copy: the checkpoint tensors stay as they are
        assert p.shape == (n, k // 128, 64) and s.shape == (n, k // 128, 8) and s.dtype == torch.float8_e4m3fn
        c_n = k // 128
        for t, b, src in ((p, 64, gemv_word_bits(q.packed)), (s.view(torch.uint8), 8, q.block_scale.view(torch.uint8))):
            assert t.transpose(0, 1).is_contiguous() and t.storage_offset() == 0
            assert torch.equal(t, src.reshape(n, c_n, b))
            storage = t.transpose(0, 1).reshape(-1)
            for row in range(n):
                for c in range(c_n):
                    off = c * n * b + row * b
                    assert torch.equal(storage[off:off + b], src[row, c * b:(c + 1) * b]), (n, k, b, row, c)
    with pytest.raises(ValueError, match="multiple of 128"):
        tile_for_gemv(random_weight(4, 48, key="tile48"))
    assert random_weight(4, 128, key="cpu").prepare_gemv().gemv_operands()[0].dim() == 2   # CPU: no-op


def _u32(b: torch.Tensor) -> torch.Tensor:
    b = b.reshape(-1, 4).to(torch.int64)
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def test_gemv_word_bits_dequant_cpu():
    """The kernel's two dequantizations, emulated on int64 words: dequant_word on checkpoint
    words gives register i = the bf16x2 bits of (code i, code i + 4) · 2^-126, and
    dequant_word_tiled on gemv_word_bits words (register i = the sum of its masked, shifted
    pieces) the k-adjacent pair (code 2i, code 2i + 1) — for every code value at every position
    (each byte of the word swept through 0..255 with random others) and random words."""
    from atlas.nvfp4 import GEMV_WORD_PIECES, gemv_word_bits
    g = torch.Generator().manual_seed(7)
    words = torch.randint(0, 256, (4096, 4), generator=g, dtype=torch.int64)
    sweep = torch.randint(0, 256, (4, 256, 4), generator=g, dtype=torch.int64)
    for j in range(4):
        sweep[j, :, j] = torch.arange(256)
    packed = torch.cat([words, sweep.reshape(-1, 4)]).to(torch.uint8)
    q, t = _u32(packed), _u32(gemv_word_bits(packed))
    m32 = 0xFFFFFFFF
    assert GEMV_WORD_PIECES == (((0x81C081C0, 0),), ((0x02070207, 6),),
                                ((0x04000400, 5), (0x00380038, 3)),
                                ((0x40004000, 1), (0x38003800, -5))), "csrc/w4a16_gemv.cu hard-codes these"
    def pair(lo, hi):   # bf16x2 bits of (code lo, code hi) · 2^-126: sign → 15 / 31, magnitude → 6..8 / 22..24
        a, b = (q >> (4 * lo)) & 0xF, (q >> (4 * hi)) & 0xF
        return ((a & 8) << 12) | ((a & 7) << 6) | ((b & 8) << 28) | ((b & 7) << 22)

    for i, pieces in enumerate(GEMV_WORD_PIECES):
        v = (q << (12 - 4 * i)) & m32
        assert torch.equal((v & 0x80008000) | ((v >> 6) & 0x01C001C0), pair(i, i + 4)), f"dequant_word {i}"
        want = pair(2 * i, 2 * i + 1)
        got = torch.zeros_like(t)
        for mask, shift in pieces:
            piece = t & mask
            got += ((piece << shift) if shift >= 0 else (piece >> -shift)) & m32
        assert torch.equal(got, want), f"register {i}"


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(1, 128), (17, 256), (100, 2048), (2048, 512), (33, 4096), (1024, 5120),
                                 (248077, 256), (8192, 2048), (5120, 6144), (1024, 1152)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 17, 32])
def test_tiled_layout_matches_reference(n, k, m):
    """Every GEMV variant on the tiled layout matches the reference (plain bf16 / f32, an n_rows
    prefix — bitwise the full call's columns — dual with a tiled or a checkpoint partner, silu
    and gated; M = 2..32 plain on the tiled layout is the x-resident kernel wherever x fits:
    one warp over all of K, two segments per warp or one). Since v3.17 the tiled words pair k-adjacent codes, so the tiled and checkpoint
    layouts group a row's products into different k16 steps: equal within f32 rounding, not
    bitwise (each layout is batch invariant on its own: test_batch_invariance)."""
    q, x = _cuda_case(n, k, m, key=("tiled", n, k))
    qt = _tiled(q)
    _check(ops.w4a16_gemv(x, qt), x, q, torch.bfloat16)
    full = ops.w4a16_gemv(x, qt, out_dtype=torch.float32)
    _check(full, x, q, torch.float32)
    rows = max(1, n - 7)
    out = poison_(torch.empty(m, rows, dtype=torch.float32, device="cuda"))
    assert torch.equal(ops.w4a16_gemv(x, qt, out_dtype=torch.float32, n_rows=rows, out=out), full[:, :rows])
    q2 = random_weight(max(1, n // 3), k, key=("tiled2", n, k), device="cuda")
    for a, b in ((qt, _tiled(q2)), (qt, q2), (q, _tiled(q2))):   # mixed layouts: two launches
        got = ops.w4a16_gemv_dual(x, a, b)
        assert torch.equal(got[0], ops.w4a16_gemv(x, a)) and torch.equal(got[1], ops.w4a16_gemv(x, b))
    _check(got[1], x, q2, torch.bfloat16)
    g = random_x(m, k, key=("tiled_g", n), device="cuda")
    assert rel_err(ops.w4a16_gemv_silu(g, x, qt), _ref(reference.silu_mul(g, x), q)) <= TOL[torch.bfloat16]
    assert rel_err(ops.w4a16_gemv_gated(x, g, qt), _ref(reference.sigmoid_gate_mul(x, g), q)) <= \
        TOL[torch.bfloat16] + 2.0 ** -8   # + sigmoid_gate_mul's ≤ 1-ulp expf


@pytest.mark.cuda
def test_dual_mixed_layouts_refused_by_binding():
    """The fused dual launch reads one layout; the binding names the mismatch (ops.w4a16_gemv_dual
    runs mixed pairs as two launches instead)."""
    q1, x = _cuda_case(64, 256, 2, key="mixed")
    q2 = _tiled(random_weight(32, 256, key="mixed2", device="cuda"))
    with pytest.raises(RuntimeError, match="share a layout"):
        torch.ops.atlas.w4a16_gemv_dual(x, *q1.gemv_operands(), q1.global_scale,
                                        *q2.gemv_operands(), q2.global_scale, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 4])
def test_tiled_layout_qg_bitwise(m):
    """q+gate de-interleave on the store, single and dual, from the tiled layout: bitwise the
    de-interleaved plain GEMV of the same tiled weight."""
    nq, hd, k = 4, 64, 1024
    q, x = _cuda_case(2 * nq * hd, k, m, key="tiled_qg")
    kv = random_weight(2 * hd, k, key="tiled_kv", device="cuda")
    qt, kvt = _tiled(q), _tiled(kv)
    want = reference.qg_deinterleave(ops.w4a16_gemv(x, qt), nq, hd)
    assert torch.equal(ops.w4a16_gemv_qg(x, qt, nq, hd), want)
    got = ops.w4a16_gemv_dual(x, qt, kvt, qg_head_dim=hd)
    assert torch.equal(got[0], want) and torch.equal(got[1], ops.w4a16_gemv(x, kvt))


_BAD_LAYOUT_SCRIPT = """
import torch, atlas
from atlas.nvfp4 import NVFP4Weight
g = torch.Generator(device="cuda").manual_seed(0)
q = NVFP4Weight(torch.randint(0, 256, (64, 128), device="cuda", dtype=torch.uint8, generator=g),
                torch.full((64, 16), 0.5, device="cuda").to(torch.float8_e4m3fn),
                torch.tensor(1.0, device="cuda")).prepare_gemv()
x = torch.randn(1, 256, device="cuda", generator=g).bfloat16()
p, s = q.gemv_operands()
bad = (((p.contiguous(), s), "chunk-major"), ((p, s.contiguous()), "chunk-major"),
       ((q.packed[:, :64].contiguous(), q.block_scale), "with K = 256"))
for (pp, ss), want in bad:
    try:
        torch.ops.atlas.w4a16_gemv(x, pp, ss, q.global_scale, torch.bfloat16, 64, 0)
        print("accepted")
    except RuntimeError as e:
        print("refused:", want in str(e))
"""


@pytest.mark.cuda
def test_tiled_layout_must_be_chunk_major():
    """A 3-D operand that is not the chunk-major view tile_for_gemv makes (e.g. a contiguous
    [N, K/128, 64] copy), or a checkpoint packed of the wrong K, is refused by the binding with an
    error that names the problem (and the number, formatted by num()). Run in a subprocess: these
    messages used to stream an integer through c10::str, which segfaulted the process on the H200
    — a crash must fail this test, not end the suite."""
    r = subprocess.run([sys.executable, "-c", _BAD_LAYOUT_SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.split("\n")[:3] == ["refused: True"] * 3, r.stdout
