"""PagedKvCache / AttentionMetadata: pool layout, allocator edge cases, plan() metadata against a
hand computation and against a token-by-token reference on random batches, CUDA-graph static
metadata, and one negative test per validation rule (matched on the argument name)."""
import random

import pytest
import torch

from atlas import AttentionMetadata, ModelConfig, PagedKvCache
from atlas.kv_cache import KvCacheExhausted

CFG = ModelConfig.tiny()            # nkv 2, hd 64
BLOCK_SIZES = [1, 4, 16, 528]       # 528: the hybrid-model page size vLLM picks (not a power of 2)
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


def make(num_blocks=8, block_size=4, dtype=torch.bfloat16, num_layers=1, device="cpu"):
    return PagedKvCache(CFG, num_layers, num_blocks, dtype, device, block_size=block_size)


def state(cache):
    """Everything the allocator knows, for 'left unchanged' checks."""
    return (list(cache._free), {s: cache.blocks_of(s) for s in cache.seq_ids},
            {s: cache.seq_len(s) for s in cache.seq_ids})


def reference_metadata(cache, seq_ids, query_lens, context_lens, width):
    """Token-by-token expectation from the cache's block lists after the plan."""
    bs = cache.block_size
    positions, slots, qsl, seq_lens, tables = [], [], [0], [], []
    for sid, q, c in zip(seq_ids, query_lens, context_lens):
        blocks = cache.blocks_of(sid)
        for j in range(q):
            p = c + j
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + q)
        seq_lens.append(c + q)
        tables.append(blocks + [0] * (width - len(blocks)))
    return positions, slots, qsl, seq_lens, tables


def check_against_reference(cache, meta):
    pos, slots, qsl, lens, tables = reference_metadata(
        cache, meta.seq_ids, meta.query_lens, meta.context_lens, meta.max_blocks)
    assert meta.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == qsl
    assert meta.seq_lens.tolist() == lens
    assert meta.block_tables.tolist() == tables
    assert (meta.positions.dtype, meta.slot_mapping.dtype) == (torch.int64, torch.int64)
    assert {meta.query_start_loc.dtype, meta.seq_lens.dtype, meta.block_tables.dtype} == {torch.int32}
    assert meta.num_tokens == len(pos) and meta.max_seq_len == max(lens)
    assert meta.max_query_len == max(meta.query_lens) and meta.host_seq_lens == lens


# ---- pools -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 528])
def test_pool_layout(dtype, block_size):
    cache = make(num_blocks=3, block_size=block_size, dtype=dtype, num_layers=2)
    for i in range(2):
        k, v, ks, vs = cache.layer(i)
        for t in (k, v):
            assert t.shape == (3, block_size, 2, 64) and t.dtype == dtype and t.is_contiguous()
            assert torch.isnan(t.float()).all()                   # unwritten slots read as NaN
        if dtype == torch.float8_e4m3fn:
            assert (k.view(torch.uint8) == 0x7F).all()
            for s in (ks, vs):
                assert s.shape == (3, block_size, 2) and s.dtype == torch.float32
                assert s.is_contiguous() and torch.isnan(s).all()
        else:
            assert ks is None and vs is None
    assert cache.k_caches[0].data_ptr() != cache.v_caches[0].data_ptr() != cache.k_caches[1].data_ptr()
    per_token = 2 * 2 * (64 * (1 if dtype == torch.float8_e4m3fn else 2) + (4 if dtype == torch.float8_e4m3fn else 0))
    assert cache.nbytes == 2 * 3 * block_size * per_token


def test_layers_do_not_alias():
    cache = make(num_layers=3)
    cache.k_caches[1].zero_()
    assert torch.isnan(cache.k_caches[0].float()).all() and torch.isnan(cache.v_caches[1].float()).all()
    assert torch.isnan(cache.k_caches[2].float()).all()


# ---- plan(): hand-computed mixed batch -------------------------------------------------------


