"""bhqk.capture: weights, scores, lse and head outputs from any backend, equal to the reference and to
Hugging Face's eager output_attentions; selection of layers, heads and rows; nothing when off; and
one head captured on a fast path allocates one head's [Q, K], not H of them."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import bhqk
from bhqk import bias as biases
from bhqk import masks, observe
from bhqk.errors import ShapeError
from bhqk.functional import prepare as problem
from bhqk.inspect import capture
from bhqk.inspect.capture import recompute
from conftest import concrete_backends, mask_kinds, qkv
from tolerance import assert_close, assert_models_close, assert_paths_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

capmod = importlib.import_module("bhqk.inspect.capture")  # the module (bhqk.inspect.capture is the function)


def takes(backend, q, k, v, mask=None, **kw) -> bool:
    return bhqk.why_not(backend, q, k, v, mask, **kw) is None


class Stack(nn.Module):
    """L self-attention layers, for naming and selection tests."""

    def __init__(self, L=3, D=32, H=4, Hkv=None, backend="auto"):
        super().__init__()
        self.blocks = nn.ModuleList(bhqk.MultiHeadAttention(D, H, num_kv_heads=Hkv, backend=backend) for _ in range(L))

    def forward(self, x, mask=None):
        for blk in self.blocks:
            x = x + blk(x, mask=mask)  # [B, N, D]
        return x


# ---- equal to the reference, from every backend ---------------------------------------------------

@pytest.mark.parametrize("backend", concrete_backends())
@pytest.mark.parametrize("kind", ["none", "causal_br", "padding", "key_padding", "window", "document", "dense", "~causal"])
def test_weights_equal_attention_weights_from_every_backend(backend, kind):
    B, H, Hkv, Q, K = 2, 4, 2, 5, 7
    q, k, v = qkv(B, H, Hkv, Q, K, 8, 6)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    assert takes(backend, q, k, v, m), f"{backend} must take {kind}"
    with capture(what=("scores", "weights", "lse", "head_outputs")) as cap:
        out = bhqk.attention(q, k, v, m, backend=backend)
    rec = cap[0]
    assert rec.backend == backend
    P_ref, lse_ref = bhqk.functional.reference.weights(problem(q, k, v, m))
    # float64; two paths each (the backend's lse or the narrowed call against the full reference)
    assert_paths_close(rec.weights, P_ref, n=K)
    assert_paths_close(rec.weights, bhqk.attention_weights(q, k, m), n=K)
    assert_paths_close(rec.lse, lse_ref, n=K)
    assert_paths_close(rec.scores, bhqk.functional.reference.scores(problem(q, k, v, m))[0], n=8)  # a score: d = 8 terms
    assert torch.equal(rec.head_outputs, out)  # the backend's own output
    assert not torch.isnan(rec.weights).any()


LSE_SOFTCAP = ["reference", "tiled"]  # the backends that return lse and take softcap (declared, not computed)


def test_the_lse_softcap_case_list_matches_what_each_backend_declares():
    q, k, v = qkv(1, 4, None, 6, 6, 8)
    for b in concrete_backends():
        assert takes(b, q, k, v, return_lse=True, bias=biases.alibi(4), softcap=5.0) == (b in LSE_SOFTCAP), b


@pytest.mark.parametrize("backend", LSE_SOFTCAP)
def test_saved_lse_path_equals_reference_with_bias_and_fully_masked_rows(backend):
    B, H, Q, K = 1, 4, 6, 6
    q, k, v = qkv(B, H, None, Q, K, 8)
    m = masks.dense(torch.tensor([[True] * K] * (Q - 1) + [[False] * K]))  # last query row fully masked
    kw = dict(bias=biases.alibi(H), softcap=5.0)
    with capture(heads=[1, 3], rows=[0, 2, 5], what=("weights", "lse")) as cap:
        _, lse = bhqk.attention(q, k, v, m, backend=backend, return_lse=True, **kw)
    P = bhqk.attention_weights(q, k, m, **kw)[:, [1, 3]][:, :, [0, 2, 5]]  # [B, h=2, r=3, K]
    assert_paths_close(cap[0].weights, P, n=K)
    assert torch.equal(cap[0].lse, lse[:, [1, 3]][:, :, [0, 2, 5]])  # the lse the backend returned, selected
    assert (cap[0].weights[:, :, 2] == 0).all()  # the fully masked row: 0, not NaN


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_module_captures_use_the_lse_the_backend_computed(backend, monkeypatch):
    seen = []
    real = capmod.recompute
    monkeypatch.setattr(capmod, "recompute", lambda p, heads, rows, lse=None: seen.append(lse) or real(p, heads, rows, lse))
    model = Stack(L=1, backend=backend)
    x = torch.randn(2, 5, 32)
    with capture(what=("weights", "lse")) as cap:
        model(x)
    assert len(seen) == 1 and seen[0] is not None  # the lse the call computed, though nobody asked for it
    P = bhqk.attention_weights(*_heads_of(model.blocks[0], x))
    assert_paths_close(cap[0].weights, P, n=8)  # float32; scores of d = 8 terms, rows of 5 keys


def _heads_of(m, x):
    from bhqk.nn import split_heads
    return split_heads(m.q_proj(x), m.num_heads, "q"), split_heads(m.k_proj(x), m.num_kv_heads, "k")


def test_recompute_with_and_without_lse_agree():
    q, k, v = qkv(2, 4, 1, 5, 9, 8)  # multi-query: Hkv = 1
    p = problem(q, k, v, masks.causal("bottom_right"), bias=biases.alibi(4, "bottom_right"))
    _, lse = bhqk.functional.reference.weights(p)
    S1, P1, l1 = recompute(p, [0, 3], [1, 4])
    S2, P2, l2 = recompute(p, [0, 3], [1, 4], lse)
    assert_paths_close(P1, P2, n=9)
    assert_paths_close(l1, l2, n=9)
    assert P1.shape == (2, 2, 2, 9) and l1.shape == (2, 2, 2)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), g=st.integers(1, 3), Q=st.integers(1, 9), K=st.integers(1, 9),
       d=st.sampled_from([1, 3, 8]), kind=st.sampled_from(["none", "causal_br", "padding", "window", "document", "dense"]),
       data=st.data())
def test_any_selection_is_a_slice_of_the_full_weights(B, Hkv, g, Q, K, d, kind, data):
    H = Hkv * g
    q, k, v = qkv(B, H, Hkv, Q, K, d, seed=Q * 31 + K)
    m = None if kind == "none" else mask_kinds(B, H, Q, K)[kind]
    heads = data.draw(st.lists(st.integers(0, H - 1), min_size=1, unique=True))
    rows = data.draw(st.one_of(st.none(), st.lists(st.integers(0, Q - 1), min_size=1, unique=True)))
    with capture(heads=heads, rows=rows, what=("weights", "head_outputs")) as cap:
        out = bhqk.attention(q, k, v, m, backend="reference")
    hs, rs = sorted(heads), (sorted(rows) if rows is not None else list(range(Q)))
    full = bhqk.attention_weights(q, k, m)  # [B, H, Q, K]
    rec = cap[0]
    assert rec.heads == hs and rec.query_positions == rs
    assert_paths_close(rec.weights, full[:, hs][:, :, rs], n=max(d, K))  # [B, h, r, K]
    assert torch.equal(rec.head_outputs, out[:, hs][:, :, rs])  # [B, h, r, dv]: the output itself, selected


# ---- selection and naming ------------------------------------------------------------------------

def test_layers_by_index_and_by_module_path():
    torch.manual_seed(0)
    model, x = Stack(L=3), torch.randn(1, 6, 32)
    with capture(model=model) as cap:
        model(x)
    assert [r.name for r in cap] == ["blocks.0", "blocks.1", "blocks.2"]
    with capture(layers=[2, "blocks.0"], model=model) as cap2:
        model(x)
    assert [r.index for r in cap2] == [0, 2] and cap2.calls == 3
    with capture(layers="blocks.*", heads=[1], model=model) as cap3:
        model(x)
    assert len(cap3) == 3 and cap3["blocks.1"].weights.shape == (1, 1, 6, 6)
    assert_paths_close(cap3["blocks.1"].weights, cap[1].weights[:, [1]], n=8)  # float32; d = 8, K = 6
    with capture(layers=1) as cap4:  # no model: named by order
        model(x)
    assert [r.name for r in cap4] == ["attention.1"]
    assert "H=1 of 4" in cap3[0].shape("weights") and "Q=6" in cap3[0].shape("weights")


def test_unselected_calls_cost_nothing(monkeypatch):
    calls = []
    real = capmod.recompute
    monkeypatch.setattr(capmod, "recompute", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model, x = Stack(L=4), torch.randn(1, 5, 32)
    with capture(layers=[1]) as cap:
        model(x)
    assert len(calls) == 1 and len(cap) == 1
    model(x)  # capture off: never called
    assert len(calls) == 1


def test_capture_off_changes_nothing_and_stores_nothing_on_modules():
    torch.manual_seed(0)
    model = Stack(L=2, Hkv=2)
    x = torch.randn(2, 7, 32, requires_grad=True)
    mask = masks.padding(torch.tensor([7, 4]))
    before = {n: sorted(vars(m)) for n, m in model.named_modules()}
    out0 = model(x, mask)
    (g0,) = torch.autograd.grad(out0.sum(), x)
    with capture(what=("scores", "weights", "lse", "head_outputs")) as cap:
        out1 = model(x, mask)
    (g1,) = torch.autograd.grad(out1.sum(), x)
    assert torch.equal(out0, out1) and torch.equal(g0, g1)  # bit for bit, gradients included
    assert all(not t.requires_grad for r in cap for t in (r.weights, r.scores, r.lse, r.head_outputs))
    assert {n: sorted(vars(m)) for n, m in model.named_modules()} == before
    assert observe.active() == ()
    assert len(cap) == 2


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="unknown what"):
        capture(what=("probs",)).__enter__()
    with pytest.raises(ValueError, match="layers takes"):
        capture(layers=[-1]).__enter__()
    q, k, v = qkv(1, 2, None, 3, 3, 4)
    with pytest.raises(ShapeError, match="heads .* out of range .* H=2"):
        with capture(heads=[5]):
            bhqk.attention(q, k, v)
    with capture(heads=[0]) as cap:
        bhqk.attention(q, k, v)
    with pytest.raises(KeyError, match="head 1 was not captured"):
        cap[0].head(1)
    with pytest.raises(KeyError, match="no captured call"):
        cap[3]


# ---- one head costs one head ----------------------------------------------------------------------

def _largest_allocation(fn) -> int:
    """The largest CPU allocation (bytes) any operator made while ``fn`` ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@pytest.mark.parametrize("backend", [b for b in ("tiled", "torch") if b in concrete_backends()])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_one_head_on_a_fast_path_never_allocates_the_other_heads(backend, mask):
    B, H, Q, K, d = 1, 8, 512, 512, 32
    q, k, v = qkv(B, H, None, Q, K, d, dtype=torch.float32)
    m = masks.causal() if mask else None
    one_head = B * Q * K * 4  # bytes of one head's [Q, K] in float32
    kw = {"block_q": 64, "block_k": 64} if backend == "tiled" else {}

    def run(heads):
        def fn():
            if heads == "off":
                return bhqk.attention(q, k, v, m, backend=backend, **kw)
            with capture(heads=heads) as cap:
                bhqk.attention(q, k, v, m, backend=backend, **kw)
            run.cap = cap
        return fn

    base = _largest_allocation(run("off"))  # the fast path's own buffers
    assert base < H * one_head  # so an allocation for all H heads would stand out
    one = _largest_allocation(run([5]))
    assert run.cap[0].backend == backend and run.cap[0].weights.shape == (B, 1, Q, K)
    assert_paths_close(run.cap[0].weights, bhqk.attention_weights(q, k, m)[:, [5]], n=K)
    every = _largest_allocation(run(None))  # the control: the same measurement sees all H heads
    assert every >= H * one_head
    assert one <= max(base, 1.5 * one_head), f"largest allocation {one} B; one head's [Q, K] is {one_head} B"


