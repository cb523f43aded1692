"""What every ``bhqk`` command shares: the argparse types its options are checked with, and how long
work reports itself (a bar on a terminal; off a terminal, where a command asks for it, a line per
stage or step on stderr). viz, inspect, budget, models and the entry point import it from here.

Options are validated when they are parsed (an argparse ``type`` per kind of value), so a bad value
is one ``bhqk CMD: error: argument --x: ...`` line and exit status 2 before any work starts."""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# --- argument types: each turns a bad value into one argparse error -----------------------------


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def finite_float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (``nan`` and ``inf`` are refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {value:g}")
        return value

    parse.__name__ = f"number >= {low:g}"
    return parse


def int_list(low: int | None = None) -> Callable[[str], list[int]]:
    """An argparse type: comma- (or space-) separated integers, at least one, each >= ``low``."""

    def parse(text: str) -> list[int]:
        parts = [x for x in text.replace(" ", ",").split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}")
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,5, got {text!r}") from None
        if low is not None and any(v < low for v in values):
            raise argparse.ArgumentTypeError(f"every value must be >= {low}, got {text!r}")
        return values

    parse.__name__ = "list of integers"
    return parse


def fraction_list(text: str) -> list[float]:
    """An argparse type: comma-separated numbers in [0, 1]; ``a,b,...,z`` (or ``…``) is the progression
    a, b, … up to z, z included (``0,0.3,...,1`` is 0, 0.3, 0.6, 0.9, 1)."""
    parts = [x.strip() for x in text.replace(" ", ",").split(",") if x.strip()]
    try:
        if len(parts) == 4 and parts[2] in ("...", "…"):
            a, b, z = float(parts[0]), float(parts[1]), float(parts[3])
            if not b > a or z < a:
                raise argparse.ArgumentTypeError(f"a progression a,b,...,z needs a < b and a <= z, got {text!r}")
            step = b - a
            n = int(math.floor((z - a) / step + 1e-9))
            values = [round(a + i * step, 10) for i in range(n + 1)]
            if values[-1] < z - 1e-9:  # the step does not land on z: z is still the last depth
                values.append(z)
        else:
            values = [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0,0.5,1 or 0,0.1,...,1, "
                                         f"got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"every depth must be a number in [0, 1], got {text!r}")
    return values


def backend_name(text: str) -> str:
    """An argparse type: the name of a registered attention backend."""
    from .functional import names

    if text not in names():
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose from {', '.join(names())}")
    return text


def sentence(text: str) -> str:
    """An argparse type: a sentence with at least one non-space character."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"a sentence is empty ({text!r}); give every sentence some text")
    return text


def text(value: str) -> str:
    """An argparse type: a text with at least one non-space character (``bhqk show``, ``trace``, ``generate``)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"the text is empty ({value!r}); give some words to read")
    return value


def output_file(*suffixes: str) -> Callable[[str], Path]:
    """An argparse type: a path whose suffix says the format (one of ``suffixes``)."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: the suffix says the format; use one of {', '.join(suffixes)}")
        return path

    parse.__name__ = "output file"
    return parse


def plain(doc: str | None) -> str:
    """A docstring as ``--help`` text: without reST markup (````x```` and ``:func:`x``` become x)."""
    out = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return out.replace("``", "")


BACKEND_HELP = "attention backend: auto (default), reference, torch, tiled, or another registered name"

# --- progress -----------------------------------------------------------------------------------

_LINES = [False]  # a command that runs for minutes asks for lines off a terminal (lines_off_terminal)


def progress_enabled() -> bool:
    """Progress bars only when both stdout and stderr are terminals (quiet when piped or captured)."""
    try:
        return sys.stderr.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


@contextlib.contextmanager
def lines_off_terminal() -> Iterator[None]:
    """Inside the block, off a terminal, every bar of :func:`progress` and every :func:`stage` is a line
    per step on stderr (a command that runs for minutes is not silent when its output is piped)."""
    before = _LINES[0]
    _LINES[0] = True
    try:
        yield
    finally:
        _LINES[0] = before


def say(line: str) -> None:
    """``line`` on stderr, off a terminal inside :func:`lines_off_terminal` (on a terminal the bars speak)."""
    if _LINES[0] and not progress_enabled():
        print(line, file=sys.stderr, flush=True)


class Lines:
    """A stand-in for a tqdm bar off a terminal: a line on stderr per :meth:`update` (``desc i/total (s)``)."""

    disable = False

    def __init__(self, iterable: Any = None, desc: str = "", total: int | None = None, **_: Any) -> None:
        self.iterable, self.desc, self.n, self.t0 = iterable, desc.strip(), 0, time.perf_counter()
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)

    def update(self, n: int = 1) -> None:
        self.n += n
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.desc} {self.n}{of} ({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)

    def __iter__(self) -> Iterator[Any]:
        for x in self.iterable:
            yield x
            self.update(1)

    def close(self) -> None:
        pass

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(iterable: Any = None, *, disable: bool = False, **kwargs: Any) -> Any:
    """tqdm's bar, except off a terminal inside :func:`lines_off_terminal`: :class:`Lines`."""
    if not disable and _LINES[0] and not progress_enabled():
        return Lines(iterable, **kwargs)
    from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs in the venv)

    return tqdm(iterable, disable=disable, **kwargs)


def progress(iterable: Any = None, **kwargs: Any) -> Any:
    """A bar on stderr on a terminal (:func:`progress_enabled`); off one, lines inside
    :func:`lines_off_terminal`, else nothing."""
    kwargs = {"leave": False, "dynamic_ncols": True, **kwargs}
    return progress_bar(iterable, disable=not (progress_enabled() or _LINES[0]), **kwargs)


@contextlib.contextmanager
def stage(desc: str) -> Iterator[None]:
    """Work that reports nothing while it runs (loading a model): a one-step bar on a terminal; off one,
    inside :func:`lines_off_terminal`, ``desc …`` and then ``desc: done (s)`` on stderr."""
    if _LINES[0] and not progress_enabled():
        t0 = time.perf_counter()
        say(f"{desc} …")
        yield
        say(f"{desc}: done ({time.perf_counter() - t0:.1f} s)")
        return
    with progress(total=1, desc=desc, bar_format="{desc} … {elapsed}") as bar:
        yield
        bar.update(1)


class Ticker:
    """An observer that advances a bar by one every ``per`` attention calls."""

    def __init__(self, bar: Any, per: int = 1) -> None:
        self.bar, self.per, self.calls = bar, max(1, per), 0

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event == "attention":
            self.calls += 1
            if self.calls % self.per == 0:
                self.bar.update(1)


@contextlib.contextmanager
def attention_progress(desc: str, total: int | None = None, per: int = 1, unit: str = " attention call") -> Iterator[None]:
    """A bar that advances as attention calls run (one tick per ``per`` calls)."""
    from .observe import observing

    with progress(total=total, desc=desc, unit=unit) as bar:
        if bar.disable:
            yield
            return
        with observing(Ticker(bar, per)):
            yield


__all__ = ["int_at_least", "finite_float_at_least", "int_list", "fraction_list", "backend_name", "sentence", "text",
           "output_file", "plain", "BACKEND_HELP", "progress_enabled", "lines_off_terminal", "say", "Lines",
           "progress_bar", "progress", "stage", "Ticker", "attention_progress"]