def test_plan_mixed_batch_hand_computed():
    cache = make(num_blocks=16, block_size=4)
    # step 1: prefill a (6 tokens) and b (3 tokens); fresh cache hands out blocks 0, 1, 2, ...
    m = cache.plan({"a": 6, "b": 3})
    assert m.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert m.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]      # a: blocks 0,1; b: 2
    assert m.query_start_loc.tolist() == [0, 6, 9]
    assert m.seq_lens.tolist() == [6, 3]
    assert m.block_tables.tolist() == [[0, 1], [2, 0]]                  # padded with 0
    assert (m.context_lens, m.query_lens, m.max_query_len, m.max_seq_len) == ([0, 0], [6, 3], 6, 6)

    # step 2: a decodes 1, c prefills a 5-token chunk, b verifies 4 tokens (1 + 3 drafts)
    m = cache.plan({"a": 1, "c": 5, "b": 4})
    assert m.seq_ids == ["a", "c", "b"]
    assert m.positions.tolist() == [6, 0, 1, 2, 3, 4, 3, 4, 5, 6]
    # a pos 6 -> block 1 off 2 = 6; c -> new blocks 3, 4; b pos 3 -> block 2 off 3 = 11,
    # pos 4..6 -> new block 5 off 0..2 = 20..22
    assert m.slot_mapping.tolist() == [6, 12, 13, 14, 15, 16, 11, 20, 21, 22]
    assert m.query_start_loc.tolist() == [0, 1, 6, 10]
    assert m.seq_lens.tolist() == [7, 5, 7]
    assert m.block_tables.tolist() == [[0, 1], [3, 4], [2, 5]]
    assert (m.context_lens, m.query_lens, m.max_query_len, m.max_seq_len) == ([6, 0, 3], [1, 5, 4], 5, 7)
    assert not m.is_decode
    assert [cache.seq_len(s) for s in "abc"] == [7, 7, 5]
    check_against_reference(cache, m)

    # step 3: b rejected 2 drafts -> back to 5 tokens; block 5 still holds pos 4; decode all
    cache.truncate("b", 5)
    m = cache.plan({"a": 1, "b": 1, "c": 1})
    assert m.is_decode and m.positions.tolist() == [7, 5, 5]
    assert m.slot_mapping.tolist() == [7, 21, 17]   # b pos 5 -> block 5 off 1: the rejected slot
    check_against_reference(cache, m)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("seed", range(3))
