"""Key tables and the strict loader: pure remaps, clear LoadErrors that name the key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2LMHeadModel

from bhqk import models
from bhqk.errors import LoadError
from bhqk.models import GPT2, BertEncoder, remap_bert, remap_gpt2
from bhqk.models.loading import BERT_TABLE, checkpoint_key
from tolerance import assert_models_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=40)
    path = tmp_path_factory.mktemp("bert")
    BertModel(cfg).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    return path


def copy_with(src, dst, edit=None, config=None):
    """A copy of a model folder whose weights pass through ``edit(state_dict)``."""
    shutil.copytree(src, dst)
    if edit is not None:
        sd = load_file(dst / "model.safetensors")
        edit(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        c.update(config)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


# --- the key tables are pure -------------------------------------------------------------------

def test_remap_bert_is_pure_and_drops_the_pooler(bert_dir):
    sd = load_file(bert_dir / "model.safetensors")
    before = {k: v.clone() for k, v in sd.items()}
    out = remap_bert(sd)
    assert sd.keys() == before.keys() and all(torch.equal(sd[k], before[k]) for k in sd)
    assert "layers.1.attn.q_proj.weight" in out and "embeddings.norm.bias" in out
    assert not any(k.startswith("pooler") for k in out)
    assert torch.equal(out["layers.0.ff_in.weight"], sd["encoder.layer.0.intermediate.dense.weight"])
    assert set(out) == set(BertEncoder.from_pretrained(bert_dir).state_dict())


def test_remap_bert_old_names_and_prefix():
    sd = {"bert.embeddings.LayerNorm.gamma": torch.ones(3), "bert.encoder.layer.2.output.LayerNorm.beta": torch.zeros(3),
          "cls.predictions.bias": torch.zeros(5)}
    assert set(remap_bert(sd)) == {"embeddings.norm.weight", "layers.2.ff_norm.bias"}


def test_remap_gpt2_transposes_conv1d_and_splits_c_attn(gpt2_dir):
    sd = load_file(gpt2_dir / "model.safetensors")
    out = remap_gpt2(sd)
    D = 32
    c_attn = sd["transformer.h.1.attn.c_attn.weight"]  # Conv1D: [D, 3D] = [in, out]
    assert c_attn.shape == (D, 3 * D)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        torch.testing.assert_close(out[f"blocks.1.attn.{name}.weight"], c_attn[:, i * D : (i + 1) * D].T)
        torch.testing.assert_close(out[f"blocks.1.attn.{name}.bias"], sd["transformer.h.1.attn.c_attn.bias"][i * D : (i + 1) * D])
    torch.testing.assert_close(out["blocks.0.ff_in.weight"], sd["transformer.h.0.mlp.c_fc.weight"].T)
    assert out["blocks.0.ff_in.weight"].shape == (4 * D, D)
    assert set(out) == set(GPT2.from_pretrained(gpt2_dir).state_dict())


def test_reverse_table_names_checkpoint_keys():
    assert checkpoint_key("layers.3.attn.q_proj.weight", BERT_TABLE) == "encoder.layer.3.attention.self.query.weight"
    assert checkpoint_key("embeddings.norm.bias", BERT_TABLE, "bert.") == "bert.embeddings.LayerNorm.bias"


# --- loading folders -----------------------------------------------------------------------------

def test_any_bert_folder_matches_transformers(bert_dir):
    hf = BertModel.from_pretrained(bert_dir).eval()
    ours = BertEncoder.from_pretrained(bert_dir)
    ids = torch.randint(0, 120, (2, 9))
    mask = torch.tensor([[1] * 9, [1] * 4 + [0] * 5])
    with torch.no_grad():
        a, b = ours(ids, mask), hf(ids, attention_mask=mask).last_hidden_state
    assert_models_close(a[mask.bool()], b[mask.bool()], width=64, layers=2)  # intermediate_size, num_hidden_layers


def test_bert_task_model_with_prefix_loads(tmp_path):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16)
    hf = BertForMaskedLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = BertEncoder.from_pretrained(tmp_path)
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        ref = hf.bert(ids).last_hidden_state
    assert_models_close(ours(ids), ref, width=32, layers=1)


def test_pytorch_model_bin_loads(gpt2_dir, tmp_path):
    dst = tmp_path / "bin"
    shutil.copytree(gpt2_dir, dst)
    torch.save(load_file(dst / "model.safetensors"), dst / "pytorch_model.bin")
    (dst / "model.safetensors").unlink()
    a, b = GPT2.from_pretrained(dst), GPT2.from_pretrained(gpt2_dir)
    ids = torch.randint(0, 100, (1, 6))
    torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)


def test_load_dispatches_on_model_type(bert_dir, gpt2_dir):
    assert isinstance(models.load(bert_dir), BertEncoder)
    assert isinstance(models.load(gpt2_dir), GPT2)


# --- errors name the key --------------------------------------------------------------------------

def test_missing_key(bert_dir, tmp_path):
    key = "encoder.layer.1.attention.self.query.weight"
    d = copy_with(bert_dir, tmp_path / "m", edit=lambda sd: sd.pop(key))
    with pytest.raises(LoadError, match="missing keys") as e:
        BertEncoder.from_pretrained(d)
    assert key in str(e.value) and "unexpected" not in str(e.value)


def test_missing_gpt2_key_names_the_fused_checkpoint_key(gpt2_dir, tmp_path):
    d = copy_with(gpt2_dir, tmp_path / "m", edit=lambda sd: sd.pop("transformer.h.1.attn.c_attn.weight"))
    with pytest.raises(LoadError, match=r"missing keys.*transformer\.h\.1\.attn\.c_attn\.weight"):
        GPT2.from_pretrained(d)


def test_wrong_shape(bert_dir, tmp_path):
    key = "embeddings.position_embeddings.weight"
    d = copy_with(bert_dir, tmp_path / "s", edit=lambda sd: sd.update({key: sd[key][:30]}))
    with pytest.raises(LoadError, match="wrong shapes") as e:
        BertEncoder.from_pretrained(d)
    msg = str(e.value)
    assert key in msg and "embeddings.position.weight" in msg and "[30, 32]" in msg and "[40, 32]" in msg


def test_wrong_shape_gpt2_conv1d(gpt2_dir, tmp_path):
    key = "transformer.h.0.mlp.c_proj.weight"
    d = copy_with(gpt2_dir, tmp_path / "s", edit=lambda sd: sd.update({key: sd[key][:, :16]}))
    with pytest.raises(LoadError, match="wrong shapes") as e:
        GPT2.from_pretrained(d)
    line = next(x for x in str(e.value).splitlines() if key in x)
    assert "[128, 16]" in line and "blocks.0.ff_out.weight needs [32, 128]" in line  # Conv1D [in, out] as stored
    key = "transformer.h.0.attn.c_attn.weight"
    d = copy_with(gpt2_dir, tmp_path / "t", edit=lambda sd: sd.update({key: sd[key][:, :95]}))
    with pytest.raises(LoadError, match=r"transformer\.h\.0\.attn\.c_attn\.weight.*\[32, 95\]"):
        GPT2.from_pretrained(d)
    d = copy_with(gpt2_dir, tmp_path / "u", edit=lambda sd: sd.update({key: sd[key][:, :90]}))  # splits, wrong size
    with pytest.raises(LoadError, match="wrong shapes") as e:
        GPT2.from_pretrained(d)
    assert str(e.value).count(key) == 1 and "[32, 90]" in str(e.value)


def test_unexpected_key(gpt2_dir, tmp_path):
    d = copy_with(gpt2_dir, tmp_path / "u", edit=lambda sd: sd.update({"transformer.h.0.attn.rotary.inv_freq": torch.ones(4)}))
    with pytest.raises(LoadError, match=r"unexpected keys.*transformer\.h\.0\.attn\.rotary\.inv_freq"):
        GPT2.from_pretrained(d)


def test_untied_lm_head_is_refused(gpt2_dir, tmp_path):
    d = copy_with(gpt2_dir, tmp_path / "h", edit=lambda sd: sd.update({"lm_head.weight": torch.randn(100, 32)}))
    with pytest.raises(LoadError, match="lm_head.weight"):
        GPT2.from_pretrained(d)


@pytest.mark.parametrize("loader", [GPT2.from_pretrained, BertEncoder.from_pretrained, models.load])
def test_unknown_architecture(gpt2_dir, tmp_path, loader):
    d = copy_with(gpt2_dir, tmp_path / "a", config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(LoadError, match="unknown architecture.*'llama'"):
        loader(d)


def test_wrong_family(bert_dir):
    with pytest.raises(LoadError, match="model_type='bert'.*'gpt2'"):
        GPT2.from_pretrained(bert_dir)


def test_unsupported_config_options(gpt2_dir, bert_dir, tmp_path):
    d = copy_with(gpt2_dir, tmp_path / "c", config={"scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(LoadError, match="scale_attn_by_inverse_layer_idx"):
        GPT2.from_pretrained(d)
    d = copy_with(bert_dir, tmp_path / "r", config={"position_embedding_type": "relative_key"})
    with pytest.raises(LoadError, match="relative_key"):
        BertEncoder.from_pretrained(d)
    d = copy_with(bert_dir, tmp_path / "g", config={"hidden_act": "mystery"})
    with pytest.raises(LoadError, match="hidden_act='mystery'"):
        BertEncoder.from_pretrained(d)


def test_folder_problems(tmp_path, bert_dir):
    with pytest.raises(LoadError, match="not a folder"):
        BertEncoder.from_pretrained(tmp_path / "nope")
    with pytest.raises(LoadError, match="no config.json"):
        BertEncoder.from_pretrained(tmp_path)
    d = tmp_path / "w"
    d.mkdir()
    (d / "config.json").write_text((bert_dir / "config.json").read_text())
    with pytest.raises(LoadError, match="no weights"):
        BertEncoder.from_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="not valid JSON"):
        BertEncoder.from_pretrained(d)


# --- corrupt files and impossible configs: a LoadError naming the file and the field ---------------

def _weights_only(src, dst):
    """A copy of a GPT-2 folder with only config.json (weights written by the test)."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


