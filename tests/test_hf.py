"""Hugging Face models on bhqk through ``attn_implementation="bhqk"`` equal transformers' own
``eager`` attention (tiny random configs built here, fp32, no network)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import transformers
from transformers import masking_utils as mu

import bhqk
from bhqk import masks
from bhqk.errors import LoadError, MaskError
from bhqk.functional import flex
from bhqk.integrations.transformers import AllKeys, HFMask, attention_forward, build_mask, names, register
from bhqk.models.real import encode, load_model
from conftest import registry_restored
from tolerance import assert_close, assert_models_close, assert_paths_close, bound

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

NAMES = register()
# max abs logit difference over real tokens between two fp32 paths through these tiny models: two
# layers whose widest sum is 96 terms, logits of order 1 (tolerance.assert_models_close's bound)
TOL = 2 * bound(torch.float32, 96) * 2
V = 100  # vocabulary of the tiny models


def _llama(**kw):
    c = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=128)
    c.update(kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**c))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, max_position_embeddings=128))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"], max_position_embeddings=128))


def _gemma2(softcap=0.05):  # small: the random model's scores are ~0.05, so tanh bends them
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=softcap,
        final_logit_softcapping=30.0, query_pre_attn_scalar=16, max_position_embeddings=128))


def _gpt_oss():
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64))


def _bert():
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96))


def _t5(dropout_rate=0.1):
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, dropout_rate=dropout_rate))


def _doge():  # computes a dynamic mask from the one it receives (dtype, masked_fill); keeps the top 4 keys
    return transformers.DogeForCausalLM(transformers.DogeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, keep_window_size=4, max_position_embeddings=128))


def _deepseek_v32():  # its indexer reads the mask (mask[:, 0], dtype) and picks 4 keys per query: indices=
    return transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        vocab_size=V, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        index_n_heads=2, index_head_dim=16, index_topk=4, first_k_dense_replace=1, n_group=1, topk_group=1,
        max_position_embeddings=128))


def _deepseek_v4():  # concatenates the mask with a bias over its compressed keys (torch.cat); sinks
    return transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(
        vocab_size=V, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=4,
        o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=2, num_nextn_predict_layers=0,
        qk_rope_head_dim=8, max_position_embeddings=128))


DECODERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "gpt2": _gpt2}


def _batch(B=2, N=13, seed=0, left=True):
    """ids [B, N] and attention_mask [B, N]: row 1 padded (left for decoders, right for encoders)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, N), generator=g)
    am = torch.ones(B, N, dtype=torch.long)
    if B > 1 and left:
        am[1, :5] = 0
    elif B > 1:
        am[1, -5:] = 0
    return ids, am


