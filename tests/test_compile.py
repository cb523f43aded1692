"""torch.compile: the torch backend compiles to one graph (``fullgraph=True``) with no observer on
the compiled path; the tiled backend and ``auto`` leave the graph in exactly one place
(``registry._outside_graph``) and give the eager answer.

Dynamo is run with ``backend="eager"`` (it traces and checks the graph but generates no code): a
few seconds per test instead of the 10-30 s Inductor takes on these CPUs; the graph it captures is
the same one Inductor would compile."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import bhqk
from bhqk import masks, observe
from tolerance import assert_paths_close

CHAIN = 2 * 16 + 8  # the sums behind one output of tiny_mha: projections (E = 16) and attention (N = 8)


def tiny_mha(backend: str) -> bhqk.MultiHeadAttention:
    torch.manual_seed(0)
    return bhqk.MultiHeadAttention(16, 2, num_kv_heads=1, backend=backend).eval()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_torch_backend_compiles_to_one_graph():
    m = tiny_mha("torch")
    x = torch.randn(2, 8, 16)
    graphs = CompileCounter()
    compiled = torch.compile(m, fullgraph=True, backend=graphs)
    t = time.perf_counter()
    with torch.no_grad():
        out = compiled(x, mask=masks.causal())
    took = time.perf_counter() - t
    assert_paths_close(out, m(x, mask=masks.causal()), n=CHAIN)
    assert graphs.frame_count == 1  # one graph, no observer check, nothing left outside
    print(f"fullgraph compile (dynamo, eager backend) of a tiny MultiHeadAttention: {took:.2f} s")


@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_tiled_and_auto_leave_the_graph_in_one_place(backend):
    m = tiny_mha(backend)
    x = torch.randn(2, 8, 16, requires_grad=True)
    mask = masks.sliding_window(3)
    graphs = CompileCounter()
    out = torch.compile(m, backend=graphs)(x, mask=mask)
    assert graphs.frame_count == 2  # before and after the one break
    ref = m(x, mask=mask)
    assert_paths_close(out, ref, n=CHAIN)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    assert_paths_close(g, g_ref, n=CHAIN)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="_outside_graph"):  # the break is there, and only there
        torch.compile(m, fullgraph=True, backend="eager")(x, mask=mask)


def test_observers_are_off_the_compiled_path_and_counted():
    assert observe._LISTENING == 0 and observe.active() == ()

    class Seen:
        def __init__(self):
            self.events = []

        def on_event(self, event, data):
            self.events.append(event)

    with observe.observing(Seen()) as seen:
        assert observe._LISTENING == 1 and observe.active() == (seen,)
        bhqk.attention(*(torch.randn(1, 1, 3, 4) for _ in range(3)), backend="reference")
    assert seen.events == ["attention"]
    assert observe._LISTENING == 0 and observe.active() == ()


@pytest.mark.slow
def test_inductor_fullgraph_compile_of_the_torch_backend():
    m = tiny_mha("torch")
    x = torch.randn(2, 8, 16)
    compiled = torch.compile(m, fullgraph=True)
    t = time.perf_counter()
    with torch.no_grad():
        out = compiled(x, mask=masks.causal())
    print(f"Inductor fullgraph compile + first call: {time.perf_counter() - t:.1f} s")
    assert_paths_close(out, m(x, mask=masks.causal()), n=CHAIN)
