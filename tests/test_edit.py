"""bhqk.edit: every edit kind equals the same intervention written by hand on eager attention, on a
Llama-shaped HF model (GQA), HF GPT-2, a sliding-window HF model (Mistral), bhqk's GPT-2 and BERT
and MultiHeadAttention; gradients of scale, bias and weights; nesting; capture inside an edit;
patching across runs; bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import bhqk
from bhqk import masks, observe
from bhqk.errors import MaskError, ShapeError
from bhqk.integrations.transformers import register
from bhqk.models.bert import BertConfig, BertEncoder
from bhqk.models.gpt2 import GPT2, GPT2Config
from tolerance import assert_close, assert_models_close, bound, magnitude_of

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
V, N = 50, 9


# ---- the intervention by hand, on eager attention ------------------------------------------------------

SPEC: dict = {}  # {"module": the edited attention module, "heads": [...], kind: value}


def by_hand(q, k, v, allowed, scaling, spec):
    """Eager attention with ``spec``'s intervention on its heads: q [B, H, Q, d], k/v [B, Hkv, K, ·],
    allowed bool broadcastable to [B, H, Q, K] (or None). A row with nothing to attend gives 0."""
    B, H, Q, _ = q.shape
    K = k.shape[2]
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # [B, Hkv, K, ·] -> [B, H, K, ·]
    S = q @ k.transpose(-1, -2) * scaling  # [B, H, Q, K]
    allow = torch.ones(B, H, Q, K, dtype=torch.bool) if allowed is None else allowed.expand(B, H, Q, K).clone()
    heads = spec.get("heads", [])
    on = torch.zeros(1, H, 1, 1, dtype=torch.bool)
    on[0, heads] = True  # [1, H, 1, 1]
    spec = {key: _spread(val, heads, H) for key, val in spec.items()}
    if "mask" in spec:
        mask = spec["mask"](Q, K) if callable(spec["mask"]) else spec["mask"]  # [Q, K], True = may attend
        allow = allow & (mask | ~on)
    if "bias" in spec:
        S = S + torch.where(on, spec["bias"], 0.0)
    S = S.masked_fill(~allow, float("-inf"))
    P = torch.softmax(S, dim=-1).nan_to_num(0.0)  # a fully masked row: 0
    if "weights" in spec:
        P = torch.where(on, spec["weights"], P)
    O = P @ v  # [B, H, Q, dv]
    if "output" in spec:
        O = torch.where(on, spec["output"], O)
    if spec.get("zero"):
        O = torch.where(on, 0.0, O)
    if "scale" in spec:
        O = torch.where(on, O * spec["scale"], O)
    return O


def _spread(t, heads, H):
    """A per-edited-head tensor [#B, h, ·, ·] (or scale [h]) laid out on the H heads (others 0)."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.bool or len(heads) == 1:
        return t
    if t.dim() == 1:
        t = t[None, :, None, None]  # [h] -> [1, h, 1, 1]
    if t.dim() != 4 or t.shape[1] != len(heads):
        return t
    return torch.zeros(t.shape[0], H, *t.shape[2:], dtype=t.dtype).index_copy(1, torch.tensor(heads), t)  # [#B, H, ·, ·]


def hf_by_hand(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """transformers' attention-function contract, eager, with SPEC's intervention on SPEC's module."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    allowed = None
    if attention_mask is not None:
        allowed = attention_mask[..., : key.shape[2]] > torch.finfo(attention_mask.dtype).min / 2  # [B, 1, Q, K]
    spec = SPEC if SPEC.get("module") is module else {}
    return by_hand(query, key, value, allowed, scaling, spec).transpose(1, 2).contiguous(), None


AttentionInterface.register("by_hand", hf_by_hand)
AttentionMaskInterface.register("by_hand", eager_mask)


def _hf(kind):
    torch.manual_seed(0)
    if kind == "llama":
        c = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        m = transformers.LlamaForCausalLM(c)
    elif kind == "mistral":
        c = transformers.MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                       max_position_embeddings=64)
        m = transformers.MistralForCausalLM(c)
    else:
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    m = m.eval()
    m.set_attn_implementation("bhqk")
    ref = copy.deepcopy(m)
    ref.set_attn_implementation("by_hand")
    return m, ref


LAYER = {"llama": "model.layers.1.self_attn", "mistral": "model.layers.1.self_attn", "gpt2": "transformer.h.1.attn"}


def _kinds(Q, K, dv, g):
    """One value per edit kind (bhqk's argument, the same by hand), for h = 2 edited heads."""
    ko = torch.ones(Q, K, dtype=torch.bool)
    ko[:, 0] = False  # the sink knocked out, by hand
    T = torch.randn(Q, K, generator=g)
    P = torch.rand(2, Q, K, generator=g)  # two heads, rows not normalized: used as given
    O = torch.randn(1, 2, Q, dv, generator=g)
    return {
        "zero": (dict(zero=True), dict(zero=True)),
        "scale": (dict(scale=0.37), dict(scale=0.37)),
        "mask": (dict(mask=masks.key_span(0, 1)), dict(mask=ko)),
        "block": (dict(mask=masks.block_span(3, 6, 1, 3)), dict(mask=_block(Q, K, 3, 6, 1, 3))),
        "bias": (dict(bias=T), dict(bias=T)),
        "weights": (dict(weights=P), dict(weights=P[None])),
        "output": (dict(output=O), dict(output=O)),
    }


def _block(Q, K, q0, q1, k0, k1):
    m = torch.ones(Q, K, dtype=torch.bool)
    m[q0:q1, k0:k1] = False
    return m


def _close(a, b):
    """Two whole-model paths in fp32 (the edit on bhqk, the same edit by hand on eager): the models
    here are two layers whose widest sum is at most 96 terms."""
    assert_models_close(a, b, width=96, layers=2)


def _changed(a, b, n=96):
    """The edit moved the output by far more than two paths' rounding could (100× the bound)."""
    return (a - b).abs().max().item() > 100 * bound(torch.float32, n, magnitude_of(b))


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_every_edit_equals_the_intervention_by_hand_on_hf_models(kind):
    m, ref = _hf(kind)
    ids = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, N, dtype=torch.long)
    am[1, :3] = 0  # left padding in the second row
    real = am.bool()
    target = ref.get_submodule(LAYER[kind])
    H = 4
    heads = [0, 3]  # with GQA (Llama, Mistral: Hkv = 2) these read K/V heads 0 and 1
    with torch.no_grad():
        plain = m(ids, attention_mask=am).logits
        SPEC.clear()
        _close(plain[real], ref(ids, attention_mask=am).logits[real])  # the harness itself: no edit, same logits
        dv = m.config.hidden_size // H
        for name, (ours, theirs) in _kinds(N, N, dv, torch.Generator().manual_seed(2)).items():
            with bhqk.edit(model=m, layers=[LAYER[kind]], heads=heads, **ours) as ed:
                got = m(ids, attention_mask=am).logits
            SPEC.clear()
            SPEC.update(module=target, heads=heads, **theirs)
            want = ref(ids, attention_mask=am).logits
            SPEC.clear()
            assert ed.hits == [(1, LAYER[kind])], name
            _close(got[real], want[real])
            assert _changed(got[real], plain[real]), f"{name} changed nothing"


def test_a_knockout_holds_at_every_decode_step_of_generate():
    """key_span(0, 1) during greedy generation with a KV cache: every step's scores equal eager's with
    key 0 knocked out by hand for that step's [Q, K]."""
    m, ref = _hf("llama")
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    layer = LAYER["llama"]
    gen = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        with bhqk.edit(model=m, layers=layer, heads=[1], mask=masks.key_span(0, 1)) as ed:
            got = m.generate(ids, **gen)
        SPEC.update(module=ref.get_submodule(layer), heads=[1], mask=lambda Q, K: torch.arange(K)[None, :] != 0)
        want = ref.generate(ids, **gen)
        SPEC.clear()
        plain = m.generate(ids, **gen)
    assert len(ed.hits) == 4  # the prefill and three decode steps of layer 1
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        _close(a, b)
    assert any(_changed(a[torch.isfinite(a)], b[torch.isfinite(a)]) for a, b in zip(got.scores, plain.scores))


def _bhqk_by_hand(module, spec, causal):
    """MultiHeadAttention.attend for one instance, by hand (the test's eager), as an instance attribute."""
    def attend(q, k, v, *, mask=None, bias=None, return_weights=False, backend=None):
        B, H, Q, _ = q.shape
        K = k.shape[2]
        allowed = None
        if mask is not None:
            allowed = masks.as_mask(mask).materialize(B, H, Q, K)
        o = by_hand(q, k, v, allowed, q.shape[-1] ** -0.5, spec)  # [B, H, Q, dv]
        return module.out_proj(o.transpose(1, 2).flatten(2))  # [B, Q, H·dv] -> [B, Q, D]
    return attend


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_every_edit_equals_the_intervention_by_hand_on_bhqk_models(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        m = GPT2(GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64)).eval()
        layer = "blocks.1.attn"
    else:
        m = BertEncoder(BertConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                   max_positions=32)).eval()
        layer = "layers.1.attn"
    ids = torch.randint(1, V, (2, N), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, N, dtype=torch.long)
    am[1, -3:] = 0  # padding in the second row (right for both: positions stay simple)
    ref = copy.deepcopy(m)
    target = ref.get_submodule(layer)
    heads = [1, 2]
    with torch.no_grad():
        plain = m(ids, am)
        for name, (ours, theirs) in _kinds(N, N, 8, torch.Generator().manual_seed(2)).items():
            with bhqk.edit(model=m, layers=layer, heads=heads, **ours):
                got = m(ids, am)
            target.attend = _bhqk_by_hand(target, dict(heads=heads, **theirs), kind == "gpt2")
            want = ref(ids, am)
            del target.attend
            real = am.bool()
            _close(got[real], want[real])
            assert _changed(got[real], plain[real]), f"{name} changed nothing"


def test_multihead_attention_mask_and_bias_and_weights_under_gqa():
    torch.manual_seed(0)
    mha = bhqk.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 7, 32)
    g = torch.Generator().manual_seed(3)
    for backend in ("reference", "tiled", "torch"):
        for ours, theirs in list(_kinds(7, 7, 8, g).values()):
            with torch.no_grad(), bhqk.edit(heads=[1, 2], **ours):
                got = mha(x, mask=masks.causal(), backend=backend)
            spec = dict(heads=[1, 2], **theirs)
            want = _bhqk_by_hand(mha, spec, True)(*_qkv(mha, x), mask=masks.causal())
            assert_close(got, want.detach().double(), dtype=torch.float32, n=32)


