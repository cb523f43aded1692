"""bhqk.viz: PNGs of the right size with tokens on the axes, the layers × heads grid, mask drawings,
the self-contained HTML page's data, the bertviz export and ``bhqk show``."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
import torch
from matplotlib.image import imread
from torch import nn

import bhqk
from bhqk import masks, viz
from bhqk.errors import ShapeError
from bhqk.inspect import capture
from bhqk.viz.heatmap import DPI
from bhqk.viz.html import decode_weights, encode_weights

TOKENS = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]


@pytest.fixture(scope="module")
def cap():
    torch.manual_seed(0)
    layers = nn.ModuleList(bhqk.MultiHeadAttention(32, 4) for _ in range(3))
    x = torch.randn(1, len(TOKENS), 32)
    with torch.no_grad(), capture(model=layers) as c:
        for layer in layers:
            x = x + layer(x)  # [B, N, D]
    return c


def png_size(path) -> tuple[int, int]:
    h, w = imread(path).shape[:2]
    return w, h


def assert_figure_size(fig, path) -> None:
    """The PNG is the figure's size in inches × DPI (to a pixel: matplotlib truncates)."""
    w_in, h_in = fig.get_size_inches()
    w, h = png_size(path)
    assert abs(w - w_in * DPI) < 1 and abs(h - h_in * DPI) < 1, (w, h, w_in * DPI, h_in * DPI)


def test_heatmap_png_has_the_figure_size_tokens_colour_bar_and_named_shape(cap, tmp_path):
    fig = viz.heatmap(cap, TOKENS, layer=1, head=2, path=tmp_path / "head.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS  # keys as columns
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS  # queries as rows
    assert len(fig.axes) == 2  # the heatmap and its colour bar
    title = fig._suptitle.get_text()
    assert "layer 1, head 2" in title and "[B=1, H=4, Q=9, K=9]" in title
    assert_figure_size(fig, tmp_path / "head.png")
    w_in, h_in = fig.get_size_inches()
    assert 700 <= w_in * DPI <= 2400 and 600 <= h_in * DPI <= 2400
    shown = ax.images[0].get_array()
    torch.testing.assert_close(torch.tensor(shown.data), cap[1].head(2).float())


def test_heatmap_grows_with_the_sentence_and_labels_captured_rows(tmp_path):
    q, k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    toks = [f"w{i}" for i in range(40)]
    with capture(rows=[3, 7, 8]) as c:
        bhqk.attention(q, k, v)
    small = viz.heatmap(c, toks, head=1)
    assert [t.get_text() for t in small.axes[0].get_yticklabels()] == ["w3", "w7", "w8"]
    with capture() as c2:
        bhqk.attention(q, k, v)
    big = viz.heatmap(c2, toks, head=1)
    assert big.get_size_inches()[1] > small.get_size_inches()[1]
    assert len(big.axes[0].texts) == 0  # too many cells for numbers


def test_heatmap_greys_masked_cells(tmp_path):
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    with capture() as c:
        bhqk.attention(q, k, v, masks.causal(), backend="reference")
    fig = viz.heatmap(c, ["a", "b", "c", "d"])
    arr = fig.axes[0].images[0].get_array()
    assert arr.mask.tolist() == (~torch.ones(4, 4, dtype=torch.bool).tril()).tolist()


def test_grid_is_layers_by_heads(cap, tmp_path):
    fig = viz.grid(cap, path=tmp_path / "grid.png")
    images = [ax for ax in fig.axes if ax.images]
    assert len(images) == 3 * 4
    assert [ax.get_ylabel() for ax in images if ax.get_ylabel()] == ["layer 0", "layer 1", "layer 2"]
    assert [ax.get_title() for ax in images if ax.get_title()] == [f"head {h}" for h in range(4)]
    assert_figure_size(fig, tmp_path / "grid.png")
    w_in, h_in = fig.get_size_inches()
    assert w_in > h_in  # 4 heads across, 3 layers down


def test_mask_drawing_shows_what_may_attend(tmp_path):
    ms = {"causal bottom_right": masks.causal("bottom_right"), "window": masks.sliding_window(1, align="top_left")}
    fig = viz.mask(ms, 4, 6, path=tmp_path / "masks.png")
    drawn = [ax for ax in fig.axes if ax.get_visible()]
    assert len(drawn) == 2 and "[Q=4, K=6]" in drawn[0].get_xlabel()
    for ax, m in zip(drawn, ms.values()):
        want = m.materialize(1, 1, 4, 6)[0, 0].expand(4, 6).int()
        assert torch.tensor(ax.images[0].get_array()).tolist() == want.tolist()
    assert png_size(tmp_path / "masks.png")[0] > 400


def test_to_bertviz_format(cap):
    attention, tokens = viz.to_bertviz(cap, TOKENS)
    assert tokens == TOKENS and len(attention) == 3
    for a, rec in zip(attention, cap):
        assert a.shape == (1, 4, 9, 9) and a.dtype == torch.float32
        torch.testing.assert_close(a.sum(-1), torch.ones(1, 4, 9))
        torch.testing.assert_close(a, rec.weights.float())
    # what bertviz's format_attention does with it: squeeze the batch, stack the layers
    assert torch.stack([a.squeeze(0) for a in attention]).shape == (3, 4, 9, 9)
    with capture(heads=[0]) as part:
        bhqk.attention(torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4))
    with pytest.raises(ValueError, match="every head"):
        viz.to_bertviz(part, TOKENS)
    with pytest.raises(ShapeError, match="tokens has 8 tokens but call '0' has K=9 keys"):
        viz.to_bertviz(cap, TOKENS[:8])


