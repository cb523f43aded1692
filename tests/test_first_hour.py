"""The microscope's first hour (issue 27): each finding of a researcher's first session with a tiny
Llama on ``attn_implementation="bhqk"`` and the bundled MiniLM, as a test. capture and edit are never
silent and share one selection; a head table names the model's layers, exports and plots; ``bhqk
stats`` finds its model, refuses texts it cannot read, and takes its results away; ``detect`` checks
its arguments."""

from __future__ import annotations

import ast
import copy
import csv
import functools
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import bhqk
from bhqk import masks, viz
from bhqk.cli import main
from bhqk.errors import MaskError, ShapeError
from bhqk.inspect import detect
from bhqk.inspect.heads import ROLE_THRESHOLDS, HeadTable, head_table
from bhqk.integrations.transformers import register
from tolerance import assert_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
V = 100
ROOT = Path(__file__).resolve().parents[1]
STATS = ("entropy", "distance", "sink", "received")
HINT = r"register\(\).*set_attn_implementation\(\"bhqk\"\)"


def _llama(attn: str = "bhqk", vocab: int = V) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    m = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    m.set_attn_implementation(attn)
    return m


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, V, (1, 12), generator=torch.Generator().manual_seed(1))


# ---- 1. capture and edit are never silent ------------------------------------------------------------


@pytest.mark.parametrize("case", ["no such layer", "decoder layer", "names without model"])
def test_a_capture_that_selects_nothing_raises_naming_what_it_was_given_and_what_ran(llama, ids, case):
    layers, model, match = {
        "no such layer": (["model.layers.9.self_attn"], llama, r"'model.layers.9.self_attn' matches no module.*"
                                                                 r"model.layers.0.self_attn"),
        "decoder layer": (["model.layers.1"], llama, r"'model.layers.1' matched no attention call.*"
                                                     r"'model.layers.1.self_attn'"),
        "names without model": (["model.layers.1.self_attn"], None, r"module path; pass model="),
    }[case]
    with pytest.raises(ValueError, match=match):
        with torch.no_grad(), bhqk.capture(model=model, layers=layers, what=STATS) as cap:
            llama(ids)
        print(cap)  # on the old code: "Capture(0 of 2 attention calls ...)", an empty head table


def test_capture_edit_and_detect_on_a_model_not_on_bhqk_say_how_to_put_it_there(ids):
    sdpa = _llama("sdpa")
    with pytest.raises(ValueError, match="capture: no attention call ran on bhqk.*" + HINT):
        with torch.no_grad(), bhqk.capture(model=sdpa, what=STATS):
            sdpa(ids)
    with pytest.raises(ValueError, match="edit: no attention call ran on bhqk.*" + HINT):
        with torch.no_grad(), bhqk.edit(model=sdpa, zero=True):
            sdpa(ids)
    given = r"\(given layers=\['model.layers.1.self_attn'\]\)"
    with pytest.raises(ValueError, match="edit: no attention call ran on bhqk inside the block " + given + ".*" + HINT):
        with torch.no_grad(), bhqk.edit(model=sdpa, layers=["model.layers.1.self_attn"], zero=True):
            sdpa(ids)
    with pytest.raises(ValueError, match="detect: no attention call ran on bhqk.*" + HINT):
        detect(sdpa, vocab=V, length=4, batch=1)


def test_a_capture_that_selects_something_is_unchanged(llama, ids):
    with torch.no_grad(), bhqk.capture(model=llama, layers="model.layers.*.self_attn", what=STATS) as cap:
        llama(ids)
    assert [r.name for r in cap] == ["model.layers.0.self_attn", "model.layers.1.self_attn"] and cap.calls == 2


# ---- 2. repr of an edit that holds tensors ---------------------------------------------------------


def test_repr_of_an_edit_holding_tensors(llama, ids):
    sel = dict(model=llama, layers=["model.layers.1.self_attn"])
    Q = ids.shape[1]
    for kw, shown in ((dict(heads=[0], weights=torch.full((Q, Q), 1.0 / Q)), "weights [12, 12]"),
                      (dict(heads=[0], output=torch.zeros(Q, 16)), "output [12, 16]"),
                      (dict(heads=[0, 2], scale=torch.tensor([0.5, 2.0])), "scale [2]"),
                      (dict(heads=[1], scale=torch.tensor(0.5)), "scale=0.5")):
        with torch.no_grad(), bhqk.edit(**sel, **kw) as e:
            llama(ids)
        text = repr(e)  # the old code: RuntimeError, Boolean value of Tensor with more than one value is ambiguous
        assert shown in text and "1 calls edited" in text, text


