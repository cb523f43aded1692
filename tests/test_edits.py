"""bhqk.edits: edits as functions at named points (issue 28, item 5). Each ready-made edit of the
table equals its keyword form bit for bit; a user function at ``head_outputs`` or ``weights`` equals
the same computation by hand; nested functions run outer first; a selection by module path names the
same call at the prefill and at every decode step of ``generate()`` (Hugging Face and bhqk's GPT-2),
and capture records carry that path; bad input names the argument."""

from __future__ import annotations

import pytest
import torch
import transformers

import bhqk
from bhqk import edits, masks
from bhqk.errors import ShapeError
from bhqk.integrations.transformers import register
from bhqk.models.gpt2 import GPT2, GPT2Config
from tolerance import assert_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
V, N = 50, 9
LAYER = "model.layers.1.self_attn"


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(c).eval()
    m.set_attn_implementation("bhqk")
    return m


def _values(g: torch.Generator) -> dict:
    """One value per ready-made edit, for h = 2 edited heads of a [Q=N, K=N, dv=16] call."""
    return {"zero": True, "scale": torch.tensor([0.5, 2.0]), "mask": masks.key_span(0, 1),
            "bias": torch.randn(N, N, generator=g), "weights": torch.rand(2, N, N, generator=g),
            "output": torch.randn(1, 2, N, 16, generator=g)}


@pytest.mark.parametrize("kind", list(edits.EDITS))
def test_each_ready_made_edit_equals_its_keyword_form_bitwise(kind):
    m = _llama()
    values = _values(torch.Generator().manual_seed(2))
    assert set(values) == set(edits.EDITS)  # a new entry of the table needs its value here
    ids = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :3] = 0
    what = ("weights", "lse", "head_outputs", "entropy")
    step = edits.zero() if kind == "zero" else getattr(edits, kind)(values[kind])
    assert (step.kind, step.point) == (kind, edits.EDITS[kind].point)
    got = {}
    with torch.no_grad():
        plain = m(ids, attention_mask=am).logits
        for form, kw in (("keyword", {kind: values[kind]}), ("do", {"do": step})):
            with bhqk.edit(model=m, layers=LAYER, heads=[0, 3], **kw) as ed, \
                    bhqk.capture(model=m, layers=LAYER, what=what) as cap:
                logits = m(ids, attention_mask=am).logits
            got[form] = (logits, dict(cap[LAYER].values), repr(ed), ed.hits)
    (a, ca, ra, ha), (b, cb, rb, hb) = got["keyword"], got["do"]
    assert torch.equal(a, b) and ra == rb and ha == hb == [(1, LAYER)]
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)
    assert not torch.equal(a, plain), f"{kind} changed nothing"


def _mha_by_hand(mha, x, causal_and=None, weights_fn=None, outputs_fn=None, heads=(1, 3)):
    """MultiHeadAttention by hand, with a mask ANDed into ``heads``, a function of their P and one of their O."""
    B, Q, _ = x.shape
    q = bhqk.split_heads(mha.q_proj(x), mha.num_heads).double()  # [B, H, Q, d]
    k = bhqk.split_heads(mha.k_proj(x), mha.num_kv_heads).double()  # [B, Hkv, K, d]
    v = bhqk.split_heads(mha.v_proj(x), mha.num_kv_heads).double()  # [B, Hkv, K, dv]
    G = mha.num_heads // mha.num_kv_heads
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # [B, Hkv, K, ·] -> [B, H, K, ·]
    allowed = torch.ones(Q, Q, dtype=torch.bool).tril()[None, None].repeat(1, mha.num_heads, 1, 1)  # [1, H, Q, K]
    hs = list(heads)
    if causal_and is not None:
        allowed[:, hs] &= causal_and
    S = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))  # [B, H, Q, K]
    P = torch.softmax(S, -1).nan_to_num(0.0)
    if weights_fn is not None:
        P = P.clone()
        P[:, hs] = weights_fn(P[:, hs])
    O = P @ v  # [B, H, Q, dv]
    if outputs_fn is not None:
        O = O.clone()
        O[:, hs] = outputs_fn(O[:, hs])
    return mha.out_proj.double()(O.transpose(1, 2).flatten(2)), P  # [B, Q, H·dv] -> [B, Q, D]


