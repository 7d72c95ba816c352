"""Synthetic Qwen3-family checkpoints in every dialect atlas loads, for tests and benchmarks.

`write_checkpoint(dir, config, dialect)` writes what a real export would: `config.json` (with the
dialect's `quantization_config`) and safetensors files (sharded with `model.safetensors.index.json`
when `shard_bytes` is set), holding random weights of the config's real shapes.

Dialects (tensor names per linear module `<m>`, DESIGN "Formats"):
    "bf16"                       <m>.weight bf16 [N, K]
    "modelopt_nvfp4"             <m>.weight uint8 [N, K/2], <m>.weight_scale e4m3 [N, K/16],
                                 <m>.weight_scale_2 f32 [] (multiplier), <m>.input_scale f32 []
    "compressed_tensors_nvfp4"   <m>.weight_packed uint8 [N, K/2], <m>.weight_scale e4m3 [N, K/16],
                                 <m>.weight_global_scale f32 [1] (divisor = 1 / global_scale)
    "fp8"                        <m>.weight e4m3 [N, K], <m>.weight_scale_inv f32 [⌈N/128⌉, ⌈K/128⌉]
Embeddings, norms, routers (`mlp.gate`, `mlp.shared_expert_gate`) and, unless asked, `lm_head`
stay BF16 in every dialect and are listed in the dialect's exclude list, as real exports do.

Every dense tensor is drawn from a generator seeded by (seed, tensor name), so `dense_weight`
regenerates the exact float weight a quantized tensor was made from: tests compare what the
loader dequantizes against quantize→dequantize of that weight.

Example:
    >>> import tempfile
    >>> d = write_checkpoint(tempfile.mkdtemp(), tiny_config(), "modelopt_nvfp4")
    >>> sorted(p.name for p in d.iterdir())
    ['config.json', 'model.safetensors']
"""
from __future__ import annotations

import copy
import fnmatch
import json
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor

from atlas import ops
from atlas.fp8 import FP8_BLOCK, quantize_fp8_block   # Qwen FP8: one float32 scale per 128 × 128 block

DIALECTS = ("bf16", "modelopt_nvfp4", "compressed_tensors_nvfp4", "fp8")

# =============================================================================================
# Configs (HF config.json dicts; field names and values as the real checkpoints ship them)
# =============================================================================================


def _layer_types(num_layers: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def qwen36_35b_a3b_config() -> dict:
    """Qwen3.6-35B-A3B (same topology as Qwen3.5-35B-A3B): VL-wrapped config, text part in
    `text_config`; hidden 2048, 40 layers (every 4th full attention), 16/2 heads of 256,
    256 experts top-8 of width 512 + one shared expert, vocab 248320, one MTP layer."""
    text = {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
        "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "attn_output_gate": True,
        "full_attention_interval": 4, "layer_types": _layer_types(40, 4),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts": 256, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "dtype": "bfloat16",
    }
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": text,
            "vision_config": {"model_type": "qwen3_5_moe", "hidden_size": 1152, "depth": 27}}


