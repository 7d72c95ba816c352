"""reshape_and_cache: the reference on CPU (exact slots, skips, strided rows, FP8 round trip,
validation) and the CUDA kernel against it, bit for bit (cache bytes and scales)."""
import zlib

import pytest
import torch

from atlas import ops, reference
from helpers import poison_, rel_err

CACHE_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
HEADS = [(2, 256), (4, 256), (8, 128)]  # (nkv, hd): Qwen3-Next / 3.5 MoE, Qwen3.5-27B, Qwen3 dense
BLOCK_SIZES = [16, 528]                           # vLLM's default; a hybrid GDN model's page
TOKENS = [1, 7, 4096]


def _gen(*params) -> torch.Generator:
    """A CPU generator seeded from the case's parameters (crc32: stable across runs)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def make_rows(t, nkv, hd, *, gen, strided, device="cpu", magnitudes=True):
    """key, value [T, nkv, hd] bf16. Row magnitudes spread over 1e-3..1e4 (per token and head) so
    a fixed FP8 scale would fail. strided: views into a fused qkv buffer [T, (nq + 2·nkv)·hd]
    with nq = 2·nkv, as the QKV projection writes it (row stride > nkv·hd)."""
    nq = 2 * nkv
    qkv = torch.randn(t, nq + 2 * nkv, hd, generator=gen)
    if magnitudes:
        qkv *= 10.0 ** (torch.rand(t, nq + 2 * nkv, 1, generator=gen) * 7 - 3)
    qkv = qkv.bfloat16().reshape(t, -1).to(device)
    if strided:
        key = qkv[:, nq * hd:(nq + nkv) * hd].view(t, nkv, hd)
        value = qkv[:, (nq + nkv) * hd:].view(t, nkv, hd)
    else:
        key = qkv[:, nq * hd:(nq + nkv) * hd].reshape(t, nkv, hd).contiguous()
        value = qkv[:, (nq + nkv) * hd:].reshape(t, nkv, hd).contiguous()
    return key, value


def make_cache(num_blocks, bs, nkv, hd, dtype, device="cpu"):
    """Poisoned caches (NaN / 0xFF bytes) and, for FP8, NaN scales: any slot or scale the op
    does not write stays poisoned, and the tests check that it does."""
    kc = poison_(torch.empty(num_blocks, bs, nkv, hd, dtype=dtype, device=device))
    vc = poison_(torch.empty_like(kc))
    if dtype == torch.float8_e4m3fn:
        ks = poison_(torch.empty(num_blocks, bs, nkv, dtype=torch.float32, device=device))
        return kc, vc, ks, poison_(torch.empty_like(ks))
    return kc, vc, None, None


def make_slots(t, num_slots, *, gen, skip_every=5):
    """int64 [T]: distinct random slots; tokens 1, 1 + skip_every, ... are padding (-1)."""
    slots = torch.randperm(num_slots, generator=gen)[:t].to(torch.int64)
    slots[1::skip_every] = -1
    return slots


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits as integers, so NaN poison compares equal to itself."""
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


# ---------------------------------------------------------------------------------------------
# reference (CPU): exactly the named slots, skips, strided rows, block sizes, FP8 precision
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("strided", [False, True])
def test_reference_writes_exactly_the_named_slots(dtype, bs, strided):
    gen = _gen("named", dtype, bs, strided)
    t, nkv, hd, num_blocks = 37, 2, 64, 5
    key, value = make_rows(t, nkv, hd, gen=gen, strided=strided)
    assert key.stride(0) > nkv * hd if strided else key.is_contiguous()
    kc, vc, ks, vs = make_cache(num_blocks, bs, nkv, hd, dtype)
    slots = make_slots(t, num_blocks * bs, gen=gen)
    ops.reshape_and_cache(key, value, kc, vc, slots, ks, vs)

    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for tok, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written[s] = True
        b, o = divmod(s, bs)
        for src, cache, scale in ((key, kc, ks), (value, vc, vs)):
            if dtype == torch.bfloat16:
                assert torch.equal(bits(cache[b, o]), bits(src[tok]))
            else:
                amax = src[tok].float().abs().amax(dim=-1)                      # [nkv]
                assert torch.equal(scale[b, o], amax / 448)
                back = reference.dequantize_kv_fp8(cache[b, o], scale[b, o])
                assert rel_err(back, src[tok].float()) <= 2**-4
    # every other slot keeps its poison, bytes and scales alike
    for cache, scale in ((kc, ks), (vc, vs)):
        rest = bits(cache).reshape(num_blocks * bs, -1)[~written]
        assert torch.equal(rest, bits(poison_(torch.empty_like(cache))).reshape(num_blocks * bs, -1)[~written])
        if scale is not None:
            assert scale.reshape(-1, nkv)[~written].isnan().all()
            assert not scale.reshape(-1, nkv)[written].isnan().any()