def test_plan_random_steps_against_reference(block_size, seed):
    """Random prefill chunks / decodes / verify groups / rejections over many steps."""
    rng = random.Random(hash((block_size, seed)))
    num_blocks = 16 if block_size < 528 else 8   # small, so exhaustion happens too
    cache = make(num_blocks=num_blocks, block_size=block_size)
    lens = {}
    for _ in range(12):
        step = {}
        for sid in rng.sample(range(6), rng.randint(1, 4)):
            kind = rng.choice(["prefill", "decode", "verify"])
            step[sid] = {"prefill": rng.randint(1, 2 * block_size + 1), "decode": 1,
                         "verify": rng.randint(2, 5)}[kind]
        try:
            before = state(cache)
            meta = cache.plan(step)
        except KvCacheExhausted:
            assert state(cache) == before
            if not cache.seq_ids:
                continue
            victim = rng.choice(cache.seq_ids)
            cache.free(victim)
            lens.pop(victim)
            continue
        assert meta.context_lens == [lens.get(s, 0) for s in step]
        for sid, n in step.items():
            lens[sid] = lens.get(sid, 0) + n
        check_against_reference(cache, meta)
        # every block is owned by one sequence or free, and each owns ceil(len / bs)
        owned = [b for s in cache.seq_ids for b in cache.blocks_of(s)]
        assert sorted(owned + cache._free) == list(range(num_blocks))
        for sid in cache.seq_ids:
            assert len(cache.blocks_of(sid)) == -(-lens[sid] // block_size)
        # reject a random number of trailing tokens of one sequence
        sid = rng.choice(list(step))
        new_len = max(0, lens[sid] - rng.randint(0, 3))
        cache.truncate(sid, new_len)
        lens[sid] = new_len
        assert {s: cache.seq_len(s) for s in cache.seq_ids} == lens


def test_plan_zero_tokens_and_new_empty_seq():
    cache = make()
    m = cache.plan({"a": 3, "b": 0})
    assert m.query_start_loc.tolist() == [0, 3, 3] and m.seq_lens.tolist() == [3, 0]
    assert cache.blocks_of("b") == [] and cache.seq_len("b") == 0
    m = cache.plan({"b": 0})
    assert m.num_tokens == 0 and m.block_tables.shape == (1, 1)   # width is at least 1


def test_plan_metadata_is_one_buffer():
    """All five device tensors are views of one flat buffer (hence one host→device copy)."""
    m = make().plan({"a": 5, "b": 2})
    ptrs = {t.untyped_storage().data_ptr() for t in
            (m.positions, m.slot_mapping, m.query_start_loc, m.seq_lens, m.block_tables)}
    assert ptrs == {m._buffer.untyped_storage().data_ptr()}


def test_max_blocks_per_seq_fixes_width():
    cache = make(block_size=4)
    m = cache.plan({"a": 5, "b": 1}, max_blocks_per_seq=4)
    assert m.block_tables.tolist() == [[0, 1, 0, 0], [2, 0, 0, 0]]
    check_against_reference(cache, m)
    before = state(cache)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        cache.plan({"b": 1, "a": 12}, max_blocks_per_seq=4)    # a would need 5 blocks
    assert state(cache) == before


# ---- allocator edge cases --------------------------------------------------------------------


def test_exact_fit_then_exhausted():
    cache = make(num_blocks=4, block_size=4)
    with pytest.raises(KvCacheExhausted, match="needs 5 new blocks but only 4 of 4 are free") as e:
        cache.plan({"a": 10, "b": 6})          # 3 + 2 blocks
    assert (e.value.needed, e.value.free) == (5, 4)
    assert cache.seq_ids == [] and cache.num_free_blocks == 4     # nothing registered
    m = cache.plan({"a": 8, "b": 8})           # 2 + 2 blocks: exact fit
    assert cache.num_free_blocks == 0 and m.slot_mapping.tolist() == list(range(16))
    cache.plan({"a": 0})                        # needs no block: fine when full
    with pytest.raises(KvCacheExhausted, match="needs 1 new blocks but only 0"):
        cache.plan({"a": 1})


def test_exhaustion_leaves_every_sequence_unchanged():
    cache = make(num_blocks=6, block_size=4)
    cache.plan({"a": 5, "b": 3})               # a: 2 blocks, b: 1 -> 3 free
    before = state(cache)
    # a fits (1 more block), b fits (1 more), new c needs 3: 5 > 3 -> nothing at all happens
    with pytest.raises(KvCacheExhausted):
        cache.plan({"a": 4, "b": 2, "c": 9})
    assert state(cache) == before and "c" not in cache
    m = cache.plan({"a": 4, "b": 2})           # the fitting part alone still works
    assert m.context_lens == [5, 3]


def test_free_and_reuse():
    cache = make(num_blocks=4, block_size=4)
    cache.plan({"a": 8, "b": 4})               # a: 0, 1; b: 2
    cache.free("a")
    assert "a" not in cache and cache.num_free_blocks == 3
    m = cache.plan({"c": 12})                  # last freed first: a's blocks 0, 1 then 3
    assert cache.blocks_of("c") == [0, 1, 3]
    check_against_reference(cache, m)
    with pytest.raises(ValueError, match="seq_id 'a'"):
        cache.seq_len("a")
    with pytest.raises(KvCacheExhausted):      # cache full again
        cache.plan({"a": 1})
    assert "a" not in cache                    # the failed plan did not register a


def test_truncate_across_block_boundary_frees_blocks():
    cache = make(num_blocks=8, block_size=4)
    cache.plan({"a": 10})                      # blocks 0, 1, 2 (pos 8, 9 in block 2)
    cache.truncate("a", 8)                     # block 2 no longer needed
    assert cache.blocks_of("a") == [0, 1] and cache.num_free_blocks == 6
    cache.truncate("a", 5)                     # pos 4 still in block 1
    assert cache.blocks_of("a") == [0, 1] and cache.seq_len("a") == 5
    cache.truncate("a", 4)
    assert cache.blocks_of("a") == [0] and cache.num_free_blocks == 7
    cache.truncate("a", 0)
    assert cache.blocks_of("a") == [] and cache.num_free_blocks == 8 and "a" in cache
    cache.truncate("a", 0)                     # no-op


def test_truncate_then_plan_reuses_slots():
    """Rejected drafts: the next step rewrites the very slots the rejected tokens took."""
    cache = make(num_blocks=8, block_size=4)
    cache.plan({"x": 2, "a": 3})               # a: block 1, slots 4..6
    verify = cache.plan({"a": 4})              # a: pos 3..6 -> slots 7, then block 2: 8..10
    assert verify.slot_mapping.tolist() == [7, 8, 9, 10]
    cache.truncate("a", 4)                     # accept 1 of 3 drafts: block 2 freed
    assert cache.blocks_of("a") == [1]
    again = cache.plan({"a": 3})
    assert again.positions.tolist() == [4, 5, 6]
    assert again.slot_mapping.tolist() == [8, 9, 10]
    check_against_reference(cache, again)


# ---- with the KV writer: plan() slots and block tables address the same cache rows ----------


def _write_and_gather(device, dtype, block_size):
    """Write random K/V rows through ops.reshape_and_cache at plan() slots over a few steps
    (with a rejection), then gather every sequence back through block_tables / seq_lens."""
    from atlas import ops
    gen = torch.Generator().manual_seed(block_size * 7 + (dtype == torch.bfloat16))
    cache = make(num_blocks=24, block_size=block_size, dtype=dtype, device=device)
    k_cache, v_cache, k_scale, v_scale = cache.layer(0)
    written = {}   # seq -> list of K rows [nkv, hd] in position order
    for step, reject in (({"a": 9, "b": 2}, None), ({"b": 5, "a": 1}, ("b", 4)),
                         ({"b": 1, "c": 3, "a": 1}, None)):
        meta = cache.plan(step)
        key = (torch.randn(meta.num_tokens, 2, 64, generator=gen) * 30).to(torch.bfloat16)
        ops.reshape_and_cache(key.to(device), key.to(device), k_cache, v_cache, meta.slot_mapping,
                              k_scale, v_scale)
        for sid, lo, n in zip(meta.seq_ids, meta.query_start_loc.tolist(), meta.query_lens):
            written.setdefault(sid, []).extend(key[lo:lo + n])
        if reject:
            cache.truncate(*reject)
            del written[reject[0]][reject[1]:]
    meta = cache.plan({s: 0 for s in written})
    bt, lens = meta.block_tables.cpu(), meta.seq_lens.tolist()
    for row, sid in enumerate(meta.seq_ids):
        pos = torch.arange(lens[row])
        blocks = bt[row, pos // block_size].long()
        got = k_cache.cpu()[blocks, pos % block_size].float()
        want = torch.stack(written[sid]).float()
        if k_scale is None:
            assert torch.equal(got, want), sid          # bf16 rows are copied bit for bit
        else:
            scale = k_scale.cpu()[blocks, pos % block_size].unsqueeze(-1)
            got = got * scale
            # e4m3 rounding: relative 2^-4 (half of a 3-bit ulp) for normals, absolute
            # 2^-10 · scale (half the subnormal step 2^-9) near 0; 1.01 covers f32 rounding
            bound = 1.01 * torch.maximum(want.abs() * 2 ** -4, scale * 2 ** -10)
            assert ((got - want).abs() <= bound).all(), sid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_plan_addresses_what_reshape_and_cache_wrote(dtype, block_size):
    _write_and_gather("cpu", dtype, block_size)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 528])