def _mha():
    torch.manual_seed(0)
    mha = bhqk.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    return mha, torch.randn(2, 7, 32)


def test_a_function_at_head_outputs_equals_the_hand_computation_and_nested_ones_run_outer_first():
    mha, x = _mha()
    w = torch.tensor([0.5, -1.5])[None, :, None, None]  # [1, h, 1, 1]
    seen = []

    def outer(o):  # o [B, h, Q, dv]
        seen.append(list(o.shape))
        return torch.tanh(o) * w.to(o.dtype)

    def inner(o):
        return o + 1.0

    with torch.no_grad():
        for backend in ("reference", "tiled", "torch"):
            with bhqk.edit(heads=[1, 3], do=edits.at("head_outputs", outer)), \
                    bhqk.edit(heads=[3], do=edits.at("head_outputs", inner)):
                got = mha(x, mask=masks.causal(), backend=backend)
            want, _ = _mha_by_hand(mha.double(), x.double(), outputs_fn=lambda o: torch.cat(
                [torch.tanh(o[:, :1]) * 0.5, torch.tanh(o[:, 1:]) * -1.5 + 1.0], 1))  # head 1: outer; head 3: inner(outer)
            mha.float()
            assert_close(got, want, dtype=torch.float32, n=32, msg=backend)
    assert seen == [[2, 2, 7, 8]] * 3  # the outer edit's heads, together, once per call


def test_a_function_at_weights_with_a_knockout_equals_the_hand_computation_and_capture_sees_it():
    mha, x = _mha()

    def sharpen(P):  # P [B, h, Q, K] -> rows of P², not renormalized
        return P.square()

    ko = torch.ones(7, 7, dtype=torch.bool)
    ko[:, 0] = False
    with torch.no_grad():
        with bhqk.edit(heads=[1, 3], do=[edits.mask(masks.key_span(0, 1)), edits.at("weights", sharpen)]) as ed, \
                bhqk.capture(what=("weights", "head_outputs")) as cap:
            got = mha(x, mask=masks.causal())
        want, P = _mha_by_hand(mha.double(), x.double(), causal_and=ko, weights_fn=sharpen)
        mha.float()
    assert_close(got, want, dtype=torch.float32, n=32)
    assert_close(cap[0].weights, P, dtype=torch.float32, n=7)  # capture reads the pattern as edited
    assert "at('weights', sharpen)" in repr(ed)


