"""Quantized storage in the budget cache (``plan.cache(model, bits=8 | 4)``, docs/design.md §9) on every
layer type of tests/test_budget_layers.py: generation equals an ordinary cache holding the same
quantize→dequantize keys and values (the plan's streaming mask edited in by ``plan.emulate``), with and
without a plan; ``bits=None`` is the unquantized cache bit for bit; bytes are what ``Plan.nbytes``
predicts; crop, assisted decoding, batch reorder and capture work on it; bad input is refused first."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

import bhqk
from bhqk.budget import Plan
from bhqk.budget.plan import model_map
from bhqk.budget.quant import Quantized, attend, fake_quantize, quantize
from bhqk.errors import ShapeError
from bhqk.functional import attention
from bhqk.nn.cache import LayerCache
from test_budget import _generate, _inputs, _llama  # ids [B, N] (row 1 left-padded), their mask; greedy (sequences, logits)
from test_budget_inspect import KW, NEW, WIDTH, _same_records  # what to capture; records equal within the bound
from test_budget_layers import COMMON, NAMES, S, W, _mixed, _model
from tolerance import assert_close, assert_models_close

pytestmark = pytest.mark.protocol

R, GROUP, BLOCK = 3, 8, 4  # a 20-token prompt and 10 new tokens: several blocks of quantized positions


class FakeQuantCache(transformers.DynamicCache):
    """The emulation: an ordinary cache (every position) that returns, for the K/V heads ``keeps[layer]``,
    the positions older than ``residual`` before the call's first as ``fake_quantize`` gives them (the
    budget cache's rule: a call writing P … P+Q−1 reads positions < P − residual quantized)."""

    def __init__(self, keeps: torch.Tensor, bits: int, group: int, residual: int) -> None:
        super().__init__()
        self.keeps, self.bits, self.group, self.residual = keeps, bits, group, residual

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        P = self.get_seq_length(layer_idx)
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)  # [B, Hkv, P + Q, d]
        cut = max(0, P - self.residual)
        heads = self.keeps[layer_idx].nonzero().flatten()
        if cut and len(heads):
            k, v = k.clone(), v.clone()
            k[:, heads, :cut] = fake_quantize(k[:, heads, :cut], self.bits, self.group)  # [B, h, cut, d]
            v[:, heads, :cut] = fake_quantize(v[:, heads, :cut], self.bits, self.group)
        return k, v


def _all_full(model) -> Plan:
    shape = model_map(model).shape
    return Plan(torch.ones(shape.layers, shape.kv_heads, dtype=torch.bool), sink=S, window=W)


def _emulated(model, plan: Plan, bits: int, ids, am, n=10):
    keeps = plan.full | plan.free(model_map(model).shape)
    with plan.emulate(model):
        return _generate(model, ids, am, n=n, cache=FakeQuantCache(keeps, bits, GROUP, R))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("which", ["all_full", "mixed"])
@pytest.mark.parametrize("name", NAMES)
def test_generation_with_bits_equals_the_emulated_quantization(name, which, bits):
    model = _model(name)
    ids, am = _inputs()
    plan = _all_full(model) if which == "all_full" else _mixed(model)
    cache = plan.cache(model, bits=bits, group=GROUP, residual=R, block=BLOCK)
    seq, logits = _generate(model, ids, am, cache=cache)
    ref_seq, ref = _emulated(model, plan, bits, ids, am)
    assert_models_close(logits, ref, width=96, layers=model.config.num_hidden_layers, msg=f"{name} {which} bits={bits}")
    assert torch.equal(seq, ref_seq)
    assert any(layer.qk is not None and layer.qk.n for layer in cache.budget_layers), "nothing was quantized"
    _, plain = _generate(model, ids, am, cache=plan.cache(model))
    assert (plain - ref).abs().max() > 1e-4, "the quantization must change something (else the test proves nothing)"
    assert cache.nbytes() == plan.nbytes(seq.shape[1] - 1, model, batch=2, bits=bits, group=GROUP, residual=R)[0]


