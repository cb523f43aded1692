"""Every statistic of every record equals the same statistic computed from eager's weights for that
row, at the prefill and at each decode step (issue 25, item 2): B=1 without a mask and B=2
left-padded; MHA and GQA; Hugging Face ``generate()``, bhqk's GPT-2 ``generate()`` and a decode loop
over bhqk's own ``KVCache``; with the decode-step shortcuts (GQA packing, kept plans, kept decisions;
:mod:`bhqk.shortcuts`) and with every shortcut off.

Eager's weights: transformers' ``output_attentions`` of one full forward over the generated ids
(Hugging Face), the reference's weights of one full forward (bhqk's GPT-2 and ``MultiHeadAttention``).
A decode step's row i sits at key position K − 1, so its eager row is row K − 1 of that forward."""

from __future__ import annotations

import pytest
import torch
import transformers

import bhqk
from bhqk import masks, shortcuts
from bhqk.integrations.transformers import register
from tolerance import assert_paths_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
V = 100
OFFSETS = (0, 1, 3)
WINDOW = 3
TOPK = 3
KW = dict(what=("entropy", "distance", "sink", "received"), offsets=OFFSETS, window=WINDOW, topk=TOPK)
PROMPT, NEW = 20, 5


def expected(P: torch.Tensor, allowed: torch.Tensor, real: torch.Tensor) -> dict:
    """The statistics by their formulas from eager's weights P [B, H, r, K] of a call's rows, which
    sit at key positions K − r … K − 1: ``allowed`` [B, r, K] the keys each row may attend, ``real``
    [B, r] the rows that count. ``sink``: P on the first key the row may attend."""
    P = P.double() * real[:, None, :, None]  # padding rows' weights out (eager's are not 0 there)
    r, K = P.shape[-2:]
    pos = torch.arange(K - r, K).double()  # [r]
    j = torch.arange(K).double()  # [K]
    D = (pos[:, None] - j[None, :]).abs()  # [r, K]
    first = allowed.long().argmax(-1)  # [B, r]: the first key each row may attend
    out = {
        "entropy": -torch.special.xlogy(P, P).sum(-1),
        "distance": (P * D).sum(-1),
        "sink": P.gather(-1, first[:, None, :, None].expand(*P.shape[:3], 1))[..., 0],
        "local": (P * (D < WINDOW)).sum(-1),
        "received": P.sum(-2),
        "topk": P.topk(TOPK, dim=-1).values,
    }
    for o in OFFSETS:
        key = torch.arange(K - r, K) - o  # [r]
        ok = (key >= 0) & (key < K)
        out[f"offset({o})"] = torch.where(ok, P.gather(-1, key.clamp(0, K - 1)[:, None].expand(*P.shape[:3], 1))[..., 0], 0.0)
    return out


def compare(rec, P: torch.Tensor, allowed: torch.Tensor, real: torch.Tensor, msg: str) -> None:
    """Every statistic of ``rec`` against :func:`expected` of eager's rows P [B, H, r, K]."""
    K = P.shape[-1]
    assert torch.equal(rec.real, real[:, None, :].expand(rec.real.shape)), f"{msg}: real rows"
    exp = expected(P, allowed, real)
    row = real[:, None, :]  # [B, 1, r]
    got = {n: torch.where(row, getattr(rec, n), 0.0) for n in ("entropy", "distance", "sink", "local")}
    got["received"] = rec.received
    got["topk"] = torch.where(row[..., None], rec.topk_weights, 0.0)
    for o in OFFSETS:
        got[f"offset({o})"] = torch.where(row, rec.offset(o), 0.0)
    for name, want in exp.items():
        # two fp32 paths (eager's weights, bhqk's tiles) of sums over K keys: the bound of tests/tolerance.py
        assert_paths_close(got[name], want, dtype=torch.float32, n=K, msg=f"{msg} {name}")
    picked = torch.where(row[..., None], P.double().gather(-1, rec.topk_keys), 0.0)  # eager's weights at the keys named
    assert_paths_close(picked, exp["topk"], dtype=torch.float32, n=K, msg=f"{msg} topk_keys")


def _ids_and_mask(B: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, PROMPT), generator=g)
    am = torch.ones(B, PROMPT, dtype=torch.long)
    if B == 2:
        am[1, :7] = 0  # left padding
    return ids, am


def _allowed(am: torch.Tensor, Q: int, K: int) -> torch.Tensor:
    """[B, Q, K]: causal (bottom-right) and a real key."""
    causal = torch.ones(Q, K, dtype=torch.bool).tril(K - Q)  # [Q, K]
    return causal[None] & am[:, None, :K].bool()  # [B, Q, K]


def _check_steps(records, full_P, am: torch.Tensor, layers: int, name: str) -> int:
    """Each record (prefill, then each decode step; ``layers`` per call) against its rows of the
    full forward's weights ``full_P[layer]`` [B, H, N, N]; the number of records compared."""
    for i, rec in enumerate(records):
        Q, K = rec.sizes["Q"], rec.sizes["K"]
        li = i % layers
        P = full_P[li][:, :, K - Q:K, :K]  # the rows this call computed
        allowed = _allowed(am, K, K)[:, K - Q:K]  # [B, Q, K]
        real = am[:, K - Q:K].bool()  # [B, Q]: a left-padding row is no real row
        compare(rec, P, allowed, real, f"{name} call {i} (Q={Q}, K={K}, {rec.backend})")
    return len(records)


