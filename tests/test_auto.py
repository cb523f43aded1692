"""The ``auto`` policy as a registry policy: every registered backend with an estimate is weighed
(a fake backend registered here is considered, wins when cheapest, loses when it refuses); the
tile plan travels in the Choice; costs are measured per machine and cached, and tests inject fixed
costs so the choices they check do not depend on the machine."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.errors import BackendError
from bhqk.functional import (
    Backend,
    Estimate,
    calibrate,
    prepare,
    register,
    registry,
    tiled,
    unregister,
)
from bhqk.functional.tiled_plan import Plan
from conftest import qkv


@pytest.fixture
def reference_costs(two_threads):
    with calibrate.fixed():
        yield


@pytest.fixture
def fake():
    """A backend that computes with the reference, costs what the test says, and refuses on demand."""
    state = {"seconds": 1e-6, "refuse": None, "runs": 0}

    def run(p, need_lse, plan=None):
        state["runs"] += 1
        assert plan == "fake-plan"  # the plan its estimate made reaches its run
        return registry.get("reference").run(p, need_lse)

    register(Backend("fake", run, lambda p, need_lse: state["refuse"],
                     lambda p, grad: Estimate(state["seconds"], "fake note", "fake-plan")))
    try:
        yield state
    finally:
        unregister("fake")
    assert "fake" not in bhqk.functional.names()


def test_a_registered_backend_is_weighed_and_wins_when_cheapest(fake, reference_costs):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32)
    choice = bhqk.choose_backend(q, k, v, masks.sliding_window(16))
    assert choice.name == "fake" and set(choice.estimates) >= {"fake", "torch"}
    assert choice.reason.startswith("fake: estimated") and "fake note" in choice.reason
    out = bhqk.attention(q, k, v, masks.sliding_window(16))
    assert fake["runs"] == 1
    torch.testing.assert_close(out, bhqk.attention(q, k, v, masks.sliding_window(16), backend="reference"))


def test_a_registered_backend_loses_when_dearer_or_refusing(fake, reference_costs):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32)
    fake["seconds"] = 10.0
    choice = bhqk.choose_backend(q, k, v, masks.sliding_window(16))
    assert choice.name != "fake" and "fake" in choice.estimates and choice.estimates["fake"] == 10.0
    fake["seconds"], fake["refuse"] = 1e-9, "the fake backend refuses"
    choice = bhqk.choose_backend(q, k, v, masks.sliding_window(16))
    assert choice.name != "fake" and "fake" not in choice.estimates and "not fake: the fake backend refuses" in choice.reason
    assert fake["runs"] == 0


def test_policy_choices_and_reasons(reference_costs):
    big = torch.zeros(1, 8, 4096, 64)  # finite: NaN/inf would be handed to tiled
    q = k = v = big

    def decide(*args, lse=False, **kw):
        return registry.decide(prepare(q, k, v, *args, **kw), lse)

    plain = decide()
    assert plain.name == "torch" and plain.reason.startswith("torch: estimated") and "tiled" in plain.reason
    assert decide(masks.causal()).name == "torch"
    assert decide(lse=True).name == "tiled"  # only tiled returns lse
    assert decide(softcap=30.0).name == "tiled"
    win = decide(masks.sliding_window(256))
    assert win.name == "tiled" and win.estimates["tiled"] * 3 < win.estimates["torch"]
    assert isinstance(win.plan, Plan) and win.plan.fraction(prepare(q, k, v).ext) < 0.2
    dense_win = decide(masks.sliding_window(256).materialize(1, 1, 4096, 4096))
    assert dense_win.name == "tiled" and "dense mask 16.8 M entries" in dense_win.reason
    assert decide(masks.document(torch.arange(4096) // 512)).name == "tiled"
    huge = torch.zeros(1, 1, 8192, 8)
    far = registry.decide(prepare(huge, huge, huge, masks.padding(6000)), False)
    assert far.name == "tiled" and "not torch: it would need a dense mask" in far.reason
    dropping = registry.decide(prepare(huge, huge, huge, masks.padding(6000), dropout_p=0.1), False)
    assert dropping.name == "tiled"  # the tiled backend has dropout (tests/test_dropout.py)
    assert bhqk.why_not("tiled", huge, huge, huge, dropout_p=0.1) is None
    assert bhqk.why_not("tiled", huge, huge, huge, masks.padding(6000), return_lse=True) is None


def test_tiny_calls_go_to_sdpa_even_masked(reference_costs):
    q, k, v = qkv(2, 4, 2, 1, 9, d=8, dtype=torch.float32)  # a decode step with a KV cache
    pad = masks.key_padding(torch.tensor([[True] * 9, [False] * 3 + [True] * 6]))
    for mask in (None, masks.causal("bottom_right"), pad, pad & masks.causal("bottom_right")):
        choice = bhqk.choose_backend(q, k, v, mask)
        assert choice.name == "torch", choice.reason
        assert "not tiled: its fixed costs alone" in choice.reason  # no tile plan was made
    torch.testing.assert_close(bhqk.attention(q, k, v, pad), bhqk.attention(q, k, v, pad, backend="reference"))


def test_gradients_are_weighed_and_the_plan_is_reused(reference_costs, monkeypatch):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32, requires_grad=True)
    fwd = bhqk.choose_backend(q.detach(), k.detach(), v.detach(), masks.sliding_window(8), return_lse=True)
    both = bhqk.choose_backend(q, k, v, masks.sliding_window(8), return_lse=True)
    assert both.name == fwd.name == "tiled" and "(forward+backward)" in both.reason
    assert both.estimates["tiled"] > 2 * fwd.estimates["tiled"]
    monkeypatch.setattr(tiled, "plan_for", lambda p: pytest.fail("the run planned again"))
    out, lse = both.run(prepare(q, k, v, masks.sliding_window(8)), True)
    ref, ref_lse = bhqk.attention(q, k, v, masks.sliding_window(8), backend="reference", return_lse=True)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum() + ref_lse.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_no_backend_possible_names_every_refusal(reference_costs, monkeypatch):
    q, k, v = qkv(1, 2, None, 8, 8, d=4, dtype=torch.float32)
    tiled = registry.get("tiled")
    refusing = dataclasses.replace(tiled, why_not=lambda p, need_lse: "it refuses for this test")
    monkeypatch.setitem(registry._REGISTRY, "tiled", refusing)
    with pytest.raises(BackendError, match="torch: .*log-sum-exp.*tiled: it refuses for this test"):
        bhqk.choose_backend(q, k, v, return_lse=True)


# ---- the costs: measured once per machine, cached, overridable -----------------------------------

FAKE = calibrate.Costs(1e-5, 1e-9, 0.6, 1e-10, 2.0, 3.0, 1e-10, source="measured")


def test_costs_are_cached_per_machine_in_the_file_named_by_the_env(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate, "measure", lambda dev, dt: calls.append(dt) or FAKE)
    backward = {"sdpa_backward": 4.0, "sdpa_causal_backward": 0.7, "sdpa_mask_elem_backward": 1e-10, "tiled_fixed_backward": 2.0,
                "tiled_elem_backward": 3.0}
    monkeypatch.setattr(calibrate, "measure_backward", lambda dev, dt: backward)
    monkeypatch.setattr(calibrate, "_MEMO", {})
    path = tmp_path / "costs.json"
    monkeypatch.setenv("BHQK_COSTS", str(path))
    cpu = torch.device("cpu")
    assert calibrate.costs(cpu, torch.float32) == FAKE and calls == [torch.float32]
    assert calibrate.costs(cpu, torch.float32).sdpa_elem == 1e-9 and len(calls) == 1  # in-process memo
    with_grad = calibrate.costs(cpu, torch.float32, grad=True)
    assert (with_grad.sdpa_backward, with_grad.tiled_elem_backward) == (4.0, 3.0) and len(calls) == 1
    monkeypatch.setattr(calibrate, "_MEMO", {})  # a new process: read from the file, nothing measured
    assert calibrate.costs(cpu, torch.float32, grad=True) == with_grad and len(calls) == 1
    data = json.loads(path.read_text())
    (key,) = data
    assert key == calibrate.machine_key("cpu") and torch.__version__ in key and "float32" in data[key]
    monkeypatch.setenv("BHQK_COSTS", "reference")
    assert calibrate.costs(cpu, torch.bfloat16) == calibrate.REFERENCE[torch.bfloat16]


def test_measuring_gives_positive_finite_costs(monkeypatch):
    monkeypatch.setenv("BHQK_COSTS", "measure")
    monkeypatch.setattr(calibrate, "_MEMO", {})
    c = calibrate.measure(torch.device("cpu"), torch.float32)
    for name in ("sdpa_call", "sdpa_elem", "tiled_fixed", "tiled_elem", "tiled_partial", "sdpa_build_elem"):
        value = getattr(c, name)
        assert math.isfinite(value) and value > 0, (name, value)
    assert 0.3 <= c.sdpa_causal <= 1.0 and c.sdpa_mask_elem >= 0
    b = calibrate.measure_backward(torch.device("cpu"), torch.float32)
    assert b["sdpa_backward"] >= 1.5 and 0.3 <= b["sdpa_causal_backward"] <= 1.0
    assert b["tiled_fixed_backward"] > 0 and b["tiled_elem_backward"] > 0


def test_measure_turns_its_timings_into_costs(monkeypatch):
    """The arithmetic of ``measure`` / ``measure_backward`` on timings given by the test (the real
    timings differ on every machine; these make each formula and clamp checkable)."""
    times = {"plain": 2e-3, "plain_big": 30e-3, "causal_big": 18e-3, "mask_big": 36e-3, "call": 50e-6, "build": 4e-3,
             "tiled": 40e-3, "tiled_window": 20e-3, "tiled_small": 1e-3,
             "sdpa_big": 30e-3, "sdpa_big_both": 105e-3, "sdpa_causal_big_both": 70e-3, "sdpa_mask_big_both": 110e-3,
             "tiled_big_both": 150e-3, "tiled_small_both": 4e-3}
    monkeypatch.setattr(calibrate, "_fastest", lambda fns, device, rounds=5: {k: times[k] for k in fns})
    fitted = []
    monkeypatch.setattr(calibrate, "_scales", lambda parts, t: fitted.append(t) or tuple(range(2, 2 + len(parts[0]))))
    cpu, entries = torch.device("cpu"), calibrate.H * calibrate.N_BIG**2
    c = calibrate.measure(cpu, torch.float32)
    assert c.sdpa_call == 50e-6 and c.sdpa_build_elem == pytest.approx(4e-3 / calibrate.N**2)
    assert c.sdpa_elem == pytest.approx((30e-3 - 50e-6) / entries)
    assert c.sdpa_causal == pytest.approx((18e-3 - 50e-6) / (30e-3 - 50e-6))
    assert c.sdpa_mask_elem == pytest.approx(6e-3 / entries)
    assert (c.tiled_fixed, c.tiled_elem, c.tiled_partial) == (2, 3, 4) and fitted[0] == [40e-3, 20e-3, 1e-3]
    b = calibrate.measure_backward(cpu, torch.float32)
    assert b["sdpa_backward"] == pytest.approx(3.5) and b["sdpa_causal_backward"] == pytest.approx(70 / 105)
    assert b["sdpa_mask_elem_backward"] == pytest.approx(5e-3 / entries)
    assert (b["tiled_fixed_backward"], b["tiled_elem_backward"]) == (2, 3) and fitted[1] == [150e-3, 4e-3]
    times.update(causal_big=40e-3, mask_big=20e-3, sdpa_big_both=40e-3)  # noise: clamped, never nonsense
    c, b = calibrate.measure(cpu, torch.float32), calibrate.measure_backward(cpu, torch.float32)
    assert c.sdpa_causal == 1.0 and c.sdpa_mask_elem == 0.0 and b["sdpa_backward"] == 1.5
    assert calibrate._causal_share(1e-3, 10e-3, 0.0) == 0.3  # a causal kernel never counts as < 30 % of the work


def test_the_tile_models_three_parts_are_fitted_exactly_when_consistent():
    parts = [(1.0, 2.0, 0.5), (0.2, 8.0, 0.1), (3.0, 0.5, 0.0)]
    scales = (0.5, 2.0, 7.0)
    times = [sum(p * s for p, s in zip(row, scales)) for row in parts]
    assert calibrate._scales(parts, times) == pytest.approx(scales)
    one = calibrate._scales(parts, [times[0], -1.0, times[2]])  # noise that makes a scale negative: one scale for all
    assert one[0] == one[1] == one[2] > 0
    two = calibrate._scales([(0.01, 0.05), (0.005, 0.0005)], [0.30, 0.002])  # the backward's 2×2 fit, noisy
    assert two == pytest.approx((0.302 / 0.0655,) * 2)  # the total over the total, nothing else in either sum


def test_models_use_auto_directly():
    from bhqk.models import common

    assert not hasattr(common, "backend_for")
