"""The page ``bhqk stats`` writes, opened in headless Chromium: both pictures decode, nothing is
fetched from anywhere but the file itself, no console error, the head table has one row per layer
and head, and the page fits the viewport's width."""

from __future__ import annotations

import pytest

from conftest import CHROMIUM
from test_stats_cli import llama_folder  # noqa: F401  (a pytest fixture)

pytestmark = pytest.mark.browser
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_stats_page_in_chromium(llama_folder, tmp_path):  # noqa: F811
    from playwright import sync_api

    from bhqk.viz.stats_cli import run

    _, files = run(llama_folder, "The cat sat on the mat. " * 30, out=tmp_path, max_tokens=120)
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = b.new_context(viewport={"width": 1200, "height": 800}).new_page()
        problems: list[str] = []
        requests: list[str] = []
        pg.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        pg.on("pageerror", lambda e: problems.append(str(e)))
        pg.on("request", lambda r: requests.append(r.url))
        pg.goto(files["page"].resolve().as_uri())
        pg.wait_for_load_state("load")
        widths = pg.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
        rows = pg.eval_on_selector_all("[data-testid=heads] tr", "els => els.length")
        overflow = pg.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        b.close()
    assert len(widths) == 2 and all(done and w > 100 for done, w in widths), widths
    assert rows == 1 + 2 * 4
    assert not problems, problems
    assert all(u.startswith(("file:", "data:")) for u in requests), requests
    assert overflow <= 0
