"""Feed-forward blocks of Qwen3-family decoder layers: dense SwiGLU MLP and sparse MoE.

    DenseMLP:   y = down(silu(gate(x)) · up(x))
    SparseMoE:  p = softmax(x · W_router^T) over all E experts (float32);
                top-k experts per row (lowest index wins ties), weights renormalized when
                cfg.norm_topk_prob; y = Σ_j w_j · expert_{id_j}(x) + sigmoid(x · w_sg) · shared(x)
                where every expert and the shared expert is a DenseMLP-shaped SwiGLU.

Weights arrive under HF checkpoint names (`{prefix}gate_proj.weight`, `{prefix}gate.weight`,
`{prefix}experts.{e}.down_proj.weight`, or the fused `{prefix}experts.gate_up_proj` [E, 2I, h]
gate half first and `{prefix}experts.down_proj` [E, h, I]) in any supported dialect (BF16;
ModelOpt or compressed-tensors NVFP4; Qwen FP8 block-scaled), detected per module from its keys
and converted once at load to `weight_format` ("bf16" | "fp8" | "nvfp4").

Routing never leaves the GPU: router logits → top-k → fixed-size ids int32 [T, k] and weights
f32 [T, k], and the experts run over those index tensors (see `ExpertBank`), so the whole block
is CUDA-graph capturable. On CUDA with BF16 or NVFP4 experts a decode step's block (T ≤ 32) is
four or five launches: `ops.moe_router` (the [router | shared gate] GEMV and the top-k in one launch; it also emits the shared expert — stored as expert E — as slot k of every row, weight
sigmoid(gate)), and moe_experts' kernels (group
the pairs by expert, gate+up, down, combine; NVFP4 with T·k ≤ 36, e.g. decode batches up to 4
at k = 9: no grouping, the expert-indexed one-row GEMV per (token, expert) pair for gate+up and
down, then the combine — the same bits).
Precision: expert and shared-expert outputs are BF16 (as
each projection's output is), their weighted sum is accumulated in float32 and rounded to BF16
once; the router logits are BF16 (the projection's output, as in HF) and are softmaxed in fp32.
The router and the shared-expert gate (E·h and h weights, ≤ 2 MB) always run in BF16: routing
decisions are the most precision-sensitive part of the block and too small to be worth
quantizing (ModelOpt and llm-compressor leave them unquantized too).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from atlas import ops
from atlas._ext import use_kernel
from atlas.fp8 import FP8_BLOCK
from atlas.linear import GEMV_MAX_ROWS, Linear, convert_weight, load_linears, load_weight
from atlas.nvfp4 import GEMV_CHUNK_K, dequantize_expert_stack, expert_words_for_gemv, tile_expert_stack

ROUTER_FUSED_MAX_ROWS = 32  # rows up to which SparseMoE.route runs ops.moe_router (one launch)
SILU_FUSE_MAX_K = 4096   # down-projection K up to which a multi-row step fuses silu·up (_fuse_silu)


def _need(sd: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in sd:
        raise KeyError(f"ffn: missing checkpoint tensor {key!r}")
    return sd[key]


def _expert_weight(sd: Mapping[str, Tensor], prefix: str, weight_format: str, device):
    """One expert projection `{prefix}weight...` (any dialect) → container in weight_format."""
    return convert_weight(load_weight(sd, prefix), weight_format, device)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """bf16(silu(gate) · up), silu(g) = g / (1 + exp(−g)), float32 math (reference.silu_mul: the
    rounding w4a16_gemv_silu and moe_experts fuse)."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(torch.bfloat16)


# =============================================================================================
# Dense SwiGLU MLP
# =============================================================================================

