"""Linear: dialect detection, load-time conversion rules, and forward in bf16 / fp8 / nvfp4
against float32 matmuls of the dequantized weight (CPU); the GPU paths (CUDA)."""
import zlib

import pytest
import torch

import atlas
from atlas.fp8 import FP8BlockWeight, quantize_fp8_block
from atlas.linear import GEMV_CHUNKED_MAX_ROWS, GEMV_MAX_ROWS, Linear, detect_dialect, load_linears, load_weight
from atlas.nvfp4 import NVFP4Weight
from helpers import rel_err

DIALECTS = ["bf16", "modelopt_nvfp4", "ct_nvfp4", "fp8"]
FORMATS = ["bf16", "fp8", "nvfp4"]


def _gen(*key):
    """A generator seeded from the case's parameters (crc32: stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def module_state_dict(w: torch.Tensor, dialect: str, prefix: str = "m.") -> dict:
    """One module's checkpoint tensors in a dialect (what HF / ModelOpt / llm-compressor /
    Qwen FP8 exports store), made from a float weight."""
    if dialect == "bf16":
        return {f"{prefix}weight": w.to(torch.bfloat16)}
    if dialect == "fp8":
        q = quantize_fp8_block(w)
        return {f"{prefix}weight": q.weight, f"{prefix}weight_scale_inv": q.weight_scale_inv}
    q = atlas.quantize_nvfp4(w)
    if dialect == "modelopt_nvfp4":
        return {f"{prefix}weight": q.packed, f"{prefix}weight_scale": q.block_scale,
                f"{prefix}weight_scale_2": q.global_scale}
    return {f"{prefix}weight_packed": q.packed, f"{prefix}weight_scale": q.block_scale,
            f"{prefix}weight_global_scale": 1.0 / q.global_scale}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_detect_and_load(dialect):
    w = torch.randn(48, 64, generator=_gen(dialect))
    sd = module_state_dict(w, dialect)
    assert detect_dialect(sd, "m.") == dialect
    got = load_weight(sd, "m.")
    kind = {"bf16": torch.Tensor, "fp8": FP8BlockWeight}.get(dialect, NVFP4Weight)
    assert isinstance(got, kind)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("weight_format", FORMATS)
def test_conversion_rules(dialect, weight_format):
    w = torch.randn(40, 128, generator=_gen(dialect, weight_format))
    sd = module_state_dict(w, dialect)
    lin = Linear.from_state_dict(sd, "m.", weight_format, "cpu", shape=(40, 128))
    assert lin.weight_format == weight_format and (lin.out_features, lin.in_features) == (40, 128)
    src = load_weight(sd, "m.")
    src_bf16 = (src if isinstance(src, torch.Tensor) else src.dequantize(torch.bfloat16)).to(torch.bfloat16)
    if weight_format == "nvfp4":
        if isinstance(src, NVFP4Weight):   # already NVFP4: used as it is, never re-quantized
            assert lin.weight.packed.data_ptr() == src.packed.data_ptr()
            assert torch.equal(lin.weight.global_scale, src.global_scale)
        else:                              # BF16, or FP8 via its BF16 dequantization
            want = atlas.quantize_nvfp4(src_bf16)
            assert torch.equal(lin.weight.packed, want.packed)
            assert torch.equal(lin.weight.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
    elif weight_format == "fp8":
        if isinstance(src, FP8BlockWeight):
            assert lin.weight.weight.data_ptr() == src.weight.data_ptr()
        else:
            assert torch.equal(lin.weight.weight.view(torch.uint8), quantize_fp8_block(src_bf16).weight.view(torch.uint8))
    else:
        assert torch.equal(lin.weight, src_bf16)


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("t", [0, 1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 100, GEMV_CHUNKED_MAX_ROWS + 1])
def test_forward_matches_dense(weight_format, t):
    g = _gen(weight_format, t)
    lin = Linear.from_weight(torch.randn(72, 96, generator=g), weight_format, "cpu")
    x = torch.randn(t, 96, generator=g).to(torch.bfloat16)
    want = x.float() @ lin.dense(torch.float32).t()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (t, 72)
    # bf16 output: one rounding (2^-9); the GEMM paths also round the weight to bf16 first
    assert rel_err(y, want) < 1e-2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_nvfp4_verify_rows_run_as_gemv_chunks(device):
    """32 < T ≤ 512 rows: the GEMV over 32-row chunks; every row equals its own 1-row GEMV
    bitwise (the GEMV's rows do not depend on M), so a verify step agrees with decode steps."""
    g = _gen("chunks32", device)
    lin = Linear.from_weight(torch.randn(200, 256, generator=g), "nvfp4", device)
    x = torch.randn(77, 256, generator=g).to(torch.bfloat16).to(device)
    y = lin(x)
    # the chunking itself: 32-row launches written in place
    assert torch.equal(y, torch.cat([atlas.ops.w4a16_gemv(x[r:r + 32], lin.weight) for r in range(0, 77, 32)]))
    if device == "cuda":   # the kernel's rows are M-invariant (the CPU reference's BLAS is not)
        assert torch.equal(y, torch.cat([atlas.ops.w4a16_gemv(x[i:i + 1], lin.weight) for i in range(77)]))


def test_nvfp4_gemm_chunks_rows(monkeypatch):
    import atlas.linear as L
    monkeypatch.setattr(L, "_GEMM_CHUNK_ELEMS", 96 * 5)     # 5 rows per chunk: 15 chunks
    g = _gen("chunks")
    lin = Linear.from_weight(torch.randn(72, 96, generator=g), "nvfp4", "cpu")
    x = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(L.nvfp4_gemm(x, lin.weight), (x @ lin.dense(torch.bfloat16).t()))


def test_load_linears_shares_global_scale():
    g = _gen("share")
    sd = {**module_state_dict(torch.randn(32, 64, generator=g), "bf16", "k."),
          **module_state_dict(10 * torch.randn(16, 64, generator=g), "bf16", "v.")}
    k, v = load_linears(sd, ["k.", "v."], "nvfp4", "cpu", share_global_scale=True)
    assert torch.equal(k.weight.global_scale, v.weight.global_scale)
    joint = atlas.quantize_nvfp4(torch.cat([sd["k.weight"], sd["v.weight"]]))
    assert torch.equal(torch.cat([k.weight.packed, v.weight.packed]), joint.packed)
    k2, v2 = load_linears(sd, ["k.", "v."], "nvfp4", "cpu")
    assert not torch.equal(k2.weight.global_scale, v2.weight.global_scale)
    # NVFP4 inputs are used as they are: their own scales survive
    sd4 = {**module_state_dict(torch.randn(32, 64, generator=g), "modelopt_nvfp4", "k."),
           **module_state_dict(5 * torch.randn(16, 64, generator=g), "ct_nvfp4", "v.")}
    k3, v3 = load_linears(sd4, ["k.", "v."], "nvfp4", "cpu", share_global_scale=True)
    assert torch.equal(k3.weight.packed, sd4["k.weight"]) and torch.equal(v3.weight.packed, sd4["v.weight_packed"])


def test_errors_name_the_module():
    sd = module_state_dict(torch.randn(8, 32), "modelopt_nvfp4")
    del sd["m.weight_scale_2"]
    with pytest.raises(KeyError, match="m.weight_scale_2"):
        load_weight(sd, "m.")
    with pytest.raises(KeyError, match="x.weight"):
        load_weight(sd, "x.")
    with pytest.raises(ValueError, match="m.bias"):
        load_weight({"m.weight": torch.zeros(2, 2), "m.bias": torch.zeros(2)}, "m.")
    with pytest.raises(ValueError, match="weight_format"):
        Linear.from_weight(torch.zeros(2, 16), "int4", "cpu")
    with pytest.raises(ValueError, match="'m.' must have shape"):
        Linear.from_state_dict({"m.weight": torch.zeros(2, 16)}, "m.", "bf16", "cpu", shape=(3, 16))
    lin = Linear.from_weight(torch.zeros(2, 16), "bf16", "cpu")
    with pytest.raises(TypeError, match="x"):
        lin(torch.zeros(1, 16))
    with pytest.raises(ValueError, match="x"):
        lin(torch.zeros(1, 8, dtype=torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("t", [1, 8, 32, 33, 300, 600])
def test_cuda_forward(weight_format, t):
    g = _gen("cuda", weight_format, t)
    lin = Linear.from_weight(torch.randn(1000, 512, generator=g), weight_format, "cuda")
    x = torch.randn(t, 512, generator=g).to(torch.bfloat16).cuda()
    want = x.float() @ lin.dense(torch.float32).t()
    out = lin(x)
    assert out.is_cuda and rel_err(out, want) < 1e-2
