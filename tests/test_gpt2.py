"""GPT-2 on bhqk equals transformers.GPT2LMHeadModel (random weights, saved and reloaded from a folder)."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bhqk.models.cli import add_generate_parser
from bhqk.models.gpt2 import GPT2, sample
from tolerance import assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

WIDTH, LAYERS = 4 * 64, 3  # the test model's widest sum (its MLP, 4·n_embd) and depth

VOCAB = 300  # 256 byte tokens + merges of the test tokenizer


def train_tokenizer(path, vocab_size=VOCAB):
    """A byte-level BPE tokenizer.json like GPT-2's, trained offline on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the cat sat on the mat", "attention is all you need", "queries keys and values"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=160, n_embd=64, n_layer=3, n_head=4,
                     bos_token_id=0, eos_token_id=1, pad_token_id=0)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    train_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf(folder):
    return GPT2LMHeadModel.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def model(folder):
    return GPT2.from_pretrained(folder)


def left_padded(B=3, N=20, pads=(0, 5, 11), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


def hf_positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("N,backend", [(20, "auto"), (90, "auto"), (20, "reference")])
def test_logits_equal_transformers(folder, model, hf, N, backend):
    ids, _ = left_padded(N=N)
    if backend != "auto":
        model = GPT2.from_pretrained(folder, backend=backend)
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert_models_close(ours, ref, width=WIDTH, layers=LAYERS)


@pytest.mark.parametrize("N,backend", [(20, "auto"), (90, "auto"), (20, "reference")])
def test_logits_equal_transformers_left_padded(folder, model, hf, N, backend):
    ids, mask = left_padded(N=N)
    if backend != "auto":
        model = GPT2.from_pretrained(folder, backend=backend)
    with torch.no_grad():
        ours = model(ids, mask)
        ref = hf(ids, attention_mask=mask, position_ids=hf_positions(mask)).logits
    real = mask.bool()
    assert_models_close(ours[real], ref[real], width=WIDTH, layers=LAYERS)
    assert torch.isfinite(ours).all()


def test_positions_count_real_tokens_only(model):
    """A left-padded row gives the same logits as the same tokens unpadded."""
    ids, mask = left_padded()
    with torch.no_grad():
        padded = model(ids, mask)[2, 11:]
        alone = model(ids[2:, 11:])[0]
    assert_models_close(padded, alone, width=WIDTH, layers=LAYERS)


def test_greedy_generate_equals_transformers(model, hf):
    ids, _ = left_padded(B=2, pads=(0, 0))
    ours = model.generate(ids, 32)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours.shape == (2, 52)
    assert torch.equal(ours, ref)


def test_greedy_generate_left_padded_equals_transformers(model, hf):
    ids, mask = left_padded()
    ours = model.generate(ids, 32, attention_mask=mask)
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_cached_decoding_equals_full_recompute_at_every_step(folder, model, backend):
    if backend != "auto":
        model = GPT2.from_pretrained(folder, backend=backend)
    ids, mask = left_padded(N=12, pads=(0, 4, 7))
    B, N = ids.shape
    cache = model.new_cache(N + 16)
    seq, am = ids, mask
    with torch.no_grad():
        logits = model(seq, am, cache=cache)[:, -1]
        for step in range(16):
            full = model(seq, am)[:, -1]  # [B, V], recomputed from scratch
            assert_models_close(logits, full, width=WIDTH, layers=LAYERS, msg=f"step {step}")
            nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, nxt], 1)
            am = torch.cat([am, torch.ones_like(nxt)], 1)
            logits = model(nxt, am, cache=cache)[:, -1]
    assert cache.length == N + 16


def test_generate_with_and_without_cache_agree(model):
    ids, mask = left_padded(N=10, pads=(0, 3, 6))
    a = model.generate(ids, 12, attention_mask=mask, use_cache=True)
    b = model.generate(ids, 12, attention_mask=mask, use_cache=False)
    assert torch.equal(a, b)


def test_sampling_is_repeatable_and_respects_top_k(model):
    ids, _ = left_padded(B=1, pads=(0,))
    a = model.generate(ids, 10, temperature=1.0, seed=7)
    b = model.generate(ids, 10, temperature=1.0, seed=7)
    assert torch.equal(a, b)
    assert torch.equal(model.generate(ids, 10, temperature=0.8, top_k=1, seed=3), model.generate(ids, 10))
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    draws = {int(sample(logits, 2.0, top_k=2, generator=torch.Generator().manual_seed(s))) for s in range(50)}
    assert draws == {1, 2}


def test_eos_stops_generation(model):
    ids, _ = left_padded(B=1, pads=(0,))
    greedy = model.generate(ids, 8)
    eos = int(greedy[0, 22])  # the third generated token
    out = model.generate(ids, 8, eos_token_id=eos)
    first = (out[0, 20:] == eos).nonzero()[0].item()
    assert out.shape[1] == 20 + first + 1