@pytest.mark.parametrize("name", NAMES)
def test_bits_none_is_the_unquantized_cache_bit_for_bit(name):
    model = _model(name)
    ids, am = _inputs()
    for plan in (_all_full(model), _mixed(model)):
        a, b = plan.cache(model), plan.cache(model, bits=None)
        seq, logits = _generate(model, ids, am, cache=a)
        seq2, logits2 = _generate(model, ids, am, cache=b)
        assert torch.equal(logits, logits2) and torch.equal(seq, seq2)
        assert all(layer.qk is None for layer in b.budget_layers)


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_assisted_decoding_with_bits_is_greedy_decoding_with_it(name):
    model = _model(name)
    ids, am = _inputs(B=1)
    plan = _mixed(model)
    kw = dict(bits=4, group=GROUP, residual=R, block=BLOCK)
    seq, _ = _generate(model, ids, am, n=12, cache=plan.cache(model, **kw))
    torch.manual_seed(1)
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **COMMON)).eval()
    assisted = model.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              assistant_model=draft, cache=plan.cache(model, **kw))
    assert torch.equal(assisted, seq)


@torch.no_grad()
def test_crop_and_batch_reorder_keep_integers_and_floats_together():
    model = _llama()  # every layer full attention: a crop needs no past recording
    ids, am = _inputs(B=2, N=22)
    plan = _all_full(model)
    cache = plan.cache(model, bits=8, group=GROUP, residual=R, block=BLOCK)
    model(input_ids=ids[:, :18], attention_mask=am[:, :18], cache=cache)
    for n in range(18, 22):
        model(input_ids=ids[:, n:n + 1], attention_mask=am[:, :n + 1], cache=cache)
    layer = cache.budget_layers[0]  # full attention: every position, the oldest in integers
    assert layer.positions(0).tolist() == list(range(22)) and layer.qk.n == 22 - R
    cache.crop(-2)
    assert layer.positions(0).tolist() == list(range(20)) and layer.fk.shape[-2] == 1 and layer.qk.n == 22 - R
    cache.crop(-5)  # past the float window: integers removed from the end too
    assert layer.positions(0).tolist() == list(range(15)) and layer.fk.shape[-2] == 0 and layer.qk.n == 15
    before = layer.qk.data.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.qk.data, before.flip(0))
    cache.batch_select_indices(torch.tensor([1]))
    assert layer.qk.data.shape[0] == 1 and torch.equal(layer.qk.data[0], before[0])


@pytest.mark.parametrize("name", ["gemma3", "llama4"])
def test_capture_on_a_quantized_cache_equals_capture_on_the_emulated_run(name):
    """The observed one-call path dequantizes what it copies: every record is the emulation's."""
    model = _model(name)
    layers = model_map(model).shape.layers
    ids, am = _inputs()
    for plan in (_mixed(model), _all_full(model)):
        with bhqk.capture(model=model, **KW) as cap:
            seq, logits = _generate(model, ids, am, n=NEW, cache=plan.cache(model, bits=4, group=GROUP, residual=R,
                                                                           block=BLOCK))
        with bhqk.capture(model=model, **KW) as ref:
            ref_seq, ref_logits = _emulated(model, plan, 4, ids, am, n=NEW)
        assert torch.equal(seq, ref_seq)
        assert_models_close(logits, ref_logits, width=WIDTH, layers=layers, msg=name)
        _same_records(cap.records, ref.records, layers, name)


def test_bad_input_is_refused_before_any_forward():
    model = _model("llama4")  # d = 16
    plan = _mixed(model)
    for bits in (2, 3, 16, True, "8"):
        with pytest.raises(ValueError, match="bits must be one of 8, 4"):
            plan.cache(model, bits=bits)
    with pytest.raises(ValueError, match="group=12 does not divide the head size d=16"):
        plan.cache(model, bits=8, group=12)
    with pytest.raises(ValueError, match="group=12 does not divide"):
        plan.nbytes(10, model, bits=4, group=12)
    with pytest.raises(ValueError, match="pass bits=8 or 4"):
        plan.cache(model, group=8)
    with pytest.raises(ShapeError, match=r"the plan is \[layers=4, Hkv=2\] but Gemma2ForCausalLM"):
        plan.cache(_model("gemma2"), bits=8, group=12)  # a plan of another model: its check comes first
    cache = Plan(plan.full, sink=S, window=W).cache(bits=8, group=12)  # no model: checked at the first keys written
    with pytest.raises(ValueError, match="group=12 does not divide the head size d=16"):
        _generate(model, *_inputs(), n=1, cache=cache)
    assert cache.budget_layers[0].fk is None


