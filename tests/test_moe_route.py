"""ops.moe_route: softmax over all experts (fp32), top-k with lowest-index ties, renormalize;
reference semantics vs HF's router on CPU, kernel == reference on the GPU."""
import zlib

import pytest
import torch

from atlas import ops, reference


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("e,k", [(8, 2), (64, 8), (256, 8), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_matches_hf_router(e, k, renormalize):
    g = _gen("hf", e, k, renormalize)
    x = torch.randn(13, e, generator=g) * 2
    ids, w = ops.moe_route(x, k, renormalize)
    p = torch.softmax(x, -1)
    top = p.topk(k, -1)                            # HF Qwen3_5MoeTopKRouter (fp32 probs)
    val = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (13, k)
    assert torch.equal(ids.long(), top.indices)    # float32 logits: no ties
    torch.testing.assert_close(w, val, rtol=1e-6, atol=1e-7)


def test_moe_route_ties_lowest_index_first():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    ids, w = ops.moe_route(x, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize("kw,match,exc", [
    (dict(logits=torch.zeros(3, 8), top_k=0), "top_k", ValueError),
    (dict(logits=torch.zeros(3, 8), top_k=9), "top_k", ValueError),
    (dict(logits=torch.zeros(3, 64), top_k=33), "top_k", ValueError),
    (dict(logits=torch.zeros(3, 8), top_k=2.0), "top_k", TypeError),
    (dict(logits=torch.zeros(3, 1025), top_k=2), "E ≤ 1024", ValueError),
    (dict(logits=torch.zeros(8), top_k=2), "logits", ValueError),
    (dict(logits=torch.zeros(3, 8, dtype=torch.float16), top_k=2), "logits", TypeError),
])
def test_moe_route_rejects(kw, match, exc):
    with pytest.raises(exc, match=match):
        ops.moe_route(**kw)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 5, 32, 513])
@pytest.mark.parametrize("e,k", [(8, 2), (33, 4), (256, 8), (512, 10), (1024, 32)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_kernel_matches_reference(dtype, t, e, k, renormalize):
    g = _gen("cuda", dtype, t, e, k, renormalize)
    x = (torch.randn(t, e, generator=g) * 3).to(dtype)   # bf16 logits tie often: tests the rule
    ids_ref, w_ref = reference.moe_route(x, k, renormalize)
    ids, w = ops.moe_route(x.cuda(), k, renormalize)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.cuda
def test_moe_route_kernel_graph_replay():
    x = torch.randn(8, 256, device="cuda")
    ops.moe_route(x, 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = ops.moe_route(x, 8)
    x.copy_(torch.randn(8, 256, device="cuda"))
    graph.replay()
    ids_ref, w_ref = reference.moe_route(x.cpu(), 8)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-6, atol=1e-7)
