"""Sharding a sequence over ranks, and putting it back together.

Three schemes, drawn for 8 positions over 2 ranks (the digit is the rank that holds the position)::

    contiguous  0 0 0 0 1 1 1 1     rank r holds one slice; causal work is unbalanced
    zigzag      0 0 1 1 1 1 0 0     2·P chunks; rank r holds chunks r and 2P-1-r (balanced causal)
    striped     0 1 0 1 0 1 0 1     rank r holds positions r, r+P, … (balanced causal)

Every rank holds N / P positions. A length that does not split evenly is an error; pad it to
:func:`padded_length` and mask the padded keys with ``bhqk.masks.padding(N)`` (their query rows
are computed and then dropped by :func:`unshard`).
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..masks.view import IndexMap

SCHEMES = ("contiguous", "zigzag", "striped")


def _parts(scheme: str, world_size: int) -> int:
    if scheme not in SCHEMES:
        raise ValueError(f"sharding must be one of {SCHEMES}, got {scheme!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    return 2 * world_size if scheme == "zigzag" else world_size


def padded_length(n: int, world_size: int, scheme: str = "zigzag") -> int:
    """The smallest length >= n that ``scheme`` splits evenly over ``world_size`` ranks."""
    p = _parts(scheme, world_size)
    return -(-n // p) * p


def index_map(n: int, rank: int, world_size: int, scheme: str = "zigzag", what: str = "sequence") -> IndexMap:
    """Global positions of rank ``rank``'s shard of a length-``n`` sequence."""
    p = _parts(scheme, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0…{world_size - 1}, got {rank}.")
    if n % p:
        raise ShapeError(
            f"{what} length {n} does not split evenly for {scheme} sharding over {world_size} ranks: it needs a "
            f"multiple of {p}. Pad it to {padded_length(n, world_size, scheme)} and mask the padded keys with "
            f"bhqk.masks.padding({n}); drop the padded query rows after unshard."
        )
    if scheme == "contiguous":
        c = n // world_size
        return IndexMap([(c, rank * c, 1)], n)
    if scheme == "zigzag":
        c = n // p
        return IndexMap([(c, rank * c, 1), (c, (p - 1 - rank) * c, 1)], n)
    return IndexMap([(n // world_size, rank, world_size)], n)


def positions(n: int, rank: int, world_size: int, scheme: str = "zigzag") -> torch.Tensor:
    """Global position of each local position (int64 [n / P]), e.g. for rotary embeddings."""
    return index_map(n, rank, world_size, scheme).positions()


def _axis(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ShapeError(f"dim={dim} is not an axis of a {x.dim()}-D tensor of shape {list(x.shape)}.")
    return dim % x.dim()


def shard(x: torch.Tensor, rank: int, world_size: int, *, dim: int = 2, scheme: str = "zigzag") -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along the sequence axis ``dim`` (2 for [B, H, N, d], 1 for [B, N, D]).

    Contiguous and striped shards are views (striped ones strided); zig-zag shards are copies. Differentiable.
    """
    dim = _axis(x, dim)
    m = index_map(x.shape[dim], rank, world_size, scheme, what=f"axis {dim} of shape {list(x.shape)}")
    parts = [x.narrow(dim, r.first, r.length) if r.step == 1 else x.narrow(dim, r.first, r.step * (r.length - 1) + 1)[
        (slice(None),) * dim + (slice(None, None, r.step),)] for r in m.runs]  # each [..., run, ...]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)  # [..., N/P, ...]


def unshard(pieces: list[torch.Tensor], *, dim: int = 2, scheme: str = "zigzag") -> torch.Tensor:
    """The whole tensor from every rank's shard (``pieces[r]`` from rank r): the inverse of :func:`shard`."""
    if not pieces:
        raise ValueError("unshard needs one piece per rank, got none.")
    world_size = len(pieces)
    dim = _axis(pieces[0], dim)
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) != 1:
        raise ShapeError(f"unshard: the pieces have different shapes {sorted(shapes)}; every rank holds N/P positions.")
    n = pieces[0].shape[dim] * world_size
    if scheme == "striped":
        return torch.stack(pieces, dim=dim + 1).flatten(dim, dim + 1)  # [..., N/P, P, ...] -> [..., N, ...]
    order: list[tuple[int, torch.Tensor]] = []
    for r, p in enumerate(pieces):
        m = index_map(n, r, world_size, scheme)
        order += [(run.first, p.narrow(dim, run.start, run.length)) for run in m.runs]
    return torch.cat([t for _, t in sorted(order, key=lambda e: e[0])], dim=dim)  # [..., N, ...]


def gather(x: torch.Tensor, *, dim: int = 2, scheme: str = "zigzag", group=None) -> torch.Tensor:
    """The whole tensor on every rank from each rank's shard ``x`` (an all-gather; not differentiable)."""
    import torch.distributed as dist

    from .group import Ring

    ring = Ring.of(group)
    pieces = [torch.empty_like(x) for _ in range(ring.size)]
    dist.all_gather(pieces, x.contiguous(), group=ring.group)
    return unshard(pieces, dim=dim, scheme=scheme)
