"""Ring attention on a real distributed engine. Launch with torchrun::

    torchrun --nproc-per-node 4 -m bhqk.distributed.demo              # gloo on CPUs
    torchrun --nproc-per-node 8 -m bhqk.distributed.demo --seq-len 65536    # nccl when CUDA is there

Every rank builds the same random q, k, v (seeded), keeps its zig-zag shard, runs causal ring
attention over packed documents forward and backward, and rank 0 compares the gathered result
with single-process ``bhqk.attention`` (tiled backend). It prints each rank's shard shape and the
max difference; per-rank peak memory is measured by ``benchmarks/ring.py``. The process group is
created with ``--timeout`` seconds (default 60): a peer that dies or stalls makes the others raise
instead of waiting forever.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from .. import masks
from ..functional import attention
from .ring import ring_attention
from .shard import gather, index_map, shard


def _args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bhqk.distributed.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096, help="sequence length N (queries = keys), default 4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="Hkv (GQA), default = heads")
    ap.add_argument("--dim", type=int, default=64, help="head dimension d")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    ap.add_argument("--sharding", choices=["zigzag", "striped", "contiguous"], default="zigzag")
    ap.add_argument("--docs", type=int, default=3, help="packed documents in the sequence (1 = plain causal)")
    ap.add_argument("--backend", default=None, help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("run me under torchrun, e.g.:  torchrun --nproc-per-node 4 -m bhqk.distributed.demo", file=sys.stderr)
        return 2
    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.timeout))
    try:
        return _run(a, backend, device)
    finally:
        dist.destroy_process_group()


def _run(a, backend: str, device: torch.device) -> int:
    rank, P = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, a.dtype)
    B, H, Hkv, N, d = a.batch, a.heads, a.kv_heads or a.heads, a.seq_len, a.dim
    g = torch.Generator().manual_seed(0)  # the same global tensors on every rank
    q = torch.randn(B, H, N, d, generator=g).to(device, dtype)  # [B, H, N, d]
    k = torch.randn(B, Hkv, N, d, generator=g).to(device, dtype)  # [B, Hkv, N, d]
    v = torch.randn(B, Hkv, N, d, generator=g).to(device, dtype)  # [B, Hkv, N, dv]
    dout = torch.randn(B, H, N, d, generator=g).to(device, dtype)  # [B, H, N, dv]
    ids = torch.sort(torch.randint(0, a.docs, (N,), generator=g)).values.to(device)  # document id per position
    mask = masks.causal() & masks.document(ids) if a.docs > 1 else masks.causal()

    cut = lambda t: shard(t, rank, P, scheme=a.sharding).contiguous()  # noqa: E731  [B, ·, N/P, ·]
    ql, kl, vl, dl = cut(q), cut(k), cut(v), cut(dout)
    for t in (ql, kl, vl):
        t.requires_grad_(True)
    out = ring_attention(ql, kl, vl, mask, sharding=a.sharding)  # [B, H, N/P, d]
    dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), dl)  # this rank's shards of the gradients
    got = [gather(t, scheme=a.sharding) for t in (out.detach(), dq, dk, dv)]  # [B, ·, N, ·]
    if rank == 0:
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        want = attention(qr, kr, vr, mask, backend="tiled")  # [B, H, N, d]
        want.backward(dout)
        diffs = [float((x.double() - w.double()).abs().max()) for x, w in zip(got, (want.detach(), qr.grad, kr.grad, vr.grad))]
        print(f"bhqk ring attention: {backend} on {device.type}, {P} ranks, B={B}, H={H}, Hkv={Hkv}, N={N}, d={d}, "
              f"{a.dtype}, mask {mask!r}, {a.sharding} sharding, process-group timeout {a.timeout:g} s")
        for r in range(P):
            m = index_map(N, r, P, a.sharding)
            where = ", ".join(f"{x.first}…{x.first + x.step * (x.length - 1)}" + (f" step {x.step}" if x.step > 1 else "")
                              for x in m.runs)
            print(f"  rank {r}: q shard {list(ql.shape)} (positions {where}), k/v shard {list(kl.shape)}")
        print(f"  max |ring - single-process tiled|: out {diffs[0]:.2e}, dq {diffs[1]:.2e}, "
              f"dk {diffs[2]:.2e}, dv {diffs[3]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