def _qkv(mha, x):
    q = bhqk.split_heads(mha.q_proj(x), mha.num_heads)  # [B, H, Q, d]
    k = bhqk.split_heads(mha.k_proj(x), mha.num_kv_heads)  # [B, Hkv, K, d]
    v = bhqk.split_heads(mha.v_proj(x), mha.num_kv_heads)  # [B, Hkv, K, dv]
    return q, k, v


# ---- gradients --------------------------------------------------------------------------------------------

def test_gradients_of_scale_bias_and_weights_equal_eager():
    m, ref = _hf("llama")
    ids = torch.randint(0, V, (1, N), generator=torch.Generator().manual_seed(1))
    layer = LAYER["llama"]
    target = ref.get_submodule(layer)
    g = torch.Generator().manual_seed(4)
    values = {"scale": torch.tensor([0.5, 1.5]), "bias": torch.randn(N, N, generator=g),
              "weights": torch.softmax(torch.randn(2, N, N, generator=g), -1)}
    for kind, value in values.items():
        ours = value.clone().requires_grad_()
        theirs = value.clone().requires_grad_()
        with bhqk.edit(model=m, layers=layer, heads=[1, 2], **{kind: ours}):
            m(ids).logits.square().sum().backward()
        SPEC.update(module=target, heads=[1, 2], **{kind: theirs[None] if kind == "weights" else theirs})
        ref(ids).logits.square().sum().backward()
        SPEC.clear()
        assert ours.grad is not None and bool(ours.grad.abs().sum() > 0), kind
        _close(ours.grad, theirs.grad)
    pairs = [(a.grad, b.grad) for a, b in zip(m.parameters(), ref.parameters()) if a.grad is not None]
    assert len(pairs) > 10
    for a, b in pairs:  # parameters too (accumulated over the three)
        _close(a, b)


