"""``bhqk demo``: a worked example small enough to check by hand, then a multi-head forward with its trace."""

from __future__ import annotations

import torch

from .functional import attention, attention_weights
from .inspect import trace
from .nn import MultiHeadAttention
from .text import number_grid
from .viz.walkthrough import EXAMPLE_K, EXAMPLE_Q  # the worked example: n = 4 tokens of width d = 3


def seed_example() -> str:
    """S = Q·Kᵀ, P = softmax(S), O = P·V for the worked 4×3 matrices (scale 1, so the table is Q·Kᵀ itself)."""
    q = torch.tensor(EXAMPLE_Q, dtype=torch.float64)[None, None]  # [B=1, H=1, Q=4, d=3]
    k = torch.tensor(EXAMPLE_K, dtype=torch.float64)[None, None]  # [B=1, H=1, K=4, d=3]
    v = k.clone()  # the example gives no V; use V = K so O keeps width d = 3
    S = (q @ k.transpose(-2, -1))[0, 0]  # [Q, K] = Q @ Kᵀ
    P = attention_weights(q, k, scale=1.0)[0, 0]  # [Q, K]
    O = attention(q, k, v, scale=1.0, backend="reference")[0, 0]  # [Q, dv]
    lines = [
        "1. A worked example, one batch element and one head (B=1, H=1), small enough to check by hand:",
        f"   Q: {list(q.shape[2:])} = [Q=4, d=3]   K: {list(k.shape[2:])} = [K=4, d=3]",
        f"   S = Q·Kᵀ: [Q, d] @ [d, K] -> [Q, K] = {list(S.shape)}  (row = query, column = key)",
        number_grid(S.tolist(), "{:9.4f}"),
        "   P = softmax(S) row by row (scale 1 here; bhqk's default is 1/√d):",
        number_grid(P.tolist(), "{:9.4f}"),
        f"   row sums: {[round(x, 6) for x in P.sum(-1).tolist()]}",
        f"   O = P·V with V = K: [Q, K] @ [K, dv] -> [Q, dv] = {list(O.shape)}  (each token keeps width 3)",
        number_grid(O.tolist(), "{:9.4f}"),
    ]
    return "\n".join(lines)


def multihead_example() -> str:
    """A cross-attention forward (Q ≠ K, GQA) with the trace of what flowed."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 8, num_kv_heads=2)
    x, ctx = torch.randn(2, 5, 64), torch.randn(2, 7, 64)
    with trace(mha) as t:
        out = mha(x, ctx)
    return "\n".join([
        "2. MultiHeadAttention(D=64, H=8, Hkv=2): x [B=2, Q=5, D=64] attends to a context [B=2, K=7, D=64]",
        f"   output: {list(out.shape)} = [B, Q, D]; the trace of the call:",
        str(t),
    ])


def attention_pictures(out_dir: str = "bhqk-show") -> str:
    """3. A real sentence's attention: the bundled MiniLM, captured on the fast path, drawn."""
    from .errors import LoadError
    from .viz.cli import show

    report: list[str] = []
    try:
        paths = show("The cat sat on the mat.", out_dir, backend="torch", report=report)
    except (ImportError, LoadError) as e:
        return f"3. Pictures of attention skipped: {e}"
    return "\n".join(["3. Attention of a real sentence (bundled all-MiniLM-L6-v2, captured from the SDPA path),",
                      "   as `bhqk show` draws it:",
                      *(f"   {r}" for r in report), *(f"   wrote {p}" for p in paths)])


def run(out_dir: str = "bhqk-show") -> str:
    return "\n\n".join([seed_example(), multihead_example(), attention_pictures(out_dir), next_steps()])


def next_steps() -> str:
    return "\n".join([
        "Try next:",
        "  bhqk explain --batch 2 --heads 8 --q-len 5 --k-len 7 --head-dim 64 --kv-heads 2 [--lang zh]",
        "  bhqk explain --html walkthrough.html      # every step of the worked example, with its numbers",
        "  bhqk mask causal --q-len 4 --k-len 6 --align bottom_right",
        "  bhqk mask sliding_window --q-len 8 --left 2",
        '  bhqk embed "A man is eating food." "A man eats a meal." "The sky is blue."',
        '  bhqk show "The cat sat on the mat." [--model DIR]   # any local Hugging Face folder',
        '  bhqk trace --model DIR "The cat sat on the mat."    # every attention call by module path',
        "  torchrun --nproc-per-node 4 -m bhqk.distributed.demo",
    ])
