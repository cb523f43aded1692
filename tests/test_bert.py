"""BERT / all-MiniLM-L6-v2 on bhqk equals transformers.BertModel loaded from the same bundled folder."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertModel

from bhqk.models.bert import BertEncoder, SentenceEncoder, bundled_model_dir, cosine_similarity, mean_pool
from bhqk.models.cli import add_embed_parser
from tolerance import assert_close, assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

FF = 1536  # MiniLM's widest sum (its feed-forward width)

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar on a stage while a small crowd sings along.",
    "The stock market fell sharply today.",
    "Hi",
    "A person plays an acoustic guitar.",
]


@pytest.fixture(scope="module")
def folder():
    return bundled_model_dir()


@pytest.fixture(scope="module")
def encoder(folder):
    return SentenceEncoder.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return BertModel.from_pretrained(str(folder)).eval()


def test_bundled_folder_is_found_without_download(folder):
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    c = BertEncoder.from_pretrained().config
    assert (c.num_layers, c.num_heads, c.hidden_size, c.hidden_size // c.num_heads) == (6, 12, 384, 32)


def test_tokenization_equals_transformers(encoder, folder):
    ids, mask = encoder.tokenize(SENTENCES)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ref = tokenizer(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
    assert mask.sum(1).tolist() != [mask.shape[1]] * len(SENTENCES), "the batch must be padded"


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_hidden_states_equal_transformers_padded_batch(encoder, hf, folder, backend):
    ids, mask = encoder.tokenize(SENTENCES)
    model = encoder.model if backend == "auto" else BertEncoder.from_pretrained(folder, backend=backend)
    with torch.no_grad():
        ours = model(ids, mask, output_hidden_states=True)
        ref = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(ours) == len(ref) == 7
    real = mask.bool()
    for layer, (a, b) in enumerate(zip(ours, ref)):
        assert_models_close(a[real], b[real], width=FF, layers=max(layer, 1), msg=f"layer {layer}")


def test_long_padded_batch_equals_transformers(hf):
    """N=100 > 64: the fused path with the padding mask, not the small-problem reference."""
    torch.manual_seed(0)
    model = BertEncoder.from_pretrained()
    ids = torch.randint(1000, 30000, (3, 100))
    mask = torch.ones(3, 100, dtype=torch.long)
    mask[1, 70:] = 0
    mask[2, 9:] = 0
    with torch.no_grad():
        a = model(ids, mask)
        b = hf(ids, attention_mask=mask).last_hidden_state
    assert_models_close(a[mask.bool()], b[mask.bool()], width=FF, layers=6)
    with torch.no_grad():  # unpadded: no mask at all
        a = model(ids)
        b = hf(ids).last_hidden_state
    assert_models_close(a, b, width=FF, layers=6)


def test_sentence_embeddings_equal_transformers_mean_pooling(encoder, hf):
    ids, mask = encoder.tokenize(SENTENCES)
    with torch.no_grad():
        h = hf(ids, attention_mask=mask).last_hidden_state
    m = mask[..., None].float()
    ref = F.normalize((h * m).sum(1) / m.sum(1), dim=-1)  # sentence-transformers: mean pooling, then Normalize
    ours = encoder.encode(SENTENCES)
    assert ours.shape == (len(SENTENCES), 384)
    assert_models_close(ours, ref, width=FF, layers=6)
    assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)), n=384)


def test_batches_of_any_size_give_the_same_embeddings(folder):
    one = SentenceEncoder.from_pretrained(folder, batch_size=2).encode(SENTENCES)
    all_ = SentenceEncoder.from_pretrained(folder, batch_size=32).encode(SENTENCES)
    assert_models_close(one, all_, width=FF, layers=6)


def test_paraphrase_is_more_similar_than_unrelated(encoder):
    sim = cosine_similarity(encoder.encode(SENTENCES))
    assert sim[0, 4] > 0.5 > sim[0, 2]
    assert sim[0, 4] > sim[0, 2] + 0.3
    assert sim[0, 1] > sim[0, 2] and sim[4, 1] > sim[4, 2]


def test_mean_pool_ignores_padding():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    torch.testing.assert_close(mean_pool(h, torch.tensor([[1, 1, 0]])), torch.tensor([[2.0, 3.0]]))


def test_shape_errors_name_the_argument(encoder):
    with pytest.raises(ValueError, match="input_ids must be 2-D"):
        encoder.model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask has"):
        encoder.model(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 6))
    with pytest.raises(ValueError, match="512 positions"):
        encoder.model(torch.zeros(1, 513, dtype=torch.long))


def test_token_ids_are_checked(encoder):
    V = encoder.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids holds token id {V} at \[0, 2\]; .*V={V}"):
        encoder.model(torch.tensor([[101, 7, V]]))
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor.*torch.float32"):
        encoder.model(torch.tensor([[101.0, 7.0]]))
    with pytest.raises(ValueError, match=r"token_type_ids holds token type 2 at \[0, 1\]; type_vocab_size=2"):
        encoder.model(torch.tensor([[101, 7]]), token_type_ids=torch.tensor([[0, 2]]))


def embed_cli(argv):
    p = argparse.ArgumentParser(prog="bhqk")
    sub = p.add_subparsers(dest="command", required=True)
    add_embed_parser(sub)
    a = p.parse_args(argv)
    return a.func(a)


def test_cli_embed_prints_the_similarity_table():
    out = embed_cli(["embed", SENTENCES[0], SENTENCES[4], SENTENCES[2]])
    lines = out.splitlines()
    assert "bundled all-MiniLM-L6-v2" in lines[0]
    assert "[0] A man is playing a guitar." in out
    rows = [line for line in lines if line.startswith("[") and "  " in line and "." in line.split()[-1]]
    values = [[float(x) for x in row.split()[1:]] for row in rows[-3:]]
    assert values[0][0] == pytest.approx(1.0, abs=1e-4)
    assert values[0][1] > values[0][2] and values[0][1] == pytest.approx(values[1][0])


def test_cli_embed_with_a_folder_that_is_not_a_model(tmp_path):
    from bhqk.errors import LoadError

    with pytest.raises(LoadError, match="config.json"):
        embed_cli(["embed", "x", "--model", str(tmp_path)])