@pytest.mark.parametrize("tokens", [TOKENS[:5], TOKENS + ["extra"]], ids=["too few", "too many"])
def test_pictures_and_page_refuse_a_wrong_number_of_tokens(cap, tmp_path, tokens):
    """One token per query and per key, as cap.summary and to_bertviz demand: a ShapeError naming
    `tokens`, the count the call needs and the count given; nothing drawn, nothing written."""
    want = f"tokens has {len(tokens)} tokens but call '1' has Q=9 queries"
    with pytest.raises(ShapeError, match=want):
        viz.heatmap(cap, tokens, layer=1, head=2, path=tmp_path / "head.png")
    with pytest.raises(ShapeError, match=want.replace("'1'", "'0'")):
        viz.html(cap, tokens, tmp_path / "page.html")
    with pytest.raises(ShapeError, match=f"key_tokens has {len(tokens)} tokens but call '1' has K=9 keys"):
        viz.heatmap(cap, TOKENS, layer=1, key_tokens=tokens)
    with pytest.raises(ShapeError, match=f"key_tokens has {len(tokens)} tokens but call '0' has K=9 keys"):
        viz.html(cap, TOKENS, tmp_path / "page.html", key_tokens=tokens)
    with pytest.raises(ShapeError, match=f"tokens has {len(tokens)} tokens but the weights have Q=9"):
        viz.heatmap(cap[0].weights, tokens)  # a tensor [B, H, Q, K]
    assert list(tmp_path.iterdir()) == []


def test_cross_attention_labels_need_key_tokens(tmp_path):
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)  # Q=3 queries, K=5 keys
    with capture() as c:
        bhqk.attention(q, kv, kv)
    queries, keys = ["a", "b", "c"], ["v", "w", "x", "y", "z"]
    fig = viz.heatmap(c, queries, key_tokens=keys)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == keys
    assert viz.html(c, queries, tmp_path / "p.html", key_tokens=keys).is_file()
    with pytest.raises(ShapeError, match="tokens has 3 tokens but call 'attention.0' has K=5 keys.*key_tokens="):
        viz.heatmap(c, queries)


def test_html_is_self_contained_and_carries_the_weights(cap, tmp_path):
    tricky = TOKENS[:-1] + ["</script><b>x"]
    path = viz.html(cap, tricky, tmp_path / "page.html")
    text = path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing fetched from a network
    assert "<script src" not in text and "@import" not in text
    assert text.count("</script>") == 2  # the data block and the code; the token did not end a script
    blob = re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S).group(1)
    data = json.loads(blob)
    assert data["tokens"] == tricky and len(data["layers"]) == 3
    layer = data["layers"][2]
    assert layer["name"] == "2" and dict(layer["shapes"])["S, P"] == "[B=1, H=4, Q=9, K=9]"
    h3 = layer["heads"][3]
    w = decode_weights(h3["scale"], h3["w"], 9)  # 8 bits per cell: within scale / 510
    torch.testing.assert_close(w, cap[2].head(3).float(), atol=h3["scale"] / 510 + 1e-6, rtol=0)
    assert h3["scale"] == pytest.approx(float(cap[2].head(3).max()))
    assert set(layer["heads"][0]["stats"]) >= {"entropy", "distance", "first"}


def test_weights_travel_in_8_bits_and_masked_rows_are_marked(tmp_path):
    w = torch.softmax(torch.randn(5, 300), -1)  # [r, K]
    w[2] = 0  # a fully masked query row
    scale, text = encode_weights(w)
    assert scale == float(w.max())
    back = decode_weights(scale, text, 300)
    assert back.shape == (5, 300) and float((back - w).abs().max()) <= scale / 510 + 1e-7
    assert back[2].eq(0).all()
    assert encode_weights(torch.zeros(2, 3))[0] == 0.0
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    with capture() as c:
        bhqk.attention(q, k, v, masks.padding(torch.tensor([0])), backend="reference")  # every row masked
    data = viz.html(c, None, tmp_path / "p.html")
    blob = re.search(r'<script id="data" type="application/json">(.*?)</script>', data.read_text(), re.S).group(1)
    assert json.loads(blob)["layers"][0]["heads"][0]["masked"] == [0, 1, 2, 3]


