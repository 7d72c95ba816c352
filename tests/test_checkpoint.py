"""Checkpoint writer ↔ loader: every dialect and key layout round-trips to the same dequantized
weights; a checkpoint made by compressed-tensors' own NVFP4 compressor loads to what its
decompressor gives; every malformed case raises CheckpointError naming the key and the file."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import atlas
from atlas import testing as T
from atlas.checkpoint import (Checkpoint, CheckpointError, dequantized_weight, detect_dialect, load_state_dict,
                              open_checkpoint, weight_from_state_dict)
from atlas.config import ModelConfig
from atlas.fp8 import quantize_fp8_block
from atlas.nvfp4 import NVFP4Weight, quantize_nvfp4

from helpers import rel_err

FIXTURES = Path(__file__).parent / "fixtures"
NVFP4_DIALECTS = ("modelopt_nvfp4", "compressed_tensors_nvfp4")

# Quantization error of each dialect on N(0, 0.02) weights with ×8 outlier columns (rel. L2):
# BF16 rounds to 8 bits (≤ 2^-9 per element); FP8 E4M3 keeps 3 mantissa bits (≈ 2-3 %);
# NVFP4 keeps ~1 bit with 16-wide blocks (≈ 10 %). Bounds leave ~1.5× headroom.
DENSE_BOUND = {"bf16": 2**-8, "fp8": 0.05, "modelopt_nvfp4": 0.15, "compressed_tensors_nvfp4": 0.15}


def _write(tmp_path, dialect, *, layout="qwen3_next", name="ckpt", **kw):
    return T.write_checkpoint(tmp_path / name, T.tiny_config(layout=layout), dialect, **kw)


def _expected_dequant(dense: torch.Tensor, dialect: str) -> torch.Tensor:
    """What the loader must give back for a module the writer quantized from `dense`."""
    if dialect == "bf16":
        return dense.to(torch.bfloat16).float()
    if dialect == "fp8":
        return quantize_fp8_block(dense).dequantize(torch.float32)
    return quantize_nvfp4(dense).dequantize(torch.float32)


# =============================================================================================
# Round trips
# =============================================================================================


# every dialect in both key layouts; half of them sharded (the shard split is layout-independent)
ROUND_TRIPS = [(d, lay, 200_000 if (i + j) % 2 else None)
               for i, d in enumerate(T.DIALECTS) for j, lay in enumerate(["qwen3_next", "vl"])]


@pytest.mark.parametrize("dialect, layout, shard_bytes", ROUND_TRIPS)
def test_round_trip_every_module(tmp_path, dialect, layout, shard_bytes):
    seed = 7 + T.DIALECTS.index(dialect)
    d = T.write_checkpoint(tmp_path / "c", T.tiny_config(layout=layout), dialect, seed=seed, layers="all",
                           shard_bytes=shard_bytes)
    if shard_bytes:
        assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 1
    ck = open_checkpoint(d)
    assert ck.dialect == dialect and ck.layout == layout
    sd = ck.load("")
    cfg = ck.model_config
    experts = "fused" if layout == "vl" and dialect == "bf16" else "per_expert"
    mods = T.checkpoint_modules(cfg, layers="all", experts=experts)
    assert len(mods) > 50
    for name, (kind, shape) in mods.items():
        dense = T.dense_weight(name, kind, shape, seed=seed)
        if kind == "fused_experts":
            assert torch.equal(sd[name].float(), dense.to(torch.bfloat16).float()), name
            continue
        quantized = kind == "linear" and dialect != "bf16"
        if quantized and dialect == "fp8":            # the stored bytes are exactly atlas.fp8's
            q = quantize_fp8_block(dense)
            assert torch.equal(sd[name + ".weight"].view(torch.uint8), q.weight.view(torch.uint8)), name
            assert torch.equal(sd[name + ".weight_scale_inv"], q.weight_scale_inv), name
        got = dequantized_weight(sd, name + ".")
        want = _expected_dequant(dense, dialect if quantized else "bf16")
        assert got.shape == tuple(shape), name
        if dialect == "compressed_tensors_nvfp4" and quantized:
            # the file holds 1/global_scale; the loader inverts it back: ≤ 1 ulp of float32 apart
            torch.testing.assert_close(got, want, rtol=2**-22, atol=0, msg=name)
        else:
            assert torch.equal(got, want), name
        assert rel_err(got, dense) < DENSE_BOUND[dialect if quantized else "bf16"], name


def test_sharded_and_single_file_load_the_same(tmp_path):
    a = _write(tmp_path, "modelopt_nvfp4", name="one", layers="all")
    b = _write(tmp_path, "modelopt_nvfp4", name="many", layers="all", shard_bytes=100_000)
    sa, sb = load_state_dict(a, "mtp."), load_state_dict(b, "mtp.")
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k].view(torch.uint8) if sa[k].dtype == torch.float8_e4m3fn else sa[k],
                           sb[k].view(torch.uint8) if sb[k].dtype == torch.float8_e4m3fn else sb[k]) for k in sa)


@pytest.mark.parametrize("dialect", T.DIALECTS)
def test_weight_containers(tmp_path, dialect):
    d = _write(tmp_path, dialect, quantize_lm_head=True)
    sd = load_state_dict(d, "mtp.layers.0.self_attn.")
    q = weight_from_state_dict(sd, "mtp.layers.0.self_attn.q_proj.")
    want = {"bf16": torch.Tensor, "fp8": atlas.FP8BlockWeight}.get(dialect, NVFP4Weight)
    assert isinstance(q, want)
    assert tuple(q.shape) == (4 * 64 * 2, 256)
    assert isinstance(open_checkpoint(d).lm_head(), want)


@pytest.mark.parametrize("layout", ["qwen3_next", "vl"])
def test_prefix_spellings_and_well_known_keys(tmp_path, layout):
    d = _write(tmp_path, "fp8", layout=layout, layers=[1])
    ck = open_checkpoint(d)
    a = ck.load("model.layers.1.self_attn.")
    b = ck.load("model.language_model.layers.1.self_attn.")
    assert sorted(k.replace("language_model.", "") for k in b) == sorted(a)
    assert all(k.startswith("model.language_model.layers.1.self_attn.") for k in b)
    assert ck.embedding_key() == "model.embed_tokens.weight"
    assert ck.final_norm_key() == "model.norm.weight"
    assert ck.lm_head_prefix() == "lm_head."
    assert ck.embedding().shape == (1000, 256) and ck.embedding().dtype == torch.bfloat16
    assert load_state_dict(d, "model.norm.weight")["model.norm.weight"].shape == (256,)


def test_tied_embeddings_use_the_embedding_as_lm_head(tmp_path):
    cfg = T.tiny_config()
    cfg["tie_word_embeddings"] = True
    d = T.write_checkpoint(tmp_path / "tied", cfg, "bf16")
    ck = open_checkpoint(d)
    assert ck.lm_head_prefix() == "model.embed_tokens."
    assert torch.equal(ck.lm_head(), ck.embedding())


def test_mtp_fc_left_bf16_by_an_incomplete_exclude_list(tmp_path):
    d = _write(tmp_path, "modelopt_nvfp4", mtp_fc_bf16=True)
    cfg = json.loads((d / "config.json").read_text())
    assert not any("fc" in p for p in cfg["quantization_config"]["exclude_modules"])
    sd = load_state_dict(d, "mtp.")
    assert sd["mtp.fc.weight"].dtype == torch.bfloat16 and "mtp.fc.weight_scale" not in sd
    fc = weight_from_state_dict(sd, "mtp.fc.")
    assert isinstance(fc, torch.Tensor) and fc.shape == (256, 512)
    assert isinstance(weight_from_state_dict(sd, "mtp.layers.0.self_attn.o_proj."), NVFP4Weight)


def test_keep_bf16_patterns_are_written_and_excluded(tmp_path):
    d = _write(tmp_path, "compressed_tensors_nvfp4", keep_bf16=["mtp.layers.0.*"])
    sd = load_state_dict(d, "mtp.")
    assert sd["mtp.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert sd["mtp.fc.weight_packed"].dtype == torch.uint8
    ignore = json.loads((d / "config.json").read_text())["quantization_config"]["ignore"]
    assert any("mtp" in p for p in ignore)


# =============================================================================================
# Dialect detection and configs
# =============================================================================================


@pytest.mark.parametrize("dialect", T.DIALECTS)
def test_dialect_from_config_and_from_tensor_names(tmp_path, dialect):
    d = _write(tmp_path, dialect)
    ck = open_checkpoint(d)
    assert ck.dialect == dialect
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config", None)
    assert detect_dialect(cfg, ck._meta) == dialect          # no quantization_config: tensor names decide


def test_dialect_legacy_hf_quant_config_and_unsupported_methods():
    assert detect_dialect({}, [], hf_quant_config={"quantization": {"quant_algo": "NVFP4"}}) == "modelopt_nvfp4"
    nested = {"quantization_config": {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}}
    assert detect_dialect(nested, []) == "modelopt_nvfp4"
    mixed = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}}
    assert detect_dialect(mixed, ["a.weight", "a.weight_scale", "a.weight_scale_2"]) == "modelopt_nvfp4"
    with pytest.raises(CheckpointError, match="MIXED_PRECISION"):
        detect_dialect(mixed, ["a.weight", "a.weight_scale"])
    for qc, word in [({"quant_method": "gptq"}, "gptq"), ({"quant_method": "modelopt", "quant_algo": "FP8"}, "FP8"),
                     ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
                     ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size")]:
        with pytest.raises(CheckpointError, match=word):
            detect_dialect({"quantization_config": qc}, [])


@pytest.mark.parametrize("make, fixture", [(T.qwen36_35b_a3b_config, "qwen3_6_35b_a3b"),
                                           (T.qwen3_next_80b_a3b_config, "qwen3_next_80b_a3b"),
                                           (T.qwen36_27b_config, "qwen3_5_27b")])
def test_real_shaped_configs_match_published_ones(make, fixture):
    ours = ModelConfig.from_hf(make())
    theirs = ModelConfig.from_hf(json.loads((FIXTURES / f"{fixture}.json").read_text()))
    for f in ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "vocab_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "intermediate_size", "layer_types", "attn_output_gate",
              "rope_theta", "partial_rotary_factor", "mtp_num_hidden_layers", "tie_word_embeddings"):
        assert getattr(ours, f) == getattr(theirs, f), f


def test_writer_takes_a_model_config(tmp_path):
    cfg = ModelConfig.tiny()
    d = T.write_checkpoint(tmp_path / "mc", cfg, "fp8", layers="all")
    ck = open_checkpoint(d)
    assert ck.model_config == cfg
    assert ck.load("mtp.")["mtp.fc.weight"].shape == (64, 128)


def test_writer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dialect"):
        _write(tmp_path, "int4")
    with pytest.raises(ValueError, match="fused experts"):
        _write(tmp_path, "fp8", experts="fused")
    with pytest.raises(ValueError, match="not full-attention"):
        _write(tmp_path, "bf16", layers=[0])
    with pytest.raises(ValueError, match="layout"):
        _write(tmp_path, "bf16", layout="llama")


# =============================================================================================
# compressed-tensors' own NVFP4 compressor
# =============================================================================================


def _dense_of(src: Path, module: str) -> torch.Tensor:
    return load_state_dict(src, module + ".weight")[module + ".weight"].float()


def test_compressed_tensors_compressor_output_loads_like_its_decompressor(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    src = _write(tmp_path, "bf16", name="dense", experts="per_expert")
    ck = open_checkpoint(src)
    tensors = load_file(str(src / "model.safetensors"))
    expected = {}
    modules = [m for m, (kind, _) in T.checkpoint_modules(ck.model_config).items()
               if kind == "linear" and m.startswith("mtp.")]
    for m in modules:
        w = tensors.pop(m + ".weight")                          # bf16 [N, K]
        n, k = w.shape
        gs = generate_gparam(w.float().min(), w.float().max())   # CT: 448·6 / amax (a divisor)
        blocks = w.reshape(n, k // 16, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
        comp = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs},
                                              scheme)
        expected[m] = NVFP4PackedCompressor.decompress(comp, scheme)["weight"]
        tensors.update({f"{m}.{p}": t.contiguous() for p, t in comp.items()})
    out = tmp_path / "ct"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="nvfp4-pack-quantized", quantization_status="compressed",
        ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]).model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(cfg))

    loaded = open_checkpoint(out)
    assert loaded.dialect == "compressed_tensors_nvfp4"
    sd = loaded.load("mtp.")
    for m in modules:
        q = weight_from_state_dict(sd, m + ".")
        assert isinstance(q, NVFP4Weight)
        ours, theirs = q.dequantize(torch.float32), expected[m].float()
        # CT's decompressor works in bf16: one bf16 rounding (≤ 2^-9 relative) apart
        assert ((ours - theirs).abs() <= ours.abs() * 2**-8).all(), m
        assert rel_err(ours, _dense_of(src, m)) < DENSE_BOUND["compressed_tensors_nvfp4"], m


# =============================================================================================
# Malformed checkpoints: CheckpointError naming the key and the file
# =============================================================================================


def _rewrite(d: Path, edit) -> None:
    f = d / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f), metadata={"format": "pt"})


Q = "mtp.layers.0.self_attn.q_proj"
K = "mtp.layers.0.self_attn.k_proj"


def _nan_e4m3(shape):
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)


MALFORMED = [
    # (dialect, edit, words the message must contain)
    ("modelopt_nvfp4", lambda t: t.pop(Q + ".weight_scale"), [Q + ".weight_scale", "missing"]),
    ("modelopt_nvfp4", lambda t: t.pop(Q + ".weight_scale_2"), [Q + ".weight_scale_2", "missing"]),
    ("bf16", lambda t: t.pop("mtp.norm.weight"), ["mtp.norm.weight", "missing"]),
    ("bf16", lambda t: t.pop("mtp.layers.0.mlp.experts.5.down_proj.weight"),
     ["mtp.layers.0.mlp.experts.5.down_proj.weight", "missing"]),
    ("modelopt_nvfp4", lambda t: t.update({K + ".weight": t[K + ".weight"][:, :-8].contiguous()}),
     [K + ".weight", "model.safetensors", "shape", "[128, 128]"]),
    ("fp8", lambda t: t.update({K + ".weight_scale_inv": torch.ones(2, 2)}), [K + ".weight_scale_inv", "shape"]),
    ("bf16", lambda t: t.update({"mtp.fc.weight": torch.zeros(256, 256, dtype=torch.bfloat16)}),
     ["mtp.fc.weight", "[256, 512]"]),
    ("modelopt_nvfp4", lambda t: t.update({Q + ".weight_scale": t[Q + ".weight_scale"].float()}),
     [Q + ".weight_scale", "dtype", "float8_e4m3fn", "float32"]),
    ("compressed_tensors_nvfp4", lambda t: t.update({Q + ".weight_packed": t[Q + ".weight_packed"].to(torch.int8)}),
     [Q + ".weight_packed", "dtype", "uint8"]),
    ("bf16", lambda t: t.update({"mtp.norm.weight": t["mtp.norm.weight"].to(torch.int32)}),
     ["mtp.norm.weight", "dtype"]),
    ("modelopt_nvfp4", lambda t: t.update({Q + ".weight_scale_2": torch.tensor(0.0)}),
     [Q + ".weight_scale_2", "non-zero", "0.0"]),
    ("modelopt_nvfp4", lambda t: t.update({Q + ".weight_scale_2": torch.tensor(float("nan"))}),
     [Q + ".weight_scale_2", "finite", "nan"]),
    ("compressed_tensors_nvfp4", lambda t: t.update({Q + ".weight_global_scale": torch.tensor([float("inf")])}),
     [Q + ".weight_global_scale", "finite", "inf"]),
    ("compressed_tensors_nvfp4", lambda t: t.update({Q + ".weight_global_scale": torch.zeros(2)}),
     [Q + ".weight_global_scale", "scalar"]),
    ("modelopt_nvfp4", lambda t: t.update({Q + ".weight_scale": _nan_e4m3(t[Q + ".weight_scale"].shape)}),
     [Q + ".weight_scale", "NaN block scale"]),
    ("fp8", lambda t: t[K + ".weight_scale_inv"].__setitem__((0, 1), 0.0), [K + ".weight_scale_inv", "positive"]),
    ("fp8", lambda t: t[K + ".weight_scale_inv"].__setitem__((0, 0), float("nan")), [K + ".weight_scale_inv", "nan"]),
    ("fp8", lambda t: t.update({K + ".weight": _nan_e4m3(t[K + ".weight"].shape)}), [K + ".weight", "NaN"]),
    ("bf16", lambda t: t["mtp.pre_fc_norm_hidden.weight"].__setitem__(3, float("inf")),
     ["mtp.pre_fc_norm_hidden.weight", "non-finite"]),
    ("modelopt_nvfp4", lambda t: t.update({Q + ".weight_packed": t[Q + ".weight"].clone()}), [Q, "compressed_tensors_nvfp4"]),
    ("modelopt_nvfp4", lambda t: t.update({Q + ".zero_point": torch.zeros(1)}), [Q + ".zero_point", "unexpected"]),
]


@pytest.mark.parametrize("dialect, edit, words", MALFORMED, ids=[f"{i}-{m[0]}" for i, m in enumerate(MALFORMED)])
def test_malformed_tensor_raises_naming_key_and_file(tmp_path, dialect, edit, words):
    d = _write(tmp_path, dialect)
    _rewrite(d, edit)
    with pytest.raises(CheckpointError) as e:
        load_state_dict(d, "mtp.")
    msg = str(e.value)
    assert "model.safetensors" in msg or str(d) in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), (w, msg)


@pytest.mark.parametrize("cut", [100, 1 << 14])
def test_truncated_file_raises_naming_the_file(tmp_path, cut):
    d = _write(tmp_path, "modelopt_nvfp4", shard_bytes=150_000)
    victim = sorted(d.glob("*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:cut] if cut < 1000 else data[:-cut])
    with pytest.raises(CheckpointError, match=victim.name):
        load_state_dict(d, "mtp.")


def test_vl_layout_messages_name_the_stored_key(tmp_path):
    d = _write(tmp_path, "bf16", layout="vl")
    _rewrite(d, lambda t: t.pop("model.language_model.norm.weight"))
    with pytest.raises(CheckpointError, match="model.language_model.norm.weight"):
        load_state_dict(d, "model.norm.")


def test_index_problems(tmp_path):
    d = _write(tmp_path, "bf16", shard_bytes=150_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(d.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        open_checkpoint(d)
    d2 = _write(tmp_path, "bf16", name="c2", shard_bytes=150_000)
    index = json.loads((d2 / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.extra.weight"] = sorted(index["weight_map"].values())[0]
    (d2 / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="mtp.extra.weight"):
        open_checkpoint(d2)


def test_missing_files_and_prefixes(tmp_path):
    d = _write(tmp_path, "bf16")
    with pytest.raises(CheckpointError, match="missing 'model.layers.1.input_layernorm.weight'"):
        load_state_dict(d, "model.layers.1.")                  # a layer this checkpoint lacks
    with pytest.raises(CheckpointError, match="no tensors under prefix 'visual.'"):
        load_state_dict(d, "visual.")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        open_checkpoint(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint(tmp_path / "nowhere")


# =============================================================================================
# Layers from a checkpoint directory (MtpHead / Qwen3AttentionLayer .from_pretrained)
# =============================================================================================


def _import_or_skip(module):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        pytest.skip(f"{module} not importable yet: {e}")


@pytest.mark.parametrize("dialect, layout, weight_format", [
    ("bf16", "vl", "bf16"), ("modelopt_nvfp4", "qwen3_next", "nvfp4"),
    ("compressed_tensors_nvfp4", "vl", "nvfp4"), ("fp8", "qwen3_next", "fp8")])
def test_load_mtp_head_proposes(tmp_path, dialect, layout, weight_format):
    mtp_mod = _import_or_skip("atlas.layers.mtp")
    d = _write(tmp_path, dialect, layout=layout, quantize_lm_head=dialect in NVFP4_DIALECTS, mtp_fc_bf16=True)
    head = mtp_mod.MtpHead.from_pretrained(d, weight_format=weight_format, max_seq_len=64, max_seqs=2,
                                           device="cpu")
    assert isinstance(head, mtp_mod.MtpHead)
    g = torch.Generator().manual_seed(3)
    head.prefill(0, torch.randint(0, 1000, (9,), generator=g), torch.randn(9, 256, generator=g).bfloat16())
    drafts, conf = head.propose([0], torch.tensor([5]), torch.randn(1, 256, generator=g).bfloat16(), 2)
    assert drafts.shape == (1, 2) and bool(((drafts >= 0) & (drafts < 1000)).all())
    assert bool(((conf > 0) & (conf <= 1)).all())


def test_load_mtp_head_rejects_malformed_before_building(tmp_path):
    _import_or_skip("atlas.layers.mtp")
    from atlas.checkpoint import load_mtp_head
    d = _write(tmp_path, "modelopt_nvfp4")
    _rewrite(d, lambda t: t.update({Q + ".weight_scale_2": torch.tensor(float("nan"))}))
    with pytest.raises(CheckpointError, match="weight_scale_2"):
        load_mtp_head(d, weight_format="nvfp4", max_seq_len=64, max_seqs=1, device="cpu")


@pytest.mark.parametrize("dialect", T.DIALECTS)
def test_load_attention_layer(tmp_path, dialect):
    attn_mod = _import_or_skip("atlas.layers.attention")
    from atlas.checkpoint import load_attention_layer
    d = _write(tmp_path, dialect, layout="vl", layers=[3])
    layer = attn_mod.Qwen3AttentionLayer.from_pretrained(d, 3, weight_format="bf16", device="cpu")
    assert isinstance(layer, attn_mod.Qwen3AttentionLayer)
    sd = load_state_dict(d, "model.layers.3.self_attn.")
    want = dequantized_weight(sd, "model.layers.3.self_attn.o_proj.").to(torch.bfloat16)
    assert torch.equal(layer.o_proj.dense(torch.bfloat16), want)
    with pytest.raises(CheckpointError, match="layer_idx 2 is not a full-attention layer"):
        load_attention_layer(d, 2, weight_format="bf16", device="cpu")


# =============================================================================================
# GPU: loading to the device, the writer's kernel path, a real-shaped MTP checkpoint
# =============================================================================================


@pytest.mark.cuda
@pytest.mark.parametrize("dialect", T.DIALECTS)
def test_load_to_cuda_matches_cpu(tmp_path, dialect):
    d = _write(tmp_path, dialect, layout="vl", shard_bytes=150_000)
    cpu, gpu = load_state_dict(d, "mtp."), load_state_dict(d, "mtp.", device="cuda")
    assert cpu.keys() == gpu.keys()
    for k in cpu:
        assert gpu[k].is_cuda and gpu[k].dtype == cpu[k].dtype
        assert torch.equal(gpu[k].cpu().view(torch.uint8) if cpu[k].element_size() == 1 else gpu[k].cpu(),
                           cpu[k].view(torch.uint8) if cpu[k].element_size() == 1 else cpu[k]), k


@pytest.mark.cuda
def test_writer_on_cuda_quantizes_bit_exactly(tmp_path):
    """Weights drawn on the GPU and quantized by the kernel equal the reference quantization of
    the same dense weight, byte for byte."""
    from atlas import reference
    d = T.write_checkpoint(tmp_path / "g", T.tiny_config(), "modelopt_nvfp4", seed=5, device="cuda")
    sd = load_state_dict(d, "mtp.")
    mods = {m: v for m, v in T.checkpoint_modules(open_checkpoint(d).model_config).items() if v[0] == "linear"}
    for m, (kind, shape) in mods.items():
        if m == "mtp.fc" or "experts.1" in m or "experts.0" in m or "self_attn" in m:
            dense = T.dense_weight(m, kind, shape, seed=5, device="cuda").cpu()
            packed, scale, gs = reference.quantize_nvfp4(dense)
            assert torch.equal(sd[m + ".weight"], packed), m
            assert torch.equal(sd[m + ".weight_scale"].view(torch.uint8), scale.view(torch.uint8)), m
            assert torch.equal(sd[m + ".weight_scale_2"], gs), m


@pytest.mark.cuda
@pytest.mark.slow
def test_real_shaped_35b_a3b_mtp_checkpoint_loads_and_proposes(tmp_path):
    """The main job's default: a synthetic Qwen3.6-35B-A3B NVFP4 MTP checkpoint (256 experts,
    vocab 248320, ~2.5 GB, sharded) written on the GPU, loaded and validated, then one propose."""
    mtp_mod = _import_or_skip("atlas.layers.mtp")
    d = T.write_checkpoint(tmp_path / "big", T.qwen36_35b_a3b_config(), "modelopt_nvfp4", layers="mtp",
                           device="cuda", shard_bytes=1 << 30, quantize_lm_head=True, mtp_fc_bf16=True)
    assert len(list(d.glob("*.safetensors"))) >= 2
    head = mtp_mod.MtpHead.from_pretrained(d, weight_format="nvfp4", max_seq_len=256, max_seqs=2, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in (0, 1):
        head.prefill(s, torch.randint(0, 248320, (65,), generator=g, device="cuda"),
                     torch.randn(65, 2048, generator=g, device="cuda").bfloat16())
    drafts, conf = head.propose([0, 1], torch.tensor([7, 8], device="cuda"),
                                torch.randn(2, 2048, generator=g, device="cuda").bfloat16(), 3)
    torch.cuda.synchronize()
    assert drafts.shape == (2, 3) and bool(((drafts >= 0) & (drafts < 248320)).all())
    assert bool(torch.isfinite(conf).all())


def test_duplicate_key_across_files_without_index(tmp_path):
    d = _write(tmp_path, "bf16", shard_bytes=150_000)
    (d / "model.safetensors.index.json").unlink()
    files = sorted(d.glob("*.safetensors"))
    t = load_file(str(files[0]))
    key = next(iter(t))
    save_file({key: t[key]}, str(d / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=f"'{key}' is in both"):
        open_checkpoint(d)
    (d / "extra.safetensors").unlink()
    assert len(load_state_dict(d, "mtp.")) > 10            # no index: every file's keys, once


def test_legacy_hf_quant_config_file(tmp_path):
    """Older ModelOpt exports: no quantization_config in config.json, hf_quant_config.json beside it."""
    d = _write(tmp_path, "modelopt_nvfp4")
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                           "exclude_modules": qc["exclude_modules"]}}))
    ck = open_checkpoint(d)
    assert ck.dialect == "modelopt_nvfp4"
    assert isinstance(weight_from_state_dict(ck.load("mtp.fc."), "mtp.fc."), NVFP4Weight)