def _hf(B: int, Hkv: int, off: bool) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=Hkv, head_dim=16, max_position_embeddings=128)).eval()
    ids, am = _ids_and_mask(B)
    model.set_attn_implementation("bhqk")
    gen_am = am if B == 2 else None  # B=1: no attention mask, as the issue's case
    with torch.no_grad(), bhqk.capture(model=model, **KW) as cap:
        out = model.generate(ids, attention_mask=gen_am, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    full_am = torch.cat([am, torch.ones(B, NEW, dtype=am.dtype)], 1)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(out[:, :-1], attention_mask=full_am[:, :-1] if B == 2 else None, output_attentions=True).attentions
    L = model.config.num_hidden_layers
    assert [r.sizes["Q"] for r in cap.records] == [PROMPT] * L + [1] * (NEW - 1) * L
    _check_steps(cap.records, ref, full_am, L, f"hf B={B} Hkv={Hkv}")


def _gpt2(B: int, off: bool) -> None:
    from bhqk.models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=96)).eval()
    ids, am = _ids_and_mask(B)
    with torch.no_grad(), bhqk.capture(model=model, **KW) as cap:
        out = model.generate(ids, NEW, attention_mask=am if B == 2 else None)
    full_am = torch.cat([am, torch.ones(B, NEW, dtype=am.dtype)], 1)
    with torch.no_grad(), bhqk.capture(what=("weights",)) as full:  # the reference's weights of one full forward
        model(out[:, :-1], full_am[:, :-1] if B == 2 else None)
    L = model.config.n_layer
    assert [r.sizes["Q"] for r in cap.records] == [PROMPT] * L + [1] * (NEW - 1) * L
    _check_steps(cap.records, [r.weights for r in full.records], full_am, L, f"gpt2 B={B}")


def _kvcache(B: int, Hkv: int, off: bool) -> None:
    from bhqk.nn import KVCache, MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, num_kv_heads=Hkv).eval()
    _, am = _ids_and_mask(B)
    N = PROMPT + NEW - 1
    full_am = torch.cat([am, torch.ones(B, NEW, dtype=am.dtype)], 1)[:, :N]
    x = torch.randn(B, N, 64)
    cache = KVCache(1, capacity=N)

    def mask(s: int, e: int):
        causal = masks.causal("bottom_right")  # as KVCache's docs say, at every step (a decode step sees every key)
        return causal & masks.key_padding(full_am[:, :e].bool()) if B == 2 else causal

    with torch.no_grad(), bhqk.capture(**KW) as cap:
        mha(x[:, :PROMPT], mask=mask(0, PROMPT), cache=cache)
        for s in range(PROMPT, N):
            mha(x[:, s:s + 1], mask=mask(s, s + 1), cache=cache)
    with torch.no_grad():
        _, P = mha(x, mask=mask(0, N), backend="reference", return_weights=True)  # [B, H, N, N]
    assert [r.sizes["Q"] for r in cap.records] == [PROMPT] + [1] * (NEW - 1)
    _check_steps(cap.records, [P], full_am, 1, f"KVCache B={B} Hkv={Hkv}")


CASES = [(src, B, Hkv) for src in ("hf", "kvcache") for B in (1, 2) for Hkv in (4, 2)] + [("gpt2", B, 4) for B in (1, 2)]


@pytest.mark.parametrize("shortcuts_on", [True, False], ids=["shortcuts", "no_shortcuts"])
@pytest.mark.parametrize("src,B,Hkv", CASES, ids=[f"{s}-B{b}-{'mha' if h == 4 else 'gqa'}" for s, b, h in CASES])
def test_every_statistic_of_every_step_equals_eagers_row(src, B, Hkv, shortcuts_on):
    shortcuts.clear()  # the first call fills what the later ones reuse
    run = {"hf": lambda: _hf(B, Hkv, not shortcuts_on), "kvcache": lambda: _kvcache(B, Hkv, not shortcuts_on),
           "gpt2": lambda: _gpt2(B, not shortcuts_on)}[src]
    if shortcuts_on:
        run()
    else:
        with shortcuts.off():
            run()


def test_the_issues_case_hf_generate_b1_decode_entropy():
    """Issue 25's report: a decode step's entropy was that of the first keys (0.0–0.67 against 3.04–3.18)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128)).eval()
    ids = torch.randint(1, V, (1, PROMPT))
    model.set_attn_implementation("bhqk")
    with torch.no_grad(), bhqk.capture(model=model, what=("entropy", "received")) as cap:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(out[:, :-1], output_attentions=True).attentions
    for i, rec in enumerate(cap.records[2:]):  # the decode steps
        K = rec.sizes["K"]
        P = ref[i % 2][:, :, K - 1:K, :K].double()  # [1, H, 1, K]
        assert_paths_close(rec.entropy, -torch.special.xlogy(P, P).sum(-1), dtype=torch.float32, n=K,
                           msg=f"decode call {i} entropy")
