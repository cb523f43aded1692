"""Which attention calls a ``capture`` or an ``edit`` block selects: call indices (their order inside
the block) and/or module-path globs (matched against ``model.named_modules()``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable


def selectors(layers: int | str | Iterable[int | str] | None, who: str) -> list[int | str] | None:
    """``layers`` as a list (None: every call), each a call index ≥ 0 or a module-path glob; else a
    ValueError naming ``who`` ("capture", "edit")."""
    if layers is None:
        return None
    out = [layers] if isinstance(layers, (int, str)) else list(layers)
    for sel in out:
        if isinstance(sel, bool) or not isinstance(sel, (int, str)) or (isinstance(sel, int) and sel < 0):
            raise ValueError(f"{who}: layers takes call indices >= 0 and module-path names, got {sel!r}.")
    return out


def selected(layers: list[int | str] | None, index: int, name: str) -> bool:
    """The call ``index`` of module path ``name`` is one of ``layers`` (None: every call)."""
    if layers is None:
        return True
    return any(sel == index if isinstance(sel, int) else fnmatch.fnmatchcase(name, sel) for sel in layers)
