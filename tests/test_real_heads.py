"""Heads of a real language model, and the retrieval detector.

The retrieval detector (bhqk.inspect.retrieval) on models whose answer is known by construction: a
hand-built pointer model whose heads attend where we set them (a copying head, a sink, a previous-
token head), and the shipped toy induction model, whose copying heads are the ones detect() names.
The real model (SmolLM2-135M-Instruct) at a few hundred tokens: each role's best head is measured
against the rest of the model with a margin, never against a head list copied from a run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bhqk
from bhqk.inspect import detect, retrieval, toy

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

# ---------------------------------------------------------------------------------------------
# A pointer model: head h of the one attention call puts (almost) all its weight on key target_h(i)


class Pointer(nn.Module):
    """Three heads over one-hot position codes: head 0 copies the needle (from row N0 − 1 on, row i
    attends key s + i − (N0 − 1); before that, itself), head 1 attends key 0, head 2 the previous key.
    Values are one-hot tokens and the logits read head 0, so greedy decoding copies the needle."""

    def __init__(self, vocab: int, start: int, prompt_len: int, max_len: int = 64, sharp: float = 50.0) -> None:
        super().__init__()
        self.V, self.s, self.N0, self.d, self.sharp = vocab, start, prompt_len, max_len, sharp

    def targets(self, N: int) -> torch.Tensor:
        i = torch.arange(N)
        copy = torch.where(i >= self.N0 - 1, self.s + i - (self.N0 - 1), i)  # [N]
        return torch.stack([copy, torch.zeros_like(i), (i - 1).clamp(min=0)])  # [3, N]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, N = ids.shape
        eye = torch.eye(self.d)  # [d, d]
        q = self.sharp * eye[self.targets(N)]  # [3, N, d]
        q = q[None].expand(B, 3, N, self.d)  # [B, H, Q, d]
        k = eye[:N][None, None].expand(B, 3, N, self.d)  # [B, H, K, d]
        v = nn.functional.one_hot(ids, self.V).float()[:, None].expand(B, 3, N, self.V)  # [B, H, K, V]
        out = bhqk.attention(q, k, v, bhqk.masks.causal(), scale=1.0)  # [B, H, Q, V]
        return out[:, 0]  # [B, Q, V]: head 0's copy


def _prompt(vocab: int, needle: list[int], start: int, n: int) -> torch.Tensor:
    """[n] filler tokens (ids ≥ 10, none of the needle's) with ``needle`` at ``start``."""
    g = torch.Generator().manual_seed(0)
    fill = torch.randint(10, vocab, (n,), generator=g)
    fill[torch.isin(fill, torch.tensor(needle))] = 10
    fill[start:start + len(needle)] = torch.tensor(needle)
    return fill


def test_retrieval_scores_the_head_that_copies_the_needle_by_construction():
    needle, s, N = [3, 5, 7, 2], 6, 20
    ids = _prompt(40, needle, s, N)
    model = Pointer(40, s, N)
    t = retrieval(model, ids, (s, s + len(needle)), max_new_tokens=len(needle))
    assert t.layers == ["attention.0"] and t.num_heads == 3
    assert t["retrieval"][0].tolist() == [1.0, 0.0, 0.0]  # copy head, sink, previous token
    assert t["retrieval hits"][0].tolist() == [4.0, 0.0, 0.0]
    assert "4 copied" in t.notes["retrieval"]


def test_retrieval_counts_a_sink_only_where_key_0_is_the_copied_token():
    needle, N = [3, 5, 7, 2], 20
    ids = _prompt(40, needle, 0, N)  # the needle starts at key 0: the sink head's argmax is its first token
    t = retrieval(Pointer(40, 0, N), ids, (0, 4), max_new_tokens=4)
    assert t["retrieval"][0].tolist() == [1.0, 0.25, 0.0]


def test_retrieval_teacher_forced_counts_only_needle_tokens():
    needle, s, N = [3, 5, 7, 2], 6, 20
    ids = _prompt(40, needle, s, N)
    model = Pointer(40, s, N)
    # the second answer token is not a needle token: not counted; the others are copied by head 0
    t = retrieval(model, [ids, ids], [(s, s + 4), (s, s + 4)], answer=[torch.tensor([3, 9, 7]), torch.tensor([3, 5])])
    assert t["retrieval hits"][0].tolist() == [4.0, 0.0, 0.0]  # 2 + 2 copied tokens
    assert t["retrieval"][0].tolist() == [1.0, 0.0, 0.0]


def test_retrieval_errors():
    ids = _prompt(40, [3, 5], 6, 20)
    model = Pointer(40, 6, 20)
    with pytest.raises(ValueError, match="no trial copied"):
        retrieval(model, ids, (6, 8), answer=torch.tensor([9, 9]))
    with pytest.raises(ValueError, match="not inside its prompt"):
        retrieval(model, ids, (18, 25), answer=torch.tensor([3]))
    with pytest.raises(ValueError, match="as many needle spans"):
        retrieval(model, [ids, ids], [(6, 8)])
    with pytest.raises(ValueError, match="ran no bhqk attention|no attention call ran on bhqk"):  # capture may say it first
        retrieval(lambda x: nn.functional.one_hot(x, 40).float(), ids, (6, 8), answer=torch.tensor([3]))


def test_retrieval_on_the_toy_model_finds_the_heads_detect_calls_induction():
    model = toy.load()
    V = model.config.vocab
    heads = detect(model, vocab=V, length=20, batch=4, model=model, seed=1)
    g = torch.Generator().manual_seed(2)
    prompts, spans, answers = [], [], []
    for _ in range(4):
        seg = torch.randperm(V, generator=g)[:20]  # distinct tokens: each copy has one source
        prompts.append(torch.cat([seg, seg[:1]]))  # the copy has begun
        spans.append((0, 20))
        answers.append(seg[1:])
    t = retrieval(model, prompts, spans, answer=answers)
    assert t.layers == heads.layers
    induction = heads["induction"] > 0.3  # [L, H] the detector's induction heads (its control subtracted)
    assert bool(induction.any())
    score = t["retrieval"].float()
    assert float(score[induction].min()) > 0.5, t  # every induction head copies from the needle
    assert float(score[~induction].max()) < 0.2, t  # no other head does
    # greedy: the model continues the copy itself and the same heads score
    g2 = retrieval(model, prompts[0], spans[0], max_new_tokens=19)
    assert float(g2["retrieval"].float()[induction].min()) > 0.5


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (tests/conftest.py: smollm2), a few hundred tokens of pydoc prose

N_TEXT = 256


def _pydoc(tok, n: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.tensor(tok(text[: 40 * n], add_special_tokens=False)["input_ids"][:n])[None]  # [1, n]


def _logits(model):
    return lambda x: model(x, logits_to_keep=1)


@pytest.fixture(scope="module")
def text_table(smollm2):
    """The head table of every layer and head over N_TEXT tokens of pydoc prose (fast path)."""
    model, tok = smollm2
    with torch.no_grad(), bhqk.capture(model=model, what=("sink",), offsets=(1,)) as cap:
        model(_pydoc(tok, N_TEXT), logits_to_keep=1)
    assert {r.backend for r in cap.records} != {"reference"}
    return cap.head_table()


@pytest.fixture(scope="module")
def detected(smollm2):
    model, tok = smollm2
    return detect(_logits(model), vocab=len(tok), length=32, batch=1, model=model, low=400, seed=0)


@pytest.fixture(scope="module")
def needle(smollm2):
    """(prompt [1, N], the key's span, the key's tokens): a pass key in the middle of pydoc prose, asked
    through the chat template."""
    model, tok = smollm2
    key = "40517"
    words = tok.decode(_pydoc(tok, 200)[0])
    cut = words.rfind("\n", 0, len(words) // 2) + 1
    content = (words[:cut] + f"The pass key is {key}. Remember it.\n" + words[cut:]
               + "\n\nWhat is the pass key? Answer with the number only.")
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]  # [1, N]
    kt = tok(key, add_special_tokens=False)["input_ids"]
    flat = ids[0].tolist()
    s = next(i for i in range(len(flat)) if flat[i: i + len(kt)] == kt)
    return ids, (s, s + len(kt)), torch.tensor(kt)


def test_real_model_has_previous_token_heads(text_table, detected):
    for v in (text_table["prev"], detected["prev"]):  # pydoc prose; random tokens (detect's control)
        best, median = float(v.max()), float(v.median())
        assert best > 0.5 and best > median + 0.4, (best, median)
    # the same head on both texts: previous-token attention is not a property of one text
    li, h, _ = text_table.top("prev", 1)[0]
    assert float(detected["prev"][li, h]) > 0.5


def test_real_model_has_induction_heads_and_the_control_scores_none(detected):
    v = detected["induction"]
    li, h, best = detected.top("induction", 1)[0]
    assert best > 0.5 and best > float(v.median()) + 0.4, detected
    assert float(detected["induction (control)"][li, h]) < 0.05  # nothing repeats: nothing to find
    # the induction heads sit after the first previous-token heads (they read what those wrote)
    first_prev = min(li_ for li_, _, x in detected.top("prev", 3) if x > 0.5)
    assert li > first_prev


def test_real_model_sinks_key_0_far_above_uniform(text_table):
    v = text_table["sink"]  # [L, H]: P on key 0 over N_TEXT rows
    uniform = float(sum(1 / (i + 1) for i in range(N_TEXT)) / N_TEXT)  # key 0's share under uniform attention
    assert float(v.median()) > 10 * uniform, (float(v.median()), uniform)
    assert float(v.max()) > 0.9
    # the first two layers attend locally: their heads sink less than the model's median head
    assert float(v[:2].mean()) < float(v.median())


def test_real_model_retrieval_heads_are_induction_heads(smollm2, needle, detected):
    model, _ = smollm2
    ids, span, key = needle
    t = retrieval(model, ids, span, answer=key)  # the key's digits, teacher-forced after the prompt
    assert t.layers == detected.layers and t.num_heads == 9
    v = t["retrieval"]
    li, h, best = t.top("retrieval", 1)[0]
    assert best >= 0.8 and float(v.median()) == 0.0, t
    # the heads that copy the needle best (a tie of several: 5 key tokens score in steps of 0.2) include
    # heads that copy on random text too
    tied = [(l_, h_) for l_, h_, x in t.top("retrieval", 10) if x == best]
    assert max(float(detected["induction"][l_, h_]) for l_, h_ in tied) > 0.3, tied
    assert int((v >= 0.5).sum()) <= 27  # few heads retrieve (at most a tenth)
