"""Attention over sequences sharded across processes (ring attention / context parallelism) on
torch.distributed: gloo on CPUs, nccl on GPUs. Masks stay in global positions.

``ring_attention`` is the function, ``RingMultiHeadAttention`` the module; ``shard``/``unshard``/
``gather`` cut a sequence into per-rank pieces (zig-zag, striped or contiguous) and put it back.
Run ``torchrun --nproc-per-node 4 -m bhqk.distributed.demo`` to see it work.
"""

from .module import RingMultiHeadAttention
from .ring import ring_attention
from .shard import SCHEMES, gather, index_map, padded_length, positions, shard, unshard

__all__ = ["ring_attention", "RingMultiHeadAttention", "shard", "unshard", "gather", "positions",
           "index_map", "padded_length", "SCHEMES"]
