"""What attention costs on the machine at hand: the numbers ``auto``'s cost model multiplies.

The machines bhqk runs on differ by more than any constant can absorb (an AVX-512/AMX Xeon ran
SDPA-flash fp32 N=4096 forward in 140 ms, an AVX2 EPYC in 370 ms; tiled/SDPA was 1.25× on one and
1.8× on the other; a GPU is another world). So the costs are measured where they are used: a few
small SDPA and tiled calls per (device type, dtype), the first time ``auto`` needs them, the
backward only when a call needs gradients. They are kept in-process and in a JSON file per machine
and torch version, so a process pays for the measurement once per machine.

``BHQK_COSTS`` chooses where they come from:

- unset: measured, cached in ``$XDG_CACHE_HOME/bhqk/costs.json`` (``~/.cache/bhqk/costs.json``);
- a file path: the same, cached in that file (edit it to override a measured value);
- ``reference``: the built-in costs of the 2-core Xeon the project was tuned on (no measuring);
- ``measure``: measured in every process, never read from or written to a file.

Tests inject fixed costs with :func:`fixed`, so the choices they check do not depend on the machine.

FlexAttention's costs (:class:`FlexCosts`: the compile, per call, per visited score entry) are
never measured implicitly: measuring them compiles a kernel (tens of seconds on a CPU). They are
measured by :func:`measure_flex` (``bhqk calibrate --flex``), kept in the same file, and updated
with every compile bhqk observes; until they exist, ``auto`` does not weigh ``flex``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch

from .. import masks
from . import tiled, tiled_plan, torch_sdpa
from .problem import prepare

VERSION = 6  # bump when what is measured changes: old cache entries are then ignored


@dataclass(frozen=True)
class Costs:
    """Seconds, per (device type, dtype), at head dimension d = dv = 64.

    SDPA: ``sdpa_call`` per call, ``sdpa_elem`` per score entry (one query-key pair of one head)
    without a mask, × ``sdpa_causal`` with ``is_causal``, + ``sdpa_mask_elem`` per score entry when
    it is handed a dense mask or bias, + ``sdpa_build_elem`` per [Q, K] entry of a structured mask
    it materializes for SDPA. Tiled: ``tiled_plan``'s model (fitted on the reference
    machine) split into its fixed part (per call, rectangle, row group) and its per-entry part,
    scaled by ``tiled_fixed`` and ``tiled_elem``. ``*_backward``: forward+backward time / forward
    time (None: not measured yet)."""

    sdpa_call: float
    sdpa_elem: float
    sdpa_causal: float
    sdpa_mask_elem: float
    tiled_fixed: float
    tiled_elem: float
    sdpa_build_elem: float = 0.0
    sdpa_backward: float | None = None
    tiled_backward: float | None = None
    source: str = "measured"
    sdpa_causal_backward: float | None = None  # is_causal's share of SDPA's forward+backward (None: sdpa_causal)


# The 2-core Intel Xeon (AVX-512, AMX) the project was first tuned on, torch 2.13, B=1, H=8, d=64 (the constants
# auto used before it measured): used with BHQK_COSTS=reference and for tests.
REFERENCE = {
    torch.float32: Costs(20e-6, 1.08e-9, 0.6, 0.31e-9, 1.0, 1.0, 0.5e-9, 3.6, 3.1, "reference"),
    torch.bfloat16: Costs(20e-6, 0.45e-9, 0.75, 0.31e-9, 1.0, 1.1, 0.5e-9, 6.0, 3.1, "reference"),
    torch.float16: Costs(20e-6, 1.1e-9, 0.6, 0.31e-9, 1.0, 1.1, 0.5e-9, 3.6, 3.1, "reference"),
    torch.float64: Costs(20e-6, 2.4e-9, 0.6, 0.62e-9, 1.0, 2.2, 0.5e-9, 3.6, 3.1, "reference"),
}

@dataclass(frozen=True)
class FlexCosts:
    """Seconds, per (device type, dtype), of compiled FlexAttention at d = dv = 64: ``compile`` per
    new kernel (a new mask / bias structure; the latest compile observed), ``call`` per call and
    ``elem`` per score entry of the blocks it visits (full and partial 128×128 blocks of the
    ``BlockMask``, × B·H); ``backward``: forward+backward / forward time (None: not measured; on
    the CPU FlexAttention has no backward)."""

    compile: float
    call: float
    elem: float
    backward: float | None = None
    source: str = "measured"


_C = TypeVar("_C", Costs, FlexCosts)

_MEMO: dict[tuple[str, str], Costs] = {}  # in-process: (device type, dtype) -> costs
_FLEX_MEMO: dict[tuple[str, str], FlexCosts] = {}  # in-process: (device type, dtype) -> FlexAttention's costs
_FIXED: list[Callable[[str, torch.dtype], Costs] | None] = [None]  # set by fixed()
_FIXED_FLEX: list[Callable[[str, torch.dtype], FlexCosts | None] | None] = [None]  # set by fixed(..., flex=)


def costs(device: torch.device, dtype: torch.dtype, grad: bool = False) -> Costs:
    """The costs of attention on ``device``'s type in ``dtype`` (measured once; see the module doc)."""
    if _FIXED[0] is not None:
        return _FIXED[0](device.type, dtype)
    mode = os.environ.get("BHQK_COSTS", "")
    if mode == "reference":
        return REFERENCE.get(dtype, REFERENCE[torch.float32])
    key = _key(device, dtype)
    c = _MEMO.get(key)
    if c is None and mode != "measure":
        c = _load(key, Costs)
    if c is None:
        c = measure(device, dtype)
    if grad and None in (c.sdpa_backward, c.tiled_backward, c.sdpa_causal_backward):
        c = _with_backward(c, measure_backward(device, dtype))
    if _MEMO.get(key) != c:
        _MEMO[key] = c
        if mode != "measure":
            _store(key, c)
    return c