@pytest.mark.parametrize("content, match", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1234\n", "Git LFS pointer.*git lfs pull"),
    (b"", "is empty"),
    (bytes(range(256)) * 40, "not a readable safetensors file"),
    (None, "not a readable safetensors file"),  # truncated: the real file cut in half
])
def test_corrupt_safetensors_is_a_load_error_naming_the_file(gpt2_dir, tmp_path, content, match):
    d = _weights_only(gpt2_dir, tmp_path / "g")
    if content is None:
        whole = (gpt2_dir / "model.safetensors").read_bytes()
        content = whole[: len(whole) // 2]
    (d / "model.safetensors").write_bytes(content)
    with pytest.raises(LoadError, match=match) as e:
        GPT2.from_pretrained(d)
    assert "model.safetensors" in str(e.value)


def test_truncated_pytorch_bin_is_a_load_error(gpt2_dir, tmp_path):
    d = _weights_only(gpt2_dir, tmp_path / "g")
    sd = load_file(gpt2_dir / "model.safetensors")
    torch.save(sd, d / "pytorch_model.bin")
    whole = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(LoadError, match="pytorch_model.bin.*not a readable PyTorch checkpoint"):
        GPT2.from_pretrained(d)
    torch.save([1, 2, 3], d / "pytorch_model.bin")
    with pytest.raises(LoadError, match="pytorch_model.bin does not hold a state dict"):
        GPT2.from_pretrained(d)


@pytest.mark.parametrize("index, match", [
    ("{not json", "model.safetensors.index.json is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"metadata": {}}', "has no weight_map"),
    ('{"weight_map": {"wte.weight": "../../etc/passwd"}}', "must be a file name"),
])
def test_bad_sharded_index_is_a_load_error(gpt2_dir, tmp_path, index, match):
    d = _weights_only(gpt2_dir, tmp_path / "g")
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(LoadError, match=match):
        GPT2.from_pretrained(d)


def test_sharded_checkpoint_loads(gpt2_dir, tmp_path):
    d = _weights_only(gpt2_dir, tmp_path / "g")
    sd = load_file(gpt2_dir / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    parts = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, keys in parts.items():
        save_file({k: sd[k].contiguous() for k in keys}, d / shard, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: s for s, ks in parts.items() for k in ks}}))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(GPT2.from_pretrained(d)(ids), GPT2.from_pretrained(gpt2_dir)(ids))


