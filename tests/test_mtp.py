"""MtpHead against a reference MTP composed from HF transformers modules (the Qwen3.5 MoE / dense
decoder layer, zero-centered RMSNorms, nn.Linear fc and LM head) holding the same weights.

The reference is stateless: it runs all rows of a sequence (row r = (embed(t_{r+1}), h_r) at
RoPE position r + 1) through the HF layer with a causal mask. Our head runs them through its
paged drafter KV in whatever chunking the test picks. Both run in BF16; differences are BF16
rounding order (relative bound 2e-2). Greedy chains are compared draft by draft with the
reference teacher-forced on our drafts: each draft must be the reference's argmax, or within
`NEAR_TIE` of the reference's max logit (a near-tie rounding may legitimately flip).
MoE rows can flip an expert too: the router sees the BF16-rounded residual, and when the k-th and
(k+1)-th router logits nearly tie, the two runs may pick different experts. Both runs record
their routing; a row whose expert set differs must be such a router near-tie (`ROUTER_TIE`), and
it (and, in a draft chain, everything downstream of it) is excluded from the value checks.
"""
import zlib

import pytest
import torch
from helpers import rel_err

pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_dense  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe  # noqa: E402

import atlas  # noqa: E402
from atlas.kv_cache import KvCacheExhausted  # noqa: E402
from atlas.layers.ffn import SparseMoE  # noqa: E402
from atlas.layers.mtp import MtpHead, random_state_dict  # noqa: E402

BF16_TOL = 2e-2      # BF16 intermediates rounded in a different order than HF
NEAR_TIE = 0.05      # logits within this of the max may swap under BF16 rounding noise
ROUTER_TIE = 0.1     # router logits (O(1)) this close at the top-k boundary may swap likewise
FORMATS = ["bf16", "fp8", "nvfp4"]
KINDS = ["moe", "dense"]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _cfg(kind: str, **kw):
    if kind == "moe":
        return atlas.ModelConfig.tiny(model_type="qwen3_5_moe", **kw)
    return atlas.ModelConfig.tiny(model_type="qwen3_5", num_experts=0, **kw)


def _head(kind, weight_format="bf16", *, seed=0, kv_dtype=torch.bfloat16, mtp_vocab_size=0, max_seq_len=256,
          max_seqs=4, device="cpu", cfg=None, **kw):
    cfg = cfg or _cfg(kind)
    g = _gen("weights", kind, seed)
    sd = random_state_dict(cfg, seed=seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).bfloat16()
    lm_head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 3 / cfg.hidden_size ** 0.5).bfloat16()
    if weight_format == "nvfp4":
        lm_head = atlas.quantize_nvfp4(lm_head)
    sd = {k: v.to(device) for k, v in sd.items()}
    return MtpHead.from_state_dict(cfg, sd, embed.to(device), lm_head.to(device) if isinstance(lm_head, torch.Tensor)
                                   else lm_head.to(device), weight_format, kv_dtype, max_seq_len, max_seqs,
                                   mtp_vocab_size, device, **kw)


def _inputs(g, head, n):
    """Target-side data of one sequence: tokens t_0..t_n, hiddens h_0..h_n (final-normed scale)."""
    tokens = torch.randint(0, head.cfg.vocab_size, (n + 1,), generator=g)
    hidden = torch.randn(n + 1, head.hidden_size, generator=g).bfloat16()
    return tokens, hidden


# ---- routing records (MoE near-ties) ---------------------------------------------------------

def _record_routing(head: MtpHead) -> list:
    """Record (router logits f32 [T, E], ids [T, k]) of every routing call of our head."""
    calls = []
    if isinstance(head.ffn, SparseMoE):
        route = head.ffn.route

        def recording(x, *, shared_slot=False):
            logits, ids, w = route(x, shared_slot=shared_slot)
            k = head.ffn.top_k
            calls.append((logits[:, :head.ffn.num_experts].float().cpu(), ids[:, :k].long().cpu()))
            return logits, ids, w
        head.ffn.route = recording
    return calls


