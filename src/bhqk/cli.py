"""The ``bhqk`` command line.

Every mistake exits with status 2 and one message, without a traceback: a bad option is refused
when it is parsed (``bhqk mask: error: argument --q-len/-Q: must be >= 1, got -3``); a library
error (ShapeError, MaskError, LoadError, any ValueError) is printed whole, every line of it, with
its hints in flag syntax (``--align top_left``, not the Python ``align='top_left'``)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

import torch

from . import masks
from .console import (
    BACKEND_HELP,
    backend_name,
    fraction_list,
    int_at_least,
    int_list,
    lines_off_terminal,
    progress_enabled,
    stage,
)
from .explain import explain

USER_ERRORS = (ValueError, OSError, ImportError)  # a bad value, a file that cannot be read or written, a missing extra
MAX_DRAW_CELLS = 2**18  # bhqk mask draws one character per (batch, query, key): at most 512 × 512
MAX_DRAW_BATCH = 64  # and at most this many batch elements (padding: one per --lengths entry)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``bhqk mask: error: ...``) and point to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        mine = installed("bhqk")
    except PackageNotFoundError:  # running from a source tree that is not installed
        mine = "unknown (not installed)"
    return f"bhqk {mine} (torch {torch.__version__}, Python {sys.version.split()[0]})"


# --- bhqk explain -------------------------------------------------------------------------------

positive = int_at_least(1)


def cmd_explain(a: argparse.Namespace) -> str:
    if a.html:
        from .viz.walkthrough import cmd_explain_html

        return cmd_explain_html(a)
    return explain(B=a.batch, H=a.heads, Q=a.q_len, K=a.k_len, d=a.head_dim,  # sizes left out: the worked example's
                   dv=a.value_dim, Hkv=a.kv_heads, D=a.model_dim, lang=a.lang)


# --- bhqk mask ----------------------------------------------------------------------------------

MASK_KINDS = ("causal", "sliding_window", "padding", "document", "prefix_lm", "full")


def build_mask(a: argparse.Namespace) -> masks.Mask | None:
    if a.kind == "causal":
        return masks.causal(a.align)
    if a.kind == "sliding_window":
        return masks.sliding_window(a.left, a.right, a.align)
    if a.kind == "padding":
        return masks.padding(torch.tensor(a.lengths))
    if a.kind == "document":
        return masks.document(torch.tensor(a.doc_ids), torch.tensor(a.k_doc_ids) if a.k_doc_ids else None)
    if a.kind == "prefix_lm":
        return masks.prefix_lm(a.prefix, a.align)
    return None


def check_drawable(B: int, Q: int, K: int) -> None:
    """Refuse, before anything is built, a drawing of more than MAX_DRAW_CELLS characters or
    MAX_DRAW_BATCH batch elements."""
    if B > MAX_DRAW_BATCH:
        raise ValueError(f"--lengths gives B={B} batch elements; bhqk mask draws at most {MAX_DRAW_BATCH}.")
    if B * Q * K > MAX_DRAW_CELLS:
        b = f"B={B} × " if B > 1 else ""
        raise ValueError(f"{b}Q={Q} × K={K} = {B * Q * K:,} cells is too many to draw; bhqk mask draws at most "
                         f"{MAX_DRAW_CELLS:,} (e.g. --q-len 512 --k-len 512). To see a long mask, draw a smaller one "
                         f"of the same kind: the pattern is the same.")


def cmd_mask(a: argparse.Namespace) -> str:
    K = a.k_len if a.k_len else a.q_len
    B = len(a.lengths) if a.kind == "padding" else 1
    check_drawable(B, a.q_len, K)
    m = build_mask(a)
    if m is None:
        return f"full (no mask), Q={a.q_len}, K={K}\n" + "\n".join(" ".join("■" * K) for _ in range(a.q_len))
    out = [f"{m!r}  [Q={a.q_len} rows = queries, K={K} columns = keys; ■ may attend, · masked]"]
    for b in range(B):
        if B > 1:
            out.append(f"batch {b}:")
        out.append(m.draw(a.q_len, K, b=b, B=B))
    return "\n".join(out)


# --- bhqk calibrate ------------------------------------------------------------------------------


def cmd_calibrate(a: argparse.Namespace) -> str:
    """Measure what attention costs here (what ``auto`` weighs), and FlexAttention's with --flex."""
    from .functional import calibrate, costs

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False).")
    where = costs.stored_in()
    out = [f"machine: {costs.machine_key(dev.type)}",
           f"kept in: {where}" if where else "kept in: this process only (BHQK_COSTS is 'measure' or 'reference')"]
    c = calibrate.remeasure(dev, dtype)
    ns = lambda t: f"{1e9 * t:.3g} ns"  # noqa: E731
    out += [f"SDPA ({a.dtype}):  {1e6 * c.sdpa_call:.3g} µs per call, {ns(c.sdpa_elem)} per score entry, "
            f"+{ns(c.sdpa_mask_elem)} per entry of a dense mask, forward+backward × {c.sdpa_backward:.2f}",
            f"tiled ({a.dtype}): the tile model × {c.tiled_scale:.2f}, forward+backward × {c.tiled_backward:.2f}"]
    if a.flex:
        f = calibrate.measure_flex(dev, dtype)
        back = "no backward here" if f.backward is None else f"forward+backward × {f.backward:.2f}"
        out.append(f"flex ({a.dtype}):  compile {f.compile:.3g} s a kernel, {1e6 * f.call:.3g} µs per call, "
                   f"{ns(f.elem)} per visited score entry, {back}; auto now weighs it")
    else:
        out.append("flex: not measured (--flex compiles a kernel: tens of seconds on a CPU); "
                   "until it is, auto does not weigh it")
    return "\n".join(out)


