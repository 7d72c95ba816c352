"""ModelConfig: the text-model fields of a Qwen3-family `config.json`, named as in HF.

Supported `model_type`s (HF name → what atlas needs to know about the family):

    qwen3        dense; plain RMSNorm weight (x·w); full RoPE; no attention output gate
    qwen3_moe    as qwen3, sparse MoE MLP (no shared expert)
    qwen3_next   Qwen3-Next: zero-centered norms (x·(1+w)); q_proj emits [q | gate] per head and
                 the attention output is multiplied by sigmoid(gate); partial RoPE (0.25);
                 hybrid layers (every `full_attention_interval`-th is full attention, the rest
                 Gated DeltaNet); sparse MoE + one shared expert; one MTP layer
    qwen3_5      Qwen3.5 / 3.6 dense: as qwen3_next but a dense MLP; VL-wrapped config
    qwen3_5_moe  Qwen3.5 / 3.6 MoE: as qwen3_next; VL-wrapped config

Rules (STYLE 12): a key present in the config always wins; a derived value never overrides it
(Qwen3's `head_dim` is not hidden_size / num_attention_heads, so `head_dim` is required, never
guessed). Keys that shape tensors are required and missing ones raise ValueError naming the key;
knobs that HF gives a class default (rms_norm_eps, rope_theta, ...) take that default.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

_OP = "ModelConfig"

# Family traits: what HF's modeling code hard-wires per model_type (not config keys, except
# attn_output_gate / partial_rotary_factor / full_attention_interval / norm_topk_prob, which
# the config may state and then wins). Read from transformers 5.x
# models/{qwen3,qwen3_moe,qwen3_next,qwen3_5,qwen3_5_moe}/{configuration,modeling}_*.py.
_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(zero_centered_norm=False, attn_output_gate=False, partial_rotary_factor=1.0,
                  full_attention_interval=1, moe=False, shared_expert=False,
                  norm_topk_prob=False, mtp_num_hidden_layers=0),
    # HF Qwen3MoeConfig.norm_topk_prob defaults to False (published Qwen3-30B-A3B sets true).
    "qwen3_moe": dict(zero_centered_norm=False, attn_output_gate=False, partial_rotary_factor=1.0,
                      full_attention_interval=1, moe=True, shared_expert=False,
                      norm_topk_prob=False, mtp_num_hidden_layers=0),
    # Qwen3-Next config.json has no MTP key, yet its checkpoints ship one `mtp.*` layer
    # (vLLM sets num_nextn_predict_layers = 1 for its MTP drafter): default 1.
    "qwen3_next": dict(zero_centered_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
                       full_attention_interval=4, moe=True, shared_expert=True,
                       norm_topk_prob=True, mtp_num_hidden_layers=1),
    "qwen3_5": dict(zero_centered_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
                    full_attention_interval=4, moe=False, shared_expert=False,
                    norm_topk_prob=True, mtp_num_hidden_layers=0),
    # Qwen3_5MoeTopKRouter always renormalizes the top-k (no config key): norm_topk_prob True.
    "qwen3_5_moe": dict(zero_centered_norm=True, attn_output_gate=True, partial_rotary_factor=0.25,
                        full_attention_interval=4, moe=True, shared_expert=True,
                        norm_topk_prob=True, mtp_num_hidden_layers=0),
}

LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")
_ROPE_TYPES = ("default", "mrope")   # mrope = default RoPE with mrope_section (Qwen-VL label)
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "head_dim")
_REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, eq=True)
class ModelConfig:
    """Text-model configuration of a Qwen3-family checkpoint (fields named as in HF config.json).

    Build one with `ModelConfig.from_hf(path_or_dict)` (a checkpoint directory, a config.json
    path, or the parsed dict) or `ModelConfig.tiny(**overrides)` for tests. Direct construction
    works too; `None` in a derivable field means "derive" (layer_types, full_attention_interval).

    Attributes (glossary: h = hidden_size, nq / nkv = attention / KV heads, hd = head_dim):
        model_type: family, one of qwen3 | qwen3_moe | qwen3_next | qwen3_5 | qwen3_5_moe (a
            VL-wrapped or `*_text` config reports its family, e.g. "qwen3_5_moe").
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers,
        vocab_size: as in HF. num_attention_heads % num_key_value_heads == 0.
        intermediate_size: dense MLP width, None when the config has none (Qwen3.5 MoE).
        rms_norm_eps: RMSNorm epsilon (HF default 1e-6).
        rope_theta: RoPE base (from `rope_parameters` / `rope_scaling` or top level; HF
            default 1e4). partial_rotary_factor: fraction of head_dim that is rotated.
        mrope_section: Qwen3.5/3.6 interleaved-mRoPE split of rotary_dim / 2 (e.g. (11, 11, 10));
            for text-only positions it equals plain RoPE. None when absent.
        max_position_embeddings, tie_word_embeddings: as in HF.
        num_experts, num_experts_per_tok, moe_intermediate_size: routed experts (0 = dense).
        shared_expert_intermediate_size: width of the always-on shared expert (0 = none).
        norm_topk_prob: renormalize the top-k router probabilities to sum to 1.
        decoder_sparse_step, mlp_only_layers: HF's rule for which layers are MoE (`is_moe_layer`).
        mtp_num_hidden_layers: MTP decoder layers shipped with the checkpoint
            (`mtp_num_hidden_layers`, Qwen3-Next's `num_nextn_predict_layers`).
        attn_output_gate: q_proj emits per head [q(hd) | gate(hd)]; output *= sigmoid(gate).
        zero_centered_norm: RMSNorm scale is (1 + w) (Qwen3-Next family) instead of w.
        layer_types: per layer "full_attention" | "linear_attention" | "sliding_attention";
            derived from full_attention_interval when absent (layer i is full attention iff
            (i + 1) % interval == 0, as HF does).
        full_attention_interval: see layer_types; None when layer_types is not periodic.
        torch_dtype: checkpoint dtype (`torch_dtype` or `dtype` key), None when absent.
        raw: the dict the config was parsed from (the whole file, VL wrapper included).

    Derived (properties): rotary_dim = int(hd · partial_rotary_factor), softmax_scale =
    hd ** -0.5, is_moe = num_experts > 0, num_kv_groups = nq / nkv, full_attention_layers.

    Raises:
        ValueError: a value out of range or inconsistent (named in the message).
        TypeError: a field of the wrong type.

    Example:
        >>> cfg = ModelConfig.from_hf({"model_type": "qwen3", "hidden_size": 4096,
        ...     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        ...     "num_hidden_layers": 36, "vocab_size": 151936, "intermediate_size": 12288})
        >>> cfg.rotary_dim, cfg.softmax_scale == 128 ** -0.5, cfg.zero_centered_norm
        (128, True, False)
    """

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    intermediate_size: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    mrope_section: Optional[tuple[int, ...]] = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0
    attn_output_gate: bool = False
    zero_centered_norm: bool = False
    layer_types: Optional[tuple[str, ...]] = None
    full_attention_interval: Optional[int] = None
    torch_dtype: Optional[torch.dtype] = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ---- validation and derived fields ------------------------------------------------------

    def __post_init__(self):
        if self.model_type not in _FAMILIES:
            raise ValueError(f"{_OP}: unsupported model_type {self.model_type!r} "
                             f"(supported: {', '.join(_FAMILIES)})")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_hidden_layers", "vocab_size", "max_position_embeddings",
                     "decoder_sparse_step"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "mtp_num_hidden_layers"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.intermediate_size is not None:
            _check_int("intermediate_size", self.intermediate_size, minimum=1)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"{_OP}: num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if not (float(self.rms_norm_eps) > 0):
            raise ValueError(f"{_OP}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (float(self.rope_theta) > 0):
            raise ValueError(f"{_OP}: rope_theta must be > 0, got {self.rope_theta}")
        if not (0 < float(self.partial_rotary_factor) <= 1):
            raise ValueError(f"{_OP}: partial_rotary_factor must be in (0, 1], "
                             f"got {self.partial_rotary_factor}")
        rot = int(self.head_dim * self.partial_rotary_factor)
        if rot < 2 or rot % 2 != 0:
            raise ValueError(f"{_OP}: rotary_dim = int(head_dim {self.head_dim} * "
                             f"partial_rotary_factor {self.partial_rotary_factor}) = {rot} "
                             "must be even and >= 2")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
            if sum(self.mrope_section) != rot // 2:
                raise ValueError(f"{_OP}: mrope_section {list(self.mrope_section)} must sum to "
                                 f"rotary_dim / 2 = {rot // 2}")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"{_OP}: num_experts_per_tok must be in [1, num_experts = "
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            _check_int("moe_intermediate_size", self.moe_intermediate_size, minimum=1)
        elif self.intermediate_size is None:
            raise ValueError(f"{_OP}: a dense model (num_experts = 0) needs intermediate_size")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, torch.dtype):
            raise TypeError(f"{_OP}: torch_dtype must be a torch.dtype or None, "
                            f"got {type(self.torch_dtype).__name__}")
        self._derive_layer_types()

    def _derive_layer_types(self):
        n = self.num_hidden_layers
        interval = self.full_attention_interval
        if interval is not None:
            _check_int("full_attention_interval", interval, minimum=1)
        if self.layer_types is None:
            if interval is None:
                interval = _FAMILIES[self.model_type]["full_attention_interval"]
                object.__setattr__(self, "full_attention_interval", interval)
            types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                          for i in range(n))
            object.__setattr__(self, "layer_types", types)
        else:
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", types)
            if len(types) != n:
                raise ValueError(f"{_OP}: layer_types has {len(types)} entries but "
                                 f"num_hidden_layers is {n}")
            bad = [t for t in types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"{_OP}: layer_types has unknown entry {bad[0]!r} "
                                 f"(known: {', '.join(LAYER_TYPES)})")
            if interval is None:   # derive only when the pattern is exactly periodic
                full = [i for i, t in enumerate(types) if t == "full_attention"]
                if full:
                    k = full[0] + 1
                    if full == [i for i in range(n) if (i + 1) % k == 0]:
                        object.__setattr__(self, "full_attention_interval", k)
        if "full_attention" not in self.layer_types:
            raise ValueError(f"{_OP}: layer_types has no full_attention layer")

    # ---- derived values ---------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: int(head_dim · partial_rotary_factor) (64 of 256 for Qwen3-Next)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def softmax_scale(self) -> float:
        """Attention score scale head_dim ** -0.5 (1/16 for head_dim 256)."""
        return self.head_dim ** -0.5

    @property
    def is_moe(self) -> bool:
        """True when the MLP has routed experts (num_experts > 0)."""
        return self.num_experts > 0

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group): num_attention_heads / num_key_value_heads."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the ones with a paged KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def is_moe_layer(self, layer: int) -> bool:
        """HF's rule: layer uses the sparse MoE block iff the model has experts, the layer is
        not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0."""
        _check_int("layer", layer, minimum=0)
        if layer >= self.num_hidden_layers:
            raise ValueError(f"{_OP}.is_moe_layer: layer must be < num_hidden_layers = "
                             f"{self.num_hidden_layers}, got {layer}")
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Parse an HF config: a checkpoint directory holding config.json, a path to a JSON file,
        or the already-parsed dict.

        Handles the flat layout (qwen3, qwen3_moe, qwen3_next) and the VL-wrapped one
        (qwen3_5, qwen3_5_moe: text fields under `text_config`; a bare `*_text` config works
        too). RoPE settings come from `rope_parameters` (transformers 5), `rope_scaling`
        (older files) or top-level `rope_theta` / `partial_rotary_factor`; where two of them
        state a value they must agree.

        Raises:
            FileNotFoundError: no config.json at the path.
            TypeError: path_or_dict is neither a path nor a mapping, or a key has the wrong type.
            ValueError: unsupported model_type, a missing required key (named), an unsupported
                RoPE type (only default RoPE / mRoPE), or inconsistent values.
        """
        raw = _load_json(path_or_dict)
        text = raw.get("text_config")
        if text is None:
            text = raw
        elif not isinstance(text, Mapping):
            raise TypeError(f"{_OP}.from_hf: text_config must be a dict, got {type(text).__name__}")

        model_type = text.get("model_type") or raw.get("model_type")
        if model_type is None:
            raise ValueError(f"{_OP}.from_hf: missing required key 'model_type'")
        family = model_type[: -len("_text")] if model_type.endswith("_text") else model_type
        if family not in _FAMILIES:
            raise ValueError(f"{_OP}.from_hf: unsupported model_type {model_type!r} "
                             f"(supported: {', '.join(_FAMILIES)})")
        traits = _FAMILIES[family]

        required = _REQUIRED + (_REQUIRED_MOE if traits["moe"] else ("intermediate_size",))
        if traits["shared_expert"]:
            required += ("shared_expert_intermediate_size",)
        for key in required:
            if text.get(key) is None:
                where = "text_config" if text is not raw else "config"
                raise ValueError(f"{_OP}.from_hf: missing required key {key!r} in {where} "
                                 f"(model_type {model_type!r})")

        def get(key, default=None):
            value = text.get(key)
            return default if value is None else value

        rope_theta, partial, mrope_section = _rope_fields(text, traits["partial_rotary_factor"])
        mtp = text.get("mtp_num_hidden_layers")
        if mtp is None:
            mtp = text.get("num_nextn_predict_layers")
        if mtp is None:
            mtp = traits["mtp_num_hidden_layers"]
        tie = text.get("tie_word_embeddings")
        if tie is None:
            tie = raw.get("tie_word_embeddings", False)
        layer_types = text.get("layer_types")
        return cls(
            model_type=family,
            hidden_size=text["hidden_size"],
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=get("num_key_value_heads", text["num_attention_heads"]),
            head_dim=text["head_dim"],
            num_hidden_layers=text["num_hidden_layers"],
            vocab_size=text["vocab_size"],
            intermediate_size=text.get("intermediate_size"),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            mrope_section=mrope_section,
            max_position_embeddings=get("max_position_embeddings", 32768),
            tie_word_embeddings=_check_bool("tie_word_embeddings", tie),
            num_experts=get("num_experts", 0),
            num_experts_per_tok=get("num_experts_per_tok", 0),
            moe_intermediate_size=get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0),
            norm_topk_prob=_check_bool("norm_topk_prob", get("norm_topk_prob", traits["norm_topk_prob"])),
            decoder_sparse_step=get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(get("mlp_only_layers", ())),
            mtp_num_hidden_layers=mtp,
            attn_output_gate=_check_bool("attn_output_gate",
                                         get("attn_output_gate", traits["attn_output_gate"])),
            # not an HF key: a family trait, but stated values win (to_hf() writes it)
            zero_centered_norm=_check_bool("zero_centered_norm",
                                           get("zero_centered_norm", traits["zero_centered_norm"])),
            layer_types=None if layer_types is None else tuple(layer_types),
            full_attention_interval=text.get("full_attention_interval"),
            torch_dtype=_parse_dtype(get("torch_dtype", get("dtype", raw.get("torch_dtype", raw.get("dtype"))))),
            raw=raw,
        )

    def to_hf(self) -> dict[str, Any]:
        """A flat HF-style config dict of these fields (plus `zero_centered_norm`, which HF
        leaves to the model_type), such that `ModelConfig.from_hf(cfg.to_hf()) == cfg`.
        Fields that are None are left out; `raw` is not included (it is the original file)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "raw" or value is None:
                continue
            if isinstance(value, torch.dtype):
                value = str(value).replace("torch.", "")
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A small Qwen3-Next-style config for CPU tests (every feature on, shapes tiny).

        Defaults: model_type "qwen3_next", hidden 64, 4 q / 2 kv heads, head_dim 64 (not
        hidden/heads = 16, on purpose; 64 is the smallest head_dim paged_decode takes),
        partial_rotary_factor 0.25 → rotary_dim 16, rope_theta
        1e4 (so small positions rotate visibly), zero-centered norms, attention output gate,
        8 experts top-2 of width 32 + a shared expert of width 32, norm_topk_prob, dense
        intermediate_size 128, vocab 512, 2 layers ["linear_attention", "full_attention"],
        one MTP layer, eps 1e-6, max positions 4096, bf16.

        Any field can be overridden, e.g. `ModelConfig.tiny(num_experts=0)` for a dense MLP,
        `ModelConfig.tiny(model_type="qwen3", zero_centered_norm=False, attn_output_gate=False,
        partial_rotary_factor=1.0)` for plain Qwen3. Pass `layer_types` along with a changed
        `num_hidden_layers` (or `layer_types=None` to derive it from full_attention_interval).

        Example:
            >>> ModelConfig.tiny().rotary_dim, ModelConfig.tiny(head_dim=128).rotary_dim
            (16, 32)
        """
        fields = dict(
            model_type="qwen3_next", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_hidden_layers=2, vocab_size=512, intermediate_size=128,
            rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25,
            max_position_embeddings=4096, tie_word_embeddings=False, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            norm_topk_prob=True, mtp_num_hidden_layers=1, attn_output_gate=True,
            zero_centered_norm=True, layer_types=("linear_attention", "full_attention"),
            full_attention_interval=2, torch_dtype=torch.bfloat16)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{_OP}.tiny: unknown field(s) {sorted(unknown)}")
        if "num_experts" in overrides and overrides["num_experts"] == 0:
            fields.update(num_experts_per_tok=0, moe_intermediate_size=0,
                          shared_expert_intermediate_size=0)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            fields.update(layer_types=None)
        fields.update(overrides)
        return cls(**fields)