class DenseMLP:
    """y = down(silu(gate(x)) · up(x)); x [T, h] bf16 → [T, h] bf16.

    Weights: `{prefix}gate_proj`, `{prefix}up_proj` [I, h], `{prefix}down_proj` [h, I].
    Example:
        >>> mlp = DenseMLP.from_state_dict(sd, "mtp.layers.0.mlp.", "bf16", "cpu")
        >>> y = mlp(x)
    """

    def __init__(self, gate_proj, up_proj, down_proj):
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        # NVFP4 decode/verify rows: gate+up in one w4a16_gemv_dual launch and silu·up fused into
        # the down GEMV's load (w4a16_gemv_silu) where that measured faster (_fuse_silu): 2
        # launches instead of 3 GEMVs + 5 elementwise kernels, bitwise equal to the unfused
        # composition (the ops' contract).
        self.fused = all(getattr(p, "weight_format", None) == "nvfp4" for p in (gate_proj, up_proj, down_proj))

    @classmethod
    def from_state_dict(cls, state_dict, prefix: str, weight_format: str, device) -> "DenseMLP":
        # gate and up read the same input: one global scale when quantized here, so a fused
        # gate+up launch (w4a16_gemv_dual) stays possible
        gate, up = load_linears(state_dict, [f"{prefix}gate_proj.", f"{prefix}up_proj."], weight_format,
                                device, share_global_scale=True)
        return cls(gate, up, Linear.from_state_dict(state_dict, f"{prefix}down_proj.", weight_format, device))

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(p) for p in (self.gate_proj, self.up_proj, self.down_proj))

    def __call__(self, x: Tensor) -> Tensor:
        if self.fused and x.shape[0] <= GEMV_MAX_ROWS:
            g, u = ops.w4a16_gemv_dual(x, self.gate_proj.weight, self.up_proj.weight)
            if self._fuse_silu(x.shape[0]):
                return ops.w4a16_gemv_silu(g, u, self.down_proj.weight)
            return ops.w4a16_gemv(silu_mul(g, u), self.down_proj.weight)     # the same bits
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    def _fuse_silu(self, t: int) -> bool:
        """Whether down takes silu(g)·u on its load (w4a16_gemv_silu) for a T-row step. Measured
        on the H200 (bench/results/gemv_variants.md, 27B down 5120×17408): fused 34.5 vs 44.2 µs
        unfused at T = 1, but 58.4 vs 46.3 at T = 8 — every CTA recomputes silu over its K range
        one stage ahead, a latency chain that grows with the rows. Kept fused for T > 1 only where
        down's K ≤ 4096 (e.g. the 35B-A3B shared expert, K = 512; not measured there)."""
        return t == 1 or self.down_proj.in_features <= SILU_FUSE_MAX_K


def _nbytes(p) -> int:
    n = getattr(p, "nbytes", None)
    return int(n) if n is not None else 0


# =============================================================================================
# Expert bank: E SwiGLU experts stacked per format, run over device-side expert ids
# =============================================================================================