def _flipped_rows(ours: list, theirs, k: int) -> list[int]:
    """Rows (over the concatenated calls) whose expert set differs; each must be a router
    near-tie in our logits."""
    if not ours:
        return []
    logits = torch.cat([c[0] for c in ours])
    ids = torch.cat([c[1] for c in ours])
    flipped = []
    for r in range(ids.shape[0]):
        if set(ids[r].tolist()) != set(theirs[r].tolist()):
            top = logits[r].sort(descending=True).values
            assert top[k - 1] - top[k] < ROUTER_TIE, f"row {r}: expert sets differ without a router near-tie"
            flipped.append(r)
    return flipped


# ---- the reference MTP ------------------------------------------------------------------------

class HfMtp:
    """The MTP forward composed from HF modules with `head`'s weights (dequantized)."""

    def __init__(self, head: MtpHead):
        cfg = head.cfg
        rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta),
                "partial_rotary_factor": float(cfg.partial_rotary_factor),
                "mrope_section": [cfg.rotary_dim // 2, 0, 0]}
        common = dict(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                      num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                      rms_norm_eps=cfg.rms_norm_eps, num_hidden_layers=1, layer_types=["full_attention"],
                      rope_parameters=rope, vocab_size=cfg.vocab_size)
        moe = isinstance(head.ffn, SparseMoE)
        if moe:
            m = hf_moe
            hf_cfg = m.Qwen3_5MoeTextConfig(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                                            moe_intermediate_size=cfg.moe_intermediate_size,
                                            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                                            **common)
            layer_cls, norm_cls, rotary_cls = m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeTextRotaryEmbedding
        else:
            m = hf_dense
            hf_cfg = m.Qwen3_5TextConfig(intermediate_size=cfg.intermediate_size, **common)
            layer_cls, norm_cls, rotary_cls = m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding
        hf_cfg._attn_implementation = "eager"
        bf = torch.bfloat16
        self.layer = layer_cls(hf_cfg, 0).to(bf).eval()
        self.rotary = rotary_cls(hf_cfg)
        self.norms = {}
        with torch.no_grad():
            for name in ("norm_embedding", "norm_hidden", "norm"):
                n = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps).to(bf)
                n.weight.copy_(getattr(head, name))
                self.norms[name] = n
            self.layer.input_layernorm.weight.copy_(head.input_layernorm)
            self.layer.post_attention_layernorm.weight.copy_(head.post_attention_layernorm)
            attn = self.layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(attn, name).weight.copy_(getattr(head.attn, name).dense().cpu())
            attn.q_norm.weight.copy_(head.attn.q_norm_weight)
            attn.k_norm.weight.copy_(head.attn.k_norm_weight)
            mlp = self.layer.mlp
            if moe:
                f = head.ffn
                mlp.gate.weight.copy_(f.router.cpu())
                mlp.shared_expert_gate.weight.copy_(f.shared_gate.cpu())
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mlp.shared_expert, name).weight.copy_(getattr(f.shared, name).dense().cpu())
                e = f.num_experts   # the stacks may hold the shared expert as one more entry
                mlp.experts.gate_up_proj.copy_(torch.cat([f.experts.gate.dense()[:e], f.experts.up.dense()[:e]], 1).cpu())
                mlp.experts.down_proj.copy_(f.experts.down.dense()[:e].cpu())
            else:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mlp, name).weight.copy_(getattr(head.ffn, name).dense().cpu())
        self.routing = []   # router indices [L, k] of each call (MoE)
        if moe:
            self.layer.mlp.gate.register_forward_hook(lambda mod, inp, out: self.routing.append(out[2]))
        self.fc = head.fc.dense().cpu()
        self.embed = head.embed_tokens.cpu()
        lm = head.lm_head
        self.lm_head = (lm.dequantize(bf) if isinstance(lm, atlas.NVFP4Weight) else lm).cpu()[:head.vocab]

    @torch.no_grad()
    def __call__(self, tokens, hidden):
        """Rows r = 0..L-1: (tokens[r], hidden[r]) at position r + 1 → (logits [L, V'], normed [L, h])."""
        n = self.norms
        x = torch.cat([n["norm_embedding"](self.embed[tokens]), n["norm_hidden"](hidden)], dim=-1)
        x = torch.nn.functional.linear(x, self.fc).unsqueeze(0)                     # [1, L, h]
        L = x.shape[1]
        pos = torch.arange(1, L + 1).unsqueeze(0)
        cos_sin = self.rotary(x, pos[None].expand(3, -1, -1))   # mRoPE ids [3, B, L] (transformers 5.17)
        mask = torch.full((L, L), float("-inf")).triu(1).to(torch.bfloat16)[None, None]
        x = self.layer(x, cos_sin, attention_mask=mask, position_ids=pos)
        normed = n["norm"](x[0])
        return torch.nn.functional.linear(normed, self.lm_head), normed