def qwen3_next_80b_a3b_config() -> dict:
    """Qwen3-Next-80B-A3B: flat config; hidden 2048, 48 layers, 16/2 heads of 256, 512 experts
    top-10 of width 512 + shared expert, vocab 151936, one MTP layer."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_theta": 10000000, "partial_rotary_factor": 0.25, "attention_bias": False,
        "full_attention_interval": 4, "layer_types": _layer_types(48, 4),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
        "norm_topk_prob": True, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    }


def qwen36_27b_config() -> dict:
    """Qwen3.6-27B: dense VL-wrapped config; hidden 5120, 64 layers, 24/4 heads of 256,
    SwiGLU 17408, vocab 248320, one MTP layer (dense FFN)."""
    text = {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "attn_output_gate": True,
        "full_attention_interval": 4, "layer_types": _layer_types(64, 4),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "dtype": "bfloat16",
    }
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": False, "text_config": text}


def tiny_config(*, layout: str = "qwen3_next", moe: bool = True) -> dict:
    """A Qwen3-Next-shaped config small enough for CPU tests: hidden 256, 4 layers (1 and 3 full
    attention), 4/2 heads of 64, vocab 1000, 8 experts top-2 of width 96 (+ shared 64) or a dense
    FFN of 320. Widths are multiples of 16 (NVFP4 blocks) but mostly not of 128, so FP8 scale
    grids have partial blocks. layout "vl" wraps it the Qwen3.5/3.6 way (`text_config`)."""
    if layout not in ("qwen3_next", "vl"):
        raise ValueError(f"tiny_config: layout must be 'qwen3_next' or 'vl', got {layout!r}")
    if layout == "qwen3_next" and not moe:
        raise ValueError("tiny_config: Qwen3-Next is always MoE; a dense tiny config uses layout='vl'")
    text = {
        "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
        "attn_output_gate": True, "full_attention_interval": 2, "layer_types": _layer_types(4, 2),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    }
    if moe:
        text.update({"moe_intermediate_size": 96, "shared_expert_intermediate_size": 64, "num_experts": 8,
                     "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                     "mlp_only_layers": [], "intermediate_size": 320})
    else:
        text["intermediate_size"] = 320
    if layout == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                "rope_theta": 10000000, "partial_rotary_factor": 0.25, "num_nextn_predict_layers": 1, **text}
    text.update({"model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", "mtp_num_hidden_layers": 1,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                     "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                     "mrope_section": [4, 2, 2]}})
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": False, "text_config": text}


def text_config(config: dict) -> dict:
    """The text-model part of an HF config dict (`text_config` of a VL-wrapped config, merged
    over the top level so top-level keys such as `tie_word_embeddings` stay visible)."""
    if isinstance(config.get("text_config"), dict):
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(config["text_config"])
        return merged
    return config


# =============================================================================================
# Module inventory: which tensors a Qwen3-family checkpoint holds, with their logical shapes
# =============================================================================================


def model_config(config):
    """atlas.ModelConfig of an HF config dict (or the ModelConfig itself)."""
    from atlas.config import ModelConfig
    return config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)


def decoder_layer_modules(cfg, prefix: str, layer_idx: int | None, *, experts: str = "per_expert",
                          attention: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{module name: (kind, logical shape)} of one decoder layer of ModelConfig `cfg` under
    `prefix` (e.g. "model.layers.3." or "mtp.layers.0."; layer_idx None = an MTP layer, MoE
    whenever the model has experts). kind: "linear" [N, K] projections, "norm" [n] vectors,
    "router" [N, K] gates, "fused_experts" stacked [E, N, K] parameters (the module name is then
    the parameter's full key)."""
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gate = 2 if cfg.attn_output_gate else 1
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        prefix + "input_layernorm": ("norm", (h,)),
        prefix + "post_attention_layernorm": ("norm", (h,)),
    }
    if attention:
        a = prefix + "self_attn."
        out.update({a + "q_proj": ("linear", (nq * hd * gate, h)), a + "k_proj": ("linear", (nkv * hd, h)),
                    a + "v_proj": ("linear", (nkv * hd, h)), a + "o_proj": ("linear", (h, nq * hd)),
                    a + "q_norm": ("norm", (hd,)), a + "k_norm": ("norm", (hd,))})
    m = prefix + "mlp."
    if cfg.is_moe if layer_idx is None else cfg.is_moe_layer(layer_idx):
        e, i, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out[m + "gate"] = ("router", (e, h))
        if si:
            out.update({m + "shared_expert.gate_proj": ("linear", (si, h)),
                        m + "shared_expert.up_proj": ("linear", (si, h)),
                        m + "shared_expert.down_proj": ("linear", (h, si)),
                        m + "shared_expert_gate": ("router", (1, h))})
        if experts == "fused":
            out.update({m + "experts.gate_up_proj": ("fused_experts", (e, 2 * i, h)),
                        m + "experts.down_proj": ("fused_experts", (e, h, i))})
        else:
            for x in range(e):
                out.update({f"{m}experts.{x}.gate_proj": ("linear", (i, h)),
                            f"{m}experts.{x}.up_proj": ("linear", (i, h)),
                            f"{m}experts.{x}.down_proj": ("linear", (h, i))})
    else:
        f = cfg.intermediate_size
        out.update({m + "gate_proj": ("linear", (f, h)), m + "up_proj": ("linear", (f, h)),
                    m + "down_proj": ("linear", (h, f))})
    return out