def test_the_quantizer_round_trips_within_half_a_step_and_packs_two_per_byte():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g) * 3  # [B, h, n, d]
    for bits in (8, 4):
        q = quantize(x, bits, 32)
        assert q.data.dtype == torch.uint8 and q.data.shape[-1] == 64 * bits // 8 and q.scale.shape == (2, 3, 5, 2)
        step = q.scale.float()[..., None]  # [B, h, n, d/g, 1]
        err = (q.dequantize() - x).abs().reshape(2, 3, 5, 2, 32)
        # half a step of rounding; the group's top integer clamped where the float16 scale rounded down
        # (at most (2^bits − 1) steps × its relative rounding 2^-11); float32 rounding of q·scale + zero
        top = (1 << bits) - 1
        bound = step * (0.5 + top * 2.0**-11) + 4 * torch.finfo(torch.float32).eps * x.abs().reshape(err.shape)
        assert bool((err <= bound).all())
        assert torch.equal(fake_quantize(x, bits, 32), q.dequantize())
        assert q.nbytes() == 2 * 3 * 5 * (64 * bits // 8 + 2 * 2 * 2)


def test_blockwise_attention_equals_attention_over_the_dequantized_keys_and_confines_non_finite():
    """Any block size, the float tail, sinks; a NaN key and an inf value reach only the rows that may
    attend their position."""
    g = torch.Generator().manual_seed(0)
    B, H, h, Q, nq, nf, d = 2, 4, 2, 3, 11, 2, 16
    q = torch.randn(B, H, Q, d, generator=g)
    k, v = torch.randn(B, h, nq + nf, d, generator=g), torch.randn(B, h, nq + nf, d, generator=g)
    k[0, 1, 5, 3] = float("nan")
    v[1, 0, 7, 0] = float("inf")
    qk, qv = quantize(k[..., :nq, :], 4, 8), quantize(v[..., :nq, :], 4, 8)
    dk, dv = torch.cat([qk.dequantize(), k[..., nq:, :]], -2), torch.cat([qv.dequantize(), v[..., nq:, :]], -2)
    K = nq + nf
    allowed = torch.rand(B, 1, Q, K, generator=g) > 0.3  # [B, 1, Q, K]
    allowed[0, :, 0, 5] = allowed[1, :, 1, 7] = False  # rows that may not see the NaN key (inf value)
    allowed[0, :, 1, 5] = allowed[1, :, 2, 7] = True
    sinks = torch.randn(H, generator=g)
    ref = attention(q.double(), dk.double(), dv.double(), allowed, sinks=sinks.double())  # [B, H, Q, dv]
    for block in (1, 4, 11, 512):
        out = attend(q, qk, qv, k[..., nq:, :], v[..., nq:, :], lambda a, b: (allowed[..., a:b], None), scale=None,
                     softcap=None, sinks=sinks, block=block)
        finite = ref.isfinite().all(-1)  # [B, H, Q]
        assert torch.equal(out.isfinite().all(-1), finite), f"block={block}: non-finite rows"
        assert_close(torch.where(finite[..., None], out, 0), torch.where(finite[..., None], ref, 0), n=K, msg=f"block={block}")
        assert out[0, 2:4, 1].isnan().all() and out[0, :, 0].isfinite().all()  # K/V head 1 = query heads 2, 3
        assert not out[1, 0:2, 2].isfinite().all(-1).any() and out[1, :, 1].isfinite().all()
        # the model's layout (q a transposed view, the float tail a column slice of a wider tensor), called twice
        qs = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, Q, d] with the strides of [B, Q, H, d]
        wide_k, wide_v = (torch.cat([t, t], -1)[..., nq:, :d] for t in (k, v))  # [B, h, nf, d] odd strides
        for _ in range(2):
            again = attend(qs, qk, qv, wide_k, wide_v, lambda a, b: (allowed[..., a:b], None), scale=None,
                           softcap=None, sinks=sinks, block=block)
            assert torch.equal(again.isfinite(), out.isfinite())
            assert_close(torch.where(finite[..., None], again, 0), torch.where(finite[..., None], ref, 0), n=K)
    assert isinstance(qk, Quantized)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("Q", [1, 2, 5])