# --- bhqk demo and show -------------------------------------------------------------------------


def cmd_demo(a: argparse.Namespace) -> str:
    from .demo import run

    return run(a.out)


# --- bhqk needle, bhqk grade ---------------------------------------------------------------------


def task_list(text: str) -> list[str]:
    """An argparse type: comma-separated task names of bhqk.evaluate.tasks."""
    from .evaluate.tasks import TASKS

    names = [x.strip() for x in text.replace(" ", ",").split(",") if x.strip()]
    bad = [x for x in names if x not in TASKS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected tasks among {', '.join(TASKS)}, got {text!r}")
    return list(dict.fromkeys(names))


def load_plan(path: str):
    """A KV budget plan saved as JSON (``bhqk.budget.Plan.load``): ``--plan`` of needle, grade, stats and generate."""
    from .budget import Plan

    return Plan.load(path)


def named_plans(names: list[str], model, sink: int, window: int) -> dict:
    """``--compare``'s configurations by name: ``full`` (the model as it is: None), ``streaming`` (every
    K/V head keeps ``sink`` + ``window``) or a plan's JSON file (``bhqk.budget.Plan.load``)."""
    from .budget import Plan, model_map

    out: dict = {}
    for name in names:
        if name in out:
            raise ValueError(f"--compare: {name!r} is given twice.")
        if name == "full":
            out[name] = None
        elif name == "streaming":
            shape = model_map(model).shape
            out[name] = Plan(torch.zeros(shape.layers, shape.kv_heads, dtype=torch.bool), sink, window, model=shape)
        else:
            out[name] = load_plan(name)
    return out


def causal_lm(a: argparse.Namespace, what: str) -> tuple:
    """(model, tokenizer) of the causal LM ``--model`` names, on ``--backend`` (the one loader), else one LoadError."""
    from .integrations.hf_attention import implementation
    from .models.real import load_model

    with stage(f"loading {a.model}"):
        loaded = load_model(a.model, implementation(a.backend))
    return loaded.causal(what)


def cmd_grade(a: argparse.Namespace) -> str:
    """``bhqk grade``: the graded set (bhqk.evaluate.grade); off a terminal a line per reply or forward on stderr."""
    import json
    from pathlib import Path

    from .evaluate import grade, tasks

    if a.ratio is not None:
        return cmd_board(a)
    if a.methods is not None:
        raise ValueError("--methods are graded at compression ratios: give --ratio (e.g. --ratio 0.75).")
    a.trials = a.trials or 1
    if a.plan is not None and a.compare is not None:
        raise ValueError("give --plan (one plan) or --compare (several), not both.")
    names = a.compare or ([a.plan] if a.plan is not None else ["full"])
    for name in names:  # a bad plan fails before the model loads
        if name not in ("full", "streaming"):
            load_plan(name)
    with lines_off_terminal():
        model, tok = causal_lm(a, "bhqk grade")
        plans = named_plans(names, model, a.sink, a.window)
        lengths = a.lengths or list(grade.LENGTHS)
        what = a.task or (["needle"] if not a.kl_lengths else [])
        lines = [f"{a.model}, seed {a.seed}: " + ", ".join(names)]
        data: dict = {"model": str(a.model), "backend": a.backend, "seed": a.seed, "configs": names,
                      "sink": a.sink, "window": a.window}
        if what:
            prompts = tasks.make_set(tok, what, lengths, a.trials, a.seed)
            g = grade.grade(model, tok, prompts, plans)  # a bar on a terminal, else lines (lines_off_terminal)
            cost = ", ".join(f"{L}: prefill {c['prefill_s']:.2f} s + reply {c['decode_s']:.2f} s"
                             for L, c in g.cost().items())
            lines += [f"{a.trials} trial(s) per task and length", g.table(), f"median seconds per reply: {cost}"]
            data["tasks"] = g.to_json()
        for L in a.kl_lengths or []:
            d = grade.divergence(model, tok, plans, L, a.chunks or 4, seed=a.seed)
            lines += ["", d.table()]
            data.setdefault("divergence", []).append(d.to_json())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grade.json").write_text(json.dumps(data, indent=1))
    return "\n".join(lines + [f"wrote {out / 'grade.json'}"])


def cmd_board(a: argparse.Namespace) -> str:
    """``bhqk grade --ratio``: the KV-compression table (bhqk.evaluate.board) into OUT/board.json, resumed."""
    from pathlib import Path

    from .evaluate import board

    for flag, v in (("--plan", a.plan), ("--compare", a.compare), ("--kl-lengths", a.kl_lengths)):
        if v is not None:
            raise ValueError(f"{flag} is not part of the table (--ratio): grade plans without --ratio.")
    if a.lengths is not None and len(a.lengths) != 1:
        raise ValueError(f"--ratio grades at one prompt length, got --lengths {','.join(map(str, a.lengths))}.")
    methods = a.methods or ["full", "bits8", "bits4", "fisher", "fisher+bits4", "best"]
    for name in methods:  # every name and score checked before the model loads
        board.parse(name)
    board.check_scores(a.scores)
    bad = [r for r in a.ratio if not 0 < r < 1]
    if bad:
        raise ValueError(f"--ratio: compression ratios are in (0, 1) (1 − bytes held ÷ the model's own), got {bad}.")
    path = Path(a.out) / "board.json"
    with lines_off_terminal():
        model, tok = causal_lm(a, "bhqk grade")
        b = board.Board(model, tok, length=(a.lengths or [2048])[0], tasks=a.task or list(board.TASKS),
                        trials=a.trials or 30, seed=a.seed, sink=a.sink, window=a.window, scores=a.scores,
                        kl_chunks=a.chunks or 2, path=path, log=lambda line: print(line, file=sys.stderr, flush=True))
        b.run(methods, a.ratio)
    return f"{a.model}\n{b.table()}\nwrote {path}"


GRADED = {"task": "--task", "compare": "--compare", "kl_lengths": "--kl-lengths", "chunks": "--chunks",
          "sink": "--sink", "window": "--window"}
"""``bhqk needle``'s former graded-set options (now ``bhqk grade``'s): refused with a pointer there."""


def cmd_needle(a: argparse.Namespace) -> str:
    """``bhqk needle``: the grid (bhqk.evaluate.needle); off a terminal a line per prompt on stderr."""
    from .evaluate import needle
    from .inspect.edit import parse_edit, zero_heads

    given = [flag for dest, flag in GRADED.items() if getattr(a, dest) is not None]
    if given:
        verb = "belongs" if len(given) == 1 else "belong"
        raise ValueError(f"{', '.join(given)} {verb} to `bhqk grade` (the graded set: tasks, configurations, KL); "
                         f"`bhqk needle` runs the grid of --lengths × --depths. Run `bhqk grade {given[0]} ...`.")
    a.lengths = a.lengths or [1024, 2048, 4096, 8192]
    a.depths = a.depths if a.depths is not None else fraction_list("0,0.1,...,1")
    pairs = parse_edit(a.edit) if a.edit is not None else None
    plan = load_plan(a.plan) if a.plan is not None else None  # before the model: a bad plan fails at once
    with lines_off_terminal():
        model, tok = causal_lm(a, "bhqk needle")
        bar = progress_enabled()  # a terminal: a bar; else a line per prompt on stderr
        result = needle.grid(model, tok, a.lengths, a.depths, a.trials, a.seed, plan=plan,
                             edit=zero_heads(model, pairs) if pairs else None, max_new_tokens=a.max_new_tokens,
                             progress=bar, log=None if bar else lambda line: print(line, file=sys.stderr, flush=True))
    result.meta.update({"model": str(a.model), "backend": a.backend, "edit": a.edit, "plan": a.plan})
    what = " ".join(x for x in (f"edit {a.edit}" if a.edit else "", f"plan {a.plan}" if a.plan else "") if x)
    js, png = result.save(a.out, title=f"{a.model}: pass key found (%)" + (f", {what}" if what else ""))
    return f"{a.model}, seed {a.seed}, {a.trials} trial(s) per cell\n{result.table()}\nwrote {js} and {png}"


MODEL_HELP = ("a model name (smollm2-135m, the default; gemma3-270m), a .gguf file or a Hugging Face folder of a "
              "causal LM")


def add_needle_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("needle", help="needle in a haystack: pass-key retrieval over prompt lengths × depths",
                       description="Hide a random pass key at each depth of a prompt of each length (filler: Python's "
                                   "own documentation), ask for it through the chat template, greedy-decode the "
                                   "answer; print the table of keys found and write OUT/needle.json (one entry per "
                                   "trial) and OUT/needle.png (the heatmap). Deterministic given --seed. Progress: a "
                                   "bar on a terminal, else a line per prompt on stderr. Graded tasks, configurations "
                                   "compared with intervals and the KL divergence: `bhqk grade`.")
    p.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    p.add_argument("--lengths", type=int_list(64), default=None,
                   help="prompt lengths in tokens, template included, at most the model's context (default "
                        "1024,2048,4096,8192)")
    p.add_argument("--depths", type=fraction_list, default=None,
                   help="needle depths, fractions of the filler before it (default 0,0.1,...,1)")
    p.add_argument("--trials", type=int_at_least(1), default=1, help="prompts (keys) per cell (default 1)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the keys and haystacks (default 0)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=16, help="tokens of each answer (default 16)")
    p.add_argument("--out", default="bhqk-needle", help="folder for needle.json and needle.png (default bhqk-needle)")
    p.add_argument("--edit", default=None, metavar="zero:L.H,...",
                   help="zero the outputs of these query heads (layer.head) during every generation, e.g. zero:5.0,12.3")
    p.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="generate with the KV cache of a head-wise budget plan (bhqk.budget.Plan.load)")
    p.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    for dest, flag in GRADED.items():  # refused by cmd_needle with a pointer to `bhqk grade`
        p.add_argument(flag, dest=dest, nargs="*", default=None, help=f"refused here: {flag} belongs to `bhqk grade`")
    p.set_defaults(func=cmd_needle)
    return p


def add_grade_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("grade", help="grade plans on retrieval tasks and real text, with 95 %% intervals",
                       description="Every configuration (the model as it is, every head streaming, plans) answers the "
                                   "same prompts of the tasks (needle, multikey, multivalue, vartrack; depths drawn "
                                   "from --seed); print every accuracy with its Wilson 95 % interval and each "
                                   "configuration's paired difference from the first (Newcombe's interval, McNemar's "
                                   "p); with --kl-lengths the KL divergence from the model and the perplexity on "
                                   "Python's documentation (bootstrap intervals). Writes OUT/grade.json "
                                   "(bhqk.evaluate.grade). Progress: a bar on a terminal, else a line per reply or "
                                   "forward on stderr.")
    p.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    p.add_argument("--task", type=task_list, default=None, metavar="TASK[,TASK...]",
                   help="needle, multikey, multivalue, vartrack (bhqk.evaluate.tasks; default needle, none with "
                        "--kl-lengths alone)")
    p.add_argument("--lengths", type=int_list(64), default=None,
                   help="prompt lengths in tokens, template included (default 1024,2048,4096)")
    p.add_argument("--trials", type=int_at_least(1), default=None,
                   help="prompts per task and length (default 1; with --ratio 30)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the prompts (default 0)")
    p.add_argument("--compare", nargs="+", default=None, metavar="PLAN",
                   help="configurations: full (the model as it is), streaming (every K/V head keeps --sink + --window) "
                        "or a plan's JSON file; differences are taken from the first (default: full)")
    p.add_argument("--plan", default=None, metavar="PLAN.json", help="one plan to grade alone (or give --compare)")
    p.add_argument("--sink", type=int_at_least(0), default=64, help="the streaming configuration's sink (default 64)")
    p.add_argument("--window", type=int_at_least(0), default=256, help="the streaming configuration's window (default 256)")
    p.add_argument("--kl-lengths", type=int_list(2), default=None, metavar="N[,N...]",
                   help="also the KL divergence from the model and the perplexity on --chunks pieces of N tokens "
                        "of real text, at the positions beyond sink + window")
    p.add_argument("--chunks", type=int_at_least(1), default=None,
                   help="text pieces per --kl-lengths length (default 4), or of best's KL with --ratio (default 2)")
    p.add_argument("--ratio", type=fraction_list, default=None, metavar="R[,R...]",
                   help="the KV-compression table: grade --methods at these compression ratios (1 − bytes held ÷ "
                        "the model's own cache's), one prompt length (default 2048), tasks needle,multikey, "
                        "into OUT/board.json; a run resumes where it stopped (bhqk.evaluate.board)")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help="with --ratio: full, bits8, bits4, streaming, a score of bhqk.budget.find (fisher, "
                        "retrieval, ...) optionally +bits8 or +bits4, best (the lowest KL on real text among "
                        "--scores × bits × streaming sizes) (default full bits8 bits4 fisher fisher+bits4 best)")
    p.add_argument("--scores", type=lambda t: [x for x in t.split(",") if x], default=["fisher", "retrieval"],
                   metavar="S[,S...]", help="with --ratio: the scores best chooses among (default fisher,retrieval)")
    p.add_argument("--out", default="bhqk-grade", help="folder for grade.json or board.json (default bhqk-grade)")
    p.add_argument("--backend", type=backend_name, default="auto", help=BACKEND_HELP)
    p.set_defaults(func=cmd_grade)
    return p