@pytest.mark.parametrize("edit, match", [
    ({"n_head": "4"}, r"config.json: n_head must be an integer >= 1, got '4'"),
    ({"n_embd": None}, r"config.json: n_embd must be an integer >= 1, got None"),
    ({"vocab_size": -5}, r"config.json: vocab_size must be an integer >= 1, got -5"),
    ({"n_layer": 2.0}, r"config.json: n_layer must be an integer >= 0, got 2.0"),
    ({"n_head": 5}, r"n_embd=32 is not divisible by n_head=5"),
    ({"layer_norm_epsilon": "tiny"}, r"layer_norm_epsilon must be a positive number"),
    ({"activation_function": 3}, r"activation_function must be a string"),
])
def test_bad_gpt2_config_fields_name_file_and_field(gpt2_dir, tmp_path, edit, match):
    d = copy_with(gpt2_dir, tmp_path / "c", config=edit)
    with pytest.raises(LoadError, match=match) as e:
        GPT2.from_pretrained(d)
    assert str(d / "config.json") in str(e.value)


@pytest.mark.parametrize("edit, match", [
    ({"num_attention_heads": "4"}, r"num_attention_heads must be an integer >= 1, got '4'"),
    ({"hidden_size": None}, r"hidden_size must be an integer >= 1, got None"),
    ({"vocab_size": -5}, r"vocab_size must be an integer >= 1, got -5"),
    ({"max_position_embeddings": True}, r"max_position_embeddings must be an integer >= 1, got True"),
])
def test_bad_bert_config_fields_name_file_and_field(bert_dir, tmp_path, edit, match):
    d = copy_with(bert_dir, tmp_path / "c", config=edit)
    with pytest.raises(LoadError, match=match) as e:
        BertEncoder.from_pretrained(d)
    assert str(d / "config.json") in str(e.value)


@pytest.mark.parametrize("loader", [GPT2.from_pretrained, BertEncoder.from_pretrained, models.load])
def test_config_that_is_not_an_object(gpt2_dir, tmp_path, loader):
    d = _weights_only(gpt2_dir, tmp_path / "g")
    (d / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(LoadError, match=r"config.json must hold a JSON object.*got a JSON list"):
        loader(d)


def test_dead_model_type_helper_is_gone():
    from bhqk.models import loading

    assert not hasattr(loading, "model_type")