def test_both_readings_equal_attention_over_the_dequantized_keys(Q, bits):
    """The factored reading (few rows: scales applied to the products with the integers) and the blockwise
    one (dequantized blocks merged by log-sum-exp) against bhqk's attention over the dequantized keys, with
    a mask, an additive bias, a soft cap and sinks; the model's strides (q a transposed view, the float tail
    a slice of a wider tensor); called twice; a NaN in the float tail takes the blockwise path."""
    from bhqk.budget.quant import _factored_fits
    g = torch.Generator().manual_seed(Q * 10 + bits)
    B, H, h, nq, nf, d, dv = 2, 6, 2, 13, 3, 16, 8
    K = nq + nf
    q = torch.randn(B, Q, H, d, generator=g).transpose(1, 2)  # [B, H, Q, d] with the model's strides
    k, v = torch.randn(B, h, K, d, generator=g) * 3, torch.randn(B, h, K, 2 * dv, generator=g)[..., ::2]  # odd strides
    qk, qv = quantize(k[..., :nq, :], bits, 8), quantize(v[..., :nq, :].contiguous(), bits, 4)
    dk, dvals = torch.cat([qk.dequantize(), k[..., nq:, :]], -2), torch.cat([qv.dequantize(), v[..., nq:, :]], -2)
    allowed = torch.rand(B, 1, Q, K, generator=g) > 0.3  # [B, 1, Q, K]
    allowed[0, :, 0] = False  # a row that sees nothing
    bias = torch.randn(B, H, Q, K, generator=g)
    sinks = torch.randn(H, generator=g)
    ref = attention(q.double(), dk.double(), dvals.double(), allowed, bias=bias.double(), softcap=5.0, scale=0.3,
                    sinks=sinks.double())  # [B, H, Q, dv]
    rows = Q * (H // h)  # G·Q per K/V head; × groups within d and dv: Q = 1 factored, Q = 2 and 5 blockwise
    factored = rows * (d // 8) <= d and rows * (dv // 4) <= dv
    assert _factored_fits(q, qk, qv, k[..., nq:, :], v[..., nq:, :]) == factored
    for block in (1, 5, 64):
        for _ in range(2):
            out = attend(q, qk, qv, k[..., nq:, :], v[..., nq:, :], lambda a, b: (allowed[..., a:b], bias[..., a:b]),
                         scale=0.3, softcap=5.0, sinks=sinks, block=block)
            assert_close(out, ref, n=K, magnitude=float(dvals.abs().max()), msg=f"Q={Q} bits={bits} block={block}")
    tail = k[..., nq:, :].clone()
    tail[1, 0, 1, 2] = float("nan")  # K/V head 0 of sequence 1: its rows that may attend position nq + 1
    assert not _factored_fits(q, qk, qv, tail, v[..., nq:, :])
    out = attend(q, qk, qv, tail, v[..., nq:, :], lambda a, b: (allowed[..., a:b], None), scale=None, softcap=None,
                 sinks=None, block=4)
    sees = allowed[1, 0, :, nq + 1]  # [Q]
    assert torch.equal(out[1, :H // h].isnan().any(-1), sees.expand(H // h, Q)) and out[0].isfinite().all()


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "llama4"])
@torch.no_grad()
def test_chunks_after_quantized_positions_equal_the_emulation(name):
    """Q > 1 over quantized positions (the model's mask taken per block of columns), past the windows."""
    model = _model(name)
    ids, am = _inputs(N=24)
    plan = _mixed(model)
    keeps = plan.full | plan.free(model_map(model).shape)
    cache, ref_cache = plan.cache(model, bits=4, group=GROUP, residual=R, block=BLOCK), FakeQuantCache(keeps, 4, GROUP, R)
    outs, refs, s = [], [], 0
    for c in (9, 1, 6, 1, 7):
        outs.append(model(input_ids=ids[:, s:s + c], attention_mask=am[:, :s + c], cache=cache).logits)  # [B, c, V]
        with plan.emulate(model):
            refs.append(model(input_ids=ids[:, s:s + c], attention_mask=am[:, :s + c], cache=ref_cache).logits)
        s += c
    assert_models_close(torch.cat(outs, 1), torch.cat(refs, 1), width=96, layers=model.config.num_hidden_layers, msg=name)


class _FakeQuantLayer(LayerCache):
    """The emulation on bhqk's own models: an ordinary layer whose K/V heads ``heads`` read their keys and
    values older than the last ``residual`` before this call quantize→dequantize."""

    def __init__(self, bits: int, index: int, heads: list[int]) -> None:
        super().__init__(None, None, index)
        self.bits, self.heads = bits, heads
        self.until = 0  # positions read quantized whatever R says (a cache cropped back into its integers)

    def update(self, k, v):
        P = self.end
        keys, values = super().update(k, v)  # [B, Hkv, P + Q, ·]
        a = max(0, P - R, self.until)  # positions in integers when this call reads
        out = []
        for t in (keys, values):
            t = t.clone()
            t[:, self.heads, :a] = fake_quantize(t[:, self.heads, :a], self.bits, GROUP)  # [B, h, a, ·]
            out.append(t)
        return tuple(out)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("chunks", [[20], [7, 1, 12]])
@pytest.mark.parametrize("which", ["all_full", "mixed"])
def test_own_model_quantized_cache_equals_the_emulation(which, chunks, bits):
    """GPT-2 (bhqk's own) with ``plan.kv_cache(model, bits=...)``: prefill in chunks, then decode steps,
    equal an ordinary cache reading the same quantize→dequantize positions of the full heads (the plan's
    streaming mask edited in by ``plan.emulate``); an all-full plan's crop back into the integers is exact
    and its bytes are the integers and the float tail."""
    from bhqk.budget.quant import QuantizedLayerCache
    from bhqk.budget.ring import BudgetLayerCache
    from bhqk.nn import KVCache
    from test_budget_kvcache import _gpt2
    from test_budget_kvcache import _mixed as _gpt2_mixed
    model = _gpt2()
    ids, am = _inputs()
    plan = Plan(torch.ones(2, 4, dtype=torch.bool)) if which == "all_full" else _gpt2_mixed()
    full = [plan.full[li].nonzero().flatten().tolist() for li in range(2)]  # each layer's full K/V heads

    def emulation():
        return KVCache(layers=[_FakeQuantLayer(bits, li, full[li]) for li in range(2)])

    cache = plan.kv_cache(model, bits=bits, group=GROUP, residual=R, block=BLOCK)
    kinds = {QuantizedLayerCache} if which == "all_full" else {BudgetLayerCache}
    assert {type(layer) for layer in cache} == kinds
    seq = model.generate(ids, 10, attention_mask=am, cache=cache)  # [B, N + 10]
    with plan.emulate(model):
        ref_seq = model.generate(ids, 10, attention_mask=am, cache=emulation())
    assert torch.equal(seq, ref_seq)
    am2 = torch.cat([am, torch.ones(am.shape[0], 10, dtype=am.dtype)], 1)
    logits = {}
    with torch.no_grad():
        for run in ("bits", "ref"):
            c = plan.kv_cache(model, bits=bits, group=GROUP, residual=R, block=BLOCK) if run == "bits" else emulation()
            s, outs = 0, []
            with plan.emulate(model) if run == "ref" else contextlib.nullcontext():
                for n in chunks:
                    outs.append(model(seq[:, s:s + n], am2[:, :s + n], cache=c))  # [B, n, V]
                    s += n
                for t in range(s, seq.shape[1] - 1):  # decode steps, Q = 1
                    outs.append(model(seq[:, t:t + 1], am2[:, :t + 1], cache=c))  # [B, 1, V]
                if which == "all_full":
                    if run == "bits":
                        assert c[0].qk is not None and c[0].qk.n == seq.shape[1] - 1 - R
                        B, Hkv, d = 2, 4, 8  # K and V: B·Hkv·(d·bits/8 + 2 float16 a group) a position, the tail fp32
                        per, tail = 2 * B * Hkv * (d * bits // 8 + 2 * (d // GROUP) * 2), 2 * B * Hkv * R * d * 4
                        assert c.nbytes() == 2 * (c[0].qk.n * per + tail)
                    c.crop(15)  # back into the integers: they stay integers (the emulation reads them so)
                    if run == "bits":
                        assert c[0].qk.n == 15 and c[0].fk.shape[-2] == 0 and c.length == 15
                    else:
                        for layer in c:
                            layer.until = 15
                    outs.append(model(seq[:, 15:16], am2[:, :16], cache=c))  # [B, 1, V]
                elif run == "bits":  # the full heads' layer inside the budget layer holds integers
                    assert c[0].full_cache.qk.n == seq.shape[1] - 1 - R
            logits[run] = torch.cat(outs, 1)  # [B, N + 10 (+ 1), V]
    assert_models_close(logits["bits"], logits["ref"], width=64, layers=2, msg=f"{which} bits={bits} chunks={chunks}")
    if chunks == [20]:  # observed: each layer as one call over the dequantized keys, records the emulation's
        with bhqk.capture(**KW) as got:
            model.generate(ids, NEW, attention_mask=am, cache=plan.kv_cache(model, bits=bits, group=GROUP, residual=R))
        with plan.emulate(model), bhqk.capture(**KW) as want:
            model.generate(ids, NEW, attention_mask=am, cache=emulation())
        assert len(got.records) == 2 * NEW
        _same_records(got.records, want.records, layers=2, msg=f"own model {which} bits={bits}")
    with pytest.raises(ValueError, match="bits must be one of 8, 4"):
        plan.kv_cache(model, bits=3)
    with pytest.raises(ValueError, match="group=5 does not divide the head size d=8"):
        plan.kv_cache(model, bits=8, group=5)
