"""The head detector on the shipped toy model (a two-layer attention-only transformer trained on
repeated random sequences by examples/train_induction.py): it finds the induction heads in layer 1
and the previous-token heads in layer 0 that the circuit needs; on an untrained model of the same
shape it finds none, and without repetition (the control) no head scores."""

from __future__ import annotations

import pytest
import torch

from bhqk.inspect import detect, toy

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


def test_detector_finds_the_induction_head_of_the_shipped_model():
    model = toy.load()
    t = detect(model, vocab=model.config.vocab, length=20, batch=4, model=model, seed=1)
    assert t.layers == ["blocks.0", "blocks.1"]
    layer, head, score = t.top("induction", 1)[0]
    assert layer == 1 and score > 0.3, t
    assert float(t["induction (control)"][layer, head]) < 0.15  # nothing to copy: the head has nothing to find
    assert float(t["induction"][0].max()) < 0.1  # layer 0 cannot do it alone
    prev_layer, _, prev = t.top("prev", 1)[0]
    assert prev_layer == 0 and prev > 0.4, t  # the previous-token head the induction head reads
    roles = {(li, r) for li, _, r, _ in t.roles()}
    assert (1, "induction") in roles and (0, "prev") in roles


def test_an_untrained_model_has_no_induction_head():
    torch.manual_seed(0)
    model = toy.AttnOnly(toy.ToyConfig()).eval()
    t = detect(model, vocab=model.config.vocab, length=20, batch=4, model=model)
    assert float(t["induction"].max()) < 0.3, t
    assert not [r for r in t.roles() if r[2] == "induction"]
