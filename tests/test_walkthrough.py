"""``bhqk explain --html``: the walkthrough page draws every step with bhqk's own numbers and named
shapes, in English and Chinese; in Chromium the toggle works, every step is shown, nothing is
fetched, and a screenshot is kept under artifacts/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import bhqk
from bhqk.cli import main
from bhqk.viz import walkthrough
from conftest import CHROMIUM

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def cells(page: str, testid: str) -> list[str]:
    table = re.search(rf'<table class="m[^"]*" data-testid="{testid}">(.*?)</table>', page, re.S).group(1)
    return re.findall(r"<td[^>]*>([^<]*)</td>", table)


def test_worked_example_by_default_every_step_with_numbers_and_shapes():
    page = walkthrough.build()
    for step in walkthrough.STEPS:
        assert f'id="step-{step}"' in page
    assert cells(page, "m-s")[:4] == ["1.5400", "3.5200", "5.5000", "7.4800"]  # S = Q·Kᵀ, first row
    assert cells(page, "m-s")[7] == "18.3700" and len(cells(page, "m-s")) == 16  # the 4×4 table
    assert "[Q=4, K=4]" in page and "[d=3, K=4]" in page and "[Q=4, H·dv=6]" in page
    q = torch.tensor(walkthrough.EXAMPLE_Q, dtype=torch.float64)[None, None]  # [1, 1, 4, 3]
    k = torch.tensor(walkthrough.EXAMPLE_K, dtype=torch.float64)[None, None]
    P = bhqk.attention_weights(q, k, bhqk.masks.causal(), scale=3 ** -0.5)[0, 0]  # [Q, K]
    assert cells(page, "m-p") == [f"{x:.4f}" for x in P.flatten().tolist()]
    assert cells(page, "m-masked")[1] == "−∞"  # q1 may not look at k2
    assert cells(page, "m-omerged")[:3] == cells(page, "m-ohead-0")[:3]  # head 0 first in the merged row
    assert cells(page, "m-omerged")[3:6] == cells(page, "m-ohead-1")[:3]
    for i in range(4):
        assert f'data-testid="p-row-{i}"' in page
    assert "注意力，逐步计算" in page and "拆分多头" in page and "合并多头" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)


def test_sizes_as_flags_and_limits(tmp_path, capsys):
    out = tmp_path / "w.html"
    assert main(["explain", "--html", str(out), "-H", "3", "-Q", "2", "-K", "5", "-d", "2", "--value-dim", "4"]) == 0
    assert str(out) in capsys.readouterr().out
    page = out.read_text()
    assert "B=1, H=3, Q=2, K=5, d=2, dv=4" in page and "causal (bottom_right)" in page
    assert len(cells(page, "m-s")) == 10 and len(cells(page, "m-omerged")) == 2 * 12
    assert main(["explain", "--html", str(tmp_path / "zh.html"), "--lang", "zh"]) == 0
    assert 'data-ui="zh"' in (tmp_path / "zh.html").read_text()
    with pytest.raises(ValueError, match="Q=40 must be 1 … 12"):
        walkthrough.build(Q=40)
    assert main(["explain", "--html", str(tmp_path / "x.html"), "--kv-heads", "1", "-H", "2"]) == 2
    capsys.readouterr()
    assert main(["explain", "-H", "3"]) == 0  # the text walk-through too: sizes left out are the example's
    assert "(B=1, H=3, Hkv=3, Q=4, K=4, d=3, dv=3, D=9)" in capsys.readouterr().out


@pytest.mark.browser
def test_walkthrough_in_chromium_toggle_and_every_step(tmp_path):
    from playwright import sync_api

    path = walkthrough.write(tmp_path / "walkthrough.html")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            pg = b.new_page(viewport={"width": 1400, "height": 900})
            problems, requests = [], []
            pg.on("pageerror", lambda e: problems.append(str(e)))
            pg.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            pg.on("request", lambda r: requests.append(r.url))
            pg.goto(path.as_uri())
            for step in walkthrough.STEPS:
                assert pg.is_visible(f"[data-testid=step-{step}]")
            assert pg.locator("[data-testid^=p-row-]").count() == 4
            assert "S = Q·Kᵀ: every query against every key" in pg.inner_text("#step-s")
            assert pg.evaluate("document.documentElement.scrollWidth") <= 1400
            ARTIFACTS.mkdir(exist_ok=True)
            pg.screenshot(path=str(ARTIFACTS / "walkthrough.png"), full_page=True)
            pg.click("#lang button[data-set=zh]")
            text = pg.inner_text("#step-s")
            assert "每个查询与每个键两两打分" in text and "every query against every key" not in text
            assert pg.get_attribute("html", "lang") == "zh-CN"
            pg.click("#lang button[data-set=en]")
            assert "every query against every key" in pg.inner_text("#step-s")
            assert problems == [] and all(u.startswith("file:") for u in requests), (problems, requests)
        finally:
            b.close()