# ---- parsing helpers ------------------------------------------------------------------------


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_OP}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{_OP}: {name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_OP}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _load_json(path_or_dict) -> dict:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError(f"{_OP}.from_hf: path_or_dict must be a path or a dict, "
                        f"got {type(path_or_dict).__name__}")
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{_OP}.from_hf: no config file at {path}")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{_OP}.from_hf: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _rope_fields(text: Mapping[str, Any], default_partial: float):
    """(rope_theta, partial_rotary_factor, mrope_section) from rope_parameters / rope_scaling /
    top-level keys; two sources stating different values is an error, not a silent pick."""
    sources = [("top level", text)]
    for key in ("rope_parameters", "rope_scaling"):
        d = text.get(key)
        if d is None:
            continue
        if not isinstance(d, Mapping):
            raise TypeError(f"{_OP}.from_hf: {key} must be a dict or null, got {type(d).__name__}")
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"{_OP}.from_hf: {key}.rope_type {rope_type!r} is not supported "
                             f"(only {', '.join(_ROPE_TYPES)}: atlas kernels implement plain RoPE)")
        sources.append((key, d))

    def pick(name, default):
        found = [(where, d[name]) for where, d in sources if d.get(name) is not None]
        if not found:
            return default
        values = {float(v) for _, v in found}
        if len(values) > 1:
            said = ", ".join(f"{where}: {v}" for where, v in found)
            raise ValueError(f"{_OP}.from_hf: {name} disagrees between {said}")
        return float(found[0][1])

    theta = pick("rope_theta", 10000.0)
    partial = pick("partial_rotary_factor", default_partial)
    sections = [d["mrope_section"] for _, d in sources if d.get("mrope_section") is not None]
    mrope = tuple(int(s) for s in sections[0]) if sections else None
    return theta, partial, mrope


def _parse_dtype(value) -> Optional[torch.dtype]:
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"{_OP}.from_hf: torch_dtype {value!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


__all__ = ["ModelConfig", "LAYER_TYPES"]