class _Stack:
    """E weights of one role (gate, up or down), all [N, K], stacked in one format:
        bf16:  w [E, N, K] bf16
        nvfp4: packed uint8 [E, N, K/2], block_scale e4m3 [E, N, K/16], global_scale f32 [E];
               on CUDA derived once into what ops.moe_experts reads fastest: the tiled views of
               nvfp4.tile_expert_stack where N and K are multiples of 128 (every Qwen3.x MoE),
               else packed [E, N, K/8, 4], the words in the GEMV bit order (expert_words_for_gemv)
        fp8:   w e4m3 [E, N, K], scale_inv f32 [E, ceil(N/128), ceil(K/128)]
    `dense(idx)` dequantizes the experts idx (int64 [R], on the device) to bf16 [R, N, K]."""

    def __init__(self, weights: list, weight_format: str):
        self.format = weight_format
        if weight_format == "bf16":
            self.t = (torch.stack(weights),)
        elif weight_format == "nvfp4":
            packed = torch.stack([w.packed for w in weights])   # a copy of our own: re-ordered in place of it
            scale = torch.stack([w.block_scale for w in weights])
            if packed.is_cuda:
                packed, scale = self.kernel_layout(packed, scale)
            self.t = (packed, scale, torch.stack([w.global_scale.reshape(()) for w in weights]))
        else:
            self.t = (torch.stack([w.weight for w in weights]), torch.stack([w.weight_scale_inv for w in weights]))
        self.num_experts = len(weights)
        self.shape = tuple(weights[0].shape)

    @staticmethod
    def kernel_layout(packed: Tensor, block_scale: Tensor) -> tuple[Tensor, Tensor]:
        """An NVFP4 stack (checkpoint words) → the form ops.moe_experts streams fastest: the tiled
        views where N and K are multiples of 128 (gate, up and down agree: [I, h], [h, I]), else
        the words in the GEMV bit order with the scales as they are."""
        _, n, half_k = packed.shape
        if n % GEMV_CHUNK_K == 0 and (2 * half_k) % GEMV_CHUNK_K == 0:
            return tile_expert_stack(packed, block_scale)
        return expert_words_for_gemv(packed), block_scale

    @classmethod
    def from_dense(cls, w: Tensor, weight_format: str, device, extra: list = ()) -> "_Stack":
        """From a fused BF16 checkpoint tensor [E, N, K] (+ `extra` converted weights appended)."""
        return cls([convert_weight(w[e], weight_format, device) for e in range(w.shape[0])] + list(extra),
                   weight_format)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.t)

    def dense(self, idx: Tensor | None = None) -> Tensor:
        pick = (lambda t: t) if idx is None else (lambda t: t.index_select(0, idx))
        if self.format == "bf16":
            return pick(self.t[0])
        n, k = self.shape
        if self.format == "nvfp4":
            return dequantize_expert_stack(*(pick(t) for t in self.t)).to(torch.bfloat16)
        w, s = (pick(t) for t in self.t)                                       # [R, N, K] e4m3
        s = s.repeat_interleave(FP8_BLOCK, 1)[:, :n].repeat_interleave(FP8_BLOCK, 2)[:, :, :k]
        return (w.float() * s).to(torch.bfloat16)

    def chunks(self, size: int, limit: int):
        """(first expert, bf16 [c, N, K]) over consecutive chunks of ≤ size of the first `limit` experts."""
        for e0 in range(0, limit, size):
            idx = torch.arange(e0, min(e0 + size, limit), device=self.t[0].device)
            yield e0, self.dense(idx)