# --- the parser ---------------------------------------------------------------------------------


def parser() -> Parser:
    p = Parser(prog="bhqk", description="Multi-head attention with named dimensions [B, H, Q, K].", allow_abbrev=False)
    p.add_argument("--version", action="version", version=version(), help="print the versions of bhqk, torch and Python")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    e = sub.add_parser("explain", help="the shape walk-through of multi-head attention",
                       description="Print the named shape of every step of multi-head attention for the given sizes, "
                                   "and the self-check lines (inner dimension, head split, memory of S and P).")
    e.add_argument("--batch", "-B", type=positive, default=1, help="B, batch size (default 1)")
    e.add_argument("--heads", "-H", type=positive, default=None,
                   help="H, number of query heads (default 2, the worked example's)")
    e.add_argument("--q-len", "-Q", type=positive, default=None, help="Q, query length (default 4, the worked example's)")
    e.add_argument("--k-len", "-K", type=positive, default=None, help="K, key length (default: Q, self-attention)")
    e.add_argument("--head-dim", "-d", type=positive, default=None,
                   help="d, head dimension of queries and keys (default 3, the worked example's)")
    e.add_argument("--value-dim", type=positive, default=None, help="dv, head dimension of values (default d)")
    e.add_argument("--kv-heads", type=positive, default=None, help="Hkv, key/value heads; H must be a multiple (default H)")
    e.add_argument("--model-dim", type=positive, default=None, help="D, model width (default H·d)")
    e.add_argument("--lang", choices=("en", "zh"), default="en", help="language of the walk-through: en (default) or zh")
    e.add_argument("--html", metavar="FILE", default=None,
                   help="write a page that draws every step with its numbers (English/中文); "
                        "sizes optional, default: the worked 4×3 example")
    e.set_defaults(func=cmd_explain)

    m = sub.add_parser("mask", help="draw a mask (rows = queries, columns = keys)",
                       description="Draw a mask as rows of ■ (may attend) and · (masked), one row per query and "
                                   f"one column per key; at most {MAX_DRAW_CELLS:,} cells.")
    m.add_argument("kind", choices=MASK_KINDS, help="the kind of mask: " + ", ".join(MASK_KINDS))
    m.add_argument("--q-len", "-Q", type=positive, default=8, help="Q, query length (rows; default 8)")
    m.add_argument("--k-len", "-K", type=positive, default=None, help="K, key length (columns; default: Q)")
    m.add_argument("--align", choices=("top_left", "bottom_right"), default=None,
                   help="causal alignment, needed when Q ≠ K: top_left (PyTorch's is_causal) or bottom_right "
                        "(FlashAttention, decoding with a KV cache)")
    m.add_argument("--left", type=int_at_least(0), default=2, help="sliding_window: keys before the query (default 2)")
    m.add_argument("--right", type=int_at_least(0), default=0, help="sliding_window: keys after the query (default 0)")
    m.add_argument("--lengths", type=int_list(0), default=[3, 5],
                   help="padding: valid key lengths, one per batch element (default 3,5)")
    m.add_argument("--doc-ids", type=int_list(), default=[0, 0, 0, 1, 1, 2, 2, 2],
                   help="document: a document id per query position (default 0,0,0,1,1,2,2,2)")
    m.add_argument("--k-doc-ids", type=int_list(), default=None,
                   help="document: a document id per key position (default: --doc-ids)")
    m.add_argument("--prefix", type=int_at_least(0), default=3, help="prefix_lm: prefix length (default 3)")
    m.set_defaults(func=cmd_mask)

    d = sub.add_parser("demo", help="a worked example, a traced multi-head forward, pictures of real attention",
                       description="The 4×3 worked example (S = Q·Kᵀ, P, O), a traced multi-head forward, and "
                                   "pictures of a real sentence's attention through the bundled MiniLM.")
    d.add_argument("--out", default="bhqk-show", help="folder for the attention pictures (default: bhqk-show)")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("calibrate", help="measure what attention costs on this machine (what backend='auto' weighs)",
                       description="Time SDPA and the tiled backend (a second or two) and, with --flex, compile and time "
                                   "FlexAttention; keep the costs for this machine (BHQK_COSTS names the file, default "
                                   "~/.cache/bhqk/costs.json). auto weighs flex only once its costs are measured.")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device to measure (default cpu)")
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32",
                   help="the dtype to measure (default float32)")
    c.add_argument("--flex", action="store_true", help="also compile and time FlexAttention (tens of seconds on a CPU)")
    c.set_defaults(func=cmd_calibrate)

    from .models.cli import add_embed_parser, add_generate_parser
    from .viz.cli import add_show_parser, add_trace_parser

    add_embed_parser(sub)
    add_generate_parser(sub).set_defaults(load_plan=load_plan)  # --plan: bhqk.budget sits above models
    add_show_parser(sub)
    add_trace_parser(sub)
    from .viz.stats_cli import add_stats_parser

    add_stats_parser(sub).set_defaults(load_plan=load_plan)  # --plan: bhqk.budget sits above viz
    add_needle_parser(sub)
    add_grade_parser(sub)
    from .budget.cli import add_budget_parser

    add_budget_parser(sub)
    for each in sub.choices.values():
        each.set_defaults(flags_=flags_of(each), parser_=each)
    return p