def test_generate_errors(model):
    ids, _ = left_padded(B=1, pads=(0,))
    with pytest.raises(ValueError, match="positions"):
        model.generate(ids, 200)
    with pytest.raises(ValueError, match="attention_mask has K=3"):
        model(ids, torch.ones(1, 3))


@pytest.mark.parametrize("call, err, match", [
    (lambda m: m(torch.tensor([[1, VOCAB]])), ValueError, rf"input_ids holds token id {VOCAB} at \[0, 1\].*V={VOCAB}"),
    (lambda m: m(torch.tensor([[1, -1]])), ValueError, r"input_ids holds token id -1"),
    (lambda m: m(torch.tensor([[1.0, 2.0]])), ValueError, r"input_ids must be an integer tensor.*torch.float32"),
    (lambda m: m(torch.zeros(1, 0, dtype=torch.long)), ValueError, r"input_ids has N=0 tokens"),
    (lambda m: m([[1, 2]]), TypeError, r"input_ids must be an integer tensor"),
    (lambda m: m(torch.tensor([[1, 2]]), position_ids=torch.tensor([[0, 160]])), ValueError,
     r"position_ids holds position 160 at \[0, 1\]; this GPT-2 has 160 positions"),
    (lambda m: m.generate(torch.tensor([[1, VOCAB + 5]]), 2), ValueError, r"prompt_ids holds token id"),
    (lambda m: m.generate(torch.tensor([[1.0, 2.0]]), 2), ValueError, r"prompt_ids must be an integer tensor"),
    (lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), 2), ValueError, r"prompt_ids is empty \(\[1, 0\]\)"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, temperature=float("nan")), ValueError,
     r"temperature must be a finite number"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, temperature=float("inf")), ValueError,
     r"temperature must be a finite number"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, temperature=-1.0), ValueError, r"temperature must be a finite number >= 0"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, temperature=1.0, top_k=0), ValueError, r"top_k must be an integer >= 1"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, top_k=2.5), ValueError, r"top_k must be an integer >= 1"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2.0), ValueError, r"max_new_tokens must be an integer >= 0"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), -1), ValueError, r"max_new_tokens must be an integer >= 0"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, eos_token_id=VOCAB), ValueError, r"eos_token_id=300 is not a token id"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, seed="x"), TypeError, r"seed must be an integer"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), 2, attention_mask=torch.ones(1, 3)), ValueError, r"attention_mask has"),
])
def test_bad_arguments_name_the_argument(model, call, err, match):
    with pytest.raises(err, match=match):
        call(model)


def test_sample_checks_its_arguments():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, float("nan"))
    with pytest.raises(ValueError, match="top_k"):
        sample(logits, 1.0, top_k=0)
    assert sample(logits, 1.0, top_k=1).tolist() == logits.argmax(-1).tolist()


def generate_cli(argv):
    p = argparse.ArgumentParser(prog="bhqk")
    sub = p.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    a = p.parse_args(argv)
    return a.func(a)


def test_cli_generate_with_ids(folder, model):
    out = generate_cli(["generate", "--model", str(folder), "--ids", "5,6,7,8", "-n", "6"])
    expect = model.generate(torch.tensor([[5, 6, 7, 8]]), 6)[0].tolist()
    assert out == ",".join(map(str, expect))


def test_cli_generate_with_tokenizer(folder, model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = "the cat sat"
    out = generate_cli(["generate", "--model", str(folder), prompt, "-n", "5"])
    ids = tok.encode(prompt).ids
    expect = model.generate(torch.tensor([ids]), 5)[0].tolist()
    assert out.startswith(prompt)
    assert out == tok.decode(ids) + tok.decode(expect[len(ids):])
    shown = generate_cli(["generate", "--model", str(folder), prompt, "-n", "5", "--show-ids"])
    assert shown == ",".join(map(str, expect))


def test_cli_generate_needs_a_prompt_or_ids(folder, tmp_path):
    from bhqk.errors import LoadError

    with pytest.raises(ValueError, match="the prompt is missing"):
        generate_cli(["generate", "--model", str(folder)])
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(LoadError, match="tokenizer.json"):
        generate_cli(["generate", "--model", str(tmp_path), "hello"])


def test_weights_are_stored_input_major_and_loading_keeps_them_so(model, hf):
    """Every block linear and the tied head [out, in] sit in memory as [in, out] (a decode step's
    matrix-vector products stream them faster); loading copies into them, so the layout survives
    and the values are the checkpoint's."""
    weights = [m.weight for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)] + [model.tokens.weight]
    assert len(weights) == 6 * len(model.blocks) + 1
    for w in weights:
        assert w.stride() == (1, w.shape[0])  # [out, in] viewed from [in, out] storage
    torch.testing.assert_close(model.tokens.weight, hf.transformer.wte.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.blocks[0].attn.q_proj.weight, hf.transformer.h[0].attn.c_attn.weight[:, :64].t(),
                               rtol=0, atol=0)
