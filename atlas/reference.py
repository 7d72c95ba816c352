"""Plain-torch references of every atlas op: the CPU path and the test oracle.

Float32 math, written to be obviously right rather than fast. Kernels in csrc/ are checked
against these; quantization is bit-exact, everything else within a precision-fitting bound.
Glossary (DESIGN.md): T rows, B sequences, nq/nkv/hd heads and head dim, h hidden,
M ≤ 32 GEMV rows, N×K weight, bs block size.
"""
from __future__ import annotations

import torch

# =============================================================================================
# NVFP4: E2M1 elements × E4M3 block scales (16 along K) × one float32 global scale
# =============================================================================================

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude index 0..7; bit 3 = sign
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16


def e2m1_lut(device=None) -> torch.Tensor:
    """float32 [16]: value of each 4-bit code (codes 8..15 are the negatives; 8 is -0)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 → uint8 E2M1 codes, round-to-nearest-even with saturation at ±6.

    Decision thresholds on |v| (ties go to the even code): ≤0.25→0, <0.75→0.5, ≤1.25→1,
    <1.75→1.5, ≤2.5→2, <3.5→3, ≤5→4, else 6. The sign bit is v's sign bit (−0.1 → code 8, −0).
    NaN inputs are the caller's problem (quantize_nvfp4 rejects them)."""
    a = v.abs()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = torch.signbit(v).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def e4m3_rne_satfinite(v: torch.Tensor) -> torch.Tensor:
    """float32 → float8_e4m3fn, round-to-nearest-even, saturating at ±448 (torch's cast alone
    turns values past the top binade into NaN, so clamp first; the clamp is exact)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 [] = amax / (6·448), or 1.0 when amax is 0 (an all-zero weight)."""
    amax = amax.float()
    # Divide by a full tensor, not a Python scalar: torch's CUDA division by a scalar multiplies
    # by its reciprocal, which is not bit-exact with the kernel's IEEE division.
    return torch.where(amax > 0, amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def quantize_nvfp4(w: torch.Tensor):
    """BF16/F16/F32 [N, K] → (packed uint8 [N, K/2], block_scale e4m3 [N, K/16], global_scale f32 []).

    global_scale = amax(|w|) / (6·448) (1.0 when amax is 0). Per 16-block along K:
    s = e4m3_rne_satfinite(block_amax / 6 / global_scale); elements
    e2m1_rne_satfinite(x / (float(s) · global_scale)), with every code 0 where that divisor is 0.
    A block whose scale underflows E4M3 (block_amax < 2^-10 · 6 · global_scale, i.e. below
    ~2^-10/448 of the tensor's amax) therefore stores scale 0 and zero codes.
    Low nibble = even element: byte (n, j) = code[n, 2j] | code[n, 2j+1] << 4.
    The caller guarantees finite input (atlas.quantize_nvfp4 raises on NaN/Inf)."""
    n, k = w.shape
    x = w.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = nvfp4_global_scale(x.abs().amax())
    block_amax = x.abs().amax(dim=-1)                              # [N, K/16]
    s = e4m3_rne_satfinite(block_amax / torch.full_like(block_amax, E2M1_MAX) / gs)  # [N, K/16] e4m3
    denom = (s.float() * gs).unsqueeze(-1)                          # [N, K/16, 1]
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    codes = torch.where(denom > 0, e2m1_encode(x / safe), torch.zeros((), dtype=torch.uint8))
    codes = codes.reshape(n, k // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous(), s.contiguous(), gs.reshape(())


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 [N, K/2], block_scale e4m3 [N, K/16], global_scale f32 []) → [N, K] of dtype.
    W = e2m1 · float(block_scale) · global_scale, computed in float32."""
    n = packed.shape[0]
    lut = e2m1_lut(packed.device)
    lo = lut[(packed & 0xF).long()]
    hi = lut[(packed >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(n, -1, NVFP4_BLOCK)   # [N, K/16, 16]
    scale = block_scale.float().unsqueeze(-1) * global_scale.float()
    return (vals * scale).reshape(n, -1).to(dtype)


# =============================================================================================
# w4a16_gemv family (GEMV work: insert below)
# =============================================================================================

def w4a16_gemv(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
               global_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = x · Wᵀ with W the NVFP4 weight (packed uint8 [N, K/2], block_scale e4m3 [N, K/16],
    global_scale f32 []): x [M, K] bf16 → y [M, N] of out_dtype (bf16 | float32).

    float32 math (x.float() @ dequantize(...).T), rounded once to out_dtype."""
    w = dequantize_nvfp4(packed, block_scale, global_scale, torch.float32)   # [N, K]
    return (x.float() @ w.T).to(out_dtype)


def qg_deinterleave(y: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[M, nq·2hd] with per-head [q (hd) | gate (hd)] columns → [M, Q all heads | G all heads]."""
    m = y.shape[0]
    per_head = y.reshape(m, num_heads, 2, head_dim)
    return torch.cat([per_head[:, :, 0].reshape(m, -1), per_head[:, :, 1].reshape(m, -1)], dim=1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(silu(gate) · up): silu(g) = g / (1 + exp(−g)) and the product in float32, one
    rounding to bf16 (the activation w4a16_gemv_silu fuses; same formula as F.silu)."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(torch.bfloat16)



# =============================================================================================
# reshape_and_cache (paged KV work: insert below)
# =============================================================================================

# ---- reshape_and_cache: K/V rows → paged cache (BF16 copy, or FP8 with per-row scales) -------

KV_FP8_MAX = E4M3_MAX  # |stored value| ≤ 448: each (token, kv-head) row is scaled to fill E4M3


def quantize_kv_fp8(x: torch.Tensor):
    """K/V rows → FP8 E4M3 with one float32 scale per row (per token and kv head).

    x [..., hd] bf16 | f32 → (q float8_e4m3fn [..., hd], scale float32 [...]).
    scale = amax(|row|) / 448 (1.0 when amax == 0); q = e4m3_rne_satfinite(x / scale);
    the row's values are float(q) · scale. Both divisions are elementwise IEEE float32
    divisions by a tensor (never by a Python scalar: torch turns `t / 448.0` on CUDA into a
    multiplication by the reciprocal, which the kernel does not do). Inputs must be finite."""
    x = x.float()
    amax = x.abs().amax(dim=-1)                                              # [...]
    scale = torch.where(amax > 0, amax / torch.full_like(amax, KV_FP8_MAX), torch.ones_like(amax))
    q = e4m3_rne_satfinite(x / scale.unsqueeze(-1))
    return q, scale


def dequantize_kv_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    """(q float8_e4m3fn [..., hd], scale float32 [...]) → [..., hd] of dtype = float(q) · scale."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write token t's K/V rows to cache slot slot_mapping[t], in place; negative slots skip.

    key, value [T, nkv, hd] bf16 (row stride may exceed nkv·hd); k_cache, v_cache
    [num_blocks, bs, nkv, hd] bf16 | float8_e4m3fn, contiguous, so slot = block · bs + offset
    is the row index of the cache viewed as [num_blocks · bs, nkv, hd]. slot_mapping int64 [T],
    slots distinct, < num_blocks · bs. BF16 cache: exact copy. FP8 cache: quantize_kv_fp8 per
    (token, kv head) row, scale stored in k_scale / v_scale float32 [num_blocks, bs, nkv].
    Slots not named keep their contents."""
    nkv, hd = key.shape[1], key.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]                                                  # [T']
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = src[keep]                                                        # [T', nkv, hd]
        if cache.dtype == torch.float8_e4m3fn:
            q, s = quantize_kv_fp8(rows)
            # index_put_ has no float8 kernel: write the bytes
            cache.view(torch.uint8).view(-1, nkv, hd)[slots] = q.view(torch.uint8)
            scale.view(-1, nkv)[slots] = s
        else:
            cache.view(-1, nkv, hd)[slots] = rows.to(cache.dtype)


# =============================================================================================
# paged_decode (paged KV work: insert below)
# =============================================================================================

# ---- paged_decode: decode / verify attention over the paged KV cache ------------------------


def paged_kv_gather(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
                    seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len cache rows, float32 [seq_len, nkv, hd].

    Position p lives at cache[block_table[p // bs], p % bs]; an FP8 row is float(q) · scale
    with its (token, kv head) scale. cache [num_blocks, bs, nkv, hd] bf16 | float8_e4m3fn,
    scale float32 [num_blocks, bs, nkv] or None, block_table int32 [max_blocks]."""
    bs = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks, offs = block_table.to(cache.device)[pos // bs].long(), pos % bs
    if cache.dtype == torch.float8_e4m3fn:  # advanced indexing has no float8 kernel: gather bytes
        rows = cache.view(torch.uint8)[blocks, offs].view(torch.float8_e4m3fn)
        return dequantize_kv_fp8(rows, scale[blocks, offs])
    return cache[blocks, offs].float()


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """Causal GQA attention of q_len new tokens per sequence over its paged KV, float32 math.

    query [B, nq, hd] (q_len 1) or [B, q_len, nq, hd] bf16; k_cache, v_cache
    [num_blocks, bs, nkv, hd] bf16 | float8_e4m3fn (FP8 scales k_scale, v_scale float32
    [num_blocks, bs, nkv]); block_tables int32 [B, max_blocks]; seq_lens int32 [B], tokens in
    the cache including the q_len new ones. Query token j of sequence b sits at position
    seq_lens[b] − q_len + j and attends to positions 0..that position; query head h reads kv
    head h // (nq / nkv). Returns (out bf16 shaped like query, lse float32 [B, (q_len,) nq]):
    out = softmax(s) · V and lse = logsumexp(s) (natural log) of s = softmax_scale · q·k over
    the attended positions; a row that attends nothing (seq_len 0) gets out 0, lse −inf."""
    squeeze = query.dim() == 3
    q = query.unsqueeze(1) if squeeze else query                          # [B, T, nq, hd]
    b_count, t, nq, hd = q.shape
    nkv = k_cache.shape[2]
    group = nq // nkv
    out = torch.zeros(b_count, t, nq, hd, dtype=torch.float32, device=query.device)
    lse = torch.full((b_count, t, nq), float("-inf"), dtype=torch.float32, device=query.device)
    for b in range(b_count):
        seq_len = int(seq_lens[b])
        if seq_len <= 0:
            continue
        k = paged_kv_gather(k_cache, k_scale, block_tables[b], seq_len)  # [L, nkv, hd]
        v = paged_kv_gather(v_cache, v_scale, block_tables[b], seq_len)
        k = k.repeat_interleave(group, dim=1)                             # [L, nq, hd]
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("tnd,lnd->ntl", q[b].float(), k) * softmax_scale  # [nq, T, L]
        last = seq_len - t + torch.arange(t, device=query.device)        # [T] newest visible pos
        visible = torch.arange(seq_len, device=query.device)[None, :] <= last[:, None]  # [T, L]
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)                              # [nq, T]; -inf if none
        p = torch.exp(s - row_lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # masked → exp(-inf) = 0
        out[b] = torch.einsum("ntl,lnd->tnd", p, v)
        lse[b] = row_lse.transpose(0, 1)
    out = out.to(torch.bfloat16)
    if squeeze:
        return out.squeeze(1), lse.squeeze(1)
    return out, lse


# =============================================================================================
# small layer ops: rms_norm, rope, sigmoid gate, argmax, moe routing (layer work: insert below)
# =============================================================================================

# ---- rms_norm / qk_norm_rope / sigmoid_gate_mul (attention layer work) ----------------------


def _rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """float32 x·rsqrt(mean(x²) + eps)·w over the last dim; w = 1 + weight when zero_centered
    (Qwen3-Next / 3.5 / 3.6 norms), weight otherwise (Qwen3)."""
    xf = x.float()
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, D] bf16, weight [D] bf16|f32 → [R, D] bf16: float32 math, one rounding at the end.
    With residual [R, D] bf16: h = bf16(x + residual) (float32 add) is written to residual in
    place and normalized instead of x."""
    if residual is not None:
        residual.copy_((x.float() + residual.float()).to(torch.bfloat16))
        x = residual
    return _rms_normalize(x, weight, eps, zero_centered).to(torch.bfloat16)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, rope_theta: float):
    """NeoX RoPE tables for int64 positions [T] → (cos, sin) float32 [T, rotary_dim/2].

    inv_freq_i = theta^(−2i/rotary_dim), angle = pos · inv_freq_i, both in float64, then
    cos/sin in float64 rounded once to float32 (exact up to that rounding at any position;
    HF computes the angle in float32, which loses ~3 mrad at position 32K)."""
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = torch.pow(torch.tensor(float(rope_theta), dtype=torch.float64), -i / rotary_dim)
    angle = positions.to(torch.float64).unsqueeze(-1) * inv_freq                  # [T, rot/2]
    return torch.cos(angle).float(), torch.sin(angle).float()


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX (rotate-half) RoPE on float32 x [T, H, hd] with cos/sin [T, rot/2]: dim i
    pairs with dim i + rot/2 for i < rot/2; dims ≥ rot pass through."""
    half = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)                                      # [T, 1, rot/2]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor,
                 k_norm_weight: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale=None, v_scale=None, *,
                 eps: float, zero_centered: bool, rotary_dim: int, rope_theta: float) -> torch.Tensor:
    """Per-head RMSNorm of q and k, partial NeoX RoPE, then K and V into the paged cache.

    q [T, nq, hd], k/v [T, nkv, hd] bf16 (strided views allowed); norm weights [hd];
    positions int64 [T]; slot_mapping int64 [T] (< 0 skips the write). Returns q_out
    [T, nq, hd] bf16 = bf16(rope(norm(q))). K is rounded ONCE to bf16 after norm and RoPE
    (k_bf = bf16(rope(norm(k)))) and written with exactly the math of reshape_and_cache
    (BF16 copy, or FP8 with one scale per (token, kv head)); V is written as given."""
    cos, sin = rope_cos_sin(positions, rotary_dim, rope_theta)
    qn = apply_rope_neox(_rms_normalize(q, q_norm_weight, eps, zero_centered), cos, sin)
    kn = apply_rope_neox(_rms_normalize(k, k_norm_weight, eps, zero_centered), cos, sin)
    reshape_and_cache(kn.to(torch.bfloat16), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return qn.to(torch.bfloat16)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out = x · sigmoid(gate), elementwise in float32, one rounding to bf16 (Qwen3-Next gated
    attention output, before o_proj). x and gate bf16 of one shape."""
    return (x.float() * torch.sigmoid(gate.float())).to(torch.bfloat16)


# ---- argmax / moe_route / embedding (MTP work) ---------------------------------------------


def argmax(logits: torch.Tensor):
    """Row-wise greedy pick with its top-1 softmax probability.

    logits [R, V] bf16 | f32 → (ids int64 [R], prob float32 [R]).
    ids[r] = the lowest index among the maxima of row r (torch.argmax returns the first one);
    NaN logits never win (a row with no other value: index 0) and make prob NaN;
    prob[r] = 1 / Σ_v exp(logits[r, v] − max_r) = softmax(logits[r])[ids[r]], float32 math."""
    x = logits.float()
    ids = torch.argmax(x.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")), dim=-1)
    m = x.gather(-1, ids.unsqueeze(-1))
    prob = 1.0 / torch.exp(x - m).sum(dim=-1)
    return ids.to(torch.int64), prob.to(torch.float32)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool = True, shared_slot: bool = False):
    """MoE router: softmax over all E experts in float32, top-k, optional renormalization.

    logits [T, E] bf16 | f32 → (ids int32 [T, k], weights float32 [T, k]).
    Experts are ranked by logit (softmax is monotonic, so this is the rank by probability
    without the ties that rounding of the probabilities would add); among equal logits the
    lowest expert index wins. Slot j holds the j-th best expert. weights = softmax(logits)[ids],
    divided by their sum when `renormalize` (Qwen3 `norm_topk_prob`).
    shared_slot: logits is [T, E + 1] = [router | shared-expert gate]; routing uses the first E
    columns and the outputs get slot k = (E, sigmoid(logits[:, E])) → [T, k + 1]."""
    x = logits.float()
    if shared_slot:
        x, gate = x[:, :-1], x[:, -1:]
    probs = torch.softmax(x, dim=-1)
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    w = probs.gather(-1, order)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if shared_slot:
        order = torch.cat([order, torch.full_like(order[:, :1], x.shape[1])], dim=1)
        w = torch.cat([w, 1.0 / (1.0 + torch.exp(-gate))], dim=1)
    return order.to(torch.int32), w.to(torch.float32)


def moe_router(x: torch.Tensor, gates: torch.Tensor, top_k: int, renormalize: bool = True,
               num_experts: int | None = None, shared_slot: bool = False):
    """MoE router from the hidden states: logits = F.linear(x, gates) (bf16 in, float32 sums, one
    bf16 rounding), then moe_route over them.

    x [T, h] bf16, gates [R, h] bf16 (R = E router rows, or E + 1 with the shared-expert gate row
    last) → (logits bf16 [T, R], ids int32 [T, k (+1)], weights float32 [T, k (+1)]).
    num_experts: E (default R − shared_slot); shared_slot as in moe_route (needs R = E + 1)."""
    e = gates.shape[0] - int(shared_slot) if num_experts is None else num_experts
    logits = torch.nn.functional.linear(x, gates)
    ids, weights = moe_route(logits[:, :e + int(shared_slot)], top_k, renormalize, shared_slot)
    return logits, ids, weights


def embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gather rows: table [V, h], ids int32|int64 [T] in [0, V) → [T, h] (same dtype, exact)."""
    return table.index_select(0, ids.long())


def embedding_norm_concat(table: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                          w_hidden: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """The MTP fc input: [rms_norm(table[ids], w_embed) | rms_norm(hidden, w_hidden)] → bf16 [T, 2h]
    (each half float32 math, one bf16 rounding, as rms_norm)."""
    def norm(x, w):
        xf = x.float()
        wf = w.float() + 1.0 if zero_centered else w.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * wf).to(torch.bfloat16)
    return torch.cat([norm(embedding(table, ids), w_embed), norm(hidden, w_hidden)], dim=-1)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts over expert ids: x [T, h] bf16, ids int [T, k], weights f32 [T, k],
    gate/up [E, I, h], down [E, h, I] dense float weights → out float32 [T, h].

    For each pair (t, j), e = ids[t, j] (an id outside [0, E) contributes nothing):
    g = bf16(W_gate[e]·x[t]), u = bf16(W_up[e]·x[t]) (float32 dots), a = bf16(g / (1 + exp(−g))·u),
    d = bf16(W_down[e]·a); out[t] = Σ_j weights[t, j]·d in float32, slot order."""
    def rnd(v):
        return v.to(torch.bfloat16).float()
    t, k = ids.shape
    e_count = gate.shape[0]
    xf = x.float()
    d = torch.zeros(t, k, down.shape[1], dtype=torch.float32, device=x.device)   # d of every pair (0: skipped)
    ids = ids.long()
    for e in torch.unique(ids[(ids >= 0) & (ids < e_count)]).tolist():   # one expert at a time, all its pairs
        rows, slots = (ids == e).nonzero(as_tuple=True)
        g = rnd(xf[rows] @ gate[e].float().T)
        u = rnd(xf[rows] @ up[e].float().T)
        a = rnd(g / (1.0 + torch.exp(-g)) * u)
        d[rows, slots] = rnd(a @ down[e].float().T)
    out = torch.zeros(t, down.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        out = out + weights[:, j:j + 1].float() * d[:, j]
    return out
