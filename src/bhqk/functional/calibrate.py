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
- ``reference``: the built-in costs of the 2-core Xeon the project was tuned on (no measuring; CPU
  figures, not meaningful on another device);
- ``measure``: measured in every process, never read from or written to a file.

Tests inject fixed costs with :func:`fixed`, so the choices they check do not depend on the machine.

FlexAttention's costs (:class:`FlexCosts`: the compile, per call, per visited score entry) are
never measured implicitly: measuring them compiles kernels (tens of seconds on a CPU). They are
measured by :func:`measure_flex` (``bhqk calibrate --flex``), kept in the same file, and updated
with every compile bhqk observes; until they exist, ``auto`` does not weigh ``flex``.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    it materializes for SDPA. Tiled: ``tiled_plan``'s model (fitted on the reference machine) in
    its fixed part (per call, rectangle, row group), its per-entry part and its partial (mask)
    part, scaled by ``tiled_fixed``, ``tiled_elem`` and ``tiled_partial``. Forward+backward:
    ``sdpa_backward`` (its time / the forward's), ``sdpa_causal_backward`` (is_causal's share), and
    the tile model's fixed and per-entry scales ``tiled_fixed_backward`` / ``tiled_elem_backward``
    (the tiled backend's ratio grows with N, so it is no ratio); ``tiled_backward``: a ratio, for
    tables without those scales (``REFERENCE``). None: not measured yet."""

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
    tiled_partial: float | None = None  # scale of the tile model's partial (mask) part (None: tiled_elem)
    tiled_fixed_backward: float | None = None  # forward+backward scales of the tile model's fixed and per-entry
    tiled_elem_backward: float | None = None  # parts (None: the forward's × tiled_backward)
    sdpa_mask_elem_backward: float | None = None  # a dense mask's extra per entry, forward+backward (None: × sdpa_backward)


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
    first_compile: float = 0.0  # what the first compile of a process pays on top (imports, compiler warm-up)
    backward_compile: float | None = None  # the backward's compile, at the first backward (None: not measured)


_C = TypeVar("_C", Costs, FlexCosts)

_MEMO: dict[tuple[str, str], Costs] = {}  # in-process: (device type, dtype) -> costs
_FLEX_MEMO: dict[tuple[str, str], FlexCosts | None] = {}  # in-process: (device type, dtype) -> FlexAttention's costs
_FIXED: list[Callable[[str, torch.dtype], Costs] | None] = [None]  # set by fixed()
_FIXED_FLEX: list[Callable[[str, torch.dtype], FlexCosts | None] | None] = [None]  # set by fixed(..., flex_costs=)


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
    if grad and None in (c.sdpa_backward, c.sdpa_causal_backward, c.sdpa_mask_elem_backward, c.tiled_elem_backward):
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
    if key not in _FLEX_MEMO and mode != "measure":
        _FLEX_MEMO[key] = _load(key, FlexCosts)  # None too: the file is read once per process, not per call
    return _FLEX_MEMO.get(key)


def observed_compile(device: torch.device, dtype: torch.dtype, seconds: float, first_in_process: bool) -> None:
    """Record a compile bhqk just paid (the first call of a new FlexAttention kernel), where
    FlexAttention's costs were measured: the estimate of the next compile on this machine, or,
    for the process's first compile, of its one-time excess (``first_compile``)."""
    if _FIXED_FLEX[0] is not None:
        return
    c = flex_costs(device, dtype)
    if c is not None:
        c = replace(c, first_compile=max(seconds - c.compile, 0.0)) if first_in_process else replace(c, compile=seconds)
        _keep_flex(_key(device, dtype, "flex "), c)


def _keep_flex(key: tuple[str, str], c: FlexCosts) -> None:
    _FLEX_MEMO[key] = c
    if stored_in() is not None:
        _store(key, c)


@contextlib.contextmanager
def fixed(table: dict[torch.dtype, Costs] | Costs | None = None, flex_costs: FlexCosts | None = None) -> Iterator[None]:
    """Use fixed costs inside the ``with`` block (default: ``REFERENCE``), whatever the machine;
    estimates are then pure functions of the call (no measured planning time). ``flex_costs``:
    FlexAttention's costs for every device and dtype (default None: auto does not weigh it)."""
    table = REFERENCE if table is None else table
    if isinstance(table, Costs):
        table = replace(table, source="fixed")
    else:
        table = {dt: replace(c, source="fixed") for dt, c in table.items()}
    fixed_flex = None if flex_costs is None else replace(flex_costs, source="fixed")
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
    sync = _sync(device)
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


def _sync(device: torch.device) -> Callable[[], None]:
    """Waits for ``device``'s queued work (CUDA); nothing to wait for on the CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _both(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A forward+backward call: ``run()``'s output summed and differentiated."""
    return lambda: run().sum().backward()


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
    """Time SDPA (no mask, is_causal, a dense mask at N = ``N_BIG``; a tiny call), building a mask,
    and the tiled backend (without a mask, with a window, with few rows: the three parts of its
    model), forward only, interleaved, each sample about ``SAMPLE_S`` long: about 2 s in all on a
    quiet 2-core machine."""
    q, k, v = _inputs(device, dtype)
    tq, tk, tv = _inputs(device, dtype, 16, 1)
    dense = masks.dense(torch.rand(1, 1, N_BIG, N_BIG, generator=torch.Generator().manual_seed(1)).to(device) > 0.1)
    tiled_calls = []  # (p, plan): element-bound, partial-bound (a window: its band is partial) and overhead-bound (few rows)
    for args, mask in ((_inputs(device, dtype, N_BIG), None), (_inputs(device, dtype, N_BIG), masks.sliding_window(N_BIG // 8)),
                       (_inputs(device, dtype, 128, 1), masks.causal())):
        p = prepare(*args, mask)
        tiled_calls.append((p, tiled_plan.plan_for(p)))
    bq, bk, bv = _inputs(device, dtype, N_BIG)
    fns = {
        "plain": lambda: torch_sdpa.run(prepare(q, k, v)),
        "plain_big": lambda: torch_sdpa.run(prepare(bq, bk, bv)),
        "causal_big": lambda: torch_sdpa.run(prepare(bq, bk, bv, masks.causal())),
        "mask_big": lambda: torch_sdpa.run(prepare(bq, bk, bv, dense)),
        "call": lambda: torch_sdpa.run(prepare(tq, tk, tv)),
        "build": lambda: masks.sliding_window(N // 8).materialize(1, 1, N, N, device),
        "tiled": lambda: tiled.forward(*tiled_calls[0]),
        "tiled_window": lambda: tiled.forward(*tiled_calls[1]),
        "tiled_small": lambda: tiled.forward(*tiled_calls[2]),
    }
    with torch.no_grad():
        t = _fastest(fns, device)
    call = min(t["call"], t["plain"])
    elem = max(t["plain_big"] - call, 0.1 * t["plain_big"]) / (H * N_BIG**2)
    a_fixed, a_elem, a_partial = _scales([tiled_parts(*c) for c in tiled_calls],
                                         [t["tiled"], t["tiled_window"], t["tiled_small"]])  # a 3×3 solve
    causal = _causal_share(t["causal_big"], t["plain_big"], call)
    mask_elem = max(0.0, t["mask_big"] - t["plain_big"]) / (H * N_BIG**2)
    return Costs(call, elem, causal, mask_elem, a_fixed, a_elem, t["build"] / (N * N),
                 tiled_partial=a_partial)


def _scales(parts: list[tuple[float, ...]], times: list[float]) -> tuple[float, ...]:
    """The scales of the model's parts (columns: fixed, per-entry[, partial]) that make them add
    up to the measured times of as many tiled calls (a square solve); where noise makes one of
    them ≤ 0, one scale for all (the total over the total)."""
    try:
        x = torch.linalg.solve(torch.tensor(parts, dtype=torch.float64), torch.tensor(times, dtype=torch.float64))
        if bool((x > 0).all()):
            return tuple(float(s) for s in x)
    except RuntimeError:  # a singular system
        pass
    one = sum(times) / sum(map(sum, parts))
    return (one,) * len(parts[0])


def _with_backward(c: Costs, b: dict[str, float]) -> Costs:
    """``c`` with the forward+backward costs ``b`` (``tiled_backward``, a ratio, stays None: the tile
    model's own scales replace it)."""
    return replace(c, sdpa_backward=b["sdpa_backward"], sdpa_causal_backward=b["sdpa_causal_backward"],
                   sdpa_mask_elem_backward=b["sdpa_mask_elem_backward"], tiled_fixed_backward=b["tiled_fixed_backward"],
                   tiled_elem_backward=b["tiled_elem_backward"])


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


def tiled_parts(p, plan) -> tuple[float, float, float]:
    """``plan.cost`` (tiled_plan's model) in its fixed, per-entry and partial (mask) parts."""
    rows_per_q, n = p.ext.B * p.ext.H, len(tiled_plan.split(p.ext.B, p.sizes["Hkv"], tiled_plan.workers(p.q.device)))
    return plan.parts(rows_per_q, n)


def measure_backward(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Forward+backward costs, interleaved, at N = ``N_BIG`` (where per-entry costs dominate as in
    the calls that matter; at N = 512 fixed costs dominated both backwards, SDPA's 20×): SDPA's
    forward+backward / forward, is_causal's share of it and a dense mask's extra per entry; the tiled
    backend's fixed and per-entry scales of its tile model, from a no-mask call and an
    overhead-bound one (few rows), since its forward+backward / forward ratio grows with N."""
    bq, bk, bv = _inputs(device, dtype, N_BIG, grad=True)
    sq, sk, sv = _inputs(device, dtype, 128, 1, grad=True)
    calls = [(p, tiled_plan.plan_for(p)) for p in (prepare(bq, bk, bv), prepare(sq, sk, sv, masks.causal()))]

    def sdpa_big() -> None:
        with torch.no_grad():
            torch_sdpa.run(prepare(bq, bk, bv))

    dense = masks.dense(torch.rand(1, 1, N_BIG, N_BIG, generator=torch.Generator().manual_seed(1)).to(device) > 0.1)
    fns: dict[str, Callable[[], object]] = {
        "sdpa_big": sdpa_big,
        "sdpa_big_both": _both(lambda: torch_sdpa.run(prepare(bq, bk, bv))[0]),
        "sdpa_mask_big_both": _both(lambda: torch_sdpa.run(prepare(bq, bk, bv, dense))[0]),
        "sdpa_causal_big_both": _both(lambda: torch_sdpa.run(prepare(bq, bk, bv, masks.causal()))[0]),
        "tiled_big_both": _both(lambda: tiled.run(calls[0][0], False, calls[0][1])[0]),
        "tiled_small_both": _both(lambda: tiled.run(calls[1][0], False, calls[1][1])[0]),
    }
    t = _fastest(fns, device)
    for x in (bq, bk, bv, sq, sk, sv):
        x.grad = None
    (f1, e1, p1), (f2, e2, p2) = (tiled_parts(*c) for c in calls)
    fixed, elem = _scales([(f1, e1 + p1), (f2, e2 + p2)], [t["tiled_big_both"], t["tiled_small_both"]])
    return {"sdpa_backward": max(1.5, t["sdpa_big_both"] / t["sdpa_big"]),
            "sdpa_causal_backward": _causal_share(t["sdpa_causal_big_both"], t["sdpa_big_both"], 0.0),
            "sdpa_mask_elem_backward": max(0.0, t["sdpa_mask_big_both"] - t["sdpa_big_both"]) / (H * N_BIG**2),
            "tiled_fixed_backward": fixed, "tiled_elem_backward": elem}


FLEX_N = (1024, 2048)  # FlexAttention is timed on [1, H, N, D] calls with a window of 256 at these lengths


def measure_flex(device: torch.device | str, dtype: torch.dtype) -> FlexCosts:
    """Compile FlexAttention for two structures (a sliding window, then causal & window; fresh
    kernels, Inductor's on-disk caches off, so what is measured is a new structure's compile): the
    second compile is what a kernel costs, the first's excess the one-time cost of a process's
    first compile (when none ran before in this process). Then calls
    at the two ``FLEX_N`` lengths (the same kernel: dynamic sizes), interleaved, give the per-call
    and per-visited-entry costs; on CUDA also forward+backward / forward and the backward's compile
    (its first backward, caches off). Stored for this machine:
    ``auto`` weighs ``flex`` from then on. Tens of seconds on a CPU (the compiles); a BackendError
    where FlexAttention cannot run."""
    from ..errors import BackendError
    from . import flex

    device = torch.device(device)
    window = masks.sliding_window(256)
    calls = [prepare(*_inputs(device, dtype, n), window) for n in FLEX_N]
    reason = flex.why_not(calls[0], False)
    if reason is not None:
        raise BackendError(f"cannot measure FlexAttention on {device.type} in {dtype}: {reason}.")
    sync = _sync(device)
    other = dataclasses.replace(calls[0], mask=masks.causal() & window)  # another structure: a second kernel
    fresh = not flex.compiled_any(device.type)  # the first compile of the process pays its one-time costs
    seconds = []
    with torch.no_grad():
        for p in (calls[0], other):
            flex.forget(flex.kernel_key(p))  # the call below compiles, from scratch (no on-disk caches):
            with torch._inductor.config.patch(force_disable_caches=True):  # a new structure's compile
                t0 = time.perf_counter()
                flex.run(p)
                sync()
            seconds.append(time.perf_counter() - t0)
        t = _fastest({"short": lambda: flex.run(calls[0]), "long": lambda: flex.run(calls[1])}, device, rounds=3)
    e1, e2 = (flex.visited(p) for p in calls)
    elem = max(t["long"] - t["short"], 1e-9) / (e2 - e1)
    old = flex_costs(device, dtype)
    first = max(seconds[0] - seconds[1], 0.0) if fresh else (old.first_compile if old is not None else 0.0)
    c = FlexCosts(compile=max(seconds[1] - t["short"], 0.0), call=max(t["short"] - elem * e1, 0.0), elem=elem,
                  first_compile=first)
    if device.type != "cpu":  # FlexAttention has a backward here
        q, k, v = _inputs(device, dtype, FLEX_N[1], grad=True)

        both = _both(lambda: flex.run(prepare(q, k, v, window))[0])
        with torch._inductor.config.patch(force_disable_caches=True):
            t0 = time.perf_counter()
            both()  # the first backward compiles the backward kernel
            sync()
            first_both = time.perf_counter() - t0
        steady = _fastest({"both": both}, device, rounds=3)["both"]
        c = replace(c, backward=max(1.5, steady / t["long"]), backward_compile=max(first_both - steady, 0.0))
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
