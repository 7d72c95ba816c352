"""Checkpoint loading: safetensors (memory-mapped, tensor by tensor), dialect detection, validation.

A Qwen3-family checkpoint directory holds `config.json` and one `*.safetensors` file or shards
listed in `model.safetensors.index.json`. What this module handles:

Key layouts (both map onto one canonical naming, the Qwen3-Next one):
    Qwen3-Next      model.embed_tokens / model.layers.N.… / model.norm / lm_head / mtp.…
    Qwen3.5/3.6 VL  model.language_model.embed_tokens / model.language_model.layers.N.… /
                    model.language_model.norm / lm_head / mtp.… (top level); model.visual.… → visual.…
Experts: fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate half first) + `mlp.experts.down_proj`
[E, H, I] (BF16), or per expert `mlp.experts.{e}.{gate,up,down}_proj.…` in any dialect.
Weight dialects, detected per module from its keys (DESIGN "Formats"):
    bf16                      weight float [N, K]
    modelopt_nvfp4            weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32 (×)
    compressed_tensors_nvfp4  weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16],
                              weight_global_scale f32 (÷)
    fp8                       weight e4m3 [N, K], weight_scale_inv f32 [⌈N/128⌉, ⌈K/128⌉]
The checkpoint's dialect comes from `quantization_config` (or `hf_quant_config.json`), else from
tensor names. A module that an incomplete exclude list left unquantized (e.g. a BF16 `mtp.fc`
in an NVFP4 export) loads as what it is; any other mix of dialects is an error.

`load_state_dict` returns raw tensors by HF name (layers convert them: NVFP4 tensors become
`NVFP4Weight` in the layer's `from_state_dict`). Everything is validated before it is returned —
dtypes and shapes against the config, scales finite (global scales also non-zero), weights
finite — and any failure raises `CheckpointError` naming the key and the file. Nothing
half-loaded is ever returned.

Example:
    >>> import tempfile, atlas.testing as T
    >>> d = T.write_checkpoint(tempfile.mkdtemp(), T.tiny_config(), "modelopt_nvfp4")
    >>> sd = load_state_dict(d, "mtp.layers.0.self_attn.")
    >>> sd["mtp.layers.0.self_attn.q_proj.weight"].dtype, tuple(sd["mtp.layers.0.self_attn.q_proj.weight"].shape)
    (torch.uint8, (512, 128))
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import Tensor

from atlas.testing import DIALECTS, FP8_BLOCK, decoder_layer_modules, mtp_modules, text_config

__all__ = ["CheckpointError", "Checkpoint", "open_checkpoint", "load_state_dict", "detect_dialect",
           "load_mtp_head", "load_attention_layer", "DIALECTS"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing or malformed tensors, bad scales, unreadable
    files. The message names the key and the file."""


_ST_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
              "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
              "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
              "F8_E5M2": torch.float8_e5m2}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SCALARS = (torch.float32, torch.bfloat16, torch.float16)
_VL_TEXT = "model.language_model."
_FUSED_EXPERTS = re.compile(r"^(?P<module>.*\.experts\.(?:gate_up_proj|down_proj))(?P<param>_[a-z_0-9]+)?$")
_LAYER = re.compile(r"^(model|mtp)\.layers\.\d+\.")
_PROGRESS_BYTES = 1 << 30   # show a progress bar for loads above 1 GiB


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


# =============================================================================================
# Dialect detection
# =============================================================================================