def test_zero_scale_gradient_is_the_heads_contribution():
    """d loss / d s at s = 1 (attribution patching) is finite and equals eager's, for one head."""
    m, ref = _hf("gpt2")
    ids = torch.randint(0, V, (1, N), generator=torch.Generator().manual_seed(5))
    s = torch.ones((), requires_grad=True)
    with bhqk.edit(model=m, layers=LAYER["gpt2"], heads=[2], scale=s):
        m(ids).logits[0, -1].logsumexp(-1).backward()
    t = torch.ones((), requires_grad=True)
    SPEC.update(module=ref.get_submodule(LAYER["gpt2"]), heads=[2], scale=t)
    ref(ids).logits[0, -1].logsumexp(-1).backward()
    SPEC.clear()
    _close(s.grad, t.grad)


# ---- composition, restoration, capture ---------------------------------------------------------------------

def test_nested_edits_compose_and_the_model_is_unchanged_after():
    m, ref = _hf("llama")
    ids = torch.randint(0, V, (1, N), generator=torch.Generator().manual_seed(1))
    layer = LAYER["llama"]
    state = {k: v.clone() for k, v in m.state_dict().items()}
    attrs = {n: dict(vars(mod)) for n, mod in m.named_modules()}
    T = torch.randn(N, N)
    with torch.no_grad():
        plain = m(ids).logits
        with bhqk.edit(model=m, layers=layer, heads=[1], mask=masks.key_span(0, 1)):
            with bhqk.edit(model=m, layers=layer, heads=[1, 2], bias=T):
                with bhqk.edit(model=m, layers=[1], heads=[2], scale=0.5):
                    got = m(ids).logits
        ko = torch.ones(N, N, dtype=torch.bool)
        ko[:, 0] = False
        target = ref.get_submodule(layer)

        def nested(module, q, k, v, am, scaling=None, **kw):  # head 1: knock-out and bias; head 2: bias and ·0.5
            allowed = am[..., : k.shape[2]] > torch.finfo(am.dtype).min / 2 if am is not None else None
            if module is not target:
                return by_hand(q, k, v, allowed, scaling, {}).transpose(1, 2).contiguous(), None
            one = by_hand(q, k, v, allowed, scaling, dict(heads=[1], mask=ko, bias=T))
            two = by_hand(q, k, v, allowed, scaling, dict(heads=[2], bias=T, scale=0.5))
            o = torch.cat([one[:, :2], two[:, 2:3], one[:, 3:]], dim=1)  # [B, H, Q, dv]
            return o.transpose(1, 2).contiguous(), None

        AttentionInterface.register("nested_by_hand", nested)
        AttentionMaskInterface.register("nested_by_hand", eager_mask)
        ref.set_attn_implementation("nested_by_hand")
        _close(got, ref(ids).logits)
        assert torch.equal(m(ids).logits, plain)  # after the blocks: unedited
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
    assert observe._EDITING == 0 and observe.editors() == ()  # nothing left listening: the next call pays one int test
    assert {n: set(vars(mod)) for n, mod in m.named_modules()} == {n: set(a) for n, a in attrs.items()}


