"""A two-layer attention-only transformer small enough to ship trained (``data/induction.safetensors``,
made by ``examples/train_induction.py``): the smallest model in which an induction head forms, so the
head detector (:mod:`bhqk.inspect.heads`) can be checked on a head known to exist.

tokens [B, N] → embedding + learned position [B, N, D] → 2 × (x + MultiHeadAttention(x), causal)
→ unembedding [B, N, V]. No MLP, no normalization: every path through the model is attention.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..masks import causal
from ..nn import MultiHeadAttention

WEIGHTS = Path(__file__).with_name("data") / "induction.safetensors"


@dataclass
class ToyConfig:
    vocab: int = 64  # V
    width: int = 64  # D
    heads: int = 4  # H
    layers: int = 2
    max_len: int = 64  # positions with a learned embedding


class AttnOnly(nn.Module):
    """Embedding, ``layers`` causal self-attention blocks with residuals, unembedding."""

    def __init__(self, c: ToyConfig | None = None, backend: str = "auto") -> None:
        super().__init__()
        self.config = c = c or ToyConfig()
        self.embed = nn.Embedding(c.vocab, c.width)  # V -> D
        self.pos = nn.Embedding(c.max_len, c.width)  # N -> D
        self.blocks = nn.ModuleList(MultiHeadAttention(c.width, c.heads, backend=backend) for _ in range(c.layers))
        self.unembed = nn.Linear(c.width, c.vocab, bias=False)  # D -> V

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, N] → logits [B, N, V]."""
        N = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(N, device=ids.device))  # [B, N, D]
        for blk in self.blocks:
            x = x + blk(x, mask=causal())  # [B, N, D]
        return self.unembed(x)  # [B, N, V]


def save(model: AttnOnly, path: str | Path) -> None:
    from safetensors.torch import save_file

    meta = {k: str(v) for k, v in asdict(model.config).items()}
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path), metadata=meta)


def load(path: str | Path = WEIGHTS, backend: str = "auto") -> AttnOnly:
    """The shipped toy model (or another file written by :func:`save`), in eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    model = AttnOnly(ToyConfig(**{k: int(v) for k, v in meta.items()}), backend=backend)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


def repeated(batch: int, length: int, vocab: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, 2·length] token ids: a random sequence followed by itself (induction's test input)."""
    seg = torch.randint(0, vocab, (batch, length), generator=generator)  # [B, L]
    return torch.cat([seg, seg], dim=1)  # [B, 2L]


__all__ = ["AttnOnly", "ToyConfig", "WEIGHTS", "save", "load", "repeated"]
