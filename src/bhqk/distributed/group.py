"""This process's place in a ring of processes (a torch.distributed group): what ring attention
and ``gather`` share, in its own module so that neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ring:
    """This process's place in a ring over ``group``: its rank there, and the global ranks of its neighbours."""

    group: dist.ProcessGroup
    rank: int
    size: int
    prev: int
    next: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> Ring:
        if not dist.is_available():
            raise RuntimeError("ring attention needs torch.distributed, which this PyTorch build does not have.")
        if not dist.is_initialized():
            raise RuntimeError(
                "ring attention needs a process group, and torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(backend, timeout=...) in every process first (torchrun "
                "sets the rendezvous variables), or pass group= an existing group."
            )
        g = dist.group.WORLD if group is None else group
        if g is None:  # WORLD is set once torch.distributed is initialized
            raise RuntimeError("ring attention: torch.distributed is initialized but has no default process group.")
        rank, size = dist.get_rank(g), dist.get_world_size(g)
        if rank < 0:
            raise RuntimeError(f"this process (global rank {dist.get_rank()}) is not a member of the group passed as group=.")
        glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(g, i))
        return cls(g, rank, size, glob((rank - 1) % size), glob((rank + 1) % size))

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor], tag: int, what: str, step: int) -> list:
        """Send ``send`` to the next rank and receive ``recv`` from the previous one, without waiting."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(recv)]
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._failed(what, step, e) from e

    def wait(self, works: list, what: str, step: int) -> None:
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # gloo/nccl report a dead or silent peer as RuntimeError (DistBackendError)
            raise self._failed(what, step, e) from e

    def _failed(self, what: str, step: int, cause: Exception) -> RuntimeError:
        return RuntimeError(
            f"ring attention: rank {self.rank} of {self.size} failed at step {step} passing {what} (to global rank "
            f"{self.next}, from global rank {self.prev}): a peer died, hung, or the process group's timeout ran "
            f"out (set it with init_process_group(timeout=...)). Cause: {cause}"
        )
