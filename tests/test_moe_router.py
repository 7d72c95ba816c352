"""ops.moe_router: router GEMV + moe_route in one launch. CPU: the reference's semantics (HF's
router: softmax of F.linear logits in fp32, top-k) and validation; GPU: logits within bf16
rounding of the reference's, ids and weights bitwise moe_route of the kernel's own logits, every
output written (poisoned buffers), batch invariance, graph replay."""
import zlib

import pytest
import torch

from atlas import ops, reference
from atlas._ext import _C
from helpers import poison_, rel_err


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _inputs(g, t, r, h):
    x = torch.randn(t, h, generator=g).bfloat16()
    gates = (torch.randn(r, h, generator=g) * h ** -0.5).bfloat16()   # logits ≈ N(0, 1): bf16 ties happen
    return x, gates


@pytest.mark.parametrize("e,k,shared_slot", [(8, 2, False), (64, 8, True), (256, 8, True)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_router_matches_hf_router(e, k, shared_slot, renormalize):
    g = _gen("hf", e, k, shared_slot, renormalize)
    x, gates = _inputs(g, 9, e + int(shared_slot), 64)
    logits, ids, w = ops.moe_router(x, gates, k, renormalize, shared_slot=shared_slot)
    want = torch.nn.functional.linear(x, gates)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want)
    p = torch.softmax(want[:, :e].float(), -1)
    top = p.topk(k, -1)
    val = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    assert ids.shape == w.shape == (9, k + int(shared_slot))
    assert torch.equal(ids[:, :k].long().sort(-1).values, top.indices.sort(-1).values)   # ties: any order
    torch.testing.assert_close(w[:, :k].sort(-1).values, val.sort(-1).values, rtol=1e-6, atol=1e-7)
    if shared_slot:
        assert (ids[:, k] == e).all()
        torch.testing.assert_close(w[:, k], torch.sigmoid(want[:, e].float()))


def test_moe_router_routes_the_first_e_rows():
    """R = E + 1 without the shared slot (the epilogue path): the last row's logit is returned, not routed."""
    g = _gen("first-e")
    x, gates = _inputs(g, 5, 17, 32)
    logits, ids, w = ops.moe_router(x, gates, 3, num_experts=16)
    ids0, w0 = ops.moe_route(logits[:, :16], 3)
    assert logits.shape == (5, 17) and torch.equal(ids, ids0) and torch.equal(w, w0)


@pytest.mark.parametrize("kw,match,exc", [
    (dict(x=torch.zeros(3, 64), gates=torch.zeros(8, 64).bfloat16(), top_k=2), "x", TypeError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(8, 64), top_k=2), "gates", TypeError),
    (dict(x=torch.zeros(3, 60).bfloat16(), gates=torch.zeros(8, 60).bfloat16(), top_k=2), "multiple of 8", ValueError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(8, 32).bfloat16(), top_k=2), "h = 64", ValueError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(8, 64).bfloat16(), top_k=9), "top_k", ValueError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(8, 64).bfloat16(), top_k=2.0), "top_k", TypeError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(8, 64).bfloat16(), top_k=2, num_experts=6),
     "R = E or E", ValueError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(8, 64).bfloat16(), top_k=2, num_experts=8,
          shared_slot=True), "R = E \\+ 1", ValueError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(1026, 64).bfloat16(), top_k=2), "num_experts", ValueError),
    (dict(x=torch.zeros(3, 64).bfloat16(), gates=torch.zeros(64, 8).bfloat16().t(), top_k=2), "contiguous", ValueError),
    (dict(x=torch.zeros(64).bfloat16(), gates=torch.zeros(8, 64).bfloat16(), top_k=2), "x", ValueError),
])
def test_moe_router_rejects(kw, match, exc):
    with pytest.raises(exc, match=match):
        ops.moe_router(**kw)