def _check_draft(draft: int, ref_logits: torch.Tensor):
    top = ref_logits.float().max()
    assert draft == int(ref_logits.float().argmax()) or ref_logits[draft].float() >= top - NEAR_TIE, \
        f"draft {draft} (logit {ref_logits[draft].item():.4f}) is not the reference's greedy pick " \
        f"{int(ref_logits.float().argmax())} (logit {top.item():.4f})"


def _ref_chain(ref: HfMtp, tokens, hidden, drafts):
    """Teacher-forced reference chain: rows (t_{r+1}, h_r) r < P, then each draft with the
    previous row's normed output. Returns the logits that predicted each draft and (MoE) the
    reference's expert ids of each draft's row."""
    toks, hid = list(tokens), hidden.clone()
    out, routes = [], []
    for d in drafts:
        ref.routing.clear()
        logits, normed = ref(torch.stack(toks), hid)
        out.append(logits[-1])
        routes.append(ref.routing[0][-1:] if ref.routing else None)
        toks.append(torch.tensor(d))
        hid = torch.cat([hid, normed[-1:]])
    return out, routes


def _check_chain(drafts: list[int], ref_logits, ref_routes, calls, k: int, conf=None) -> int:
    """Check drafts against the reference chain up to the first MoE routing flip (a router
    near-tie, after which the two chains' hiddens legitimately differ). Returns how many drafts
    were checked. `calls` holds our routing of the draft rows, one call per draft."""
    for j, d in enumerate(drafts):
        if calls and _flipped_rows(calls[j:j + 1], ref_routes[j], k):
            return j
        _check_draft(d, ref_logits[j])
        if conf is not None:
            p = torch.softmax(ref_logits[j].float(), -1)[d]
            assert abs(conf[j] - p.item()) < 0.02 + 0.05 * p.item()
    return len(drafts)


