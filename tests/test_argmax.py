"""ops.argmax (greedy pick + top-1 softmax probability) and ops.embedding: reference semantics on
CPU, kernel == reference on the GPU (ids exactly, prob to float32 rounding)."""
import zlib

import pytest
import torch

from atlas import ops, reference


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---- reference semantics (CPU) --------------------------------------------------------------

def test_argmax_lowest_index_wins_ties():
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    ids, prob = ops.argmax(x)
    assert ids.tolist() == [1, 0, 0] and ids.dtype == torch.int64
    torch.testing.assert_close(prob, torch.softmax(x, -1).gather(-1, ids[:, None]).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("r,v", [(1, 1), (3, 17), (5, 4097), (2, 248077)])
def test_argmax_matches_softmax(dtype, r, v):
    g = _gen("ref", dtype, r, v)
    x = (torch.randn(r, v, generator=g) * 4).to(dtype)
    ids, prob = ops.argmax(x)
    p = torch.softmax(x.float(), -1)
    assert torch.equal(ids, x.float().argmax(-1))
    # float32 sums of up to 2.5e5 terms in different orders: ~sqrt(V)·2^-24 ≈ 3e-5 relative
    torch.testing.assert_close(prob, p.max(-1).values, rtol=1e-4, atol=0)


def test_argmax_masked_vocab():
    x = torch.full((2, 10), float("-inf"))
    x[0, 7] = 1.0
    ids, prob = ops.argmax(x)
    assert ids.tolist() == [7, 0] and prob[0].item() == 1.0


def test_argmax_strided_rows():
    x = torch.randn(4, 64)
    ids, _ = ops.argmax(x[:, :50])
    assert torch.equal(ids, x[:, :50].argmax(-1))


@pytest.mark.parametrize("bad,match,exc", [
    (torch.zeros(4, dtype=torch.float32), "logits", ValueError),
    (torch.zeros(2, 4, dtype=torch.int32), "logits", TypeError),
    (torch.zeros(2, 0), "V > 0", ValueError),
    (torch.zeros(8, 2).t(), "contiguous last dim", ValueError),
])
def test_argmax_rejects(bad, match, exc):
    with pytest.raises(exc, match=match):
        ops.argmax(bad)


def test_embedding_gathers_rows():
    table = torch.randn(10, 16).bfloat16()
    ids = torch.tensor([3, 3, 0, 9])
    assert torch.equal(ops.embedding(table, ids), table[ids])
    assert torch.equal(ops.embedding(table, ids.int()), table[ids])


@pytest.mark.parametrize("ids,match,exc", [
    (torch.tensor([0, 10]), r"ids must be in \[0, 10\)", ValueError),
    (torch.tensor([-1]), r"ids must be in \[0, 10\)", ValueError),
    (torch.tensor([0.0]), "ids", TypeError),
    (torch.tensor([[0]]), "ids", ValueError),
])
def test_embedding_rejects(ids, match, exc):
    with pytest.raises(exc, match=match):
        ops.embedding(torch.randn(10, 16).bfloat16(), ids)


def test_embedding_rejects_non_bf16_table():
    with pytest.raises(TypeError, match="table"):
        ops.embedding(torch.randn(10, 16), torch.tensor([0]))


# ---- CUDA kernel vs reference -----------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("r", [1, 3, 32])
@pytest.mark.parametrize("v", [1, 255, 4096, 4097, 32768, 248077, 248320])
def test_argmax_kernel_matches_reference(dtype, r, v):
    g = _gen("cuda", dtype, r, v)
    x = (torch.randn(r, v, generator=g) * 6).to(dtype)
    if v > 8:   # plant exact ties: the lowest index must win across CTAs of the split pass
        x[:, v - 1] = x.float().max(-1).values.to(dtype)
        x[:, v // 3] = x[:, v - 1]
    ids_ref, prob_ref = reference.argmax(x)
    ids, prob = ops.argmax(x.cuda())
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(prob.cpu(), prob_ref, rtol=1e-4, atol=0)  # fp32 sum order (see above)


@pytest.mark.cuda
def test_argmax_kernel_row_is_batch_invariant():
    g = _gen("inv")
    x = torch.randn(32, 248320, generator=g).bfloat16().cuda()
    ids, prob = ops.argmax(x)
    for r in (0, 17, 31):
        i1, p1 = ops.argmax(x[r:r + 1])
        assert torch.equal(i1, ids[r:r + 1]) and torch.equal(p1, prob[r:r + 1])


@pytest.mark.cuda
def test_argmax_kernel_masked_and_strided():
    x = torch.full((3, 9000), float("-inf"), device="cuda")
    x[0, 8999] = 2.0
    x[1, 4096] = 2.0
    ids, prob = ops.argmax(x[:, :9000])
    assert ids.tolist() == [8999, 4096, 0] and prob[:2].tolist() == [1.0, 1.0]
    y = torch.randn(4, 300, device="cuda")
    assert torch.equal(ops.argmax(y[:, :200])[0], y[:, :200].argmax(-1))


def _nan_logits(dtype):
    x = torch.randn(3, 9000).to(dtype)
    x[0, 5] = float("nan")        # in a full split chunk of the kernel
    x[0, 7000] = 50.0
    x[1, 8999] = float("nan")     # in the tail chunk
    x[1, 8000] = 50.0
    x[2] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_nan_never_wins(dtype):
    """A NaN logit never wins and makes prob NaN; an all-NaN row picks index 0."""
    ids, prob = ops.argmax(_nan_logits(dtype))
    assert ids.tolist() == [7000, 8000, 0] and prob.isnan().all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernel_nan_never_wins(dtype):
    ids, prob = ops.argmax(_nan_logits(dtype).cuda())
    assert ids.tolist() == [7000, 8000, 0] and prob.isnan().all()


@pytest.mark.cuda
def test_argmax_kernel_graph_replay():
    x = torch.randn(8, 50000, device="cuda")
    ops.argmax(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, prob = ops.argmax(x)
    x.copy_(torch.randn(8, 50000, device="cuda"))
    graph.replay()
    ref_ids, ref_prob = reference.argmax(x.cpu())
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(prob.cpu(), ref_prob, rtol=1e-4, atol=0)  # fp32 sum order (see above)


@pytest.mark.cuda
@pytest.mark.parametrize("h", [2048, 5120, 60])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding_kernel(h, id_dtype):
    g = _gen("emb", h, id_dtype)
    table = torch.randn(1000, h, generator=g).bfloat16().cuda()
    ids = torch.randint(0, 1000, (33,), generator=g).to(id_dtype).cuda()
    out = ops.embedding(table, ids)
    assert torch.equal(out, table[ids.long()])
    bad = torch.tensor([5, 1000, -1], dtype=id_dtype, device="cuda")   # GPU: zero rows, no fault
    out = ops.embedding(table, bad)
    assert torch.equal(out[0], table[5]) and not out[1:].any()


# ---- embedding_norm_concat (the MTP fc input) -------------------------------------------------

@pytest.mark.parametrize("zero_centered", [True, False])
def test_embedding_norm_concat_is_two_rms_norms(zero_centered):
    g = _gen("enc", zero_centered)
    table = torch.randn(50, 64, generator=g).bfloat16()
    ids = torch.randint(0, 50, (7,), generator=g)
    hidden = (torch.randn(7, 64, generator=g) * 30).bfloat16()
    we, wh = torch.randn(64, generator=g) * 0.1, torch.randn(64, generator=g) * 0.1
    out = ops.embedding_norm_concat(table, ids, hidden, we, wh, 1e-6, zero_centered)
    want = torch.cat([ops.rms_norm(table[ids], we, 1e-6, zero_centered), ops.rms_norm(hidden, wh, 1e-6, zero_centered)], -1)
    assert out.shape == (7, 128) and torch.equal(out, want)


def test_embedding_norm_concat_rejects():
    t = torch.randn(10, 16).bfloat16()
    w = torch.zeros(16)
    with pytest.raises(ValueError, match="ids must be in"):
        ops.embedding_norm_concat(t, torch.tensor([10]), t[:1], w, w, 1e-6, True)
    with pytest.raises(ValueError, match="hidden"):
        ops.embedding_norm_concat(t, torch.tensor([1, 2]), t[:1], w, w, 1e-6, True)
    with pytest.raises(TypeError, match="w_hidden"):
        ops.embedding_norm_concat(t, torch.tensor([1]), t[:1], w, w.bfloat16(), 1e-6, True)


@pytest.mark.cuda
@pytest.mark.parametrize("h,t", [(2048, 1), (2048, 32), (5120, 8), (64, 3)])
def test_embedding_norm_concat_kernel(h, t):
    g = _gen("enc-cuda", h, t)
    table = torch.randn(1000, h, generator=g).bfloat16()
    ids = torch.randint(0, 1000, (t,), generator=g)
    hidden = (torch.randn(t, 2 * h, generator=g) * 10).bfloat16()[:, :h]      # strided rows
    we, wh = torch.randn(h, generator=g) * 0.1, torch.randn(h, generator=g) * 0.1
    ref = reference.embedding_norm_concat(table, ids, hidden, we, wh, 1e-6, True)
    out = ops.embedding_norm_concat(table.cuda(), ids.cuda(), hidden.cuda(), we.cuda(), wh.cuda(), 1e-6, True)
    # float32 sum-of-squares order and rsqrtf: at most one bf16 ulp apart
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2 ** -7, atol=1e-6)