def _key(device: torch.device | str, dtype: torch.dtype, what: str = "") -> tuple[str, str]:
    return torch.device(device).type, what + str(dtype).removeprefix("torch.")


def flex_costs(device: torch.device, dtype: torch.dtype) -> FlexCosts | None:
    """FlexAttention's measured costs on ``device``'s type in ``dtype``, or None where they were
    never measured here (``auto`` then does not weigh it; :func:`measure_flex` measures them).
    ``BHQK_COSTS=reference`` has none: the reference table predates FlexAttention in bhqk."""
    if _FIXED_FLEX[0] is not None:
        return _FIXED_FLEX[0](torch.device(device).type, dtype)
    mode = os.environ.get("BHQK_COSTS", "")
    if mode == "reference":
        return None
    key = _key(device, dtype, "flex ")
    c = _FLEX_MEMO.get(key)
    if c is None and mode != "measure":
        c = _load(key, FlexCosts)
        if c is not None:
            _FLEX_MEMO[key] = c
    return c


def observed_compile(device: torch.device, dtype: torch.dtype, seconds: float) -> None:
    """Record a compile bhqk just paid (the first call of a new FlexAttention kernel): the
    estimate of the next compile on this machine, where FlexAttention's costs were measured."""
    if _FIXED_FLEX[0] is not None:
        return
    c = flex_costs(device, dtype)
    if c is not None:
        _keep_flex(_key(device, dtype, "flex "), replace(c, compile=seconds))


def _keep_flex(key: tuple[str, str], c: FlexCosts) -> None:
    _FLEX_MEMO[key] = c
    if stored_in() is not None:
        _store(key, c)


@contextlib.contextmanager
def fixed(table: dict[torch.dtype, Costs] | Costs | None = None, flex: FlexCosts | None = None) -> Iterator[None]:
    """Use fixed costs inside the ``with`` block (default: ``REFERENCE``), whatever the machine;
    estimates are then pure functions of the call (no measured planning time). ``flex``:
    FlexAttention's costs for every device and dtype (default None: auto does not weigh it)."""
    table = REFERENCE if table is None else table
    if isinstance(table, Costs):
        table = replace(table, source="fixed")
    else:
        table = {dt: replace(c, source="fixed") for dt, c in table.items()}
    fixed_flex = None if flex is None else replace(flex, source="fixed")
    old, old_flex = _FIXED[0], _FIXED_FLEX[0]
    _FIXED[0] = (lambda dev, dt: table) if isinstance(table, Costs) else (lambda dev, dt: table.get(dt, table[torch.float32]))
    _FIXED_FLEX[0] = lambda dev, dt: fixed_flex
    try:
        yield
    finally:
        _FIXED[0], _FIXED_FLEX[0] = old, old_flex