# ---- step --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("chunks", [(13,), (5, 1, 1, 1), (9, 3, 1)])
def test_step_matches_hf(kind, weight_format, chunks):
    g = _gen("step", kind, weight_format, chunks)
    head = _head(kind, weight_format)
    ref = HfMtp(head)
    n = sum(chunks)
    tokens, hidden = _inputs(g, head, n)
    ref_logits, ref_hidden = ref(tokens[1:n + 1], hidden[:n])
    calls = _record_routing(head)
    outs = []
    r0 = 0
    for c in chunks:
        meta = head.cache.plan({"s": c})
        logits, normed = head.step(tokens[r0 + 1:r0 + c + 1], hidden[r0:r0 + c], meta)
        assert logits.shape == (c, head.vocab) and logits.dtype == torch.bfloat16
        outs.append((logits, normed))
        r0 += c
    logits, normed = (torch.cat(x) for x in zip(*outs))
    keep = [r for r in range(n) if r not in _flipped_rows(calls, ref.routing[0] if ref.routing else None,
                                                         head.cfg.num_experts_per_tok)]
    assert len(keep) >= n - 2
    assert rel_err(normed[keep], ref_hidden[keep]) < BF16_TOL
    assert rel_err(logits[keep], ref_logits[keep]) < BF16_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_step_mixed_batch_matches_hf(kind):
    """Two sequences in one step: a prefill chunk of 11 rows and a decode row of another."""
    g = _gen("mixed", kind)
    head = _head(kind)
    ref = HfMtp(head)
    ta, ha = _inputs(g, head, 11)
    tb, hb = _inputs(g, head, 6)
    head.step(tb[1:6], hb[:5], head.cache.plan({"b": 5}))
    meta = head.cache.plan({"a": 11, "b": 1})
    logits, _ = head.step(torch.cat([ta[1:12], tb[6:7]]), torch.cat([ha[:11], hb[5:6]]), meta)
    assert rel_err(logits[:11], ref(ta[1:12], ha[:11])[0]) < BF16_TOL
    assert rel_err(logits[11:], ref(tb[1:7], hb[:6])[0][-1:]) < BF16_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_step_fp8_kv_matches_hf(kind):
    g = _gen("fp8kv", kind)
    head = _head(kind, kv_dtype=torch.float8_e4m3fn)
    ref = HfMtp(head)
    tokens, hidden = _inputs(g, head, 10)
    head.step(tokens[1:7], hidden[:6], head.cache.plan({"s": 6}))
    logits, _ = head.step(tokens[7:11], hidden[6:10], head.cache.plan({"s": 4}))
    # e4m3 K/V (3 mantissa bits, per-row scales): ~2^-5 relative per element
    assert rel_err(logits, ref(tokens[1:11], hidden[:10])[0][6:]) < 5e-2


# ---- prefill + propose -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("prompt,k", [(1, 1), (16, 4), (17, 3), (40, 4)])   # 16: draft rows cross a block
def test_propose_is_hf_greedy_chain(kind, weight_format, prompt, k):
    g = _gen("chain", kind, weight_format, prompt, k)
    head = _head(kind, weight_format)
    ref = HfMtp(head)
    tokens, hidden = _inputs(g, head, prompt)           # t_0..t_P, h_0..h_P
    head.prefill("s", tokens[:prompt], hidden[:prompt])
    assert head.cache.seq_len("s") == prompt - 1
    calls = _record_routing(head)
    drafts, conf = head.propose(["s"], tokens[prompt:prompt + 1], hidden[prompt - 1:prompt], k)
    assert drafts.shape == (1, k) and drafts.dtype == torch.int64 and conf.dtype == torch.float32
    ref_logits, ref_routes = _ref_chain(ref, tokens[1:prompt + 1], hidden[:prompt], drafts[0].tolist())
    checked = _check_chain(drafts[0].tolist(), ref_logits, ref_routes, calls, head.cfg.num_experts_per_tok,
                           conf[0].tolist())
    assert checked >= 1 or kind == "moe"
    assert head.cache.seq_len("s") == prompt - 1 + k


