"""Fuzzing the command line: random bad argument vectors for every subcommand exit 2 with one
message and no traceback; any size ``bhqk mask`` would refuse to draw is refused before anything
is built (the drawing path is patched to record calls, and Python's allocations are traced)."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bhqk import cli, masks
from test_cli import assert_one_error, run

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

bad_int = st.sampled_from(["-1", "0", "-3", "x", "", "1.5", "nan", "inf", "1e3", "--", "٣"])
bad_nonneg = st.sampled_from(["-1", "-100", "x", "", "1.5", "nan"])
bad_float = st.sampled_from(["nan", "-nan", "inf", "-inf", "-1", "-0.5", "x", "", "1,2"])
bad_list = st.sampled_from(["", ",", "a", "1,b", "1;2", "1.5", " "])
junk = st.text(alphabet="abcxyz-_=", min_size=1, max_size=8).map(lambda s: "--" + s.strip("-") + "zz")


@st.composite
def explain_argv(draw):
    good = {"--heads": "4", "--q-len": "3", "--head-dim": "8"}
    kind = draw(st.sampled_from(["bad value", "not divisible", "junk option", "bad lang"]))  # (a size left out: the example's)
    if kind == "bad value":
        flag = draw(st.sampled_from(["--heads", "--q-len", "--head-dim", "--batch", "--k-len", "--value-dim",
                                     "--kv-heads", "--model-dim"]))
        good[flag] = draw(bad_int)
    elif kind == "not divisible":
        H = draw(st.integers(2, 64))
        good["--heads"], good["--kv-heads"] = str(H), str(draw(st.integers(1, 200).filter(lambda k: H % k)))
    elif kind == "junk option":
        good[draw(junk)] = "1"
    else:
        good["--lang"] = draw(st.sampled_from(["fr", "", "EN"]))
    return ["explain", *(x for kv in good.items() for x in kv)]


@st.composite
def mask_argv(draw):
    kind = draw(st.sampled_from(cli.MASK_KINDS))
    argv = ["mask", kind]
    what = draw(st.sampled_from(["bad size", "bad option", "no align", "bad kind", "doc length", "junk option"]))
    if what == "bad size":
        argv += [draw(st.sampled_from(["--q-len", "-Q", "--k-len", "-K"])), draw(bad_int)]
    elif what == "bad option":
        flag, value = draw(st.sampled_from([("--left", bad_nonneg), ("--right", bad_nonneg), ("--prefix", bad_nonneg),
                                            ("--lengths", bad_list), ("--doc-ids", bad_list), ("--k-doc-ids", bad_list),
                                            ("--align", st.sampled_from(["top", "", "left", "TOP_LEFT"]))]))
        argv += [flag, draw(value)]
    elif what == "no align":
        Q = draw(st.integers(1, 20))
        argv = ["mask", draw(st.sampled_from(["causal", "sliding_window", "prefix_lm"])), "-Q", str(Q),
                "-K", str(draw(st.integers(1, 20).filter(lambda k: k != Q)))]
    elif what == "bad kind":
        argv[1] = draw(st.sampled_from(["", "Causal", "window", "dense", "-1"]))
    elif what == "doc length":
        argv = ["mask", "document", "-Q", str(draw(st.integers(1, 30).filter(lambda q: q != 8)))]
    else:
        argv += [draw(junk)]
    return argv


@st.composite
def generate_argv(draw):
    argv = ["generate", "--model", "/nonexistent/bhqk-model", "--ids", "1,2"]
    flag, value = draw(st.sampled_from([
        ("--temperature", bad_float), ("--top-k", bad_int), ("--max-new-tokens", bad_nonneg), ("-n", bad_nonneg),
        ("--seed", bad_nonneg), ("--eos-id", bad_nonneg), ("--ids", bad_list),
        ("--backend", st.sampled_from(["", "fast", "cuda", "Tiled"])), ("--model", st.just("/nonexistent/bhqk-model")),
    ]))
    argv += [flag, draw(value)]
    if draw(st.booleans()):
        argv = [a for a in argv if a not in ("--model", "/nonexistent/bhqk-model")]  # --model is required
    return argv


@st.composite
def embed_argv(draw):
    what = draw(st.sampled_from(["empty", "suffix", "backend", "none", "junk"]))
    if what == "empty":
        return ["embed", "A sentence.", draw(st.text(alphabet=" \t\n", max_size=3))]
    if what == "suffix":
        return ["embed", "A sentence.", "--out", "vectors" + draw(st.sampled_from([".csv", ".txt", "", ".np", ".jsonl"]))]
    if what == "backend":
        return ["embed", "A sentence.", "--backend", draw(st.sampled_from(["", "gpu", "flash2"]))]
    if what == "none":
        return ["embed"]
    return ["embed", "A sentence.", draw(junk)]


@st.composite
def other_argv(draw):
    return draw(st.sampled_from([
        [], ["nonsense"], ["--nonsense"], ["demo", "--nonsense"], ["demo", "extra"],
        ["show"], ["show", "a", "--out", "x", "--layer", "one"],
        ["show", "a", "--out", "x", "--head", "1.5"], ["show", " "], ["mask"], ["generate"],
        ["calibrate", "--dtype", "int8"], ["calibrate", "--device", "tpu"], ["calibrate", "extra"], ["calibrate", "--flex=1"],
    ]))


@FUZZ
@given(st.one_of(explain_argv(), mask_argv(), generate_argv(), embed_argv(), other_argv()))
def test_bad_argument_vectors_exit_2_with_one_message(argv):
    code, out, err = run(argv)
    command = argv[0] if argv and argv[0] in ("explain", "mask", "demo", "embed", "generate", "show", "calibrate") else ""
    assert_one_error(code, out, err, command)


@FUZZ
@given(kind=st.sampled_from(cli.MASK_KINDS), Q=st.integers(1, 10**6), K=st.integers(1, 10**6) | st.none(),
       B=st.integers(1, 40) | st.integers(1, 1000), big=st.booleans())
def test_sizes_beyond_the_limit_are_refused_before_anything_is_built(monkeypatch, kind, Q, K, B, big):
    if not big:  # also sizes near and under the limit
        Q, K = max(1, Q % 700), None if K is None else max(1, K % 700)
    calls = []
    monkeypatch.setattr(cli, "build_mask", lambda a: calls.append("build") or None)
    monkeypatch.setattr(masks.Mask, "draw", lambda *a, **k: calls.append("draw") or "")
    argv = ["mask", kind, "-Q", str(Q), *(["-K", str(K)] if K else []), "--lengths", ",".join(["2"] * B),
            "--align", "top_left"]
    cells = (B if kind == "padding" else 1) * Q * (K or Q)
    tracemalloc.start()
    try:
        code, out, err = run(argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    too_many = B > cli.MAX_DRAW_BATCH if kind == "padding" else False
    if cells > cli.MAX_DRAW_CELLS or too_many:
        assert_one_error(code, out, err, "mask")
        assert calls == [] and f"{cli.MAX_DRAW_BATCH if too_many else cli.MAX_DRAW_CELLS:,}" in err  # gives the limit
        assert peak < 2**20  # nothing of the drawing's size was allocated (Python allocations traced)
    else:
        assert code == 0, err
        assert calls[:1] == ["build"]


def test_the_fuzz_oracle_sees_a_traceback():
    # guard: the oracle fails on a crash that is not a bhqk error
    with pytest.raises(AssertionError):
        assert_one_error(1, "", "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n", "mask")