def test_cuda_plan_addresses_what_reshape_and_cache_wrote(dtype, block_size):
    _write_and_gather("cuda", dtype, block_size)


# ---- AttentionMetadata -----------------------------------------------------------------------


def test_copy_into_static_metadata():
    cache = make(num_blocks=16, block_size=4)
    static = AttentionMetadata.empty(3, 2, 4, block_size=4, device="cpu")
    assert static.slot_mapping.tolist() == [-1, -1, -1] and static.query_start_loc.tolist() == [0, 3, 3]
    step = cache.plan({"a": 2, "b": 1}, max_blocks_per_seq=4)
    out = static.copy_(step)
    assert out is static
    for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(static, name), getattr(step, name)), name
        assert getattr(static, name).data_ptr() != getattr(step, name).data_ptr()
    assert (static.seq_ids, static.query_lens, static.context_lens) == (["a", "b"], [2, 1], [0, 0])
    assert static.max_seq_len == 2
    # a metadata not backed by one buffer is copied tensor by tensor
    loose = AttentionMetadata.from_tensors(*(getattr(step, n).clone() for n in (
        "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")), block_size=4)
    assert torch.equal(static.copy_(loose).block_tables, step.block_tables)


@pytest.mark.parametrize("step,match", [
    ({"a": 2, "b": 2}, "num_tokens"),
    ({"a": 3}, "num_seqs"),
])
def test_copy_shape_mismatch(step, match):
    cache = make(num_blocks=16, block_size=4)
    static = AttentionMetadata.empty(3, 2, 4, block_size=4, device="cpu")
    with pytest.raises(ValueError, match=match):
        static.copy_(cache.plan(step, max_blocks_per_seq=4))


