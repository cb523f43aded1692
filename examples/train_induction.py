"""Train the two-layer attention-only toy model on repeated random token sequences (CPU, a few
minutes) and write its weights to src/bhqk/inspect/data/induction.safetensors, the file the head
detector's tests and examples load.

    flock /tmp/bhqk-cpu.lock python examples/train_induction.py [--steps 3000] [--out PATH]

Each training sequence is a random segment of a random length L in [6, 20] repeated until the
sequence is full; the loss counts only the tokens a copy can predict (from position L on). With a
varying L no fixed position offset predicts the next token, so the model has to learn the two-step
circuit: a previous-token head in layer 0 and an induction head in layer 1 (find the token after an
earlier occurrence of the current one).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bhqk.inspect import toy


def batch(B: int, N: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, N] and the loss weight [B, N - 1] of each next-token target."""
    L = torch.randint(6, 21, (B,), generator=g)  # [B] segment lengths
    seg = torch.randint(0, vocab, (B, 20), generator=g)  # [B, 20]
    pos = torch.arange(N)  # [N]
    ids = torch.gather(seg, 1, pos[None, :] % L[:, None])  # [B, N]: the segment repeated
    weight = (pos[1:][None, :] >= L[:, None]).float()  # [B, N - 1]: the target at t+1 is a copy
    return ids, weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=toy.WEIGHTS)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(a.seed)
    c = toy.ToyConfig()
    model = toy.AttnOnly(c, backend="torch")  # SDPA: no cost calibration on the first call
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps, pct_start=0.1)
    N = c.max_len
    t0 = time.perf_counter()
    for step in range(a.steps):
        ids, w = batch(a.batch, N, c.vocab, g)
        logits = model(ids)[:, :-1]  # [B, N - 1, V]
        loss = (F.cross_entropy(logits.reshape(-1, c.vocab), ids[:, 1:].reshape(-1), reduction="none")
                * w.reshape(-1)).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step:5d}  copy loss {loss.item():.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    toy.save(model, a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size // 1024} KiB) after {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