def mtp_modules(cfg, *, experts: str = "per_expert") -> dict[str, tuple[str, tuple[int, ...]]]:
    """The MTP branch: fc [h, 2h] (input = [normed embedding ; normed hidden]), its three norms,
    and `mtp.layers.j.` decoder layers (empty when the config has no MTP layer)."""
    h = cfg.hidden_size
    if cfg.mtp_num_hidden_layers < 1:
        return {}
    mods = {"mtp.fc": ("linear", (h, 2 * h)), "mtp.pre_fc_norm_embedding": ("norm", (h,)),
            "mtp.pre_fc_norm_hidden": ("norm", (h,)), "mtp.norm": ("norm", (h,))}
    for j in range(cfg.mtp_num_hidden_layers):
        mods.update(decoder_layer_modules(cfg, f"mtp.layers.{j}.", None, experts=experts))
    return mods


def checkpoint_modules(cfg, *, layers="mtp", experts: str = "per_expert") -> dict[str, tuple[str, tuple]]:
    """Modules `write_checkpoint` writes, in canonical (Qwen3-Next) names: "model.embed_tokens",
    "model.norm", "lm_head" (absent when tied), the MTP branch and the listed layers.
    layers: "mtp" (nothing more), "all" (every full-attention layer; GDN layers are not atlas's
    and are not written) or a list of full-attention layer indices."""
    h, v = cfg.hidden_size, cfg.vocab_size
    mods: dict[str, tuple[str, tuple]] = {"model.embed_tokens": ("embedding", (v, h)),
                                          "model.norm": ("norm", (h,))}
    if not cfg.tie_word_embeddings:
        mods["lm_head"] = ("lm_head", (v, h))
    full = list(cfg.full_attention_layers)
    if layers == "all":
        idx = full
    elif layers == "mtp":
        idx = []
    else:
        idx = [int(i) for i in layers]
        bad = [i for i in idx if i not in full]
        if bad:
            raise ValueError(f"write_checkpoint: layers {bad} are not full-attention layers (those are {full})")
    for i in idx:
        mods.update(decoder_layer_modules(cfg, f"model.layers.{i}.", i, experts=experts))
    mods.update(mtp_modules(cfg, experts=experts))
    return mods


# =============================================================================================
# Random weights and their quantization
# =============================================================================================


def _generator(seed: int, name: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def dense_weight(name: str, kind: str, shape: Sequence[int], *, seed: int = 0, device="cpu") -> Tensor:
    """The float32 weight `write_checkpoint` draws for module `name` (canonical name).

    Magnitudes as in trained Qwen3 checkpoints: projections N(0, 0.02) with a few ×8 outlier
    columns per matrix (so block scales spread over several binades), embeddings N(0, 0.02),
    zero-centered norms (scale = 1 + w) N(0, 0.1)."""
    g = _generator(seed, name, device)
    if kind == "norm":
        return torch.randn(*shape, generator=g, device=device) * 0.1
    w = torch.randn(*shape, generator=g, device=device) * 0.02
    if kind in ("linear", "fused_experts", "lm_head"):
        k = shape[-1]
        cols = torch.randint(0, k, (max(1, k // 64),), generator=g, device=device)
        w[..., cols] *= 8.0
    return w


def _linear_tensors(name: str, w: Tensor, dialect: str) -> dict[str, Tensor]:
    """One linear module's checkpoint tensors in `dialect` (keys relative to the module)."""
    if dialect == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    if dialect == "fp8":
        q = quantize_fp8_block(w)
        return {"weight": q.weight, "weight_scale_inv": q.weight_scale_inv}
    from atlas.nvfp4 import quantize_nvfp4
    q = quantize_nvfp4(w)
    if dialect == "modelopt_nvfp4":
        # input_scale (activation amax / 2688) is what W4A4 paths read; W4A16 ignores it
        return {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": q.global_scale.reshape(()),
                "input_scale": torch.tensor(8.0 / 2688.0, device=w.device)}
    # compressed-tensors stores the divisor 1 / global_scale, shape [1]
    return {"weight_packed": q.packed, "weight_scale": q.block_scale,
            "weight_global_scale": (1.0 / q.global_scale.double()).float().reshape(1)}


# =============================================================================================
# Config dialect blocks
# =============================================================================================


def _exclude_patterns(mc, keep_bf16: Sequence[str], quantize_lm_head: bool) -> list[str]:
    pats = [] if quantize_lm_head else ["lm_head"]
    pats += ["*.mlp.gate", "*.mlp.shared_expert_gate"] if mc.is_moe else []
    return pats + list(keep_bf16)


def quantization_config(dialect: str, exclude: Sequence[str]) -> dict | None:
    """The `quantization_config` block each producer writes (None for BF16)."""
    if dialect == "bf16":
        return None
    if dialect == "modelopt_nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "kv_cache_quant_algo": None, "exclude_modules": list(exclude),
                "producer": {"name": "modelopt", "version": "0.37.0"}}
    if dialect == "compressed_tensors_nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                   "strategy": "tensor_group", "dynamic": False, "observer": "minmax",
                   "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed", "kv_cache_scheme": None,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None, "output_activations": None,
                                              "format": "nvfp4-pack-quantized"}},
                "ignore": ["re:" + fnmatch.translate(p).replace("(?s:", "(?:") for p in exclude]}
    if dialect == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": list(exclude)}
    raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")


