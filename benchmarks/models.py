"""Real-model speed: bhqk vs transformers on the CPU. Prints a Markdown table, writes JSON.

1. all-MiniLM-L6-v2 encoder throughput (sentences/s; default batch 32, length 128): bhqk vs
   transformers BertModel with attn_implementation "eager" and "sdpa".
2. GPT-2 decode (tokens/s; a GPT-2-small-shaped random model: 12 layers, 12 heads, D=768, V=50257;
   default prompt 128, 128 new tokens, batch 1, greedy): bhqk with the KV cache, bhqk recomputing
   the whole sequence each step, transformers ``generate`` (sdpa, its own cache).

Implementations are interleaved within each repeat and medians reported (the machine is shared).

    python benchmarks/models.py            # the full configuration (~4 minutes on 2 quiet cores)
    python benchmarks/models.py --quick    # a smoke run on smaller shapes (under a minute on 2 quiet cores),
                                           # written to the untracked benchmarks/results/local/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import machine  # benchmarks/machine.py: CPU model and flags for every JSON
from bhqk.models import GPT2, BertEncoder, GPT2Config, bundled_model_dir, load_checked, remap_gpt2


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bar(iterable, desc: str):
    """A tqdm bar on a terminal; quiet when piped."""
    return tqdm(iterable, desc=desc, leave=False, disable=not (sys.stderr.isatty() and sys.stdout.isatty()))


def paired(times: dict[str, list[float]], name: str, ref: str) -> float:
    """Median over repeats of t_ref / t_name, each pair measured back to back: the speed of ``name``
    relative to ``ref``, robust to load that drifts during the run (the machine is shared)."""
    n = min(len(times[name]), len(times[ref]))
    return statistics.median(times[ref][r] / times[name][r] for r in range(n))


def bench_encoder(batch: int, length: int, repeats: int) -> dict:
    from transformers import BertModel

    folder = bundled_model_dir()
    impls = {
        "bhqk": BertEncoder.from_pretrained(folder),
        "transformers-eager": BertModel.from_pretrained(str(folder), attn_implementation="eager").eval(),
        "transformers-sdpa": BertModel.from_pretrained(str(folder), attn_implementation="sdpa").eval(),
    }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, length), generator=g)  # [B, N]
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] … [SEP]
    mask = torch.ones_like(ids)
    calls = {
        "bhqk": lambda: impls["bhqk"](ids, mask),
        "transformers-eager": lambda: impls["transformers-eager"](input_ids=ids, attention_mask=mask),
        "transformers-sdpa": lambda: impls["transformers-sdpa"](input_ids=ids, attention_mask=mask),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for fn in calls.values():
            fn()  # warm-up
        for _ in bar(range(repeats), "encoder repeats"):
            for name, fn in calls.items():
                times[name].append(timed(fn))
    return {name: {"median_s": statistics.median(t), "sentences_per_s": batch / statistics.median(t), "times_s": t,
                   "vs_transformers_sdpa": paired(times, name, "transformers-sdpa")}
            for name, t in times.items()}


def gpt2_pair(layers: int, heads: int, width: int, vocab: int, positions: int):
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    hf_cfg = HFConfig(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    hf = GPT2LMHeadModel(hf_cfg).eval()
    ours = GPT2(GPT2Config.from_hf(hf_cfg.to_dict())).eval()
    load_checked(ours, remap_gpt2(hf.state_dict()))  # the same weights through the key table
    return ours, hf


def bench_decoder(args) -> dict:
    ours, hf = gpt2_pair(args.layers, args.heads, args.width, args.vocab, args.positions)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, args.vocab, (1, args.prompt), generator=g)  # [1, N]
    n = args.new_tokens
    calls = {"bhqk (KV cache)": lambda: ours.generate(prompt, n)}
    if not args.skip_recompute:  # right after the cached run, so the two are paired in time
        calls["bhqk (recompute)"] = lambda: ours.generate(prompt, n, use_cache=False)
    calls["transformers generate"] = lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        same = torch.equal(calls["bhqk (KV cache)"](), calls["transformers generate"]())  # also the warm-up
        times: dict[str, list[float]] = {k: [] for k in calls}
        for r in bar(range(args.repeats), "decoder repeats"):
            for name, fn in calls.items():
                if name == "bhqk (recompute)" and r >= args.recompute_repeats:
                    continue
                times[name].append(timed(fn))
    out = {name: {"median_s": statistics.median(t), "tokens_per_s": n / statistics.median(t), "times_s": t,
                  "vs_transformers": paired(times, name, "transformers generate"),
                  "kv_cache_speedup": paired(times, "bhqk (KV cache)", name)}
           for name, t in times.items()}
    out["greedy_ids_equal_transformers"] = same
    return out


def markdown(cfg: dict, enc: dict | None, dec: dict | None) -> str:
    lines = ["Ratios are medians over repeats of runs measured back to back (robust to drifting load).", ""]
    if enc is not None:
        lines += [f"**all-MiniLM-L6-v2 encoder**, batch {cfg['batch']}, length {cfg['length']}, fp32, "
                  f"{cfg['threads']} threads (median of {cfg['repeats']})", "",
                  "| implementation | sentences/s | ms / batch | vs transformers-sdpa |", "|---|---:|---:|---:|"]
        for name, r in enc.items():
            lines.append(f"| {name} | {r['sentences_per_s']:.1f} | {1000 * r['median_s']:.0f} "
                         f"| {r['vs_transformers_sdpa']:.2f}× |")
        lines.append("")
    if dec is not None:
        lines += [f"**GPT-2-small-shaped decoder** (random weights; {cfg['layers']} layers, {cfg['heads']} heads, "
                  f"D={cfg['width']}, V={cfg['vocab']}), prompt {cfg['prompt']}, {cfg['new_tokens']} new tokens, "
                  f"batch 1, greedy (median of {cfg['repeats']}; recompute: {cfg['recompute_repeats']})", "",
                  "| implementation | tokens/s | s / run | vs transformers | KV cache speed-up over it |",
                  "|---|---:|---:|---:|---:|"]
        for name, r in dec.items():
            if not isinstance(r, dict):
                continue
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['median_s']:.2f} | {r['vs_transformers']:.2f}× "
                         f"| {r['kv_cache_speedup']:.1f}× |")
        lines.append("")
        lines.append("tokens/s = new tokens / wall time of the whole call (prefill included). "
                     f"Greedy ids equal transformers.generate: {dec['greedy_ids_equal_transformers']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 repeats, batch 8, length 64; a 4-layer decoder, prompt 32, 16 new tokens, "
                        "recompute once; written to benchmarks/results/local/")
    p.add_argument("--only", choices=("encoder", "decoder"), default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--recompute-repeats", type=int, default=3, help="runs of the slow no-cache decoder (≤ --repeats)")
    p.add_argument("--skip-recompute", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", default=None,
                   help="output path (default benchmarks/results/models.json; "
                        "--quick: benchmarks/results/local/models-quick.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens = min(args.repeats, 2), min(args.new_tokens, 16)
        args.batch, args.length, args.layers = min(args.batch, 8), min(args.length, 64), min(args.layers, 4)
        args.prompt, args.recompute_repeats = min(args.prompt, 32), min(args.recompute_repeats, 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = {k: v for k, v in vars(args).items() if k not in ("json", "only")}
    cfg["threads"] = torch.get_num_threads()
    load_before = os.getloadavg()
    enc = bench_encoder(args.batch, args.length, args.repeats) if args.only in (None, "encoder") else None
    dec = bench_decoder(args) if args.only in (None, "decoder") else None
    load_after = os.getloadavg()
    table = markdown(cfg, enc, dec) + (f"\n\nLoad average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f} "
                                       f"on {os.cpu_count()} CPUs (other work on the machine slows every row).")
    print(table)
    results = Path(__file__).parent / "results"
    out = Path(args.json) if args.json else (results / "local" / "models-quick.json" if args.quick else results / "models.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine.describe(), "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)]}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    out.write_text(json.dumps({"config": cfg, "meta": meta, "encoder": enc, "decoder": dec, "markdown": table}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