def test_page_assets_are_package_data():
    from importlib import resources

    assets = resources.files("bhqk.viz").joinpath("assets")
    names = {p.name for p in assets.iterdir()}
    assert {"attention.html", "attention.css", "attention.js"} <= names
    template = assets.joinpath("attention.html").read_text()
    assert all(f"${name}" in template for name in ("title", "css", "js", "data"))


def test_viz_imports_no_matplotlib_until_a_picture_is_drawn():
    code = "import sys, bhqk, bhqk.inspect, bhqk.viz; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- bhqk show on the bundled MiniLM -------------------------------------------------------------

def test_show_command_writes_pictures_and_page(tmp_path):
    from bhqk.viz.cli import add_show_parser

    p = argparse.ArgumentParser(prog="bhqk")
    add_show_parser(p.add_subparsers(dest="command"))
    a = p.parse_args(["show", "The cat sat on the mat.", "--layer", "2", "--head", "5", "--out", str(tmp_path / "out")])
    text = a.func(a)
    paths = [tmp_path / "out" / n for n in ("attention.png", "attention_grid.png", "attention.html")]
    for path in paths:
        assert path.is_file() and path.stat().st_size > 1000
        assert str(path) in text
    assert "layer 2 (layers.2.attn), head 5" in text and "[B=1, H=12, Q=9, K=9]" in text
    assert "on [CLS]/[SEP] " in text  # MiniLM's tokenizer has them, and they are in the text
    w, h = png_size(paths[1])
    assert w > h > 500  # 12 heads across, 6 layers down
    a = p.parse_args(["show", "The cat sat on the mat.", "--head", "12", "--out", str(tmp_path / "bad")])
    with pytest.raises(ValueError, match="H=12"):
        a.func(a)
    assert p.parse_args(["show", "x"]).out == "bhqk-show"  # a default folder, as for demo
    a = p.parse_args(["show", "The cat sat on the mat.", "--max-tokens", "5", "--out", str(tmp_path / "cut")])
    text = a.func(a)
    assert text.splitlines()[0] == "input cut: 9 tokens, the first 5 are shown ([SEP] kept at the end; --max-tokens 5)."
    assert "Q=5, K=5" in text and "tokens: [CLS] the cat sat [SEP]" in text
    assert "input cut: 9 tokens" in (tmp_path / "cut" / "attention.html").read_text()
    for bad in ("2", "257"):
        a = p.parse_args(["show", "x", "--max-tokens", bad, "--out", str(tmp_path / "bad")])
        with pytest.raises(ValueError, match="takes 3 … 256 tokens"):
            a.func(a)


def test_special_token_shares_only_for_tokens_that_are_there(tmp_path, monkeypatch):
    """A decoder's text has no [CLS]/[SEP]: neither the page nor ``bhqk show`` reports shares on them."""
    from bhqk.viz import cli as vcli
    from bhqk.viz.html import page_data

    words = ["The", "Ġcat", "Ġsat", "Ġon", "Ġthe", "Ġmat", "."]  # GPT-2's tokens
    q = torch.randn(1, 2, 7, 8)
    with capture() as c:
        bhqk.attention(q, q, q, masks.causal())
    assert set(page_data(c, words)["layers"][0]["heads"][0]["stats"]) == {"entropy", "distance", "first"}
    stats = page_data(c, ["[CLS]"] + words[1:])["layers"][0]["heads"][0]["stats"]
    assert "on [CLS]" in stats and "on [SEP]" not in stats

    def decoder(sentence, model=None, backend="auto", *, max_tokens=None, cut=None, specials=None):
        cut += [7, 7]  # nothing cut; no special token among the words
        return c, words

    monkeypatch.setattr(vcli, "run_sentence", decoder)
    report: list[str] = []
    vcli.show("The cat sat on the mat.", tmp_path, report=report)
    assert "entropy" in report[-1] and "CLS" not in "\n".join(report) and "SEP" not in "\n".join(report)
    assert "[CLS]" not in (tmp_path / "attention.html").read_text()


def test_pick_head_prefers_a_focused_head_that_reads_words():
    from bhqk.inspect.stats import HeadStats
    from bhqk.viz.cli import pick_head

    parked = HeadStats(0, "a", 0, entropy=0.01, distance=3.0, first=0.9, special={"[CLS]": 0.9, "[SEP]": 0.05})
    wordy = HeadStats(0, "a", 1, entropy=0.30, distance=1.0, first=0.1, special={"[CLS]": 0.1, "[SEP]": 0.1})
    vague = HeadStats(1, "b", 0, entropy=1.50, distance=2.0, first=0.1, special={"[CLS]": 0.1, "[SEP]": 0.1})
    assert pick_head([parked, vague, wordy]) is wordy
    assert pick_head([parked]) is parked
