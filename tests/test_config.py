"""ModelConfig: parsing of published Qwen3-family config.json files (fixtures/), derived fields,
and one negative test per validation rule (matched on the key / argument name)."""
import copy
import json
from pathlib import Path

import pytest
import torch

from atlas import ModelConfig

FIXTURES = Path(__file__).parent / "fixtures"

# fixture -> fields it must parse to (published values; see shared/notes/peers-and-formats.md §2)
EXPECTED = {
    "qwen3_8b": dict(
        model_type="qwen3", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, num_hidden_layers=36, vocab_size=151936, intermediate_size=12288,
        rms_norm_eps=1e-6, rope_theta=1e6, partial_rotary_factor=1.0, rotary_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=False, is_moe=False, num_experts=0,
        mtp_num_hidden_layers=0, attn_output_gate=False, zero_centered_norm=False,
        full_attention_interval=1, num_full=36, mrope_section=None, torch_dtype=torch.bfloat16),
    "qwen3_next_80b_a3b": dict(
        model_type="qwen3_next", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, num_hidden_layers=48, vocab_size=151936, intermediate_size=5120,
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, rotary_dim=64,
        max_position_embeddings=262144, tie_word_embeddings=False, is_moe=True, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
        mtp_num_hidden_layers=1, attn_output_gate=True, zero_centered_norm=True,
        full_attention_interval=4, num_full=12, mrope_section=None, torch_dtype=torch.bfloat16),
    "qwen3_5_27b": dict(
        model_type="qwen3_5", hidden_size=5120, num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, num_hidden_layers=64, vocab_size=248320, intermediate_size=17408,
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, rotary_dim=64,
        max_position_embeddings=262144, tie_word_embeddings=False, is_moe=False, num_experts=0,
        mtp_num_hidden_layers=1, attn_output_gate=True, zero_centered_norm=True,
        full_attention_interval=4, num_full=16, mrope_section=(11, 11, 10),
        torch_dtype=torch.bfloat16),
    "qwen3_6_35b_a3b": dict(
        model_type="qwen3_5_moe", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, num_hidden_layers=40, vocab_size=248320, intermediate_size=None,
        rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25, rotary_dim=64,
        max_position_embeddings=262144, tie_word_embeddings=False, is_moe=True, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, mtp_num_hidden_layers=1, attn_output_gate=True,
        zero_centered_norm=True, full_attention_interval=4, num_full=10,
        mrope_section=(11, 11, 10), torch_dtype=torch.bfloat16),
}


def _raw(name):
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _text(raw):
    return raw.get("text_config", raw)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_fields(name):
    cfg = ModelConfig.from_hf(FIXTURES / f"{name}.json")
    want = dict(EXPECTED[name])
    num_full = want.pop("num_full")
    for key, value in want.items():
        assert getattr(cfg, key) == value, key
    assert len(cfg.layer_types) == cfg.num_hidden_layers
    assert len(cfg.full_attention_layers) == num_full
    # HF rule: layer i is full attention iff (i + 1) % interval == 0
    k = cfg.full_attention_interval
    assert cfg.full_attention_layers == tuple(i for i in range(cfg.num_hidden_layers) if (i + 1) % k == 0)
    assert cfg.softmax_scale == cfg.head_dim ** -0.5
    assert cfg.num_kv_groups == cfg.num_attention_heads // cfg.num_key_value_heads
    assert cfg.raw == _raw(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_path_dir_and_dict_agree(name, tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / f"{name}.json").read_text())
    by_file = ModelConfig.from_hf(str(FIXTURES / f"{name}.json"))
    by_dir = ModelConfig.from_hf(tmp_path)
    by_dict = ModelConfig.from_hf(_raw(name))
    assert by_file == by_dir == by_dict