def _out(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        o = model(**inputs)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def _real_diff(a, b, am):
    return (a - b).abs()[am.bool()].max().item()


def _model(make, seed=0):
    torch.manual_seed(seed)
    return make().eval()


# ---- registration: both interfaces, every name ---------------------------------------------------


def test_register_adds_the_attention_function_and_the_mask_builder_under_every_name():
    backends = bhqk.functional.names()
    assert NAMES == names() == ["bhqk"] + [f"bhqk:{b}" for b in backends if b != "auto"]
    assert "bhqk:flex" in NAMES
    for n in NAMES:
        assert n in transformers.AttentionInterface._global_mapping
        # without the mask builder transformers would hand the attention function attention_mask=None
        assert mu.ALL_MASK_ATTENTION_FUNCTIONS[n] is build_mask


def test_backend_names_come_from_the_registry():
    """A backend registered later (e.g. another helper's) gets its name without touching the adapter."""
    from bhqk.functional import registry

    with registry_restored():
        registry.register(dataclasses.replace(registry.get("reference"), name="fake"))
        assert "bhqk:fake" in names()
        try:
            assert "x:fake" in register("x")
            assert "x:fake" in transformers.AttentionInterface._global_mapping
        finally:
            for n in names("x"):
                transformers.AttentionInterface._global_mapping.pop(n, None)
                mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(n, None)


# every registered name on both models; flex on its unfused eager path (flex.uncompiled(): the same
# mask_mod, score_mod and BlockMask, nothing compiled), its compiled kernel in the slow run (seconds of
# compile per model; tests/test_flex.py compiles one kernel in the default run)
PADDING_CASES = [(n, k) for n in NAMES for k in ("llama", "bert")]


@pytest.mark.parametrize("name, kind", PADDING_CASES)
def test_padding_is_never_dropped(name, kind):
    """A padded batch gives each sequence the outputs it has alone (independent of eager)."""
    with flex.uncompiled() if name == "bhqk:flex" else contextlib.nullcontext():
        _check_padding_is_never_dropped(name, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_padding_is_never_dropped_on_compiled_flex(kind):
    _check_padding_is_never_dropped("bhqk:flex", kind)


def _check_padding_is_never_dropped(name, kind):
    model = _model(_llama if kind == "llama" else _bert)
    ids, am = _batch(left=kind == "llama")
    model.set_attn_implementation(name)
    pos = (am.cumsum(-1) - 1).clamp(min=0)  # [B, N] positions of the real tokens
    with torch.no_grad():
        batch = model(ids, attention_mask=am, position_ids=pos)
        real = am[1].bool()
        alone = model(ids[1:, real], position_ids=pos[1:, real])
    get = (lambda o: o.logits) if kind == "llama" else (lambda o: o.last_hidden_state)
    diff = (get(batch)[1, real] - get(alone)[0]).abs().max().item()
    assert diff <= TOL, f"{name}: padded row differs from the same sequence alone by {diff}"


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    model = _model(_llama)
    model.save_pretrained(tmp_path)
    ids, am = _batch()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="bhqk").eval()
    assert loaded.config._attn_implementation == "bhqk"
    with torch.no_grad():
        ours = loaded(ids, attention_mask=am).logits
    assert _real_diff(ours, _out(model, "eager", input_ids=ids, attention_mask=am), am) <= TOL


# ---- models vs eager -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_decoder_logits_equal_eager_left_padded(kind):
    model = _model(DECODERS[kind])
    ids, am = _batch()
    ref = _out(model, "eager", input_ids=ids, attention_mask=am)
    for name in ("bhqk", "bhqk:tiled"):
        diff = _real_diff(_out(model, name, input_ids=ids, attention_mask=am), ref, am)
        assert diff <= TOL, f"{kind} {name}: max abs logit diff {diff}"


@pytest.mark.parametrize("kind", ["doge", "deepseek_v32", "deepseek_v4"])
def test_models_that_use_the_mask_as_a_tensor_equal_eager(kind):
    """Model code that reads, indexes, modifies or concatenates the mask it receives sees transformers'
    own (eager) mask tensor; the attention function honours what the model made of it."""
    model = _model({"doge": _doge, "deepseek_v32": _deepseek_v32, "deepseek_v4": _deepseek_v4}[kind])
    ids, am = _batch()
    ref = _out(model, "eager", input_ids=ids, attention_mask=am)
    ours = _out(model, "bhqk", input_ids=ids, attention_mask=am)
    real = am.bool()
    assert_close(ours[real], ref[real].double(), dtype=torch.float32, n=max(ids.shape[1], model.config.hidden_size),
                 msg=f"{kind}: logits on bhqk differ from eager's")


def test_gemma2_softcap_matters():
    """Guards the Gemma 2 comparison: without the softcap eager's logits move far beyond TOL."""
    ids, am = _batch()
    capped = _out(_model(_gemma2), "eager", input_ids=ids, attention_mask=am)
    plain = _out(_model(lambda: _gemma2(None)), "eager", input_ids=ids, attention_mask=am)
    assert _real_diff(capped, plain, am) > 100 * TOL


def test_bert_equals_eager_right_padded():
    model = _model(_bert)
    ids, am = _batch(left=False)
    ref = _out(model, "eager", input_ids=ids, attention_mask=am)
    for name in ("bhqk", "bhqk:tiled"):
        assert _real_diff(_out(model, name, input_ids=ids, attention_mask=am), ref, am) <= TOL


def test_t5_position_bias_equals_eager():
    model = _model(_t5)
    ids, am = _batch(left=False)
    dec = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, attention_mask=am, decoder_input_ids=dec)
    ref = _out(model, "eager", **inputs)
    for name in ("bhqk", "bhqk:tiled"):
        diff = (_out(model, name, **inputs) - ref).abs().max().item()
        assert diff <= TOL, f"T5 {name}: max abs logit diff {diff}"