# (E, k, h, shared_slot, R): 35B-A3B (5 tiles per CTA), Qwen3-Next (9: two tile groups), E = 1024
# (17 tiles per CTA, 4 groups, every lane 32 logits), h % 32 != 0 (a part-filled last k step),
# fewer tiles than CTAs, R = E + 1 routed over E only.
CASES = [(256, 8, 2048, True, 257), (512, 10, 2048, True, 513), (1024, 32, 256, False, 1024),
         (33, 4, 136, False, 33), (8, 2, 64, False, 8), (64, 8, 520, False, 65), (128, 8, 4096, True, 129)]


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 5, 16, 17, 32, 70])
@pytest.mark.parametrize("e,k,h,shared_slot,r", CASES)
def test_moe_router_kernel_matches_reference(t, e, k, h, shared_slot, r):
    g = _gen("cuda", t, e, k, h, shared_slot, r)
    x, gates = _inputs(g, t, r, h)
    renormalize = bool(t % 2)
    ref_logits, _, _ = reference.moe_router(x, gates, k, renormalize, e, shared_slot)
    logits, ids, w = ops.moe_router(x.cuda(), gates.cuda(), k, renormalize, num_experts=e, shared_slot=shared_slot)
    exact = x.double() @ gates.double().T
    err = (logits.cpu().double() - exact).abs()
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
    assert (err <= ulp + 1e-5).all(), f"max err / |logit| {(err / (exact.abs() + 1e-9)).max():.3g}"   # one rounding
    assert rel_err(logits.cpu(), ref_logits) < 4e-3
    ids_route, w_route = ops.moe_route(logits if shared_slot else logits[:, :e], k, renormalize, shared_slot=shared_slot)
    assert torch.equal(ids, ids_route) and torch.equal(w, w_route)


@pytest.mark.cuda
@pytest.mark.parametrize("e,k,h,shared_slot,r", CASES[:3])
def test_moe_router_kernel_writes_every_output(e, k, h, shared_slot, r):
    """The binding over NaN-poisoned buffers: every logit, id and weight is written."""
    g = _gen("poison", e, k, h)
    t = 21
    x, gates = (a.cuda() for a in _inputs(g, t, r, h))
    kk = k + int(shared_slot)
    logits = poison_(torch.empty(t, r, dtype=torch.bfloat16, device="cuda"))
    ids = torch.full((t, kk), -7, dtype=torch.int32, device="cuda")
    w = poison_(torch.empty(t, kk, device="cuda"))
    _C.moe_router(x, gates, logits, ids, w, e, True, shared_slot)
    want = ops.moe_router(x, gates, k, num_experts=e, shared_slot=shared_slot)
    assert torch.equal(logits, want[0]) and torch.equal(ids, want[1]) and torch.equal(w, want[2])
    assert not logits.isnan().any() and (ids >= 0).all() and not w.isnan().any()


@pytest.mark.cuda
def test_moe_router_kernel_batch_invariant():
    """A token's logits (and so its route) do not depend on the batch around it or its tile."""
    g = _gen("batch-invariant")
    x, gates = (a.cuda() for a in _inputs(g, 40, 257, 2048))
    batch = ops.moe_router(x, gates, 8, shared_slot=True)
    for r in (0, 15, 16, 39):
        one = ops.moe_router(x[r:r + 1], gates, 8, shared_slot=True)
        assert all(torch.equal(a[r:r + 1], b) for a, b in zip(batch, one)), f"row {r}"


@pytest.mark.cuda
def test_moe_router_kernel_strided_x_and_graph_replay():
    g = _gen("graph")
    x, gates = (a.cuda() for a in _inputs(g, 8, 257, 2048))
    wide = torch.randn(8, 2056, generator=g).bfloat16().cuda()
    view = wide[:, 8:]                                                        # row stride 2056: copied
    assert all(torch.equal(a, b) for a, b in zip(ops.moe_router(view, gates, 8, shared_slot=True),
                                                  ops.moe_router(view.contiguous(), gates, 8, shared_slot=True)))
    ops.moe_router(x, gates, 8, shared_slot=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_router(x, gates, 8, shared_slot=True)
    x.copy_(torch.randn(8, 2048, generator=g).bfloat16())
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, ops.moe_router(x, gates, 8, shared_slot=True)))