def test_head_dim_explicit_not_derived():
    # Qwen3-0.6B: hidden 1024 / 16 heads = 64, but head_dim is 128; the explicit value wins
    raw = _raw("qwen3_8b")
    raw.update(hidden_size=1024, num_attention_heads=16, head_dim=128)
    cfg = ModelConfig.from_hf(raw)
    assert cfg.head_dim == 128 and cfg.rotary_dim == 128
    assert cfg.softmax_scale == 128 ** -0.5


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_matches_transformers(name):
    """Cross-check against transformers' own config classes when it is installed."""
    transformers = pytest.importorskip("transformers")
    raw = _raw(name)
    try:
        hf = transformers.AutoConfig.for_model(**copy.deepcopy(raw))
    except Exception as e:  # an older transformers without this model_type
        pytest.skip(f"transformers cannot build {raw['model_type']}: {e}")
    hf = getattr(hf, "text_config", hf)
    cfg = ModelConfig.from_hf(raw)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(cfg, key) == getattr(hf, key), key
    rope = getattr(hf, "rope_parameters", None) or {}
    assert cfg.rope_theta == float(rope.get("rope_theta", getattr(hf, "rope_theta", None)))
    assert cfg.partial_rotary_factor == float(
        rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    if getattr(hf, "layer_types", None) is not None:
        assert list(cfg.layer_types) == list(hf.layer_types)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size"):
        if hasattr(hf, key):
            assert getattr(cfg, key) == getattr(hf, key), key


def test_text_config_alone():
    # a bare qwen3_5_moe_text config (what a VL wrapper's text_config holds) parses the same
    raw = _raw("qwen3_6_35b_a3b")
    wrapped = ModelConfig.from_hf(raw)
    bare = ModelConfig.from_hf(raw["text_config"])
    assert bare == wrapped and bare.model_type == "qwen3_5_moe"


def test_layer_types_derived_from_interval_when_absent():
    raw = _raw("qwen3_6_35b_a3b")
    del raw["text_config"]["layer_types"]
    cfg = ModelConfig.from_hf(raw)
    assert cfg.full_attention_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39)
    raw["text_config"]["full_attention_interval"] = 2
    assert ModelConfig.from_hf(raw).full_attention_layers == tuple(range(1, 40, 2))


def test_explicit_layer_types_win_over_interval():
    raw = _raw("qwen3_5_27b")
    types = ["linear_attention"] * 64
    types[0] = types[10] = "full_attention"
    raw["text_config"]["layer_types"] = types
    cfg = ModelConfig.from_hf(raw)
    assert cfg.full_attention_layers == (0, 10)
    assert cfg.full_attention_interval == 4   # stated in the file, kept as stated


def test_rope_sources():
    raw = _raw("qwen3_8b")
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    assert ModelConfig.from_hf(raw).rope_theta == 5e6
    raw.pop("rope_parameters")
    assert ModelConfig.from_hf(raw).rope_theta == 10000.0   # HF default_theta
    nxt = _raw("qwen3_next_80b_a3b")
    nxt.pop("partial_rotary_factor")
    assert ModelConfig.from_hf(nxt).partial_rotary_factor == 0.25   # family default


def test_mtp_key_aliases():
    nxt = _raw("qwen3_next_80b_a3b")
    assert ModelConfig.from_hf(nxt).mtp_num_hidden_layers == 1      # family default
    nxt["num_nextn_predict_layers"] = 2
    assert ModelConfig.from_hf(nxt).mtp_num_hidden_layers == 2
    dense = _raw("qwen3_5_27b")
    del dense["text_config"]["mtp_num_hidden_layers"]
    assert ModelConfig.from_hf(dense).mtp_num_hidden_layers == 0


def test_attn_output_gate_explicit_wins():
    raw = _raw("qwen3_5_27b")
    raw["text_config"]["attn_output_gate"] = False
    assert ModelConfig.from_hf(raw).attn_output_gate is False


def test_tie_word_embeddings_from_wrapper():
    raw = _raw("qwen3_5_27b")
    del raw["text_config"]["tie_word_embeddings"]
    raw["tie_word_embeddings"] = True
    assert ModelConfig.from_hf(raw).tie_word_embeddings is True


def test_is_moe_layer():
    cfg = ModelConfig.from_hf(_raw("qwen3_next_80b_a3b"))
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    raw = _raw("qwen3_next_80b_a3b")
    raw.update(mlp_only_layers=[0, 5], decoder_sparse_step=2)
    cfg = ModelConfig.from_hf(raw)
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [1, 3, 7]
    assert not ModelConfig.from_hf(_raw("qwen3_8b")).is_moe_layer(0)
    with pytest.raises(ValueError, match="layer"):
        cfg.is_moe_layer(48)


@pytest.mark.parametrize("cfg", [
    *(ModelConfig.from_hf(FIXTURES / f"{n}.json") for n in sorted(EXPECTED)),
    ModelConfig.tiny(), ModelConfig.tiny(num_experts=0, model_type="qwen3_5"),
    ModelConfig.tiny(zero_centered_norm=False, attn_output_gate=False, num_hidden_layers=3,
                     layer_types=("full_attention", "linear_attention", "full_attention")),
], ids=lambda c: c.model_type)
def test_to_hf_round_trip(cfg):
    back = ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf())))
    assert back == cfg


def test_frozen():
    cfg = ModelConfig.tiny()
    with pytest.raises(Exception):
        cfg.head_dim = 64


