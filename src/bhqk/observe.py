"""Observers: how trace and capture see attention calls without anything stored on modules.

Lower layers call :func:`emit`; nothing happens unless an observer is active (one integer test).
:func:`active` reads a plain module-level count before the ``ContextVar``: ``torch.compile`` traces
the count (and guards on it) but cannot trace a ``ContextVar``, so with no observer anywhere the
compiled path never touches one (a capture inside a compiled call is not supported).

Editors (``bhqk.edit``) are the one write-side hook: :func:`editors` is read the same way (a module
count first) and :func:`edit` hands a call's output to them before observers see it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol


class Observer(Protocol):
    """Receives events (``on_event``). An observer with a true ``wants_lse`` attribute asks ``auto``
    calls on the CPU for their log-sum-exp (:func:`wants_lse`): the span path returns it from the
    same fused-kernel call, where the statistics would otherwise run the kernel again for it."""

    def on_event(self, event: str, data: dict[str, Any]) -> None: ...


_ACTIVE: contextvars.ContextVar[tuple[Observer, ...]] = contextvars.ContextVar("bhqk_observers", default=())
_MODULE: contextvars.ContextVar[object | None] = contextvars.ContextVar("bhqk_module", default=None)
_LISTENING = 0  # observing() blocks open in any thread or context; 0: nobody listens anywhere
_EDITORS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("bhqk_editors", default=())
_EDITING = 0  # editing() blocks open anywhere; 0: no edit anywhere (read first, like _LISTENING)


def active() -> tuple[Observer, ...]:
    """The observers listening now (empty almost always)."""
    if not _LISTENING:  # compile-safe: a module global, not the ContextVar
        return ()
    return _ACTIVE.get()


def quiet() -> bool:
    """Nobody listens or edits anywhere (two integer tests): :func:`scope` would do nothing."""
    return not (_LISTENING or _EDITING)


def wants_lse() -> bool:
    """An active observer asks for each call's log-sum-exp (``Observer.wants_lse``)."""
    return _LISTENING > 0 and any(getattr(o, "wants_lse", False) for o in _ACTIVE.get())


def emit(event: str, **data: Any) -> None:
    """Hand one event to every active observer; ``module`` is the attention module running, if any."""
    data.setdefault("module", _MODULE.get())
    for obs in _ACTIVE.get():
        obs.on_event(event, data)


@contextlib.contextmanager
def scope(module: object) -> Iterator[None]:
    """Mark ``module`` as the one whose attention calls follow (observers see it as ``module``).
    With nobody listening or editing it does nothing (so a compiled module never touches the ``ContextVar``)."""
    if not (_LISTENING or _EDITING):
        yield
        return
    token = _MODULE.set(module)
    try:
        yield
    finally:
        _MODULE.reset(token)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Make ``observer`` active inside the ``with`` block."""
    global _LISTENING
    token = _ACTIVE.set(_ACTIVE.get() + (observer,))
    _LISTENING += 1
    try:
        yield observer
    finally:
        _LISTENING -= 1
        _ACTIVE.reset(token)


# ---- editors: bhqk.edit changes the output of the attention calls it selects ------------------------

def editors() -> tuple[Any, ...]:
    """The edits active now (empty almost always; compile-safe like :func:`active`)."""
    if not _EDITING:
        return ()
    return _EDITORS.get()


def edit(problem: Any, out: Any, lse: Any, backend: str) -> tuple[Any, Any, Any]:
    """Hand one attention call's result to the active edits; returns ``(problem, out, lse)`` as
    edited (the problem observers should see). The first editor combines every active one
    (``apply(editors, problem, out, lse, backend, module)``), so nested edits compose."""
    eds = _EDITORS.get()
    if not eds:
        return problem, out, lse
    return eds[0].apply(eds, problem, out, lse, backend, _MODULE.get())


@contextlib.contextmanager
def editing(editor: Any) -> Iterator[Any]:
    """Make ``editor`` active inside the ``with`` block (after the ones already active)."""
    global _EDITING
    token = _EDITORS.set(_EDITORS.get() + (editor,))
    _EDITING += 1
    try:
        yield editor
    finally:
        _EDITING -= 1
        _EDITORS.reset(token)
