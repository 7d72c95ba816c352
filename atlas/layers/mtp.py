"""MtpHead: the multi-token-prediction draft head of Qwen3-Next / Qwen3.5 / Qwen3.6.

One MTP forward of T rows (vLLM / SGLang `Qwen3NextMTP`, the seed engine's `mtp_head`):

    e      = pre_fc_norm_embedding(embed_tokens[tokens])         [T, h]
    hh     = pre_fc_norm_hidden(target_hidden)                    [T, h]
    x      = fc([e ; hh])                                         [T, h]   embedding FIRST
    x      = x + self_attn(input_layernorm(x))                    one full-attention layer with
    x      = x + mlp(post_attention_layernorm(x))                 its own paged KV (dense or MoE)
    normed = norm(x)                                              [T, h]
    logits = lm_head[:V'] · normed                                [T, V'] bf16, V' = mtp_vocab_size or V
All norms are zero-centered (1 + w) RMSNorms; embed_tokens and lm_head are the target's, shared
and never copied. `normed` is what the LM head reads and what chains into the next draft.

Row convention (DESIGN; the seed engine and vLLM agree up to the position offset):
    A sequence with tokens t_0 .. t_N (t_N the newest, not yet run through the target) and target
    hiddens h_0 .. h_{N−1} (h_i = the target's final-normed hidden at position i, which predicted
    t_{i+1}) has drafter rows r = 0, 1, ...: row r pairs embed(t_{r+1}) with h_r, sits at RoPE
    position r + 1 and at KV index r of the drafter cache. Rows 0 .. N−2 are "settled" (both
    inputs true); propose() adds row N−1 = (t_N, h_{N−1}) and then rows built from its own drafts.

Lifecycle of one sequence:
    prefill(s, [t_0..t_{P−1}], [h_0..h_{P−1}])   rows 0..P−2        (KV only; no FFN, no LM head)
    propose([s], t_P, h_{P−1}, k) → d_1..d_k     rows P−1..P+k−2    (row P−1 exact; later rows use
                                                                    drafted tokens + draft hiddens)
    target verifies [t_P, d_1..d_k], accepts a ≤ k drafts and samples a bonus token b, with
    hiddens H_P .. H_{P+k} at positions P .. P+k
    accept(s, a, H_P..H_{P+a−1}, d_1..d_a)       keep rows ..P−1, recompute rows P..P+a−1 from the
                                                 true hiddens: the KV now equals a fresh prefill
                                                 over t_0..t_{P+a} (exact drafter KV)
    propose([s], b, H_{P+a}, k) ...               and so on; free(s) at the end.

Everything on the propose path stays on the device: the drafted id feeds the next position's
embedding through ops.argmax → ops.embedding (no host sync between drafts), and the KV blocks for
all k rows are allocated on the host once, before any launch (cache.plan). On CUDA the whole
propose for a given (B, k) is captured once as one CUDA graph (`capture_propose`) and replayed.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from atlas import ops
from atlas._graph import capture
from atlas._validate import check_tensor
from atlas.config import ModelConfig
from atlas.kv_cache import AttentionMetadata, KvCacheExhausted, PagedKvCache
from atlas.layers.attention import Qwen3AttentionLayer
from atlas.layers.ffn import build_ffn
from atlas.linear import GEMV_MAX_ROWS, WEIGHT_FORMATS, Linear, nvfp4_gemm
from atlas.nvfp4 import NVFP4Weight

KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
PREFILL_CHUNK_ROWS = 512   # drafter prefill rows per forward (bounds the scratch, as the seed engine)


class MtpHead:
    """The MTP draft head (module docstring: math, row convention, lifecycle).

    Build with `from_state_dict` (or `atlas.checkpoint.load_mtp_head`).

    Attributes:
        cfg: ModelConfig. weight_format: "bf16" | "fp8" | "nvfp4" (fc, attention, FFN).
        embed_tokens: bf16 [V, h] (shared). lm_head: bf16 [V, h] or NVFP4Weight [V, h] (shared).
        vocab: V' = the rows the LM head and the argmax use.
        fc: Linear [h, 2h]. attn: Qwen3AttentionLayer. ffn: DenseMLP | SparseMoE.
        cache: PagedKvCache with one layer, the drafter's own KV (bf16 or fp8).
        max_seq_len, max_seqs, max_blocks_per_seq (the static block_tables width).
    """

    def __init__(self, cfg: ModelConfig, *, embed_tokens: Tensor, lm_head, fc: Linear, norm_embedding: Tensor,
                 norm_hidden: Tensor, input_layernorm: Tensor, attn: Qwen3AttentionLayer,
                 post_attention_layernorm: Tensor, ffn, norm: Tensor, cache: PagedKvCache, mtp_vocab_size: int,
                 max_seq_len: int, max_seqs: int):
        self.cfg = cfg
        self.hidden_size = cfg.hidden_size
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        if isinstance(lm_head, NVFP4Weight):
            lm_head.prepare_gemv()       # the shared head's tiled GEMV layout (derived once, kept on it)
        self.vocab = mtp_vocab_size if mtp_vocab_size > 0 else lm_head.shape[0]
        self.fc, self.attn, self.ffn = fc, attn, ffn
        self.norm_embedding, self.norm_hidden, self.norm = norm_embedding, norm_hidden, norm
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.eps, self.zero_centered = float(cfg.rms_norm_eps), bool(cfg.zero_centered_norm)
        self.weight_format = fc.weight_format
        self.cache = cache
        self.max_seq_len, self.max_seqs = max_seq_len, max_seqs
        self.max_blocks_per_seq = max_seq_len // cache.block_size + 1
        self._pending: dict[Hashable, tuple[int, int]] = {}   # seq → (rows before propose, k)
        self._graphs: dict[tuple[int, int], ProposeGraph] = {}
        self._consts: dict[tuple, Tensor] = {}   # constant index tensors of _draft_metas, built once

    # =========================================================================================
    # construction
    # =========================================================================================
    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict: Mapping[str, Tensor], embed_tokens: Tensor, lm_head,
                        weight_format: str = "bf16", kv_dtype: torch.dtype = torch.bfloat16,
                        max_seq_len: int = 4096, max_seqs: int = 1, mtp_vocab_size: int = 0,
                        device="cuda", *, main_pool_blocks: int | None = None, prefix: str = "mtp.",
                        block_size: int = 16) -> "MtpHead":
        """Build the head from HF checkpoint tensors under `prefix`.

        Args:
            cfg: ModelConfig of the target model (hidden, heads, MoE fields, eps, RoPE).
            state_dict: `{prefix}fc.*` [h, 2h], `{prefix}pre_fc_norm_embedding.weight`,
                `{prefix}pre_fc_norm_hidden.weight`, `{prefix}norm.weight` [h],
                `{prefix}layers.0.{input_layernorm,post_attention_layernorm}.weight`,
                `{prefix}layers.0.self_attn.*`, `{prefix}layers.0.mlp.*` (dense or MoE), each
                module in any dialect (BF16, ModelOpt / compressed-tensors NVFP4, Qwen FP8).
            embed_tokens: the target's bf16 [V, h] table (shared, not copied; moved to `device`
                only if it lives elsewhere).
            lm_head: the target's LM head, bf16 [V, h] or NVFP4Weight [V, h] (shared).
            weight_format: "bf16" | "fp8" | "nvfp4": what fc, attention and FFN projections run in
                (all three formats, dense and MoE heads alike).
            kv_dtype: torch.bfloat16 (default) or torch.float8_e4m3fn for the drafter KV.
            max_seq_len: longest sequence (drafter rows) served; sets the block_tables width.
            max_seqs: sequences drafted concurrently.
            mtp_vocab_size: draft over the first V' rows of the LM head only (0 = all V).
            device: where the head and its KV live.
            main_pool_blocks: cap on the drafter's KV blocks (the main pool's size), if given.
            prefix: key prefix of the head ("mtp." in Qwen3-Next / 3.5 / 3.6 checkpoints).
            block_size: drafter KV block size (16).
        Drafter KV blocks = (max_seq_len // block_size + 1) · max_seqs, capped by main_pool_blocks.
        Raises:
            KeyError: a missing tensor (named). ValueError / TypeError: a bad argument (named).
        """
        op = "MtpHead.from_state_dict"
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"{op}: cfg must be an atlas.ModelConfig, got {type(cfg).__name__}")
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"{op}: weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        if kv_dtype not in KV_DTYPES:
            raise TypeError(f"{op}: kv_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {kv_dtype}")
        for name, v in (("max_seq_len", max_seq_len), ("max_seqs", max_seqs), ("block_size", block_size)):
            _check_int(op, name, v, minimum=1)
        h = cfg.hidden_size
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # "cuda" → "cuda:N", so shared weights compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        check_tensor(op, "embed_tokens", embed_tokens, dtype=torch.bfloat16, shape=(None, h),
                     what=f"bf16 [V, h={h}]")
        embed_tokens = embed_tokens.to(device).contiguous()
        if isinstance(lm_head, NVFP4Weight):
            if lm_head.shape[1] != h:
                raise ValueError(f"{op}: lm_head must be [V, h={h}], got {list(lm_head.shape)}")
            lm_head = lm_head.to(device) if lm_head.device != device else lm_head   # keeps its derived layouts
        else:
            check_tensor(op, "lm_head", lm_head, dtype=torch.bfloat16, shape=(None, h),
                         what=f"bf16 [V, h={h}] or an NVFP4Weight")
            lm_head = lm_head.to(device).contiguous()
        _check_int(op, "mtp_vocab_size", mtp_vocab_size, minimum=0)
        if mtp_vocab_size > lm_head.shape[0]:
            raise ValueError(f"{op}: mtp_vocab_size must be ≤ V = {lm_head.shape[0]}, got {mtp_vocab_size}")
        if main_pool_blocks is not None:
            _check_int(op, "main_pool_blocks", main_pool_blocks, minimum=1)

        def norm_w(name: str) -> Tensor:
            key = f"{prefix}{name}.weight"
            if key not in state_dict:
                raise KeyError(f"{op}: missing checkpoint tensor {key!r}")
            w = state_dict[key]
            check_tensor(op, key, w, dtypes=(torch.bfloat16, torch.float16, torch.float32), shape=(h,),
                         what=f"float [{h}]")
            return w.to(device=device, dtype=torch.float32).contiguous()

        layer = f"{prefix}layers.0."
        fc = Linear.from_state_dict(state_dict, f"{prefix}fc.", weight_format, device, shape=(h, 2 * h))
        attn = Qwen3AttentionLayer.from_state_dict(cfg, state_dict, f"{layer}self_attn.", weight_format, device)
        ffn = build_ffn(cfg, state_dict, f"{layer}mlp.", weight_format, device)
        blocks = (max_seq_len // block_size + 1) * max_seqs
        if main_pool_blocks is not None:
            blocks = min(blocks, main_pool_blocks)
        cache = PagedKvCache(cfg, 1, blocks, dtype=kv_dtype, device=device, block_size=block_size)
        return cls(cfg, embed_tokens=embed_tokens, lm_head=lm_head, fc=fc,
                   norm_embedding=norm_w("pre_fc_norm_embedding"), norm_hidden=norm_w("pre_fc_norm_hidden"),
                   input_layernorm=norm_w("layers.0.input_layernorm"), attn=attn,
                   post_attention_layernorm=norm_w("layers.0.post_attention_layernorm"), ffn=ffn,
                   norm=norm_w("norm"), cache=cache, mtp_vocab_size=mtp_vocab_size, max_seq_len=max_seq_len,
                   max_seqs=max_seqs)

    @classmethod
    def from_pretrained(cls, path, *, weight_format: str, kv_dtype: torch.dtype = torch.bfloat16,
                        max_seq_len: int, max_seqs: int, mtp_vocab_size: int = 0, device="cuda") -> "MtpHead":
        """Load from a checkpoint directory (config.json + safetensors, any dialect and key
        layout): the `mtp.` tensors plus the target's embedding and LM head, validated before
        anything is built. See atlas.checkpoint.load_mtp_head (raises CheckpointError)."""
        from atlas.checkpoint import load_mtp_head
        return load_mtp_head(path, weight_format=weight_format, kv_dtype=kv_dtype, max_seq_len=max_seq_len,
                             max_seqs=max_seqs, mtp_vocab_size=mtp_vocab_size, device=device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head_nbytes(self) -> int:
        """LM-head bytes one draft position streams (the first V' rows)."""
        if isinstance(self.lm_head, NVFP4Weight):
            return self.vocab * self.hidden_size * 9 // 16
        return self.vocab * self.hidden_size * 2

    def weight_nbytes(self, rows: int = 1) -> int:
        """Weight bytes one forward of `rows` rows must read at least: fc, attention, FFN (the
        experts `rows` rows hit, at most all), LM head prefix. The floor's numerator."""
        ffn = self.ffn.active_nbytes(rows) if hasattr(self.ffn, "active_nbytes") else self.ffn.nbytes
        return self.fc.nbytes + self.attn.weight_nbytes + ffn + self.lm_head_nbytes

    # =========================================================================================
    # one forward
    # =========================================================================================
    def step(self, tokens: Tensor, target_hidden: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """One MTP forward of T rows.

        Args:
            tokens: int64 [T] (device): row i's token, already shifted by the caller — row i
                pairs embed(tokens[i]) = embed(t_{r+1}) with target_hidden[i] = h_r.
            target_hidden: bf16 [T, h]: the target's final-normed hiddens (or, for chained
                drafts, this head's own `hidden` output).
            meta: `mtp.cache.plan({seq: n, ...})` for these rows (rows grouped per sequence
                in plan() order). The KV of row r goes to drafter index r = meta.positions;
                its RoPE position is r + 1 (added here).
        Returns:
            logits bf16 [T, V'] (V' = mtp_vocab_size or V), hidden bf16 [T, h] (the normed
            vector the LM head read; feed it back as target_hidden for the next draft).
        Example:
            >>> meta = mtp.cache.plan({0: 5})
            >>> logits, hidden = mtp.step(tokens[1:6], target_hidden[0:5], meta)
        """
        self._check_rows("MtpHead.step", tokens, target_hidden)
        if not isinstance(meta, AttentionMetadata) or meta.num_tokens != tokens.shape[0]:
            raise ValueError(f"MtpHead.step: meta must be an AttentionMetadata with T = {tokens.shape[0]} rows")
        return self._forward(tokens, target_hidden, _shift_positions(meta))

    def _forward(self, tokens: Tensor, target_hidden: Tensor, meta: AttentionMetadata, *,
                 kv_only: bool = False):
        """The forward of the module docstring with meta.positions already = RoPE positions.
        kv_only: only write this step's drafter K/V (prefill, accept)."""
        rms = lambda x, w: ops.rms_norm(x, w, self.eps, self.zero_centered)  # noqa: E731
        x = ops.embedding_norm_concat(self.embed_tokens, tokens, target_hidden, self.norm_embedding,
                                      self.norm_hidden, self.eps, self.zero_centered)     # [T, 2h] = [e | hh]
        x = self.fc(x)                                                                    # [T, h]
        if kv_only:
            # A drafter row's K/V depend on its own input alone (one layer): prefill and accept
            # skip Q, the attention itself (O(L²) over a prompt), o_proj and the FFN; write_kv
            # writes the bytes the full layer would.
            self.attn.write_kv(rms(x, self.input_layernorm), meta, self.cache, 0)
            return None
        a = self.attn(rms(x, self.input_layernorm), meta, self.cache, 0)
        # residual adds fused into the next norm: x ← bf16(x + a), then the norm of that x
        f = self.ffn(ops.rms_norm(a, self.post_attention_layernorm, self.eps, self.zero_centered, residual=x))
        normed = ops.rms_norm(f, self.norm, self.eps, self.zero_centered, residual=x)     # x ← bf16(x + f)
        return self.logits(normed), normed

    def logits(self, normed: Tensor) -> Tensor:
        """LM head over the first V' rows: normed bf16 [T, h] → bf16 [T, V'] (a row prefix of the
        shared weight: a view for BF16, `n_rows` of the GEMV for NVFP4 — nothing is copied)."""
        if isinstance(self.lm_head, NVFP4Weight):
            if normed.shape[0] <= GEMV_MAX_ROWS:
                return ops.w4a16_gemv(normed, self.lm_head, n_rows=self.vocab)
            return nvfp4_gemm(normed, self.lm_head.rows(0, self.vocab))
        return F.linear(normed, self.lm_head[:self.vocab])

    # =========================================================================================
    # drafter prefill (catch-up over a prompt) and exact KV after verification
    # =========================================================================================
    def prefill(self, seq_id: Hashable, tokens: Tensor, target_hidden: Tensor) -> None:
        """Fill the drafter KV over a prompt (or a further chunk of one).

        Args:
            seq_id: the sequence (new, or one whose last call was prefill/accept).
            tokens: int64 [L] t_c .. t_{c+L−1}; target_hidden: bf16 [L, h] h_c .. h_{c+L−1}.
                Writes the L − 1 rows r = c .. c+L−2 pairing tokens[1:] with target_hidden[:-1].
                c must equal the rows the sequence already has (0 for a new one): a further
                chunk starts with the last token/hidden of the previous chunk.
        After prefill over the whole prompt t_0..t_{P−1}, call propose with (t_P, h_{P−1}).
        Runs in chunks of 512 rows; K/V only (no FFN, no LM head). Host syncs are fine here.
        """
        op = "MtpHead.prefill"
        self._check_rows(op, tokens, target_hidden)
        if seq_id in self._pending:
            raise ValueError(f"{op}: seq_id {seq_id!r} has a propose awaiting accept()")
        self._append_rows(seq_id, tokens[1:], target_hidden[:-1])

    def _plan(self, rows: dict) -> AttentionMetadata:
        """cache.plan at the static block_tables width, with the drafter's limits in the errors."""
        try:
            return self.cache.plan(rows, max_blocks_per_seq=self.max_blocks_per_seq)
        except KvCacheExhausted as e:
            e.args = (f"MtpHead: drafter KV exhausted: {e.args[0]}. The drafter pool holds "
                      f"{self.cache.num_blocks} blocks ((max_seq_len // block_size + 1) · max_seqs, capped "
                      "by main_pool_blocks): free finished sequences with mtp.free(), or build the head with "
                      "a larger max_seqs",)
            raise
        except ValueError as e:
            if "max_blocks_per_seq" not in str(e):
                raise
            raise ValueError(f"MtpHead: a sequence would exceed max_seq_len = {self.max_seq_len} drafter rows "
                             f"({e})") from None

    def _append_rows(self, seq_id: Hashable, tokens: Tensor, hidden: Tensor) -> None:
        if tokens.shape[0] == 0 and seq_id not in self.cache:
            self.cache.plan({seq_id: 0})            # register the sequence with no rows
        for r0 in range(0, tokens.shape[0], PREFILL_CHUNK_ROWS):
            r1 = min(r0 + PREFILL_CHUNK_ROWS, tokens.shape[0])
            meta = self._plan({seq_id: r1 - r0})
            self._forward(tokens[r0:r1], hidden[r0:r1], _shift_positions(meta), kv_only=True)

    def accept(self, seq_id: Hashable, num_accepted: int, target_hidden_rows: Tensor, tokens: Tensor) -> None:
        """Settle the drafter KV of `seq_id` after the target verified the last propose().

        With P = the sequence's token count at propose time (its first draft row was
        (t_P, h_{P−1})) and k drafts d_1..d_k proposed:
        Args:
            num_accepted: a, 0 ≤ a ≤ k: drafts the target accepted.
            target_hidden_rows: bf16 [a, h]: the target's hiddens H_P .. H_{P+a−1} from the
                verify forward (the rows that read t_P, d_1, .., d_{a−1}).
            tokens: int64 [a]: the accepted drafts d_1 .. d_a (device or host).
        Effect: rows ≥ P (built from draft hiddens, or rejected) are dropped and rows
        P .. P+a−1 are recomputed from (d_j, H_{P+j−1}), so the drafter KV equals what
        prefill over t_0 .. t_{P+a} would hold. Next: propose(bonus token, H_{P+a}).
        For many sequences use accept_batch (one plan and one K/V forward for all).
        """
        self.accept_batch([seq_id], [num_accepted], target_hidden_rows, tokens)

    def accept_batch(self, seq_ids: Sequence[Hashable], num_accepted: Sequence[int], target_hidden_rows: Tensor,
                     tokens: Tensor) -> None:
        """accept() for B sequences at once: one cache.plan and one K/V-only forward over all
        recomputed rows (instead of B of each: the verify loop of a batch stays a few launches).

        Args:
            seq_ids: B distinct sequences with a pending propose.
            num_accepted: B ints a_b (0 ≤ a_b ≤ k_b).
            target_hidden_rows: bf16 [Σ a_b, h]: each sequence's H rows (as in accept), in
                seq_ids order. tokens: int64 [Σ a_b]: each sequence's accepted drafts, same order.
        Validation happens before any state changes.
        """
        op = "MtpHead.accept"
        seq_ids, num_accepted = list(seq_ids), list(num_accepted)
        if len(set(seq_ids)) != len(seq_ids) or len(num_accepted) != len(seq_ids):
            raise ValueError(f"{op}: seq_ids must be distinct and match num_accepted one to one, got "
                             f"{seq_ids} and {num_accepted}")
        for s, a in zip(seq_ids, num_accepted):
            if s not in self._pending:
                raise ValueError(f"{op}: seq_id {s!r} has no propose awaiting accept()")
            _check_int(op, "num_accepted", a, minimum=0)
            if a > self._pending[s][1]:
                raise ValueError(f"{op}: num_accepted must be ≤ the {self._pending[s][1]} drafts proposed for "
                                 f"{s!r}, got {a}")
        total = sum(num_accepted)
        check_tensor(op, "target_hidden_rows", target_hidden_rows, dtype=torch.bfloat16,
                     shape=(total, self.hidden_size), what=f"bf16 [num_accepted, h={self.hidden_size}]")
        check_tensor(op, "tokens", tokens, dtype=torch.int64, shape=(total,), what="int64 [num_accepted]")
        for s in seq_ids:
            base, _ = self._pending.pop(s)
            self.cache.truncate(s, base + 1)           # keep rows ..P−1 (row P−1 was exact)
        rows = {s: a for s, a in zip(seq_ids, num_accepted) if a > 0}
        if rows:   # Σ a ≤ 32 · 8 rows in practice: one chunk
            meta = self._plan(rows)
            self._forward(tokens.to(self.device), target_hidden_rows.to(self.device), _shift_positions(meta),
                          kv_only=True)

    def cancel_propose(self, seq_ids: Sequence[Hashable]) -> None:
        """Undo the last propose() of these sequences entirely (drop all its rows, including
        the exact first one), e.g. when its drafts will not be verified; the sequences are then
        as before that propose and can propose again with the same inputs."""
        for s in seq_ids:
            if s not in self._pending:
                raise ValueError(f"MtpHead.cancel_propose: seq_id {s!r} has no propose awaiting accept()")
            base, _ = self._pending.pop(s)
            self.cache.truncate(s, base)

    def free(self, seq_id: Hashable) -> None:
        """Forget a sequence and give its drafter KV blocks back."""
        self._pending.pop(seq_id, None)
        self.cache.free(seq_id)

    # =========================================================================================
    # propose
    # =========================================================================================
    def propose(self, seq_ids: Sequence[Hashable], last_tokens: Tensor, target_hidden: Tensor,
                num_drafts: int, *, use_graph: bool | None = None) -> tuple[Tensor, Tensor]:
        """Draft `num_drafts` tokens for each of B sequences, greedily.

        Args:
            seq_ids: B distinct sequences, each prefilled / accepted (rows 0..P−2 settled).
            last_tokens: int64 [B] (device): t_P, the newest token of each sequence.
            target_hidden: bf16 [B, h]: h_{P−1}, the target hidden that predicted t_P.
            num_drafts: k ≥ 1.
            use_graph: replay a CUDA graph captured once per (B, k) (default: on CUDA).
        Returns:
            drafts int64 [B, k], confidence float32 [B, k] (top-1 softmax probability of each
            draft over the V' logits). Both on the device; nothing is read back.
        Draft j (j ≥ 1) of sequence b reads row (drafts[b, j−1], hidden of draft j−1) at
        position P_b + j; each draft position is one batched forward of B decode rows. The
        k·B KV rows are allocated on the host first (one plan, all or nothing; a full
        drafter cache raises KvCacheExhausted and changes nothing).
        """
        op = "MtpHead.propose"
        seq_ids = list(seq_ids)
        b = len(seq_ids)
        if b == 0 or len(set(seq_ids)) != b:
            raise ValueError(f"{op}: seq_ids must be a non-empty list of distinct ids, got {seq_ids}")
        _check_int(op, "num_drafts", num_drafts, minimum=1)
        check_tensor(op, "last_tokens", last_tokens, dtype=torch.int64, shape=(b,), device=self.device,
                     what=f"int64 [B={b}]")
        check_tensor(op, "target_hidden", target_hidden, dtype=torch.bfloat16, shape=(b, self.hidden_size),
                     device=self.device, what=f"bf16 [B={b}, h={self.hidden_size}]")
        busy = [s for s in seq_ids if s in self._pending]
        if busy:
            raise ValueError(f"{op}: seq_ids {busy} have a propose awaiting accept()")
        k = num_drafts
        base = [self.cache.seq_len(s) if s in self.cache else 0 for s in seq_ids]
        meta = self._plan({s: k for s in seq_ids})
        for s, n in zip(seq_ids, base):
            self._pending[s] = (n, k)
        if use_graph is None:
            use_graph = self.device.type == "cuda"
        if not use_graph:
            return self._propose_body(last_tokens, target_hidden, meta, k)
        graph = self._graphs.get((b, k))
        if graph is None:
            graph = self._graphs[(b, k)] = ProposeGraph(self, b, k, meta)
        return graph(last_tokens, target_hidden, meta)

    def capture_propose(self, batch_size: int, num_drafts: int) -> "ProposeGraph":
        """The CUDA graph propose() replays for (B, k), captured on its first use; it exists
        after one propose() of that shape. (Capture needs a real step: see ProposeGraph.)"""
        key = (batch_size, num_drafts)
        if key not in self._graphs:
            raise ValueError(f"MtpHead.capture_propose: no graph for (B, k) = {key} yet; call propose() "
                             "once with that shape (the first call captures it)")
        return self._graphs[key]

    def _propose_body(self, tokens: Tensor, hidden: Tensor, meta: AttentionMetadata, k: int):
        """k batched forwards; meta covers all k rows of every sequence (plan({s: k}))."""
        b = tokens.shape[0]
        drafts, conf = [], []
        for j, meta_j in enumerate(_draft_metas(meta, b, k, self._consts)):
            logits, hidden = self._forward(tokens, hidden, meta_j)
            tokens, p = ops.argmax(logits)                                               # [B] int64, f32
            drafts.append(tokens)
            conf.append(p)
        if k == 1:   # views: a torch.stack is one more kernel per output in the captured graph
            return drafts[0].unsqueeze(1), conf[0].unsqueeze(1)
        return torch.stack(drafts, dim=1), torch.stack(conf, dim=1)

    # ---- checks ----------------------------------------------------------------------------
    def _check_rows(self, op: str, tokens: Tensor, target_hidden: Tensor) -> None:
        check_tensor(op, "tokens", tokens, dtype=torch.int64, ndim=1, device=self.device, what="int64 [T]")
        t = tokens.shape[0]
        check_tensor(op, "target_hidden", target_hidden, dtype=torch.bfloat16, shape=(t, self.hidden_size),
                     device=self.device, what=f"bf16 [T={t}, h={self.hidden_size}]")

    def __repr__(self) -> str:
        return (f"MtpHead({self.weight_format}, h={self.hidden_size}, V'={self.vocab}, "
                f"ffn={type(self.ffn).__name__}, kv={self.cache})")


# =============================================================================================
# metadata helpers
# =============================================================================================

def _shift_positions(meta: AttentionMetadata) -> AttentionMetadata:
    """The same step with RoPE positions r + 1 for drafter rows r (module docstring). Only RoPE
    reads positions; causality comes from seq_lens, so the slots and masks are unchanged."""
    return dataclasses.replace(meta, positions=meta.positions + 1)


def _draft_metas(meta: AttentionMetadata, b: int, k: int, consts: dict) -> list[AttentionMetadata]:
    """Per draft position j = 0..k−1, the metadata of its B decode rows, out of
    plan({s: k for s in seqs}) (B·k rows, k consecutive rows per sequence): row j of each
    sequence, seq_lens shortened to end at it, positions shifted to RoPE positions; position
    j's tensors are rows of [k, B] tensors (graph-capturable). Every device op here is a kernel
    of the captured propose (≈ 1–2 µs of replay each), so: the constant tensors (query_start_loc,
    the seq_len offsets) come from `consts`, built on the first (eager, warm-up) call and reused
    by the capture; k = 1 needs one op (positions + 1: slots and seq_lens are views); k > 1 four
    (positions, the two transposing copies, seq_lens)."""
    def const(name: str, n: int, fn):
        key = (name, n, meta.device)
        if key not in consts:
            consts[key] = fn()
        return consts[key]

    qsl = const("qsl", b, lambda: torch.arange(b + 1, dtype=torch.int32, device=meta.device))
    positions = meta.positions.view(b, k).t() + 1                                      # [k, B]
    if k == 1:                                                                         # [1, B] rows: views
        slots, seq_lens = meta.slot_mapping.view(1, b), meta.seq_lens.view(1, b)
    else:
        positions = positions.contiguous()
        slots = meta.slot_mapping.view(b, k).t().contiguous()                          # [k, B]
        back = const("back", k, lambda: torch.arange(k - 1, -1, -1, dtype=torch.int32, device=meta.device))
        seq_lens = (meta.seq_lens.unsqueeze(0) - back.unsqueeze(1)).contiguous()       # [k, B]
    out = []
    for j in range(k):
        ctx = [c + j for c in meta.context_lens]
        out.append(AttentionMetadata(positions[j], slots[j], qsl, seq_lens[j], meta.block_tables, meta.block_size,
                                     seq_ids=list(meta.seq_ids), query_lens=[1] * b, context_lens=ctx,
                                     max_query_len=1, max_seq_len=max(ctx) + 1, num_tokens=b))
    return out


class ProposeGraph:
    """A whole propose() for B sequences × k drafts captured as one CUDA graph.

    Static buffers: last_tokens int64 [B], target_hidden bf16 [B, h], metadata of B·k rows
    (block_tables width = head.max_blocks_per_seq); outputs drafts int64 [B, k], confidence
    f32 [B, k] (overwritten by the next replay). `graph(tokens, hidden, meta)` copies the inputs
    and meta (from `cache.plan({s: k ...})`) in, replays, returns the static outputs. No sync.

    Capture (first propose of this (B, k)): one warm-up step runs eagerly on a side stream over
    the static buffers (zero inputs, the real metadata), so lazy inits (cuBLAS handles, kernel
    attributes) happen outside the capture; its K/V writes land in the very rows the first
    replay then rewrites from the real inputs. Then the graph is captured (nothing runs).
    """

    def __init__(self, head: MtpHead, batch_size: int, num_drafts: int, meta: AttentionMetadata):
        dev = head.device
        self.batch_size, self.num_drafts = batch_size, num_drafts   # no reference to head: it owns
        # its graphs (head._graphs), and a cycle would leave a deleted head's graphs to the GC
        self.tokens = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(batch_size, head.hidden_size, dtype=torch.bfloat16, device=dev)
        self.meta = AttentionMetadata.empty(batch_size * num_drafts, batch_size, head.max_blocks_per_seq,
                                            block_size=head.cache.block_size, device=dev)
        self.meta.copy_(meta)   # real host fields (B sequences × k rows) for the capture
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            head._propose_body(self.tokens, self.hidden, self.meta, num_drafts)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.drafts, self.confidence = capture(
            self.graph, lambda: head._propose_body(self.tokens, self.hidden, self.meta, num_drafts))

    def __call__(self, tokens: Tensor, hidden: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        self.tokens.copy_(tokens)
        self.hidden.copy_(hidden)
        self.meta.copy_(meta)
        self.graph.replay()
        return self.drafts, self.confidence

    def replay(self) -> tuple[Tensor, Tensor]:
        """Replay with whatever the static buffers hold (benchmarks)."""
        self.graph.replay()
        return self.drafts, self.confidence


def _check_int(op: str, name: str, v, *, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{op}: {name} must be ≥ {minimum}, got {v}")


# =============================================================================================
# random weights (tests and benchmarks)
# =============================================================================================

def random_state_dict(cfg: ModelConfig, *, seed: int = 0, device="cpu", prefix: str = "mtp.",
                      fused_experts: bool = True) -> dict[str, Tensor]:
    """A BF16 MTP-head state dict with HF names for `cfg` (dense or MoE), weights ~ N(0, 1/fan_in)
    so activations stay O(1), norm weights ~ N(0, 0.1) (zero-centered: scale ≈ 1). Experts are
    fused (`experts.gate_up_proj` [E, 2I, h], `experts.down_proj` [E, h, I]) or per expert."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def w(*shape, fan_in=None):
        std = (fan_in or shape[-1]) ** -0.5
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16)

    def norm(n):
        return (torch.randn(n, generator=g, device=device) * 0.1).to(torch.bfloat16)

    layer, sd = f"{prefix}layers.0.", {}
    sd[f"{prefix}fc.weight"] = w(h, 2 * h)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "layers.0.input_layernorm",
                 "layers.0.post_attention_layernorm"):
        sd[f"{prefix}{name}.weight"] = norm(h)
    q_rows = nq * hd * (2 if cfg.attn_output_gate else 1)
    sd[f"{layer}self_attn.q_proj.weight"] = w(q_rows, h)
    sd[f"{layer}self_attn.k_proj.weight"] = w(nkv * hd, h)
    sd[f"{layer}self_attn.v_proj.weight"] = w(nkv * hd, h)
    sd[f"{layer}self_attn.o_proj.weight"] = w(h, nq * hd)
    sd[f"{layer}self_attn.q_norm.weight"] = norm(hd)
    sd[f"{layer}self_attn.k_norm.weight"] = norm(hd)
    mlp = f"{layer}mlp."
    if cfg.is_moe:
        e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        sd[f"{mlp}gate.weight"] = w(e, h)
        gate_up, down = w(e, 2 * i, h), w(e, h, i)
        if fused_experts:
            sd[f"{mlp}experts.gate_up_proj"], sd[f"{mlp}experts.down_proj"] = gate_up, down
        else:
            for x in range(e):
                sd[f"{mlp}experts.{x}.gate_proj.weight"] = gate_up[x, :i].contiguous()
                sd[f"{mlp}experts.{x}.up_proj.weight"] = gate_up[x, i:].contiguous()
                sd[f"{mlp}experts.{x}.down_proj.weight"] = down[x].contiguous()
        if s:
            sd[f"{mlp}shared_expert.gate_proj.weight"] = w(s, h)
            sd[f"{mlp}shared_expert.up_proj.weight"] = w(s, h)
            sd[f"{mlp}shared_expert.down_proj.weight"] = w(h, s)
            sd[f"{mlp}shared_expert_gate.weight"] = w(1, h)
    else:
        n = cfg.intermediate_size
        sd[f"{mlp}gate_proj.weight"] = w(n, h)
        sd[f"{mlp}up_proj.weight"] = w(n, h)
        sd[f"{mlp}down_proj.weight"] = w(h, n)
    return sd
