"""NVFP4 weight container and the public quantize / dequantize entry points.

Layout (DESIGN "Formats", fixed): W[N, K], K % 16 == 0
    packed       uint8          [N, K/2]   byte (n, j) = code(W[n, 2j]) | code(W[n, 2j+1]) << 4
    block_scale  float8_e4m3fn  [N, K/16]  one scale per 16 consecutive K, row-major
    global_scale float32        []         W = e2m1 · float(block_scale) · global_scale
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from atlas import ops, reference
from atlas._validate import check_tensor


@dataclass(eq=False)
class NVFP4Weight:
    """An NVFP4 weight W[N, K] in the checkpoint layout.

    Attributes:
        packed: uint8 [N, K/2], two E2M1 codes per byte (low nibble = even K index).
        block_scale: float8_e4m3fn [N, K/16].
        global_scale: float32 [] (a 0-dim tensor on the same device, so kernels read it without
            a host sync).
    A kernel that wants another device layout derives it once through `derived()`; the
    tensors above are never changed or padded.

    Example:
        >>> q = NVFP4Weight.from_modelopt(torch.zeros(8, 16, dtype=torch.uint8),
        ...     torch.ones(8, 2).to(torch.float8_e4m3fn), torch.tensor(0.5))
        >>> q.shape
        (8, 32)
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor
    _derived: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        op = "NVFP4Weight"
        check_tensor(op, "packed", self.packed, dtype=torch.uint8, ndim=2, what="uint8 [N, K/2]")
        n, half_k = self.packed.shape
        check_tensor(op, "block_scale", self.block_scale, dtype=torch.float8_e4m3fn,
                     shape=(n, half_k // 8), device=self.packed.device, what="e4m3 [N, K/16]")
        if half_k % 8 != 0:
            raise ValueError(f"{op}: K = {2 * half_k} must be a multiple of 16")
        check_tensor(op, "global_scale", self.global_scale, dtype=torch.float32,
                     device=self.packed.device, what="float32 scalar")
        if self.global_scale.numel() != 1:
            raise ValueError(f"{op}: global_scale must be a scalar, got shape {list(self.global_scale.shape)}")
        self.global_scale = self.global_scale.reshape(())
        self.packed = self.packed.contiguous()
        self.block_scale = self.block_scale.contiguous()

    # ---- construction from checkpoint dialects ----------------------------------------------
    @classmethod
    def from_modelopt(cls, weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> "NVFP4Weight":
        """ModelOpt: weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32 (a
        multiplier: global_scale = weight_scale_2). Zero or non-finite scale → ValueError."""
        gs = _checked_global_scale("from_modelopt", "weight_scale_2", weight_scale_2)
        return cls(weight, weight_scale, gs)

    @classmethod
    def from_compressed_tensors(cls, weight_packed: Tensor, weight_scale: Tensor,
                                weight_global_scale: Tensor) -> "NVFP4Weight":
        """compressed-tensors: weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16],
        weight_global_scale f32 (a divisor: global_scale = 1 / weight_global_scale)."""
        g = _checked_global_scale("from_compressed_tensors", "weight_global_scale", weight_global_scale)
        return cls(weight_packed, weight_scale, (1.0 / g.double()).float())

    # ---- properties -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV streams: N·K/2 + N·K/16 (+4 for the global scale)."""
        return self.packed.numel() + self.block_scale.numel() + 4

    def to(self, device) -> "NVFP4Weight":
        return NVFP4Weight(self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_nvfp4(self, dtype)

    def rows(self, start: int, stop: int) -> "NVFP4Weight":
        """Rows [start, stop) as a view sharing storage and global scale (a row prefix of an LM
        head, or one half of a fused gate_up)."""
        return NVFP4Weight(self.packed[start:stop], self.block_scale[start:stop], self.global_scale)

    def derived(self, name: str, make: Callable[["NVFP4Weight"], object]):
        """A device layout derived once from this weight (e.g. an interleaved copy for a
        kernel) and cached under `name`."""
        if name not in self._derived:
            self._derived[name] = make(self)
        return self._derived[name]

    def prepare_gemv(self) -> "NVFP4Weight":
        """Derive the tiled layout w4a16_gemv streams (tile_for_gemv) when it applies (a CUDA
        weight with K % 128 == 0); every GEMV of this weight reads it from then on. Costs a
        second copy of the weight's bytes. Call at load time, outside CUDA-graph capture.
        Results equal the checkpoint layout's within f32 rounding (the tiled words pair other
        k, so the mma groups a row's products differently; each layout is batch invariant)."""
        if self.packed.is_cuda and self.shape[1] % GEMV_CHUNK_K == 0:
            self.derived("gemv_tiled", tile_for_gemv)
        return self

    def gemv_operands(self) -> tuple[Tensor, Tensor]:
        """(packed, block_scale) as w4a16_gemv takes them: the tiled 3-D views after
        prepare_gemv(), else the checkpoint tensors."""
        return self._derived.get("gemv_tiled") or (self.packed, self.block_scale)


GEMV_CHUNK_K = 128     # K per chunk of the tiled layout


def _chunk_major(t: Tensor, row_bytes_per_chunk: int) -> Tensor:
    """[..., N, C·b] bytes → a [..., N, C, b] view (inner strides (b, N·b, 1)) of a chunk-major
    buffer [..., C, N, b]: chunk c of every row, rows in order, is one run of N·b bytes at c·N·b
    (per leading index: an expert stack is chunk-major per expert)."""
    *lead, n, cb = t.shape
    c = cb // row_bytes_per_chunk
    buf = torch.empty(*lead, c, n, row_bytes_per_chunk, dtype=t.dtype, device=t.device)   # always a copy
    buf.copy_(t.reshape(*lead, n, c, row_bytes_per_chunk).transpose(-3, -2))
    return buf.transpose(-3, -2)


def _in_gemv_word_bits(packed: Tensor) -> None:
    """Re-place the codes of a chunk-major packed view [..., N, C, 64] (_chunk_major) in the GEMV
    word bit order, in place, a bounded number of [N, 64] chunk runs per pass (the int64
    temporaries of gemv_word_bits)."""
    buf = packed.transpose(-3, -2).flatten(0, -3)   # [(...)·C, N, 64]: a view of the buffer
    per_pass = max(1, (1 << 24) // max(1, buf[0].numel()))
    for c in range(0, buf.shape[0], per_pass):
        buf[c:c + per_pass] = gemv_word_bits(buf[c:c + per_pass])


# The tiled copy also re-places the bits inside each 32-bit word (8 codes, code i = k offset i):
# the kernel forms bf16x2 register i = (code 2i, code 2i + 1) · 2^-126 — k-adjacent pairs, so the
# activations feed the mma in their natural order (v3.17: the checkpoint words' kernel pairs
# (code i, code i + 4) made every staged-kernel CTA permute its activation stage per chunk,
# ≈ 12% of the M = 32 time, bench/NOTES.md) — e2m1 magnitude bits 0..2
# at bf16 bits 6..8 / 22..24, sign at 15 / 31 — as the sum of disjoint masked, shifted pieces of
# the word (GEMV_WORD_PIECES[i]: (mask, left shift; negative = right shift) pairs):
#   r0 = q & 0x81C081C0
#   r1 = (q & 0x02070207) << 6
#   r2 = ((q & 0x00380038) << 3) + ((q & 0x04000400) << 5)
#   r3 = ((q & 0x38003800) >> 5) + ((q & 0x40004000) << 1)
# 6 masks (LOP3, the 16-lane ALU pipe) + 5 shifts/adds that ptxas maps to IMAD on the FMA pipe,
# where v3's rotations (rotr(q, R) & magnitudes | rotr(q, S) & signs: 5 SHF.W + 6 LOP3 per
# word) kept the ALU pipe the bottleneck (ncu: math-pipe throttle). No assignment with fewer than 5 shifted pieces
# exists, nor one with left shifts only (search: bench/NOTES.md, w4a16_gemv v3.4). Register i's
# 8 bits, in the order (code 2i bits 0, 1, 2, sign; code 2i + 1 bits 0, 1, 2, sign), come from
# the word bits GEMV_WORD_SOURCES[i].
GEMV_BF16_SLOTS = (6, 7, 8, 15, 22, 23, 24, 31)
GEMV_WORD_SOURCES = ((6, 7, 8, 15, 22, 23, 24, 31),
                     (0, 1, 2, 9, 16, 17, 18, 25),
                     (3, 4, 5, 10, 19, 20, 21, 26),
                     (11, 12, 13, 14, 27, 28, 29, 30))


def _pieces(sources: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(mask, shift) pieces of one register: the source bits grouped by their shift."""
    by_shift: dict[int, int] = {}
    for src, dst in zip(sources, GEMV_BF16_SLOTS):
        by_shift[dst - src] = by_shift.get(dst - src, 0) | (1 << src)
    return tuple((mask, shift) for shift, mask in sorted(by_shift.items(), key=lambda kv: -kv[1]))


GEMV_WORD_PIECES = tuple(_pieces(src) for src in GEMV_WORD_SOURCES)


def _gemv_word_moves() -> list[tuple[int, int, int]]:
    """(source bit of the checkpoint word, 1, destination bit of the tiled word) per code bit."""
    moves = []
    for i, sources in enumerate(GEMV_WORD_SOURCES):
        for j, dst in enumerate(sources):
            code = 2 * i + (j >= 4)
            moves.append((4 * code + (j % 4), 0x1, dst))
    return moves


@functools.lru_cache(maxsize=None)
def _gemv_word_luts(inverse: bool) -> Tensor:
    """int32 [4, 256]: entry [i, v] = the output word bits that byte i of a word with value v
    sets (the bit moves of _gemv_word_moves, or their inverse); a word maps to the OR of its
    four bytes' entries."""
    lut = [[0] * 256 for _ in range(4)]
    for src, _, dst in _gemv_word_moves():
        if inverse:
            src, dst = dst, src
        for v in range(256):
            if (v >> (src % 8)) & 1:
                lut[src // 8][v] |= 1 << dst
    return torch.tensor([[x - (1 << 32) if x >= 1 << 31 else x for x in row] for row in lut], dtype=torch.int32)


def gemv_word_bits(packed: Tensor, inverse: bool = False) -> Tensor:
    """uint8 [..., 4j] checkpoint packing → the same codes in the tiled word bit order above
    (little-endian 32-bit words); inverse=True maps that order back to the checkpoint's."""
    lut = _gemv_word_luts(inverse).to(packed.device)
    b = packed.reshape(-1, 4).long()
    w = lut[0][b[:, 0]] | lut[1][b[:, 1]] | lut[2][b[:, 2]] | lut[3][b[:, 3]]
    return w.view(torch.uint8).reshape(packed.shape)   # little-endian: byte j of word = bits 8j..8j+7


def tile_for_gemv(q: "NVFP4Weight") -> tuple[Tensor, Tensor]:
    """The same codes as q, laid out for w4a16_gemv (csrc/w4a16_gemv.h, "tiled"): chunk-major —
    the 64 packed bytes (8 scale bytes) of every row's 128-k chunk c form one run over all rows,
    so a warp's 16-row tile chunk is 1 KB contiguous and the tiles the GPU streams at the same
    time read neighbouring memory (measured before: the checkpoint's row-major pieces left DRAM
    ≈ 50% busy, 40 KB-apart tile-major runs ≈ 0.68–0.76 of copy bandwidth) — and each 32-bit
    word's codes in the bit order of gemv_word_bits (cheaper dequantization).

    Returns:
        (packed uint8 [N, K/128, 64], block_scale float8_e4m3fn [N, K/128, 8]): views with strides
        (64, 64·N, 1) and (8, 8·N, 1) of chunk-major buffers; index [n, c] is row n's chunk c.
        The 3-D strided shape is what tells the kernel binding the layout.
    Raises:
        ValueError: K % 128 != 0.
    """
    n, k = q.shape
    if k % GEMV_CHUNK_K != 0:
        raise ValueError(f"tile_for_gemv: K = {k} must be a multiple of {GEMV_CHUNK_K}")
    packed = _chunk_major(q.packed, GEMV_CHUNK_K // 2)          # [N, C, 64], chunk-major storage
    _in_gemv_word_bits(packed)
    scale = _chunk_major(q.block_scale.view(torch.uint8), GEMV_CHUNK_K // 16).view(torch.float8_e4m3fn)
    return packed, scale


def tile_expert_stack(packed: Tensor, block_scale: Tensor) -> tuple[Tensor, Tensor]:
    """An NVFP4 expert stack (checkpoint words: packed uint8 [E, N, K/2], block_scale e4m3
    [E, N, K/16]) → the same codes laid out as tile_for_gemv lays out one weight, per expert: the
    form ops.moe_experts streams fastest (csrc/moe_experts.h, "tiled"; v9: the rows a warp and its
    neighbours stream at one time are adjacent, T = 32 −12%, bench/NOTES.md). Derived once at load
    (atlas.layers.ffn expert banks on CUDA, where h and I are multiples of 128).

    Returns:
        (packed uint8 [E, N, K/128, 64], block_scale e4m3 [E, N, K/128, 8]): views with strides
        (N·K/2, 64, 64·N, 1) and (N·K/16, 8, 8·N, 1) of per-expert chunk-major buffers, words in
        the GEMV bit order (gemv_word_bits); index [e, n, c] is expert e's row n, chunk c. The
        4-D strided shape with last dim 64 is what tells moe_experts the layout.
    Raises:
        ValueError: K % 128 != 0, or the shapes disagree.
    """
    check_tensor("tile_expert_stack", "packed", packed, dtype=torch.uint8, ndim=3, what="uint8 [E, N, K/2]")
    e, n, half_k = packed.shape
    check_tensor("tile_expert_stack", "block_scale", block_scale, dtype=torch.float8_e4m3fn,
                 shape=(e, n, half_k // 8), device=packed.device, what=f"e4m3 [{e}, {n}, {half_k // 8}]")
    if (2 * half_k) % GEMV_CHUNK_K:
        raise ValueError(f"tile_expert_stack: K = {2 * half_k} must be a multiple of {GEMV_CHUNK_K}")
    tiled = _chunk_major(packed, GEMV_CHUNK_K // 2)                # [E, N, C, 64], chunk-major per expert
    _in_gemv_word_bits(tiled)
    scale = _chunk_major(block_scale.view(torch.uint8), GEMV_CHUNK_K // 16).view(torch.float8_e4m3fn)
    return tiled, scale


def is_tiled_expert_stack(packed: Tensor) -> bool:
    """Whether packed is tile_expert_stack's layout ([E, N, K/128, 64]; the GEMV word form is
    [E, N, K/8, 4], the checkpoint's [E, N, K/2])."""
    return packed.dim() == 4 and packed.shape[-1] == GEMV_CHUNK_K // 2


def expert_words_for_gemv(packed: Tensor) -> Tensor:
    """An NVFP4 expert stack's packed codes, uint8 [E, N, K/2] (checkpoint words) → a new
    contiguous uint8 [E, N, K/8, 4]: the same bytes' codes with each 32-bit word in the GEMV bit
    order (gemv_word_bits) — the form ops.moe_experts reads without any activation permutation
    (csrc/moe_experts.cu v7: T = 32 −8%). Rows stay row-major; the 4-D shape is what tells
    moe_experts the word order. Derived once at load (atlas.layers.ffn expert banks on CUDA)."""
    check_tensor("expert_words_for_gemv", "packed", packed, dtype=torch.uint8, ndim=3, what="uint8 [E, N, K/2]")
    e, n, half_k = packed.shape
    if half_k % 4:
        raise ValueError(f"expert_words_for_gemv: K = {2 * half_k} must be a multiple of 8")
    out = torch.empty(e, n, half_k // 4, 4, dtype=torch.uint8, device=packed.device)
    per_pass = max(1, (1 << 24) // max(1, n * half_k))           # bounds the int64 temporaries
    for e0 in range(0, e, per_pass):
        out[e0:e0 + per_pass] = gemv_word_bits(packed[e0:e0 + per_pass]).view(-1, n, half_k // 4, 4)
    return out


def dequantize_expert_stack(packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    """An NVFP4 expert stack → float32 [E, N, K]: packed uint8 [E, N, K/2] (checkpoint words),
    [E, N, K/8, 4] (GEMV word order, expert_words_for_gemv) or [E, N, K/128, 64] with block_scale
    [E, N, K/128, 8] (tile_expert_stack), block_scale e4m3 [E, N, K/16] otherwise, global_scale
    f32 [E]. W = e2m1 · block_scale · global_scale (exact up to the last product)."""
    if is_tiled_expert_stack(packed):   # per-expert chunk-major views → row-major GEMV words
        packed = packed.reshape(packed.shape[0], packed.shape[1], -1, 4)
        block_scale = block_scale.reshape(block_scale.shape[0], block_scale.shape[1], -1)
    if packed.dim() == 4:   # words in the GEMV bit order: back to the checkpoint's
        packed = gemv_word_bits(packed, inverse=True).flatten(2)
    e, n, half_k = packed.shape
    lut = reference.e2m1_lut(packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack([lut[byte & 0xF], lut[byte >> 4]], dim=-1)   # [256, 2]: a byte's (low, high) code values
    vals = pairs[packed.long()].view(e, n, -1, 16)
    vals.mul_(block_scale.float().unsqueeze(-1)).mul_(global_scale.float().view(e, 1, 1, 1))   # (v·s)·g, in place
    return vals.view(e, n, 2 * half_k)


def _checked_global_scale(op: str, name: str, t: Tensor) -> Tensor:
    check_tensor(op, name, t, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
    if t.numel() != 1:
        raise ValueError(f"{op}: {name} must be a scalar, got shape {list(t.shape)}")
    v = float(t.reshape(()).item())  # load time: a host read is fine here
    if not (v == v and abs(v) != float("inf")) or v == 0.0:
        raise ValueError(f"{op}: {name} must be finite and non-zero, got {v}")
    return t.reshape(()).float()


def quantize_nvfp4(w: Tensor) -> NVFP4Weight:
    """Quantize a float weight [N, K] (K % 16 == 0) to NVFP4 (GPU: our kernel, else reference).

    Rounding: E2M1 round-to-nearest-even with saturation at ±6, E4M3 block scales RNE and
    saturating, quantized with the rounded block scale; global scale amax / (6·448), 1.0 for an
    all-zero weight. A block whose scale underflows E4M3 stores scale 0 and zero codes.
    Raises ValueError for NaN/Inf input (this is a load-time op: it reads one flag back).
    """
    if isinstance(w, torch.Tensor) and w.is_floating_point() and not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_nvfp4: w must be finite, got NaN or Inf values")
    packed, block_scale, global_scale = ops.quantize_nvfp4(w)
    return NVFP4Weight(packed, block_scale, global_scale)


def dequantize_nvfp4(q: NVFP4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """NVFP4Weight → dense [N, K] of dtype (float32 math)."""
    if not isinstance(q, NVFP4Weight):
        raise TypeError(f"dequantize_nvfp4: q must be an NVFP4Weight, got {type(q).__name__}")
    return reference.dequantize_nvfp4(q.packed, q.block_scale, q.global_scale, dtype)