@pytest.mark.parametrize("magnitude", [1e-3, 1e-1, 1.0, 30.0, 1e3, 1e4])
def test_fp8_round_trip_any_magnitude(magnitude):
    """Per-row scales keep E4M3's precision (half an ulp of a 3-bit mantissa = 2^-4 relative)
    whatever the magnitude; a fixed scale of 1.0 overflows at 1e3 and flushes at 1e-3."""
    gen = _gen("round-trip", magnitude)
    t, nkv, hd = 16, 4, 256
    key, value = make_rows(t, nkv, hd, gen=gen, strided=False, magnitudes=False)
    key, value = (key.float() * magnitude).bfloat16(), (value.float() * magnitude).bfloat16()
    kc, vc, ks, vs = make_cache(2, 16, nkv, hd, torch.float8_e4m3fn)
    ops.reshape_and_cache(key, value, kc, vc, torch.arange(t), ks, vs)
    for src, cache, scale in ((key, kc, ks), (value, vc, vs)):
        back = reference.dequantize_kv_fp8(cache.reshape(-1, nkv, hd)[:t], scale.reshape(-1, nkv)[:t])
        for tok in range(t):
            for h in range(nkv):
                assert rel_err(back[tok, h], src[tok, h].float()) <= 2**-4
    if magnitude in (1e-3, 1e4):  # a fixed scale of 1.0 flushes (1e-3) or saturates (1e4) here
        fixed = reference.e4m3_rne_satfinite(key.float()).float()
        assert rel_err(fixed, key.float()) > 2**-2


def test_fp8_zero_row_gets_scale_one():
    key = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    key[1, 1] = 3.0
    kc, vc, ks, vs = make_cache(1, 16, 2, 64, torch.float8_e4m3fn)
    ops.reshape_and_cache(key, key.clone(), kc, vc, torch.tensor([0, 1]), ks, vs)
    assert ks[0, 0].tolist() == [1.0, 1.0] and ks[0, 1, 0] == 1.0 and ks[0, 1, 1] == torch.tensor(3.0) / torch.tensor(448.0)
    assert (kc[0, 0].float() == 0).all() and (kc[0, 1, 1].float() == 448).all()


def test_fp8_quantization_is_round_to_nearest_even():
    """quantize_kv_fp8 stores the nearest E4M3 value of x / scale, ties to the even code (what
    the kernel's cvt.rn.satfinite does): checked against a search over all 127 magnitudes.
    Row 0 has amax 448, so scale = 1 and it hits exact ties: 1.0625 (1 | 1.125), 17 (16 | 18),
    1.5·2^-9 (subnormals 2^-9 | 2^-8)."""
    x = torch.randn(64, 128, generator=_gen("rne"))
    x[0, :6] = torch.tensor([448.0, 1.0625, 17.0, -17.0, 1.5 * 2**-9, 1.1875])
    x = x.bfloat16()
    q, scale = reference.quantize_kv_fp8(x)
    assert scale[0] == 1.0
    v = (x.float() / scale.unsqueeze(-1)).double()
    mags = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448 ascending
    dist = (v.abs().unsqueeze(-1) - mags).abs()                                     # [64, 128, 127]
    near = dist == dist.min(dim=-1, keepdim=True).values
    code = torch.arange(127)
    even = torch.where(near & (code % 2 == 0), code, 999).min(dim=-1).values
    want = torch.where(even < 999, even, torch.where(near, code, 999).min(dim=-1).values)
    got = q.view(torch.uint8)
    assert torch.equal((got & 0x7F).long(), want)
    assert torch.equal(got >> 7 == 1, torch.signbit(v))
    assert (got[0, 1:5] & 0x7F).tolist() == [0x38, 0x58, 0x58, 0x02]   # 1.0, 16, 16, 2^-8


def test_empty_step_is_a_no_op():
    key = torch.empty(0, 2, 64, dtype=torch.bfloat16)
    kc, vc, _, _ = make_cache(1, 16, 2, 64, torch.bfloat16)
    ops.reshape_and_cache(key, key, kc, vc, torch.empty(0, dtype=torch.int64))
    assert kc.isnan().all() and vc.isnan().all()


def _good(dtype=torch.bfloat16):
    key = torch.randn(3, 2, 64).bfloat16()
    kc, vc, ks, vs = make_cache(2, 16, 2, 64, dtype)
    return dict(key=key, value=key.clone(), k_cache=kc, v_cache=vc,
                slot_mapping=torch.tensor([0, 5, -1]), k_scale=ks, v_scale=vs)