def test_copy_width_and_block_size_mismatch():
    cache = make(num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="max_blocks"):
        AttentionMetadata.empty(3, 2, 4, block_size=4, device="cpu").copy_(cache.plan({"a": 2, "b": 1}))
    with pytest.raises(ValueError, match="block_size"):
        AttentionMetadata.empty(3, 2, 4, block_size=8, device="cpu").copy_(
            cache.plan({"a": 2, "b": 1}, max_blocks_per_seq=4))
    with pytest.raises(TypeError, match="other"):
        AttentionMetadata.empty(3, 2, 4, block_size=4, device="cpu").copy_({"a": 1})


def test_from_tensors_host_fields():
    m = AttentionMetadata.from_tensors(
        torch.tensor([7, 0, 1, 2]), torch.tensor([7, 8, 9, 10]),
        torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([8, 3], dtype=torch.int32),
        torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), block_size=4, seq_ids=["a", "b"])
    assert (m.query_lens, m.context_lens, m.max_query_len, m.max_seq_len, m.num_tokens) == \
        ([1, 3], [7, 0], 3, 8, 4)


@pytest.mark.parametrize("bad,match,exc", [
    (dict(positions=torch.zeros(3, dtype=torch.int32)), "positions", TypeError),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.int64)), "slot_mapping", ValueError),
    (dict(query_start_loc=torch.zeros(3, dtype=torch.int64)), "query_start_loc", TypeError),
    (dict(query_start_loc=torch.zeros(1, dtype=torch.int32)), "query_start_loc", ValueError),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), "seq_lens", ValueError),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)), "block_tables", TypeError),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "block_tables", ValueError),
    (dict(block_tables=torch.zeros(4, 2, dtype=torch.int32).t()), "block_tables", ValueError),
    (dict(block_size=0), "block_size", ValueError),
])
def test_metadata_validation(bad, match, exc):
    args = dict(positions=torch.zeros(3, dtype=torch.int64), slot_mapping=torch.zeros(3, dtype=torch.int64),
                query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
                seq_lens=torch.tensor([1, 2], dtype=torch.int32),
                block_tables=torch.zeros(2, 4, dtype=torch.int32), block_size=4)
    args.update(bad)
    with pytest.raises(exc, match=match):
        AttentionMetadata.from_tensors(**args)


@pytest.mark.parametrize("args,match,exc", [
    ((-1, 2, 4), "num_tokens", ValueError),
    ((3, 0, 4), "num_seqs", ValueError),
    ((3, 2, 0), "max_blocks", ValueError),
    ((3.0, 2, 4), "num_tokens", TypeError),
])
def test_empty_validation(args, match, exc):
    with pytest.raises(exc, match=match):
        AttentionMetadata.empty(*args, block_size=4, device="cpu")


# ---- negative tests: PagedKvCache ------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match,exc", [
    (dict(cfg={"hidden_size": 64}), "cfg", TypeError),
    (dict(num_layers=0), "num_layers", ValueError),
    (dict(num_blocks=0), "num_blocks", ValueError),
    (dict(num_blocks=2.0), "num_blocks", TypeError),
    (dict(dtype=torch.float16), "dtype", TypeError),
    (dict(block_size=0), "block_size", ValueError),
])
def test_constructor_validation(kwargs, match, exc):
    args = dict(cfg=CFG, num_layers=1, num_blocks=4, dtype=torch.bfloat16, device="cpu", block_size=4)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        PagedKvCache(args.pop("cfg"), args.pop("num_layers"), args.pop("num_blocks"), **args)


