"""``bhqk stats --model DIR --file text.txt``: the head table printed, overview.png, received.png and
a self-contained stats.html written; the figures' size does not grow with the text's length."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from bhqk.cli import main
from bhqk.inspect.heads import HeadTable
from tolerance import assert_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random Llama with the bundled MiniLM's tokenizer files."""
    from bhqk.models.bert import bundled_model_dir

    folder = tmp_path_factory.mktemp("tiny-llama-stats")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (bundled_model_dir() / name).exists():
            shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


def test_stats_command_prints_the_table_and_writes_pictures_and_a_page(llama_folder, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 40)
    out = tmp_path / "out"
    assert main(["stats", "--model", str(llama_folder), "--file", str(text), "--out", str(out), "--max-tokens", "150"]) == 0
    report = capsys.readouterr().out
    assert "150 tokens (cut from" in report and "2 layers × 4 heads" in report
    rows = [line for line in report.splitlines() if line.startswith("| ") and "model.layers." in line]
    assert len(rows) == 2 * 4  # one row per layer and head
    assert "entropy" in report and "prev" in report
    for name in ("overview.png", "received.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "stats.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "<script" not in page and "http" not in page.replace(
        "http-equiv", "")
    assert page.count("<tr>") >= 1 + 2 * 4


def test_stats_command_errors_are_a_message(llama_folder, tmp_path, capsys):
    assert main(["stats", "--model", str(llama_folder)]) == 2
    assert "--file" in capsys.readouterr().err


def test_pictures_are_bounded_at_any_length():
    from bhqk.viz.stats_page import bin_mean, received_curves, sparkline

    class R:  # a record of 100k keys
        name, real = "layer", torch.ones(1, 2, 5, dtype=torch.bool)
        received = torch.rand(1, 2, 100_000, dtype=torch.float64)

    names, curves, K = received_curves([R()], points=500)
    assert K == 100_000 and curves[0].numel() <= 500
    assert_close(bin_mean(torch.arange(10.0), 5), torch.tensor([0.5, 2.5, 4.5, 6.5, 8.5], dtype=torch.float64), n=2)
    assert len(sparkline(R.received[0, 0])) < 20_000
    t = HeadTable(["a"], 2, {"prev": torch.tensor([[0.9, 0.1]])})
    assert t.roles() == [(0, 0, "prev", float(t["prev"][0, 0]))]  # the table's value itself
