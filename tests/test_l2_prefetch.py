"""ops.l2_prefetch: a hint with no result — its views' layout rules and errors (CPU), and on the
GPU that it leaves memory bit-identical and runs on a forked stream under graph capture (MtpHead's
use of it: tests/test_mtp.py)."""
import pytest
import torch

import atlas
from atlas import ops
from atlas.ops import _strided_runs


# ---- layout rules and errors (CPU) ----------------------------------------------------------

def _tiled_prefix(n: int, chunks: int, rows: int, b: int = 64) -> torch.Tensor:
    """rows of a chunk-major [n, chunks, b] uint8 view (tile_for_gemv's layout)."""
    buf = torch.arange(n * chunks * b, dtype=torch.int64).to(torch.uint8).reshape(chunks, n, b)
    return buf.transpose(0, 1)[:rows]


@pytest.mark.parametrize("view,expect", [
    (lambda: torch.zeros(4096, dtype=torch.uint8), (4096, 4096, 1)),
    (lambda: torch.zeros(8, 512, dtype=torch.bfloat16)[:3], (3072, 3072, 1)),
    (lambda: _tiled_prefix(96, 16, 32), (32 * 64, 96 * 64, 16)),
    (lambda: _tiled_prefix(96, 16, 32, b=8), (32 * 8, 96 * 8, 16)),
    (lambda: torch.zeros(4, 64, dtype=torch.float32)[:, :32], (128, 256, 4)),
])
def test_strided_runs(view, expect):
    assert _strided_runs("t", "v", view()) == expect


def test_cpu_is_a_no_op():
    t = torch.randn(4096)
    before = t.clone()
    assert ops.l2_prefetch(t, blocks=7) is None
    assert torch.equal(t, before)


def test_errors_name_the_argument():
    t = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1..8 views"):
        ops.l2_prefetch()
    with pytest.raises(ValueError, match="1..8 views"):
        ops.l2_prefetch(*[t] * 9)
    with pytest.raises(TypeError, match=r"views\[1\]"):
        ops.l2_prefetch(t, "not a tensor")
    with pytest.raises(ValueError, match="blocks"):
        ops.l2_prefetch(t, blocks=0)
    with pytest.raises(ValueError, match=r"views\[0\].*equal runs"):
        ops.l2_prefetch(torch.zeros(4, 4, 64, dtype=torch.uint8)[:, :2, :32])   # two strides
    with pytest.raises(ValueError, match=r"views\[0\].*16-byte"):
        ops.l2_prefetch(t[1:33])                                                 # misaligned start
    with pytest.raises(ValueError, match=r"views\[0\].*16-byte"):
        ops.l2_prefetch(t[:24])                                                  # run not a multiple of 16
    with pytest.raises(ValueError, match=r"views\[0\] is empty"):
        ops.l2_prefetch(t[:0])


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("evict_last", [True, False])
@pytest.mark.parametrize("blocks", [1, 5, 64])
def test_cuda_prefetch_leaves_memory_unchanged(evict_last, blocks):
    g = torch.Generator(device="cuda").manual_seed(blocks)
    flat = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    chunked = torch.randint(0, 256, (16, 4096, 64), dtype=torch.uint8, device="cuda", generator=g)
    before = (flat.clone(), chunked.clone())
    ops.l2_prefetch(flat, chunked.transpose(0, 1)[:1024], flat[16:4096 + 16], blocks=blocks, evict_last=evict_last)
    torch.cuda.synchronize()
    assert torch.equal(flat, before[0]) and torch.equal(chunked, before[1])


@pytest.mark.cuda
def test_cuda_prefetch_in_a_graph_on_a_forked_stream():
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ops.l2_prefetch(x)
        torch.mul(x, 2, out=y)
        main.wait_stream(side)
    x.copy_(torch.randn(1 << 20, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


@pytest.mark.cuda
def test_cuda_binding_rejects_bad_regions():
    t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="l2_prefetch"):
        atlas._ext._C.l2_prefetch([t], [24], [24], [1], 1, True)      # run not a multiple of 16
    with pytest.raises(RuntimeError, match="l2_prefetch"):
        atlas._ext._C.l2_prefetch([t], [16, 16], [16], [1], 1, True)  # mismatched lists

