"""ops.moe_route: softmax over all experts (fp32), top-k with lowest-index ties, renormalize;
reference semantics vs HF's router on CPU, kernel == reference on the GPU."""
import zlib

import pytest
import torch

import atlas
from atlas import ops, reference
from atlas.nvfp4 import dequantize_expert_stack, expert_words_for_gemv, gemv_word_bits, tile_expert_stack
from helpers import rel_err


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e,k", [(33, 4), (256, 8), (1024, 32)])
def test_moe_route_kernel_masked_experts(dtype, e, k):
    """−inf logits (masked experts) rank last, among themselves by index, with weight 0 — also
    when a row has fewer than k finite logits (the kernel's padding keys must stay below them)."""
    g = _gen("masked", dtype, e, k)
    x = (torch.randn(6, e, generator=g) * 3).to(dtype)
    x[:, torch.randperm(e, generator=g)[: e // 2]] = float("-inf")
    x[1, : e - k // 2] = float("-inf")                 # row 1: only k/2 finite logits
    x[2, :] = float("-inf")
    x[2, 5] = 0.0                                     # row 2: one finite logit
    x[3, :] = float("-inf")
    x[3, :3] = torch.tensor([-0.0, 0.0, -0.0])        # row 3: −0 and +0 tie (lower index first)
    ids_ref, w_ref = reference.moe_route(x, k, True)
    ids, w = ops.moe_route(x.cuda(), k, True)
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


# ---- moe_experts (routed experts over device-side ids) -----------------------------------------

# NVFP4 stacks come in three layouts: the checkpoint's ([E, N, K/2]), its words in the GEMV bit
# order ("nvfp4w": [E, N, K/8, 4], nvfp4.expert_words_for_gemv) and those words per-expert
# chunk-major, what the layers derive on CUDA ("nvfp4t": nvfp4.tile_expert_stack, h and I % 128 == 0)
FMTS = ["bf16", "nvfp4", "nvfp4w", "nvfp4t"]
NVFP4_FMTS = ["nvfp4", "nvfp4w", "nvfp4t"]


def _stacks(g, e, inter, h, fmt):
    """gate, up [E, I, h], down [E, h, I] in fmt, plus their dense float32 values (skips the test
    for nvfp4t where h or I is not a multiple of 128)."""
    if fmt == "nvfp4t" and (h % 128 or inter % 128):
        pytest.skip("the tiled expert layout needs h and I multiples of 128")
    out, dense = [], []
    for n, k in ((inter, h), (inter, h), (h, inter)):
        w = torch.randn(e, n, k, generator=g) * k ** -0.5
        if fmt == "bf16":
            s = w.bfloat16()
            dense.append(s.float())
        else:
            qs = [atlas.quantize_nvfp4(w[i]) for i in range(e)]
            packed, scale = torch.stack([q.packed for q in qs]), torch.stack([q.block_scale for q in qs])
            if fmt == "nvfp4w":
                packed = expert_words_for_gemv(packed)
            elif fmt == "nvfp4t":
                packed, scale = tile_expert_stack(packed, scale)
            s = (packed, scale, torch.stack([q.global_scale for q in qs]))
            dense.append(torch.stack([q.dequantize(torch.float32) for q in qs]))
        out.append(s)
    return out, dense


def _to(s, dev):   # (Tensor.to keeps a dense view's strides: tiled stacks stay tiled)
    return s.to(dev) if isinstance(s, torch.Tensor) else tuple(x.to(dev) for x in s)


def _repeat_expert(s, e):
    """A stack of one expert → E copies of it, in the same layout."""
    def rep(x):
        if x.dim() == 4 and x.shape[-1] in (64, 8):   # tiled: repeat the chunk-major buffer
            return x.transpose(1, 2).expand(e, *x.transpose(1, 2).shape[1:]).contiguous().transpose(1, 2)
        return x.expand(e, *x.shape[1:]).contiguous()
    return rep(s) if isinstance(s, torch.Tensor) else tuple(rep(x) for x in s)


@pytest.mark.parametrize("fmt", FMTS)
def test_moe_experts_reference_semantics(fmt):
    """Per pair: bf16 rounding after each projection and after silu·up; f32 weighted sum."""
    g = _gen("experts-ref", fmt)
    e, inter, h, t, k = 6, 32, 64, 3, 2
    (gate, up, down), (dg, du, dd) = _stacks(g, e, inter, h, fmt)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.tensor([[0, 5], [3, 3], [1, 6]], dtype=torch.int32)        # 6: out of range → skipped
    w = torch.rand(t, k, generator=g)
    out = ops.moe_experts(x, ids, w, gate, up, down)
    want = torch.zeros(t, h)
    for r in range(t):
        for j in range(k):
            ex = int(ids[r, j])
            if ex >= e:
                continue
            gg = (dg[ex] @ x[r].float()).bfloat16().float()
            uu = (du[ex] @ x[r].float()).bfloat16().float()
            a = (torch.nn.functional.silu(gg) * uu).bfloat16().float()
            want[r] += w[r, j] * (dd[ex] @ a).bfloat16().float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_moe_experts_cpu_all_ids_invalid(fmt):
    """Every id outside [0, E): zeros (the CPU path cuts the stacks to the named experts)."""
    (gate, up, down), _ = _stacks(_gen("experts-none", fmt), 3, 32, 64, fmt)
    ids = torch.tensor([[3, -1], [7, 3]], dtype=torch.int32)
    out = ops.moe_experts(torch.randn(2, 64).bfloat16(), ids, torch.rand(2, 2), gate, up, down)
    assert torch.equal(out, torch.zeros(2, 64))


def test_moe_experts_rejects():
    x = torch.zeros(2, 64).bfloat16()
    ids = torch.zeros(2, 2, dtype=torch.int32)
    w = torch.zeros(2, 2)
    gate = torch.zeros(4, 32, 64).bfloat16()
    down = torch.zeros(4, 64, 32).bfloat16()
    with pytest.raises(TypeError, match="ids"):
        ops.moe_experts(x, ids.long(), w, gate, gate, down)
    with pytest.raises(ValueError, match="down"):
        ops.moe_experts(x, ids, w, gate, gate, gate)
    with pytest.raises(ValueError, match="weights"):
        ops.moe_experts(x, ids, w[:1], gate, gate, down)
    with pytest.raises(ValueError, match="multiples of 32"):
        ops.moe_experts(x[:, :48].contiguous(), ids, w, gate[:, :, :48].contiguous(), gate[:, :, :48].contiguous(),
                        down[:, :48].contiguous())
    many = torch.zeros(ops.MOE_EXPERTS_MAX_EXPERTS + 1, 32, 64).bfloat16()   # the grouping kernel's limit
    with pytest.raises(ValueError, match="E ≤ 4096"):
        ops.moe_experts(x, ids, w, many, many, many.transpose(1, 2).contiguous())


def test_expert_words_for_gemv_roundtrip():
    """The GEMV word order is a byte-preserving permutation of each 32-bit word's codes: the
    inverse restores the checkpoint bytes, and the codes move as the tiled GEMV layout's do."""
    g = _gen("expert-words")
    packed = torch.randint(0, 256, (3, 16, 40), generator=g, dtype=torch.uint8)   # K = 80
    words = expert_words_for_gemv(packed)
    assert words.shape == (3, 16, 10, 4) and words.dtype == torch.uint8 and words.is_contiguous()
    assert torch.equal(words.flatten(2), gemv_word_bits(packed))
    assert torch.equal(gemv_word_bits(words, inverse=True).flatten(2), packed)
    assert not torch.equal(words.flatten(2), packed)                      # random codes do move


@pytest.mark.parametrize("t", [1, 6])
def test_moe_experts_gemv_words_equal_checkpoint_words_cpu(t):
    g = _gen("experts-words-cpu", t)
    (gate, up, down), _ = _stacks(g, 5, 32, 64, "nvfp4")
    words = [(expert_words_for_gemv(s[0]), s[1], s[2]) for s in (gate, up, down)]
    x = torch.randn(t, 64, generator=g).bfloat16()
    ids = torch.randint(0, 5, (t, 3), generator=g).int()
    w = torch.rand(t, 3, generator=g)
    assert torch.equal(ops.moe_experts(x, ids, w, *words), ops.moe_experts(x, ids, w, gate, up, down))


def test_tile_expert_stack_layout():
    """tile_expert_stack: per expert, row n's chunk c at the chunk-major offset, words in the GEMV
    bit order; dequantizes to the checkpoint stack's values; a row-major copy is rejected."""
    g = _gen("tile-expert-stack")
    e, n, k = 3, 128, 256
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(e, n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn)
    gs = torch.rand(e, generator=g) + 0.5
    tp, ts = tile_expert_stack(packed, scale)
    assert tp.shape == (e, n, 2, 64) and tp.stride() == (n * 128, 64, n * 64, 1)
    assert ts.shape == (e, n, 2, 8) and ts.stride() == (n * 16, 8, n * 8, 1)
    flat = tp.transpose(1, 2).contiguous().view(-1)                          # the buffer as stored
    assert torch.equal(flat[2 * n * 128 + 1 * n * 64 + 5 * 64:][:64],       # expert 2, chunk 1, row 5
                       gemv_word_bits(packed[2, 5, 64:128]))
    assert torch.equal(dequantize_expert_stack(tp, ts, gs), dequantize_expert_stack(packed, scale, gs))
    with pytest.raises(ValueError, match="multiple of 128"):
        tile_expert_stack(packed[:, :, :40].contiguous(), scale[:, :, :5].contiguous())
    x, ids, w = torch.zeros(2, 256).bfloat16(), torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 1)
    gate = (tp, ts, gs)
    down = tile_expert_stack(torch.randint(0, 256, (e, k, n // 2), generator=g, dtype=torch.uint8),
                             scale.new_ones(e, k, n // 16)) + (gs,)
    with pytest.raises(ValueError, match="tile_expert_stack's view"):         # right shape, row-major strides
        ops.moe_experts(x, ids, w, (tp.contiguous(), ts, gs), gate, down)
    with pytest.raises(ValueError, match="one NVFP4 layout"):
        ops.moe_experts(x, ids, w, gate, (packed, scale, gs), down)


@pytest.mark.parametrize("t", [1, 6])
def test_moe_experts_tiled_equals_checkpoint_words_cpu(t):
    g = _gen("experts-tiled-cpu", t)
    (gate, up, down), _ = _stacks(g, 5, 128, 256, "nvfp4")
    tiled = [(*tile_expert_stack(s[0], s[1]), s[2]) for s in (gate, up, down)]
    x = torch.randn(t, 256, generator=g).bfloat16()
    ids = torch.randint(0, 5, (t, 3), generator=g).int()
    w = torch.rand(t, 3, generator=g)
    assert torch.equal(ops.moe_experts(x, ids, w, *tiled), ops.moe_experts(x, ids, w, gate, up, down))


def test_moe_experts_rejects_mixed_word_orders():
    g = _gen("experts-words-mixed")
    (gate, up, down), _ = _stacks(g, 4, 32, 64, "nvfp4")
    x, ids, w = torch.zeros(2, 64).bfloat16(), torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2)
    mixed = (expert_words_for_gemv(gate[0]), gate[1], gate[2])
    with pytest.raises(ValueError, match="one NVFP4 layout"):
        ops.moe_experts(x, ids, w, mixed, up, down)
    with pytest.raises(ValueError, match=r"uint8 \[E, 32, 8, 4\]"):     # a 4-D packed of the wrong K
        ops.moe_experts(x, ids, w, (mixed[0][:, :, :4].contiguous(), gate[1], gate[2]), up, down)
    with pytest.raises(ValueError, match="expert_words_for_gemv: K = 12"):
        expert_words_for_gemv(torch.zeros(1, 2, 6, dtype=torch.uint8))


@pytest.mark.cuda
def test_moe_experts_binding_rejects_mixed_word_orders():
    """The binding's own check (ops.moe_experts checks first): one launch reads one word order."""
    g = _gen("experts-words-binding")
    (gate, up, down), _ = _stacks(g, 4, 128, 256, "nvfp4")
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    x = torch.randn(1, 256, generator=g).bfloat16().cuda()
    ids = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    w = torch.ones(1, 2, device="cuda")
    with pytest.raises(RuntimeError, match="one NVFP4 layout"):
        torch.ops.atlas.moe_experts(x, ids, w, expert_words_for_gemv(gate[0]), gate[1], gate[2], *up, *down,
                                    None, None, False)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t,k,e", [(1, 8, 256), (8, 8, 256), (32, 8, 256), (3, 10, 512), (5, 2, 8),
                                   (2, 20, 64), (17, 8, 256),
                                   (64, 4, 8),    # ≈ 32 pairs per expert: 4 records of 8 (MT = 1)
                                   (80, 4, 8)])   # T > 64: records of 32 pairs (MT = 4), ≈ 40 per expert
def test_moe_experts_kernel_matches_reference(fmt, t, k, e):
    g = _gen("experts-cuda", fmt, t, k, e)
    inter, h = 512, 2048
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt) if e <= 8 else _stacks(g, 1, inter, h, fmt)
    if e > 8:   # many experts: repeat one random expert (keeps the CPU setup fast)
        gate, up, down = (_repeat_expert(s, e) for s in (gate, up, down))
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    w = torch.rand(t, k, generator=g)
    ref = ops.moe_experts(x, ids, w, gate, up, down)
    out = ops.moe_experts(x.cuda(), ids.cuda(), w.cuda(), _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"))
    # float32 dot order differs; a bf16 rounding may land one ulp apart (2^-8 relative)
    assert rel_err(out.cpu(), ref) < 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_moe_experts_kernel_batch_invariant(fmt):
    """Row t of a 32-row call (pairs grouped by expert on the device, tensor-core columns) is
    bitwise the 1-row call on that row alone: the batched propose drafts what each sequence
    drafts alone."""
    g = _gen("experts-batch-invariant", fmt)
    e, inter, h, t, k = 16, 512, 2048, 32, 9
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt)
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    x = torch.randn(t, h, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int().cuda()
    w = torch.rand(t, k, generator=g).cuda()
    out = ops.moe_experts(x, ids, w, gate, up, down, out_dtype=torch.bfloat16)
    for r in range(t):
        one = ops.moe_experts(x[r:r + 1], ids[r:r + 1], w[r:r + 1], gate, up, down, out_dtype=torch.bfloat16)
        assert torch.equal(out[r:r + 1], one), f"row {r}"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("h,inter", [(96, 32), (256, 64), (384, 160),   # K % 128 != 0: the K-tail paths
                                     (256, 128)])   # one token: the one-row GEMV path (NVFP4)
def test_moe_experts_kernel_repeated_and_invalid_ids(fmt, h, inter):
    """Rows that name one expert several times (a group of up to T·k pairs: several column
    passes at T·k > 32) and ids outside [0, E) (skipped), vs the reference."""
    g = _gen("experts-repeated", fmt, h, inter)
    e, t, k = 4, 9, 6
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.randint(0, e, (t, k), generator=g).int()
    ids[0, 1], ids[3, 0], ids[5, 5] = e, -1, e + 7                            # out of range: contribute 0
    ids[:, 2] = 1                                                            # expert 1: ≥ 9 pairs
    w = torch.rand(t, k, generator=g)
    ref = ops.moe_experts(x, ids, w, gate, up, down)
    out = ops.moe_experts(x.cuda(), ids.cuda(), w.cuda(), _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"))
    assert rel_err(out.cpu(), ref) < 5e-3
    big = torch.full((40, 1), 2, dtype=torch.int32)                          # 40 pairs of expert 2: 2 passes
    xb = torch.randn(40, h, generator=g).bfloat16()
    wb = torch.rand(40, 1, generator=g)
    ref = ops.moe_experts(xb, big, wb, gate, up, down)
    out = ops.moe_experts(xb.cuda(), big.cuda(), wb.cuda(), _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"))
    assert rel_err(out.cpu(), ref) < 5e-3
    few = torch.randint(0, e, (4, 8), generator=g).int()                    # 32 pairs: grouped inside the
    few[1, 3], few[2, 0] = e + 1, -2                                         # GEMV CTAs (no grouping launch)
    xf = torch.randn(4, h, generator=g).bfloat16()
    wf = torch.rand(4, 8, generator=g)
    ref = ops.moe_experts(xf, few, wf, gate, up, down)
    out = ops.moe_experts(xf.cuda(), few.cuda(), wf.cuda(), _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"))
    assert rel_err(out.cpu(), ref) < 5e-3
    one = torch.tensor([[e, 0, -1, 2, 2, e + 3]], dtype=torch.int32)       # one token (h, I % 128 == 0 at
    x1, w1 = xf[:1], wf[:1, :6].contiguous()                                # NVFP4: the one-row GEMV path)
    ref = ops.moe_experts(x1, one, w1, gate, up, down)
    out = ops.moe_experts(x1.cuda(), one.cuda(), w1.cuda(), _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"))
    assert rel_err(out.cpu(), ref) < 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_kernel_token_alone_equals_token_in_shared_batch(fmt, out_dtype):
    """One token alone (every expert group of 1 pair, MT = 1) is bitwise the same token inside a
    32-token batch where every token picks the same experts (groups of 32 pairs, MT = 4, the
    token in a different mma column): an expert's dot does not depend on its other columns."""
    g = _gen("experts-alone-vs-batch", fmt, out_dtype)
    e, inter, h, t, k = 12, 512, 2048, 32, 8
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt)
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    experts = torch.randperm(e, generator=g)[:k]
    ids = torch.stack([experts[torch.randperm(k, generator=g)] for _ in range(t)]).int().cuda()   # same set, any slot
    x = torch.randn(t, h, generator=g).bfloat16().cuda()
    w = torch.rand(t, k, generator=g).cuda()
    out = ops.moe_experts(x, ids, w, gate, up, down, out_dtype=out_dtype)
    for r in (0, 13, 31):
        one = ops.moe_experts(x[r:r + 1], ids[r:r + 1], w[r:r + 1], gate, up, down, out_dtype=out_dtype)
        assert torch.equal(out[r:r + 1], one), f"row {r}"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_moe_experts_kernel_token_alone_equals_token_in_80_token_batch(fmt):
    """Above 64 tokens the records hold 32 pairs (MT = 4 n8 tiles) instead of 8: one token alone
    is still bitwise the same token inside an 80-token batch sharing its experts."""
    g = _gen("experts-alone-vs-80", fmt)
    e, inter, h, t, k = 12, 512, 2048, 80, 8
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt)
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    experts = torch.randperm(e, generator=g)[:k]
    ids = torch.stack([experts[torch.randperm(k, generator=g)] for _ in range(t)]).int().cuda()
    x = torch.randn(t, h, generator=g).bfloat16().cuda()
    w = torch.rand(t, k, generator=g).cuda()
    out = ops.moe_experts(x, ids, w, gate, up, down, out_dtype=torch.bfloat16)
    for r in (0, 33, 79):
        one = ops.moe_experts(x[r:r + 1], ids[r:r + 1], w[r:r + 1], gate, up, down, out_dtype=torch.bfloat16)
        assert torch.equal(out[r:r + 1], one), f"row {r}"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", NVFP4_FMTS)
def test_moe_experts_kernel_indexed_batch_equals_grouped_batch(fmt):
    """NVFP4 with T·k ≤ 36 runs one expert-indexed GEMV slot per pair (pair p reads token p / k);
    one token more takes the grouped kernels. The shared rows are bitwise the same."""
    g = _gen("experts-indexed-vs-grouped", fmt)
    e, inter, h, k = 24, 512, 2048, 9
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt)
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    x = torch.randn(5, h, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(5)]).int()
    ids[1, 4], ids[3, 0] = -1, e                                               # skipped pairs
    ids = ids.cuda()
    w = torch.rand(5, k, generator=g).cuda()
    grouped = ops.moe_experts(x, ids, w, gate, up, down, out_dtype=torch.bfloat16)           # 45 pairs
    indexed = ops.moe_experts(x[:4], ids[:4], w[:4], gate, up, down, out_dtype=torch.bfloat16)   # 36
    assert torch.equal(indexed, grouped[:4])


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4, 6, 17, 64, 80])   # indexed, grouped (CTA and warp-streamed), MT = 4
def test_moe_experts_kernel_tiled_equals_gemv_words(t):
    """The tiled stacks (per-expert chunk-major) hold the same codes as the GEMV-word stacks and
    every path sums them in the same order: bitwise equal outputs."""
    g = _gen("experts-tiled-vs-words", t)
    e, inter, h, k = 12, 512, 2048, 8
    (gate, up, down), _ = _stacks(g, e, inter, h, "nvfp4w")
    words = [_to(s, "cuda") for s in (gate, up, down)]
    tiled = []
    for s in (gate, up, down):
        packed = gemv_word_bits(s[0], inverse=True).flatten(2)                # back to checkpoint words
        tiled.append(_to((*tile_expert_stack(packed, s[1]), s[2]), "cuda"))
    assert tiled[0][0].dim() == 4 and tiled[0][0].shape[-1] == 64 and not tiled[0][0].is_contiguous()
    x = torch.randn(t, h, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    ids[0, 1] = -1
    ids, w = ids.cuda(), torch.rand(t, k, generator=g).cuda()
    assert torch.equal(ops.moe_experts(x, ids, w, *tiled), ops.moe_experts(x, ids, w, *words))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", NVFP4_FMTS)
@pytest.mark.parametrize("h,inter", [(256, 1024),   # gate_up: 2 chunks per job, ≈ 3 jobs per warp
                                     (2048, 256)])  # down: 2 chunks per job, ≈ 3 jobs per warp
def test_moe_experts_kernel_warp_streams_cross_jobs(fmt, h, inter):
    """The warp-streamed grouped GEMV (NVFP4, 17..64 tokens) at its shortest jobs: 2 chunks, so
    a warp's copies enter its next job at the first step of every job, and each warp runs
    several jobs (64 distinct experts, 512 pairs). Against the reference, and each checked row
    bitwise equal to that token alone (the one-row GEMV path)."""
    g = _gen("experts-warp-streams", fmt, h, inter)
    e, t, k = 64, 64, 8
    (gate, up, down), _ = _stacks(g, e, inter, h, fmt)
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    w = torch.rand(t, k, generator=g)
    ref = ops.moe_experts(x, ids, w, *(_to(s, "cpu") for s in (gate, up, down)))
    out = ops.moe_experts(x.cuda(), ids.cuda(), w.cuda(), gate, up, down)
    assert rel_err(out.cpu(), ref) < 5e-3
    batch = ops.moe_experts(x.cuda(), ids.cuda(), w.cuda(), gate, up, down, out_dtype=torch.bfloat16)
    for r in (0, 37, 63):
        one = ops.moe_experts(x[r:r + 1].cuda(), ids[r:r + 1].cuda(), w[r:r + 1].cuda(), gate, up, down,
                              out_dtype=torch.bfloat16)
        assert torch.equal(batch[r:r + 1], one), f"row {r}"


@pytest.mark.cuda
def test_moe_experts_kernel_rejects_misaligned_x():
    g = _gen("experts-misaligned")
    (gate, up, down), _ = _stacks(g, 4, 32, 64, "bf16")
    buf = torch.randn(2 * 64 + 1, generator=g).bfloat16().cuda()
    x = buf[1:].view(2, 64)                                                  # 2-byte offset
    ids = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    w = torch.ones(2, 1, device="cuda")
    with pytest.raises(ValueError, match="x must start 16-byte aligned"):
        ops.moe_experts(x, ids, w, gate.cuda(), up.cuda(), down.cuda())


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", NVFP4_FMTS)
@pytest.mark.parametrize("t", [1, 4])   # 1: the expert-indexed one-row GEMV path
def test_moe_experts_kernel_graph_replay(fmt, t):
    g = _gen("experts-graph", fmt, t)
    (gate, up, down), _ = _stacks(g, 8, 128, 256, fmt)
    gate, up, down = _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda")
    x = torch.randn(t, 256, generator=g).bfloat16().cuda()
    ids = torch.randint(0, 8, (t, 2), generator=g).int().cuda()
    w = torch.rand(t, 2, generator=g).cuda()
    ops.moe_experts(x, ids, w, gate, up, down)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts(x, ids, w, gate, up, down)
    ids.copy_(torch.randint(0, 8, (t, 2), generator=g).int())
    graph.replay()
    assert torch.equal(out, ops.moe_experts(x, ids, w, gate, up, down))


def test_moe_route_shared_slot():
    g = _gen("shared-slot")
    x = torch.randn(4, 9, generator=g)
    ids, w = ops.moe_route(x, 3, shared_slot=True)
    ids0, w0 = ops.moe_route(x[:, :8], 3)
    assert ids.shape == (4, 4) and torch.equal(ids[:, :3], ids0) and (ids[:, 3] == 8).all()
    torch.testing.assert_close(w[:, :3], w0)
    torch.testing.assert_close(w[:, 3], torch.sigmoid(x[:, 8]))
    with pytest.raises(ValueError, match="shared_slot"):
        ops.moe_route(torch.randn(2, 65), 32, shared_slot=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_route_kernel_shared_slot(dtype):
    g = _gen("shared-slot-cuda", dtype)
    x = (torch.randn(33, 257, generator=g) * 3).to(dtype)
    ids_ref, w_ref = reference.moe_route(x, 8, True, True)
    ids, w = ops.moe_route(x.cuda(), 8, shared_slot=True)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.cuda
def test_moe_experts_kernel_bf16_out():
    g = _gen("experts-bf16-out")
    (gate, up, down), _ = _stacks(g, 9, 64, 256, "nvfp4")
    x = torch.randn(5, 256, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(5)]).int()
    w = torch.rand(5, 3, generator=g)
    ref = ops.moe_experts(x, ids, w, gate, up, down, out_dtype=torch.bfloat16)
    out = ops.moe_experts(x.cuda(), ids.cuda(), w.cuda(), _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"),
                          out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and rel_err(out.cpu(), ref) < 5e-3


def test_moe_route_strided_logits():
    """The first E columns of [router | shared gate] logits route like a contiguous copy."""
    x = torch.randn(5, 9)
    assert all(torch.equal(a, b) for a, b in zip(ops.moe_route(x[:, :8], 2), ops.moe_route(x[:, :8].contiguous(), 2)))


def test_moe_experts_shared_epilogue():
    g = _gen("experts-shared")
    (gate, up, down), _ = _stacks(g, 4, 32, 64, "bf16")
    x = torch.randn(3, 64, generator=g).bfloat16()
    ids = torch.randint(0, 4, (3, 2), generator=g).int()
    w = torch.rand(3, 2, generator=g)
    shared = torch.randn(3, 64, generator=g).bfloat16()
    logits = torch.randn(3, 5, generator=g).bfloat16()
    out = ops.moe_experts(x, ids, w, gate, up, down, shared=shared, shared_gate=logits[:, 4])
    routed = ops.moe_experts(x, ids, w, gate, up, down)
    want = (routed + torch.sigmoid(logits[:, 4:].float()) * shared.float()).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    with pytest.raises(ValueError, match="together"):
        ops.moe_experts(x, ids, w, gate, up, down, shared=shared)


@pytest.mark.cuda
def test_moe_route_kernel_strided_logits():
    x = torch.randn(33, 257, device="cuda").bfloat16()
    ids, w = ops.moe_route(x[:, :256], 8)
    ids_ref, w_ref = reference.moe_route(x[:, :256].cpu(), 8)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t", [1, 4])
def test_moe_experts_kernel_shared_epilogue(fmt, t):
    g = _gen("experts-shared-cuda", fmt, t)
    (gate, up, down), _ = _stacks(g, 16, 512, 2048, fmt)
    x = torch.randn(t, 2048, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(16, generator=g)[:8] for _ in range(t)]).int()
    w = torch.rand(t, 8, generator=g)
    shared = torch.randn(t, 2048, generator=g).bfloat16()
    logits = torch.randn(t, 17, generator=g).bfloat16()
    ref = ops.moe_experts(x, ids, w, gate, up, down, shared=shared, shared_gate=logits[:, 16])
    dev = [t.cuda() for t in (x, ids, w, shared, logits)]
    out = ops.moe_experts(dev[0], dev[1], dev[2], _to(gate, "cuda"), _to(up, "cuda"), _to(down, "cuda"),
                          shared=dev[3], shared_gate=dev[4][:, 16])
    assert out.dtype == torch.bfloat16 and rel_err(out.cpu(), ref) < 5e-3