def test_gpt_oss_sinks_equal_eager():
    model = _model(_gpt_oss)
    ids, am = _batch()
    ref = _out(model, "eager", input_ids=ids, attention_mask=am)
    assert _real_diff(_out(model, "bhqk", input_ids=ids, attention_mask=am), ref, am) <= TOL


def test_custom_4d_masks_pass_through():
    """A prepared 4-D mask reaches the attention function as is: float (additive) and bool both work."""
    model = _model(_llama)
    ids, _ = _batch(B=1)
    N = ids.shape[1]
    allowed = torch.rand(1, 1, N, N, generator=torch.Generator().manual_seed(3)) > 0.5
    allowed |= torch.eye(N, dtype=torch.bool)  # every query sees itself
    additive = torch.zeros(1, 1, N, N).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = _out(model, "eager", input_ids=ids, attention_mask=additive)
    ones = torch.ones_like(ids)
    assert _real_diff(_out(model, "bhqk", input_ids=ids, attention_mask=additive), ref, ones) <= TOL
    assert _real_diff(_out(model, "bhqk", input_ids=ids, attention_mask=allowed), ref, ones) <= TOL


def test_gpt_oss_weights_and_capture_include_the_sinks():
    """s_aux reaches bhqk as sinks=: output_attentions and a capture equal eager's weights, whose
    rows sum to 1 - the sink's share."""
    model = _model(_gpt_oss)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks  # [H]
            sinks.copy_(torch.linspace(0.5, 2.5, sinks.shape[0]))  # large enough to take a visible share
    ids, am = _batch()
    ref = model.set_attn_implementation("eager") or model(ids, attention_mask=am, output_attentions=True).attentions
    model.set_attn_implementation("bhqk")
    with torch.no_grad(), bhqk.capture(model=model, layers=["model.layers.0.self_attn"], heads=[1]) as cap:
        ours = model(ids, attention_mask=am, output_attentions=True).attentions
    real = am.bool()
    for b in range(2):
        rows = ref[0][b, 1][real[b]].detach()  # [real queries, K]
        assert float(rows.sum(-1).max()) < 0.999  # the sink takes a share
        assert_paths_close(ours[0][b, 1][real[b]], rows, n=64)
        assert_paths_close(cap["model.layers.0.self_attn"].head(1, b=b)[real[b]], rows, n=64)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_sequences_equal_eager(kind):
    """position_ids restarting mark packed documents: the builder finds them, and logits equal eager's."""
    model = _model(DECODERS[kind])
    ids, _ = _batch(B=1, N=14)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]])
    ref = _out(model, "eager", input_ids=ids, position_ids=pos)
    ones = torch.ones_like(ids)
    assert _real_diff(_out(model, "bhqk", input_ids=ids, position_ids=pos), ref, ones) <= TOL
    built = [m.structure for m in _built_masks(model, ids, None, pos)]
    assert all("document" in repr(m) and not isinstance(m, masks.Dense) for m in built), built


def _built_masks(model, ids, am, pos):
    """The mask values transformers' public create_*_mask functions return for this model under bhqk."""
    model.set_attn_implementation("bhqk")
    emb = model.get_input_embeddings()(ids)
    kw = dict(config=model.config, inputs_embeds=emb, attention_mask=am, cache=None, position_ids=pos)
    out = [mu.create_causal_mask(**kw)]
    if getattr(model.config, "sliding_window", None):
        out.append(mu.create_sliding_window_causal_mask(**kw))
    return out