@pytest.mark.parametrize("kind", KINDS)
def test_batched_propose_equals_single(kind):
    g = _gen("batch", kind)
    prompts = [9, 20, 1, 15, 16]   # 15, 16: the drafts' rows cross a 16-row block boundary
    data = [_inputs(g, _head(kind), p) for p in prompts]
    batched = _head(kind)
    for i, (p, (t, h)) in enumerate(zip(prompts, data)):
        batched.prefill(i, t[:p], h[:p])
    last = torch.stack([t[p] for p, (t, h) in zip(prompts, data)])
    hid = torch.stack([h[p - 1] for p, (t, h) in zip(prompts, data)])
    drafts, conf = batched.propose(list(range(len(prompts))), last, hid, 3)
    for i, (p, (t, h)) in enumerate(zip(prompts, data)):
        single = _head(kind)
        single.prefill("x", t[:p], h[:p])
        d1, c1 = single.propose(["x"], t[p:p + 1], h[p - 1:p], 3)
        assert torch.equal(d1[0], drafts[i])
        torch.testing.assert_close(c1[0], conf[i], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_propose_restores_the_sequence(kind):
    g = _gen("cancel", kind)
    head = _head(kind)
    tokens, hidden = _inputs(g, head, 9)
    head.prefill("s", tokens[:9], hidden[:9])
    d1, c1 = head.propose(["s"], tokens[9:10], hidden[8:9], 3)
    head.cancel_propose(["s"])
    assert head.cache.seq_len("s") == 8
    d2, c2 = head.propose(["s"], tokens[9:10], hidden[8:9], 3)
    assert torch.equal(d1, d2) and torch.equal(c1, c2)
    with pytest.raises(ValueError, match="no propose"):
        head.cancel_propose(["t"])


@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_mtp_vocab_size_truncates_head(weight_format):
    g = _gen("vocab", weight_format)
    full, cut = _head("moe", weight_format), _head("moe", weight_format, mtp_vocab_size=100)
    tokens, hidden = _inputs(g, full, 8)
    lf, _ = full.step(tokens[1:9], hidden[:8], full.cache.plan({"s": 8}))
    lc, _ = cut.step(tokens[1:9], hidden[:8], cut.cache.plan({"s": 8}))
    assert lc.shape == (8, 100) and torch.equal(lc, lf[:, :100])
    cut.free("s")
    cut.prefill("s", tokens[:8], hidden[:8])
    drafts, _ = cut.propose(["s"], tokens[8:9], hidden[7:8], 3)
    assert int(drafts.max()) < 100


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_prefill_writes_the_kv_a_full_step_writes(kind, weight_format, kv_dtype):
    """prefill's K/V-only path == the K/V the full forward (step) writes, byte for byte."""
    g = _gen("kv-only", kind, weight_format, kv_dtype)
    a, b = _head(kind, weight_format, kv_dtype=kv_dtype), _head(kind, weight_format, kv_dtype=kv_dtype)
    tokens, hidden = _inputs(g, a, 20)
    a.prefill("s", tokens[:20], hidden[:20])                                       # rows 0..18
    b.step(tokens[1:20], hidden[:19], b.cache.plan({"s": 19}))
    for ours, want in zip(_kv_rows(a, "s"), _kv_rows(b, "s")):
        assert torch.equal(ours, want)


# ---- accept: exact drafter KV ----------------------------------------------------------------

def _kv_rows(head: MtpHead, seq):
    """The sequence's drafter K and V rows in logical order, dequantized: [n, nkv, hd] f32 each."""
    n, bs = head.cache.seq_len(seq), head.cache.block_size
    blocks = torch.tensor(head.cache.blocks_of(seq), dtype=torch.long)
    k, v, ks, vs = head.cache.layer(0)
    rows = []
    for c, s in ((k, ks), (v, vs)):
        x = c[blocks].float().reshape(-1, c.shape[2], c.shape[3])[:n]
        if s is not None:
            x = x * s[blocks].reshape(-1, c.shape[2])[:n, :, None]
        rows.append(x)
    return rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_accept_leaves_kv_of_fresh_prefill(kind, accepted, kv_dtype):
    g = _gen("accept", kind, accepted, kv_dtype)
    P, k = 12, 3
    head = _head(kind, kv_dtype=kv_dtype)
    tokens, hidden = _inputs(g, head, P)
    head.prefill("s", tokens[:P], hidden[:P])
    drafts, _ = head.propose(["s"], tokens[P:P + 1], hidden[P - 1:P], k)
    verify_hidden = torch.randn(k + 1, head.hidden_size, generator=g).bfloat16()   # H_P..H_{P+k}
    stale = _kv_rows(head, "s")
    head.accept("s", accepted, verify_hidden[:accepted], drafts[0, :accepted].clone())
    assert head.cache.seq_len("s") == P + accepted

    fresh = _head(kind, kv_dtype=kv_dtype)
    seq_tokens = torch.cat([tokens[:P + 1], drafts[0, :accepted]])                  # t_0..t_P, d_1..d_a
    seq_hidden = torch.cat([hidden[:P], verify_hidden[:accepted + 1]])               # h_0..h_{P-1}, H_P..
    fresh.prefill("s", seq_tokens, seq_hidden)
    assert fresh.cache.seq_len("s") == P + accepted
    for ours, want in zip(_kv_rows(head, "s"), _kv_rows(fresh, "s")):
        assert not ours.isnan().any()
        assert rel_err(ours, want) < (2e-2 if kv_dtype == torch.bfloat16 else 6e-2)
    if accepted >= 2:   # the test can tell: before accept(), row P came from a draft hidden
        assert rel_err(stale[0][P], _kv_rows(fresh, "s")[0][P]) > 0.1


@pytest.mark.parametrize("kind", KINDS)
def test_accept_batch_equals_per_sequence_accept(kind):
    g = _gen("accept-batch", kind)
    prompts, accepted = [7, 16, 3], [2, 0, 3]
    data = [_inputs(g, _head(kind), p) for p in prompts]
    heads = [_head(kind), _head(kind)]
    verify = [torch.randn(4, heads[0].hidden_size, generator=g).bfloat16() for _ in prompts]
    drafts = []
    for head in heads:
        for i, (p, (t, h)) in enumerate(zip(prompts, data)):
            head.prefill(i, t[:p], h[:p])
        last = torch.stack([t[p] for p, (t, h) in zip(prompts, data)])
        hid = torch.stack([h[p - 1] for p, (t, h) in zip(prompts, data)])
        drafts.append(head.propose([0, 1, 2], last, hid, 3)[0])
    assert torch.equal(drafts[0], drafts[1])
    d = drafts[0]
    heads[0].accept_batch([0, 1, 2], accepted, torch.cat([v[:a] for v, a in zip(verify, accepted)]),
                          torch.cat([d[i, :a] for i, a in enumerate(accepted)]))
    for i, a in enumerate(accepted):
        heads[1].accept(i, a, verify[i][:a], d[i, :a].clone())
    for i, p in enumerate(prompts):
        assert heads[0].cache.seq_len(i) == heads[1].cache.seq_len(i) == p + accepted[i]
        for ours, want in zip(_kv_rows(heads[0], i), _kv_rows(heads[1], i)):
            assert rel_err(ours, want) < 1e-2
    with pytest.raises(ValueError, match="no propose"):
        heads[0].accept_batch([0], [0], verify[0][:0], d[0, :0])


@pytest.mark.parametrize("kind", KINDS)
def test_propose_after_accept_matches_hf(kind):
    """Two rounds: propose, accept 1, propose again — drafts stay the reference's greedy chain."""
    g = _gen("rounds", kind)
    P = 10
    head = _head(kind)
    ref = HfMtp(head)
    tokens, hidden = _inputs(g, head, P)
    head.prefill("s", tokens[:P], hidden[:P])
    d, _ = head.propose(["s"], tokens[P:P + 1], hidden[P - 1:P], 2)
    H = torch.randn(3, head.hidden_size, generator=g).bfloat16()
    head.accept("s", 1, H[:1], d[0, :1].clone())
    bonus = torch.randint(0, head.cfg.vocab_size, (1,), generator=g)
    calls = _record_routing(head)
    d2, _ = head.propose(["s"], bonus, H[1:2], 2)
    seq_tokens = torch.cat([tokens[1:P + 1], d[0, :1], bonus])
    seq_hidden = torch.cat([hidden[:P], H[:2]])
    ref_logits, ref_routes = _ref_chain(ref, seq_tokens, seq_hidden, d2[0].tolist())
    _check_chain(d2[0].tolist(), ref_logits, ref_routes, calls, head.cfg.num_experts_per_tok)


# ---- errors ------------------------------------------------------------------------------------

def test_drafter_cache_exhaustion_is_clear_and_atomic():
    head = _head("dense", max_seq_len=32, max_seqs=1)     # (32 // 16 + 1) · 1 = 3 blocks
    g = _gen("full")
    tokens, hidden = _inputs(g, head, 40)
    head.prefill("a", tokens[:30], hidden[:30])           # 29 rows: 2 blocks
    head.prefill("b", tokens[:10], hidden[:10])           # 9 rows: the 3rd block
    with pytest.raises(KvCacheExhausted, match="drafter KV exhausted"):
        head.propose(["a", "b"], tokens[:2], hidden[:2], 8)
    assert head.cache.seq_len("a") == 29 and head.cache.seq_len("b") == 9
    head.propose(["b"], tokens[:1], hidden[:1], 3)          # still usable
    with pytest.raises(ValueError, match="max_seq_len"):
        head.propose(["a"], tokens[:1], hidden[:1], 30)      # 29 + 30 rows > 3 blocks per sequence


@pytest.mark.parametrize("call,match,exc", [
    (lambda h, t, x: h.accept("s", 1, x[:1], t[:1]), "no propose", ValueError),
    (lambda h, t, x: h.propose(["s"], t[:1], x[:1], 0), "num_drafts", ValueError),
    (lambda h, t, x: h.propose(["s", "s"], t[:2], x[:2], 1), "distinct", ValueError),
    (lambda h, t, x: h.propose(["s"], t[:1].int(), x[:1], 1), "last_tokens", TypeError),
    (lambda h, t, x: h.propose(["s"], t[:1], x[:2], 1), "target_hidden", ValueError),
    (lambda h, t, x: h.step(t[:3], x[:3], h.cache.plan({"z": 2})), "meta", ValueError),
    (lambda h, t, x: h.prefill("s", t[:3], x[:3].float()), "target_hidden", TypeError),
])
def test_bad_calls_name_the_argument(call, match, exc):
    head = _head("dense")
    g = _gen("bad")
    tokens, hidden = _inputs(g, head, 5)
    head.prefill("s", tokens[:4], hidden[:4])
    with pytest.raises(exc, match=match):
        call(head, tokens, hidden)


def test_accept_validates_against_the_propose():
    head = _head("dense")
    g = _gen("acc")
    tokens, hidden = _inputs(g, head, 5)
    head.prefill("s", tokens[:4], hidden[:4])
    d, _ = head.propose(["s"], tokens[4:5], hidden[3:4], 2)
    with pytest.raises(ValueError, match="num_accepted"):
        head.accept("s", 3, hidden[:3], tokens[:3])
    with pytest.raises(ValueError, match="target_hidden_rows"):
        head.accept("s", 2, hidden[:1], d[0])
    with pytest.raises(ValueError, match="awaiting accept"):
        head.propose(["s"], tokens[4:5], hidden[3:4], 2)


@pytest.mark.parametrize("kw,match,exc", [
    (dict(weight_format="int4"), "weight_format", ValueError),
    (dict(kv_dtype=torch.float16), "kv_dtype", TypeError),
    (dict(mtp_vocab_size=10**6), "mtp_vocab_size", ValueError),
    (dict(max_seqs=0), "max_seqs", ValueError),
])
def test_from_state_dict_rejects(kw, match, exc):
    with pytest.raises(exc, match=match):
        _head("dense", **kw)


def test_missing_key_is_named():
    cfg = _cfg("dense")
    sd = random_state_dict(cfg)
    del sd["mtp.pre_fc_norm_hidden.weight"]
    emb = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(KeyError, match="pre_fc_norm_hidden"):
        MtpHead.from_state_dict(cfg, sd, emb, emb, "bf16", torch.bfloat16, 64, 1, 0, "cpu")


def test_main_pool_caps_blocks():
    head = _head("dense", max_seq_len=1024, max_seqs=8, main_pool_blocks=20)
    assert head.cache.num_blocks == 20


# ---- CUDA: kernels vs the CPU reference path, graphs, real shapes ------------------------------

REAL = {  # 35B-A3B MTP (MoE) and 27B MTP (dense); vocab cut to keep the CPU reference fast
    "35b-a3b": dict(kind="moe", cfg=dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                         num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                         shared_expert_intermediate_size=512, vocab_size=32768,
                                         partial_rotary_factor=0.25, rope_theta=1e7)),
    "27b": dict(kind="dense", cfg=dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                       intermediate_size=17408, vocab_size=32768, partial_rotary_factor=0.25,
                                       rope_theta=1e7)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("model", list(REAL))
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_cuda_propose_matches_cpu_reference(model, weight_format):
    spec = REAL[model]
    cfg = _cfg(spec["kind"], **spec["cfg"])
    g = _gen("cuda", model, weight_format)
    cpu = _head(spec["kind"], weight_format, cfg=cfg, max_seq_len=512, max_seqs=4)
    dev = _head(spec["kind"], weight_format, cfg=cfg, max_seq_len=512, max_seqs=4, device="cuda")
    prompts = [37, 5]
    data = [_inputs(g, cpu, p) for p in prompts]
    for i, (p, (t, h)) in enumerate(zip(prompts, data)):
        cpu.prefill(i, t[:p], h[:p])
        dev.prefill(i, t[:p].cuda(), h[:p].cuda())
    last = torch.stack([t[p] for p, (t, h) in zip(prompts, data)])
    hid = torch.stack([h[p - 1] for p, (t, h) in zip(prompts, data)])
    d_cpu, c_cpu = cpu.propose([0, 1], last, hid, 3)
    d_dev, c_dev = dev.propose([0, 1], last.cuda(), hid.cuda(), 3)       # graph captured + replayed
    agree = (d_dev.cpu() == d_cpu).float().mean().item()
    assert agree >= 0.8, f"GPU drafts {d_dev.tolist()} vs CPU reference {d_cpu.tolist()}"
    assert torch.equal(d_dev[:, 0].cpu(), d_cpu[:, 0]) or agree >= 0.8
    dev.cancel_propose([0, 1])
    d_again, _ = dev.propose([0, 1], last.cuda(), hid.cuda(), 3)          # replay of the same graph
    assert torch.equal(d_again, d_dev)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_propose_equals_eager(kind):
    g = _gen("graph", kind)
    head = _head(kind, "nvfp4", device="cuda")
    tokens, hidden = _inputs(g, head, 30)
    tokens, hidden = tokens.cuda(), hidden.cuda()
    for s in range(3):
        head.prefill(s, tokens[:20 + s], hidden[:20 + s])
    last, hid = tokens[20:23], hidden[19:22]
    d_eager, c_eager = head.propose([0, 1, 2], last, hid, 3, use_graph=False)
    head.cancel_propose([0, 1, 2])
    d_graph, c_graph = head.propose([0, 1, 2], last, hid, 3, use_graph=True)
    assert torch.equal(d_graph, d_eager)
    torch.testing.assert_close(c_graph, c_eager, rtol=1e-3, atol=1e-5)   # cuBLAS may pick another algorithm


@pytest.mark.cuda
def test_cuda_deleted_head_frees_its_graphs_without_gc():
    """A head's captured propose graphs die with the head by reference counting: no cycle is
    left for the cyclic GC, which could destroy them in the middle of a later capture and
    invalidate it (bench_mtp's full grid on the H200, session 14)."""
    import gc
    import weakref
    head = _head("dense", "nvfp4", device="cuda")
    t, h = (x.cuda() for x in _inputs(_gen("gc", "dense"), head, 12))
    head.prefill(0, t[:-1], h[:-1])
    head.propose([0], t[-1:], h[-2:-1], 2)
    graphs = [weakref.ref(g) for g in head._graphs.values()]
    assert graphs
    gc.disable()
    try:
        del head
        assert all(r() is None for r in graphs)
    finally:
        gc.enable()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_batched_propose_equals_single(kind):
    g = _gen("cuda-batch", kind)
    head = _head(kind, "nvfp4", device="cuda", max_seqs=8)
    data = [tuple(x.cuda() for x in _inputs(g, head, 12 + 3 * i)) for i in range(5)]
    for i, (t, h) in enumerate(data):
        head.prefill(i, t[:-1], h[:-1])
    last = torch.stack([t[-1] for t, h in data])
    hid = torch.stack([h[-2] for t, h in data])
    drafts, _ = head.propose(list(range(5)), last, hid, 3)
    head.cancel_propose(range(5))
    for i in range(5):
        d1, _ = head.propose([i], last[i:i + 1], hid[i:i + 1], 3)
        head.cancel_propose([i])
        assert torch.equal(d1[0], drafts[i])
