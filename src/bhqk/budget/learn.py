"""The learned head score (DuoAttention's objective, Xiao et al. 2024): one gate per K/V head mixing
full and streaming attention (:func:`~bhqk.budget.gate.gated`), trained so that the model's final
hidden states on synthetic pass-key prompts (:func:`bhqk.corpus.passkey_prompt`, drawn from (seed,
step): a resumed run sees the same prompts) stay those of full attention, with an L1 pull of the gates
towards 0 (streaming). Heads whose gate stays high are the ones the prompts need in full.

One step (:func:`train_gates`): ``loss = mean over answer rows of mean over d of (h_gated − h_full)² +
reg · mean |g|``; AdamW (lr 0.02, no weight decay) on DuoAttention's schedule (:meth:`Settings.schedule`:
linear warm-up over the first fifth of the steps from 0.1×, linear decay over the last fifth to 0.1×);
the gates start at 1 and are clamped to [0, 1] after each update. ``checkpoint=`` writes the gates, the
optimizer's state and the step (:data:`FORMAT`, ``torch.save``, atomically) every ``every`` steps and at
the end; ``resume=`` continues such a run made with the same settings, bit for bit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..corpus import passkey_prompt
from ..errors import LoadError
from ..integrations.model_map import model_map
from .gate import gated

FORMAT = "bhqk.budget.gates/1"


@dataclass
class Settings:
    """What a run of :func:`train_gates` depends on (a resumed run must match): the streaming heads'
    ``sink`` and ``window``, the prompts (``length``: tokens, or (min, max) drawn per step; ``keys``,
    ``words``, ``seed``), ``lr``, ``reg`` (the L1 weight) and ``steps`` (the schedule's length)."""

    sink: int
    window: int
    steps: int
    length: int | tuple[int, int] = 1024
    keys: int = 2
    words: int = 8
    seed: int = 0
    lr: float = 0.02
    reg: float = 0.05

    def prompt_length(self, step: int) -> int:
        if isinstance(self.length, int):
            return self.length
        lo, hi = self.length
        return random.Random(f"passkey-length:{self.seed}:{step}").randint(lo, hi)

    def schedule(self, step: int) -> float:
        """DuoAttention's learning-rate factor at ``step``."""
        w = max(1, self.steps // 5)
        return min(max((step + 1) / w, 0.1), max((self.steps - step) / w, 0.1))


@dataclass
class Training:
    """A run of :func:`train_gates`: the ``gates`` [L, Hkv] (in [0, 1]), the ``step`` reached, and per
    step the distillation loss, the mean gate and the seconds it took (``history``)."""

    gates: torch.Tensor
    step: int
    settings: Settings
    history: list[dict[str, float]] = field(default_factory=list)


def _save(path: Path, gates: torch.Tensor, opt: torch.optim.Optimizer, step: int, s: Settings, shape) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": FORMAT, "gates": gates.detach().clone(), "optimizer": opt.state_dict(), "step": step,
                "settings": asdict(s), "shape": list(shape)}, tmp)
    tmp.replace(path)  # atomic: an interrupted save leaves the previous checkpoint


def _load(path: Path, s: Settings, shape) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises its own types for a damaged or foreign file
        raise LoadError(f"{path}: not a gates checkpoint ({type(e).__name__}: {e}).") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise LoadError(f"{path}: not a gates checkpoint (expected \"format\": {FORMAT!r}).")
    got = dict(state["settings"])
    if isinstance(got.get("length"), list):
        got["length"] = tuple(got["length"])
    if state["shape"] != list(shape):
        raise LoadError(f"{path}: gates for [layers, Hkv] = {state['shape']}, but the model has {list(shape)}.")
    if got != asdict(s):
        diff = {k: (got.get(k), v) for k, v in asdict(s).items() if got.get(k) != v}
        raise LoadError(f"{path}: made with other settings (checkpoint, now): {diff}; resume with the same ones.")
    return state


def train_gates(model, tokenizer, sink: int, window: int, steps: int, *, length: int | tuple[int, int] = 1024,
                keys: int = 2, words: int = 8, seed: int = 0, lr: float = 0.02, reg: float = 0.05,
                checkpoint: str | Path | None = None, resume: str | Path | None = None, every: int = 10,
                until: int | None = None, progress: Callable[[int, dict[str, float]], None] | None = None
                ) -> Training:
    """Train one gate per K/V head of ``model`` (a Hugging Face causal LM) for ``steps`` steps (module
    doc); ``checkpoint``: written every ``every`` steps and at the end; ``resume``: a checkpoint to
    continue from (same settings; its step ≤ ``steps``); ``until``: stop after that step (the schedule
    still spans ``steps``: a long run in parts). ``progress(step, record)`` after each step."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"train_gates: steps must be an int >= 0, got {steps!r}.")
    if tokenizer is None:
        raise ValueError("train_gates: the pass-key prompts are text; pass tokenizer=.")
    s = Settings(sink, window, steps, tuple(length) if isinstance(length, list) else length, keys, words, seed,
                 float(lr), float(reg))
    m = model_map(model)
    model = m.model
    L, Hkv = m.shape.layers, m.shape.kv_heads
    dev = m.device
    gates = torch.ones(L, Hkv, device=dev, requires_grad=True)
    opt = torch.optim.AdamW([gates], lr=s.lr, weight_decay=0.0)
    step = 0
    if resume is not None:
        state = _load(Path(resume), s, (L, Hkv))
        with torch.no_grad():
            gates.copy_(state["gates"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        if step > steps:
            raise ValueError(f"train_gates: {resume} is at step {step}, beyond steps={steps}.")
    stop = steps if until is None else min(until, steps)
    out = Path(checkpoint) if checkpoint is not None else Path(resume) if resume is not None else None
    run = Training(gates.detach(), step, s)
    was = model.training
    model.eval()
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        while step < stop:
            t0 = time.perf_counter()
            ids, first = passkey_prompt(tokenizer, s.prompt_length(step), s.seed, step, s.keys, s.words)
            ids = ids.to(dev)
            with torch.no_grad():
                want = m.hidden(ids[None])[0, first:].float()  # [n, d]
            for group in opt.param_groups:
                group["lr"] = s.lr * s.schedule(step)
            with gated(m, gates, sink, window):
                distill = (m.hidden(ids[None])[0, first:].float() - want).pow(2).mean(-1).mean()  # [n, d] -> []
            loss = distill + s.reg * gates.abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                gates.clamp_(0.0, 1.0)
            step += 1
            rec = {"step": step, "distill": float(distill.detach()), "mean gate": float(gates.detach().mean()),
                   "seconds": time.perf_counter() - t0, "tokens": int(ids.numel())}
            run.history.append(rec)
            if out is not None and (step % every == 0 or step == stop):
                _save(out, gates, opt, step, s, (L, Hkv))
            if progress is not None:
                progress(step, rec)
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.train(was)
    if out is not None and not out.exists():  # nothing trained now (resumed at its end, or steps=0)
        _save(out, gates, opt, step, s, (L, Hkv))
    run.gates, run.step = gates.detach().clone().cpu(), step
    return run


__all__ = ["train_gates", "Training", "Settings", "FORMAT"]
