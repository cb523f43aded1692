"""The "flex" backend (FlexAttention) and the masks' FlexAttention forms, on the CPU.

Most tests run FlexAttention's unfused eager path (``flex.uncompiled()``: same mask_mod, score_mod
and BlockMask, no compile); one default test runs the compiled kernel and checks that a new
length, window or padding does not compile again. Compiling every mask kind is marked slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask

import bhqk
from bhqk import BackendError, masks
from bhqk import bias as biases
from bhqk.functional import calibrate, costs, flex, names
from bhqk.functional.problem import prepare
from bhqk.functional.registry import decide
from bhqk.masks import Extent
from bhqk.masks.view import IndexMap, View
from conftest import mask_kinds, qkv
from tolerance import assert_low_precision_close, assert_paths_close

ROOT = Path(__file__).resolve().parents[1]


def _kinds(B, H, Q, K, seed=0) -> dict[str, masks.Mask]:
    """Every mask kind of conftest, and a ring shard's view of a global mask."""
    out = mask_kinds(B, H, Q, K, seed)
    ext = Extent(B, H, 2 * Q, 2 * K)  # a shard's view of a causal mask twice as large
    out["view"] = View(masks.causal("bottom_right"), ext, IndexMap([(Q, 1, 2)], 2 * Q),
                       IndexMap([(K - K // 2, 0, 1), (K // 2, 2 * K - K // 2, 1)], 2 * K))
    return out


def _evaluate(mod, B, H, Q, K) -> torch.Tensor:
    """A mask_mod on broadcast index tensors, as a bool [B, H, Q, K]."""
    b = torch.arange(B)[:, None, None, None]  # [B, 1, 1, 1]
    h = torch.arange(H)[None, :, None, None]  # [1, H, 1, 1]
    q = torch.arange(Q)[None, None, :, None]  # [1, 1, Q, 1]
    k = torch.arange(K)[None, None, None, :]  # [1, 1, 1, K]
    return mod(b, h, q, k).expand(B, H, Q, K)


# ---- masks as mask_mod and BlockMask ---------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), Q=st.integers(1, 12), K=st.integers(2, 12), seed=st.integers(0, 9))
def test_mask_mod_equals_materialize_for_every_mask(B, H, Q, K, seed):
    for name, m in _kinds(B, H, Q, K, seed).items():
        want = m.materialize(B, H, Q, K).expand(B, H, Q, K)
        assert torch.equal(_evaluate(m.mask_mod(B, H, Q, K), B, H, Q, K), want), name


def test_mask_mod_works_under_vmap_like_create_mask():
    B, H, Q, K = 2, 2, 6, 9
    for name, m in _kinds(B, H, Q, K).items():
        from torch.nn.attention.flex_attention import create_mask

        got = create_mask(m.mask_mod(B, H, Q, K), B, H, Q, K, device="cpu")
        assert torch.equal(got, m.materialize(B, H, Q, K).expand(B, H, Q, K)), name


def _classes(bm, nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool [#B, #H, nq, nk] of a BlockMask."""
    def dense(num, idx):
        out = torch.zeros(*idx.shape[:-1], nk, dtype=torch.bool)
        chosen = torch.arange(idx.shape[-1]) < num[..., None]  # [.., nq, slots]
        out.scatter_(-1, idx.long().clamp(max=nk - 1), chosen)
        return out[..., :nq, :nk]

    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


EXACT = ["causal_tl", "causal_br", "padding", "key_padding", "window", "prefix_lm", "predicate", "dense", "~causal"]


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 2), Q=st.integers(1, 40), K=st.integers(1, 40),
       block=st.sampled_from([4, 8, 16]), seed=st.integers(0, 5))
def test_block_mask_equals_create_block_mask(B, H, Q, K, block, seed):
    nq, nk = -(-Q // block), -(-K // block)
    for name, m in mask_kinds(B, H, Q, K, seed).items():
        ours = m.block_mask(B, H, Q, K, block=block)
        assert ours.shape == (1, 1, Q, K) and ours.BLOCK_SIZE == (block, block)
        ref = create_block_mask(m.mask_mod(B, H, Q, K), B, H, Q, K, device="cpu", BLOCK_SIZE=block)
        (p, f), (rp, rf) = _classes(ours, nq, nk), _classes(ref, nq, nk)
        p, f = p[0, 0], f[0, 0]  # one classification for every (b, h)
        full_everywhere = rf.all(0).all(0)
        some_entry = (rp | rf).any(0).any(0)
        assert not (f & ~full_everywhere).any(), name  # full only where every (b, h) is full
        assert not (some_entry & ~(p | f)).any(), name  # never skips a tile with an allowed entry
        if name in EXACT:  # classify is exact for these (document's id ranges and combinations may say partial)
            assert torch.equal(f, full_everywhere), name
            assert torch.equal(p | f, some_entry), name


def test_block_mask_needs_no_per_pair_evaluation():
    calls = []

    class Counting(masks.Causal):
        def block(self, *a, **kw):
            calls.append(a)
            return super().block(*a, **kw)

    bm = Counting("top_left").block_mask(1, 1, 4096, 4096, block=128)
    assert calls == [] and bm.kv_num_blocks.shape == (1, 1, 32)
    assert int(bm.full_kv_num_blocks.sum()) == 31 * 32 // 2 and int(bm.kv_num_blocks.sum()) == 32  # diagonal tiles partial


def test_mask_errors_reach_block_mask():
    with pytest.raises(bhqk.MaskError, match="alignment"):
        masks.causal().block_mask(1, 1, 3, 5)


# ---- the backend, eager (no compile) ---------------------------------------------------------------

def test_flex_equals_reference_for_a_ring_shards_view():
    """(every other mask kind, on every backend: tests/test_semantics.py)"""
    B, H, Hkv, Q, K = 2, 4, 2, 5, 7  # GQA, Q ≠ K, d ≠ dv
    q, k, v = qkv(B, H, Hkv, Q, K, 8, 6)
    m = _kinds(B, H, Q, K)["view"]
    want, want_lse = bhqk.attention(q, k, v, m, backend="reference", return_lse=True)
    with flex.uncompiled():
        got, lse = bhqk.attention(q, k, v, m, backend="flex", return_lse=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse.to(want_lse.dtype), want_lse)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("extra", ["all"])  # each alone, on every backend: tests/test_semantics.py
def test_flex_bias_softcap_scale_and_layouts(layout, extra):
    B, H, Hkv, Q, K = 2, 4, 1, 6, 9
    q, k, v = qkv(B, H, Hkv, Q, K, 8, 5, seed=3)
    g = torch.Generator().manual_seed(1)
    kw = {
        "dense_bias": dict(bias=torch.randn(B, 1, Q, K, generator=g, dtype=torch.float64)),
        "alibi": dict(bias=biases.alibi(H, "bottom_right")),
        "softcap": dict(softcap=2.0, scale=0.7),
        "all": dict(bias=biases.alibi(H, "bottom_right") + biases.dense(torch.randn(Q, K, generator=g, dtype=torch.float64)),
                    softcap=3.0),
    }[extra]
    m = masks.causal("bottom_right") & masks.padding(torch.tensor([9, 4]))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, N, H, d]
    want = bhqk.attention(q, k, v, m, backend="reference", layout=layout, **kw)
    with flex.uncompiled():
        got = bhqk.attention(q, k, v, m, backend="flex", layout=layout, **kw)
    torch.testing.assert_close(got, want)


def test_flex_sinks_need_the_lse_the_compiled_cpu_kernel_lacks():
    """(flex's sinks seam against the formula, eager: tests/test_semantics.py)"""
    q, k, v = qkv(2, 4, 2, 5, 7, 8)
    p = prepare(q, k, v, sinks=torch.linspace(-1.0, 2.0, 4, dtype=torch.float64))
    assert "sinks" in flex.why_not(p, False)  # compiled on the CPU: no lse, so no sinks
    with flex.uncompiled():
        assert flex.why_not(p, False) is None


# ---- what flex cannot do, in words; auto does not pick it ------------------------------------------

def test_why_not_names_each_limit():
    q, k, v = qkv(1, 2, None, 4, 4, 8, requires_grad=True)
    assert "backward on CPU" in bhqk.why_not("flex", q, k, v)
    with torch.no_grad():
        assert bhqk.why_not("flex", q, k, v) is None
    q, k, v = (t.detach() for t in (q, k, v))
    assert "dropout" in bhqk.why_not("flex", q, k, v, dropout_p=0.1)
    assert "log-sum-exp" in bhqk.why_not("flex", q, k, v, return_lse=True)
    with flex.uncompiled():
        assert bhqk.why_not("flex", q, k, v, return_lse=True) is None
    with pytest.raises(BackendError, match="backward on CPU"):
        bhqk.attention(*qkv(1, 2, None, 4, 4, 8, requires_grad=True), backend="flex")


def test_auto_does_not_weigh_flex_until_its_costs_are_measured(no_span_path):
    assert "flex" in names()
    for Q, m in ((300, masks.sliding_window(16)), (2000, masks.sliding_window(64))):  # calls no fused kernel claims
        q, k, v = qkv(1, 2, None, Q, Q, 16, dtype=torch.float32)
        with torch.no_grad():
            c = decide(prepare(q, k, v, m), False)
        assert c.backend.name != "flex" and "flex" not in c.estimates
        assert "not flex: its costs were never measured on this machine (cpu, float32)" in c.reason


# ---- auto weighs flex where measured, an uncompiled kernel charged its compile ----------------------

FLEX = costs.FlexCosts(compile=0.5, call=1e-4, elem=0.2e-9)  # a FlexAttention 5× cheaper per entry than tiled


@pytest.fixture
def flex_costs(two_threads):
    with costs.fixed(flex=FLEX):
        yield


def _window_call(Q=4096, seed=0):
    q, k, v = qkv(1, 8, None, Q, Q, 64, dtype=torch.float32, seed=seed)
    return prepare(q, k, v, masks.sliding_window(256))


def test_auto_compiles_flex_only_for_a_call_that_pays_for_the_compile_alone(flex_costs, monkeypatch, no_span_path):
    monkeypatch.setattr(flex, "compiled", lambda key, backward=False: False)  # never compiled: decide only, nothing runs
    with torch.no_grad(), costs.fixed(flex=costs.FlexCosts(compile=0.1, call=1e-4, elem=0.2e-9)):
        first = decide(_window_call(), False)
        assert first.name != "flex" and first.estimates["flex"] > 0.1
        assert "flex" in first.reason and "compiling its kernel first (0.1 s)" in first.reason
        long = decide(_window_call(Q=16384), False)  # tiled's estimate alone exceeds flex's and its compile
        assert long.name == "flex" and "compiling its kernel first" in long.reason
        assert decide(_window_call(Q=64), False).name == "torch"  # a tiny call: never


def test_auto_picks_a_compiled_flex_kernel_from_the_first_call(flex_costs, monkeypatch, no_span_path):
    monkeypatch.setattr(flex, "compiled", lambda key, backward=False: True)
    with torch.no_grad():
        c = decide(_window_call(), False)
    assert c.name == "flex" and "compiled" in c.reason and "compiling" not in c.reason


def test_auto_runs_flex_and_it_equals_the_reference(flex_costs, no_span_path):
    q, k, v = qkv(2, 4, 2, 700, 700, 32, dtype=torch.float32)
    m = masks.sliding_window(64) & masks.padding(torch.tensor([700, 500]))
    with flex.uncompiled(), torch.no_grad():  # the eager path compiles nothing: no compile to charge
        assert bhqk.choose_backend(q, k, v, m).name == "flex"
        got = bhqk.attention(q, k, v, m, bias=biases.alibi(4))
    want = bhqk.attention(q, k, v, m, bias=biases.alibi(4), backend="reference")
    assert_paths_close(got, want, n=700)


def test_auto_does_not_weigh_flex_where_it_cannot_run(flex_costs, no_span_path):
    q, k, v = qkv(1, 4, None, 2000, 2000, 64, dtype=torch.float32, requires_grad=True)
    c = decide(prepare(q, k, v, masks.sliding_window(64)), False)  # gradients: no backward on the CPU
    assert c.name != "flex" and "not flex: FlexAttention does not support backward on CPU" in c.reason


def test_measure_flex_keeps_its_costs_and_auto_then_weighs_flex(tmp_path, monkeypatch, no_span_path):
    monkeypatch.setenv("BHQK_COSTS", str(tmp_path / "costs.json"))
    costs.MEMO.clear()
    monkeypatch.setattr(calibrate, "FLEX_N", (256, 512))  # the eager path builds [1, 4, N, N]: keep it small
    monkeypatch.setattr(calibrate, "N", 256)  # decide measures SDPA and tiled for this file too: smaller
    with flex.uncompiled():
        c = calibrate.measure_flex("cpu", torch.float32)
    assert all(math.isfinite(x) and x >= 0 for x in (c.compile, c.call, c.elem)) and c.elem > 0 and c.backward is None
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert any("flex float32" in entry for entry in saved.values())
    costs.MEMO.clear()  # a new process: read back from the file
    assert costs.kept(torch.device("cpu"), torch.float32, costs.FlexCosts) == c
    q, k, v = qkv(1, 2, None, 600, 600, 64, dtype=torch.float32)
    with torch.no_grad(), costs.fixed(flex=dataclasses.replace(c, compile=12.5)):
        c = decide(prepare(q, k, v, masks.sliding_window(64)), False)
    assert c.name != "flex" and c.estimates["flex"] >= 12.5 and "compiling its kernel first (12.5 s)" in c.reason


def test_cli_calibrate_measures_flex_and_says_so(tmp_path, monkeypatch, capsys):
    from bhqk import cli

    monkeypatch.setenv("BHQK_COSTS", str(tmp_path / "costs.json"))
    costs.MEMO.clear()
    monkeypatch.setattr(calibrate, "FLEX_N", (256, 512))
    monkeypatch.setattr(calibrate, "measure", lambda dev, dt, grad=False, old=None: costs.REFERENCE[torch.float32])
    with flex.uncompiled():
        assert cli.main(["calibrate", "--flex"]) == 0
    out = capsys.readouterr().out
    assert "flex (float32):  compile" in out and "auto now weighs it" in out


# ---- compiled: one shared kernel, new sizes do not recompile --------------------------------------

def _compiled_case(Q, K, window, lengths, seed):
    B, H, Hkv = 2, 4, 2
    q, k, v = qkv(B, H, Hkv, Q, K, 16, 16, dtype=torch.float32, seed=seed)
    m = masks.sliding_window(window, align="bottom_right") & masks.padding(lengths)
    kw = dict(bias=biases.alibi(H, "bottom_right"), softcap=4.0)
    got = bhqk.attention(q, k, v, m, backend="flex", **kw)
    want = bhqk.attention(q, k, v, m, backend="reference", **kw)
    reach = 4.0 + float(kw["bias"].slopes.max()) * window  # |S| ≤ softcap + ALiBi within the window
    assert_paths_close(got, want, n=K, magnitude=float(v.abs().max()) * (1 + reach))


def test_compiled_flex_equals_reference_and_new_sizes_do_not_recompile():
    _compiled_case(130, 200, 40, torch.tensor([200, 150]), 0)  # compiles (Q ≠ K, several tiles)
    graphs, kernels = counters["stats"]["unique_graphs"], len(flex.kernels())
    _compiled_case(300, 260, 100, torch.tensor([90, 260]), 1)  # new lengths, window, padding
    _compiled_case(257, 385, 7, torch.tensor([385, 1]), 2)
    assert counters["stats"]["unique_graphs"] == graphs and len(flex.kernels()) == kernels


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_kinds(2, 4, 150, 170)) + ["none"])
def test_compiled_flex_every_mask_kind(kind):
    B, H, Hkv, Q, K = 2, 4, 2, 150, 170
    q, k, v = qkv(B, H, Hkv, Q, K, 16, 16, dtype=torch.float32)
    m = None if kind == "none" else _kinds(B, H, Q, K)[kind]
    assert_paths_close(bhqk.attention(q, k, v, m, backend="flex"), bhqk.attention(q, k, v, m, backend="reference"), n=K)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_flex_low_precision(dtype):
    q, k, v = qkv(1, 4, 2, 200, 300, 32, dtype=dtype)
    m = masks.causal("bottom_right")
    want = bhqk.attention(*(t.double() for t in (q, k, v)), m, backend="reference")
    with sdpa_kernel(SDPBackend.MATH):  # PyTorch's own math path at the same precision
        math = F.scaled_dot_product_attention(q, *(t.repeat_interleave(2, dim=1) for t in (k, v)),
                                              attn_mask=m.materialize(1, 4, 200, 300))
    assert_low_precision_close(bhqk.attention(q, k, v, m, backend="flex"), want, math, n=300)


# ---- the GPU script on a machine without CUDA ------------------------------------------------------

def test_gpu_benchmark_exits_clearly_without_cuda(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA device, even on a GPU machine
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--out", "/dev/null"])
    with pytest.raises(SystemExit) as e:
        gpu.main()
    assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_a_gpu_user_is_told_once_to_measure_flex_when_auto_cannot_weigh_it(monkeypatch):
    from bhqk.errors import PerformanceHint

    monkeypatch.setattr(flex, "_HINTED", set())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # devices as values: no GPU needed to build them
    with pytest.warns(PerformanceHint, match=r"bhqk calibrate --device cuda --flex"):
        flex.hint(cuda, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flex.hint(cuda, torch.bfloat16)  # once per device type and dtype
        flex.hint(cpu, torch.float32)  # on the CPU tiled is the fast path
        with costs.fixed(flex=FLEX):  # measured: auto weighs flex, nothing to say
            q = torch.zeros(1, 1, 4, 16)
            flex.estimate(prepare(q, q, q, masks.causal()), False, costs.REFERENCE[torch.float32])


@pytest.mark.slow
def test_gpu_benchmark_logic_runs_on_the_cpu_in_smoke_mode(tmp_path):
    """benchmarks/gpu.py --smoke --device cpu: every section's logic, tiny sizes, flex eager."""
    import subprocess

    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    judged = [x for x in data["correctness"] if "within_bound" in x]
    assert judged and all(x["within_bound"] for x in judged)
    assert {x["backend"] for x in judged} >= {"reference", "torch", "tiled", "auto"}  # flex: no CPU backward
    assert data["costs"]["flex_costs"]["elem"] > 0 and len(data["costs"]["choices"]) == 2 * 4 * 2
    assert not data.get("errors")


def test_why_not_says_when_the_cpu_has_no_cpp_compiler(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    flex._no_compiler.cache_clear()
    try:
        q, k, v = qkv(1, 2, None, 4, 4, 8)
        with torch.no_grad():
            assert "needs a C++ compiler (g++ / clang++) and none is on PATH" in bhqk.why_not("flex", q, k, v)
    finally:
        flex._no_compiler.cache_clear()


def test_a_kernel_that_fails_to_compile_is_refused_and_auto_runs_its_next_choice(flex_costs, monkeypatch, no_span_path):
    def broken(key):
        def fail(*args):
            raise NotImplementedError("NYI: a lowering this structure needs")
        return fail

    monkeypatch.setattr(flex, "kernel", broken)
    monkeypatch.setattr(flex, "compiled", lambda key, backward=False: True)  # no compile to pay: auto picks flex
    monkeypatch.setattr(flex, "_BROKEN", {})
    q, k, v = qkv(1, 8, None, 2048, 2048, 64, dtype=torch.float32)
    m = masks.sliding_window(256)
    with torch.no_grad():
        assert bhqk.choose_backend(q, k, v, m).name == "flex"
        with bhqk.trace() as t:
            out = bhqk.attention(q, k, v, m)  # flex fails to compile: auto decides again
        assert [c.backend for c in t.calls] == ["tiled"]
        assert_paths_close(out, bhqk.attention(q, k, v, m, backend="reference"), n=2048)
        reason = bhqk.why_not("flex", q, k, v, m)
        assert "failed to compile here (NotImplementedError: NYI: a lowering this structure needs)" in reason
        assert "not flex: its kernel for this structure failed to compile" in bhqk.choose_backend(q, k, v, m).reason
        with pytest.raises(BackendError, match="failed to compile"):  # asked by name: the error, not a fallback
            bhqk.attention(q, k, v, m, backend="flex")
