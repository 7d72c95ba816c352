"""`python -m atlas` commands: info and check run (CPU here: reference path), draft-bench runs a
tiny config end to end on CPU, and the floor's byte model matches a hand count."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atlas import testing as T
from atlas.__main__ import _format_table, build_parser, draft_bytes
from atlas.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "atlas", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_info_runs():
    r = _run("info", timeout=120)
    assert r.returncode == 0, r.stderr
    for word in ("atlas 0.1.0", "torch", "extension:", "kernels_available:"):
        assert word in r.stdout, r.stdout
    assert ("GPU 0:" in r.stdout) == torch.cuda.is_available()


def test_check_runs():
    r = _run("check", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "quantize_nvfp4" in r.stdout and "all checks passed" in r.stdout
    if not torch.cuda.is_available():
        assert "no GPU kernels to check" in r.stdout


def _mtp_importable() -> bool:
    try:
        importlib.import_module("atlas.layers.mtp")
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _mtp_importable(), reason="atlas.layers.mtp not importable yet")
def test_draft_bench_tiny_on_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on a GPU draft-bench writes a real-shaped checkpoint; run it as a bench")
    r = _run("draft-bench", "--batch", "1,2", "--drafts", "2", "--prompt-len", "8", "--iters", "2",
             "--out", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reference path" in r.stdout
    res = json.loads((tmp_path / "draft_bench_cpu.json").read_text())   # CPU runs get their own name
    assert [row["batch"] for row in res["rows"]] == [1, 2]
    assert all(row["us_per_draft"] > 0 for row in res["rows"])
    assert (tmp_path / "draft_bench_cpu.png").exists() or "matplotlib not installed" in r.stdout


def test_draft_bytes_by_hand():
    cfg = ModelConfig.from_hf(T.qwen36_35b_a3b_config())
    b1 = draft_bytes(cfg, batch=1, context=2048, weight_format="nvfp4", kv_dtype="bf16", vocab_rows=248320)
    h, nvfp4 = 2048, 0.5625
    attn = (16 * 256 * 2 * h + 2 * 2 * 256 * h + h * 16 * 256) * nvfp4
    fc = 2 * h * h * nvfp4
    experts = 8 * 3 * 512 * h * nvfp4                     # batch 1: exactly top-k distinct experts
    shared = 3 * 512 * h * nvfp4 + 257 * h * 2            # shared expert + BF16 router and shared gate
    head = 248320 * h * nvfp4
    kv = 2048 * 2 * 2 * 256 * 2
    assert b1["weights"] == pytest.approx(attn + fc + experts + shared + head)
    assert b1["kv"] == kv
    b32 = draft_bytes(cfg, batch=32, context=2048, weight_format="nvfp4", kv_dtype="fp8", vocab_rows=248320)
    assert 8 * 3 * 512 * h * nvfp4 < b32["weights"] - (attn + fc + shared + head) < 256 * 3 * 512 * h * nvfp4
    assert b32["kv"] == 32 * 2048 * 2 * (2 * 256 + 8)     # e4m3 K and V + one f32 scale each per kv head


def test_table_and_parser():
    rows = [{"batch": 1, "drafts": 3, "us_per_propose": 300.0, "us_per_draft": 100.0, "mb_per_draft": 400.0,
             "achieved_gbs": 4000.0, "floor_us_per_draft": 93.0, "pct_of_floor": 93.0, "mode": "graph"}]
    text = _format_table(rows)
    assert "µs/draft" in text and "100.0" in text and "graph" in text
    args = build_parser().parse_args(["draft-bench", "--batch", "1,8", "--kv-dtype", "fp8"])
    assert args.batch == "1,8" and args.kv_dtype == "fp8" and args.weight_format == "nvfp4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["draft-bench", "--weight-format", "int4"])


@pytest.mark.cuda
def test_draft_bench_on_gpu_with_a_model_dir(tmp_path):
    """The CLI's GPU path on a tiny checkpoint: graph-captured propose, floor and JSON."""
    if not _mtp_importable():
        pytest.skip("atlas.layers.mtp not importable")
    d = T.write_checkpoint(tmp_path / "ckpt", T.tiny_config(layout="vl"), "modelopt_nvfp4", quantize_lm_head=True)
    r = _run("draft-bench", "--model", str(d), "--batch", "1,4", "--drafts", "2", "--prompt-len", "40",
             "--iters", "5", "--out", str(tmp_path / "out"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "out" / "draft_bench.json").read_text())
    assert [row["batch"] for row in res["rows"]] == [1, 4]
    for row in res["rows"]:
        assert row["mode"] == "graph replay", row
        assert row["us_per_draft"] > 0 and row["floor_us_per_draft"] > 0
    assert res["meta"]["copy_bandwidth_gbs"] > 100