def test_models_get_structured_masks():
    model = _model(_mistral)
    ids, am = _batch()
    full, window = (m.structure for m in _built_masks(model, ids, am, None))
    assert isinstance(full, masks.And) and "causal" in repr(full) and "key_padding" in repr(full)
    assert "sliding_window(3" in repr(window) and "key_padding" in repr(window)


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_generation_equals_eager(kind, cache):
    """Decoding with a KV cache: offsets, the window over the cache, and (static) masks built once."""
    model = _model(DECODERS[kind])
    ids, am = _batch(N=9)
    out = {}
    for name in ("eager", "bhqk"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            out[name] = model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                       cache_implementation=cache)
    assert torch.equal(out["bhqk"], out["eager"])


def _grads(model, impl, inputs, am):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(**inputs).logits
    (logits * am[..., None]).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["bhqk", "bhqk:tiled"])
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_gradients_equal_sdpa(name, kind):
    """Every parameter's gradient, T5's relative-position bias table (through bias=) included."""
    model = _model(_llama if kind == "llama" else lambda: _t5(dropout_rate=0.0)).train()
    ids, am = _batch(left=kind == "llama")
    inputs = dict(input_ids=ids, attention_mask=am)
    if kind == "t5":
        inputs["decoder_input_ids"] = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(1))
        am = torch.ones(2, 6, dtype=torch.long)
    ref, ours = _grads(model, "sdpa", inputs, am), _grads(model, name, inputs, am)
    assert ref.keys() == ours.keys() and len(ours) > 0
    if kind == "t5":
        assert any("relative_attention_bias" in n for n in ours)
    for n in ref:
        assert_models_close(ours[n], ref[n], width=96, layers=2, msg=n)  # gradients of a two-layer model, widths ≤ 96


def test_dropout_only_in_training():
    model = _model(lambda: _llama(attention_dropout=0.5))
    ids, am = _batch()
    model.set_attn_implementation("bhqk")
    runs = []
    for train in (True, True, False, False):
        model.train(train)
        with torch.no_grad():
            runs.append(model(ids, attention_mask=am).logits)
    assert not torch.allclose(runs[0], runs[1])  # dropout on P, a fresh draw each call
    assert torch.equal(runs[2], runs[3]) and torch.isfinite(runs[0]).all()
    assert _real_diff(runs[2], _out(model, "eager", input_ids=ids, attention_mask=am), am) <= TOL


