"""Qwen3AttentionLayer: the full-attention layer of Qwen3, Qwen3-Next, Qwen3.5 and Qwen3.6 over a
paged KV cache, for decode, speculative verify and chunked prefill in one call.

Per token (HF `Qwen3Attention` / `Qwen3NextAttention` / `Qwen3_5MoeAttention`, chosen by config):

    q|gate = q_proj(x)          gated (Qwen3-Next family): q_proj rows per head [q(hd) | gate(hd)]
    k, v   = k_proj(x), v_proj(x)
    q, k   = rope(rmsnorm(q)), rope(rmsnorm(k))   per head; norm weight 1 + w (zero_centered) or w;
                                                   NeoX RoPE on the first rotary_dim dims
    cache ← k, v;  o = softmax(q·kᵀ·hd^-½ + causal) · v   over the sequence's cached + new tokens
    o      = o · sigmoid(gate)  (gated only);  out = o_proj(o)

Launches of a decode / verify step (T ≤ 32 rows, NVFP4 weights; up to 128 rows the GEMVs repeat
per 32 rows, see atlas.linear), all graph-capturable:
    1. w4a16_gemv_dual  q_proj and [k_proj; v_proj] in ONE launch when K and V share a global
                        scale (ModelOpt / llm-compressor exports, and every BF16/FP8 → NVFP4
                        conversion here): their rows are concatenated once at load into one
                        NVFP4 weight. Otherwise dual(q_proj, k_proj) + w4a16_gemv(v_proj).
                        Gated: q_proj's per-head [q | gate] rows are de-interleaved on the store
                        (qg_head_dim) into [T, Q of all heads | G of all heads], so qk_norm_rope
                        reads Q through its row stride and the G half is o_proj's gate operand
                        as it is ([T, nq·hd], row stride 2·nq·hd): no copy, no extra pass.
    2. qk_norm_rope     q/k norms + RoPE + K/V cache write, one bf16 rounding (csrc/qk_norm_rope.cu)
    3. paged_decode     per run of consecutive sequences with the same query_len ≤ 8 (+ its
                        split-K combine). Gated, a step of one such run (every decode and
                        verify step) passes G as paged_decode's output gate: the kernel that
                        writes o writes bf16(o · sigmoid(G)), bitwise sigmoid_gate_mul's result
                        (one launch fewer); mixed steps run sigmoid_gate_mul after attending.
    4. w4a16_gemv       o_proj.
Prefill chunks (query_len > 8) run the projections like any other rows (GEMV chunks up to 128
rows in the step, beyond that GEMMs: cuBLAS over the on-the-fly BF16 dequantization, see
atlas.linear; there, and for BF16 / FP8 weights, the gated q_proj output stays per head
[q | gate], read through strides, and the gate is a sigmoid_gate_mul launch before o_proj) and
attend with
paged_decode over query chunks of 8: a chunk of n new rows becomes ceil(n/8) pseudo-sequences
of 8 query rows, chunk c ending at row min(8c + 8, n) with seq_len = context + that end, so
each row sees exactly its causal prefix (cached tokens + new tokens up to itself). The last
chunk overlaps the one before it when 8 ∤ n (its first rows are computed twice; the copy from
the earlier chunk is kept). Every chunk of every prefill group goes into ONE paged_decode call.
Nothing L×L is ever built, the cache is read in place (BF16 or FP8), and the pseudo-sequences
use the decode kernel's tensor-core GQA packing (8 rows × group heads per KV read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

from atlas import ops
from atlas._graph import capture
from atlas._validate import check_tensor
from atlas.config import ModelConfig
from atlas.kv_cache import AttentionMetadata, PagedKvCache
from atlas.linear import GEMV_CHUNKED_MAX_ROWS, Linear, gemv, gemv_dual, load_linears

from atlas.nvfp4 import NVFP4Weight

MAX_DECODE_QUERY_LEN = 8      # paged_decode serves query_len ≤ 8 (decode and verify groups)
PREFILL_CHUNK = 8             # query rows per pseudo-sequence of a prefill chunk


@dataclass(frozen=True)
class DecodeRun:
    """Consecutive sequences b0..b1-1 with one query_len ≤ 8, rows r0..r1-1: one paged_decode."""
    b0: int
    b1: int
    r0: int
    r1: int
    query_len: int


def plan_attention(query_lens) -> tuple[list[DecodeRun], list[tuple[int, int, int]]]:
    """Split a step's sequences (host list of query lengths, plan() order) into decode/verify
    runs and prefill groups (b, first row, n). Sequences with 0 new rows are skipped."""
    runs: list[DecodeRun] = []
    prefill: list[tuple[int, int, int]] = []
    row = 0
    for b, n in enumerate(query_lens):
        if n > MAX_DECODE_QUERY_LEN:
            prefill.append((b, row, n))
        elif n > 0:
            last = runs[-1] if runs else None
            if last is not None and last.query_len == n and last.b1 == b and last.r1 == row:
                runs[-1] = DecodeRun(last.b0, b + 1, last.r0, row + n, n)
            else:
                runs.append(DecodeRun(b, b + 1, row, row + n, n))
        row += n
    return runs, prefill


class Qwen3AttentionLayer:
    """One full-attention layer (module docstring: math and launches).

    Build with `from_state_dict`. Call: `out = attn(hidden, meta, cache, layer=0)`.

    Attributes:
        cfg: ModelConfig. gated: cfg.attn_output_gate. weight_format: "bf16" | "fp8" | "nvfp4".
        q_proj [nq·hd·(2 if gated else 1), h], k_proj / v_proj [nkv·hd, h], o_proj [h, nq·hd]:
            atlas.linear.Linear. q_norm_weight, k_norm_weight: float32 [hd] as stored (the
            zero-centered offset is applied by the kernel).
        kv_fused: K and V share a global scale (NVFP4); decode then runs q, k and v in one
            w4a16_gemv_dual launch over q_proj and kv_weight = [k_proj; v_proj] rows.

    Example (CPU, reference path; `sd` holds HF-named tensors "q_proj.weight", ... "k_norm.weight"):
        >>> cfg = ModelConfig.tiny(head_dim=64)
        >>> attn = Qwen3AttentionLayer.from_state_dict(cfg, sd, "", "nvfp4", "cpu")
        >>> cache = PagedKvCache(cfg, 1, 16, device="cpu")
        >>> out = attn(torch.randn(5, 64).bfloat16(), cache.plan({"a": 5}), cache)   # 5-token prefill
        >>> out = attn(torch.randn(1, 64).bfloat16(), cache.plan({"a": 1}), cache)   # then one decode
    """

    def __init__(self, cfg: ModelConfig, q_proj: Linear, k_proj: Linear, v_proj: Linear,
                 o_proj: Linear, q_norm_weight: Tensor, k_norm_weight: Tensor):
        self.cfg = cfg
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.gated = bool(cfg.attn_output_gate)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm_weight, self.k_norm_weight = q_norm_weight, k_norm_weight
        self.weight_format = q_proj.weight_format
        # load time: comparing the two device scalars reads one flag back
        self.kv_fused = (self.weight_format == "nvfp4" and k_proj.weight_format == v_proj.weight_format == "nvfp4"
                         and bool(torch.equal(k_proj.weight.global_scale, v_proj.weight.global_scale)))
        self.kv_weight = None
        if self.kv_fused:   # one [2·nkv·hd, h] NVFP4 weight (a copy of 2·nkv·hd·h·9/16 bytes)
            kw, vw = k_proj.weight, v_proj.weight
            self.kv_weight = NVFP4Weight(torch.cat([kw.packed, vw.packed]),
                                         torch.cat([kw.block_scale, vw.block_scale]), kw.global_scale).prepare_gemv()
        self.norm_kwargs = dict(eps=float(cfg.rms_norm_eps), zero_centered=bool(cfg.zero_centered_norm),
                                rotary_dim=int(cfg.rotary_dim), rope_theta=float(cfg.rope_theta))
        self.softmax_scale = float(cfg.softmax_scale)

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict: Mapping[str, Tensor], prefix: str,
                        weight_format: str, device) -> "Qwen3AttentionLayer":
        """Build from HF checkpoint tensors under `prefix` (e.g. "model.layers.3.self_attn.").

        Args:
            cfg: ModelConfig (heads, head_dim, gate, norm style, RoPE).
            state_dict: `{prefix}q_proj.*`, `k_proj.*`, `v_proj.*`, `o_proj.*` in any dialect
                (BF16; ModelOpt or compressed-tensors NVFP4; Qwen FP8), detected per module;
                `{prefix}q_norm.weight`, `{prefix}k_norm.weight` [hd].
            weight_format: "bf16" | "fp8" | "nvfp4", what the projections run in. Tensors
                already in that format are used as they are; others are converted once (K and
                V quantized to NVFP4 here share one global scale, so they fuse).
            device: where the layer lives.
        Raises:
            KeyError: a missing tensor (named). ValueError: a wrong shape (module named).
        """
        h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_rows = nq * hd * (2 if cfg.attn_output_gate else 1)
        q_proj = Linear.from_state_dict(state_dict, f"{prefix}q_proj.", weight_format, device, shape=(q_rows, h))
        k_proj, v_proj = load_linears(state_dict, [f"{prefix}k_proj.", f"{prefix}v_proj."], weight_format,
                                      device, share_global_scale=True)
        for name, lin in (("k_proj", k_proj), ("v_proj", v_proj)):
            if (lin.out_features, lin.in_features) != (nkv * hd, h):
                raise ValueError(f"Qwen3AttentionLayer: '{prefix}{name}.' must have shape [N, K] = "
                                 f"{[nkv * hd, h]}, got {[lin.out_features, lin.in_features]}")
        o_proj = Linear.from_state_dict(state_dict, f"{prefix}o_proj.", weight_format, device, shape=(h, nq * hd))
        norms = []
        for name in ("q_norm", "k_norm"):
            key = f"{prefix}{name}.weight"
            if key not in state_dict:
                raise KeyError(f"Qwen3AttentionLayer: missing checkpoint tensor {key!r}")
            w = state_dict[key]
            check_tensor("Qwen3AttentionLayer", key, w, dtypes=(torch.bfloat16, torch.float16, torch.float32),
                         shape=(hd,), what=f"float [{hd}]")
            norms.append(w.to(device=device, dtype=torch.float32).contiguous())
        return cls(cfg, q_proj, k_proj, v_proj, o_proj, *norms)

    @classmethod
    def from_pretrained(cls, path, layer_idx: int, *, weight_format: str, device="cuda") -> "Qwen3AttentionLayer":
        """Load full-attention layer `layer_idx` from a checkpoint directory (config.json +
        safetensors, any dialect and key layout), validated before anything is built. See
        atlas.checkpoint.load_attention_layer (raises CheckpointError)."""
        from atlas.checkpoint import load_attention_layer
        return load_attention_layer(path, layer_idx, weight_format=weight_format, device=device)

    @property
    def device(self) -> torch.device:
        return self.q_norm_weight.device

    @property
    def weight_nbytes(self) -> int:
        """Projection weight bytes one decode step streams (q, k, v, o)."""
        return sum(l.nbytes for l in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))

    # ---- forward ----------------------------------------------------------------------------
    def __call__(self, hidden: Tensor, meta: AttentionMetadata, cache: PagedKvCache, layer: int = 0) -> Tensor:
        """hidden [T, h] bf16 (rows grouped per sequence in plan() order) → [T, h] bf16.

        Writes this step's K/V into `cache` layer `layer` at meta.slot_mapping, then attends.
        No host sync (metadata host fields are plain Python lists)."""
        op = "Qwen3AttentionLayer"
        check_tensor(op, "hidden", hidden, dtype=torch.bfloat16, shape=(None, self.hidden_size),
                     device=self.device, what=f"bf16 [T, h={self.hidden_size}]")
        t = hidden.shape[0]
        if meta.num_tokens != t:
            raise ValueError(f"{op}: meta has num_tokens = {meta.num_tokens} rows but hidden has T = {t}")
        if (cache.num_kv_heads, cache.head_dim) != (self.nkv, self.hd):
            raise ValueError(f"{op}: cache has (nkv, hd) = {(cache.num_kv_heads, cache.head_dim)}, "
                             f"the layer needs {(self.nkv, self.hd)}")
        if t == 0:
            return hidden.new_empty(0, self.hidden_size)
        k_cache, v_cache, k_scale, v_scale = cache.layer(layer)
        q, gate, k, v = self._project_qkv(hidden)
        q = ops.qk_norm_rope(q, k, v, self.q_norm_weight, self.k_norm_weight, meta.positions, k_cache,
                             v_cache, meta.slot_mapping, k_scale, v_scale, **self.norm_kwargs)
        o = self._attend(q, gate, meta, k_cache, v_cache, k_scale, v_scale)        # [T, nq, hd], gated
        return self.o_proj(o.view(t, self.nq * self.hd))

    # Measured alternative, not taken: the gate on o_proj's load (w4a16_gemv_gated) lost to
    # sigmoid_gate_mul + the plain GEMV once gemv v3.6 split K over warps (H200,
    # bench/results/gemv_variants.md: 2048×4096 6.58 vs 5.84 µs, 5120×6144 12.4 vs 10.8); the gate
    # in paged_decode's stores costs neither GEMV anything.

    def write_kv(self, hidden: Tensor, meta: AttentionMetadata, cache: PagedKvCache, layer: int = 0) -> None:
        """The K/V half of __call__: writes the rows' normed, rotated K and V into the cache,
        byte for byte what __call__ writes for the same rows and T (drafter catch-up over a
        prompt, or re-writing accepted rows), skipping Q, the attention and o_proj.

        Bitwise agreement with __call__ rests on w4a16_gemv_dual's guarantee that each output
        equals its own w4a16_gemv: __call__ reads K and V as rows of kv_weight (fused) or as
        k_proj / v_proj, and so does this."""
        check_tensor("Qwen3AttentionLayer.write_kv", "hidden", hidden, dtype=torch.bfloat16,
                     shape=(meta.num_tokens, self.hidden_size), device=self.device,
                     what=f"bf16 [T = meta.num_tokens, h={self.hidden_size}]")
        t, nkv, hd = hidden.shape[0], self.nkv, self.hd
        if t == 0:
            return
        if self.weight_format == "nvfp4" and t <= GEMV_CHUNKED_MAX_ROWS:
            x = hidden.contiguous()
            if self.kv_fused:
                kv = gemv(x, self.kv_weight)
                k, v = kv[:, :nkv * hd], kv[:, nkv * hd:]
            else:
                k, v = gemv_dual(x, self.k_proj.weight, self.v_proj.weight)
        else:
            k, v = self.k_proj(hidden), self.v_proj(hidden)
        k, v = k.view(t, nkv, hd), v.view(t, nkv, hd)
        k_cache, v_cache, k_scale, v_scale = cache.layer(layer)
        ops.qk_norm_rope(k[:, :1], k, v, self.q_norm_weight, self.k_norm_weight, meta.positions, k_cache,
                         v_cache, meta.slot_mapping, k_scale, v_scale, **self.norm_kwargs)  # q: a dummy head

    def _gemv_rows(self, t: int) -> bool:
        """The step's projections run as NVFP4 GEMVs (decode / verify, and any step of ≤ 128 rows)."""
        return self.weight_format == "nvfp4" and t <= GEMV_CHUNKED_MAX_ROWS

    def _project_qkv(self, x: Tensor):
        """x [T, h] → q [T, nq, hd], gate [T, nq, hd] or None (plain), k, v [T, nkv, hd], all
        strided views. gate: GEMV rows, the G half of the de-interleaved [T, Q | G] q_proj output
        (row stride 2·nq·hd); otherwise the gate half of the per-head [q | gate] rows."""
        t, nq, nkv, hd = x.shape[0], self.nq, self.nkv, self.hd
        qg_head_dim = hd if self.gated else 0
        if self._gemv_rows(t):                                                       # decode / verify
            x = x.contiguous()
            if self.kv_fused:
                y, kv = gemv_dual(x, self.q_proj.weight, self.kv_weight, qg_head_dim=qg_head_dim)
                k, v = kv[:, :nkv * hd], kv[:, nkv * hd:]
            else:
                y, k = gemv_dual(x, self.q_proj.weight, self.k_proj.weight, qg_head_dim=qg_head_dim)
                v = gemv(x, self.v_proj.weight)
            q = y[:, :nq * hd].view(t, nq, hd)                 # [T, Q | G] or [T, Q]
            gate = y[:, nq * hd:].view(t, nq, hd) if self.gated else None
        elif self.gated:                                                             # GEMM / bf16 / fp8
            y, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            y = y.view(t, nq, 2 * hd)                                                # per head [q | gate]
            q, gate = y[..., :hd], y[..., hd:]
        else:
            y, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, gate = y.view(t, nq, hd), None
        return q, gate, k.view(t, nkv, hd), v.view(t, nkv, hd)

    def _attend(self, q: Tensor, gate: Optional[Tensor], meta: AttentionMetadata, k_cache, v_cache, k_scale,
                v_scale) -> Tensor:
        """q [T, nq, hd] (normed, rotated), gate [T, nq, hd] or None → attention output [T, nq,
        hd] bf16, times sigmoid(gate) when gated."""
        t, nq, hd = q.shape
        runs, prefill = plan_attention(meta.query_lens)
        if len(runs) == 1 and not prefill and runs[0].r1 - runs[0].r0 == t:   # a plain decode / verify step
            return self._decode(q, gate, runs[0], meta, k_cache, v_cache, k_scale, v_scale).view(t, nq, hd)
        out = torch.empty_like(q)
        for r in runs:
            out[r.r0:r.r1] = self._decode(q, None, r, meta, k_cache, v_cache, k_scale, v_scale).view(-1, nq, hd)
        if prefill:
            self._prefill(q, out, prefill, meta, k_cache, v_cache, k_scale, v_scale)
        return out if gate is None else ops.sigmoid_gate_mul(out, gate)

    def _decode(self, q, gate, r: DecodeRun, meta, k_cache, v_cache, k_scale, v_scale) -> Tensor:
        """paged_decode of run r's rows of q (and of gate, the output gate, when not None)."""
        shape = (r.b1 - r.b0, r.query_len, self.nq, self.hd)
        query = q[r.r0:r.r1].view(shape)
        gate = None if gate is None else gate[r.r0:r.r1].view(shape)
        if r.query_len == 1:                                                         # [B, nq, hd]
            query, gate = query[:, 0], None if gate is None else gate[:, 0]
        return ops.paged_decode(query, k_cache, v_cache, meta.block_tables[r.b0:r.b1], meta.seq_lens[r.b0:r.b1],
                                self.softmax_scale, k_scale, v_scale, gate=gate)

    def _prefill(self, q, out, groups, meta, k_cache, v_cache, k_scale, v_scale) -> None:
        """Causal attention of prefill chunks as pseudo-sequences of 8 query rows (module doc)."""
        dev, nq, hd = q.device, self.nq, self.hd
        lane = torch.arange(PREFILL_CHUNK, device=dev)
        queries, seq_lens, tables, counts = [], [], [], []
        for b, r0, n in groups:
            nc = -(-n // PREFILL_CHUNK)
            starts = (torch.arange(nc, device=dev) * PREFILL_CHUNK).clamp_(max=n - PREFILL_CHUNK)   # [nc]
            queries.append(q[(r0 + starts).unsqueeze(1) + lane])                       # [nc, 8, nq, hd]
            # chunk c holds rows starts[c] .. starts[c]+7 → its seq_len = context + starts[c] + 8
            seq_lens.append(meta.seq_lens[b:b + 1] - n + starts + PREFILL_CHUNK)
            tables.append(meta.block_tables[b:b + 1].expand(nc, -1))
            counts.append(nc)
        o = ops.paged_decode(torch.cat(queries), k_cache, v_cache, torch.cat(tables).contiguous(),
                         torch.cat(seq_lens).to(torch.int32), self.softmax_scale, k_scale, v_scale)
        c0 = 0
        for (b, r0, n), nc in zip(groups, counts):
            full = PREFILL_CHUNK * (nc - 1)                                            # rows of chunks 0..nc-2
            out[r0:r0 + full] = o[c0:c0 + nc - 1].reshape(-1, nq, hd)
            out[r0 + full:r0 + n] = o[c0 + nc - 1, PREFILL_CHUNK - (n - full):]
            c0 += nc

    # ---- CUDA graph of one decode / verify step ----------------------------------------------
    def capture_decode(self, batch_size: int, cache: PagedKvCache, layer: int = 0,
                       max_blocks_per_seq: Optional[int] = None, *, query_len: int = 1) -> "DecodeGraph":
        """Capture one step of `batch_size` sequences × `query_len` rows (1 = decode, 2..8 =
        verify) of layer `layer` as a CUDA graph; see DecodeGraph. `max_blocks_per_seq` (the
        block_tables width W, required) bounds the context: W · block_size tokens. Plan the steps
        you replay with `cache.plan(..., max_blocks_per_seq=W)`."""
        if max_blocks_per_seq is None:
            raise TypeError("capture_decode: max_blocks_per_seq (the block_tables width) is required")
        return DecodeGraph(self, batch_size, cache, layer, max_blocks_per_seq=max_blocks_per_seq,
                           query_len=query_len)


class DecodeGraph:
    """One captured decode / verify step of a Qwen3AttentionLayer with static input buffers.

    `graph(hidden, meta)` copies hidden [B·q, h] and meta's device tensors into the static
    buffers, replays, and returns the static output [B·q, h] (overwritten by the next replay:
    copy it if you keep it). meta must come from `cache.plan` with B sequences of exactly
    `query_len` rows each and `max_blocks_per_seq` = the captured width. No host sync.

    Example (GPU):
        >>> g = attn.capture_decode(8, cache, max_blocks_per_seq=64)
        >>> out = g(hidden, cache.plan({s: 1 for s in seqs}, max_blocks_per_seq=64))
    """

    def __init__(self, attn: Qwen3AttentionLayer, batch_size: int, cache: PagedKvCache, layer: int, *,
                 max_blocks_per_seq: int, query_len: int = 1):
        op = "capture_decode"
        for name, v, lo, hi in (("batch_size", batch_size, 1, None), ("max_blocks_per_seq", max_blocks_per_seq, 1, None),
                                ("query_len", query_len, 1, MAX_DECODE_QUERY_LEN)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
            if v < lo or (hi is not None and v > hi):
                raise ValueError(f"{op}: {name} must be in [{lo}, {hi or 'inf'}], got {v}")
        if not attn.device.type == "cuda":
            raise ValueError(f"{op}: the layer must live on a CUDA device, got {attn.device}")
        self.attn, self.cache, self.layer = attn, cache, layer
        self.batch_size, self.query_len = batch_size, query_len
        t = batch_size * query_len
        self.hidden = torch.zeros(t, attn.hidden_size, dtype=torch.bfloat16, device=attn.device)
        # A harmless step: no cache writes (slot −1), seq_lens 0; host fields say "B × query_len".
        self.meta = AttentionMetadata.empty(t, batch_size, max_blocks_per_seq, block_size=cache.block_size,
                                            device=attn.device)
        self.meta.query_start_loc.copy_(torch.arange(batch_size + 1, dtype=torch.int32) * query_len)
        self.meta.query_lens = [query_len] * batch_size
        self.meta.context_lens = [0] * batch_size
        self.meta.max_query_len = query_len
        side = torch.cuda.Stream(device=attn.device)
        side.wait_stream(torch.cuda.current_stream(attn.device))
        with torch.cuda.stream(side):
            for _ in range(2):                       # warm-up: lazy inits happen outside the capture
                attn(self.hidden, self.meta, cache, layer)
        torch.cuda.current_stream(attn.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.out = capture(self.graph, lambda: attn(self.hidden, self.meta, cache, layer))

    def replay(self) -> Tensor:
        """Replay with whatever the static buffers hold (benchmarks); returns the static output."""
        self.graph.replay()
        return self.out

    def __call__(self, hidden: Tensor, meta: AttentionMetadata) -> Tensor:
        op = "DecodeGraph"
        check_tensor(op, "hidden", hidden, dtype=torch.bfloat16, shape=tuple(self.hidden.shape),
                     device=self.hidden.device, what="bf16 [B·query_len, h] as captured")
        if list(meta.query_lens) != [self.query_len] * self.batch_size:
            raise ValueError(f"{op}: meta must hold {self.batch_size} sequences of {self.query_len} rows "
                             f"(as captured), got query_lens {list(meta.query_lens)}")
        self.hidden.copy_(hidden)
        self.meta.copy_(meta)
        return self.replay()


# =============================================================================================
# the HF module this layer matches (tests and benchmarks; needs transformers)
# =============================================================================================

def hf_attention(cfg: ModelConfig, attn: Qwen3AttentionLayer, *, dtype: torch.dtype = torch.float32,
                 device=None, attn_implementation: str = "sdpa"):
    """The transformers module this layer reproduces (Qwen3Attention for model_type "qwen3",
    Qwen3NextAttention for "qwen3_next", Qwen3_5MoeAttention for "qwen3_5" / "qwen3_5_moe"),
    loaded with this layer's weights dequantized to `dtype`, plus its rotary embedding module.

    Returns (module, rotary): call `cos, sin = rotary(x, position_ids)` then
    `module(x, (cos, sin), attention_mask)[0]` with x [batch, L, h]."""
    device = attn.device if device is None else device
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta),
            "partial_rotary_factor": float(cfg.partial_rotary_factor)}
    common = dict(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.rms_norm_eps, attention_bias=False, num_hidden_layers=1,
                  max_position_embeddings=cfg.max_position_embeddings)
    if cfg.model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m
        hf_cfg = m.Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)}, **common)
        module_cls, rotary_cls = m.Qwen3Attention, m.Qwen3RotaryEmbedding
    elif cfg.model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        hf_cfg = m.Qwen3NextConfig(rope_parameters=rope, layer_types=["full_attention"], **common)
        module_cls, rotary_cls = m.Qwen3NextAttention, m.Qwen3NextRotaryEmbedding
    else:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        rope["mrope_section"] = list(cfg.mrope_section) if cfg.mrope_section else [cfg.rotary_dim // 2, 0, 0]
        hf_cfg = m.Qwen3_5MoeTextConfig(rope_parameters=rope, layer_types=["full_attention"], **common)
        module_cls, rotary_cls = m.Qwen3_5MoeAttention, m.Qwen3_5MoeTextRotaryEmbedding
    hf_cfg._attn_implementation = attn_implementation
    with torch.device(device):            # build in place: a 27B q_proj is 250 MB of float32
        module = module_cls(hf_cfg, layer_idx=0)
        rotary = rotary_cls(hf_cfg)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(module, name).weight.copy_(getattr(attn, name).dense(torch.float32))
        module.q_norm.weight.copy_(attn.q_norm_weight)
        module.k_norm.weight.copy_(attn.k_norm_weight)
    if cfg.model_type not in ("qwen3", "qwen3_next"):
        mrope = rotary.eval()

        def rotary(x, position_ids):
            # Text-only mRoPE: the three position rows are equal. transformers 5.17 (the H200's)
            # indexes position_ids as [3, B, L]; newer releases broadcast [B, L] themselves.
            if position_ids.dim() == 2:
                position_ids = position_ids[None].expand(3, -1, -1)
            return mrope(x, position_ids)
    return module.to(dtype=dtype).eval(), rotary
