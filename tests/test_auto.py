"""The ``auto`` policy, by structure first: a registered backend that claims a call as exact and
fused (``Backend.share``; the span path per the contract in OWNERS.md is tested here with a fake
one) runs it, the one computing the fewest scores; calls nobody claims are weighed by each
backend's own cost model; the tile plan travels in the Choice; costs are measured per machine,
cached, and fixed in tests so the choices they check do not depend on the machine."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.errors import BackendError
from bhqk.functional import Backend, Estimate, calibrate, costs, prepare, register, registry, tiled, unregister
from conftest import qkv, registry_restored
from tolerance import assert_close


@pytest.fixture
def reference_costs(two_threads):
    with costs.fixed():
        yield


@pytest.fixture
def fake(no_span_path):
    """A backend that computes with the reference, costs what the test says, and refuses on demand."""
    state = {"seconds": 1e-6, "refuse": None, "runs": 0}

    def run(p, need_lse, plan=None):
        state["runs"] += 1
        assert plan == "fake-plan"  # the plan its estimate made reaches its run
        return registry.get("reference").run(p, need_lse)

    register(Backend("fake", run, lambda p, need_lse: state["refuse"],
                     lambda p, grad, c: Estimate(state["seconds"], "fake note", "fake-plan")))
    try:
        yield state
    finally:
        unregister("fake")
    assert "fake" not in bhqk.functional.names()


@pytest.fixture
def spans():
    """A fused backend registered as the contract says the span path will be (``spans.share``: the
    fraction it computes; NaN/inf handed to tiled), computing with the reference."""
    state = {"runs": 0, "refuse": None}

    def run(p, need_lse, plan=None):
        state["runs"] += 1
        return registry.get("reference").run(p, need_lse)

    def share(p, plan=None):  # what a span path skips: the mask's empty 64×64 tiles
        if p.mask is None:
            return 1.0
        m = p.mask.materialize(1, 1, p.ext.Q, p.ext.K)
        return int(m.sum()) / m.numel()

    with registry_restored():  # the real span path again after the test
        register(Backend(name="spans", run=run, why_not=lambda p, need_lse: state["refuse"],
                         hands_off=registry.get("torch").hands_off, traceable=False, share=share))
        yield state


def test_auto_runs_the_real_span_path_where_a_mask_lets_it_skip_and_sdpa_where_nothing_can_be(reference_costs):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32)
    for mask in (masks.sliding_window(16), masks.causal("bottom_right") & masks.padding(200),
                 masks.document(torch.arange(300) // 100)):
        choice = bhqk.choose_backend(q, k, v, mask)
        assert choice.name == "spans" and choice.estimates == {}, choice.reason
        assert choice.reason.startswith("spans: ")
    assert bhqk.choose_backend(q, k, v).name == "torch"
    assert bhqk.choose_backend(q, k, v, masks.causal()).name == "torch"
    assert bhqk.choose_backend(q, k, v, masks.sliding_window(16), softcap=5.0).name == "tiled"  # no softcap in the kernel
    out, lse = bhqk.attention(q, k, v, masks.sliding_window(16), return_lse=True)
    want, want_lse = bhqk.attention(q.double(), k.double(), v.double(), masks.sliding_window(16), backend="reference",
                                    return_lse=True)
    assert_close(out, want, n=300)
    assert_close(lse, want_lse, n=300)


def test_a_fused_backend_named_per_the_contract_is_chosen_by_structure(spans, reference_costs):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32)
    docs = masks.document(torch.arange(300) // 100)
    for mask in (masks.sliding_window(16), masks.causal("bottom_right") & masks.padding(200), docs):
        choice = bhqk.choose_backend(q, k, v, mask)
        assert choice.name == "spans" and choice.estimates == {}, choice.reason  # nothing measured or weighed
        assert choice.reason.startswith("spans: PyTorch's fused kernel computes this call exactly")
    out = bhqk.attention(q, k, v, masks.sliding_window(16), return_lse=True)  # lse: SDPA refuses, the span path takes it
    assert spans["runs"] == 1
    torch.testing.assert_close(out[0], bhqk.attention(q, k, v, masks.sliding_window(16), backend="reference"))
    nothing_to_skip = bhqk.choose_backend(q, k, v)  # equal shares: plain SDPA, registered first
    assert nothing_to_skip.name == "torch" and "spans would compute 100%" in nothing_to_skip.reason
    assert bhqk.choose_backend(q, k, v, masks.causal()).name == "torch"  # is_causal skips as much as a span path
    spans["refuse"] = "the span path refuses"
    choice = bhqk.choose_backend(q, k, v, masks.sliding_window(16))
    assert choice.name != "spans" and "not spans: the span path refuses" in choice.reason and choice.estimates
    assert bhqk.choose_backend(q, k, v, masks.sliding_window(16), softcap=5.0).name == "tiled"  # the kernel has no softcap
    spans["refuse"] = None
    poisoned = v.clone()
    poisoned[0, 0, 3] = float("nan")
    handed = bhqk.choose_backend(q, k, poisoned, masks.sliding_window(16))
    assert handed.name == "tiled" and "spans hands it to tiled" in handed.reason


def test_a_registered_backend_is_weighed_and_wins_when_cheapest(fake, reference_costs):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32)
    choice = bhqk.choose_backend(q, k, v, masks.sliding_window(16))
    assert choice.name == "fake" and set(choice.estimates) >= {"fake", "torch", "tiled"}
    assert choice.reason.startswith("fake: estimated") and "fake note" in choice.reason
    out = bhqk.attention(q, k, v, masks.sliding_window(16))
    assert fake["runs"] == 1
    torch.testing.assert_close(out, bhqk.attention(q, k, v, masks.sliding_window(16), backend="reference"))
    assert bhqk.choose_backend(q, k, v).name == "torch"  # a claim by structure is never weighed against estimates


def test_a_registered_backend_loses_when_dearer_or_refusing(fake, reference_costs):
    q, k, v = qkv(1, 2, None, 300, 300, d=8, dtype=torch.float32)
    fake["seconds"] = 10.0
    choice = bhqk.choose_backend(q, k, v, masks.sliding_window(16))
    assert choice.name != "fake" and choice.estimates["fake"] == 10.0
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
    assert plain.name == "torch" and plain.reason.startswith("torch: PyTorch's fused kernel computes this call exactly, 100%")
    causal = decide(masks.causal())
    assert causal.name == "torch" and "50% of the scores" in causal.reason
    assert decide(lse=True).name == "spans"  # SDPA returns no lse; the span path does, over the whole key range
    assert decide(softcap=30.0).name == "tiled"  # the fused kernel has no softcap
    win = decide(masks.sliding_window(256))
    assert win.name == "spans" and "of the scores" in win.reason
    assert registry.get("spans").share(prepare(q, k, v, masks.sliding_window(256))) < 0.2
    assert decide(masks.sliding_window(256).materialize(1, 1, 4096, 4096)).name == "spans"  # a dense mask is classified too
    assert decide(masks.document(torch.arange(4096) // 512)).name == "spans"
    huge = torch.zeros(1, 1, 8192, 8)
    assert registry.decide(prepare(huge, huge, huge, masks.padding(6000)), False).name == "spans"
    dropping = registry.decide(prepare(huge, huge, huge, dropout_p=0.1), False)
    assert dropping.name == "tiled" and "math path" in dropping.reason  # SDPA's CPU dropout builds [B, H, Q, K]
    assert bhqk.why_not("tiled", huge, huge, huge, dropout_p=0.1) is None
    step = registry.decide(prepare(big[:, :, :1], big[:, :, :256], big[:, :, :256], masks.causal("bottom_right")), False)
    assert step.name == "torch" and "100%" in step.reason  # a decode step: its one query sees every key


def test_tiny_masked_calls_go_to_sdpa_by_estimate(reference_costs, no_span_path):
    q, k, v = qkv(2, 4, 2, 1, 9, d=8, dtype=torch.float32)  # a decode step with a KV cache
    pad = masks.key_padding(torch.tensor([[True] * 9, [False] * 3 + [True] * 6]))
    for mask in (pad, pad & masks.causal("bottom_right")):
        choice = bhqk.choose_backend(q, k, v, mask)
        assert choice.name == "torch" and choice.estimates["torch"] < choice.estimates["tiled"], choice.reason
    torch.testing.assert_close(bhqk.attention(q, k, v, pad), bhqk.attention(q, k, v, pad, backend="reference"))


def test_gradients_are_weighed_and_the_plan_is_reused(reference_costs, no_span_path, monkeypatch):
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


def test_no_backend_possible_names_every_refusal(reference_costs, no_span_path):
    q, k, v = qkv(1, 2, None, 8, 8, d=4, dtype=torch.float32)
    # the real tiled backend again when no_span_path restores the registry
    register(dataclasses.replace(registry.get("tiled"), why_not=lambda p, need_lse: "it refuses for this test"))
    with pytest.raises(BackendError, match="torch: .*log-sum-exp.*tiled: it refuses for this test"):
        bhqk.choose_backend(q, k, v, return_lse=True)


# ---- the costs: measured once per machine (calibrate), kept (costs), overridable ------------------

FAKE = costs.Costs(1e-5, 1e-9, 1e-10, 2.0)


def test_costs_are_cached_per_machine_in_the_file_named_by_the_env(tmp_path, monkeypatch):
    calls = []

    def measure(dev, dt, grad=False, old=None):
        calls.append(grad)
        return dataclasses.replace(old or FAKE, sdpa_backward=4.0, tiled_backward=3.0) if grad else FAKE

    monkeypatch.setattr(calibrate, "measure", measure)
    costs.MEMO.clear()
    path = tmp_path / "costs.json"
    monkeypatch.setenv("BHQK_COSTS", str(path))
    cpu = torch.device("cpu")
    assert calibrate.costs(cpu, torch.float32) == FAKE and calls == [False]
    assert calibrate.costs(cpu, torch.float32) == FAKE and calls == [False]  # in-process memo
    with_grad = calibrate.costs(cpu, torch.float32, grad=True)
    assert (with_grad.sdpa_backward, with_grad.tiled_backward, calls) == (4.0, 3.0, [False, True])
    costs.MEMO.clear()  # a new process: read from the file, nothing measured
    assert calibrate.costs(cpu, torch.float32, grad=True) == with_grad and len(calls) == 2
    data = json.loads(path.read_text())
    (key,) = data
    assert key == costs.machine_key("cpu") and torch.__version__ in key and "float32" in data[key]
    monkeypatch.setenv("BHQK_COSTS", "reference")
    assert calibrate.costs(cpu, torch.bfloat16) == costs.REFERENCE[torch.bfloat16]


def test_measuring_gives_positive_finite_costs(monkeypatch):
    """The real measurement end to end, at sizes small enough for the suite (the production sizes
    only change the numbers)."""
    monkeypatch.setattr(calibrate, "N", 128)
    monkeypatch.setattr(calibrate, "SMALL", 16)
    monkeypatch.setattr(calibrate, "SAMPLE_S", 1e-4)
    c = calibrate.measure(torch.device("cpu"), torch.float32, grad=True)
    for name in ("sdpa_call", "sdpa_elem", "tiled_scale", "sdpa_backward", "tiled_backward"):
        value = getattr(c, name)
        assert math.isfinite(value) and value > 0, (name, value)
    assert c.sdpa_mask_elem >= 0 and c.sdpa_backward >= 1.5


def test_measure_turns_its_timings_into_costs(monkeypatch):
    """The arithmetic of ``measure`` on timings given by the test (real ones differ per machine)."""
    times = {"call": 50e-6, "plain": 30e-3, "mask": 36e-3, "tiled0": 40e-3, "tiled1": 20e-3, "tiled2": 1e-3}
    both = {"plain": 105e-3, "tiled0": 150e-3, "tiled1": 60e-3, "tiled2": 4e-3}
    monkeypatch.setattr(calibrate, "_fastest", lambda fns, device, rounds=5: {k: (both if "plain" in fns and len(fns) == 4
                                                                                  else times)[k] for k in fns})
    monkeypatch.setattr(calibrate, "N", 256)
    monkeypatch.setattr(calibrate, "SMALL", 32)
    cpu, entries = torch.device("cpu"), calibrate.H * 256**2
    c = calibrate.measure(cpu, torch.float32)
    assert c.sdpa_call == 50e-6 and c.sdpa_elem == pytest.approx((30e-3 - 50e-6) / entries)
    assert c.sdpa_mask_elem == pytest.approx(6e-3 / entries) and c.sdpa_backward is None
    b = calibrate.measure(cpu, torch.float32, grad=True, old=c)
    assert b.sdpa_backward == pytest.approx(105e-3 / 30e-3) and b.tiled_backward == pytest.approx(c.tiled_scale * 214 / 61)
    times.update(mask=20e-6, plain=40e-6)  # noise: clamped, never nonsense
    c = calibrate.measure(cpu, torch.float32)
    assert c.sdpa_mask_elem == 0.0 and c.sdpa_elem == pytest.approx(0.1 * 40e-6 / entries)


def test_cli_calibrate_says_what_it_measured_and_where_it_keeps_it(tmp_path, monkeypatch, capsys):
    from bhqk import cli

    monkeypatch.setenv("BHQK_COSTS", str(tmp_path / "costs.json"))
    costs.MEMO.clear()
    monkeypatch.setattr(calibrate, "measure", lambda dev, dt, grad=False, old=None: dataclasses.replace(
        FAKE, sdpa_backward=3.5, tiled_backward=6.0))  # the measuring itself: test_measuring_gives_positive_finite_costs
    assert cli.main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert f"kept in: {tmp_path / 'costs.json'}" in out and "SDPA (float32):  10 µs per call, 1 ns per score entry" in out
    assert "tiled (float32): the tile model × 2.00, forward+backward × 6.00" in out and "flex: not measured" in out
    assert calibrate.costs(torch.device("cpu"), torch.float32, grad=True).tiled_backward == 6.0  # kept
    assert cli.main(["calibrate", "--device", "cuda"] if not torch.cuda.is_available() else ["calibrate", "--dtype", "half"]) == 2


def test_models_use_auto_directly():
    from bhqk.models import common

    assert not hasattr(common, "backend_for")


def test_decisions_are_kept_per_family_and_the_data_is_checked_on_every_call(reference_costs, no_span_path):
    q, k, v = qkv(1, 2, None, 1, 40, d=8, dtype=torch.float32)  # a decode step
    step = masks.causal("bottom_right")
    assert bhqk.choose_backend(q, k, v, step).name == "torch"
    bad = q.clone()
    bad[..., 0] = float("nan")
    handed = bhqk.choose_backend(bad, k, v, step)  # the same structure: the kept claim, its hand-off asked anew
    assert handed.name == "tiled" and "torch hands it to tiled" in handed.reason
    assert torch.isnan(bhqk.attention(bad, k, v, step)).all()
    assert bhqk.choose_backend(q, k, v, step, return_lse=True).name == "tiled"  # another structure
    top = bhqk.choose_backend(q, k, v, masks.causal("top_left"))  # the same sizes, another alignment: not the kept claim
    assert top.name == "torch" and "2% of the scores" in top.reason


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("B,H,Hkv,K", [(2, 6, 2, 9), (1, 6, 3, 1), (3, 4, 1, 7), (0, 6, 2, 5), (2, 6, 2, 0)])
def test_a_gqa_decode_step_runs_the_query_heads_of_a_kv_head_as_one_call_and_equals_the_reference(
        B, H, Hkv, K, layout, monkeypatch):
    import torch.nn.functional as F

    from bhqk.functional import reference

    q, k, v = qkv(B, H, Hkv, 1, K, d=8, dv=5, dtype=torch.float32)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q_, k_, v_, *a, **kw):
        seen.append((tuple(q_.shape), kw.get("enable_gqa", False)))
        return sdpa(q_, k_, v_, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for mask in (None, masks.causal("bottom_right")):  # a decode step: the one query sees every key
        seen.clear()
        args = [t.transpose(1, 2) for t in (q, k, v)] if layout == "bnhd" else [q, k, v]  # [B, N, H, x] in bnhd
        out = bhqk.attention(*args, mask, backend="torch", layout=layout)
        out = out.transpose(1, 2) if layout == "bnhd" else out  # [B, H, 1, dv]
        expected, _ = reference.run(prepare(q.double(), k.double(), v.double(), mask))
        assert out.shape == (B, H, 1, 5)
        assert_close(out, expected, n=K)
        assert seen == [((B, Hkv, H // Hkv, 8), False)]  # [B, Hkv, G, d]: each K/V head read once


def test_decisions_keep_being_kept_past_their_bound(reference_costs, no_span_path, monkeypatch):
    registry.DECISIONS.clear()
    monkeypatch.setattr(registry.DECISIONS, "size", 3)
    step = masks.causal("top_left")  # K is in the key: a new family per step
    for K in range(1, 8):
        q, k, v = qkv(1, 2, None, 1, K, d=8, dtype=torch.float32)
        assert bhqk.choose_backend(q, k, v, step).name == "torch"
        assert len(registry.DECISIONS) <= 3
        p = prepare(q, k, v, step)
        key = registry.family(p.q, p.k, p.v, p.mask, p.scale, p.softcap, p.dropout_p, "bhnd", p.options, False)[0]
        assert registry.DECISIONS.lookup(key) is not None  # this step's decision is kept


def test_a_kept_claim_is_not_reused_for_another_scale():
    """Claims are kept by call structure; SDPA's is_causal cannot take a scale <= 0 (it masks with -inf
    before scaling), so a kept claim of a normal-scale causal call must not answer a scale-0 one."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))  # [B, H, N, d]
    assert bhqk.choose_backend(q, k, v, masks.causal()).name == "torch"
    at_zero = bhqk.choose_backend(q, k, v, masks.causal(), scale=0.0)
    assert not at_zero.reason.startswith("torch: PyTorch's fused kernel computes this call exactly")