@pytest.mark.parametrize("new_tokens,match,exc", [
    ([("a", 1)], "new_tokens must be a mapping", TypeError),
    ({}, "at least one sequence", ValueError),
    ({"a": -1}, r"new_tokens\['a'\] must be >= 0", ValueError),
    ({"a": 1.0}, r"new_tokens\['a'\] must be an int", TypeError),
    ({"a": True}, r"new_tokens\['a'\] must be an int", TypeError),
])
def test_plan_validation(new_tokens, match, exc):
    cache = make()
    cache.plan({"a": 2})
    before = state(cache)
    with pytest.raises(exc, match=match):
        cache.plan(new_tokens)
    assert state(cache) == before


def test_plan_bad_max_blocks_per_seq():
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        make().plan({"a": 1}, max_blocks_per_seq=0)


def test_truncate_validation():
    cache = make()
    cache.plan({"a": 5})
    with pytest.raises(ValueError, match="seq_id 'z'"):
        cache.truncate("z", 0)
    with pytest.raises(ValueError, match="new_len must be <= seq_len"):
        cache.truncate("a", 6)
    with pytest.raises(ValueError, match="new_len must be >= 0"):
        cache.truncate("a", -1)
    with pytest.raises(TypeError, match="new_len"):
        cache.truncate("a", 2.0)
    assert cache.seq_len("a") == 5


@pytest.mark.parametrize("method", ["free", "seq_len", "blocks_of"])
def test_unknown_seq_id(method):
    with pytest.raises(ValueError, match="seq_id 7 is not in the cache"):
        getattr(make(), method)(7)


def test_layer_index_validation():
    cache = make(num_layers=2)
    with pytest.raises(ValueError, match="i must be < num_layers"):
        cache.layer(2)
    with pytest.raises(ValueError, match="i must be >= 0"):
        cache.layer(-1)


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_plan_matches_cpu(dtype):
    steps = [{"a": 20, "b": 1}, {"a": 1, "c": 7, "b": 4}, {"a": 1, "b": 1, "c": 1}]
    gpu = make(num_blocks=32, block_size=16, dtype=dtype, num_layers=2, device="cuda")
    cpu = make(num_blocks=32, block_size=16, dtype=dtype, num_layers=2, device="cpu")
    assert gpu.k_caches[1].is_cuda and (dtype == torch.bfloat16 or gpu.k_scales[1].is_cuda)
    for step in steps:
        mg, mc = gpu.plan(step), cpu.plan(step)
        for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            t = getattr(mg, name)
            assert t.is_cuda, name
            assert torch.equal(t.cpu(), getattr(mc, name)), name
        gpu.truncate("b", gpu.seq_len("b") - 1)
        cpu.truncate("b", cpu.seq_len("b") - 1)


@pytest.mark.cuda
def test_cuda_graph_replays_refreshed_metadata():
    """A graph captured on static metadata sees each step after static.copy_(plan(...))."""
    cache = make(num_blocks=32, block_size=16, device="cuda")
    static = AttentionMetadata.empty(3, 2, 4, block_size=16, device="cuda")
    out = torch.empty(3, dtype=torch.int64, device="cuda")

    def body():   # stands in for a decode op reading the metadata on the device
        rows = torch.arange(3, device="cuda")
        seq = torch.searchsorted(static.query_start_loc[1:].long(), rows, right=True)
        out.copy_(static.slot_mapping * 1000 + static.positions * 10 + seq)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()   # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for step in ({"a": 2, "b": 1}, {"a": 1, "b": 2}, {"b": 1, "a": 2}):
        meta = cache.plan(step, max_blocks_per_seq=4)
        static.copy_(meta)
        graph.replay()
        rows = torch.arange(3)
        seq = torch.searchsorted(meta.query_start_loc[1:].long().cpu(), rows, right=True)
        want = meta.slot_mapping.cpu() * 1000 + meta.positions.cpu() * 10 + seq
        assert torch.equal(out.cpu(), want)