# ---- measuring ------------------------------------------------------------------------------------

N, H, D = 512, 4, 64  # the measured call: [1, H, N, D]; ~1 M score entries, a few ms on a CPU core
N_BIG = 2048  # SDPA's per-entry cost and its causal share: at N = 512 its causal kernel skips nothing measurable


SAMPLE_S = 4e-3  # each timed sample repeats a call until it lasts about this long


def _fastest(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5) -> dict[str, float]:
    """Seconds per call of each function: the fastest of ``rounds`` samples, the functions
    interleaved round by round after one warm-up each (the machines are shared: interleaving lets
    a burst of load hit every function alike, and only the ratios between them decide anything).
    A sample repeats a short call until it lasts ``SAMPLE_S``: a 0.5 ms call that loses the core
    for a scheduler slice measured 20-40× too slow in every round, a 10 ms one tiled call 5×.
    Rounds go on (up to 3 × ``rounds``) until each function's two fastest samples agree."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best2 = {name: [float("inf"), float("inf")] for name in fns}  # the two fastest samples of each
    reps = dict.fromkeys(fns, 1)
    r = 0
    while r <= rounds or (r <= 3 * rounds and not _settled(best2)):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            sync()
            took = (time.perf_counter() - t) / reps[name]
            if r:
                best2[name] = sorted(best2[name] + [took])[:2]
            else:
                reps[name] = max(1, min(50, round(SAMPLE_S / max(took, 1e-6))))
        r += 1
    return {name: b[0] for name, b in best2.items()}


def _settled(best2: dict[str, list[float]], spread: float = 0.1) -> bool:
    """Every function's two fastest samples agree within ``spread`` (under a burst of load the
    fastest sample so far is not yet the function's speed)."""
    return all(b[1] <= (1 + spread) * b[0] for b in best2.values())


def _inputs(device: torch.device, dtype: torch.dtype, n: int = N, h: int = H,
            grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, D, generator=g).to(device=device, dtype=dtype).requires_grad_(grad) for _ in range(3))
    return q, k, v  # [1, h, n, D] each


