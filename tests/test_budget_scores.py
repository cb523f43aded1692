"""The causal head scores of bhqk.budget (kl, fisher, learned) and the gates they stand on: each score
puts first the one K/V head a hand-built model needs beyond the streaming window (tests/handmade.py),
the gates mix full and streaming attention exactly as a plan does at 0 and 1, the fisher score's
gradients are the finite differences of its log-likelihood, and the learned gates resume exactly."""

from __future__ import annotations

import pytest
import torch
import transformers

from bhqk.budget import Plan, find
from bhqk.budget import scores as sc
from bhqk.budget.gate import gated
from bhqk.budget.learn import train_gates
from bhqk.corpus import passkey_prompt
from bhqk.errors import LoadError, ShapeError
from bhqk.integrations.transformers import register
from handmade import INDUCTION, CharTokenizer, induction_llama
from tolerance import assert_close, assert_models_close

pytestmark = pytest.mark.protocol  # transformers through bhqk (make test-newest, make test-lowest)

register()
V = 100
S, W = 4, 16  # the hand-built model's streaming heads: a sink of 4 and a window of 16
LEARN = dict(length=240, keys=1, words=2, lr=0.1)  # pass-key prompts a character tokenizer fits in 240 tokens


def _llama(layers=2):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="bhqk")).eval()


