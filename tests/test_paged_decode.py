"""paged_decode: reference vs torch SDPA (CPU), kernel vs reference (CUDA), validation.

Every case builds its own cache from a generator seeded by its parameters: shuffled block
tables (unused table entries hold an out-of-range id, so reading them would fail), random
seq_lens with the last forced to the maximum, K/V magnitudes far from 1, and every cache slot
a sequence does not own filled with NaN (FP8: the NaN byte and NaN scales), so reading past a
sequence's end poisons the output.
"""
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from atlas import ops, reference
from atlas.testing import paged_decode_gate_as_own_launch
from helpers import poison_, rel_err

BAD_ID = 2 ** 30   # table entries past a sequence's blocks: never read


def seed_of(*params) -> int:
    """A generator seed from a case's parameters (stable across processes, unlike hash())."""
    return zlib.crc32(repr(params).encode())


def make_case(batch, max_len, block_size, head_dim, nq, nkv, q_len, kv_dtype, *, device="cpu",
              seed=0, k_mag=3.0, v_mag=50.0, extra_blocks=1):
    """Returns dict(query, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if batch > 1:
        seq_lens = torch.randint(q_len, max_len + 1, (batch,), generator=gen, device=device)
    else:
        seq_lens = torch.empty(1, dtype=torch.int64, device=device)
    seq_lens[-1] = max_len
    seq_lens = seq_lens.to(torch.int32)
    max_blocks = -(-max_len // block_size) + extra_blocks
    used = [-(-int(n) // block_size) for n in seq_lens.tolist()]
    num_blocks = sum(used) + 3
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = torch.full((batch, max_blocks), BAD_ID, dtype=torch.int32, device=device)
    at = 0
    for b, n in enumerate(used):
        block_tables[b, :n] = perm[at:at + n]
        at += n

    shape = (num_blocks, block_size, nkv, head_dim)
    k_rows = (torch.randn(shape, generator=gen, device=device) * k_mag).to(torch.bfloat16)
    v_rows = (torch.randn(shape, generator=gen, device=device) * v_mag).to(torch.bfloat16)
    # owned[block, offset]: the slot holds a position < seq_len of the sequence owning the block
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=device)
        owned[block_tables[b, pos // block_size].long(), pos % block_size] = True
    k_scale = v_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        kq, k_scale = reference.quantize_kv_fp8(k_rows)
        vq, v_scale = reference.quantize_kv_fp8(v_rows)
        k_cache, v_cache = kq, vq
        for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
            cache.view(torch.uint8)[~owned] = 0x7F          # e4m3fn NaN
            scale[~owned] = float("nan")
    else:
        k_cache, v_cache = k_rows, v_rows
        k_cache[~owned] = float("nan")
        v_cache[~owned] = float("nan")
    q_shape = (batch, nq, head_dim) if q_len == 1 else (batch, q_len, nq, head_dim)
    query = torch.randn(q_shape, generator=gen, device=device).to(torch.bfloat16)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale,
                block_tables=block_tables, seq_lens=seq_lens, softmax_scale=1.0 / math.sqrt(head_dim))


def call(case, fn=ops.paged_decode, **kw):
    c = case
    return fn(c["query"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["softmax_scale"],
              c["k_scale"], c["v_scale"], **kw)


def sdpa_one(case, b):
    """(out f32 [q_len, nq, hd], lse f32 [q_len, nq]) of sequence b by torch SDPA over its gathered KV."""
    c = case
    q = c["query"] if c["query"].dim() == 4 else c["query"].unsqueeze(1)
    n = int(c["seq_lens"][b])
    k = reference.paged_kv_gather(c["k_cache"], c["k_scale"], c["block_tables"][b], n)   # [L, nkv, hd]
    v = reference.paged_kv_gather(c["v_cache"], c["v_scale"], c["block_tables"][b], n)
    t, nq = q.shape[1], q.shape[2]
    group = nq // k.shape[1]
    qb = q[b].float().transpose(0, 1).unsqueeze(0)                                      # [1, nq, T, hd]
    kb = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)                 # [1, nq, L, hd]
    vb = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    mask = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]                # [T, L]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=c["softmax_scale"])
    s = (qb @ kb.transpose(-1, -2)) * c["softmax_scale"]
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)                   # [1, nq, T]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


# ---- CPU: the reference against torch SDPA ----------------------------------------------------

REF_CASES = [  # (B, max_len, bs, hd, nq, nkv, q_len)
    (1, 1, 16, 64, 8, 8, 1),
    (3, 17, 16, 128, 16, 2, 1),
    (2, 40, 16, 64, 24, 4, 3),
    (2, 33, 7, 64, 16, 2, 8),
    (2, 600, 528, 128, 8, 2, 3),
]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", REF_CASES, ids=lambda s: "B{}-L{}-bs{}-hd{}-h{}of{}-q{}".format(*s))
def test_reference_matches_sdpa(shape, kv_dtype):
    b, n, bs, hd, nq, nkv, t = shape
    case = make_case(b, n, bs, hd, nq, nkv, t, kv_dtype, seed=seed_of(shape, kv_dtype))
    out, lse = call(case, fn=reference.paged_decode)
    out = out if out.dim() == 4 else out.unsqueeze(1)
    lse = lse if lse.dim() == 3 else lse.unsqueeze(1)
    for i in range(b):
        want_out, want_lse = sdpa_one(case, i)
        # out is rounded to bf16 once (2^-9 relative); the float32 math agrees to ~1e-6
        assert rel_err(out[i], want_out) < 4e-3
        torch.testing.assert_close(lse[i], want_lse, atol=1e-4, rtol=1e-5)


def test_reference_fp8_uses_row_scales():
    """FP8 cache of large-magnitude rows: the reference dequantizes with each row's own scale
    (a fixed scale of 1.0 would saturate at 448 and fail)."""
    case = make_case(2, 50, 16, 64, 8, 2, 1, torch.float8_e4m3fn, seed=7, k_mag=200.0, v_mag=5000.0)
    assert case["v_scale"].nan_to_num().max() > 1.0      # a fixed scale of 1.0 would saturate
    out, lse = call(case, fn=reference.paged_decode)
    for i in range(2):
        want_out, want_lse = sdpa_one(case, i)
        assert rel_err(out[i], want_out[0]) < 4e-3
        torch.testing.assert_close(lse[i], want_lse[0], atol=1e-3, rtol=1e-5)
    # and the dequantized rows are the quantized ones times their own scales
    k = reference.paged_kv_gather(case["k_cache"], case["k_scale"], case["block_tables"][0], 10)
    blk = case["block_tables"][0, 0].long()
    want_k = case["k_cache"][blk, :10].float() * case["k_scale"][blk, :10].unsqueeze(-1)
    assert torch.equal(k, want_k)


def test_empty_and_short_sequences_cpu():
    """seq_len 0 → out 0, lse −inf; rows whose position is < 0 (seq_len < q_len) likewise."""
    case = make_case(3, 20, 16, 64, 4, 2, 3, torch.bfloat16, seed=3)
    case["seq_lens"] = torch.tensor([0, 2, 20], dtype=torch.int32)
    out, lse = call(case, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0])) and torch.isneginf(lse[1, 0]).all()
    assert torch.isfinite(lse[1, 1:]).all() and torch.isfinite(out[1:, 1:].float()).all()


def test_ops_cpu_out_and_lse():
    case = make_case(2, 30, 16, 64, 8, 2, 1, torch.bfloat16, seed=11)
    want, want_lse = call(case, fn=reference.paged_decode)
    out = poison_(torch.empty_like(case["query"]))
    got, lse = call(case, return_lse=True, out=out)
    assert got is out and torch.equal(got, want) and torch.equal(lse, want_lse)
    assert torch.equal(call(case), want)


def test_max_splits_rule():
    assert ops.paged_decode_max_splits(1, 2) == 1
    assert ops.paged_decode_max_splits(128, 2) == 1
    assert ops.paged_decode_max_splits(129, 2) == 2          # short sequences: 128-position splits
    assert ops.paged_decode_max_splits(256, 2) == 2
    assert ops.paged_decode_max_splits(257, 2) == 3
    assert ops.paged_decode_max_splits(2048, 2) == 16
    assert ops.paged_decode_max_splits(4096, 2) == 16         # ≤ 16 of them, then 256 positions
    assert ops.paged_decode_max_splits(4097, 2) == 17
    assert all(ops.paged_decode_max_splits(c, 2) <= ops.paged_decode_max_splits(c + 1, 2)
               for c in range(0, 40000, 7))                   # monotone: capacity bounds every L
    assert ops.paged_decode_max_splits(32768, 2) == 128
    assert ops.paged_decode_max_splits(10 ** 6, 1) == 128
    assert ops.paged_decode_max_splits(32768, 4) == 64      # ~256 CTAs for one sequence
    assert ops.paged_decode_max_splits(32768, 8) == 32
    assert ops.paged_decode_max_splits(32768, 64) == 16


# ---- validation: one negative test per rule, matched on the argument name ---------------------

def _bad(**changes):
    case = make_case(2, 20, 16, 64, 4, 2, 1, torch.bfloat16, seed=5)
    case.update(changes)
    return case


def _fp8_case(**changes):
    case = make_case(2, 20, 16, 64, 4, 2, 1, torch.float8_e4m3fn, seed=6)
    case.update(changes)
    return case


BAD_INPUTS = [
    ("query dtype", lambda: _bad(query=torch.zeros(2, 4, 64)), TypeError, "query"),
    ("query rank", lambda: _bad(query=torch.zeros(2, 64, dtype=torch.bfloat16)), ValueError, "query"),
    ("q_len > 8", lambda: _bad(query=torch.zeros(2, 9, 4, 64, dtype=torch.bfloat16)), ValueError, "q_len"),
    ("head_dim", lambda: _bad(query=torch.zeros(2, 4, 96, dtype=torch.bfloat16)), ValueError, "head_dim"),
    ("query strides", lambda: _bad(query=torch.zeros(2, 64, 4, dtype=torch.bfloat16).transpose(1, 2)),
     ValueError, "query"),
    ("k_cache dtype", lambda: _bad(k_cache=torch.zeros(6, 16, 2, 64)), TypeError, "k_cache"),
    ("k_cache hd", lambda: _bad(k_cache=torch.zeros(6, 16, 2, 128, dtype=torch.bfloat16)), ValueError, "k_cache"),
    ("k_cache layout", lambda: _bad(k_cache=torch.zeros(6, 2, 16, 64, dtype=torch.bfloat16).transpose(1, 2)),
     ValueError, "k_cache"),
    ("nq % nkv", lambda: _bad(k_cache=torch.zeros(6, 16, 3, 64, dtype=torch.bfloat16),
                              v_cache=torch.zeros(6, 16, 3, 64, dtype=torch.bfloat16)), ValueError, "nkv"),
    ("v_cache shape", lambda: _bad(v_cache=torch.zeros(5, 16, 2, 64, dtype=torch.bfloat16)), ValueError, "v_cache"),
    ("v_cache dtype", lambda: _bad(v_cache=torch.zeros(6, 16, 2, 64, dtype=torch.float8_e4m3fn)),
     TypeError, "v_cache"),
    ("block_tables dtype", lambda: _bad(block_tables=torch.zeros(2, 3, dtype=torch.int64)), TypeError,
     "block_tables"),
    ("block_tables batch", lambda: _bad(block_tables=torch.zeros(3, 3, dtype=torch.int32)), ValueError,
     "block_tables"),
    ("seq_lens dtype", lambda: _bad(seq_lens=torch.tensor([3, 4])), TypeError, "seq_lens"),
    ("seq_lens shape", lambda: _bad(seq_lens=torch.tensor([3], dtype=torch.int32)), ValueError, "seq_lens"),
    ("seq_lens > capacity", lambda: _bad(seq_lens=torch.tensor([3, 10 ** 4], dtype=torch.int32)), ValueError,
     "seq_lens"),
    ("seq_lens < 0", lambda: _bad(seq_lens=torch.tensor([-1, 4], dtype=torch.int32)), ValueError, "seq_lens"),
    ("block id out of range", lambda: _bad(block_tables=torch.tensor([[0, 1, 99], [2, 3, 4]], dtype=torch.int32),
                                           seq_lens=torch.tensor([40, 3], dtype=torch.int32)),
     ValueError, "block_tables"),
    ("softmax_scale type", lambda: _bad(softmax_scale=torch.tensor(0.1)), TypeError, "softmax_scale"),
    ("softmax_scale value", lambda: _bad(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("scale for bf16", lambda: _bad(k_scale=torch.ones(6, 16, 2)), ValueError, "k_scale"),
    ("missing fp8 scale", lambda: _fp8_case(v_scale=None), ValueError, "v_scale"),
    ("fp8 scale shape", lambda: _fp8_case(k_scale=torch.ones(3, 16, 2)), ValueError, "k_scale"),
    ("fp8 scale dtype", lambda: _fp8_case(k_scale=torch.ones(1).double()), TypeError, "k_scale"),
]


@pytest.mark.parametrize("name,make,exc,arg", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs(name, make, exc, arg):
    case = make()
    with pytest.raises(exc, match=arg):
        call(case)


def test_bad_out():
    case = _bad()
    with pytest.raises(ValueError, match="out"):
        call(case, out=torch.empty(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out"):
        call(case, out=torch.empty(2, 4, 64))


# ---- CUDA: the kernel against the reference ----------------------------------------------------

KERNEL_CASES = [  # (B, max_len, bs, hd, nq, nkv, q_len): sampled, L = 32768 only at small B
    (1, 1, 16, 128, 16, 2, 1),
    (3, 15, 16, 256, 16, 2, 1),
    (3, 16, 16, 128, 24, 4, 3),
    (3, 17, 528, 256, 8, 8, 1),
    (5, 700, 12, 256, 16, 2, 1),         # bs % 8 != 0: a warp's 8 tile rows span blocks (per-row lookups)
    (2, 300, 1, 128, 8, 8, 3),
    (3, 1000, 16, 64, 8, 8, 8),
    (32, 1000, 16, 256, 16, 2, 1),
    (32, 1000, 528, 128, 24, 4, 8),
    (32, 1000, 16, 256, 16, 2, 8),       # 64 rows per kv head: 4 MMA row tiles
    (3, 1000, 16, 128, 16, 1, 8),        # 128 rows per kv head: two row groups
    (3, 300, 16, 64, 16, 16, 1),         # group 1
    (128, 17, 16, 64, 8, 8, 3),
    (128, 1000, 16, 256, 24, 4, 1),      # fused mode: one CTA folds each sequence's 8 splits
    (64, 3000, 16, 64, 8, 8, 1),         # fused mode with 2 split groups + combine
    (1, 32768, 16, 256, 16, 2, 1),       # split mode, 128 splits: the grouped combine
    (1, 32768, 16, 256, 24, 4, 3),
    (3, 32768, 528, 128, 8, 8, 8),
    (2, 9000, 16, 64, 8, 1, 2),          # grouped combine at hd 64 (2 CTAs per row), 5 groups
    # FP8's 64-position tiles (v23): whole-tile splits of chunk % 64 == 0 (L 2100: 16 splits of
    # 160 positions at bf16, 192 at fp8; L 36000 past the cap: 288 / 320), and block sizes that
    # hold a bf16 warp's 8 tile rows but not an fp8 warp's 16 (the per-row lookups)
    (2, 2100, 8, 256, 16, 2, 1),
    (3, 5000, 24, 128, 24, 4, 3),        # 18 rows: 2 row tiles
    (1, 36000, 16, 64, 8, 1, 1),
]

# bf16 output rounding (2^-9) plus P rounded to bf16 (FP8 KV: f16) before P·V: ~3e-3 typical
OUT_TOL = 1e-2
LSE_ATOL = 2e-3   # scores are exact bf16 products in fp32; ex2.approx and log2 ~1e-6 relative


def _check_against_reference(case, out, lse):
    want, want_lse = call(case, fn=reference.paged_decode)
    assert not torch.isnan(out).any()
    assert rel_err(out, want) < OUT_TOL
    torch.testing.assert_close(lse, want_lse, atol=LSE_ATOL, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", KERNEL_CASES, ids=lambda s: "B{}-L{}-bs{}-hd{}-h{}of{}-q{}".format(*s))
def test_kernel_matches_reference(shape, kv_dtype):
    b, n, bs, hd, nq, nkv, t = shape
    seed = seed_of(shape, kv_dtype)
    mags = [(3.0, 50.0), (1.0, 1e-3), (8.0, 1.0)][seed % 3]   # far from 1 either way
    case = make_case(b, n, bs, hd, nq, nkv, t, kv_dtype, device="cuda", seed=seed, k_mag=mags[0], v_mag=mags[1])
    out = poison_(torch.empty_like(case["query"]))
    got, lse = call(case, return_lse=True, out=out)
    assert got is out
    _check_against_reference(case, out, lse)


FP8_SPREAD_CASES = [  # (B, max_len, bs, hd, nq, nkv, q_len): split mode, fused mode, smem Q
    (2, 3000, 16, 256, 16, 2, 1),
    (64, 3000, 16, 128, 8, 2, 1),
    (3, 1000, 16, 128, 24, 4, 3),
]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", FP8_SPREAD_CASES, ids=lambda s: "B{}-L{}-bs{}-hd{}-h{}of{}-q{}".format(*s))
def test_kernel_fp8_scale_spreads(shape):
    """The FP8 path's f16 staging (paged_decode.cu, v13) against the range it must cover: query
    heads 2^-20 .. 2^3 apart (each row staged at its own power of two), V scales 2^±8 apart from
    one 16-position block to the next (each tile's P scale steps down, and O with it, whenever a
    larger scale arrives), K scales 2^±2 apart. Checked per query-head class, so an error on the
    small heads is not hidden behind the large ones."""
    b, n, bs, hd, nq, nkv, t = shape
    seed = seed_of("fp8-spread", shape)
    case = make_case(b, n, bs, hd, nq, nkv, t, torch.float8_e4m3fn, device="cuda", seed=seed, v_mag=1.0)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = case["v_scale"].shape[0]
    v_exp = torch.randint(-8, 9, (blocks, 1, 1), generator=gen, device="cuda").float()
    k_exp = torch.randint(-2, 3, (blocks, 1, 1), generator=gen, device="cuda").float()
    case["v_scale"] = case["v_scale"] * torch.exp2(v_exp)
    case["k_scale"] = case["k_scale"] * torch.exp2(k_exp)
    head_exp = torch.tensor([-20.0, -8.0, 0.0, 3.0], device="cuda")
    head_class = torch.arange(nq, device="cuda") % 4
    case["query"] = (case["query"].float() * torch.exp2(head_exp[head_class]).unsqueeze(-1)).to(torch.bfloat16)
    out = poison_(torch.empty_like(case["query"]))
    got, lse = call(case, return_lse=True, out=out)
    want, want_lse = call(case, fn=reference.paged_decode)
    assert not torch.isnan(got).any()
    for c in range(4):
        heads = head_class == c
        assert rel_err(got[..., heads, :], want[..., heads, :]) < OUT_TOL, f"head class 2^{int(head_exp[c])}"
    torch.testing.assert_close(lse, want_lse, atol=LSE_ATOL, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_kernel_empty_and_short_sequences(kv_dtype):
    case = make_case(4, 700, 16, 128, 8, 2, 3, kv_dtype, device="cuda", seed=21)
    case["seq_lens"][0], case["seq_lens"][1], case["seq_lens"][3] = 0, 2, 513   # within owned slots
    out, lse = call(case, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0])) and torch.isneginf(lse[1, 0]).all()
    _check_against_reference(case, out, lse)


@pytest.mark.cuda
def test_kernel_strided_query_view():
    """query as a view into a fused [B, q_len, (nq + 2·nkv)·hd] qkv buffer."""
    b, t, nq, nkv, hd = 5, 3, 16, 2, 256
    case = make_case(b, 900, 16, hd, nq, nkv, t, torch.bfloat16, device="cuda", seed=31)
    qkv = torch.randn(b, t, (nq + 2 * nkv) * hd, device="cuda").to(torch.bfloat16)
    case["query"] = qkv[..., :nq * hd].view(b, t, nq, hd)
    assert not case["query"].is_contiguous()
    out, lse = call(case, return_lse=True)
    _check_against_reference(case, out, lse)
    case1 = dict(case, query=qkv[:, 0, :nq * hd].view(b, nq, hd))           # [B, nq, hd], strided
    out1, lse1 = call(case1, return_lse=True)
    _check_against_reference(case1, out1, lse1)


INVARIANCE_CASES = [  # (B, max_len, hd, nq, nkv): B · nkv · ceil(splits / 8) ≥ 256 → fused at q_len 1
    (16, 20000, 256, 16, 2),
    (52, 9000, 64, 8, 1),
    (32, 1000, 256, 16, 2),              # split mode past one wave: CTAs stream 2 splits at q_len 1
    (32, 1000, 128, 16, 2),              # the same at hd 128
]


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 8])
@pytest.mark.parametrize("geom", INVARIANCE_CASES, ids=lambda g: "B{}-L{}-hd{}-h{}of{}".format(*g))
def test_kernel_batch_invariant(geom, kv_dtype, q_len):
    """A sequence's output bits do not depend on the rest of the batch nor on the table width
    (at q_len 1 the batch runs in fused mode, combined by the flat kernel, and the sequence
    alone in split mode, its > 16 splits combined by the grouped kernel; B = 32 × 1000 runs in
    split mode past one wave, 2 splits per CTA, against 1 per CTA alone)."""
    b, n_max, hd, nq, nkv = geom
    case = make_case(b, n_max, 16, hd, nq, nkv, q_len, kv_dtype, device="cuda", seed=seed_of(geom, q_len))
    out, lse = call(case, return_lse=True)
    for i in (0, b // 2, b - 1):
        n = int(case["seq_lens"][i])
        alone = dict(case, query=case["query"][i:i + 1], seq_lens=case["seq_lens"][i:i + 1].clone(),
                     block_tables=case["block_tables"][i:i + 1, :-(-n // 16)].contiguous())
        out1, lse1 = call(alone, return_lse=True)
        assert torch.equal(out1[0], out[i]) and torch.equal(lse1[0], lse[i])


VERIFY_ROW_CASES = [  # (B, max_len, hd, nq, nkv): q_len 1 → ≤ 8 rows (Q in registers), q_len 2 → smem Q
    (1, 20000, 256, 16, 2),              # split mode, grouped combine
    (3, 3000, 128, 24, 4),
]


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("geom", VERIFY_ROW_CASES, ids=lambda g: "B{}-L{}-hd{}-h{}of{}".format(*g))
def test_kernel_verify_row_matches_decode(geom, kv_dtype):
    """The last row of a q_len-2 verify call attends exactly what a q_len-1 decode of the same
    seq_lens does, and the bits agree: the rows of an MMA tile are independent, so the ≤ 8-row
    instance (Q in registers) and the 16-row one (Q re-read from smem) compute the same."""
    b, n_max, hd, nq, nkv = geom
    case = make_case(b, n_max, 16, hd, nq, nkv, 2, kv_dtype, device="cuda", seed=seed_of(geom, "verify"))
    out, lse = call(case, return_lse=True)                                    # [B, 2, nq, hd]
    one = dict(case, query=case["query"][:, 1].contiguous())                  # [B, nq, hd]
    out1, lse1 = call(one, return_lse=True)
    assert torch.equal(out1, out[:, 1]) and torch.equal(lse1, lse[:, 1])


GATE_CASES = [  # (B, max_len, bs, hd, nq, nkv, q_len): every place out is written
    (3, 120, 16, 128, 16, 2, 1),         # L ≤ 128, one split: the attention kernel stores out
    (2, 100, 16, 256, 32, 2, 8),         # one split, 128 rows per kv head: 4 row tiles, 2 row groups
    (3, 1000, 16, 256, 24, 4, 3),        # ≤ 16 splits: the flat combine (split mode)
    (128, 1000, 16, 256, 24, 4, 1),      # fused mode, one group: the attention kernel folds and stores
    (64, 3000, 16, 64, 8, 8, 1),         # fused mode, 2 groups: the flat combine (fused)
    (1, 32768, 16, 256, 16, 2, 1),       # 128 splits: the grouped combine
    (2, 9000, 16, 64, 8, 1, 2),          # grouped combine, hd 64, q_len 2
]


def _gate_for(case, per_head: bool, gen):
    """A gate shaped like the query, as the layer passes it: the G half of a de-interleaved
    [.., Q | G] buffer, or the gate half of per-head [q | gate] rows (head stride 2·hd)."""
    q = case["query"]
    *lead, nq, hd = q.shape
    dev = q.device
    if per_head:
        buf = torch.randn(*lead, nq, 2 * hd, generator=gen, device=dev).to(torch.bfloat16) * 4
        return buf[..., hd:]
    buf = torch.randn(*lead, 2 * nq * hd, generator=gen, device=dev).to(torch.bfloat16) * 4
    return buf[..., nq * hd:].view(*lead, nq, hd)


def _unfused(case, gate):
    """paged_decode, then sigmoid_gate_mul: what the gated call must equal bit for bit."""
    return call(case, fn=paged_decode_gate_as_own_launch, return_lse=True, gate=gate)


def test_gate_cpu_is_the_composition():
    case = make_case(3, 40, 16, 64, 8, 2, 3, torch.bfloat16, seed=71)
    gen = torch.Generator().manual_seed(71)
    for per_head in (False, True):
        gate = _gate_for(case, per_head, gen)
        got, lse = call(case, return_lse=True, gate=gate)
        want, want_lse = _unfused(case, gate)
        assert torch.equal(got, want) and torch.equal(lse, want_lse)
        assert not torch.equal(got, call(case))                               # the gate did something


def test_bad_gate():
    case = _bad()
    q = case["query"]
    with pytest.raises(ValueError, match="gate"):
        call(case, gate=torch.zeros(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="gate"):
        call(case, gate=torch.zeros(q.shape))
    with pytest.raises(ValueError, match="gate"):                             # hd not contiguous
        call(case, gate=torch.zeros(2, 64, 4, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="gate"):                             # row stride not % 8
        call(case, gate=torch.zeros(2, 4 * 64 + 4, dtype=torch.bfloat16)[:, :256].view(2, 4, 64))
    with pytest.raises(ValueError, match="gate"):                             # start not 16-byte aligned
        call(case, gate=torch.zeros(2 * 4 * 64 + 4, dtype=torch.bfloat16)[4:].view(2, 4, 64))


@pytest.mark.cuda
def test_cuda_binding_rejects_misaligned_partials():
    """The split partials are stored and loaded in 8 / 16-byte runs: the binding refuses scratch
    that does not start 16-byte aligned (atlas.ops allocates it aligned; this guards direct calls)."""
    from atlas._ext import _C
    case = {k: (v.cuda() if torch.is_tensor(v) else v)
            for k, v in make_case(1, 1000, 16, 128, 16, 2, 1, torch.bfloat16, seed=8).items()}
    q = case["query"].unsqueeze(1)
    b, _, nq, hd = q.shape
    nkv = case["k_cache"].shape[2]
    splits = ops.paged_decode_max_splits(case["block_tables"].shape[1] * case["k_cache"].shape[1], nkv)
    assert splits > 1
    rows = nq // nkv
    out, lse = torch.empty_like(q), torch.empty(b, 1, nq, device="cuda")
    po = torch.empty(b * nkv * splits * rows * hd + 1, device="cuda")[1:]            # 4-byte offset
    pl = torch.empty(b * nkv * splits * rows, device="cuda")
    with pytest.raises(RuntimeError, match="partial_o"):
        _C.paged_decode(q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                        case["softmax_scale"], None, None, out, lse, po, pl, splits, None)

@pytest.mark.cuda
@pytest.mark.parametrize("per_head", [False, True], ids=["g-half", "per-head"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", GATE_CASES, ids=lambda s: "B{}-L{}-bs{}-hd{}-h{}of{}-q{}".format(*s))
def test_kernel_gate_bitwise_vs_unfused(shape, kv_dtype, per_head):
    """The output gate applied where out is written equals paged_decode + sigmoid_gate_mul bit
    for bit, on every store path (one split, fused fold, flat and grouped combines)."""
    b, n, bs, hd, nq, nkv, t = shape
    seed = seed_of("gate", shape, kv_dtype, per_head)
    case = make_case(b, n, bs, hd, nq, nkv, t, kv_dtype, device="cuda", seed=seed)
    gate = _gate_for(case, per_head, torch.Generator(device="cuda").manual_seed(seed))
    out = poison_(torch.empty_like(case["query"]))
    got, lse = call(case, return_lse=True, out=out, gate=gate)
    want, want_lse = _unfused(case, gate)
    assert got is out and torch.equal(got, want) and torch.equal(lse, want_lse)


@pytest.mark.cuda
def test_kernel_out_of_range_ids_are_memory_safe():
    """On CUDA bad ids / seq_lens are not checked (a sync): the kernel clamps and skips, no fault."""
    case = make_case(3, 100, 16, 128, 8, 2, 1, torch.bfloat16, device="cuda", seed=51)
    case["block_tables"][1, 2] = -5
    case["block_tables"][2, 0] = 10 ** 6
    case["seq_lens"][0] = 10 ** 6                                             # clamped to capacity
    out = call(case)
    torch.cuda.synchronize()
    assert out.shape == case["query"].shape


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_kernel_cuda_graph(kv_dtype):
    """Capture once, then replay with new query contents and new seq_lens (no host reads)."""
    b, t = 8, 3
    case = make_case(b, 3000, 16, 256, 24, 4, t, kv_dtype, device="cuda", seed=61)
    static = dict(case)
    static["query"] = case["query"].clone()
    static["seq_lens"] = case["seq_lens"].clone()
    out = torch.empty_like(case["query"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(static, out=out)                                                  # warm-up off-graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(static, out=out)
    for step in range(2):
        gen = torch.Generator(device="cuda").manual_seed(100 + step)
        static["query"].copy_(torch.randn(static["query"].shape, generator=gen, device="cuda"))
        new_lens = torch.randint(t, 3001, (b,), generator=gen, device="cuda").to(torch.int32)
        static["seq_lens"].copy_(torch.minimum(new_lens, case["seq_lens"]))   # stay within owned slots
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        want, _ = call(static, fn=reference.paged_decode)
        assert rel_err(out, want) < OUT_TOL