def test_a_function_at_scores_equals_the_hand_computation_with_its_lse():
    """A temperature on one head's scores (S / 2) with a knock-out of key 1: the output, the lse the call
    returns and the weights capture reads are softmax(S / 2)'s, by hand; the other heads are unedited."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, s, 5, 8, generator=g, dtype=torch.float64) for s in (4, 2, 2))  # GQA: H=4, Hkv=2

    def cool(S):  # S [B, h, Q, K]
        return S / 2

    with bhqk.edit(heads=[2], do=[edits.mask(masks.key_span(1, 2)), edits.at("scores", cool)]), \
            bhqk.capture(what=("weights", "lse")) as cap:
        out, lse = bhqk.attention(q, k, v, masks.causal(), return_lse=True)
    plain_out, plain_lse = bhqk.attention(q, k, v, masks.causal(), return_lse=True)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    allowed[:, 1] = False
    S = (q[:, 2] @ k[:, 1].transpose(-1, -2) * 8 ** -0.5 / 2).masked_fill(~allowed, float("-inf"))  # [B, Q, K]
    P = torch.softmax(S, -1)
    keep = [0, 1, 3]
    assert_close(out[:, keep], plain_out[:, keep], n=5)
    assert_close(lse[:, keep], plain_lse[:, keep], n=5)
    assert_close(out[:, 2], P @ v[:, 1], n=5)
    assert_close(lse[:, 2], torch.logsumexp(S, -1), n=5)
    assert_close(cap[0].weights[:, 2], P, n=5)
    assert_close(cap[0].lse, lse, n=5)


def test_a_weights_function_gets_the_gradient_of_its_parameters():
    mha, x = _mha()
    t = torch.tensor(1.0, requires_grad=True)
    with bhqk.edit(heads=[2], do=edits.at("weights", lambda P: P * t)):
        mha(x, mask=masks.causal()).square().sum().backward()
    s = torch.tensor(1.0, requires_grad=True)
    with bhqk.edit(heads=[2], scale=s):  # P·t·V = (P·V)·t: the same derivative as a scale
        mha(x, mask=masks.causal()).square().sum().backward()
    assert t.grad is not None and s.grad is not None and float(t.grad.abs()) > 0
    assert_close(t.grad, s.grad.double(), n=7 * 32)


def _hf_generate(m, ids, new):
    return m.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("kind", ["hf", "gpt2"])
def test_a_module_path_selects_the_prefill_and_every_decode_step_of_generate(kind):
    """A zeroed head stays 0 at every step; the other heads equal an unedited forward over the same ids."""
    if kind == "hf":
        m, layer, new = _llama(), LAYER, 4
        run = _hf_generate
    else:
        torch.manual_seed(0)
        m = GPT2(GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64)).eval()
        layer, new = "blocks.1.attn", 4

        def run(model, ids, new):
            return model.generate(ids, new)
    ids = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with bhqk.edit(model=m, layers=layer, heads=[2], do=edits.zero()) as ed, \
                bhqk.capture(model=m, layers=layer, what=("head_outputs",)) as cap:
            out = run(m, ids, new)
        with bhqk.capture(model=m, layers=layer, what=("head_outputs",)) as full:  # unedited, the same ids
            m(out[:, :-1])
        with bhqk.capture(model=m, layers=layer, what=("head_outputs",)) as plain:
            run(m, ids, new)
    steps = len(cap.records)
    assert steps == new and [r.sizes["Q"] for r in cap] == [6] + [1] * (new - 1)  # the prefill, then each step
    assert [r.name for r in cap] == [layer] * steps and [n for _, n in ed.hits] == [layer] * steps
    assert [i for i, _ in ed.hits] == [r.index for r in cap]  # the same calls, by the same count
    O = full[layer].head_outputs  # [1, H, N, dv], unedited
    others = [0, 1, 3]
    for rec in cap:
        Q, K = rec.sizes["Q"], rec.sizes["K"]
        o = rec.head_outputs  # [1, H, Q, dv], as edited
        assert torch.equal(o[:, 2], torch.zeros_like(o[:, 2])), (rec.index, Q, K)
        assert_close(o[:, others], O[:, others, K - Q:K], dtype=torch.float32, n=K, msg=f"call {rec.index}")
    assert torch.equal(cap.records[0].head_outputs[:, others], plain.records[0].head_outputs[:, others])  # the prefill


def test_the_points_and_the_table():
    assert list(edits.POINTS) == ["mask", "scores", "weights", "head_outputs"]
    assert all(k.point in edits.POINTS for k in edits.EDITS.values())
    assert {n: k.point for n, k in edits.EDITS.items()} == {
        "zero": "head_outputs", "scale": "head_outputs", "mask": "mask", "bias": "scores", "weights": "weights",
        "output": "head_outputs"}
    assert [p for p, pt in edits.POINTS.items() if pt.functions] == ["scores", "weights", "head_outputs"]


def test_bad_steps_name_the_argument():
    mha, x = _mha()
    for make, match in ((lambda: edits.at("mask", abs), "point 'mask' takes values only"),
                        (lambda: edits.at("logits", abs), "point must be one of"),
                        (lambda: edits.at("head_outputs", 3), "fn must be a function"),
                        (lambda: edits.scale("2"), "edits.scale: scale must be"),
                        (lambda: edits.mask(3), "edits.mask: mask must be"),
                        (lambda: edits.bias("x"), "edits.bias: bias must be"),
                        (lambda: bhqk.edit(do=3).__enter__(), "edit: do takes edits"),
                        (lambda: bhqk.edit(do=[edits.weights(torch.rand(7, 7)), edits.mask(masks.key_span(0, 1))])
                         .__enter__(), r"weights= replaces the heads' weights, so \['mask'\]"),
                        (lambda: bhqk.edit(do=[edits.output(torch.rand(7, 8))] * 2).__enter__(), "output= replaces"),
                        (lambda: bhqk.edit(do=[]).__enter__(), "say what to do")):
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(ShapeError, match="edits.weights: weights must be finite and >= 0"):
        edits.weights(-torch.rand(7, 7))
    with pytest.raises(ShapeError, match="edits.output: output must be a float tensor"):
        edits.output(torch.ones(7, 8, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"edit: at\('head_outputs', <lambda>\) returned \[2, 1, 7, 4\]"), \
            torch.no_grad(), bhqk.edit(heads=[1], do=edits.at("head_outputs", lambda o: o[..., :4])):
        mha(x, mask=masks.causal())
    with pytest.raises(ShapeError, match=r"weights has shape \[3, 3\]"), torch.no_grad(), \
            bhqk.edit(heads=[1], do=edits.weights(torch.rand(3, 3))):
        mha(x, mask=masks.causal())


def test_a_users_function_gets_a_copy_and_its_result_is_checked():
    """A function may write in place (the given P stays as given, call after call); a result of another
    dtype, NaN/+inf scores, negative weights or NaN from finite head outputs is refused, naming the step."""
    mha, x = _mha()
    P = torch.full((7, 7), 0.2)
    with torch.no_grad(), bhqk.edit(heads=[1], do=[edits.weights(P), edits.at("weights", lambda t: t.mul_(2))]):
        first = mha(x, mask=masks.causal())
        second = mha(x, mask=masks.causal())
    assert torch.equal(P, torch.full((7, 7), 0.2)) and torch.equal(first, second)
    for point, fn, match in (("head_outputs", lambda o: o.double(), "must keep the dtype and the device"),
                             ("scores", lambda S: S * float("nan"), r"NaN or \+inf scores"),
                             ("weights", lambda P: P - 1, "not finite and >= 0"),
                             ("head_outputs", lambda o: o / 0, "NaN/inf head outputs from finite ones")):
        with pytest.raises(ShapeError, match=match), torch.no_grad(), bhqk.edit(heads=[1], do=edits.at(point, fn)):
            mha(x, mask=masks.causal())


def test_a_dense_edit_is_refused_under_dropout_and_passes_non_finite_values_as_the_formula_does():
    """An identity at scores equals the unedited call even where v holds inf at keys some rows may not
    attend (those rows stay finite); with dropout a given or changed P is refused, not silently undropped."""
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    v[0, :, 5] = float("inf")  # the last key: only the last row may attend it under a causal mask
    plain = bhqk.attention(q, k, v, masks.causal(), backend="reference")
    with bhqk.edit(heads=[1], do=edits.at("scores", lambda S: S)):
        got = bhqk.attention(q, k, v, masks.causal(), backend="reference")
    assert bool(torch.isfinite(got[:, :, :5]).all())
    assert_close(got[:, :, :5], plain[:, :, :5], n=6)
    assert torch.equal(torch.isinf(got), torch.isinf(plain)) and torch.equal(torch.isnan(got), torch.isnan(plain))
    with pytest.raises(ValueError, match="dropout"), bhqk.edit(heads=[0], do=edits.at("weights", lambda P: P)):
        bhqk.attention(q, k, v, masks.causal(), dropout_p=0.5, backend="reference")
