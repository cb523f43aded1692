"""Statistics captured from Hugging Face models on bhqk equal the ones computed from transformers'
eager ``output_attentions`` (fp32, tiny random models, padded batches), during a forward and during
``generate()`` (one record per call, each decode step its own), and on bhqk's own GPT-2."""

from __future__ import annotations

import pytest
import torch
import transformers

import bhqk
from bhqk.integrations.transformers import register
from test_stats import from_weights
from tolerance import assert_paths_close

pytestmark = pytest.mark.protocol  # make test-newest / test-lowest run it (tests/test_pins.py)

register()
V = 100
WHAT = ("entropy", "distance", "sink", "received")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=128))


def _gemma2():  # softcap and a sliding-window layer
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=0.05,
        final_logit_softcapping=30.0, query_pre_attn_scalar=16, max_position_embeddings=128))


def _gpt_oss():  # sinks
    m = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(0.5, 2.5, layer.self_attn.sinks.shape[0]))
    return m


def _bert():  # bidirectional, right padding: padded query rows attend the real keys
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=64))


FAMILIES = {"llama": _llama, "gemma2": _gemma2, "gpt_oss": _gpt_oss, "bert": _bert}


def _batch(B=2, N=13, left=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, N), generator=g)
    am = torch.ones(B, N, dtype=torch.long)
    if left:
        am[1, :5] = 0
    else:
        am[1, -5:] = 0
    return ids, am


def _compare(rec, P, am_rows, K, Q, msg, rows=None):
    """``rec``'s statistics against the formulas on eager's weights P [B, H, r, K] of the real rows."""
    real = am_rows[:, None, :].expand(P.shape[:3])  # [B, H, r]
    assert torch.equal(rec.real, real), msg
    Pr = P.double() * real[..., None]  # padding rows' weights out (eager's are not 0 there)
    exp = from_weights(Pr, K, Q, rows=rows, offsets=(1,), real=real)
    for name in ("entropy", "distance", "sink", "received"):
        got = torch.where(real, getattr(rec, name), 0.0) if name != "received" else rec.received
        # two fp32 paths (eager's weights, bhqk's tiles): 2·8·eps(fp32)·√K·max(1, |expected|), derived, not picked
        assert_paths_close(got, exp[name], dtype=torch.float32, n=K, msg=f"{msg} {name}")
    assert_paths_close(torch.where(real, rec.offset(1), 0.0), exp["offset1"], dtype=torch.float32, n=K, msg=f"{msg} offset")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_statistics_equal_eager_output_attentions(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    decoder = family != "bert"
    ids, am = _batch(left=decoder)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids, attention_mask=am, output_attentions=True).attentions  # per layer [B, H, Q, K]
    model.set_attn_implementation("bhqk")
    with torch.no_grad(), bhqk.capture(model=model, what=WHAT, offsets=(1,)) as cap:
        model(ids, attention_mask=am)
    assert len(cap.records) == len(ref)
    N = ids.shape[1]
    for li, (rec, P) in enumerate(zip(cap.records, ref)):
        _compare(rec, P, am.bool(), N, N, f"{family} layer {li} ({rec.backend})")


def test_generate_gives_one_record_per_call_equal_to_eager():
    torch.manual_seed(0)
    model = _llama().eval()
    ids, am = _batch(N=9)
    model.set_attn_implementation("bhqk")
    new = 3
    with torch.no_grad(), bhqk.capture(model=model, what=WHAT, offsets=(1,)) as cap:
        out = model.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0)
    L = model.config.num_hidden_layers
    assert len(cap.records) == L * new  # the prefill and new - 1 decode steps, each layer once
    full_am = torch.cat([am, torch.ones(2, new, dtype=am.dtype)], 1)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(out[:, :-1], attention_mask=full_am[:, :-1], output_attentions=True).attentions  # [B, H, N', N']
    N = ids.shape[1]
    for step in range(new):
        for li in range(L):
            rec = cap.records[step * L + li]
            Q = rec.sizes["Q"]
            K = rec.sizes["K"]
            assert (Q, K) == ((N, N) if step == 0 else (1, N + step))
            P = ref[li][:, :, K - Q:K, :K]  # the rows this call computed
            _compare(rec, P, full_am[:, K - Q:K].bool(), K, Q, f"step {step} layer {li}")


def test_bhqk_gpt2_generate_records_each_decode_step():
    from bhqk.models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64)).eval()
    ids = torch.randint(0, V, (1, 6))
    with torch.no_grad(), bhqk.capture(model=model, what=WHAT, offsets=(1,)) as cap:
        out = model.generate(ids, max_new_tokens=3)
    Ks = [r.sizes["K"] for r in cap.records]
    assert Ks[:2] == [6, 6] and Ks[-2:] == [8, 8], Ks
    with torch.no_grad(), bhqk.capture(model=model, what=("weights",)) as full:
        model(out[:, :-1])
    for rec in cap.records:
        Q, K = rec.sizes["Q"], rec.sizes["K"]
        layer = int(rec.name.split(".")[1]) if rec.name.startswith("blocks.") else rec.index % 2
        P = full.records[layer].weights[:, :, K - Q:K, :K]
        exp = from_weights(P, K, Q)
        for name in ("entropy", "distance", "sink", "received"):
            assert_paths_close(getattr(rec, name), exp[name], dtype=torch.float32, n=K)  # decode step vs the full pass: fp32 both