def test_output_attentions_equal_eager():
    model = _model(_llama)
    ids, am = _batch()
    got = {}
    for name in ("eager", "bhqk"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            got[name] = model(ids, attention_mask=am, output_attentions=True).attentions
    assert len(got["bhqk"]) == 2
    real = am.bool()
    for ours, ref in zip(got["bhqk"], got["eager"]):
        assert ours.shape == ref.shape == (2, 8, 13, 13)  # [B, H, Q, K]
        for b in range(2):
            assert_paths_close(ours[b][:, real[b]], ref[b][:, real[b]], n=64)


# ---- capture and trace by Hugging Face module path ----------------------------------------------


def test_capture_one_head_of_one_layer_by_module_path():
    model = _model(_llama)
    ids, am = _batch()
    ref = model.set_attn_implementation("eager") or model(ids, attention_mask=am, output_attentions=True).attentions
    model.set_attn_implementation("bhqk")
    with torch.no_grad(), bhqk.capture(model=model, layers=["model.layers.1.self_attn"], heads=[5]) as cap:
        model(ids, attention_mask=am)
    assert len(cap) == 1 and cap.calls == 2
    rec = cap["model.layers.1.self_attn"]
    assert rec.weights.shape == (2, 1, 13, 13)  # [B, h=1, Q, K]: one head only
    real = am.bool()
    for b in range(2):
        assert_paths_close(rec.head(5, b=b)[real[b]], ref[1][b, 5][real[b]].detach(), n=64)


def test_trace_lists_named_shapes_per_layer_by_module_path():
    model = _model(_llama)
    ids, am = _batch()
    model.set_attn_implementation("bhqk")
    with torch.no_grad(), bhqk.trace(model) as t:
        model(ids, attention_mask=am)
    assert [c.module for c in t.calls] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for call in t.calls:
        assert (call.sizes["H"], call.sizes["Hkv"], call.sizes["Q"], call.sizes["K"]) == (8, 2, 13, 13)
        assert "key_padding" in call.mask


# ---- the bundled MiniLM through AutoModel ------------------------------------------------------


def test_minilm_automodel_equals_bhqk_encoder():
    from bhqk.models.bert import BertEncoder, bundled_model_dir

    folder = bundled_model_dir()
    loaded = load_model(folder)
    assert not loaded.decoder and loaded.tokenizer is not None
    assert loaded.model.config._attn_implementation == "bhqk"
    enc = loaded.tokenizer(["A man is playing a guitar.", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = loaded.model(**enc).last_hidden_state
        own = BertEncoder.from_pretrained(folder)(enc["input_ids"], enc["attention_mask"])
    assert _real_diff(ours, own, enc["attention_mask"]) <= TOL


def test_capture_a_local_folder_by_text():
    """What ``bhqk show --model DIR "text"`` needs: folder → model + tokenizer → capture by module path."""
    from bhqk.models.bert import bundled_model_dir

    loaded = load_model(bundled_model_dir())
    inputs, tokens = encode(loaded, "The cat sat on the mat.")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and len(tokens) == inputs["input_ids"].shape[1]
    with torch.no_grad(), bhqk.capture(model=loaded.model, layers=["encoder.layer.*"], heads=[0, 3]) as cap:
        loaded.model(**inputs)
    assert [r.name for r in cap] == [f"encoder.layer.{i}.attention.self" for i in range(6)]
    N = len(tokens)
    assert cap.stack().shape == (6, 1, 2, N, N)  # [L, B, h, Q, K]
    torch.testing.assert_close(cap.stack().sum(-1), torch.ones(6, 1, 2, N))


def test_load_folder_finds_decoders(tmp_path):
    _model(_gpt2).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, "bhqk:tiled")
    assert loaded.decoder and loaded.tokenizer is None
    assert loaded.model.config._attn_implementation == "bhqk:tiled"


# ---- the mask builder on its own: equal to transformers' sdpa mask, structured where known --------


def _case(name, am=None):
    # chunks count positions after the left padding, as create_chunked_causal_mask computes it
    lp = torch.zeros(2, dtype=torch.long) if am is None else (am.cumsum(-1) == 0).sum(-1)
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    return {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "window": mu.sliding_window_causal_mask_function(3),
        "window_bidirectional": mu.sliding_window_bidirectional_mask_function(2),
        "chunked": mu.chunked_causal_mask_function(3, lp),
        "packed": mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids)),
        "unknown": lambda b, h, q, k: (q + k) % 3 != 1,
    }[name]


STRUCTURED = {"causal": "causal", "bidirectional": "all_keys", "window": "sliding_window", "window_bidirectional":
              "sliding_window", "chunked": "document", "packed": "document", "unknown": "dense"}


@pytest.mark.parametrize("name", sorted(STRUCTURED))
@pytest.mark.parametrize("sizes", [(9, 9, 0, 0), (3, 9, 6, 0), (1, 9, 8, 0), (4, 6, 7, 5)], ids=str)
@pytest.mark.parametrize("padded", [False, True])
def test_mask_builder_equals_transformers_sdpa_mask(name, sizes, padded):
    Q, K, q_off, kv_off = sizes
    if name == "packed" and Q != K:
        return  # transformers builds packed masks only without a cache (Q = K)
    am = None
    if padded:
        am = torch.ones(2, kv_off + K, dtype=torch.long)
        am[1, :2] = 0
        am[0, -1] = 0
    fn = _case(name, am)
    args = dict(batch_size=2, q_length=Q, kv_length=K, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                attention_mask=am)
    want = mu.sdpa_mask(**args, allow_is_causal_skip=False)  # [B, 1, Q, K]
    hf = build_mask(**args, local_size={"window": 3, "window_bidirectional": 2, "chunked": 3}.get(name))
    got = hf.structure
    assert torch.equal(got.materialize(2, 1, Q, K).expand(2, 1, Q, K), want)
    # as a tensor it is exactly transformers' eager mask (float: 0 = attend, finfo.min = masked)
    assert isinstance(hf, torch.Tensor) and hf.shape == (2, 1, Q, K) and hf.dtype == torch.float32
    eager = mu.eager_mask(**{**args, "attention_mask": None if am is None else am.bool()})  # as transformers passes it
    assert torch.equal(hf[:], eager) and type(hf[:]) is torch.Tensor
    expect = STRUCTURED[name]
    assert isinstance(got, masks.Dense) == (expect == "dense"), repr(got)
    if Q == K and q_off == kv_off == 0:  # with one row, e.g. a chunk can equal a window: any structure is right
        assert (expect if not (padded and expect == "all_keys") else "key_padding") in repr(got), repr(got)
    if padded and expect != "dense":
        assert "key_padding" in repr(got)