# =============================================================================================
# The writer
# =============================================================================================


def write_checkpoint(directory, config, dialect: str, *, seed: int = 0, layers="mtp",
                     shard_bytes: int | None = None, layout: str | None = None, experts: str | None = None,
                     keep_bf16: Sequence[str] = (), mtp_fc_bf16: bool = False,
                     quantize_lm_head: bool = False, device="cpu", progress: bool = False) -> Path:
    """Write a synthetic checkpoint of `config`'s shapes in `dialect`; returns the directory.

    Args:
        directory: created if missing; existing files of the same names are overwritten.
        config: HF config dict (flat Qwen3-Next style or VL-wrapped with `text_config`) or an
            `atlas.ModelConfig` (written back through its `to_hf()`/fields).
        dialect: "bf16" | "modelopt_nvfp4" | "compressed_tensors_nvfp4" | "fp8".
        seed: weights of module m are drawn from a generator seeded by (seed, m) (`dense_weight`).
        layers: "mtp" (embed_tokens, lm_head, final norm, the MTP branch), "all" (also every
            full-attention layer; GDN layers are not written) or a list of full-attention indices.
        shard_bytes: None writes one `model.safetensors`; else shards of about this many bytes
            plus `model.safetensors.index.json`.
        layout: "qwen3_next" (`model.layers.N.…`) or "vl" (`model.language_model.…`); None =
            "vl" when the config has a `text_config`, else "qwen3_next". `mtp.…` and `lm_head`
            stay top level in both.
        experts: "fused" (`mlp.experts.gate_up_proj` [E, 2I, H] gate half first,
            `mlp.experts.down_proj` [E, H, I]; BF16 only) or "per_expert"
            (`mlp.experts.{e}.gate_proj.weight` …); None = fused for a BF16 VL checkpoint, else
            per expert.
        keep_bf16: fnmatch patterns of modules (canonical names, e.g. "mtp.layers.0.*") written
            BF16 and listed in the exclude list.
        mtp_fc_bf16: write `mtp.fc` BF16 without listing it (the incomplete-exclude case of
            NVIDIA's NVFP4 exports).
        quantize_lm_head: quantize lm_head too (default: BF16, excluded).
        device: where weights are drawn and quantized ("cuda" uses the quantize kernel).
        progress: show a tqdm bar.
    Raises:
        ValueError: unknown dialect/layout/experts, fused experts in a quantized dialect, or a
            layer index that is not a full-attention layer.
    """
    if dialect not in DIALECTS:
        raise ValueError(f"write_checkpoint: dialect must be one of {DIALECTS}, got {dialect!r}")
    cfg = _config_dict(config)
    mc = model_config(config)
    layout = layout or ("vl" if "text_config" in cfg else "qwen3_next")
    if layout not in ("qwen3_next", "vl"):
        raise ValueError(f"write_checkpoint: layout must be 'qwen3_next' or 'vl', got {layout!r}")
    experts = experts or ("fused" if layout == "vl" and dialect == "bf16" else "per_expert")
    if experts not in ("fused", "per_expert"):
        raise ValueError(f"write_checkpoint: experts must be 'fused' or 'per_expert', got {experts!r}")
    if experts == "fused" and dialect != "bf16":
        raise ValueError(f"write_checkpoint: fused experts exist only in BF16 checkpoints, got dialect {dialect!r}")

    exclude = _exclude_patterns(mc, keep_bf16, quantize_lm_head)
    cfg = copy.deepcopy(cfg)
    qc = quantization_config(dialect, exclude)
    if qc is not None:
        cfg["quantization_config"] = qc
    else:
        cfg.pop("quantization_config", None)

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    mods = checkpoint_modules(mc, layers=layers, experts=experts)

    def stored(name: str) -> str:
        if layout == "vl" and name.startswith("model."):
            return "model.language_model." + name[len("model."):]
        return name

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for name, (kind, shape) in mods.items():
            w = dense_weight(name, kind, shape, seed=seed, device=device)
            if kind == "fused_experts":        # the module name is the parameter's key
                yield stored(name), w.to(torch.bfloat16)
                continue
            quantized = kind == "linear" or (kind == "lm_head" and quantize_lm_head)
            bf16 = (dialect == "bf16" or not quantized or any(fnmatch.fnmatchcase(name, p) for p in keep_bf16)
                    or (mtp_fc_bf16 and name == "mtp.fc"))
            for suffix, t in _linear_tensors(name, w, "bf16" if bf16 else dialect).items():
                yield f"{stored(name)}.{suffix}", t

    _write_safetensors(out, tensors(), shard_bytes, total=len(mods), progress=progress)
    return out