# --- errors in flag syntax ----------------------------------------------------------------------


def flags_of(p: argparse.ArgumentParser) -> dict[str, str]:
    """The long flag of each option of a (sub)parser, by the library's parameter name: align -> --align."""
    out = {}
    for action in p._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs:
            out[action.dest] = longs[0]
    return out


def in_flag_syntax(message: str, flags: dict[str, str]) -> str:
    """Library messages are written for Python (``pass align='top_left'``); on the command line the
    same hint is a flag (``pass --align top_left``). Only names that are options of the running
    subcommand are rewritten, and only as a hint (``name='value'`` not inside a call's parentheses)."""

    def flag(match: re.Match) -> str:
        name, value = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
        return f"{flags[name]} {value}" if name in flags else match.group(0)

    return re.sub(r"(?<![\w(.,])(?<!, )([a-z_]+)=(?:'([^']*)'|\"([^\"]*)\")", flag, message)


def error_message(command: str, e: BaseException, flags: dict[str, str]) -> str:
    """``bhqk CMD: error: <the whole message>``; later lines of a multi-line message are kept."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None:
        text = f"{e.strerror or type(e).__name__}: {e.filename}"
    return f"bhqk {command}: error: {in_flag_syntax(text, flags)}"


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:  # named by the subcommand they were given to, not by the top-level parser
        args.parser_.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        text = args.func(args)
    except USER_ERRORS as e:
        print(error_message(args.command, e, args.flags_), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"bhqk {args.command}: interrupted", file=sys.stderr)
        return 130
    if text:
        try:
            print(text)
        except BrokenPipeError:  # e.g. `bhqk demo | head`
            sys.stdout = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