def test_a_kept_claim_handed_out_again_cannot_be_changed_by_its_reader():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16)  # a decode step: [B, H, 1, d], [B, H, K, d]
    bhqk.choose_backend(q, k, k, masks.causal("bottom_right"))  # kept by structure
    again = bhqk.choose_backend(q, k, k, masks.causal("bottom_right"))
    with pytest.raises(TypeError):
        again.estimates["fake"] = 1.0  # type: ignore[index]
    assert bhqk.choose_backend(q, k, k, masks.causal("bottom_right")).estimates == {}


def test_a_statistics_capture_gets_the_calls_lse_from_auto_on_the_cpu(monkeypatch):
    """Statistics start from each row's lse: with a capture of statistics active, auto on the CPU runs a
    call that returns it (the span path, from the same kernel call) instead of running the fused
    kernel a second time for it; the output and the statistics are those of the plain call."""
    from bhqk.functional import spans_kernels

    again = []
    fused_lse = spans_kernels.fused_lse
    monkeypatch.setattr(spans_kernels, "fused_lse", lambda *a, **kw: again.append(1) or fused_lse(*a, **kw))
    q, k, v = qkv(1, 4, 2, 64, 64, d=16, dtype=torch.float32)
    plain = bhqk.attention(q, k, v, masks.causal())
    with bhqk.capture(what=("entropy",)) as cap:
        captured = bhqk.attention(q, k, v, masks.causal())
    assert torch.equal(plain, captured)
    assert cap[0].backend == "spans" and again == []
    with bhqk.capture(what=("entropy",)) as named:
        bhqk.attention(q, k, v, masks.causal(), backend="torch")  # a named backend is not changed: the lse is recomputed
    assert named[0].backend == "torch" and again == [1]
    assert_close(cap[0].entropy, named[0].entropy, dtype=torch.float32, n=64)
