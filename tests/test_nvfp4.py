"""quantize_nvfp4 / dequantize_nvfp4 / NVFP4Weight: reference against independent oracles (CPU),
the kernel bit-exact against the reference (CUDA)."""
import pytest
import torch

import atlas
from atlas import reference as ref
from atlas.nvfp4 import NVFP4Weight

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- E2M1 rounding at every tie point (independent oracle: the RNE rule written out) --------

TIES = [  # (|x|, expected magnitude index): ties go to the even code (0, 1.0, 2.0, 4.0)
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
]


@pytest.mark.parametrize("x,idx", TIES)
def test_e2m1_tie_points(x, idx):
    for sign in (1.0, -1.0):
        code = int(ref.e2m1_encode(torch.tensor([sign * x]))[0])
        assert code & 7 == idx and (code >> 3) == (sign < 0)


def test_e2m1_nearest_away_from_ties():
    g = _gen(0)
    v = (torch.rand(10000, generator=g) * 14 - 7)
    codes = ref.e2m1_encode(v)
    got = ref.e2m1_lut()[codes.long()]
    # independent oracle: nearest representable value (no ties occur with random floats)
    cand = torch.cat([E2M1, -E2M1])
    want = cand[(v[:, None] - cand[None]).abs().argmin(1)]
    assert torch.equal(got.abs(), want.abs().clamp(max=6.0))


def _tie_weight():
    """Rows whose quantization divisor is exactly 1.0: global amax 2688 → gs = 1.0; a block with
    amax 6 gets s = 1.0. Every tie point, both signs, and the exact codes appear."""
    w = torch.zeros(3, 32)
    w[0, 0] = 2688.0                                       # sets gs = 1.0 (block scale 448)
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    w[1, :8] = torch.tensor(vals)
    w[1, 8:16] = -torch.tensor(vals)
    w[2, :16] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2)
    return w


def test_quantize_tie_points_end_to_end():
    packed, scale, gs = ref.quantize_nvfp4(_tie_weight())
    assert float(gs) == 1.0
    assert float(scale[1, 0].float()) == 1.0
    lo, hi = packed[1, :4] & 0xF, packed[1, :4] >> 4
    codes = torch.stack([lo, hi], 1).reshape(-1)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7]
    assert float(scale[0, 1].float()) == 0.0               # all-zero block: scale 0, codes 0
    assert int(packed[0, 8:].max()) == 0


@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (64, 256), (33, 1040)])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e3, 1e30])
def test_roundtrip_error_bound(shape, magnitude):
    """|x − dequant| ≤ one block-scale step everywhere (largest E2M1 gap is 2 → half-gap 1;
    saturation after a rounded-down scale costs < 6/16 of a step), and gaussian data has the
    usual ~10% NVFP4 relative error."""
    g = _gen(hash((shape, magnitude)) % 2**31)
    w = torch.randn(*shape, generator=g) * magnitude
    packed, scale, gs = ref.quantize_nvfp4(w)
    deq = ref.dequantize_nvfp4(packed, scale, gs)
    step = (scale.float() * gs).repeat_interleave(16, dim=1)
    assert torch.all((deq - w).abs() <= step * 1.0 + 1e-45)
    if w.numel() >= 1024:
        assert ((deq - w).double().norm() / w.double().norm()).item() < 0.12


def test_zero_weight_and_global_scale_one():
    packed, scale, gs = ref.quantize_nvfp4(torch.zeros(4, 32))
    assert float(gs) == 1.0 and int(packed.max()) == 0 and float(scale.float().max()) == 0.0


def test_subnormal_and_underflowing_block_scales():
    w = torch.zeros(1, 64)
    w[0, 0] = 2688.0                       # gs = 1.0
    w[0, 16] = 6.0 * 2.0**-8               # block scale 2^-8: an E4M3 subnormal (exact)
    w[0, 32] = 6.0 * 2.0**-11              # block scale 2^-11 underflows E4M3 → 0, codes 0
    w[0, 48:64] = 6.0 * 3 * 2.0**-9        # block scale 3·2^-9: subnormal, exact
    packed, scale, gs = ref.quantize_nvfp4(w)
    s = scale.float()[0]
    assert s[1].item() == 2.0**-8 and s[2].item() == 0.0 and s[3].item() == 3 * 2.0**-9
    deq = ref.dequantize_nvfp4(packed, scale, gs)
    assert deq[0, 16].item() == w[0, 16].item() and deq[0, 32].item() == 0.0
    assert torch.equal(deq[0, 48:64], w[0, 48:64])


