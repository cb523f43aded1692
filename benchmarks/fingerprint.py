"""A behaviour fingerprint, not a timing: a fixed, seeded set of outputs, lse and gradients (q, k, v,
bias, sinks) of every backend of ``bhqk.functional.names()`` that runs on the CPU (``auto`` too, with
the choice it made) × every mask kind × GQA/MHA × bias, sinks, softcap, a decode step (Q = 1) ×
float32/float64, plus capture statistics and edits, saved to one .pt file. A refactor that must not
change behaviour is checked by comparing the files from before and after it bitwise.

    python benchmarks/fingerprint.py before.pt             # write the fingerprint
    python benchmarks/fingerprint.py --compare A.pt B.pt   # tensors/values compared, any that differ

Runs single-threaded (``torch.set_num_threads(1)``), FlexAttention uncompiled, with the reference
cost table (``BHQK_COSTS=reference``), so the file depends on the code, not on the machine's load.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ["BHQK_COSTS"] = "reference"

import torch  # noqa: E402

import bhqk  # noqa: E402
from bhqk import masks, shortcuts  # noqa: E402
from bhqk.errors import BackendError  # noqa: E402
from bhqk.functional import flex  # noqa: E402

B, H, D = 2, 4, 8
N = 37  # Q = K for the prefill calls; the decode step is Q = 1 over K = N


def _mask_kinds(Q: int, K: int) -> dict[str, object]:
    """Every mask kind, built for [Q, K] (fresh objects per call, so no cache carries over between kinds)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.zeros(K, dtype=torch.long)
    ids[K // 2:] = 1
    qids = ids[K - Q:]
    dense = torch.rand(B, 1, Q, K, generator=g) < 0.6
    dense[..., 0] = True
    return {
        "none": None,
        "causal_tl": masks.causal("top_left"),
        "causal_br": masks.causal("bottom_right"),
        "window": masks.sliding_window(5, align="bottom_right"),
        "key_span": masks.key_span(3, K - 4),
        "predicate_key": masks.predicate(lambda b, h, i, j: qids[i] == ids[j], key=(qids, ids)),
        "dense": masks.dense(dense),
        "per_head": masks.per_head([masks.causal("bottom_right"), masks.sliding_window(4, align="bottom_right"),
                                    None, masks.key_span(0, 9)]),
        "and": masks.causal("bottom_right") & masks.key_span(2, K),
        "or": masks.sliding_window(3, align="bottom_right") | masks.key_span(0, 4),
        "not": ~masks.key_span(5, 11),
    }


def _inputs(dtype, Hkv: int, Q: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, K, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, K, D + 2, generator=g, dtype=torch.float64).to(dtype)  # dv ≠ d
    bias = torch.randn(1, H, Q, K, generator=g, dtype=torch.float64).to(dtype)
    sinks = torch.randn(H, generator=g, dtype=torch.float64).to(dtype)
    w_out = torch.randn(B, H, Q, D + 2, generator=g, dtype=torch.float64).to(dtype)
    w_lse = torch.randn(B, H, Q, generator=g, dtype=torch.float64)
    return q, k, v, bias, sinks, w_out, w_lse


def _one(out: dict, name: str, backend: str, mask, q, k, v, bias, sinks, softcap, w_out, w_lse) -> None:
    """Forward (out, and lse where the backend gives one) and gradients of every input that has one."""
    leaves = {"q": q, "k": k, "v": v}
    if bias is not None:
        leaves["bias"] = bias
    if sinks is not None:
        leaves["sinks"] = sinks
    for lse in (False, True):
        tag = f"{name}|lse={lse}"
        for grad_bias in ((True, False) if bias is not None else (False,)):
            xs = {n: t.detach().clone().requires_grad_(n != "bias" or grad_bias) for n, t in leaves.items()}
            try:
                with shortcuts.off():
                    choice = bhqk.choose_backend(xs["q"], xs["k"], xs["v"], mask, bias=xs.get("bias"),
                                                 softcap=softcap, sinks=xs.get("sinks"), return_lse=lse) \
                        if backend == "auto" else None
                got = bhqk.attention(xs["q"], xs["k"], xs["v"], mask, bias=xs.get("bias"), softcap=softcap,
                                     sinks=xs.get("sinks"), backend=backend, return_lse=lse)
            except BackendError as e:
                out[f"{tag}|grad_bias={grad_bias}|refused"] = str(e).split("\n")[0][:200]
                if grad_bias:
                    continue
                try:  # forward only (FlexAttention on the CPU has no backward)
                    with torch.no_grad():
                        got = bhqk.attention(q, k, v, mask, bias=bias, softcap=softcap, sinks=sinks, backend=backend,
                                             return_lse=lse)
                except BackendError:
                    continue
                o, l_ = got if lse else (got, None)
                out[f"{tag}|no_grad|out"] = o.clone()
                if l_ is not None:
                    out[f"{tag}|no_grad|lse"] = l_.clone()
                continue
            o, l_ = got if lse else (got, None)
            t = f"{tag}|grad_bias={grad_bias}"
            if choice is not None:
                out[f"{t}|choice"] = choice.name
            out[f"{t}|out"] = o.detach().clone()
            loss = (o.double() * w_out.double()).sum()
            if l_ is not None:
                out[f"{t}|lse"] = l_.detach().clone()
                finite = torch.isfinite(l_)
                loss = loss + (torch.where(finite, l_.double(), 0.0) * w_lse).sum()
            loss.backward()
            for n, x in xs.items():
                if x.grad is not None:
                    out[f"{t}|grad_{n}"] = x.grad.clone()
            break  # the bias's gradient taken (or not needed): no second try


def grid(out: dict) -> None:
    backends = [n for n in bhqk.functional.names()]
    for dtype, Hkv, decode in itertools.product((torch.float32, torch.float64), (2, 4), (False, True)):
        Q, K = (1, N) if decode else (N, N)
        kinds = _mask_kinds(Q, K)
        seed = 17 * (dtype == torch.float64) + 3 * Hkv + int(decode)
        q, k, v, bias, sinks, w_out, w_lse = _inputs(dtype, Hkv, Q, K, seed)
        for kind, with_bias, with_sinks, softcap in itertools.product(kinds, (False, True), (False, True), (None, 3.0)):
            for backend in backends:
                mask = _mask_kinds(Q, K)[kind]  # a fresh object per call
                name = f"{backend}|{str(dtype)[6:]}|Hkv={Hkv}|Q={Q}|{kind}|bias={with_bias}|sinks={with_sinks}|softcap={softcap}"
                _one(out, name, backend, mask, q, k, v, bias if with_bias else None, sinks if with_sinks else None,
                     softcap, w_out, w_lse)


def captures(out: dict) -> None:
    """Statistics through ``bhqk.capture`` on functional calls (every backend; prefill and decode)."""
    what = ("weights", "lse", "head_outputs", "entropy", "distance", "sink", "received", "max")
    for backend, kind, Q in itertools.product(("reference", "torch", "spans", "tiled", "auto"),
                                              ("none", "causal_br", "window", "dense", "per_head"), (N, 1)):
        q, k, v, bias, sinks, _, _ = _inputs(torch.float32, 2, Q, N, 40 + Q)
        for with_sinks in (False, True):
            if with_sinks and backend == "torch":
                continue
            mask = _mask_kinds(Q, N)[kind]
            try:
                with torch.no_grad(), bhqk.capture(heads=[0, 3], what=what, offsets=(0, 1), window=3, topk=2) as cap:
                    bhqk.attention(q, k, v, mask, sinks=sinks if with_sinks else None, backend=backend)
            except BackendError as e:
                out[f"capture|{backend}|{kind}|Q={Q}|sinks={with_sinks}|refused"] = str(e)[:200]
                continue
            for rec in cap:
                base = f"capture|{backend}|{kind}|Q={Q}|sinks={with_sinks}|{rec.index}"
                out[f"{base}|backend"] = rec.backend
                for n in rec.keys():
                    out[f"{base}|{n}"] = rec[n].clone()
        # rows selected
        mask = _mask_kinds(Q, N)[kind]
        with torch.no_grad(), bhqk.capture(rows=[0] if Q == 1 else [1, 2, 30], what=("entropy", "lse", "sink")) as cap:
            bhqk.attention(q, k, v, mask, backend=backend)
        for rec in cap:
            for n in rec.keys():
                out[f"capture-rows|{backend}|{kind}|Q={Q}|{n}"] = rec[n].clone()


def edits(out: dict) -> None:
    """``bhqk.edit`` (zero, scale, mask, bias) on functional calls, forward and gradients."""
    g = torch.Generator().manual_seed(9)
    Q = N
    T = torch.randn(1, 2, Q, N, generator=g)
    kinds = {"zero": dict(zero=True), "scale": dict(scale=0.5), "mask": dict(mask=masks.key_span(0, 6)),
             "bias": dict(bias=T)}
    for backend, kind, (ename, ekw) in itertools.product(("reference", "torch", "spans", "tiled", "auto"),
                                                         ("none", "causal_br", "window"), kinds.items()):
        q, k, v, _, _, w_out, _ = _inputs(torch.float32, 2, Q, N, 60)
        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        try:
            with bhqk.edit(heads=[1, 2], **ekw):
                o = bhqk.attention(*xs, _mask_kinds(Q, N)[kind], backend=backend)
        except BackendError as e:
            out[f"edit|{backend}|{kind}|{ename}|refused"] = str(e)[:200]
            continue
        (o * w_out).sum().backward()
        out[f"edit|{backend}|{kind}|{ename}|out"] = o.detach().clone()
        for n, x in zip("qkv", xs):
            out[f"edit|{backend}|{kind}|{ename}|grad_{n}"] = x.grad.clone()


def make(path: str) -> None:
    torch.set_num_threads(1)
    out: dict = {}
    with flex.uncompiled():
        grid(out)
        captures(out)
        edits(out)
    torch.save(out, path)
    ts = [x for x in out.values() if isinstance(x, torch.Tensor)]
    print(f"{path}: {len(out)} entries, {len(ts)} tensors, {sum(x.numel() for x in ts)} values")


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    tensors = values = others = 0
    differ: list[str] = []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            tensors += 1
            values += x.numel()
            if not (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
                if x.shape == y.shape and x.is_floating_point() and y.is_floating_point():
                    diff = (x.double() - y.double()).abs()
                    both_nan = x.isnan() & y.isnan()
                    same_inf = (x == y) & ~torch.isfinite(x)
                    diff = torch.where(both_nan | same_inf, 0.0, diff.nan_to_num(float("inf")))
                    differ.append(f"{key}: max |diff| {diff.max().item():.3g} ({int((diff > 0).sum())} of {x.numel()} values)")
                else:
                    differ.append(f"{key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        else:
            others += 1
            if x != y:
                differ.append(f"{key}: {x!r} vs {y!r}")
    print(f"compared {tensors} tensors ({values} values) and {others} other entries (choices, refusals)")
    for k in only_a:
        print(f"only in {a_path}: {k}")
    for k in only_b:
        print(f"only in {b_path}: {k}")
    for line in differ:
        print(f"DIFFERS {line}")
    same = not differ and not only_a and not only_b
    print("all bitwise identical (torch.equal)" if same else f"{len(differ)} entries differ, "
          f"{len(only_a) + len(only_b)} present in one file only")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--compare", action="store_true", help="compare two fingerprint files")
    args = ap.parse_args(argv)
    if args.compare:
        if len(args.paths) != 2:
            ap.error("--compare takes two files")
        return compare(*args.paths)
    if len(args.paths) != 1:
        ap.error("one output file")
    make(args.paths[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