class ExpertBank:
    """E SwiGLU experts: expert_e(x) = down_e(silu(gate_e(x)) · up_e(x)), weights [I, h], [h, I].

    forward(x [T, h] bf16, ids int32 [T, k], weights f32 [T, k]) → Σ_j weights[:, j] ·
    expert_{ids[:, j]}(x) as float32 [T, h], with each expert's output rounded to BF16 first.
    Device-only strategies (none reads the ids on the host, all graph-capturable):
      "kernel": ops.moe_experts — pairs grouped by expert on the device, then tensor-core
                grouped GEMVs that read each expert hit once for all its (row, slot) pairs
                straight from the BF16 or NVFP4 stack (three or four launches; the default on CUDA for
                those formats). The torch strategies below serve FP8 stacks and the CPU.
      "gather": dequantize/gather the T·k selected experts' weights and run batched GEMVs —
                reads T·k experts (plus the copy); right when T·k is small (decode, B = 1).
      "dense":  run every expert on every row (experts in chunks of `chunk` to bound scratch)
                and combine with a dense [T, E] routing matrix — reads all E experts once;
                right when T·k approaches E (batched propose), where most experts are hit anyway.
    Without the kernel the default picks by bytes read: gather when 3·T·k < E (the gather
    copies and re-reads what it reads), else dense.
    """

    def __init__(self, gate: _Stack, up: _Stack, down: _Stack, num_experts: int | None = None):
        self.gate, self.up, self.down = gate, up, down
        self.num_experts = gate.num_experts if num_experts is None else num_experts   # routed E
        # a stack may hold one more expert at index E: the shared expert, run by the kernel path
        # as slot k of every row (moe_route(shared_slot=True))
        self.has_shared_slot = gate.num_experts == self.num_experts + 1

    @classmethod
    def from_state_dict(cls, state_dict, prefix: str, num_experts: int, weight_format: str, device,
                        shared: tuple | None = None):
        """prefix: "...mlp.experts." — fused BF16 `gate_up_proj` [E, 2I, h] (gate half first) and
        `down_proj` [E, h, I], or per-expert `{e}.gate_proj.` / `{e}.up_proj.` / `{e}.down_proj.`.
        shared: optional (gate, up, down) weights in weight_format (the shared expert, same I),
        stored as expert E of the stacks."""
        sd = state_dict
        extra = [[w] for w in shared] if shared is not None else [[], [], []]
        if prefix + "gate_up_proj" in sd:
            gu = sd[prefix + "gate_up_proj"]
            down = _need(sd, prefix + "down_proj")
            if gu.dim() != 3 or gu.shape[0] != num_experts or gu.shape[1] % 2:
                raise ValueError(f"{prefix}gate_up_proj must be [E={num_experts}, 2I, h], got {list(gu.shape)}")
            for key, t in ((prefix + "gate_up_proj", gu), (prefix + "down_proj", down)):
                if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
                    raise TypeError(f"{key}: fused experts must be a BF16/F16/F32 tensor (quantized experts "
                                    f"come per expert: experts.{{e}}.gate_proj.*), got {t.dtype}")
            i = gu.shape[1] // 2
            return cls(_Stack.from_dense(gu[:, :i], weight_format, device, extra[0]),
                       _Stack.from_dense(gu[:, i:], weight_format, device, extra[1]),
                       _Stack.from_dense(down, weight_format, device, extra[2]), num_experts)
        roles = []
        for role, more in zip(("gate_proj", "up_proj", "down_proj"), extra):
            ws = [_expert_weight(sd, f"{prefix}{e}.{role}.", weight_format, device) for e in range(num_experts)]
            roles.append(_Stack(ws + more, weight_format))
        return cls(*roles, num_experts)

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def expert_nbytes(self) -> int:
        """Bytes of one expert (all three projections)."""
        return self.nbytes // self.gate.num_experts

    def __call__(self, x: Tensor, ids: Tensor, weights: Tensor, *, path: str | None = None,
                 chunk: int = 32, shared: Tensor | None = None, shared_gate: Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> Tensor:
        """→ float32 [T, h] (path "kernel": out_dtype bf16 rounds the sum once instead); path
        "kernel" with shared [T, h] bf16 and shared_gate [T] bf16 logits: bf16 [T, h] =
        bf16(routed + sigmoid(shared_gate) · shared) (ops.moe_experts). ids may name expert E
        (the shared slot) when the stacks hold it (has_shared_slot)."""
        t, k = ids.shape
        if path is None:
            path = self._default_path(x, t, k)
        if path == "kernel":
            pick = (lambda s: s.t) if self.gate.format == "nvfp4" else (lambda s: s.t[0])  # noqa: E731
            return ops.moe_experts(x, ids, weights, pick(self.gate), pick(self.up), pick(self.down),
                                   shared=shared, shared_gate=shared_gate, out_dtype=out_dtype)
        if shared is not None:
            raise ValueError("ExpertBank: shared / shared_gate are fused on the 'kernel' path only")
        if path == "gather":
            return self._gather(x, ids, weights)
        if path == "dense":
            return self._dense(x, ids, weights, chunk)
        raise ValueError(f"ExpertBank: path must be 'kernel', 'gather', 'dense' or None, got {path!r}")

    def _default_path(self, x: Tensor, t: int, k: int) -> str:
        h, inter = self.down.shape
        if (use_kernel(x) and self.gate.format in ("bf16", "nvfp4") and t * k <= 65535 and h % 32 == 0
                and inter % 32 == 0 and h <= 8192 and inter <= 8192 and k <= 32
                and self.gate.num_experts <= ops.MOE_EXPERTS_MAX_EXPERTS):
            return "kernel"
        return "gather" if 3 * t * k < self.num_experts else "dense"

    def _gather(self, x, ids, weights):
        t, k = ids.shape
        flat = ids.reshape(-1).long()                                      # [T·k]
        xr = x.repeat_interleave(k, dim=0).unsqueeze(-1)                   # [T·k, h, 1]
        g = torch.bmm(self.gate.dense(flat), xr).squeeze(-1)               # [T·k, I] bf16
        u = torch.bmm(self.up.dense(flat), xr).squeeze(-1)
        a = silu_mul(g, u).unsqueeze(-1)                                   # [T·k, I, 1]
        d = torch.bmm(self.down.dense(flat), a).squeeze(-1)                # [T·k, h] bf16
        return (d.float().view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _dense(self, x, ids, weights, chunk):
        t, k = ids.shape
        route = torch.zeros(t, self.num_experts, dtype=torch.float32, device=x.device)
        route.scatter_add_(1, ids.long(), weights.float())                 # [T, E]
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        e = self.num_experts
        gates, ups, downs = self.gate.chunks(chunk, e), self.up.chunks(chunk, e), self.down.chunks(chunk, e)
        for (e0, wg), (_, wu), (_, wd) in zip(gates, ups, downs):
            g = torch.einsum("eih,th->tei", wg, x)                         # [T, c, I] bf16
            u = torch.einsum("eih,th->tei", wu, x)
            d = torch.einsum("ehi,tei->teh", wd, silu_mul(g, u))          # [T, c, h] bf16
            out += (d.float() * route[:, e0:e0 + wg.shape[0], None]).sum(dim=1)
        return out


# =============================================================================================
# Sparse MoE block (Qwen3-Next / Qwen3.5 / Qwen3.6 A3B)
# =============================================================================================

class SparseMoE:
    """Router + E routed SwiGLU experts + one shared expert gated by sigmoid(x · w_sg).

    x [T, h] bf16 → [T, h] bf16. Weights under `prefix` (e.g. "mtp.layers.0.mlp."): `gate.weight`
    [E, h] (router), `experts.*` (see ExpertBank), `shared_expert.{gate,up,down}_proj`,
    `shared_expert_gate.weight` [1, h].
    Example:
        >>> moe = SparseMoE.from_state_dict(cfg, sd, "mtp.layers.0.mlp.", "nvfp4", "cuda")
        >>> y = moe(x)
    """

    def __init__(self, router: Tensor, experts: ExpertBank, shared: DenseMLP | None,
                 shared_gate: Tensor | None, top_k: int, renormalize: bool):
        # One [E (+1), h] BF16 matrix: the router rows, then the shared-expert gate row, so one
        # GEMV yields both (router / shared_gate below are views of it).
        self.gates = torch.cat([router] + ([shared_gate] if shared_gate is not None else [])).contiguous()
        e = router.shape[0]
        self.router = self.gates[:e]
        self.shared_gate = self.gates[e:] if shared_gate is not None else None
        self.experts, self.shared = experts, shared
        self.num_experts, self.top_k, self.renormalize = e, top_k, renormalize

    @classmethod
    def from_state_dict(cls, cfg, state_dict, prefix: str, weight_format: str, device) -> "SparseMoE":
        sd = state_dict
        e = cfg.num_experts
        router = convert_weight(load_weight(sd, prefix + "gate."), "bf16", device)
        if tuple(router.shape) != (e, cfg.hidden_size):
            raise ValueError(f"{prefix}gate.weight must be [E={e}, h={cfg.hidden_size}], got {list(router.shape)}")
        shared = shared_gate = None
        if any(k.startswith(prefix + "shared_expert.") for k in sd):
            shared = DenseMLP.from_state_dict(sd, prefix + "shared_expert.", weight_format, device)
            if prefix + "shared_expert_gate.weight" in sd:
                shared_gate = convert_weight(load_weight(sd, prefix + "shared_expert_gate."), "bf16", device)
        # The kernel path runs the shared expert as expert E of the stacks (one more pair per row,
        # weight sigmoid(gate) from moe_route): no separate shared-expert launches. Needs the
        # shared expert's width to equal the experts' (Qwen3-Next / 3.5 / 3.6: 512 both) and a
        # kernel format; the DenseMLP stays for the other paths (a second copy of one expert).
        slot = (shared is not None and shared_gate is not None and weight_format in ("bf16", "nvfp4")
                and shared.gate_proj.out_features == cfg.moe_intermediate_size)
        extra = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight) if slot else None
        experts = ExpertBank.from_state_dict(sd, prefix + "experts.", e, weight_format, device, shared=extra)
        return cls(router, experts, shared, shared_gate, cfg.num_experts_per_tok,
                   bool(getattr(cfg, "norm_topk_prob", True)))

    @property
    def nbytes(self) -> int:
        n = self.gates.numel() * 2 + self.experts.nbytes
        if self.shared is not None:
            n += self.shared.nbytes
        return n

    def active_nbytes(self, rows: int = 1) -> int:
        """Weight bytes one call over `rows` rows must read (router and shared gate, the experts
        hit, shared expert): the floor's numerator. Experts hit = the expected number of distinct
        experts among rows·k uniform picks, E·(1 − (1 − 1/E)^(rows·k)) (= k at rows = 1; ≈ 162 of
        256 at 32 rows × top-8)."""
        e = self.num_experts
        hit = e * (1.0 - (1.0 - 1.0 / e) ** (rows * self.top_k)) if rows > 1 else min(e, self.top_k)
        n = self.gates.numel() * 2 + int(hit * self.experts.expert_nbytes())
        if self.shared is not None:
            n += self.shared.nbytes
        return n

    def gate_logits(self, x: Tensor) -> Tensor:
        """x [T, h] bf16 → [T, E (+1)] bf16: router logits (then the shared-expert gate logit)."""
        return F.linear(x, self.gates)

    def route(self, x: Tensor, *, shared_slot: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, h] bf16 → (logits bf16 [T, E (+1)], ids int32 [T, k (+1)], weights f32 [T, k (+1)]),
        on the device. Up to ROUTER_FUSED_MAX_ROWS rows (decode, verify, propose): ops.moe_router,
        one launch; more (prefill chunks): the GEMM (cuBLAS on CUDA) then ops.moe_route — the fused
        kernel re-reads the gate rows once per 16 tokens. Same ids for the same logits either way."""
        if x.shape[0] <= ROUTER_FUSED_MAX_ROWS:
            return ops.moe_router(x, self.gates, self.top_k, self.renormalize, num_experts=self.num_experts,
                                  shared_slot=shared_slot)
        logits = self.gate_logits(x)
        ids, w = ops.moe_route(logits if shared_slot else logits[:, :self.num_experts], self.top_k,
                               self.renormalize, shared_slot=shared_slot)
        return logits, ids, w

    def __call__(self, x: Tensor, *, path: str | None = None) -> Tensor:
        t = x.shape[0]
        path = path or self.experts._default_path(x, t, self.top_k)
        if path == "kernel" and self.experts.has_shared_slot:
            # shared expert = slot k of every row: 4 or 5 launches for the whole block (moe_router,
            # moe_experts' three or four kernels)
            _, ids, w = self.route(x, shared_slot=True)
            return self.experts(x, ids, w, path=path, out_dtype=torch.bfloat16)
        logits, ids, w = self.route(x)
        if path == "kernel" and self.shared is not None and self.shared_gate is not None:
            # routed experts + sigmoid(gate)·shared expert combined in moe_experts' epilogue
            return self.experts(x, ids, w, path=path, shared=self.shared(x), shared_gate=logits[:, self.num_experts])
        out = self.experts(x, ids, w, path=path)                           # [T, h] f32
        if self.shared is not None:
            s = self.shared(x).float()
            if self.shared_gate is not None:
                s = s * torch.sigmoid(logits[:, self.num_experts:].float())   # [T, 1] gate
            out = out + s
        return out.to(torch.bfloat16)


def build_ffn(cfg, state_dict, prefix: str, weight_format: str, device):
    """The FFN of a decoder layer at `prefix` ("...mlp."): SparseMoE when the state dict holds a
    router (`{prefix}gate.weight`) and cfg.is_moe, else DenseMLP."""
    has_router = prefix + "gate.weight" in state_dict or prefix + "gate.weight_packed" in state_dict
    if bool(getattr(cfg, "is_moe", False)) and has_router:
        return SparseMoE.from_state_dict(cfg, state_dict, prefix, weight_format, device)
    return DenseMLP.from_state_dict(state_dict, prefix, weight_format, device)