# ---- tiny ------------------------------------------------------------------------------------


def test_tiny_defaults():
    cfg = ModelConfig.tiny()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 64)
    assert cfg.rotary_dim == 16 and cfg.zero_centered_norm and cfg.attn_output_gate
    assert cfg.is_moe and (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.vocab_size == 512 and cfg.full_attention_layers == (1,)


def test_tiny_overrides():
    dense = ModelConfig.tiny(num_experts=0)
    assert not dense.is_moe and dense.intermediate_size == 128
    plain = ModelConfig.tiny(model_type="qwen3", zero_centered_norm=False, attn_output_gate=False,
                             partial_rotary_factor=1.0)
    assert plain.rotary_dim == 64 and not plain.zero_centered_norm
    deep = ModelConfig.tiny(num_hidden_layers=8)
    assert deep.full_attention_layers == (1, 3, 5, 7)
    assert ModelConfig.tiny(head_dim=128).rotary_dim == 32
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.tiny(bogus=1)


# ---- negative tests: one per rule, matched on the key named ----------------------------------


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "num_hidden_layers",
                                 "vocab_size", "head_dim", "intermediate_size"])
def test_missing_required_key_dense(key):
    raw = _raw("qwen3_8b")
    del raw[key]
    with pytest.raises(ValueError, match=f"missing required key '{key}'"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("key", ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                 "shared_expert_intermediate_size", "head_dim"])
def test_missing_required_key_moe(key):
    raw = _raw("qwen3_6_35b_a3b")
    del raw["text_config"][key]
    with pytest.raises(ValueError, match=f"missing required key '{key}' in text_config"):
        ModelConfig.from_hf(raw)


def test_missing_model_type():
    raw = _raw("qwen3_8b")
    del raw["model_type"]
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v3"])
def test_unsupported_model_type(model_type):
    raw = _raw("qwen3_8b")
    raw["model_type"] = model_type
    with pytest.raises(ValueError, match=f"unsupported model_type '{model_type}'"):
        ModelConfig.from_hf(raw)


def test_unsupported_rope_type():
    raw = _raw("qwen3_8b")
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="rope_scaling.rope_type 'yarn'"):
        ModelConfig.from_hf(raw)


def test_rope_theta_disagreement():
    raw = _raw("qwen3_5_27b")
    raw["text_config"]["rope_theta"] = 1e6
    with pytest.raises(ValueError, match="rope_theta disagrees"):
        ModelConfig.from_hf(raw)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


def test_bad_argument_type():
    with pytest.raises(TypeError, match="path_or_dict"):
        ModelConfig.from_hf(42)


def test_text_config_not_a_dict():
    with pytest.raises(TypeError, match="text_config"):
        ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": [1, 2]})


@pytest.mark.parametrize("overrides,match,exc", [
    (dict(num_key_value_heads=3), "num_key_value_heads", ValueError),
    (dict(hidden_size=0), "hidden_size", ValueError),
    (dict(head_dim=32.0), "head_dim", TypeError),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor", ValueError),
    (dict(head_dim=36, partial_rotary_factor=0.25), "rotary_dim", ValueError),
    (dict(num_experts_per_tok=9), "num_experts_per_tok", ValueError),
    (dict(num_experts=0, intermediate_size=None), "intermediate_size", ValueError),
    (dict(layer_types=("full_attention",)), "layer_types", ValueError),
    (dict(layer_types=("linear_attention", "mamba")), "layer_types", ValueError),
    (dict(layer_types=("linear_attention", "linear_attention")), "full_attention", ValueError),
    (dict(full_attention_interval=0, layer_types=None), "full_attention_interval", ValueError),
    (dict(mrope_section=(2, 2, 1)), "mrope_section", ValueError),
    (dict(rms_norm_eps=0.0), "rms_norm_eps", ValueError),
    (dict(rope_theta=-1.0), "rope_theta", ValueError),
    (dict(model_type="gpt2"), "model_type", ValueError),
    (dict(torch_dtype="bfloat16"), "torch_dtype", TypeError),
])
def test_invalid_fields(overrides, match, exc):
    with pytest.raises(exc, match=match):
        ModelConfig.tiny(**overrides)


def test_bad_bool_and_dtype_in_file():
    raw = _raw("qwen3_8b")
    raw["tie_word_embeddings"] = "false"
    with pytest.raises(TypeError, match="tie_word_embeddings"):
        ModelConfig.from_hf(raw)
    raw = _raw("qwen3_8b")
    raw["torch_dtype"] = "int8"
    with pytest.raises(ValueError, match="torch_dtype"):
        ModelConfig.from_hf(raw)
