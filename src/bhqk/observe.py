"""Observers: how trace and capture see attention calls without anything stored on modules.

Lower layers call :func:`emit`; nothing happens unless an observer is active (one tuple lookup).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol


class Observer(Protocol):
    def on_event(self, event: str, data: dict[str, Any]) -> None: ...


_ACTIVE: contextvars.ContextVar[tuple[Observer, ...]] = contextvars.ContextVar("bhqk_observers", default=())
_MODULE: contextvars.ContextVar[object | None] = contextvars.ContextVar("bhqk_module", default=None)


def active() -> tuple[Observer, ...]:
    """The observers listening now (empty almost always)."""
    return _ACTIVE.get()


def emit(event: str, **data: Any) -> None:
    """Hand one event to every active observer; ``module`` is the attention module running, if any."""
    data.setdefault("module", _MODULE.get())
    for obs in _ACTIVE.get():
        obs.on_event(event, data)


@contextlib.contextmanager
def scope(module: object) -> Iterator[None]:
    """Mark ``module`` as the one whose attention calls follow (observers see it as ``module``)."""
    token = _MODULE.set(module)
    try:
        yield
    finally:
        _MODULE.reset(token)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Make ``observer`` active inside the ``with`` block."""
    token = _ACTIVE.set(_ACTIVE.get() + (observer,))
    try:
        yield observer
    finally:
        _ACTIVE.reset(token)
