"""The numbers the backends' cost models multiply, kept per machine (``calibrate`` measures them). ``BHQK_COSTS``:
unset: kept in ``$XDG_CACHE_HOME/bhqk/costs.json`` (``~/.cache/...``); a path: kept there; ``reference``: the table
below; ``measure``: measured per process, never kept."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

from ..shortcuts import Cache, declare

VERSION = 7  # bump when what is measured changes: old cache entries are then ignored


class Estimate(NamedTuple):
    """Seconds of one call (inf: not to be picked, ``note`` says why), the ``plan`` its run reuses."""

    seconds: float
    note: str = ""
    plan: object = None  # opaque to auto, handed back to its run


@dataclass(frozen=True)
class Costs:
    """Seconds at d = dv = 64: SDPA's per call, per score entry, extra per entry of a dense mask built for it; tiled: ×
    ``tiled_plan``'s model. Forward+backward: SDPA's ratio to its forward, tiled's scale (None: not measured)."""

    sdpa_call: float
    sdpa_elem: float
    sdpa_mask_elem: float
    tiled_scale: float
    sdpa_backward: float | None = None
    tiled_backward: float | None = None


@dataclass(frozen=True)
class FlexCosts:
    """Compiled FlexAttention: ``compile`` per new kernel (the latest observed), ``call``, ``elem`` per
    score entry of the blocks it visits; ``backward``: forward+backward / forward (None: none here)."""

    compile: float
    call: float
    elem: float
    backward: float | None = None


# The 2-core Intel Xeon (AVX-512, AMX) the project was first tuned on, torch 2.13 (BHQK_COSTS=reference; tests).
REFERENCE = {
    torch.float32: Costs(20e-6, 1.08e-9, 0.81e-9, 1.0, 3.6, 3.1), torch.bfloat16: Costs(20e-6, 0.45e-9, 0.81e-9, 1.1, 6.0, 3.4),
    torch.float16: Costs(20e-6, 1.1e-9, 0.81e-9, 1.1, 3.6, 3.4), torch.float64: Costs(20e-6, 2.4e-9, 1.1e-9, 2.2, 3.6, 6.8),
}

_C = TypeVar("_C", Costs, FlexCosts)
MEMO: Cache[tuple[Costs | FlexCosts | None]] = Cache(
    "cost memo", "reading the costs file at every call auto weighs", "device type, cost kind and dtype, torch.get_num_threads(), "
    "BHQK_COSTS (what machine_key and the file's path depend on in-process)", 64, "a new thread count or BHQK_COSTS is a new "
    "key; keep() replaces its entry")
declare(MEMO)
_FIXED: tuple[dict[torch.dtype, Costs], FlexCosts | None] | None = None  # set inside fixed()


def mode() -> str:  # BHQK_COSTS
    return os.environ.get("BHQK_COSTS", "")


def kept(device: torch.device | str, dtype: torch.dtype, kind: type[_C]) -> _C | None:
    """The costs of ``kind`` kept for this machine (fixed, reference, in-process or in the file), or None."""
    if (fx := _FIXED or ((REFERENCE, None) if mode() == "reference" else None)) is not None:
        if kind is FlexCosts:
            return fx[1]  # type: ignore[return-value]
        return fx[0].get(dtype) or fx[0].get(torch.float32) or REFERENCE.get(dtype, REFERENCE[torch.float32])  # type: ignore[return-value]
    k = _memo_key(device, dtype, kind)
    if (hit := MEMO.lookup(k)) is not None:
        return hit[0]  # type: ignore[return-value]
    if mode() == "measure":  # measured per process: only what keep() put in the memo
        return None
    entry = _read().get(machine_key(k[0]), {}).get(k[1])
    got = kind(**entry) if entry and set(entry) == {f.name for f in fields(kind)} else None
    MEMO.put(k, (got,))
    return got  # type: ignore[return-value]


def _memo_key(device: torch.device | str, dtype: torch.dtype, kind: type) -> tuple:  # MEMO's key
    return (torch.device(device).type, ("flex " if kind is FlexCosts else "") + str(dtype).removeprefix("torch."),
            torch.get_num_threads(), mode())


def keep(device: torch.device | str, dtype: torch.dtype, c: Costs | FlexCosts) -> None:
    """Keep ``c`` for this machine: in-process, and in the file unless BHQK_COSTS says otherwise."""
    k = _memo_key(device, dtype, type(c))
    MEMO.put(k, (c,))
    if (path := stored_in()) is not None:
        data = _read()
        data.setdefault(machine_key(k[0]), {})[k[1]] = asdict(c)
        with contextlib.suppress(OSError):  # a read-only home: the in-process memo still holds
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)


@contextlib.contextmanager
def fixed(table: dict[torch.dtype, Costs] | Costs | None = None, flex: FlexCosts | None = None) -> Iterator[None]:
    """Fixed costs inside the ``with`` block, whatever the machine (default ``REFERENCE``; ``flex``:
    FlexAttention's for every dtype, default none): estimates are then pure functions of the call."""
    global _FIXED
    old, _FIXED = _FIXED, ({torch.float32: table} if isinstance(table, Costs) else table or REFERENCE, flex)
    try:
        yield
    finally:
        _FIXED = old


def machine_key(device_type: str) -> str:
    """What the costs depend on: CPU model and SIMD flags (or GPU name), threads, torch version."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), os.uname().machine)
    flags = next((hashlib.sha1(ln.encode()).hexdigest()[:12] for ln in info if ln.startswith(("flags", "Features"))), "")
    hw = torch.cuda.get_device_name() if device_type == "cuda" and torch.cuda.is_available() else f"{model} flags {flags}"
    return f"v{VERSION} torch {torch.__version__} {device_type} {hw} threads {torch.get_num_threads()}"


def stored_in() -> Path | None:
    """The file measured costs are kept in (None with ``BHQK_COSTS=measure`` or ``reference``)."""
    if mode() in ("measure", "reference"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(mode()) if mode() else Path(base) / "bhqk" / "costs.json"


def _read() -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(stored_in().read_text())  # type: ignore[union-attr]  # called only where a file keeps them
    return {}