def test_capture_inside_edit_sees_the_edited_attention():
    torch.manual_seed(0)
    mha = bhqk.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(1, 6, 32)
    q, k, v = _qkv(mha, x)
    P = torch.softmax(torch.randn(6, 6), -1) * 0.5  # rows sum to 0.5: taken as given
    with torch.no_grad():
        plain = bhqk.attention_weights(q, k, masks.causal())  # [B, H, Q, K]
        with bhqk.edit(heads=[1], mask=masks.key_span(0, 2)), bhqk.edit(heads=[3], weights=P), \
                bhqk.capture(what=("weights", "head_outputs")) as cap:
            mha(x, mask=masks.causal())
        edited = bhqk.attention_weights(q, k, masks.causal() & masks.key_span(0, 2))
    w = cap[0].weights  # [B, H, Q, K]
    assert_close(w[:, [0, 2]], plain[:, [0, 2]].double(), n=6)
    assert_close(w[:, 1], edited[:, 1].double(), n=6)
    assert_close(w[0, 3], P.double(), n=6)
    assert_close(cap[0].head_outputs[0, 3], (P @ v[0, 1]).double(), n=6)  # head 3 reads K/V head 1


# ---- patching across runs --------------------------------------------------------------------------------

def test_patching_a_head_from_a_clean_run_into_a_corrupted_one():
    """The recipe of docs/edit.md: record head 2 of layer 1 in the clean run, write it into the
    corrupted run (as its pattern, or as its output); equals eager with the clean values written by hand."""
    m, ref = _hf("llama")
    layer = LAYER["llama"]
    clean = torch.randint(0, V, (1, N), generator=torch.Generator().manual_seed(1))
    corrupt = clean.clone()
    corrupt[0, 2] = (clean[0, 2] + 1) % V
    with torch.no_grad():
        with bhqk.capture(model=m, layers=layer, heads=[2], what=("weights", "head_outputs")) as cap:
            m(clean)
        rec = cap[layer]
        with bhqk.edit(model=m, layers=layer, heads=[2], weights=rec.weights):  # [B, 1, Q, K]
            by_pattern = m(corrupt).logits
        with bhqk.edit(model=m, layers=layer, heads=[2], output=rec.head_outputs):  # [B, 1, Q, dv]
            by_output = m(corrupt).logits
        target = ref.get_submodule(layer)
        SPEC.update(module=target, heads=[2], weights=rec.weights)
        _close(by_pattern, ref(corrupt).logits)
        SPEC.clear()
        SPEC.update(module=target, heads=[2], output=rec.head_outputs)
        _close(by_output, ref(corrupt).logits)
        SPEC.clear()
        assert _changed(by_output, m(corrupt).logits)