FP8 = torch.float8_e4m3fn
BAD = [  # (name, cache dtype, change, exception, text the message must contain)
    ("key dtype", None, dict(key=torch.randn(3, 2, 64)), TypeError, "key must be bfloat16"),
    ("key not a tensor", None, dict(key=[1.0]), TypeError, "key must be a torch.Tensor"),
    ("key 2-D", None, dict(key=torch.randn(3, 128).bfloat16()), ValueError, "key must be"),
    ("hd not % 8", None, dict(key=torch.randn(3, 2, 60).bfloat16()), ValueError, "key must have head_dim"),
    ("value shape", None, dict(value=torch.randn(3, 2, 32).bfloat16()), ValueError, "value must have shape"),
    ("value dtype", None, dict(value=torch.randn(3, 2, 64).half()), TypeError, "value must be bfloat16"),
    ("key hd strided", None, dict(key=torch.randn(3, 2, 128).bfloat16()[:, :, ::2]), ValueError,
     "key must have contiguous"),
    ("key rows overlap", None, dict(key=torch.randn(256).bfloat16().as_strided((3, 2, 64), (64, 64, 1))),
     ValueError, "key must have a row stride"),
    ("key row stride % 8", None, dict(key=torch.randn(3, 132).bfloat16()[:, :128].view(3, 2, 64)),
     ValueError, "key must have a row stride"),
    ("value misaligned", None, dict(value=torch.randn(3 * 128 + 4).bfloat16()[4:].view(3, 2, 64)),
     ValueError, "value must start 16-byte aligned"),
    ("k_cache dtype", None, dict(k_cache=torch.zeros(2, 16, 2, 64)), TypeError, "k_cache must be"),
    ("k_cache nkv", None, dict(k_cache=torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)), ValueError,
     "k_cache must have shape"),
    ("k_cache not contiguous", None,
     dict(k_cache=torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16)[:, ::2]), ValueError, "k_cache must be contiguous"),
    ("v_cache shape", None, dict(v_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16)), ValueError,
     "v_cache must have shape"),
    ("v_cache dtype", None, dict(v_cache=torch.zeros(2, 16, 2, 64, dtype=FP8)), TypeError, "v_cache must be"),
    ("slot dtype", None, dict(slot_mapping=torch.tensor([0, 5, -1], dtype=torch.int32)), TypeError,
     "slot_mapping must be int64"),
    ("slot length", None, dict(slot_mapping=torch.tensor([0, 5])), ValueError, "slot_mapping must have shape"),
    ("slot out of range", None, dict(slot_mapping=torch.tensor([0, 32, -1])), ValueError,
     "slot_mapping must hold slots < num_blocks·bs"),
    ("scale for bf16", None, dict(k_scale=torch.zeros(2, 16, 2)), ValueError, "k_scale must be None"),
    ("fp8 without v_scale", FP8, dict(v_scale=None), ValueError, "v_scale float32 [num_blocks, bs, nkv] is required"),
    ("fp8 k_scale dtype", FP8, dict(k_scale=torch.zeros(2, 16, 2, dtype=torch.float64)), TypeError,
     "k_scale must be float32"),
    ("fp8 k_scale shape", FP8, dict(k_scale=torch.zeros(2, 16, 1)), ValueError, "k_scale must have shape"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_naming_the_argument(case):
    _, dtype, change, exc, text = case
    args = _good(dtype or torch.bfloat16)
    args.update(change)
    with pytest.raises(exc, match=text.replace("[", r"\[").replace("]", r"\]")):
        ops.reshape_and_cache(**args)


@pytest.mark.cuda
def test_device_mismatch_raises():
    args = _good()
    args["slot_mapping"] = args["slot_mapping"].cuda()
    with pytest.raises(ValueError, match="slot_mapping must be on cpu"):
        ops.reshape_and_cache(**args)


# ---------------------------------------------------------------------------------------------
# CUDA kernel == reference, bit for bit
# ---------------------------------------------------------------------------------------------

def _run_both(key, value, slots, num_blocks, bs, dtype):
    """Kernel on the GPU copies, reference on CPU copies; out-of-range slots (which only the
    kernel sees: on CUDA they are not checked) are the reference's skips."""
    nkv, hd = key.shape[1:]
    kc, vc, ks, vs = make_cache(num_blocks, bs, nkv, hd, dtype, device="cuda")
    ops.reshape_and_cache(key, value, kc, vc, slots, ks, vs)
    torch.cuda.synchronize()
    rk, rv, rks, rvs = make_cache(num_blocks, bs, nkv, hd, dtype)
    ref_slots = slots.cpu().clone()
    ref_slots[ref_slots >= num_blocks * bs] = -1
    reference.reshape_and_cache(key.cpu(), value.cpu(), rk, rv, ref_slots, rks, rvs)
    got = [kc, vc] + ([ks, vs] if ks is not None else [])
    want = [rk, rv] + ([rks, rvs] if rks is not None else [])
    return got, want


def _assert_bit_equal(got, want):
    for name, g, w in zip(["k_cache", "v_cache", "k_scale", "v_scale"], got, want):
        gb, wb = bits(g.cpu()), bits(w)
        if not torch.equal(gb, wb):
            bad = (gb != wb).nonzero()
            raise AssertionError(f"{name}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
                                 f"got {g.cpu()[tuple(bad[0])]}, want {w[tuple(bad[0])]}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("nkv,hd", HEADS)
@pytest.mark.parametrize("t", TOKENS)
def test_kernel_matches_reference(t, nkv, hd, bs, strided, dtype):
    gen = _gen("kernel", t, nkv, hd, bs, strided, dtype)
    num_blocks = (2 * t + 3 * bs) // bs                 # room for every slot, half of them unused
    key, value = make_rows(t, nkv, hd, gen=gen, strided=strided, device="cuda")
    slots = make_slots(t, num_blocks * bs, gen=gen, )
    _assert_bit_equal(*_run_both(key, value, slots.cuda(), num_blocks, bs, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("hd", [8, 40, 64, 96, 200, 512, 1024])
def test_kernel_other_head_dims(hd, dtype):
    """Every lane-group width (1, 2, 4, 8, 16, 32 lanes × 4 chunks), with chunks past hd left
    idle (hd 8, 40, 96, 200)."""
    gen = _gen("hd", hd, dtype)
    key, value = make_rows(33, 3, hd, gen=gen, strided=True, device="cuda")
    slots = make_slots(33, 80, gen=gen)
    _assert_bit_equal(*_run_both(key, value, slots.cuda(), 5, 16, dtype))


@pytest.mark.cuda
def test_kernel_fp8_extreme_row_magnitudes():
    """Rows from 1e-37 to 1e37 side by side in one warp: scales below 2^-100 take the kernel's
    IEEE-division branch, the others the reciprocal branch (the warp diverges per row)."""
    gen = _gen("extreme")
    t, nkv, hd = 64, 2, 256
    key, value = make_rows(t, nkv, hd, gen=gen, strided=True, magnitudes=False)
    mag = 10.0 ** (torch.rand(t, nkv, 1, generator=gen) * 74 - 37)
    mag[::3, 0] = 1e-33                                        # scale ≈ 2^-117 next to ordinary rows
    key, value = (key.float() * mag).bfloat16().cuda(), (value.float() * mag.flip(0)).bfloat16().cuda()
    slots = make_slots(t, 5 * 16, gen=gen)
    _assert_bit_equal(*_run_both(key, value, slots.cuda(), 5, 16, torch.float8_e4m3fn))


def _every_bf16_pair_rows(amax_bits: torch.Tensor, hd: int) -> torch.Tensor:
    """int16 bit patterns [R, hd]: for each amax bit pattern a, rows holding a at position 0 and
    then every bf16 x with |x| ≤ a, both signs (x bits 0..a, each also with the sign bit), hd − 1
    per row, the last row padded with zeros."""
    dev = amax_bits.device
    per_row = hd - 1
    count = 2 * (amax_bits + 1)                                            # x values for each a
    nrows = (count + per_row - 1) // per_row
    row_a = torch.repeat_interleave(amax_bits, nrows)                      # [R]
    first = torch.repeat_interleave(torch.cumsum(nrows, 0) - nrows, nrows)
    j = torch.arange(row_a.numel(), device=dev) - first                    # row within its a
    idx = j[:, None] * per_row + torch.arange(per_row, device=dev)         # [R, hd-1] into a's list
    x = torch.where(idx < 2 * (row_a[:, None] + 1), (idx >> 1) | ((idx & 1) << 15), 0)
    return torch.cat([row_a[:, None], x], 1).to(torch.int32).to(torch.int16)


@pytest.mark.cuda
def test_kernel_fp8_every_bf16_pair():
    """Exhaustive: every positive finite bf16 amax (0x0001..0x7f7f) with every bf16 x, |x| ≤ amax,
    both signs (1.07e9 pairs in 4.2 M rows of hd 256), through the kernel: its reciprocal-plus-
    correction division must give the reference's IEEE x / scale bytes for every one of them.
    The reference runs on the GPU (tensor / tensor division is IEEE there too); rows where it
    disagrees with the kernel are re-checked against the CPU reference before failing."""
    hd, chunk = 256, 1 << 19
    amax_bits = torch.arange(1, 0x7F80, dtype=torch.int64)
    rows_per_a = (2 * (amax_bits + 1) + hd - 2) // (hd - 1)
    bounds = torch.searchsorted(torch.cumsum(rows_per_a, 0), torch.arange(chunk, int(rows_per_a.sum()) + chunk, chunk))
    lo = 0
    for hi in (bounds + 1).clamp(max=amax_bits.numel()).unique().tolist():
        bits16 = _every_bf16_pair_rows(amax_bits[lo:hi].cuda(), hd)        # [R, hd]
        lo = hi
        key = bits16.view(torch.bfloat16).unsqueeze(1)                     # [R, 1, hd]
        value = (bits16 ^ -0x8000).view(torch.bfloat16).unsqueeze(1)       # the same rows negated
        t = key.shape[0]
        num_blocks = (t + 15) // 16
        kc, vc, ks, vs = make_cache(num_blocks, 16, 1, hd, torch.float8_e4m3fn, device="cuda")
        ops.reshape_and_cache(key, value, kc, vc, torch.arange(t, device="cuda"), ks, vs)
        for src, cache, scale in ((key, kc, ks), (value, vc, vs)):
            q, s = reference.quantize_kv_fp8(src[:, 0])                    # on the GPU
            got_q = bits(cache.reshape(-1, hd)[:t])
            got_s = bits(scale.reshape(-1)[:t])
            bad = (got_q != bits(q)).any(-1) | (got_s != bits(s))
            if bad.any():                                                  # the CPU reference decides
                cq, cs = reference.quantize_kv_fp8(src[bad, 0].cpu())
                assert torch.equal(got_q[bad].cpu(), bits(cq)), "E4M3 bytes differ from the reference"
                assert torch.equal(got_s[bad].cpu(), bits(cs)), "scales differ from the reference"
        del bits16, key, value, kc, vc, ks, vs


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_kernel_skips_out_of_range_slots(dtype):
    """On CUDA a slot ≥ num_blocks·bs is not checked (that would sync): the kernel writes nothing."""
    gen = _gen("oob", dtype)
    key, value = make_rows(9, 2, 256, gen=gen, strided=False, device="cuda")
    slots = torch.tensor([3, 32, 10**12, -7, 31, 2**62, 0, 33, 5], dtype=torch.int64, device="cuda")
    _assert_bit_equal(*_run_both(key, value, slots, 2, 16, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_kernel_empty_step(dtype):
    key = torch.empty(0, 2, 256, dtype=torch.bfloat16, device="cuda")
    _assert_bit_equal(*_run_both(key, key, torch.empty(0, dtype=torch.int64, device="cuda"), 2, 16, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_cuda_graph_capture_and_replay(dtype):
    """Capture once, then change the rows and the slots in place and replay: the graph reads
    the new values (nothing was baked in at capture, no host sync inside)."""
    gen = _gen("graph", dtype)
    t, nkv, hd, bs, num_blocks = 8, 4, 256, 16, 6
    key, value = make_rows(t, nkv, hd, gen=gen, strided=True, device="cuda")
    slots = make_slots(t, num_blocks * bs, gen=gen).cuda()
    kc, vc, ks, vs = make_cache(num_blocks, bs, nkv, hd, dtype, device="cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):           # warm up (custom-op dispatch) off the capture
        ops.reshape_and_cache(key, value, kc, vc, slots, ks, vs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.reshape_and_cache(key, value, kc, vc, slots, ks, vs)

    for step in range(2):
        new_key, new_value = make_rows(t, nkv, hd, gen=gen, strided=False, device="cuda")
        key.copy_(new_key)
        value.copy_(new_value)
        slots.copy_(make_slots(t, num_blocks * bs, gen=gen, skip_every=3 + step))
        for x in (kc, vc, ks, vs):
            if x is not None:
                poison_(x)
        graph.replay()
        torch.cuda.synchronize()
        rk, rv, rks, rvs = make_cache(num_blocks, bs, nkv, hd, dtype)
        reference.reshape_and_cache(key.cpu(), value.cpu(), rk, rv, slots.cpu(), rks, rvs)
        got = [kc, vc] + ([ks, vs] if ks is not None else [])
        _assert_bit_equal(got, [rk, rv] + ([rks, rvs] if rks is not None else []))
