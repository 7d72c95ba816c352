"""FP8BlockWeight (Qwen FP8 block-scaled weights): quantize / dequantize against an independent
block-loop oracle, round-trip precision across magnitudes, validation (CPU); device parity (CUDA)."""
import zlib

import pytest
import torch

from atlas.fp8 import FP8_BLOCK, FP8BlockWeight, dequantize_fp8_block, quantize_fp8_block

SHAPES = [(128, 128), (200, 300), (1, 17), (384, 130)]   # whole blocks, ragged edges, tiny


def _gen(*key):
    """A generator seeded from the case's parameters (crc32: stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _oracle_dequant(q: FP8BlockWeight) -> torch.Tensor:
    """Block by block, the format's definition written out."""
    n, k = q.shape
    out = torch.empty(n, k)
    for bi in range(0, n, FP8_BLOCK):
        for bj in range(0, k, FP8_BLOCK):
            out[bi:bi + FP8_BLOCK, bj:bj + FP8_BLOCK] = (q.weight[bi:bi + FP8_BLOCK, bj:bj + FP8_BLOCK].float()
                                                        * q.weight_scale_inv[bi // FP8_BLOCK, bj // FP8_BLOCK])
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e4])
def test_round_trip_and_oracle(shape, magnitude):
    w = torch.randn(*shape, generator=_gen(shape, magnitude)) * magnitude
    q = quantize_fp8_block(w)
    assert q.weight_scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = dequantize_fp8_block(q)
    assert torch.equal(deq, _oracle_dequant(q))
    # E4M3 keeps 3 mantissa bits: relative error ≤ 2^-4 for values in the normal range of the
    # block (|x| ≥ 2^-6 · scale); smaller ones are subnormal, bounded by half a subnormal step.
    scale = q.weight_scale_inv.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool(((deq - w).abs() <= bound * 1.0001).all())


def test_block_amax_maps_to_448():
    w = torch.zeros(130, 129)
    w[0, 0], w[129, 128] = -3.5, 1e-3
    q = quantize_fp8_block(w)
    assert float(q.weight[0, 0].float()) == -448.0 and float(q.weight[129, 128].float()) == 448.0
    assert float(q.weight_scale_inv[0, 1]) == 1.0            # an all-zero block keeps scale 1


def test_dequantize_dtype_and_container():
    w = torch.randn(64, 256, generator=_gen("dtype"))
    q = quantize_fp8_block(w)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.bfloat16), dequantize_fp8_block(q).to(torch.bfloat16))
    assert q.shape == (64, 256) and q.nbytes == 64 * 256 + 4 * 2
    assert q.derived("x", lambda t: 7) == 7 and q.derived("x", lambda t: 8) == 7


def test_validation_names_the_argument():
    good_w = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="weight"):
        FP8BlockWeight(torch.zeros(4, 8), torch.ones(1, 1))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        FP8BlockWeight(good_w, torch.ones(2, 1))
    with pytest.raises(TypeError, match="weight_scale_inv"):
        FP8BlockWeight(good_w, torch.ones(1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight_scale_inv must be finite"):
        FP8BlockWeight.from_checkpoint(good_w, torch.full((1, 1), float("nan")))
    with pytest.raises(ValueError, match="w must be finite"):
        quantize_fp8_block(torch.tensor([[float("inf")]]))
    with pytest.raises(TypeError, match="q must be an FP8BlockWeight"):
        dequantize_fp8_block(torch.zeros(2, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_matches_cpu(shape):
    w = torch.randn(*shape, generator=_gen("cuda", shape)) * 3
    q = quantize_fp8_block(w)
    qd = quantize_fp8_block(w.cuda())
    assert torch.equal(qd.weight.cpu().view(torch.uint8), q.weight.view(torch.uint8))
    assert torch.equal(qd.weight_scale_inv.cpu(), q.weight_scale_inv)
    assert torch.equal(dequantize_fp8_block(qd, torch.bfloat16).cpu(), dequantize_fp8_block(q, torch.bfloat16))