# ---- bad input ------------------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    m, _ = _hf("llama")
    ids = torch.randint(0, V, (1, N))
    with pytest.raises(ValueError, match="model.layers.7.self_attn"):
        bhqk.edit(model=m, layers=["model.layers.7.self_attn"], zero=True).__enter__()
    with pytest.raises(ValueError, match="pass model="):
        bhqk.edit(layers=["model.layers.1.self_attn"], zero=True).__enter__()
    with pytest.raises(ShapeError, match=r"heads \[5\].*H=4"), torch.no_grad():
        with bhqk.edit(model=m, layers=LAYER["llama"], heads=[5], zero=True):
            m(ids)
    with pytest.raises(ShapeError, match="weights has shape \\[3, 3\\].*Q=9"), torch.no_grad():
        with bhqk.edit(model=m, layers=LAYER["llama"], heads=[0], weights=torch.rand(3, 3)):
            m(ids)
    with pytest.raises(ShapeError, match="output"), torch.no_grad():
        with bhqk.edit(model=m, layers=LAYER["llama"], heads=[0], output=torch.rand(N, 7)):
            m(ids)
    with pytest.raises(MaskError, match="bias"), torch.no_grad():
        with bhqk.edit(model=m, layers=LAYER["llama"], heads=[0], bias=torch.rand(4, 4)):
            m(ids)
    with pytest.raises(ValueError, match="layer index 5 but only 2"), torch.no_grad():
        with bhqk.edit(layers=[5], zero=True):
            m(ids)
    with pytest.raises(ValueError, match="matched no attention call"), torch.no_grad():
        with bhqk.edit(model=m, layers="model.layers.1", zero=True):
            m(ids)
    for bad in (dict(), dict(weights=torch.rand(N, N), mask=masks.key_span(0, 1)), dict(zero=1),
                dict(output=torch.rand(N, 16), bias=torch.rand(N, N)), dict(scale="2")):
        with pytest.raises(ValueError):
            bhqk.edit(**bad).__enter__()
    with pytest.raises(ShapeError, match="finite and >= 0"):
        bhqk.edit(weights=-torch.rand(N, N)).__enter__()
    with pytest.raises(ValueError, match="heads"):
        bhqk.edit(heads=[-1], zero=True).__enter__()
    with pytest.raises(MaskError, match="key_span"):
        masks.key_span(3, 1)