# ---- the bundled MiniLM ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    from transformers import BertModel

    from bhqk.models import bert

    folder = bert.bundled_model_dir()
    hf = BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    enc = bert.SentenceEncoder.from_pretrained(folder)
    ids, am = enc.tokenize(["The cat sat on the mat.", "Attention is a table: one row per query, one column per key."])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=am, output_attentions=True).attentions  # L × [B, H, N, N]
    return enc.model, ids, am, ref


@pytest.mark.parametrize("backend", ["auto", "reference", "tiled", "torch"])
def test_minilm_weights_equal_transformers_output_attentions(minilm, backend, monkeypatch):
    model, ids, am, ref = minilm
    monkeypatch.setattr(model, "backend", backend)  # the encoder's per-call backend choice
    with torch.no_grad():
        plain = model(ids, am)
        with capture(model=model) as cap:
            captured = model(ids, am)
    assert torch.equal(plain, captured)
    assert len(cap) == len(ref) == 6
    assert backend == "auto" or {r.backend for r in cap} == {backend}
    for rec, want in zip(cap, ref):
        assert rec.name.startswith("layers.") and rec.weights.shape == want.shape == (2, 12, ids.shape[1], ids.shape[1])
        assert_models_close(rec.weights, want, width=1536, layers=6)


def test_minilm_one_head_of_one_layer(minilm):
    model, ids, am, ref = minilm
    with torch.no_grad(), capture(layers=["layers.3.*"], heads=[7], rows=[0], model=model) as cap:
        model(ids, am)
    assert [r.name for r in cap] == ["layers.3.attn"]
    assert_models_close(cap[3].weights, ref[3][:, [7]][:, :, [0]], width=1536, layers=6)


