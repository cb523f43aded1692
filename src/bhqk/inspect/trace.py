"""``with bhqk.trace() as t: model(x)`` records the named shapes that actually flowed through each
attention call; ``print(t)`` shows the table. Nothing is stored on modules."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .. import observe
from ..text import named_shape


@dataclass
class Call:
    """One attention call: the backend that ran it and the named shapes of its tensors."""

    index: int
    backend: str
    sizes: dict[str, int]
    shapes: dict[str, str]
    mask: str
    module: str = ""
    steps: list[tuple[str, str]] = field(default_factory=list)
    module_id: int | None = field(default=None, repr=False)  # id() of the module that made the call


class Trace:
    """The calls recorded by :func:`trace`; ``print(t)`` (or a bare ``t`` in a notebook) shows them."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.calls: list[Call] = []
        self._names = {id(m): n or type(m).__name__ for n, m in model.named_modules()} if model is not None else {}

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event == "attention":
            p = data["problem"]
            s = p.sizes.size
            mask = repr(p.mask) if p.mask is not None else "none"
            module = data.get("module")
            name = "" if module is None else self._names.get(id(module), "")  # a module path of the traced model
            self.calls.append(Call(len(self.calls), data["backend"], dict(s), call_shapes(s), mask, module=name,
                                   module_id=None if module is None else id(module)))
        elif event == "mha" and self.calls and self.calls[-1].module_id == id(data["module"]):
            m, call = data["module"], self.calls[-1]
            call.module = self._names.get(id(m), f"{type(m).__name__}")
            s = call.sizes
            call.steps.append(("x", named_shape(("B", "Q", "D"), data["x"].shape)))
            call.steps.append(("merge heads", named_shape(("B", "Q", "H·dv"), (s["B"], s["Q"], s["H"] * s["dv"]))))
            call.steps.append(("out", named_shape(("B", "Q", "D"), data["out"].shape)))

    def __len__(self) -> int:
        return len(self.calls)

    def __str__(self) -> str:
        """One block per call, lines of at most WIDTH characters (a part longer than that, e.g. a long
        mask's repr, gets a line of its own)."""
        if not self.calls:
            return "trace: no attention calls recorded"
        n = len(self.calls)
        out = [f"trace: {n} attention call{'s' if n > 1 else ''}"]
        for c in self.calls:
            out += _pack([f"#{c.index} {c.module or '(no module)'}", f"backend {c.backend}", f"mask {c.mask}"], " · ", "", "   ")
            out += _pack([f"{k} {c.shapes[k]}" for k in ("q", "k", "v")] + [f"S, P (virtual) {c.shapes['S, P']}",
                                                                           f"out {c.shapes['out']}"], "   ", "   ", "   ")
            if c.steps:
                out += _pack([f"{k} {v}" for k, v in c.steps], " → ", "   module: ", "     → ")
        return "\n".join(out)

    __repr__ = __str__  # a bare ``t`` in a notebook shows the calls


def call_shapes(s: dict[str, int]) -> dict[str, str]:
    """The named shapes of a call's q, k, v, S and P, and output, from its sizes (B, H, Hkv, Q, K, d, dv)."""
    B, H, Hkv, Q, K, d, dv = (s[n] for n in ("B", "H", "Hkv", "Q", "K", "d", "dv"))
    return {"q": named_shape(("B", "H", "Q", "d"), (B, H, Q, d)), "k": named_shape(("B", "Hkv", "K", "d"), (B, Hkv, K, d)),
            "v": named_shape(("B", "Hkv", "K", "dv"), (B, Hkv, K, dv)),
            "S, P": named_shape(("B", "H", "Q", "K"), (B, H, Q, K)), "out": named_shape(("B", "H", "Q", "dv"), (B, H, Q, dv))}


WIDTH = 100  # columns of ``str(trace)``


def _pack(parts: list[str], sep: str, first: str, cont: str) -> list[str]:
    """``parts`` joined by ``sep`` on as few lines of at most WIDTH characters as fit; the first line
    starts with ``first``, the others with ``cont``."""
    lines: list[str] = []
    line, empty = first, True
    for part in parts:
        if not empty and len(line) + len(sep) + len(part) > WIDTH:
            lines.append(line)
            line = cont + part
        else:
            line += ("" if empty else sep) + part
        empty = False
    return lines + [line]


@contextlib.contextmanager
def trace(model: nn.Module | None = None):
    """Record every attention call inside the block; pass ``model`` to name calls by module path."""
    t = Trace(model)
    with observe.observing(t):
        yield t