# ---- the knock-out masks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("Q,K", [(5, 5), (2, 6), (7, 7)])
def test_span_masks_by_hand_and_their_tiles(Q, K):
    off = K - Q
    ks = masks.key_span(1, 3).materialize(1, 1, Q, K)[0, 0]
    want = torch.ones(Q, K, dtype=torch.bool)
    want[:, 1:3] = False
    assert torch.equal(ks, want)
    bs = masks.block_span(3, 5, 0, 2).materialize(1, 1, Q, K)[0, 0]
    want = torch.ones(Q, K, dtype=torch.bool)
    for i in range(Q):
        if 3 <= i + off < 5:
            want[i, :2] = False
    assert torch.equal(bs, want)
    ext = masks.Extent(1, 1, Q, K)
    for m, dense in ((masks.key_span(1, 3), ks), (masks.block_span(3, 5, 0, 2), bs)):
        empty, full = m.classify_grid(ext, 2, 2)
        for i in range(empty.shape[0]):
            for j in range(empty.shape[1]):
                t = dense[2 * i: 2 * i + 2, 2 * j: 2 * j + 2]
                assert not (empty[i, j] and t.any()) and not (full[i, j] and not t.all())
                c = m.classify(ext, 2 * i, min(Q, 2 * i + 2), 2 * j, min(K, 2 * j + 2))
                assert c.value == ("empty" if empty[i, j] else "full" if full[i, j] else "partial")
        mod = m.mask_mod(1, 1, Q, K)
        qi, ki = torch.arange(Q)[:, None], torch.arange(K)[None, :]
        assert torch.equal(mod(0, 0, qi, ki), dense)


# ---- the guide's claim on the bundled MiniLM (docs/edit.md) -----------------------------------------------

def test_minilm_sink_knockout_moves_the_mass_and_zeroing_keeps_it_out():
    from bhqk.models import bert

    enc = bert.SentenceEncoder.from_pretrained()
    ids, am = enc.tokenize(["The cat sat on the mat because it was warm."])
    layer = "layers.2.attn"
    with torch.no_grad():
        with bhqk.capture(model=enc.model, layers=layer) as cap:
            base = enc.model(ids, am)
        with bhqk.edit(model=enc.model, layers=layer, mask=masks.key_span(0, 1)), \
                bhqk.capture(model=enc.model, layers=layer) as ko:
            knocked = enc.model(ids, am)
        P = cap[layer].weights.clone()  # [1, 12, N, N]
        P[..., 0] = 0.0
        with bhqk.edit(model=enc.model, layers=layer, weights=P), bhqk.capture(model=enc.model, layers=layer) as zw:
            enc.model(ids, am)
    before, after = cap[layer].weights, ko[layer].weights
    assert float(before[..., 0].mean()) > 0.3  # the sink: layer 2's heads put most of their weight on [CLS]
    assert float(after[..., 0].abs().max()) == 0.0
    assert_close(after.sum(-1), torch.ones_like(after.sum(-1), dtype=torch.float64), n=ids.shape[1])  # knocked out: renormalized
    assert_close(zw[layer].weights, P.double(), n=ids.shape[1])  # zeroed: as given, rows sum to 1 − P[:, 0]
    assert _changed(knocked, base, n=1536)


