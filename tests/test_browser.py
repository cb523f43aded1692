"""The interactive page in a real headless browser (Debian's Chromium driven by Playwright): it loads
with no console errors, switching head changes what is shown, hovering a token highlights its row,
and a screenshot is kept under artifacts/ (gitignored)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from playwright import sync_api

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("BHQK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if not Path(CHROMIUM).exists():  # a failure, never a skip: `make test` installs Debian's chromium first
    raise RuntimeError(f"no Chromium at {CHROMIUM}: run `make browser` (apt-get install chromium) or set BHQK_CHROMIUM")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    from bhqk.viz.cli import show

    out = tmp_path_factory.mktemp("show")
    report: list[str] = []
    paths = show("The cat sat on the mat.", out, report=report)  # picks the head to open on
    assert "layer 0 (layers.0.attn), head 2" in report[-1]  # MiniLM's previous-token head
    return paths[2]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser, page_file):
    ctx = browser.new_context(viewport={"width": 1400, "height": 900}, device_scale_factor=1)
    pg = ctx.new_page()
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    requests: list[str] = []
    pg.on("request", lambda r: requests.append(r.url))
    pg.goto(page_file.resolve().as_uri())
    pg.wait_for_selector("#heatmap rect.cell")
    pg.problems, pg.requests = problems, requests
    yield pg
    ctx.close()


def weights_shown(pg) -> list[str]:
    return pg.eval_on_selector_all("#heatmap rect.cell", "els => els.map(e => e.getAttribute('data-w'))")


def test_loads_offline_with_no_console_errors(page):
    assert page.problems == []
    assert all(u.startswith(("file:", "data:")) for u in page.requests), page.requests
    shapes = page.inner_text("#shapes")
    assert "[B=1, H=12, Q=9, d=32]" in shapes and "[B=1, H=12, Q=9, K=9]" in shapes
    assert page.locator("#heatmap rect.cell").count() == 81 and page.locator("#lines line.w").count() == 81
    assert page.get_attribute("body", "data-layer") == "0" and page.get_attribute("body", "data-head") == "2"


def test_switching_head_and_layer_changes_what_is_shown(page):
    before = weights_shown(page)
    page.select_option("#head", "5")
    assert page.get_attribute("body", "data-head") == "5"
    after = weights_shown(page)
    assert after != before and len(after) == 81
    assert "h=5" in page.inner_text("#heatmap-title")
    page.select_option("#layer", "3")
    assert page.get_attribute("body", "data-layer") == "3" and weights_shown(page) != after
    page.keyboard.press("ArrowRight")  # next head
    assert page.get_attribute("body", "data-head") == "6"
    page.locator("#overview").scroll_into_view_if_needed()
    box = page.locator("#overview").bounding_box()
    page.mouse.click(box["x"] + box["width"] - 10, box["y"] + box["height"] - 10)  # last layer, last head
    assert (page.get_attribute("body", "data-layer"), page.get_attribute("body", "data-head")) == ("5", "11")
    assert page.problems == []


def test_hovering_a_token_highlights_its_row(page):
    page.hover("[data-testid=q-2]")  # "cat"
    hl = page.eval_on_selector_all("#heatmap rect.cell.hl", "els => els.map(e => e.getAttribute('data-q'))")
    assert hl == ["2"] * 9
    assert page.get_attribute("[data-testid=rowbox]", "visibility") == "visible"
    assert page.get_attribute("[data-testid=rowbox]", "data-q") == "2"
    assert "cat" in page.inner_text("#info")
    # layer 0 head 2 looks at the previous token: "cat" attends to "the"
    assert "attends to: the 1.00" in page.inner_text("#info")
    visible = page.eval_on_selector_all("#lines line.w", "els => els.filter(e => +e.getAttribute('stroke-opacity') > 0).length")
    assert visible <= 9  # only cat's lines remain
    page.hover("[data-testid=row-5]")  # the heatmap's row label for the second "the"
    assert page.eval_on_selector_all("#heatmap rect.cell.hl", "els => els.map(e => e.getAttribute('data-q'))") == ["5"] * 9
    page.click("[data-testid=q-3]")  # pin "sat"
    page.mouse.move(5, 5)
    assert page.get_attribute("[data-testid=rowbox]", "data-q") == "3" and "pinned" in page.inner_text("#info")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "attention_page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    page.keyboard.press("Escape")
    assert page.get_attribute("[data-testid=rowbox]", "visibility") == "hidden"
    assert page.problems == []


def test_views_can_be_switched(page):
    page.click("#views button[data-view=heatmap]")
    assert not page.is_visible("#lines") and page.is_visible("#heatmap")
    page.click("#views button[data-view=lines]")
    assert page.is_visible("#lines") and not page.is_visible("#heatmap")
