"""explain, trace and the command line."""

from __future__ import annotations

import pytest
import torch

import bhqk
from bhqk import masks
from bhqk.cli import main


def test_explain_walks_every_step_with_named_shapes():
    text = bhqk.explain(B=2, H=8, Q=5, K=7, d=64, Hkv=2)
    assert "[B, H, Q, K]     = [2, 8, 5, 7]" in text
    assert "[B, Hkv, K, d]   = [2, 2, 7, 64]" in text
    assert "[B, Q, H·dv]     = [2, 5, 512]" in text
    assert "cross-attention" in text and "4 query heads per key/value head" in text
    assert text.index("S = Q·Kᵀ") < text.index("softmax") < text.index("O = P·V") < text.index("W_O")


def test_explain_in_chinese_uses_the_seed_names():
    text = bhqk.explain(B=1, H=2, Q=4, K=4, d=3, lang="zh")
    for word in ("批次维度", "注意力头数维度", "查询序列长度", "键序列长度", "自注意力"):
        assert word in text


@pytest.mark.parametrize("lang, word", [("en", "the worked example's sizes"), ("zh", "示例的尺寸")])
def test_explain_without_sizes_walks_the_worked_example(lang, word, capsys):
    """As ``explain --html`` does: no sizes, the worked example (4 tokens of width 3, 2 heads)."""
    assert main(["explain", "--lang", lang]) == 0
    text = capsys.readouterr().out
    assert word in text and "(B=1, H=2, Hkv=2, Q=4, K=4, d=3, dv=3, D=6)" in text
    assert "[B, H, Q, K]     = [1, 2, 4, 4]" in text
    assert text.strip() == bhqk.explain(lang=lang)
    assert main(["explain", "-Q", "1", "-d", "5"]) == 0  # a size left out is the example's: H=2
    assert "(B=1, H=2, Hkv=2, Q=1, K=1, d=5, dv=5, D=10)" in capsys.readouterr().out


def test_explain_flags_d_model_mismatch_and_bad_heads():
    assert "✗" in bhqk.explain(B=1, H=2, Q=4, K=4, d=3, D=8)
    with pytest.raises(bhqk.ShapeError, match="H=6 is not divisible by Hkv=4"):
        bhqk.explain(B=1, H=6, Hkv=4, Q=1, K=1, d=1)


def test_trace_records_named_shapes_and_module_path():
    model = torch.nn.ModuleDict({"enc": bhqk.MultiHeadAttention(16, 4, num_kv_heads=2)})
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    with bhqk.trace(model) as t:
        model["enc"](x, ctx, mask=masks.padding(torch.tensor([5, 2])))
    assert len(t) == 1
    call = t.calls[0]
    assert call.module == "enc"
    assert call.shapes["k"] == "[B=2, Hkv=2, K=5, d=4]" and call.shapes["S, P"] == "[B=2, H=4, Q=3, K=5]"
    assert "padding([5, 2])" in str(t)
    with bhqk.trace() as t2:
        pass
    assert len(t2) == 0  # nothing recorded outside the block
    assert repr(t) == str(t) and "object at" not in repr(t)  # a bare `t` in a notebook shows the calls
    assert "#0 enc" in repr(t) and "k [B=2, Hkv=2, K=5, d=4]" in repr(t) and "x [B=2, Q=3, D=16]" in repr(t)
    assert repr(t2) == "trace: no attention calls recorded"


def test_cli_explain_mask_demo(capsys):
    assert main(["explain", "--batch", "2", "--heads", "8", "--q-len", "5", "--k-len", "7", "--head-dim", "64",
                 "--kv-heads", "2"]) == 0
    assert "[2, 8, 5, 7]" in capsys.readouterr().out
    assert main(["explain", "-H", "2", "-Q", "3", "-d", "4", "--lang", "zh"]) == 0
    assert "查询序列长度" in capsys.readouterr().out
    assert main(["mask", "causal", "--q-len", "4", "--k-len", "6", "--align", "bottom_right"]) == 0
    assert "■ ■ ■ · · ·\n■ ■ ■ ■ · ·" in capsys.readouterr().out
    for kind in ("sliding_window", "padding", "document", "prefix_lm", "full"):
        assert main(["mask", kind]) == 0
        assert "■" in capsys.readouterr().out


def test_cli_demo_prints_the_seed_scores_and_draws(capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for value in ("1.5400", "3.5200", "5.5000", "7.4800", "18.3700", "29.2600", "7.8100"):
        assert value in out  # the first seed's Q·Kᵀ table
    assert "[B=2, H=8, Q=5, K=7]" in out  # the traced multi-head call
    assert max(len(line) for line in out.splitlines()) <= 100  # fits a 100-column terminal, the trace included
    assert (tmp_path / "attention.html").exists() and (tmp_path / "attention.png").exists()