def test_return_lse_is_the_edited_heads_and_capture_reads_it():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, s, 5, 8, generator=g, dtype=torch.float64) for s in (4, 2, 2))  # GQA: H=4, Hkv=2
    T = torch.randn(5, 5, generator=g, dtype=torch.float64)
    with bhqk.edit(heads=[2], mask=masks.key_span(1, 3), bias=T), bhqk.capture(what=("weights", "lse")) as cap:
        out, lse = bhqk.attention(q, k, v, masks.causal(), return_lse=True)
    plain_out, plain_lse = bhqk.attention(q, k, v, masks.causal(), return_lse=True)
    edited_out, edited_lse = bhqk.attention(q[:, [2]], k[:, [1]], v[:, [1]], masks.causal() & masks.key_span(1, 3),
                                            bias=T, return_lse=True, backend="reference")
    keep = [0, 1, 3]
    assert_close(out[:, keep], plain_out[:, keep], n=5)
    assert_close(lse[:, keep], plain_lse[:, keep], n=5)
    assert_close(out[:, [2]], edited_out, n=5)
    assert_close(lse[:, [2]], edited_lse, n=5)
    want = bhqk.attention_weights(q[:, [2]], k[:, [1]], masks.causal() & masks.key_span(1, 3), bias=T)  # [B, 1, Q, K]
    assert_close(cap[0].weights[:, [2]], want, n=5)
    assert_close(cap[0].lse, lse, n=5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_canonical_addresses_select_what_the_module_paths_select(kind):
    """``"layers.1.attn"`` is each architecture's own path (Llama's ``model.layers.1.self_attn``, GPT-2's
    ``transformer.h.1.attn``): the same capture, the same edit, and the records carry the address."""
    from bhqk.integrations.transformers import model_map

    m, _ = _hf(kind)
    assert model_map(m).path("layers.1.attn") == LAYER[kind] and model_map(m).address_of(LAYER[kind]) == "layers.1.attn"
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    outs = {}
    for sel in (LAYER[kind], "layers.1.attn"):
        with torch.no_grad(), bhqk.capture(model=m, layers=sel, heads=[2], what=("weights",)) as cap:
            m(ids)
        with torch.no_grad(), bhqk.edit(model=m, layers=[sel], heads=[1], zero=True):
            outs[sel] = (cap.records, m(ids).logits)
    (r1, l1), (r2, l2) = outs.values()
    assert [r.name for r in r2] == [LAYER[kind]] and [r.address for r in r2] == ["layers.1.attn"]
    assert r1[0].weights.shape == r2[0].weights.shape  # the same call, computed twice: within rounding
    assert_close(r2[0].weights, r1[0].weights, n=9)
    assert_models_close(l2, l1, width=64, layers=2)
    with torch.no_grad(), bhqk.capture(model=m, layers="layers.*.attn", what=("lse",)) as every:
        m(ids)
    assert [r.address for r in every.records] == ["layers.0.attn", "layers.1.attn"]
    with pytest.raises(ValueError, match=r"'layers.7.attn' matches no module.*by address layers.0.attn … layers.1.attn"):
        bhqk.capture(model=m, layers="layers.7.attn").__enter__()