def test_the_mask_is_a_tensor_built_on_first_use():
    ids = torch.ones(2, 6, dtype=torch.long)
    ids[1, :2] = 0
    hf = build_mask(batch_size=2, q_length=6, kv_length=6, attention_mask=ids, dtype=torch.float64)
    assert isinstance(hf, HFMask) and isinstance(hf, torch.Tensor)
    assert (hf.shape, hf.ndim, hf.dtype, hf.device.type) == ((2, 1, 6, 6), 4, torch.float64, "cpu")
    assert hf._tensor is None  # metadata answers without building
    assert "causal" in repr(hf) and "key_padding" in repr(hf)
    cut = hf[:, :, :, :4]  # model code indexing the mask: a plain tensor of transformers' eager mask
    assert type(cut) is torch.Tensor and torch.equal(cut, mu.eager_mask(2, 6, 6, attention_mask=ids.bool(),
                                                                         dtype=torch.float64)[..., :4])
    assert (hf != 0).dtype == torch.bool and not hf.modified
    assert isinstance(hf.detach(), HFMask)  # e.g. reentrant checkpointing detaches its inputs
    twin = copy.deepcopy(hf)  # e.g. a hook keeping the inputs
    assert isinstance(twin, HFMask) and repr(twin) == repr(hf) and torch.equal(twin[:], hf[:])


def test_a_mask_changed_in_place_is_honoured():
    """An in-place change (on the mask or on a view of its tensor) makes the structure stale: the
    attention function then uses the tensor."""
    q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    m = torch.nn.Module()
    hf = build_mask(batch_size=1, q_length=5, kv_length=5)
    plain, _ = attention_forward(m, q, q, q, hf)
    with torch.inference_mode():  # as generate() may run: the change must still be seen
        hf[:, :, :, :1].fill_(torch.finfo(torch.float32).min)  # nobody may attend key 0 now (row 0 is fully masked)
        assert hf.modified
        got, _ = attention_forward(m, q, q, q, hf)
    allowed = masks.causal().materialize(1, 1, 5, 5).clone()
    allowed[..., 0] = False
    want = bhqk.attention(q, q, q, masks.dense(allowed), backend="reference").transpose(1, 2)  # [B, Q, H, d]
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got[:, 1:], plain[:, 1:])


def test_a_window_model_without_a_mask_builder_keeps_its_window():
    """Registered without a mask builder, transformers hands the attention function attention_mask=None
    and sliding_window=4: the window must not fall back to plain causal attention."""
    transformers.AttentionInterface.register("bhqk-nobuilder", transformers.AttentionInterface._global_mapping["bhqk"])
    try:
        model = _model(_mistral)  # sliding_window=4 < N
        ids, _ = _batch(B=1)
        ref = _out(model, "eager", input_ids=ids)
        ours = _out(model, "bhqk-nobuilder", input_ids=ids)
    finally:
        transformers.AttentionInterface._global_mapping.pop("bhqk-nobuilder")
    assert_close(ours, ref.double(), dtype=torch.float32, n=model.config.hidden_size)