def _config_dict(config) -> dict:
    """HF config dict of `config` (a dict, or a ModelConfig: its parsed `raw` dict, else its
    fields written flat under their HF names)."""
    if isinstance(config, dict):
        return config
    import dataclasses
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"write_checkpoint: config must be a dict or ModelConfig, got {type(config).__name__}")
    if getattr(config, "raw", None):
        return dict(config.raw)
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name == "raw" or v is None:
            continue
        if isinstance(v, torch.dtype):
            f_name, v = "torch_dtype", str(v).replace("torch.", "")
            out[f_name] = v
            continue
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _write_safetensors(out: Path, tensors: Iterator[tuple[str, Tensor]], shard_bytes: int | None,
                       *, total: int, progress: bool) -> None:
    """Stream (key, tensor) pairs into `model.safetensors`, or, with shard_bytes, into shards of
    about that size named as HF does (`model-0000i-of-0000n.safetensors`) plus
    `model.safetensors.index.json`. A module's tensors never straddle two shards; only one
    shard is held in memory at a time."""
    from safetensors.torch import save_file
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="writing checkpoint", unit="module")
    part: dict[str, Tensor] = {}
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = "model.safetensors" if shard_bytes is None else f"model-{len(files) + 1:05d}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in part.items()}, str(out / name),
                  metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(part, name))
        part.clear()

    part_bytes = total_bytes = 0
    last_module = None
    for key, t in tensors:
        module = key.rsplit(".", 1)[0]
        if shard_bytes is not None and part and part_bytes >= shard_bytes and module != last_module:
            flush()
            part_bytes = 0
        part[key] = t
        part_bytes += t.numel() * t.element_size()
        total_bytes += t.numel() * t.element_size()
        if bar is not None and module != last_module:
            bar.update(1)
        last_module = module
    if part:
        flush()
    if bar is not None:
        bar.close()
    if shard_bytes is None:
        return
    final = {name: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, name in enumerate(files)}
    for name, new in final.items():
        (out / name).rename(out / new)
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# =============================================================================================
# Stand-ins for A/B runs
# =============================================================================================

_paged_decode = ops.paged_decode   # the real op, even while a test or bench patches ops.paged_decode


def paged_decode_gate_as_own_launch(*args, gate: Tensor | None = None, **kw):
    """ops.paged_decode with its output gate applied afterwards by ops.sigmoid_gate_mul (two
    launches): what a gated paged_decode must equal bit for bit (tests), and the attention layer's
    routing before the gate moved into paged_decode (bench_attention_layer's A/B). Same arguments
    and returns as ops.paged_decode."""
    res = _paged_decode(*args, **kw)
    if gate is None:
        return res
    out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    nq, hd = out.shape[-2:]
    out = ops.sigmoid_gate_mul(out.reshape(-1, nq, hd), gate.reshape(-1, nq, hd)).view(out.shape)
    return (out, *rest) if rest else out
