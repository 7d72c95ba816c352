"""atlas: CUDA kernels and layers for Qwen3-family decode and speculative decoding.

Public names (see ../shared/DESIGN.md): kernels_available, quantize_nvfp4, dequantize_nvfp4,
NVFP4Weight, ModelConfig, PagedKvCache, AttentionMetadata, Qwen3AttentionLayer, MtpHead, ops.
Heavier modules load on first use, so `import atlas` stays cheap.
"""
from __future__ import annotations

import importlib

from atlas._ext import kernels_available

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    "ops": "atlas.ops",
    "reference": "atlas.reference",
    "NVFP4Weight": "atlas.nvfp4",
    "quantize_nvfp4": "atlas.nvfp4",
    "dequantize_nvfp4": "atlas.nvfp4",
    "FP8BlockWeight": "atlas.fp8",
    "ModelConfig": "atlas.config",
    "PagedKvCache": "atlas.kv_cache",
    "AttentionMetadata": "atlas.kv_cache",
    "KvCacheExhausted": "atlas.kv_cache",
    "Qwen3AttentionLayer": "atlas.layers.attention",
    "MtpHead": "atlas.layers.mtp",
    "testing": "atlas.testing",
    "checkpoint": "atlas.checkpoint",
}

__all__ = ["kernels_available", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'atlas' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if module.__name__ == f"atlas.{name}" else getattr(module, name)
    globals()[name] = value
    return value