def test_atlas_quantize_rejects_nonfinite():
    for bad in (float("nan"), float("inf")):
        w = torch.randn(4, 32)
        w[1, 3] = bad
        with pytest.raises(ValueError, match="w must be finite"):
            atlas.quantize_nvfp4(w)


@pytest.mark.parametrize("bad,exc,match", [
    (torch.randn(4, 30), ValueError, "K % 16"),
    (torch.randn(4, 4, 16), ValueError, "w must"),
    (torch.randint(0, 5, (4, 32)), TypeError, "w must be"),
])
def test_quantize_validation(bad, exc, match):
    with pytest.raises(exc, match=match):
        atlas.ops.quantize_nvfp4(bad)


def test_dialects_agree():
    w = torch.randn(32, 64, generator=_gen(3))
    q = atlas.quantize_nvfp4(w)
    a = NVFP4Weight.from_modelopt(q.packed, q.block_scale, q.global_scale.clone())
    b = NVFP4Weight.from_compressed_tensors(q.packed, q.block_scale, (1.0 / q.global_scale.double()).float())
    assert torch.allclose(a.dequantize(), b.dequantize(), rtol=1e-6, atol=0)
    assert torch.equal(a.dequantize(), q.dequantize())


@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf")])
def test_dialect_bad_global_scale(scale):
    q = atlas.quantize_nvfp4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="weight_scale_2"):
        NVFP4Weight.from_modelopt(q.packed, q.block_scale, torch.tensor(scale))
    with pytest.raises(ValueError, match="weight_global_scale"):
        NVFP4Weight.from_compressed_tensors(q.packed, q.block_scale, torch.tensor(scale))


def test_container_validation():
    q = atlas.quantize_nvfp4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="block_scale"):
        NVFP4Weight(q.packed, q.block_scale[:, :1], q.global_scale)
    with pytest.raises(TypeError, match="packed"):
        NVFP4Weight(q.packed.float(), q.block_scale, q.global_scale)
    assert q.rows(2, 5).shape == (3, 32)


# ---- CUDA: the kernel is bit-exact with the reference -----------------------------------------

def _assert_bit_exact(w_cpu):
    p_ref, s_ref, g_ref = ref.quantize_nvfp4(w_cpu)
    p, s, g = atlas.ops.quantize_nvfp4(w_cpu.cuda())
    assert torch.equal(g.cpu(), g_ref), (g.item(), g_ref.item())
    assert torch.equal(s.cpu().view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(p.cpu(), p_ref)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (17, 4096), (512, 2048), (4099, 5120)])
def test_kernel_bit_exact_random(dtype, shape):
    g = _gen(hash((str(dtype), shape)) % 2**31)
    w = (torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 4).to(dtype)
    _assert_bit_exact(w)


@pytest.mark.cuda
def test_kernel_bit_exact_adversarial():
    _assert_bit_exact(_tie_weight())
    _assert_bit_exact(torch.zeros(8, 64))                         # global scale 1.0
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 16], w[0, 32], w[0, 48:] = 2688.0, 6 * 2.0**-8, 6 * 2.0**-11, 18 * 2.0**-9
    _assert_bit_exact(w)                                          # subnormal / underflowing scales
    g = _gen(11)
    for mag in (1e-30, 1e-20, 1e20, 1e30):                        # tiny and huge magnitudes
        _assert_bit_exact(torch.randn(64, 256, generator=g) * mag)
    # every tie point scaled by each block scale of a dense sweep of E4M3 values
    scales = torch.linspace(0.01, 3.0, 64)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    w = (scales[:, None] * ties[None]).repeat(1, 4)
    w[0, 0] = 2688.0
    _assert_bit_exact(w)
    # heavy-tailed data with mixed block magnitudes, bf16
    x = torch.randn(300, 640, generator=g) ** 3 * torch.exp(torch.randn(300, 40, generator=g) * 3).repeat_interleave(16, 1)
    _assert_bit_exact(x.bfloat16())


@pytest.mark.cuda
def test_kernel_misaligned_view_and_strides():
    base = torch.randn(65, 64, device="cuda").bfloat16()
    view = base.view(-1)[8:8 + 64 * 32].view(64, 32)              # 16-byte misaligned start
    p, s, gs = atlas.ops.quantize_nvfp4(view)
    p_ref, s_ref, g_ref = ref.quantize_nvfp4(view.cpu())
    assert torch.equal(p.cpu(), p_ref) and torch.equal(s.cpu().view(torch.uint8), s_ref.view(torch.uint8))
    q = atlas.quantize_nvfp4(base[:, :32])                        # non-contiguous
    assert torch.equal(q.packed.cpu(), ref.quantize_nvfp4(base[:, :32].cpu())[0])
