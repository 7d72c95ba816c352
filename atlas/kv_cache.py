"""Paged KV cache (per-layer K/V block pools + a host-side block allocator) and the per-step
attention metadata that every attention layer of a step shares.

Layout (DESIGN "Formats", fixed; the reshape_and_cache / paged_decode kernels read it):

    k_cache, v_cache  [num_blocks, bs, nkv, hd]  bf16 | float8_e4m3fn   (one pair per layer)
    k_scale, v_scale  [num_blocks, bs, nkv]      float32, FP8 only: one scale per (token, kv
                                                 head) = amax(row) / 448, stored value x / scale
    slot = block · bs + offset                   int64; < 0 means "skip this row"

Planning is separate from running (as FlashInfer's plan/run): `PagedKvCache.plan()` runs once
per step on the host, allocates the blocks the step's new tokens need and builds an
`AttentionMetadata` on the device with ONE host→device copy; all layers of the step then reuse
it. plan() is the only place in a step that runs on the host and may sync; in fact it never
waits on the GPU (its copy is async, from pinned memory), and nothing after it in the decode
path touches the host. Call it outside CUDA-graph capture.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from atlas._validate import check_tensor, describe
from atlas.config import ModelConfig

KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
FP8_E4M3_MAX = 448.0   # largest finite float8_e4m3fn; an FP8 row's scale is amax / FP8_E4M3_MAX
_FP8_NAN_BYTE = 0x7F   # e4m3fn S.1111.111 = NaN: fresh FP8 caches read as NaN until written


class KvCacheExhausted(RuntimeError):
    """plan() needs more free blocks than the cache has. The cache is left unchanged.

    Attributes: needed (blocks the plan needs), free (blocks free)."""

    def __init__(self, needed: int, free: int, num_blocks: int):
        self.needed, self.free, self.num_blocks = needed, free, num_blocks
        super().__init__(f"PagedKvCache.plan: needs {needed} new blocks but only {free} of "
                         f"{num_blocks} are free (free or truncate sequences, or build a larger "
                         "cache); nothing was allocated")


# =============================================================================================
# AttentionMetadata
# =============================================================================================


@dataclass(eq=False)
class AttentionMetadata:
    """Where the T rows of one step sit in the paged cache, for B sequences.

    Rows are grouped per sequence in plan() order: sequence b owns rows
    query_start_loc[b] : query_start_loc[b + 1] (a prefill chunk, one decode token, or a group of
    verify tokens). Device tensors (what kernels read; graph-capturable):

        positions        int64 [T]       RoPE position of each row = context_len + j
        slot_mapping     int64 [T]       cache slot each row's K/V is written to
                                         (block · bs + offset; < 0 = skip, used for padding)
        query_start_loc  int32 [B + 1]   row offsets, query_start_loc[0] = 0, [B] = T
        seq_lens         int32 [B]       tokens in the cache after this step (context + new)
        block_tables     int32 [B, W]    logical → physical block; entries at or past
                                         ceil(seq_lens[b] / bs) are padding (0, a valid block id,
                                         so a stray read stays in bounds) and must not be read

    Host-side fields (Python, read without a sync): seq_ids, query_lens, context_lens (tokens
    cached before this step), max_query_len, max_seq_len, num_tokens (T), block_size (bs).

    For CUDA graphs: allocate static metadata once (`AttentionMetadata.empty(...)` or keep the
    first plan's), capture with it, then before each replay `static.copy_(cache.plan(...))`
    with the same T, B and W (plan with `max_blocks_per_seq=W` to fix the width). A graph sees
    only the device tensors; host fields read during capture are frozen into it.
    """

    positions: Tensor
    slot_mapping: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    block_size: int
    seq_ids: list = field(default_factory=list)
    query_lens: list = field(default_factory=list)
    context_lens: list = field(default_factory=list)
    max_query_len: int = 0
    max_seq_len: int = 0
    num_tokens: int = 0
    _buffer: Optional[Tensor] = field(default=None, repr=False)   # flat storage of the views

    def __post_init__(self):
        op = "AttentionMetadata"
        check_tensor(op, "positions", self.positions, dtype=torch.int64, ndim=1, contiguous=True,
                     what="int64 [T]")
        t = self.positions.shape[0]
        dev = self.positions.device
        check_tensor(op, "slot_mapping", self.slot_mapping, dtype=torch.int64, shape=(t,),
                     device=dev, contiguous=True, what="int64 [T]")
        check_tensor(op, "query_start_loc", self.query_start_loc, dtype=torch.int32, ndim=1,
                     device=dev, contiguous=True, what="int32 [B + 1]")
        b = self.query_start_loc.shape[0] - 1
        if b < 1:
            raise ValueError(f"{op}: query_start_loc must be int32 [B + 1] with B >= 1, "
                             f"got {describe(self.query_start_loc)}")
        check_tensor(op, "seq_lens", self.seq_lens, dtype=torch.int32, shape=(b,), device=dev,
                     contiguous=True, what="int32 [B]")
        check_tensor(op, "block_tables", self.block_tables, dtype=torch.int32, ndim=2,
                     shape=(b, None), device=dev, contiguous=True, what="int32 [B, max_blocks]")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1:
            raise ValueError(f"{op}: block_size must be an int >= 1, got {self.block_size!r}")
        for name in ("seq_ids", "query_lens", "context_lens"):
            if len(getattr(self, name)) != b:
                raise ValueError(f"{op}: {name} must have B = {b} entries, "
                                 f"got {len(getattr(self, name))}")
        if self.num_tokens != t:
            raise ValueError(f"{op}: num_tokens must equal T = {t}, got {self.num_tokens}")

    # ---- shape -----------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences in the step."""
        return self.seq_lens.shape[0]

    @property
    def max_blocks(self) -> int:
        """W, the block_tables width."""
        return self.block_tables.shape[1]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new row (a plain decode step)."""
        return all(q == 1 for q in self.query_lens)

    @property
    def host_seq_lens(self) -> list[int]:
        """seq_lens on the host: context_lens[b] + query_lens[b]."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    # ---- construction for static (CUDA-graph) buffers --------------------------------------

    @classmethod
    def empty(cls, num_tokens: int, num_seqs: int, max_blocks: int, *, block_size: int,
              device: torch.device | str = "cuda") -> "AttentionMetadata":
        """Static metadata buffers for CUDA-graph capture, filled with a harmless step: every row
        is a skip row (slot −1) of sequence 0 at position 0, seq_lens 0, block_tables 0.

        Args:
            num_tokens: T >= 0; num_seqs: B >= 1; max_blocks: W >= 1; block_size: bs >= 1.
        Example:
            >>> m = AttentionMetadata.empty(4, 2, 3, block_size=16, device="cpu")
            >>> m.block_tables.shape, m.slot_mapping.tolist()
            (torch.Size([2, 3]), [-1, -1, -1, -1])
        """
        op = "AttentionMetadata.empty"
        for name, v, lo in (("num_tokens", num_tokens, 0), ("num_seqs", num_seqs, 1),
                            ("max_blocks", max_blocks, 1), ("block_size", block_size, 1)):
            _check_count(op, name, v, minimum=lo)
        buf, views = _packed_buffers(num_tokens, num_seqs, max_blocks, torch.device("cpu"))
        buf.zero_()
        views["slot_mapping"].fill_(-1)
        views["query_start_loc"][1:] = num_tokens
        dev_buf, dev_views = _to_device(buf, num_tokens, num_seqs, max_blocks, torch.device(device))
        return cls(**dev_views, block_size=block_size, seq_ids=[None] * num_seqs,
                   query_lens=[num_tokens] + [0] * (num_seqs - 1), context_lens=[0] * num_seqs,
                   max_query_len=num_tokens, max_seq_len=0, num_tokens=num_tokens,
                   _buffer=dev_buf)

    @classmethod
    def from_tensors(cls, positions: Tensor, slot_mapping: Tensor, query_start_loc: Tensor,
                     seq_lens: Tensor, block_tables: Tensor, *, block_size: int,
                     seq_ids: Optional[Sequence[Hashable]] = None) -> "AttentionMetadata":
        """Wrap existing device tensors (shapes and dtypes as in the class docstring).

        The host fields are read back from query_start_loc and seq_lens: this syncs with the
        device, so call it outside the decode loop. seq_ids default to 0..B-1.
        """
        b = query_start_loc.shape[0] - 1 if isinstance(query_start_loc, Tensor) else -1
        if b < 1:   # let __post_init__ produce the usual message
            return cls(positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                       block_size=block_size)
        qsl = query_start_loc.tolist()   # host sync (documented above)
        lens = seq_lens.tolist() if isinstance(seq_lens, Tensor) else []
        query_lens = [qsl[i + 1] - qsl[i] for i in range(b)]
        context_lens = [s - q for s, q in zip(lens, query_lens)]
        return cls(positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                   block_size=block_size,
                   seq_ids=list(range(b)) if seq_ids is None else list(seq_ids),
                   query_lens=query_lens, context_lens=context_lens,
                   max_query_len=max(query_lens), max_seq_len=max(lens) if lens else 0,
                   num_tokens=positions.shape[0] if isinstance(positions, Tensor) else 0)

    def copy_(self, other: "AttentionMetadata") -> "AttentionMetadata":
        """Copy another metadata's device tensors (and host fields) into this one's buffers, in
        place, so a CUDA graph captured with this metadata replays the other step.

        Needs the same T (num_tokens), B (num_seqs), W (max_blocks) and block_size. The copy
        is enqueued on the current stream (one device copy when both sides come from plan() /
        empty(), else five); no host sync. Returns self.

        Raises:
            TypeError: other is not an AttentionMetadata.
            ValueError: T, B, W or block_size differ (named in the message).
        """
        op = "AttentionMetadata.copy_"
        if not isinstance(other, AttentionMetadata):
            raise TypeError(f"{op}: other must be an AttentionMetadata, got {type(other).__name__}")
        for name in ("num_tokens", "num_seqs", "max_blocks", "block_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise ValueError(f"{op}: other has {name} = {theirs} but this metadata has "
                                 f"{mine}; static metadata needs identical shapes (plan with "
                                 "max_blocks_per_seq to fix the block_tables width)")
        if (self._buffer is not None and other._buffer is not None
                and self._buffer.shape == other._buffer.shape):
            self._buffer.copy_(other._buffer, non_blocking=True)
        else:
            for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
                getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        self.seq_ids = list(other.seq_ids)
        self.query_lens = list(other.query_lens)
        self.context_lens = list(other.context_lens)
        self.max_query_len, self.max_seq_len = other.max_query_len, other.max_seq_len
        return self


# =============================================================================================
# PagedKvCache
# =============================================================================================


class PagedKvCache:
    """Per-layer paged K/V pools plus a free-list block allocator with per-sequence block lists.

    Args:
        cfg: ModelConfig; nkv = cfg.num_key_value_heads, hd = cfg.head_dim.
        num_layers: number of attention layers with a cache (e.g. len(cfg.full_attention_layers),
            or 1 for an MTP head). Layers are indexed 0..num_layers-1 here; mapping model layer
            indices onto them is the caller's business.
        num_blocks: blocks in each pool (every layer uses the same block ids).
        dtype: torch.bfloat16 (default) or torch.float8_e4m3fn.
        device: where the pools live (default "cuda"; "cpu" for the reference path).
        block_size: tokens per block, bs (default 16; any size >= 1, e.g. 528 for hybrid models).

    Attributes:
        k_caches, v_caches: lists of num_layers tensors [num_blocks, bs, nkv, hd] dtype.
            Fresh pools are NaN (bf16) or 0x7F NaN bytes (fp8), so a read of an unwritten slot
            shows up as NaN.
        k_scales, v_scales: FP8: lists of float32 [num_blocks, bs, nkv] (scale of each
            (token, kv head) row = amax / 448, written by reshape_and_cache; fresh = NaN).
            BF16: lists of None.
        num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device.

    The allocator is host-side Python state: plan() allocates, truncate() and free() give
    blocks back; block ids are reused last-freed-first. It is not thread-safe.

    Example:
        >>> cache = PagedKvCache(ModelConfig.tiny(), 1, 8, device="cpu", block_size=4)
        >>> meta = cache.plan({"a": 5, "b": 1})        # prefill 5 tokens of a, 1 of b
        >>> meta.slot_mapping.tolist(), meta.block_tables.tolist()
        ([0, 1, 2, 3, 4, 8], [[0, 1], [2, 0]])
        >>> meta = cache.plan({"a": 1})                 # decode one token of a
        >>> meta.positions.tolist(), meta.seq_lens.tolist()
        ([5], [6])
    """

    def __init__(self, cfg: ModelConfig, num_layers: int, num_blocks: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda", *,
                 block_size: int = 16):
        op = "PagedKvCache"
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"{op}: cfg must be an atlas.ModelConfig, got {type(cfg).__name__}")
        _check_count(op, "num_layers", num_layers, minimum=1)
        _check_count(op, "num_blocks", num_blocks, minimum=1)
        _check_count(op, "block_size", block_size, minimum=1)
        if dtype not in KV_DTYPES:
            raise TypeError(f"{op}: dtype must be bfloat16 or float8_e4m3fn, got {dtype}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.cfg = cfg

        # One allocation for all pools: [L, 2 (K, V), num_blocks, bs, nkv, hd]; each layer's K
        # and V are contiguous views of it.
        pools = torch.empty((num_layers, 2, num_blocks, block_size, self.num_kv_heads,
                             self.head_dim), dtype=dtype, device=self.device)
        if dtype == torch.float8_e4m3fn:
            pools.view(torch.uint8).fill_(_FP8_NAN_BYTE)
            scales = torch.full((num_layers, 2, num_blocks, block_size, self.num_kv_heads),
                                float("nan"), dtype=torch.float32, device=self.device)
            self.k_scales: list[Optional[Tensor]] = [scales[i, 0] for i in range(num_layers)]
            self.v_scales: list[Optional[Tensor]] = [scales[i, 1] for i in range(num_layers)]
        else:
            pools.fill_(float("nan"))
            self.k_scales = [None] * num_layers
            self.v_scales = [None] * num_layers
        self.k_caches: list[Tensor] = [pools[i, 0] for i in range(num_layers)]
        self.v_caches: list[Tensor] = [pools[i, 1] for i in range(num_layers)]

        # Allocator state. _free is a stack: pop() hands out the most recently freed block, and
        # a fresh cache hands out 0, 1, 2, ... in order.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[Hashable, array] = {}   # seq id -> physical block ids (int32)
        self._lens: dict[Hashable, int] = {}       # seq id -> tokens in the cache

    # ---- pools -------------------------------------------------------------------------------

    def layer(self, i: int) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """(k_cache, v_cache, k_scale, v_scale) of layer i; the scales are None for BF16."""
        _check_count("PagedKvCache.layer", "i", i, minimum=0)
        if i >= self.num_layers:
            raise ValueError(f"PagedKvCache.layer: i must be < num_layers = {self.num_layers}, got {i}")
        return self.k_caches[i], self.v_caches[i], self.k_scales[i], self.v_scales[i]

    @property
    def nbytes(self) -> int:
        """Device bytes of all pools and scales."""
        per_token = 2 * self.num_kv_heads * (self.head_dim * self.k_caches[0].element_size()
                                             + (4 if self.dtype == torch.float8_e4m3fn else 0))
        return self.num_layers * self.num_blocks * self.block_size * per_token

    # ---- allocator queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def seq_ids(self) -> list:
        """Sequences known to the cache, in registration order."""
        return list(self._lens)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._lens

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens of seq_id in the cache (counting every token planned so far)."""
        self._check_known("seq_len", seq_id)
        return self._lens[seq_id]

    def blocks_of(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of seq_id, in logical order (a copy)."""
        self._check_known("blocks_of", seq_id)
        return list(self._blocks[seq_id])

    # ---- allocator updates -------------------------------------------------------------------

    def plan(self, new_tokens: Mapping[Hashable, int], *,
             max_blocks_per_seq: Optional[int] = None) -> AttentionMetadata:
        """Allocate blocks for one step's new tokens and build its AttentionMetadata on device.

        Args:
            new_tokens: {seq_id: num_new_tokens} in row order (a dict keeps insertion order).
                An unknown seq_id starts a new sequence at length 0. Counts are ints >= 0 (0
                keeps the sequence in the batch with no rows).
            max_blocks_per_seq: fix the block_tables width W (e.g. for CUDA-graph static
                metadata); default: the largest block count in this step (at least 1).
        Returns:
            AttentionMetadata with T = sum of counts rows. The tokens count as written from
            now on: seq_len(seq_id) grows by its count (undo rejected drafts with truncate()).
        Raises:
            TypeError: new_tokens is not a mapping, or a count is not an int.
            ValueError: empty new_tokens, a negative count, or a sequence that would need more
                than max_blocks_per_seq blocks.
            KvCacheExhausted: not enough free blocks; the cache is left exactly as it was.

        One host→device copy (from pinned memory, async); no host sync.
        """
        op = "PagedKvCache.plan"
        if not isinstance(new_tokens, Mapping):
            raise TypeError(f"{op}: new_tokens must be a mapping {{seq_id: num_new_tokens}}, "
                            f"got {type(new_tokens).__name__}")
        if len(new_tokens) == 0:
            raise ValueError(f"{op}: new_tokens must name at least one sequence")
        if max_blocks_per_seq is not None:
            _check_count(op, "max_blocks_per_seq", max_blocks_per_seq, minimum=1)
        bs = self.block_size

        # 1. validate everything and count blocks before touching any state
        seq_ids = list(new_tokens)
        query_lens, context_lens, grow = [], [], []
        for sid in seq_ids:
            n = new_tokens[sid]
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"{op}: new_tokens[{sid!r}] must be an int, got {type(n).__name__}")
            if n < 0:
                raise ValueError(f"{op}: new_tokens[{sid!r}] must be >= 0, got {n}")
            ctx = self._lens.get(sid, 0)
            have = len(self._blocks[sid]) if sid in self._blocks else 0
            need = -(-(ctx + n) // bs)
            if max_blocks_per_seq is not None and need > max_blocks_per_seq:
                raise ValueError(f"{op}: sequence {sid!r} needs {need} blocks for {ctx + n} "
                                 f"tokens but max_blocks_per_seq is {max_blocks_per_seq}")
            query_lens.append(n)
            context_lens.append(ctx)
            grow.append(max(need - have, 0))
        needed = sum(grow)
        if needed > len(self._free):
            raise KvCacheExhausted(needed, len(self._free), self.num_blocks)

        # 2. commit: allocate blocks, advance lengths
        for sid, n, g in zip(seq_ids, query_lens, grow):
            blocks = self._blocks.setdefault(sid, array("i"))
            for _ in range(g):
                blocks.append(self._free.pop())
            self._lens[sid] = self._lens.get(sid, 0) + n

        # 3. build the metadata in one host buffer, copy it once
        b, t = len(seq_ids), sum(query_lens)
        width = max_blocks_per_seq or max(1, max(len(self._blocks[s]) for s in seq_ids))
        buf, v = _packed_buffers(t, b, width, self.device)
        ctx_t = torch.tensor(context_lens, dtype=torch.int64)
        qlen_t = torch.tensor(query_lens, dtype=torch.int64)
        qsl = torch.zeros(b + 1, dtype=torch.int64)
        torch.cumsum(qlen_t, 0, out=qsl[1:])
        v["query_start_loc"].copy_(qsl)
        v["seq_lens"].copy_(ctx_t + qlen_t)
        # block_tables: all block lists concatenated (memcpy per sequence), then scattered into
        # the row-major [B, W] table through a "column < blocks of the row" mask, padding 0
        # (see AttentionMetadata). Two ops instead of two per row (CPU, 1 thread: B = 256 x W =
        # 125: 6 ms -> 0.5 ms; B = 64 x W = 8000: 2.2 ms, the table is 2 MB). A persistent host
        # table updated by the allocator would make this O(new blocks); not needed yet.
        bt = v["block_tables"]
        flat = array("i")
        for sid in seq_ids:
            flat.extend(self._blocks[sid])
        nblk = torch.tensor([len(self._blocks[s]) for s in seq_ids], dtype=torch.int64)
        used = torch.arange(width).unsqueeze(0) < nblk.unsqueeze(1)              # [B, W]
        bt.masked_fill_(~used, 0)
        if len(flat):
            bt.masked_scatter_(used, torch.frombuffer(flat, dtype=torch.int32))
        if t:
            # row_of [T] in [0, B): the sequence of each row = number of row boundaries
            # query_start_loc[1:B] at or before it (zero-row sequences stack boundaries).
            # torch.repeat_interleave measured 1.5-12 ms here on CPU; this is ~50 us.
            marks = torch.zeros(t + 1, dtype=torch.int64)
            marks.index_add_(0, qsl[1:b], torch.ones(b - 1, dtype=torch.int64))
            row_of = marks[:t].cumsum(0)
            pos = torch.arange(t, dtype=torch.int64) - qsl[row_of] + ctx_t[row_of]
            v["positions"].copy_(pos)
            physical = bt[row_of, pos // bs].to(torch.int64)
            v["slot_mapping"].copy_(physical * bs + pos % bs)
        dev_buf, dev_views = _to_device(buf, t, b, width, self.device)
        return AttentionMetadata(**dev_views, block_size=bs, seq_ids=seq_ids,
                                 query_lens=query_lens, context_lens=context_lens,
                                 max_query_len=max(query_lens),
                                 max_seq_len=max(c + q for c, q in zip(context_lens, query_lens)),
                                 num_tokens=t, _buffer=dev_buf)

    def truncate(self, seq_id: Hashable, new_len: int) -> None:
        """Shrink seq_id to its first new_len tokens (e.g. drop rejected draft tokens) and give
        back the blocks no longer needed. The dropped slots keep stale K/V until rewritten;
        nothing reads them (seq_lens bounds every read).

        Raises: ValueError for an unknown seq_id or new_len outside [0, seq_len(seq_id)];
        TypeError for a non-int new_len.
        """
        op = "PagedKvCache.truncate"
        self._check_known("truncate", seq_id)
        _check_count(op, "new_len", new_len, minimum=0)
        cur = self._lens[seq_id]
        if new_len > cur:
            raise ValueError(f"{op}: new_len must be <= seq_len({seq_id!r}) = {cur}, got {new_len}")
        blocks = self._blocks[seq_id]
        keep = -(-new_len // self.block_size)
        while len(blocks) > keep:   # tail first, so the next plan reuses them in order
            self._free.append(blocks.pop())
        self._lens[seq_id] = new_len

    def free(self, seq_id: Hashable) -> None:
        """Forget seq_id and give back all its blocks. Raises ValueError for an unknown seq_id."""
        self._check_known("free", seq_id)
        self.truncate(seq_id, 0)
        del self._blocks[seq_id], self._lens[seq_id]

    def _check_known(self, what: str, seq_id: Hashable) -> None:
        if seq_id not in self._lens:
            raise ValueError(f"PagedKvCache.{what}: seq_id {seq_id!r} is not in the cache")

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"PagedKvCache(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, nkv={self.num_kv_heads}, hd={self.head_dim}, "
                f"{dt}, {self.device}, free={self.num_free_blocks}, seqs={len(self._lens)})")


# =============================================================================================
# helpers
# =============================================================================================


def _check_count(op: str, name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")


def _layout(t: int, b: int, w: int) -> tuple[int, int]:
    """One flat int64 buffer holds every metadata tensor:
    [positions T | slot_mapping T | int32 region: query_start_loc B+1 | seq_lens B | block_tables B·W]
    (the int32 region is viewed through .view(int32) and padded to whole int64 words).
    Returns (int32 elements, int64 words in total)."""
    n32 = (b + 1) + b + b * w
    return n32, 2 * t + (n32 + 1) // 2


def _views(buf: Tensor, t: int, b: int, w: int) -> dict[str, Tensor]:
    n32, _ = _layout(t, b, w)
    i32 = buf[2 * t:].view(torch.int32)[:n32]
    return dict(positions=buf[:t], slot_mapping=buf[t:2 * t],
                query_start_loc=i32[:b + 1], seq_lens=i32[b + 1:2 * b + 1],
                block_tables=i32[2 * b + 1:].view(b, w))


def _packed_buffers(t: int, b: int, w: int, device: torch.device) -> tuple[Tensor, dict[str, Tensor]]:
    """Host buffer (pinned when the target is a GPU, so the copy is async) and its views."""
    _, words = _layout(t, b, w)
    pin = device.type == "cuda" and torch.cuda.is_available()
    buf = torch.empty(words, dtype=torch.int64, pin_memory=pin)
    return buf, _views(buf, t, b, w)


def _to_device(buf: Tensor, t: int, b: int, w: int, device: torch.device):
    """The single host→device copy of a step (a no-op on CPU, where the host buffer is used)."""
    if device.type != "cpu":
        # Async from pinned memory: torch's caching host allocator keeps `buf` alive until the
        # copy has run, so dropping our reference right after is safe.
        buf = buf.to(device, non_blocking=True)
    return buf, _views(buf, t, b, w)


__all__ = ["PagedKvCache", "AttentionMetadata", "KvCacheExhausted", "KV_DTYPES", "FP8_E4M3_MAX"]
