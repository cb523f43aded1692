"""The causal head scores of ``bhqk.budget`` on SmolLM2-135M-Instruct: how well the one-backward
``fisher`` score ranks the K/V heads against the exact ``kl`` score, what each costs, and what a
step of the ``learned`` gates costs.

    python benchmarks/budget_scores.py --part rank [--length 2048] [--seeds 0,1] --tag T
    python benchmarks/budget_scores.py --part learn [--length 1024] [--steps 10] [--resume] --tag T

``rank``: on ``--length`` tokens of ``pydoc_data.topics`` (S = 64, W = 256): ``kl`` (one forward per
K/V head), ``fisher`` (one forward and one backward) for each seed, and the other single-backward
candidates of ``bhqk/budget/scores.py``'s module doc (the signed, absolute and squared gradients of the
text's cross-entropy, with one gate per K/V head or per row; the one-draw Fisher of one gate per head),
each with its Spearman rank correlation against ``kl``, the overlap of its top quarter with kl's,
and its time. ``learn``: ``--steps`` steps of ``bhqk.budget.learn.train_gates`` (DuoAttention's settings:
lr 0.02, reg 0.05) on pass-key prompts of ``--length`` tokens, checkpointed to
``benchmarks/results/budget-scores-<tag>-gates.pt`` (``--resume`` continues it, ``--schedule`` sets
the schedule's length: a run can stop before it ends and resume later), each step's time, and the
gates' rank correlation with the ``kl`` of the same tag's ``rank`` part when there is one.
Results merge into ``benchmarks/results/budget-scores-<tag>.json`` with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
S, W = 64, 256


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.flatten().double().argsort().argsort().double()
    rb = b.flatten().double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> int:
    top = lambda t: set(t.flatten().argsort(descending=True)[:k].tolist())  # noqa: E731
    return len(top(a) & top(b))


def merge(tag: str, part: str, data: dict) -> Path:
    import transformers

    path = RESULTS / f"budget-scores-{tag}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old.setdefault("runs", {})[part] = {"meta": {**machine.describe(), "transformers": transformers.__version__,
                                                 "note": "shared 2-core machine: timings are noisy"}, **data}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=1))
    return path


def text_gradients(model, ids: torch.Tensor) -> torch.Tensor:
    """d CE / d g [L, Hkv, N] at g = 1, one gate per K/V head and row, CE the text's own next tokens
    over the rows streaming changes (the candidates that read the text instead of a draw)."""
    from bhqk.budget import scores as sc
    from bhqk.budget.gate import gated
    from bhqk.budget.plan import model_map

    m = model_map(model)
    L, Hkv = m.shape.layers, m.shape.kv_heads
    N, start = ids.shape[1], sc.first_row(S, W)
    g = torch.ones(L, Hkv, N, requires_grad=True)
    with gated(m, g, S, W):
        hidden = m.hidden(ids)  # [1, N, d]
    grad = torch.zeros_like(hidden)
    for a in range(start, N - 1, sc.CHUNK):
        b = min(a + sc.CHUNK, N - 1)
        h = hidden[:, a:b].detach().requires_grad_(True)
        logp = torch.log_softmax(m.logits(h).float(), -1)  # [1, c, V]
        grad[:, a:b] = torch.autograd.grad(-logp.gather(-1, ids[:, a + 1:b + 1, None]).sum(), h)[0]
    hidden.backward(grad)
    assert g.grad is not None
    return g.grad


def part_rank(a: argparse.Namespace, model, tok) -> dict:
    from bhqk.budget import scores as sc

    ids = sc.text_ids(tok, None, a.length, 1)
    out: dict = {"length": a.length, "sink": S, "window": W, "rows": a.length - sc.first_row(S, W), "seconds": {}}
    t = time.perf_counter()
    kl = sc.kl_scores(model, ids, S, W, progress=lambda line: print(line, flush=True))
    out["seconds"]["kl"] = time.perf_counter() - t
    out["kl"] = kl.tolist()
    cands: dict[str, torch.Tensor] = {}
    for seed in a.seeds:
        t = time.perf_counter()
        cands[f"fisher seed {seed}"] = sc.fisher_scores(model, ids, S, W, seed=seed)
        out["seconds"][f"fisher seed {seed}"] = time.perf_counter() - t
        print(f"fisher seed {seed}: {out['seconds'][f'fisher seed {seed}']:.1f} s", flush=True)
    if a.candidates:
        t = time.perf_counter()
        G = text_gradients(model, ids)  # [L, Hkv, N]
        out["seconds"]["text gradients"] = time.perf_counter() - t
        cands["text CE, one gate per head: -dCE/dg (signed)"] = -G.sum(-1)
        cands["text CE, one gate per head: |dCE/dg|"] = G.sum(-1).abs()
        cands["text CE, per row: sum |dCE/dg|"] = G.abs().sum(-1)
        cands["text CE, per row: sum (dCE/dg)^2 (empirical Fisher)"] = G.pow(2).sum(-1)
    rows = []
    for name, c in cands.items():
        rows.append({"score": name, "spearman": spearman(c, kl), "top_quarter_overlap": overlap(c, kl, 22),
                     "top_half_overlap": overlap(c, kl, 45)})
        out.setdefault("scores", {})[name] = c.tolist()
    if len(a.seeds) > 1:
        f0, f1 = cands[f"fisher seed {a.seeds[0]}"], cands[f"fisher seed {a.seeds[1]}"]
        out["fisher_seed_to_seed_spearman"] = spearman(f0, f1)
    out["table"] = rows
    print(f"{'score':58s} spearman  top 22  top 45")
    for r in rows:
        print(f"{r['score']:58s} {r['spearman']:+.3f}    {r['top_quarter_overlap']:2d}/22   {r['top_half_overlap']:2d}/45")
    print("seconds:", {k: round(v, 1) for k, v in out["seconds"].items()})
    return out


def part_learn(a: argparse.Namespace, model, tok) -> dict:
    from bhqk.budget.learn import train_gates

    ck = RESULTS / f"budget-scores-{a.tag}-gates.pt"
    RESULTS.mkdir(parents=True, exist_ok=True)
    resume = ck if a.resume and ck.exists() else None
    done = torch.load(ck, weights_only=True)["step"] if resume else 0
    run = train_gates(model, tok, S, W, a.schedule or a.steps, length=a.length, checkpoint=ck, every=1,
                      resume=resume, until=done + a.steps,
                      progress=lambda i, r: print(f"step {i}: distill {r['distill']:.4g}, mean gate "
                                                  f"{r['mean gate']:.3f}, {r['seconds']:.1f} s", flush=True))
    secs = [r["seconds"] for r in run.history]
    out = {"length": a.length, "schedule": a.schedule or a.steps, "resumed_from": done, "step": run.step,
           "gates": run.gates.tolist(),
           "history": run.history, "seconds_per_step_median": statistics.median(secs) if secs else None}
    path = RESULTS / f"budget-scores-{a.tag}.json"
    if path.exists() and "rank" in json.loads(path.read_text()).get("runs", {}):
        kl = torch.tensor(json.loads(path.read_text())["runs"]["rank"]["kl"])
        out["spearman_vs_kl"] = spearman(run.gates, kl)
        out["top_quarter_overlap_vs_kl"] = overlap(run.gates, kl, 22)
        print(f"gates vs kl: spearman {out['spearman_vs_kl']:+.3f}, top 22 overlap {out['top_quarter_overlap_vs_kl']}/22")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["rank", "learn"], required=True)
    p.add_argument("--tag", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--length", type=int, default=None, help="tokens (rank: 2048, learn: 1024)")
    p.add_argument("--seeds", default="0,1", help="rank: the fisher score's seeds")
    p.add_argument("--candidates", action="store_true", help="rank: also the other single-backward candidates")
    p.add_argument("--steps", type=int, default=10, help="learn: steps to run now (then stop; --resume continues)")
    p.add_argument("--schedule", type=int, default=None, help="learn: the schedule's length (default --steps)")
    p.add_argument("--resume", action="store_true", help="learn: continue the tag's checkpoint")
    a = p.parse_args()
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.length = a.length or (2048 if a.part == "rank" else 1024)
    from bhqk.models import pretrained

    model, tok = pretrained("smollm2-135m")
    data = part_rank(a, model, tok) if a.part == "rank" else part_learn(a, model, tok)
    part = a.part if a.part == "rank" or not data["resumed_from"] else f"learn from step {data['resumed_from']}"
    print("wrote", merge(a.tag, part, data))


if __name__ == "__main__":
    main()