def _ids(B=2, N=40, seed=1):
    return torch.randint(1, V, (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def handmade():
    return induction_llama()


# ---- the gates ----------------------------------------------------------------------------------------


def test_gates_at_one_and_zero_are_full_attention_and_the_plan_they_spell():
    model, ids = _llama(), _ids()
    mixed = torch.tensor([[True, False], [False, True]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits  # [B, N, V]
        with gated(model, torch.ones(2, 2), 3, 5):
            one = model(input_ids=ids).logits
        with gated(model, mixed.float(), 3, 5):
            got = model(input_ids=ids).logits
        with Plan(mixed, 3, 5).emulate(model):
            want = model(input_ids=ids).logits
        with gated(model, torch.zeros(2, 2, 40), 3, 5):  # one gate per row, all 0: every head streams
            zero = model(input_ids=ids).logits
        with Plan(torch.zeros(2, 2, dtype=torch.bool), 3, 5).emulate(model):
            stream = model(input_ids=ids).logits
    assert_models_close(one, plain, width=96, layers=2)
    assert_models_close(got, want, width=96, layers=2)
    assert_models_close(zero, stream, width=96, layers=2)
    assert (stream - plain).abs().max() > 1e-3, "streaming must change the logits (else this proves nothing)"
    assert model.config._attn_implementation == "bhqk"  # the block switched the model back


def test_gates_name_what_does_not_fit():
    model, ids = _llama(), _ids()
    with pytest.raises(ShapeError, match=r"gates must be a float tensor \[layers=2, Hkv=2\]"):
        with gated(model, torch.ones(3, 2), 3, 5):
            pass
    with pytest.raises(ShapeError, match=r"needs \[Hkv=2, N=40\].*prefill"), gated(model, torch.ones(2, 2, 7), 3, 5):
        model(input_ids=ids)
    with pytest.raises(TypeError, match="Hugging Face causal LM"), gated(torch.nn.Linear(2, 2), torch.ones(1, 1), 3, 5):
        pass


# ---- every score finds the head the hand-built model needs beyond the window ---------------------------


@pytest.mark.parametrize("score, kw", [
    ("retrieval", {}),
    ("kl", dict(length=200)),
    ("fisher", dict(length=200)),
    ("learned", dict(steps=3, **LEARN)),
])
def test_every_score_puts_the_one_long_range_head_first(handmade, score, kw):
    """K/V head (1, 1) is an induction head (the only head that reads beyond the window); (0, 0) and
    (0, 1) are local, (1, 0) inert. (1, 1) is the last by index: a score that ties everywhere fails."""
    plan = find(handmade, full=0.25, sink=S, window=W, score=score, tokenizer=CharTokenizer(), **kw)
    flat = plan.scores.flatten()  # [L·Hkv]
    best = INDUCTION[0] * 2 + INDUCTION[1]
    assert bool((flat[best] > flat[torch.arange(4) != best]).all()), plan.scores
    assert plan.full.flatten().tolist() == [False, False, False, True] and plan.score == score


@pytest.mark.parametrize("score, kw", [("fisher", dict(length=200)), ("learned", dict(steps=1, **LEARN))])
def test_the_gradient_scores_do_not_depend_on_the_callers_grad_mode(handmade, score, kw):
    """find under torch.no_grad() (as a benchmark or an eval loop runs) gives the scores it gives with
    gradients on (a recomputation: within tests/tolerance.py, fp32 sums over the 200 rows × 64 widths a
    score is made of); under torch.inference_mode() it says what to do instead of failing in backward."""
    want = find(handmade, full=0.25, sink=S, window=W, score=score, tokenizer=CharTokenizer(), **kw).scores
    with torch.no_grad():
        got = find(handmade, full=0.25, sink=S, window=W, score=score, tokenizer=CharTokenizer(), **kw).scores
        assert not torch.is_grad_enabled()  # the caller's mode is back
    assert_close(got, want, dtype=torch.float32, n=200 * 64)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"outside torch.inference_mode\(\)"):
        find(handmade, full=0.25, sink=S, window=W, score=score, tokenizer=CharTokenizer(), **kw)


def test_the_kl_score_is_the_divergence_of_the_logits_with_one_head_streamed():
    """Against the model's own logits with the plan that streams one K/V head (rows past sink + window)."""
    model, ids = _llama(), _ids(N=50)
    got = sc.kl_scores(model, ids, 3, 5)  # [L, Hkv]
    want = torch.zeros(2, 2, dtype=torch.float64)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[:, 9:].double(), -1)  # rows 9 … N−1 = S + W + 1 …
        for li in range(2):
            for j in range(2):
                keep = torch.ones(2, 2, dtype=torch.bool)
                keep[li, j] = False
                with Plan(keep, 3, 5).emulate(model):
                    mine = torch.log_softmax(model(input_ids=ids).logits[:, 9:].double(), -1)
                want[li, j] = (full.exp() * (full - mine)).sum(-1).mean()
    assert float(want.min()) > 0
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6 * float(want.max()))
    ref = sc.reference(model, ids, 9)
    assert ref.inputs is not None and len(ref.inputs) == 2  # the runs started from each head's layer


def _row_loglik(model, ids, y, start):
    """log p(y) summed over rows start … N−1 as a function of per-row gates [L, Hkv, N]."""
    def f(g):
        with gated(model, g, 3, 5):
            logits = model(input_ids=ids).logits[0]  # [N, V]
        return torch.log_softmax(logits, -1)[start:].gather(-1, y[start:, None]).sum()
    return f


def test_fisher_gradients_are_the_finite_differences_of_the_log_likelihood(monkeypatch):
    """d log p(y) / d g at g = 1 (float64 throughout) for one gate per K/V head and row, as fisher_scores
    builds them, against PyTorch's finite-difference check; per-row gradients add up to a shared gate's;
    and the score is ½ Σ_rows (d/dg)² / rows (y fixed to the argmax to compare)."""
    def rms_norm(self, x):  # transformers' LlamaRMSNorm in the input's dtype (its own rounds through float32)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    model = _llama().double()
    ids = _ids(B=1, N=16)
    with torch.no_grad():
        y = model(input_ids=ids).logits[0].argmax(-1)  # [N]
    f = _row_loglik(model, ids, y, 9)
    g = torch.ones(2, 2, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (g,), fast_mode=True)  # a random direction of the [2, 2, 16] gates
    rows = torch.autograd.grad(f(g), g)[0]  # [L, Hkv, N]
    assert float(rows[..., 9:].abs().max()) > 0, "the gates must move the likelihood (else this proves nothing)"
    assert_close(rows[..., :9], torch.zeros(2, 2, 9, dtype=torch.float64), n=16,
                 magnitude=float(rows.abs().max()))  # rows before S + W + 1: full and streaming see the same keys
    shared = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    d = torch.autograd.grad(f(shared[..., None].expand(2, 2, 16)), shared)[0]
    torch.testing.assert_close(d, rows.sum(-1))
    monkeypatch.setattr(torch, "multinomial", lambda p, n, generator=None: p.argmax(-1, keepdim=True))
    got = sc.fisher_scores(model, ids, 3, 5)
    torch.testing.assert_close(got, rows[..., 9:].pow(2).sum(-1) / (2 * 7))


def test_fisher_is_seeded_and_sums_per_row_gradients():
    model, ids = _llama(), _ids(B=1, N=48)
    a = sc.fisher_scores(model, ids, 3, 5, seed=0)
    assert torch.equal(a, sc.fisher_scores(model, ids, 3, 5, seed=0))
    assert not torch.equal(a, sc.fisher_scores(model, ids, 3, 5, seed=1))  # y is drawn from the model
    assert float(a.min()) > 0
    with pytest.raises(ShapeError, match="sink \\+ window \\+ 1"):
        sc.fisher_scores(model, ids[:, :8], 3, 5)


# ---- the learned gates ---------------------------------------------------------------------------------


def test_passkey_prompts_are_exact_in_length_and_drawn_from_the_seed():
    tok = CharTokenizer()
    ids, first = passkey_prompt(tok, 240, seed=4, index=2, keys=1, words=2)
    again, _ = passkey_prompt(tok, 240, seed=4, index=2, keys=1, words=2)
    other, _ = passkey_prompt(tok, 240, seed=4, index=3, keys=1, words=2)
    text = tok.decode(ids.tolist())
    assert ids.shape == (240,) and torch.equal(ids, again) and not torch.equal(ids, other)
    answer = tok.decode(ids[first:].tolist())
    words = answer.split("pass key is ")[-1].rstrip(".")
    assert answer.startswith("\n\nWhat is the first pass key?") and f"The first pass key is {words}. Remember it." in text
    with pytest.raises(ValueError, match="too short"):
        passkey_prompt(tok, 100, keys=2, words=8)


def test_learned_gates_resume_exactly(handmade, tmp_path):
    tok = CharTokenizer()
    straight = train_gates(handmade, tok, S, W, 2, **LEARN)
    ck = tmp_path / "gates.pt"
    with pytest.raises(_Stop):  # interrupted after step 1 and its checkpoint
        train_gates(handmade, tok, S, W, 2, checkpoint=ck, every=1, progress=_stop_at(1), **LEARN)
    assert torch.load(ck, weights_only=True)["step"] == 1
    resumed = train_gates(handmade, tok, S, W, 2, resume=ck, **LEARN)
    assert resumed.step == 2 and torch.equal(resumed.gates, straight.gates)
    assert torch.load(ck, weights_only=True)["step"] == 2  # written back where it came from
    assert not torch.equal(straight.gates, torch.full((2, 2), straight.gates[0, 0].item()))  # step 2 moved them apart
    with pytest.raises(LoadError, match="other settings.*'reg'"):
        train_gates(handmade, tok, S, W, 2, resume=ck, reg=0.5, **LEARN)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(LoadError, match="not a gates checkpoint"):
        train_gates(handmade, tok, S, W, 2, resume=tmp_path / "junk.pt", **LEARN)


class _Stop(Exception):
    pass


def _stop_at(n):
    def progress(step, _rec):
        if step == n:
            raise _Stop
    return progress


# ---- the command line -------------------------------------------------------------------------------


def test_cli_budget_runs_the_causal_scores_with_their_knobs(handmade, tmp_path, capsys, serve):
    from bhqk.cli import main

    serve((handmade, CharTokenizer()))
    from pydoc_data.topics import topics

    text = tmp_path / "text.txt"
    text.write_text(topics["if"] * 2)
    base = ["budget", "--model", "handmade", "--full", "0.25", "--sink", str(S), "--window", str(W)]
    assert main(base + ["--score", "kl", "--probe-length", "64", "--text", str(text)]) == 0
    out, err = capsys.readouterr()
    assert "1 of 4 K/V heads full" in out and "chosen by kl" in out and "kl: layer 1 kv head 1:" in err
    ck = tmp_path / "gates.pt"
    learn = base + ["--score", "learned", "--probe-length", "700"]
    assert main(learn + ["--steps", "0", "--checkpoint", str(ck)]) == 0  # the wiring; training is tested above
    assert "chosen by learned" in capsys.readouterr().out and torch.load(ck, weights_only=True)["step"] == 0
    assert main(learn + ["--steps", "2", "--resume", str(ck)]) == 2  # a schedule of another length
    assert "made with other settings" in capsys.readouterr().err
    assert main(base + ["--score", "kl", "--steps", "3"]) == 2
    assert "--steps belongs to --score learned (got --score kl)" in capsys.readouterr().err
    assert main(base + ["--score", "retrieval", "--text", str(text)]) == 2
    assert "--text is the text of --score distant, kl, fisher (got --score retrieval)" in capsys.readouterr().err


# ---- SmolLM2-135M (slow) --------------------------------------------------------------------------------


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.flatten().argsort().argsort().double()  # ranks (the scores of a real model have no ties)
    rb = b.flatten().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@pytest.mark.slow
def test_fisher_ranks_smollm2s_heads_like_the_exact_kl(smollm2):
    """1,024 tokens of pydoc text, S = 64, W = 256 (703 rows scored): one forward and backward rank the
    90 K/V heads as 90 forwards do (measured at 2,048 tokens: Spearman 0.98; README)."""
    model, tok = smollm2
    ids = sc.text_ids(tok, None, 1024, 1)
    kl = sc.kl_scores(model, ids, 64, 256)
    fisher = sc.fisher_scores(model, ids, 64, 256)
    rho = _spearman(fisher, kl)
    assert rho > 0.9, rho
    top = set(kl.flatten().argsort(descending=True)[:22].tolist())
    assert len(top & set(fisher.flatten().argsort(descending=True)[:22].tolist())) >= 16


@pytest.mark.slow
def test_learned_gates_on_smollm2_resume_exactly(smollm2, tmp_path):
    model, tok = smollm2
    kw = dict(length=512, keys=1)
    straight = train_gates(model, tok, 64, 256, 2, **kw)
    ck = tmp_path / "gates.pt"
    with pytest.raises(_Stop):
        train_gates(model, tok, 64, 256, 2, checkpoint=ck, every=1, progress=_stop_at(2), **kw)
    resumed = train_gates(model, tok, 64, 256, 2, resume=ck, **kw)
    assert torch.equal(resumed.gates, straight.gates) and not torch.equal(straight.gates, torch.ones(30, 3))