def measure(device: torch.device, dtype: torch.dtype) -> Costs:
    """Time SDPA (no mask, is_causal, a dense mask; a tiny call), building a mask, and the tiled
    backend (an element-bound and an overhead-bound call), forward only, interleaved,
    each sample about ``SAMPLE_S`` long: about 0.2 s in all on a quiet 2-core machine."""
    q, k, v = _inputs(device, dtype)
    tq, tk, tv = _inputs(device, dtype, 16, 1)
    dense = masks.dense(torch.rand(1, 1, N, N, generator=torch.Generator().manual_seed(1)).to(device) > 0.1)
    tiled_calls = []  # (p, plan): an element-bound call and an overhead-bound one (few rows)
    for args in ((q, k, v), _inputs(device, dtype, 128, 1)):
        p = prepare(*args, masks.causal())
        tiled_calls.append((p, tiled_plan.plan_for(p)))
    bq, bk, bv = _inputs(device, dtype, N_BIG)
    fns = {
        "plain": lambda: torch_sdpa.run(prepare(q, k, v)),
        "plain_big": lambda: torch_sdpa.run(prepare(bq, bk, bv)),
        "causal_big": lambda: torch_sdpa.run(prepare(bq, bk, bv, masks.causal())),
        "mask": lambda: torch_sdpa.run(prepare(q, k, v, dense)),
        "call": lambda: torch_sdpa.run(prepare(tq, tk, tv)),
        "build": lambda: masks.sliding_window(N // 8).materialize(1, 1, N, N, device),
        "tiled": lambda: tiled.forward(*tiled_calls[0]),
        "tiled_small": lambda: tiled.forward(*tiled_calls[1]),
    }
    with torch.no_grad():
        t = _fastest(fns, device)
    entries = H * N * N
    call = min(t["call"], t["plain"])
    elem = max(t["plain_big"] - call, 0.1 * t["plain_big"]) / (H * N_BIG * N_BIG)
    (f1, e1), (f2, e2) = (tiled_parts(*c) for c in tiled_calls)
    t1, t2 = t["tiled"], t["tiled_small"]
    det = f1 * e2 - f2 * e1
    a_fixed, a_elem = ((t1 * e2 - t2 * e1) / det, (f1 * t2 - f2 * t1) / det) if det else (-1.0, -1.0)
    if a_fixed <= 0 or a_elem <= 0:  # noise broke the fit: one scale for both parts
        a_fixed = a_elem = (t1 + t2) / (f1 + e1 + f2 + e2)
    causal = _causal_share(t["causal_big"], t["plain_big"], call)
    return Costs(call, elem, causal, max(0.0, t["mask"] - t["plain"]) / entries, a_fixed, a_elem, t["build"] / (N * N))


def _with_backward(c: Costs, ratios: dict[str, float]) -> Costs:
    return replace(c, sdpa_backward=ratios["sdpa_backward"], tiled_backward=ratios["tiled_backward"],
                   sdpa_causal_backward=ratios["sdpa_causal_backward"])


def _causal_share(causal: float, plain: float, call: float) -> float:
    """is_causal's time over the unmasked one, per entry (0.3 … 1)."""
    return min(1.0, max(0.3, (causal - call) / max(plain - call, 1e-9)))


def remeasure(device: torch.device | str, dtype: torch.dtype) -> Costs:
    """Measure SDPA's and the tiled backend's costs again, forward and forward+backward, and keep
    them (in the file unless ``BHQK_COSTS`` is ``measure`` or ``reference``), replacing old ones."""
    device = torch.device(device)
    c = _with_backward(measure(device, dtype), measure_backward(device, dtype))
    key = _key(device, dtype)
    _MEMO[key] = c
    if stored_in() is not None:
        _store(key, c)
    return c


def stored_in() -> Path | None:
    """The file measured costs are kept in (None with ``BHQK_COSTS=measure`` or ``reference``)."""
    return None if os.environ.get("BHQK_COSTS", "") in ("measure", "reference") else _path()


def tiled_parts(p, plan) -> tuple[float, float]:
    """``plan.cost`` (tiled_plan's model) split into its fixed part and its per-entry part."""
    rows_per_q, n = p.ext.B * p.ext.H, len(tiled_plan.split(p.ext.B, p.sizes["Hkv"], tiled_plan.workers(p.q.device)))
    total = plan.cost(rows_per_q, n)
    per_entry = total - plan.cost(0, n)  # the model's per-entry, per-row part scales with rows_per_q
    return total - per_entry, per_entry


def measure_backward(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Forward+backward / forward of SDPA and of the tiled backend: no mask, N = 1024 (4 M score
    entries, where the per-entry costs dominate as they do in the calls that matter); and
    is_causal's share of SDPA's forward+backward at N = ``N_BIG``."""
    q, k, v = _inputs(device, dtype, 2 * N, grad=True)  # at N=512 fixed costs dominate both backwards (SDPA 20×, tiled 1.5×)
    bq, bk, bv = _inputs(device, dtype, N_BIG, grad=True)
    fns: dict[str, Callable[[], object]] = {}
    for name, mask in (("sdpa_big_both", None), ("sdpa_causal_big_both", masks.causal())):
        def big(mask=mask):
            out = torch_sdpa.run(prepare(bq, bk, bv, mask))[0]
            out.sum().backward()

        fns[name] = big
    for name, run in (("sdpa", torch_sdpa.run), ("tiled", tiled.run)):
        def fwd(run=run):
            with torch.no_grad():
                run(prepare(q, k, v))

        def both(run=run):
            out, _ = run(prepare(q, k, v))
            out.sum().backward()

        fns[name], fns[name + "_both"] = fwd, both
    t = _fastest(fns, device)
    q.grad = k.grad = v.grad = bq.grad = bk.grad = bv.grad = None
    ratios = {f"{n}_backward": max(1.5, t[n + "_both"] / t[n]) for n in ("sdpa", "tiled")}
    return ratios | {"sdpa_causal_backward": _causal_share(t["sdpa_causal_big_both"], t["sdpa_big_both"], 0.0)}


FLEX_N = (1024, 2048)  # FlexAttention is timed on [1, H, N, D] calls with a window of 256 at these lengths


def measure_flex(device: torch.device | str, dtype: torch.dtype) -> FlexCosts:
    """Compile FlexAttention for a sliding-window mask (a fresh kernel, even if one is cached) and
    time it: the first call is the compile, then calls at the two ``FLEX_N`` lengths (the same
    kernel: dynamic sizes), interleaved, give the per-call and per-visited-entry costs; on CUDA
    also forward+backward / forward. Stored for this machine: ``auto`` weighs ``flex`` from then
    on. Tens of seconds on a CPU (the compile); a BackendError where FlexAttention cannot run."""
    from ..errors import BackendError
    from . import flex

    device = torch.device(device)
    window = masks.sliding_window(256)
    calls = [prepare(*_inputs(device, dtype, n), window) for n in FLEX_N]
    reason = flex.why_not(calls[0], False)
    if reason is not None:
        raise BackendError(f"cannot measure FlexAttention on {device.type} in {dtype}: {reason}.")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flex.forget(flex.kernel_key(calls[0]))  # the first call below compiles
    with torch.no_grad():
        t0 = time.perf_counter()
        flex.run(calls[0])
        sync()
        first = time.perf_counter() - t0
        t = _fastest({"short": lambda: flex.run(calls[0]), "long": lambda: flex.run(calls[1])}, device, rounds=3)
    e1, e2 = (flex.visited(p) for p in calls)
    elem = max(t["long"] - t["short"], 1e-9) / (e2 - e1)
    c = FlexCosts(compile=max(first - t["short"], 0.0), call=max(t["short"] - elem * e1, 0.0), elem=elem)
    if device.type != "cpu":  # FlexAttention has a backward here
        q, k, v = _inputs(device, dtype, FLEX_N[1], grad=True)

        def both() -> None:
            out, _ = flex.run(prepare(q, k, v, window))
            out.sum().backward()

        c = replace(c, backward=max(1.5, _fastest({"both": both}, device, rounds=3)["both"] / t["long"]))
    _keep_flex(_key(device, dtype, "flex "), c)
    return c


# ---- the file cache -------------------------------------------------------------------------------

def machine_key(device_type: str) -> str:
    """What the costs depend on: CPU model and SIMD flags (or GPU name), threads, torch version."""
    if device_type == "cuda" and torch.cuda.is_available():
        hw = torch.cuda.get_device_name()
    else:
        model, flags = "", ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith(("flags", "Features")) and not flags:
                    flags = hashlib.sha1(line.encode()).hexdigest()[:12]
        except OSError:
            pass
        hw = f"{model or os.uname().machine} flags {flags} threads {torch.get_num_threads()}"
    return f"v{VERSION} torch {torch.__version__} {device_type} {hw}"


def _path() -> Path:
    given = os.environ.get("BHQK_COSTS", "")
    if given and given not in ("reference", "measure"):
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bhqk" / "costs.json"


def _read() -> dict:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def _load(key: tuple[str, str], kind: type[_C]) -> _C | None:
    entry = _read().get(machine_key(key[0]), {}).get(key[1])
    try:
        return kind(**entry) if entry else None
    except TypeError:  # written by another version
        return None


def _store(key: tuple[str, str], c: Costs | FlexCosts) -> None:
    data = _read()
    data.setdefault(machine_key(key[0]), {})[key[1]] = asdict(c)
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the in-process memo still holds