# ---- 3, 4, 10. bhqk stats finds its model and refuses what it cannot read ---------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random Llama on disk with the bundled MiniLM's tokenizer files."""
    from bhqk.models.bert import bundled_model_dir

    folder = tmp_path_factory.mktemp("tiny-llama-first-hour")
    _llama(vocab=30522).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (bundled_model_dir() / name).exists():
            shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


def test_stats_without_model_reads_the_bundled_minilm(tmp_path, capsys):
    assert main(["stats", "The cat sat on the mat.", "--out", str(tmp_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "all-MiniLM-L6-v2 (bundled): 9 tokens, 6 layers × 12 heads" in out
    assert "encoder.layer.0.attention.self" in out


def test_a_folder_without_tokenizer_files_is_an_error_the_cli_user_can_act_on(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert main(["stats", "--model", str(tmp_path), "some text here", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer files" in err and "copy the tokenizer files" in err  # before the (absent) weights load
    assert "token ids" not in err  # the old advice, which a command-line user cannot take


@pytest.mark.parametrize("text", ["", "   ", "\n", "a"])
def test_empty_blank_or_too_short_text_is_an_error_naming_the_minimum(llama_folder, tmp_path, capsys, text):
    f = tmp_path / "text.txt"
    f.write_text(text)
    assert main(["stats", "--model", str(llama_folder), "--file", str(f), "--out", str(tmp_path / "o")]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_file_that_is_not_utf8_names_the_file(tmp_path, capsys):
    f = tmp_path / "binary.txt"
    f.write_bytes(b"\xff\xfe\x00\x81 text")
    assert main(["stats", "--file", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and "not UTF-8" in err


def test_window_0_is_reported_as_the_flag(capsys):
    with pytest.raises(SystemExit) as e:  # refused when the flags are parsed, as every bad option is
        main(["stats", "--window", "0", "some text"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--window" in err and "capture:" not in err


# ---- 5. sink is P on each row's first key that row may attend ---------------------------------------


def test_sink_is_the_first_real_key_of_a_left_padded_row(llama):
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :4] = 0  # row 1: 4 left pads, its first real key is 4
    with torch.no_grad(), bhqk.capture(model=llama, what=STATS) as cap:
        llama(input_ids=ids, attention_mask=am)
    eager = _llama("eager")
    with torch.no_grad():
        P = eager(input_ids=ids, attention_mask=am, output_attentions=True).attentions  # L × [B, H, Q, K]
    for rec, p in zip(cap, P):
        real = rec.real  # [B, H, Q]
        assert_close(rec.sink[0][real[0]], p[0, :, :, 0][real[0]].to(rec.sink.dtype), n=12)
        assert_close(rec.sink[1][real[1]], p[1, :, :, 4][real[1]].to(rec.sink.dtype), n=12)  # old: 0.000 (a pad)
        assert bool((rec.sink[1][real[1]] > 0).all())
    table = cap.head_table()
    want = torch.stack([(p[0, :, :, 0].sum(-1) + p[1, :, 4:, 4].sum(-1)) / (12 + 8) for p in P]).double()  # [L, H]
    assert_close(table["sink"].float(), want.float(), n=20)  # the records' float32 values, averaged


# ---- 6. the head table names the model's layers ----------------------------------------------------


def test_head_table_rows_carry_the_models_layer_index_and_path(llama, ids):
    with torch.no_grad(), bhqk.capture(model=llama, layers=["model.layers.1.self_attn"], what=STATS, offsets=(1,)) as cap:
        llama(ids)
    t = cap.head_table()
    assert t.layers == ["model.layers.1.self_attn"] and t.ids == [1]
    top = t.top("sink", 1)[0]
    assert (top.layer, top.name) == (1, "model.layers.1.self_attn")  # old: layer 0, the row number
    assert all(r.layer == 1 and r.name == "model.layers.1.self_attn" for r in t.roles(thresholds={"sink": 0.0}))
    assert "top sink: L1.H" in repr(t)
    assert all(row[0] == 1 for row in t.rows()) and str(t).splitlines()[2].startswith("| 1 ")


# ---- 7. one head-statistics API ---------------------------------------------------------------------


def test_stats_and_summary_of_a_streaming_capture_go_to_the_head_table(llama, ids):
    with torch.no_grad(), bhqk.capture(model=llama, what=STATS) as cap:
        llama(ids)
    assert cap.summary() == str(cap.head_table())  # a view of the one table
    with pytest.raises(KeyError, match=r"cap.head_table\(\)") as e:
        cap.stats()
    assert "'weights'" not in str(e.value)  # never steered to the O(Q·K) path


# ---- 8. take it away --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streamed(llama, ids):
    with torch.no_grad(), bhqk.capture(model=llama, what=STATS, offsets=(1,), window=3) as cap:
        llama(ids)
    return cap


def test_head_table_to_json_from_json_to_csv_and_rows_of_numbers(streamed, tmp_path):
    t = streamed.head_table(positions=(0, 5))
    back = HeadTable.from_json(t.to_json(tmp_path / "t.json"))
    assert back.layers == t.layers and back.ids == t.ids and back.columns == t.columns
    for c in t.columns:
        assert torch.equal(back[c], t[c].double())  # exact: float64 through JSON
    assert HeadTable.from_json(tmp_path / "t.json").to_dict() == t.to_dict()
    rows = t.rows()
    assert all(isinstance(x, float) for r in rows for x in r[3:])  # old: strings "0.123"
    lines = list(csv.reader(io.StringIO(t.to_csv(tmp_path / "t.csv"))))
    assert lines[0] == ["layer", "name", "head", *t.columns] and len(lines) == 1 + 2 * 4
    assert float(lines[1][3]) == rows[0][3] and (tmp_path / "t.csv").read_text() == t.to_csv()


def test_records_save_and_load(streamed, tmp_path):
    from bhqk.inspect.capture import load_records

    path = streamed.save(tmp_path / "records.pt")
    recs = load_records(path)
    assert [r.name for r in recs] == [r.name for r in streamed]
    for a, b in zip(recs, streamed):
        assert torch.equal(a.entropy, b.entropy) and torch.equal(a.offset(1), b.offset(1))
    assert head_table(recs).to_dict() == streamed.head_table().to_dict()
    (tmp_path / "junk.pt").write_bytes(b"not a file of records")
    with pytest.raises(ValueError, match="junk.pt"):
        load_records(tmp_path / "junk.pt")


def test_plotting_api(streamed, tmp_path):
    tokens = [f"t{i}" for i in range(12)]
    t = streamed.head_table()
    assert viz.overview_png(t, tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"
    assert viz.received_png(streamed.records, tmp_path / "r.png", tokens=tokens).read_bytes()[:4] == b"\x89PNG"
    peaks = viz.received_peaks(streamed.records, tokens, 3)
    curve = torch.stack([r.received.double().sum((0, 1)) / r.real.sum() for r in streamed]).mean(0)  # [K]
    assert [k for k, _, _ in peaks] == curve.topk(3).indices.tolist() and peaks[0][1] == tokens[peaks[0][0]]
    pos, vals = viz.head_series(streamed.records, 1, 2, "entropy")
    assert pos.tolist() == list(range(12)) and torch.equal(vals, streamed[1].entropy[0, 2].double())
    assert viz.head_png(streamed.records, "model.layers.0.self_attn", 3, tmp_path / "h.png", "prev",
                        tokens=tokens).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(KeyError, match="no captured layer 7"):
        viz.head_series(streamed.records, 7, 0)


def test_stats_cli_json_csv_top_and_no_duplicate_column(llama_folder, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 120)  # ~720 tokens: more than the tokenizer's 512
    js, cs = tmp_path / "t.json", tmp_path / "t.csv"
    assert main(["stats", "--model", str(llama_folder), "--file", str(text), "--out", str(tmp_path / "o"),
                 "--max-tokens", "64", "--json", str(js), "--csv", str(cs), "--top", "2"]) == 0
    out, err = capsys.readouterr()
    table = HeadTable.from_json(js)
    assert table.ids == [0, 1] and "received@0" not in table.columns and "received@0" not in out
    assert len(cs.read_text().splitlines()) == 1 + 2 * 4
    assert "| column" in out and len([ln for ln in out.splitlines() if ln.startswith("| sink ")]) == 2
    assert "longer than the specified maximum" not in err  # bhqk cuts the text; the tokenizer's warning is noise


def test_progress_bars_on_stats_and_detect(llama_folder, llama, tmp_path, capsys, monkeypatch):
    import bhqk.console

    monkeypatch.setattr(bhqk.console, "progress_enabled", lambda: True)  # as on a terminal
    assert main(["stats", "--model", str(llama_folder), "some words to read here", "--out", str(tmp_path)]) == 0
    assert "bhqk stats" in capsys.readouterr().err
    detect(llama, vocab=V, length=4, batch=1, progress=True)
    assert "detect (repeated)" in capsys.readouterr().err


# ---- 9. detect checks its arguments; thresholds ------------------------------------------------------


def test_detect_checks_vocab_length_and_runs_once(llama):
    with pytest.raises(ValueError, match=r"vocab=1000 but the model's input embedding has 100 rows"):
        detect(llama, vocab=1000)  # old: IndexError: index out of range in self
    for bad in (0, 1):
        with pytest.raises(ValueError, match=f"length must be a whole number >= 2, got {bad}"):
            detect(llama, vocab=V, length=bad)  # old: a reshape error
    t = detect(llama, vocab=V, length=4, batch=2)  # the module is the model: no model=model
    assert t.layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_roles_thresholds_override_only_what_they_name():
    t = HeadTable(["blocks.0"], 2, {"sink": torch.tensor([[0.4, 0.1]]), "prev": torch.tensor([[0.1, 0.9]])})
    assert [(r.head, r.role) for r in t.roles()] == [(1, "prev")]
    assert [(r.head, r.role) for r in t.roles(thresholds={"sink": 0.3})] == [(0, "sink"), (1, "prev")]  # old: prev dropped
    with pytest.raises(KeyError, match="no role or column"):
        t.roles(thresholds={"snk": 0.3})
    doc = (ROOT / "docs" / "heads.md").read_text()
    assert all(f"`{role}`" in doc and str(v) in doc for role, v in ROLE_THRESHOLDS.items())


def test_the_docs_call_detect_once():
    for doc in (ROOT / "README.md", ROOT / "docs" / "heads.md"):
        assert not re.search(r"detect\(model,[^)]*model=model", doc.read_text()), doc


# ---- 10. the smaller ones ------------------------------------------------------------------------------


def test_capture_and_edit_share_one_selection_and_one_set_of_errors(llama, ids):
    with torch.no_grad(), bhqk.edit(model=llama, layers="model.layers.1.self_attn", heads=3, zero=True) as e:
        a = llama(ids).logits  # old: TypeError: 'int' object is not iterable
    with torch.no_grad(), bhqk.edit(model=llama, layers=["model.layers.1.self_attn"], heads=[3], zero=True):
        b = llama(ids).logits
    assert e.heads == [3] and torch.equal(a, b)
    with torch.no_grad(), bhqk.capture(model=llama, layers="model.layers.1.self_attn", heads=3) as cap:
        llama(ids)
    assert cap.records[0].heads == [3]
    for bad in ([-1], "3", [1.5], True, []):
        errors = []
        for make in (bhqk.capture, functools.partial(bhqk.edit, zero=True)):
            with pytest.raises(ValueError) as ex:  # old: capture gave IndexError for [-1] (at the first call)
                make(model=llama, heads=bad).__enter__()
            errors.append(str(ex.value).split(": ", 1)[1])
        assert errors[0] == errors[1], errors
    for make in (bhqk.capture, functools.partial(bhqk.edit, zero=True)):
        with pytest.raises(ShapeError, match=r"heads \[7\] out of range for 'model.layers.0.self_attn', which has H=4"):
            with torch.no_grad(), make(model=llama, heads=[7]):
                llama(ids)


def test_edit_rejects_a_nan_scale_and_a_knockout_beyond_the_keys(llama, ids):
    for scale in (float("nan"), float("inf"), torch.tensor([1.0, float("nan")])):
        with pytest.raises(ShapeError, match="scale must be finite"):
            bhqk.edit(model=llama, heads=[0, 1], scale=scale).__enter__()
    with pytest.raises(MaskError, match=r"key_span\(50, 60\) changed nothing.*K=12"):
        with torch.no_grad(), bhqk.edit(model=llama, heads=[0], mask=masks.key_span(50, 60)):
            llama(ids)
    with torch.no_grad(), bhqk.edit(model=llama, heads=[0], mask=masks.key_span(0, 1)) as e:
        llama(ids)
    assert len(e.hits) == 2


def test_head_table_position_beyond_the_keys_is_an_error(streamed):
    with pytest.raises(ValueError, match=r"positions \[50\] lie beyond every captured call's keys \(K ≤ 12"):
        streamed.head_table(positions=(50,))  # old: the column silently missing
    assert "received@11" in streamed.head_table(positions=(11,)).columns


def test_weights_under_generate_say_it_is_a_decode_step(llama, ids):
    Q = ids.shape[1]
    with pytest.raises(ShapeError, match="is a decode step"):
        with torch.no_grad(), bhqk.edit(model=llama, layers=["model.layers.0.self_attn"], heads=[0],
                                        weights=torch.full((Q, Q), 1.0 / Q)):
            llama.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


# ---- issue 25, item 5: inspect does not reach up into viz ------------------------------------------------


def test_inspect_does_not_import_viz():
    import bhqk.inspect

    for path in Path(bhqk.inspect.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "viz" not in (node.module or "").split("."), f"{path.name} imports {node.module}"