def test_window_and_packing_keywords_without_a_mask():
    q = torch.randn(1, 2, 7, 8, generator=torch.Generator().manual_seed(1))
    m = torch.nn.Module()
    got, _ = attention_forward(m, q, q, q, None, sliding_window=3)
    want = bhqk.attention(q, q, q, masks.causal() & masks.sliding_window(2), backend="reference").transpose(1, 2)
    torch.testing.assert_close(got, want)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # two packed documents
    docs = masks.causal() & masks.document(torch.tensor([[0, 0, 0, 1, 1, 1, 1]]))
    want = bhqk.attention(q, q, q, docs, backend="reference").transpose(1, 2)
    torch.testing.assert_close(attention_forward(m, q, q, q, None, position_ids=pos)[0], want)
    cu = torch.tensor([0, 3, 7])
    torch.testing.assert_close(attention_forward(m, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0], want)


def test_unknown_keyword_arguments_raise():
    q = torch.randn(1, 2, 4, 8)
    m = torch.nn.Module()
    with pytest.raises(TypeError, match="'block_indices'"):
        attention_forward(m, q, q, q, None, block_indices=torch.zeros(1, 4, 2, dtype=torch.long))
    with pytest.raises(MaskError, match="sinks must hold one logit per head"):
        attention_forward(m, q, q, q, None, sinks=torch.zeros(1, 2, 4, 1))  # per-query sinks
    attention_forward(m, q, q, q, None, use_cache=True, encoder_hidden_states=None)  # nothing asked: fine
    s = torch.tensor([0.5, 2.0])  # per-head sinks [H]: "sinks" is "s_aux" under another model's name
    torch.testing.assert_close(attention_forward(m, q, q, q, None, sinks=s)[0], attention_forward(m, q, q, q, None, s_aux=s)[0])


def test_all_keys_means_no_mask_not_causal():
    """The builder's 'everything visible' is not None, so a module with is_causal=True stays bidirectional."""
    q = torch.randn(1, 2, 4, 8)
    m = torch.nn.Module()
    m.is_causal = True
    full, _ = attention_forward(m, q, q, q, AllKeys(4))
    causal_out, _ = attention_forward(m, q, q, q, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2)
    torch.testing.assert_close(full, ref)
    assert not torch.allclose(causal_out, ref)


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float32])
def test_a_two_d_attention_mask_is_key_padding_whatever_its_dtype(dtype):
    """[B, K] of 1 (real token) / 0 (padding): a float one used to be read as a [Q, K] mask plus a bias of ones."""
    q = torch.randn(2, 2, 5, 8)
    m = torch.nn.Module()
    pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).to(dtype)  # [B, K]
    got, _ = attention_forward(m, q, q, q, pad)
    want = bhqk.attention(q, q, q, masks.from_hf(pad), backend="reference").transpose(1, 2)  # [B, Q, H, d]
    torch.testing.assert_close(got, want)
    with pytest.raises(MaskError, match="only 1 .real token. and 0 .padding."):
        attention_forward(m, q, q, q, torch.tensor([[0.0, -1e9, 0, 0, 0]] * 2))  # additive [B, K]: a bias, not a mask


def test_load_folder_names_a_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="config.json"):
        load_model(tmp_path)


# ---- the command line on any local folder -------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random Llama saved as a local folder, with the bundled MiniLM's tokenizer files."""
    import shutil

    from bhqk.models.bert import bundled_model_dir

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    _llama(vocab_size=30522).save_pretrained(folder)  # the tokenizer's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (bundled_model_dir() / name).exists():
            shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


def test_cli_trace_and_show_take_any_local_folder(llama_folder, tmp_path, capsys):
    from bhqk.cli import main

    assert main(["trace", "--model", str(llama_folder), "The cat sat on the mat."]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn" in out and "model.layers.1.self_attn" in out
    assert "[B=1, Hkv=2, K=9, d=8]" in out  # GQA: 2 key/value heads for 8 query heads, seen as they flowed
    argv = ["show", "--model", str(llama_folder), "--out", str(tmp_path), "--max-tokens", "6", "The cat sat on the mat."]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "input cut: 9 tokens, the first 6 are shown" in report and "Q=6, K=6" in report
    assert (tmp_path / "attention.html").stat().st_size > 0 and (tmp_path / "attention.png").exists()