def detect_dialect(config: dict, keys, *, hf_quant_config: dict | None = None) -> str:
    """Checkpoint-level dialect: from `quantization_config` (modelopt / compressed-tensors
    "nvfp4-pack-quantized" / fp8 128×128 blocks), else ModelOpt's legacy `hf_quant_config.json`,
    else tensor names (`.weight_packed` → compressed-tensors, `.weight_scale_2` → ModelOpt,
    `.weight_scale_inv` → FP8), else "bf16". Unsupported quantization methods raise."""
    keys = list(keys)
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
    if qc:
        method = str(qc.get("quant_method", "")).lower()
        if method == "modelopt":
            algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
            # no algo stated (or MIXED_PRECISION): NVFP4 if the tensors say so; per-module checks
            # then reject any module in another ModelOpt format
            if algo == "NVFP4" or (algo in ("", "MIXED_PRECISION")
                                   and any(k.endswith(".weight_scale_2") for k in keys)):
                return "modelopt_nvfp4"
            raise CheckpointError(f"quantization_config: ModelOpt quant_algo {algo or None!r} is not supported "
                                  "(atlas loads NVFP4, Qwen FP8 block-scaled and BF16)")
        if method == "compressed-tensors":
            formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                            if isinstance(g, dict)}
            formats.discard(None)
            if formats != {"nvfp4-pack-quantized"}:
                raise CheckpointError(f"quantization_config: compressed-tensors format {sorted(formats)} is not "
                                      "supported (atlas loads 'nvfp4-pack-quantized')")
            return "compressed_tensors_nvfp4"
        if method == "fp8":
            block = list(qc.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
            if block != [FP8_BLOCK, FP8_BLOCK]:
                raise CheckpointError(f"quantization_config: fp8 weight_block_size {block} is not supported "
                                      f"(atlas loads {FP8_BLOCK}×{FP8_BLOCK} blocks)")
            return "fp8"
        raise CheckpointError(f"quantization_config: quant_method {method!r} is not supported "
                              "(supported: modelopt NVFP4, compressed-tensors NVFP4, fp8)")
    if hf_quant_config:
        algo = str((hf_quant_config.get("quantization") or {}).get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "modelopt_nvfp4"
        if algo:
            raise CheckpointError(f"hf_quant_config.json: quant_algo {algo!r} is not supported")
    if any(k.endswith(".weight_packed") for k in keys):
        return "compressed_tensors_nvfp4"
    if any(k.endswith(".weight_scale_2") for k in keys):
        return "modelopt_nvfp4"
    if any(k.endswith(".weight_scale_inv") for k in keys):
        return "fp8"
    return "bf16"


def _module_dialect(params: dict, dtype_of=None) -> str:
    """Dialect of one module from the names of its parameters (never from the config); a
    module that lost its distinguishing scale is still recognised by its weight dtype
    (`dtype_of(param) -> torch.dtype`), so the message can say which tensor is missing."""
    if "weight_packed" in params or "weight_global_scale" in params:
        return "compressed_tensors_nvfp4"
    if "weight_scale_2" in params:
        return "modelopt_nvfp4"
    if "weight_scale_inv" in params:
        return "fp8"
    w = dtype_of("weight") if dtype_of is not None and "weight" in params else None
    if w == torch.uint8 or (w is None and "weight_scale" in params):
        return "modelopt_nvfp4"
    if w == torch.float8_e4m3fn:
        return "fp8"
    return "bf16"


_REQUIRED = {"bf16": ("weight",), "modelopt_nvfp4": ("weight", "weight_scale", "weight_scale_2"),
             "compressed_tensors_nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
             "fp8": ("weight", "weight_scale_inv")}
# KV-cache scales ride on k_proj / v_proj (ModelOpt), also when the projections stay unquantized
_OPTIONAL = {"bf16": ("bias", "k_scale", "v_scale"),
             "modelopt_nvfp4": ("input_scale", "bias", "k_scale", "v_scale"),
             "compressed_tensors_nvfp4": ("input_global_scale", "bias", "k_scale", "v_scale"),
             "fp8": ("bias", "k_scale", "v_scale")}


# =============================================================================================
# The checkpoint
# =============================================================================================


class Checkpoint:
    """An opened checkpoint directory: config, dialect, key layout and a key → file map read
    from the safetensors headers (no tensor data is read until `load`).

    Attributes:
        path: the directory.
        config: config.json as a dict; `text_config` its text part (VL configs unwrapped).
        dialect: "bf16" | "modelopt_nvfp4" | "compressed_tensors_nvfp4" | "fp8".
        layout: "qwen3_next" or "vl" (language model under `model.language_model.`).
    Raises:
        CheckpointError: no config.json, unreadable/truncated safetensors, an index naming a
            missing file or key, an unsupported quantization method.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint: {self.path} is not a directory")
        self.config = _read_json(self.path / "config.json")
        self.text_config = text_config(self.config)
        self._meta: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}   # stored key → (file, dtype, shape)
        self._read_headers()
        self.layout = "vl" if any(k.startswith(_VL_TEXT) for k in self._meta) else "qwen3_next"
        self._canon = {self._canonical_stored(k): k for k in self._meta}               # canonical → stored
        hq = self.path / "hf_quant_config.json"
        self.dialect = detect_dialect(self.config, self._meta,
                                      hf_quant_config=_read_json(hq) if hq.exists() else None)
        self._model_config = None
        self._expected = None
        # "model.layers.N." / "mtp.layers.N." prefixes of the decoder layers the files hold
        self._present_layers = {m.group(0) for k in self._canon if (m := _LAYER.match(k))}

    # ---- files ----------------------------------------------------------------------------
    def _read_headers(self) -> None:
        from safetensors import safe_open
        index_file = self.path / "model.safetensors.index.json"
        listed: dict[str, str] = {}
        if index_file.exists():
            listed = _read_json(index_file).get("weight_map") or {}
            if not isinstance(listed, dict) or not listed:
                raise CheckpointError(f"checkpoint: {index_file} has no weight_map")
            files = sorted(set(listed.values()))
            for f in files:
                if not (self.path / f).is_file():
                    first = next(k for k, v in listed.items() if v == f)
                    raise CheckpointError(f"checkpoint: {f} (holding e.g. '{first}') is listed in "
                                          f"{index_file.name} but missing from {self.path}")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"checkpoint: no *.safetensors files in {self.path}")
        for f in files:
            try:
                with safe_open(str(self.path / f), framework="pt", device="cpu") as h:
                    for k in h.keys():
                        if listed and listed.get(k) != f:
                            continue            # the index is the authority on which copy to use
                        if k in self._meta:
                            raise CheckpointError(f"checkpoint: '{k}' is in both {self._meta[k][0]} and {f} "
                                                  "(and no model.safetensors.index.json says which to use)")
                        sl = h.get_slice(k)
                        st = sl.get_dtype()
                        if st not in _ST_DTYPES:
                            raise CheckpointError(f"'{k}' in {f}: unsupported safetensors dtype {st}")
                        self._meta[k] = (f, _ST_DTYPES[st], tuple(sl.get_shape()))
            except CheckpointError:
                raise
            except Exception as e:  # truncated or corrupt header: safetensors refuses to open it
                raise CheckpointError(f"checkpoint: cannot read {self.path / f}: {e} "
                                      "(truncated or corrupt safetensors file?)") from e
        missing = [k for k in listed if k not in self._meta]
        if missing:
            raise CheckpointError(f"checkpoint: '{missing[0]}' is listed in model.safetensors.index.json for "
                                  f"{listed[missing[0]]} but that file does not hold it "
                                  f"({len(missing)} such keys)")

    # ---- names ----------------------------------------------------------------------------
    def _canonical(self, name: str) -> str:
        """Caller-spelled name or prefix → canonical Qwen3-Next name."""
        if name.startswith(_VL_TEXT):
            return "model." + name[len(_VL_TEXT):]
        return name

    def _canonical_stored(self, key: str) -> str:
        """Stored key → canonical name; a VL checkpoint's non-text `model.visual.…` → `visual.…`."""
        if self.layout == "vl" and key.startswith("model.") and not key.startswith(_VL_TEXT):
            return key[len("model."):]
        return self._canonical(key)

    def _stored(self, canonical: str) -> str:
        return self._canon.get(canonical, canonical)

    def where(self, canonical_key: str) -> str:
        """"'<stored key>' in <file>" for messages."""
        stored = self._stored(canonical_key)
        f = self._meta.get(stored, ("?",))[0]
        return f"'{stored}' in {f}"

    def keys(self, prefix: str = "") -> list[str]:
        """Canonical keys under `prefix` (either spelling of the prefix is accepted)."""
        p = self._canonical(prefix)
        return sorted(k for k in self._canon if k.startswith(p))

    @property
    def model_config(self):
        """atlas.ModelConfig of config.json."""
        if self._model_config is None:
            from atlas.config import ModelConfig
            try:
                self._model_config = ModelConfig.from_hf(self.config)
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"checkpoint: {self.path / 'config.json'}: {e}") from e
        return self._model_config

    def nbytes(self, prefix: str = "") -> int:
        """Bytes stored under `prefix` (from the headers)."""
        return self._nbytes(self.keys(prefix))

    # ---- the well-known modules -----------------------------------------------------------
    def embedding_key(self) -> str:
        """Canonical key of the token embedding table [V, h] ("model.embed_tokens.weight")."""
        return self._require("model.embed_tokens.weight", "token embedding")

    def final_norm_key(self) -> str:
        """Canonical key of the final norm weight [h] ("model.norm.weight")."""
        return self._require("model.norm.weight", "final norm")

    def lm_head_prefix(self) -> str:
        """"lm_head." — or "model.embed_tokens." when the config ties the embeddings and the
        checkpoint has no lm_head."""
        if any(k.startswith("lm_head.") for k in self._canon):
            return "lm_head."
        if self.model_config.tie_word_embeddings:
            return "model.embed_tokens."
        raise CheckpointError(f"checkpoint: no 'lm_head.weight' in {self.path} and tie_word_embeddings is false")

    def _require(self, key: str, what: str) -> str:
        if key not in self._canon:
            alt = _VL_TEXT + key[len("model."):] if key.startswith("model.") else key
            raise CheckpointError(f"checkpoint: missing {what} '{key}' (or '{alt}') in {self.path}")
        return key

    def embedding(self, device="cpu") -> Tensor:
        """The embedding table, float [V, h] (as stored: BF16 in every supported dialect)."""
        return self.load(self.embedding_key(), device=device)[self.embedding_key()]

    def lm_head(self, device="cpu"):
        """The LM head as the model's layers take it: a float Tensor [V, h] for BF16, an
        `NVFP4Weight` for NVFP4, an `atlas.fp8.FP8BlockWeight` for FP8."""
        prefix = self.lm_head_prefix()
        sd = self.load(prefix, device=device)
        return weight_from_state_dict(sd, prefix)

    # ---- expectations ---------------------------------------------------------------------
    def expected_modules(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{canonical module: (kind, logical shape)} from the ModelConfig, for every module
        atlas knows the shape of: embedding, final norm, lm_head, the MTP branch and every
        decoder layer's norms, MLP and (full-attention layers) self_attn. GDN `linear_attn`
        modules pass through with dialect and scale checks only. Computed once (Qwen3-Next-80B
        has ~75 k expert modules; per-layer loads must not rebuild it)."""
        if self._expected is None:
            self._expected = self._build_expected()
        return self._expected

    def _build_expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        cfg = self.model_config
        h, v = cfg.hidden_size, cfg.vocab_size
        mods = {"model.embed_tokens": ("embedding", (v, h)), "model.norm": ("norm", (h,))}
        if not cfg.tie_word_embeddings or "lm_head.weight" in self._canon:
            mods["lm_head"] = ("lm_head", (v, h))
        full = set(cfg.full_attention_layers)

        def experts(prefix: str) -> str:
            return "fused" if f"{prefix}mlp.experts.gate_up_proj" in self._canon or \
                f"{prefix}mlp.experts.down_proj" in self._canon else "per_expert"

        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            mods.update(decoder_layer_modules(cfg, p, i, experts=experts(p), attention=i in full))
        mods.update(mtp_modules(cfg, experts=experts("mtp.layers.0.")))
        return mods

    # ---- loading --------------------------------------------------------------------------
    def load(self, prefix: str, *, device="cpu", progress: bool | None = None) -> dict[str, Tensor]:
        """Every tensor under `prefix`, validated, keyed `prefix + rest` in the caller's spelling.

        Args:
            prefix: e.g. "mtp.", "model.layers.3.self_attn.", "lm_head." or a full key; the VL
                spelling ("model.language_model.layers.3.") works too.
            device: where the tensors go (read from the memory-mapped file, then copied).
            progress: tqdm bar; None = only for loads above 1 GiB.
        Raises:
            CheckpointError: nothing under prefix, a missing module tensor, a wrong dtype or
                shape, a zero/non-finite global scale, a NaN/negative block scale, a non-finite
                weight, an unreadable file.
        """
        canon_prefix = self._canonical(prefix)
        keys = self.keys(prefix)
        groups = _group(keys)
        expected = self.expected_modules()
        self._check_missing(canon_prefix, groups, expected)   # names the first missing tensor
        if not keys:
            raise CheckpointError(f"checkpoint: no tensors under prefix '{prefix}' in {self.path}")
        for module, params in groups.items():           # dtype / shape checks from the headers alone
            self._check_meta(module, params, expected.get(module))
        out_canon = self._read(keys, device, progress)
        for module, params in groups.items():
            self._check_values(module, params, out_canon)
        return {prefix + k[len(canon_prefix):]: out_canon[k] for k in keys}

    def _read(self, keys: list[str], device, progress: bool | None) -> dict[str, Tensor]:
        """Tensors of `keys` (canonical), file by file from the memory-mapped safetensors."""
        from safetensors import safe_open
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self._meta[self._stored(k)][0], []).append(k)
        show = progress if progress is not None else self._nbytes(keys) > _PROGRESS_BYTES
        bar = None
        if show:
            from tqdm import tqdm
            bar = tqdm(total=len(keys), desc=f"loading {self.path.name}", unit="tensor")
        out: dict[str, Tensor] = {}
        try:
            for f, ks in by_file.items():
                try:
                    handle = safe_open(str(self.path / f), framework="pt", device="cpu")
                except Exception as e:
                    raise CheckpointError(f"checkpoint: cannot open {self.path / f}: {e}") from e
                with handle as h:
                    for k in ks:
                        try:
                            out[k] = h.get_tensor(self._stored(k)).to(device)
                        except Exception as e:
                            raise CheckpointError(f"checkpoint: cannot read {self.where(k)}: {e}") from e
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return out

    def _nbytes(self, keys) -> int:
        total = 0
        for k in keys:
            _, dt, shape = self._meta[self._stored(k)]
            total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
        return total

    # ---- validation -----------------------------------------------------------------------
    def _check_missing(self, prefix: str, groups: dict, expected: dict) -> None:
        """Every expected module under prefix must be complete. A decoder layer counts as
        expected when the checkpoint holds any key of it, when the prefix lies inside it, or
        when it is an MTP layer (a checkpoint may carry only some layers of the main model)."""
        for module, (kind, _) in expected.items():
            inside = module.startswith(prefix) or prefix.startswith(module + ".") or prefix == module
            if not inside:
                continue
            layer = _LAYER.match(module)
            if layer and not (layer.group(0) in self._present_layers or prefix.startswith(layer.group(0))
                              or layer.group(1) == "mtp"):
                continue
            if kind == "fused_experts":
                if module not in self._canon:
                    raise CheckpointError(f"checkpoint: missing '{self._stored_name(module)}' in {self.path}")
                continue
            params = groups.get(module, {})
            if not params:
                raise CheckpointError(f"checkpoint: missing '{self._stored_name(module + '.weight')}' "
                                      f"({kind} of shape {list(expected[module][1])}) in {self.path}")

    def _stored_name(self, canonical: str) -> str:
        if self.layout == "vl" and canonical.startswith("model."):
            return _VL_TEXT + canonical[len("model."):]
        return canonical

    def _check_meta(self, module: str, params: dict[str, str], expect) -> None:
        kind, shape = expect if expect is not None else (None, None)
        meta = {p: self._meta[self._stored(k)] for p, k in params.items()}
        first = next(iter(params.values()))
        if kind == "fused_experts":
            if set(params) != {""}:
                extra = next(p for p in params if p)
                raise CheckpointError(f"{self.where(params[extra])}: quantized fused experts are not supported "
                                      "(atlas loads fused experts in BF16, quantized experts per expert)")
            self._expect(params[""], meta[""], _FLOATS, shape)
            return
        if kind in ("norm", "embedding"):
            if set(params) != {"weight"}:
                odd = next(p for p in params if p != "weight")
                raise CheckpointError(f"{self.where(params[odd])}: a {kind} holds only 'weight', "
                                      f"found '{odd}'")
            self._expect(params["weight"], meta["weight"], _FLOATS, shape)
            return
        if not any(p.startswith("weight") for p in params):
            return                                            # e.g. a bare bias or k_scale: pass through
        dialect = _module_dialect(params, lambda p: meta[p][1])
        if dialect not in (self.dialect, "bf16"):
            raise CheckpointError(f"{self.where(first)}: module is {dialect} but the checkpoint is {self.dialect} "
                                  "(mixed quantization dialects are not supported)")
        for p in _REQUIRED[dialect]:
            if p not in params:
                raise CheckpointError(f"checkpoint: missing '{self._stored_name(module + '.' + p)}' "
                                      f"({dialect} module {module}) in {self.path}")
        for p in params:
            if p not in _REQUIRED[dialect] + _OPTIONAL[dialect]:
                raise CheckpointError(f"{self.where(params[p])}: unexpected tensor '{p}' for a {dialect} module")
        w_key = params["weight_packed" if dialect == "compressed_tensors_nvfp4" else "weight"]
        w_meta = meta["weight_packed" if dialect == "compressed_tensors_nvfp4" else "weight"]
        if shape is None:              # unknown module: infer its logical shape from the weight itself
            ws = w_meta[2]
            if len(ws) != 2:
                return
            shape = (ws[0], ws[1] * 2) if dialect.endswith("nvfp4") else ws
        n, k = shape
        if dialect == "bf16":
            self._expect(w_key, w_meta, _FLOATS, (n, k))
        elif dialect == "fp8":
            self._expect(w_key, w_meta, (torch.float8_e4m3fn,), (n, k))
            self._expect(params["weight_scale_inv"], meta["weight_scale_inv"], _SCALARS,
                         (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)))
        else:
            if k % 16:
                raise CheckpointError(f"{self.where(w_key)}: NVFP4 needs K % 16 == 0, module K = {k}")
            self._expect(w_key, w_meta, (torch.uint8,), (n, k // 2))
            self._expect(params["weight_scale"], meta["weight_scale"], (torch.float8_e4m3fn,), (n, k // 16))
            gs = "weight_scale_2" if dialect == "modelopt_nvfp4" else "weight_global_scale"
            self._expect(params[gs], meta[gs], _SCALARS, None, scalar=True)
        for p in ("input_scale", "input_global_scale", "k_scale", "v_scale"):
            if p in params:
                self._expect(params[p], meta[p], _SCALARS, None, scalar=True)

    def _expect(self, key: str, meta, dtypes, shape, *, scalar: bool = False) -> None:
        _, dt, got = meta
        if dt not in dtypes:
            want = " or ".join(_dt(d) for d in dtypes)
            raise CheckpointError(f"{self.where(key)}: dtype must be {want}, got {_dt(dt)} {list(got)}")
        if scalar and math.prod(got) != 1:
            raise CheckpointError(f"{self.where(key)}: must be a scalar ([] or [1]), got shape {list(got)}")
        if shape is not None and tuple(got) != tuple(shape):
            raise CheckpointError(f"{self.where(key)}: shape must be {list(shape)} (from config.json), "
                                  f"got {list(got)}")

    def _check_values(self, module: str, params: dict[str, str], tensors: dict[str, Tensor]) -> None:
        """Scales: global scales finite and non-zero, block scales not NaN or negative, FP8 block
        scales finite and positive. Float weights finite; FP8 weights free of NaN codes."""
        for p, key in params.items():
            t = tensors[key]
            if p in ("weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale"):
                v = float(t.reshape(-1)[0])         # load time: a host read is fine
                if not math.isfinite(v) or v == 0.0:
                    raise CheckpointError(f"{self.where(key)}: scale must be finite and non-zero, got {v}")
            elif p == "weight_scale_inv":
                bad = ~torch.isfinite(t.float()) | (t.float() <= 0)
                if bool(bad.any()):
                    v = t.float()[bad][0].item()
                    raise CheckpointError(f"{self.where(key)}: FP8 block scales must be finite and positive, "
                                          f"found {v} ({int(bad.sum())} bad)")
            elif t.dtype == torch.float8_e4m3fn:
                b = t.view(torch.uint8)
                nan = (b & 0x7F) == 0x7F
                if bool(nan.any()):
                    what = "block scale" if p == "weight_scale" else "FP8 weight"
                    raise CheckpointError(f"{self.where(key)}: {int(nan.sum())} NaN {what} value(s)")
                if p == "weight_scale" and bool((((b & 0x80) != 0) & ((b & 0x7F) != 0)).any()):
                    raise CheckpointError(f"{self.where(key)}: negative block scale(s)")
            elif t.is_floating_point():
                if not bool(torch.isfinite(t).all()):
                    raise CheckpointError(f"{self.where(key)}: non-finite values (NaN or Inf)")


def _group(keys: list[str]) -> dict[str, dict[str, str]]:
    """Canonical keys → {module: {param: key}}. Fused expert parameters are modules of their
    own (param "" for the tensor, "_scale_inv" etc. for any companions)."""
    groups: dict[str, dict[str, str]] = {}
    for k in keys:
        m = _FUSED_EXPERTS.match(k)
        if m:
            module, param = m.group("module"), m.group("param") or ""
        elif "." in k:
            module, param = k.rsplit(".", 1)
        else:
            module, param = k, ""
        groups.setdefault(module, {})[param] = k
    return groups


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint: missing {path.name} in {path.parent}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint: {path} is not valid JSON: {e}") from e


# =============================================================================================
# Public entry points
# =============================================================================================


def open_checkpoint(path) -> Checkpoint:
    """Open (headers only) a checkpoint directory. Raises CheckpointError."""
    return path if isinstance(path, Checkpoint) else Checkpoint(path)


def load_state_dict(path, prefix: str, *, device="cpu", progress: bool | None = None) -> dict[str, Tensor]:
    """Raw tensors under `prefix` by HF name, validated (see `Checkpoint.load`).

    Args:
        path: checkpoint directory (or an open `Checkpoint`).
        prefix: "mtp.", "model.layers.3.self_attn.", … (Qwen3-Next spelling also finds VL keys;
            returned keys keep the caller's spelling).
        device: target device of every tensor.
    Returns:
        {key: Tensor} in the dtypes stored (uint8 packed NVFP4, e4m3 scales/FP8, bf16, f32).
    Raises:
        CheckpointError (a ValueError) naming the key and file.
    """
    return open_checkpoint(path).load(prefix, device=device, progress=progress)


def weight_from_state_dict(sd: dict[str, Tensor], prefix: str):
    """The weight of one linear module under `prefix` ("lm_head.", "mtp.fc.") as a container:
    float Tensor [N, K] (BF16), NVFP4Weight (either NVFP4 dialect) or FP8BlockWeight (FP8)."""
    params = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
    if not params:
        raise KeyError(f"weight_from_state_dict: no tensors under '{prefix}'")
    dialect = _module_dialect(params, lambda p: params[p].dtype)
    if dialect == "bf16":
        return params["weight"]
    if dialect == "fp8":
        from atlas.fp8 import FP8BlockWeight
        return FP8BlockWeight(params["weight"], params["weight_scale_inv"].float())
    from atlas.nvfp4 import NVFP4Weight
    if dialect == "modelopt_nvfp4":
        return NVFP4Weight.from_modelopt(params["weight"], params["weight_scale"], params["weight_scale_2"])
    return NVFP4Weight.from_compressed_tensors(params["weight_packed"], params["weight_scale"],
                                               params["weight_global_scale"])


def dequantized_weight(sd: dict[str, Tensor], prefix: str) -> Tensor:
    """float32 [N, K] of one linear module's weight in any dialect (tests, conversions)."""
    params = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
    if not params:
        raise KeyError(f"weight_from_state_dict: no tensors under '{prefix}'")
    dialect = _module_dialect(params, lambda p: params[p].dtype)
    if dialect == "bf16":
        return params["weight"].float()
    return weight_from_state_dict(sd, prefix).dequantize(torch.float32)


def load_mtp_head(path, *, weight_format: str, kv_dtype=torch.bfloat16, max_seq_len: int, max_seqs: int,
                  mtp_vocab_size: int = 0, device="cuda", progress: bool | None = None):
    """`atlas.MtpHead` from a checkpoint directory: the `mtp.` tensors plus the shared embedding
    and LM head (`MtpHead.from_pretrained` delegates here).

    Args:
        weight_format: "bf16" | "fp8" | "nvfp4", what the projections run in (converted at load).
        kv_dtype: drafter KV cache dtype (torch.bfloat16 or torch.float8_e4m3fn).
        max_seq_len, max_seqs: drafter KV capacity.
        mtp_vocab_size: LM-head rows the drafter scores (0 = full vocab).
    Raises:
        CheckpointError: the checkpoint has no MTP layer or a malformed tensor.
    """
    from atlas.layers.mtp import MtpHead
    ckpt = open_checkpoint(path)
    if ckpt.model_config.mtp_num_hidden_layers < 1:
        raise CheckpointError(f"load_mtp_head: {ckpt.path}/config.json declares no MTP layer "
                              "(mtp_num_hidden_layers / num_nextn_predict_layers)")
    sd = ckpt.load("mtp.", device=device, progress=progress)
    embed = ckpt.embedding(device).to(torch.bfloat16)
    lm_head = ckpt.lm_head(device)
    if not isinstance(lm_head, Tensor) and type(lm_head).__name__ != "NVFP4Weight":
        lm_head = lm_head.dequantize(torch.bfloat16)      # an FP8 LM head runs as BF16 (MtpHead takes bf16 | NVFP4)
    elif isinstance(lm_head, Tensor):
        lm_head = lm_head.to(torch.bfloat16)
    return MtpHead.from_state_dict(ckpt.model_config, sd, embed, lm_head, weight_format, kv_dtype, max_seq_len,
                                   max_seqs, mtp_vocab_size=mtp_vocab_size, device=device)


def load_attention_layer(path, layer_idx: int, *, weight_format: str, device="cuda"):
    """`atlas.Qwen3AttentionLayer` of full-attention layer `layer_idx` (its `self_attn.` tensors;
    `Qwen3AttentionLayer.from_pretrained` delegates here).
    Raises CheckpointError when layer_idx is not a full-attention layer or a tensor is malformed."""
    from atlas.layers.attention import Qwen3AttentionLayer
    ckpt = open_checkpoint(path)
    full = list(ckpt.model_config.full_attention_layers)
    if layer_idx not in full:
        raise CheckpointError(f"load_attention_layer: layer_idx {layer_idx} is not a full-attention layer "
                              f"of {ckpt.path} (those are {full})")
    prefix = f"model.layers.{layer_idx}.self_attn."
    sd = ckpt.load(prefix, device=device)
    return Qwen3AttentionLayer.from_state_dict(ckpt.model_config, sd, prefix, weight_format, device)
