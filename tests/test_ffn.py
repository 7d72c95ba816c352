"""atlas.layers.ffn (dense SwiGLU MLP, sparse MoE) against HF transformers' Qwen3.5 modules.

The HF module gets the same weights (dequantized for fp8/nvfp4, i.e. exactly what our layer
multiplies by) and runs in BF16 like ours; the remaining differences are BF16 rounding order
(HF rounds the routing weights and the expert sum to BF16, we accumulate in float32), hence a
relative bound of 2e-2 rather than bit-exactness.
"""
import zlib
from types import SimpleNamespace

import pytest
import torch
from helpers import rel_err

pytest.importorskip("transformers")
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock  # noqa: E402

import atlas  # noqa: E402
from atlas import reference  # noqa: E402
from atlas.fp8 import quantize_fp8_block  # noqa: E402
from atlas.layers.ffn import DenseMLP, SparseMoE, build_ffn  # noqa: E402


FORMATS = ["bf16", "fp8", "nvfp4"]
BF16_TOL = 2e-2  # BF16 intermediates rounded in a different order than HF (see module doc)


def _gen(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (crc32: stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _store(sd, prefix, w: torch.Tensor, dialect: str):
    """Write module weight w [N, K] under prefix in a checkpoint dialect."""
    if dialect == "bf16":
        sd[prefix + "weight"] = w
    elif dialect == "modelopt":
        q = atlas.quantize_nvfp4(w)
        sd[prefix + "weight"], sd[prefix + "weight_scale"] = q.packed, q.block_scale
        sd[prefix + "weight_scale_2"] = q.global_scale
    elif dialect == "compressed_tensors":
        q = atlas.quantize_nvfp4(w)
        sd[prefix + "weight_packed"], sd[prefix + "weight_scale"] = q.packed, q.block_scale
        sd[prefix + "weight_global_scale"] = (1.0 / q.global_scale.double()).float()
    elif dialect == "fp8":
        q = quantize_fp8_block(w)
        sd[prefix + "weight"], sd[prefix + "weight_scale_inv"] = q.weight, q.weight_scale_inv
    else:
        raise AssertionError(dialect)


# ---- dense MLP ------------------------------------------------------------------------------

@pytest.mark.parametrize("inter,t,fused", [(96, 1, True), (96, 5, True), (4352, 1, True), (4352, 2, False)])
def test_dense_mlp_silu_fusion_rule(monkeypatch, inter, t, fused):
    """NVFP4 GEMV steps fuse silu·up into down (w4a16_gemv_silu) at T = 1 or down K ≤ 4096, and
    otherwise run silu_mul + the plain GEMV (measured faster there); the output is the same."""
    from atlas import ops
    g = _gen("silu_rule", inter, t)
    h = 64
    sd = {}
    for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        _store(sd, f"mlp.{name}.", _rand(g, *shape, scale=0.1), "bf16")
    mlp = DenseMLP.from_state_dict(sd, "mlp.", "nvfp4", "cpu")
    x = _rand(g, t, h, scale=3.0)
    want = mlp.down_proj(atlas.layers.ffn.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    calls = {"silu": 0}
    real = ops.w4a16_gemv_silu

    def counted(gate, up, q):
        calls["silu"] += 1
        return real(gate, up, q)

    monkeypatch.setattr(ops, "w4a16_gemv_silu", counted)
    assert torch.equal(mlp(x), want)
    assert calls["silu"] == int(fused) and mlp._fuse_silu(t) == fused



@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("dialect", ["bf16", "modelopt", "compressed_tensors", "fp8"])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_dense_mlp_matches_hf(weight_format, dialect, t):
    g = _gen("dense", weight_format, dialect, t)
    h, inter = 64, 96
    sd = {}
    for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        _store(sd, f"mlp.{name}.", _rand(g, *shape, scale=0.1), dialect)
    mlp = DenseMLP.from_state_dict(sd, "mlp.", weight_format, "cpu")
    hf = Qwen3_5MLP(Qwen3_5TextConfig(hidden_size=h, intermediate_size=inter), inter).to(torch.bfloat16)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf, name).weight.copy_(getattr(mlp, name).dense())
        x = _rand(g, t, h, scale=3.0)
        ref = hf(x)
    out = mlp(x)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    assert rel_err(out, ref) < BF16_TOL


# ---- sparse MoE -----------------------------------------------------------------------------

def _moe_cfg(h=64, e=8, k=2, inter=32, shared=48):
    return SimpleNamespace(hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=inter,
                           shared_expert_intermediate_size=shared, norm_topk_prob=True, is_moe=True)


def _moe_state_dict(g, cfg, dialect: str, fused: bool):
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    sd = {"mlp.gate.weight": _rand(g, e, h, scale=0.5),
          "mlp.shared_expert_gate.weight": _rand(g, 1, h, scale=0.2)}
    gate_up, down = _rand(g, e, 2 * i, h, scale=0.1), _rand(g, e, h, i, scale=0.1)
    if fused:
        sd["mlp.experts.gate_up_proj"], sd["mlp.experts.down_proj"] = gate_up, down
    else:
        for x in range(e):
            _store(sd, f"mlp.experts.{x}.gate_proj.", gate_up[x, :i].contiguous(), dialect)
            _store(sd, f"mlp.experts.{x}.up_proj.", gate_up[x, i:].contiguous(), dialect)
            _store(sd, f"mlp.experts.{x}.down_proj.", down[x].contiguous(), dialect)
    for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
        _store(sd, f"mlp.shared_expert.{name}.", _rand(g, *shape, scale=0.1), dialect)
    return sd


def _hf_moe(cfg, moe: SparseMoE):
    """HF's block holding exactly the weights our block multiplies by."""
    hf_cfg = Qwen3_5MoeTextConfig(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                                  num_experts_per_tok=cfg.num_experts_per_tok,
                                  moe_intermediate_size=cfg.moe_intermediate_size,
                                  shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    hf = Qwen3_5MoeSparseMoeBlock(hf_cfg).to(torch.bfloat16)
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router)
        hf.shared_expert_gate.weight.copy_(moe.shared_gate)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_expert, name).weight.copy_(getattr(moe.shared, name).dense())
        e = moe.num_experts   # the stacks may hold the shared expert as one more entry
        hf.experts.gate_up_proj.copy_(torch.cat([moe.experts.gate.dense()[:e], moe.experts.up.dense()[:e]], dim=1))
        hf.experts.down_proj.copy_(moe.experts.down.dense()[:e])
    return hf


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("dialect,fused", [("bf16", True), ("bf16", False), ("modelopt", False),
                                           ("compressed_tensors", False), ("fp8", False)])
@pytest.mark.parametrize("t,path", [(1, None), (1, "dense"), (6, "gather"), (6, None), (33, None)])
def test_sparse_moe_matches_hf(weight_format, dialect, fused, t, path):
    g = _gen("moe", weight_format, dialect, fused, t, path)
    cfg = _moe_cfg()
    sd = _moe_state_dict(g, cfg, dialect, fused)
    moe = build_ffn(cfg, sd, "mlp.", weight_format, "cpu")
    assert isinstance(moe, SparseMoE)
    hf = _hf_moe(cfg, moe)
    x = _rand(g, t, cfg.hidden_size, scale=2.0)
    with torch.no_grad():
        ref = hf(x.unsqueeze(0)).squeeze(0)
    out = moe(x, path=path)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
@pytest.mark.parametrize("t", [1, 6, 33])
@pytest.mark.parametrize("shared_width", [32, 48])   # 32 = the experts' width: shared expert as slot k
def test_sparse_moe_kernel_path_matches_hf(weight_format, t, shared_width):
    """path "kernel" = moe_route + ops.moe_experts (the CUDA default; here their references)."""
    g = _gen("moe-kernel-path", weight_format, t, shared_width)
    cfg = _moe_cfg(shared=shared_width)
    moe = build_ffn(cfg, _moe_state_dict(g, cfg, "bf16", True), "mlp.", weight_format, "cpu")
    assert moe.experts.has_shared_slot == (shared_width == 32)
    x = _rand(g, t, cfg.hidden_size, scale=2.0)
    with torch.no_grad():
        ref = _hf_moe(cfg, moe)(x.unsqueeze(0)).squeeze(0)
    assert rel_err(moe(x, path="kernel"), ref) < BF16_TOL


@pytest.mark.parametrize("t", [1, 4, 17])
def test_moe_gather_and_dense_paths_agree(t):
    g = _gen("paths", t)
    cfg = _moe_cfg(e=16, k=4)
    moe = build_ffn(cfg, _moe_state_dict(g, cfg, "bf16", True), "mlp.", "bf16", "cpu")
    x = _rand(g, t, cfg.hidden_size)
    assert rel_err(moe(x, path="gather"), moe(x, path="dense")) < 1e-2
    assert rel_err(moe(x, path="kernel"), moe(x, path="dense")) < 1e-2


@pytest.mark.parametrize("path", ["gather", "dense", "kernel"])
@pytest.mark.parametrize("inter", [128, 96])   # 128: tiled stacks; 96: GEMV words (K % 128 != 0)
def test_moe_expert_stacks_in_kernel_layout_cpu(path, inter):
    """_Stack.kernel_layout (what the banks derive on CUDA): every path reads the stacks as the
    same weights — bitwise the checkpoint order's result."""
    g = _gen("kernel-layout", path, inter)
    cfg = _moe_cfg(h=256, e=8, k=2, inter=inter)
    moe = build_ffn(cfg, _moe_state_dict(g, cfg, "bf16", True), "mlp.", "nvfp4", "cpu")
    x = _rand(g, 5, cfg.hidden_size)
    want = moe(x, path=path)
    for stack in (moe.experts.gate, moe.experts.up, moe.experts.down):
        stack.t = stack.kernel_layout(*stack.t[:2]) + stack.t[2:]
    assert moe.experts.gate.t[0].shape[-1] == (64 if inter % 128 == 0 else 4)
    assert torch.equal(moe(x, path=path), want)


def test_moe_routing_is_top_k_of_softmax():
    g = _gen("route")
    cfg = _moe_cfg(e=16, k=4)
    moe = build_ffn(cfg, _moe_state_dict(g, cfg, "bf16", True), "mlp.", "bf16", "cpu")
    x = _rand(g, 9, cfg.hidden_size)
    _, ids, w = moe.route(x)
    probs = torch.softmax(torch.nn.functional.linear(x, moe.router).float(), dim=-1)
    top = probs.topk(4, dim=-1)
    assert torch.equal(ids.long().sort(-1).values, top.indices.sort(-1).values)
    torch.testing.assert_close(w.sum(-1), torch.ones(9))


def test_dense_cfg_builds_dense_mlp():
    g = _gen("dense-cfg")
    sd = {f"mlp.{n}.weight": _rand(g, *s) for n, s in (("gate_proj", (32, 16)), ("up_proj", (32, 16)),
                                                         ("down_proj", (16, 32)))}
    assert isinstance(build_ffn(SimpleNamespace(is_moe=False), sd, "mlp.", "bf16", "cpu"), DenseMLP)


def test_missing_expert_key_is_named():
    g = _gen("missing")
    cfg = _moe_cfg()
    sd = _moe_state_dict(g, cfg, "bf16", False)
    del sd["mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match=r"mlp\.experts\.3\.up_proj\.weight"):
        build_ffn(cfg, sd, "mlp.", "bf16", "cpu")


def test_bad_weight_format_is_named():
    g = _gen("fmt")
    sd = {"mlp.gate_proj.weight": _rand(g, 32, 16), "mlp.up_proj.weight": _rand(g, 32, 16),
          "mlp.down_proj.weight": _rand(g, 16, 32)}
    with pytest.raises(ValueError, match="weight_format"):
        DenseMLP.from_state_dict(sd, "mlp.", "int4", "cpu")


# ---- CUDA -----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("t", [1, 8, 32])
@pytest.mark.parametrize("inter", [64, 128])   # NVFP4 on CUDA: GEMV-word | tiled stacks
def test_sparse_moe_cuda_matches_cpu(weight_format, t, inter):
    g = _gen("moe-cuda", weight_format, t, inter)
    cfg = _moe_cfg(h=256, e=64, k=8, inter=inter, shared=inter)
    sd = _moe_state_dict(g, cfg, "bf16", True)
    x = _rand(g, t, cfg.hidden_size)
    cpu = build_ffn(cfg, sd, "mlp.", weight_format, "cpu")
    dev = build_ffn(cfg, {k: v.cuda() for k, v in sd.items()}, "mlp.", weight_format, "cuda")
    assert rel_err(dev(x.cuda()).cpu(), cpu(x)) < BF16_TOL


@pytest.mark.cuda
def test_sparse_moe_cuda_graph_replay():
    g = _gen("moe-graph")
    cfg = _moe_cfg(h=256, e=64, k=8, inter=64, shared=64)
    sd = {k: v.cuda() for k, v in _moe_state_dict(g, cfg, "bf16", True).items()}
    moe = build_ffn(cfg, sd, "mlp.", "nvfp4", "cuda")
    x = _rand(g, 4, cfg.hidden_size).cuda()
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
    x2 = _rand(g, 4, cfg.hidden_size).cuda()
    static_x.copy_(x2)
    graph.replay()
    assert torch.equal(static_out, moe(x2))
