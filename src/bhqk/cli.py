"""The ``bhqk`` command line. Errors print one clear line and exit 2, without a traceback."""

from __future__ import annotations

import argparse
import sys

import torch

from . import masks
from .errors import BackendError, LoadError, MaskError, ShapeError
from .explain import explain

USER_ERRORS = (ShapeError, MaskError, BackendError, LoadError, ValueError, FileNotFoundError, ImportError)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_explain(a: argparse.Namespace) -> str:
    if a.html:
        from .viz.walkthrough import cmd_explain_html

        return cmd_explain_html(a)
    if None in (a.heads, a.q_len, a.head_dim):
        raise ValueError("explain needs --heads, --q-len and --head-dim (or --html FILE, which draws the worked example).")
    return explain(B=a.batch, H=a.heads, Q=a.q_len, K=a.k_len if a.k_len else a.q_len, d=a.head_dim,
                   dv=a.value_dim, Hkv=a.kv_heads, D=a.model_dim, lang=a.lang)


MASK_KINDS = ("causal", "sliding_window", "padding", "document", "prefix_lm", "full")


def build_mask(a: argparse.Namespace) -> masks.Mask | None:
    if a.kind == "causal":
        return masks.causal(a.align)
    if a.kind == "sliding_window":
        return masks.sliding_window(a.left, a.right, a.align)
    if a.kind == "padding":
        return masks.padding(torch.tensor(_ints(a.lengths)))
    if a.kind == "document":
        q_ids = torch.tensor(_ints(a.doc_ids))
        k_ids = torch.tensor(_ints(a.k_doc_ids)) if a.k_doc_ids else None
        return masks.document(q_ids, k_ids)
    if a.kind == "prefix_lm":
        return masks.prefix_lm(a.prefix, a.align)
    return None


def cmd_mask(a: argparse.Namespace) -> str:
    m = build_mask(a)
    K = a.k_len if a.k_len else a.q_len
    if m is None:
        return f"full (no mask), Q={a.q_len}, K={K}\n" + "\n".join(" ".join("■" * K) for _ in range(a.q_len))
    B = len(_ints(a.lengths)) if a.kind == "padding" else 1
    out = [f"{m!r}  [Q={a.q_len} rows = queries, K={K} columns = keys; ■ may attend, · masked]"]
    for b in range(B):
        if B > 1:
            out.append(f"batch {b}:")
        out.append(m.draw(a.q_len, K, b=b, B=B))
    return "\n".join(out)


def cmd_demo(a: argparse.Namespace) -> str:
    from .demo import run

    return run(a.out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bhqk", description="Multi-head attention with named dimensions [B, H, Q, K].")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("explain", help="the shape walk-through of multi-head attention")
    e.add_argument("--batch", "-B", type=int, default=1, help="B, batch size")
    e.add_argument("--heads", "-H", type=int, default=None, help="H, number of query heads")
    e.add_argument("--q-len", "-Q", type=int, default=None, help="Q, query length")
    e.add_argument("--k-len", "-K", type=int, default=None, help="K, key length (default: Q, self-attention)")
    e.add_argument("--head-dim", "-d", type=int, default=None, help="d, head dimension")
    e.add_argument("--value-dim", type=int, default=None, help="dv, value head dimension (default d)")
    e.add_argument("--kv-heads", type=int, default=None, help="Hkv, key/value heads (default H)")
    e.add_argument("--model-dim", type=int, default=None, help="D, model width (default H·d)")
    e.add_argument("--lang", choices=("en", "zh"), default="en")
    e.add_argument("--html", metavar="FILE", default=None,
                   help="write a page that draws every step with its numbers (English/中文); sizes optional, default: the worked 4×3 example")
    e.set_defaults(func=cmd_explain)

    m = sub.add_parser("mask", help="draw a mask (rows = queries, columns = keys)")
    m.add_argument("kind", choices=MASK_KINDS)
    m.add_argument("--q-len", "-Q", type=int, default=8)
    m.add_argument("--k-len", "-K", type=int, default=None, help="default: Q")
    m.add_argument("--align", choices=("top_left", "bottom_right"), default=None, help="causal alignment when Q ≠ K")
    m.add_argument("--left", type=int, default=2, help="sliding_window: keys before the query")
    m.add_argument("--right", type=int, default=0, help="sliding_window: keys after the query")
    m.add_argument("--lengths", default="3,5", help="padding: valid key lengths per batch element, e.g. 3,5")
    m.add_argument("--doc-ids", default="0,0,0,1,1,2,2,2", help="document: a document id per query position")
    m.add_argument("--k-doc-ids", default=None, help="document: ids per key position (default: --doc-ids)")
    m.add_argument("--prefix", type=int, default=3, help="prefix_lm: prefix length")
    m.set_defaults(func=cmd_mask)

    d = sub.add_parser("demo", help="the seed's worked example, a traced multi-head forward, pictures of real attention")
    d.add_argument("--out", default="bhqk-show", help="folder for the attention pictures (default: bhqk-show)")
    d.set_defaults(func=cmd_demo)
    from .models.cli import add_embed_parser, add_generate_parser
    from .viz.cli import add_show_parser

    add_embed_parser(sub)
    add_generate_parser(sub)
    add_show_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        text = args.func(args)
    except USER_ERRORS as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"bhqk {args.command}: error: {first}", file=sys.stderr)
        return 2
    if text:
        try:
            print(text)
        except BrokenPipeError:  # e.g. `bhqk demo | head`
            sys.stdout = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