# ---- head statistics ------------------------------------------------------------------------------

def test_head_stats_of_uniform_and_one_hot_attention():
    Q = K = 5
    tokens = ["[CLS]", "a", "b", "c", "[SEP]"]
    q = torch.zeros(1, 2, Q, 4, dtype=torch.float64)  # every score 0: uniform rows
    k = torch.randn(1, 2, K, 4, dtype=torch.float64)
    q[0, 1] = torch.eye(Q, 4, dtype=torch.float64) * 1e3  # head 1 with k = eye: row i looks at key i only
    k[0, 1] = torch.eye(K, 4, dtype=torch.float64)
    q[0, 1, 4] = 0.0  # except the last row, uniform
    with capture() as cap:
        bhqk.attention(q, k, k, backend="reference")
    s0, s1 = cap.stats(tokens)

    def close(got: float, want: float) -> None:  # float64 means over Q rows of sums over K keys
        assert_close(torch.tensor(got), torch.tensor(want, dtype=torch.float64), n=Q * K)

    close(s0.entropy, math.log(K))
    close(s0.first, 1 / K)
    close(s0.special["[CLS]"], 1 / K)
    close(s0.special["[SEP]"], 1 / K)
    close(s0.distance, sum(abs(i - j) for i in range(Q) for j in range(K)) / (Q * K))
    # head 1: rows 0-3 one-hot on the diagonal (entropy 0, distance 0), row 4 uniform
    close(s1.entropy, math.log(K) / Q)
    close(s1.distance, sum(abs(4 - j) for j in range(K)) / K / Q)
    close(s1.special["[CLS]"], (1 + 1 / K) / Q)
    table = cap.summary(tokens)
    assert table.count("\n") == 1 + 2 and "on [SEP]" in table and "entropy" in table
    with pytest.raises(ValueError, match="one token per key"):
        cap.stats(tokens[:3])


def test_head_stats_skip_fully_masked_rows():
    q, k, v = qkv(1, 1, None, 3, 3, 4)
    m = masks.dense(torch.tensor([[True, True, False], [True, False, False], [False, False, False]]))
    with capture() as cap:
        bhqk.attention(q, k, v, m, backend="reference")
    (s,) = cap.stats()
    P = cap[0].weights[0, 0]
    assert_paths_close(torch.tensor(s.first), P[:2, 0].mean(), n=3)  # mean over the two rows that may attend
