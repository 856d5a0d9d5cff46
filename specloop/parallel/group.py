"""The ranks' process group: gloo on CPU, NCCL on CUDA, one per engine.

The group is built straight from a TCP store (no `init_process_group`), so it is no
process-wide default: one process may hold several engines, each with its own group, and
nothing here touches global `torch.distributed` state. Collectives time out after
`TIMEOUT`, so a rank that hangs surfaces as an error on the others instead of a hang; a
rank that dies closes its connections and the others fail at once.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=300)  # rendezvous and each collective (a first CUDA call compiles kernels)
HOST = "127.0.0.1"  # one host: every rank is a process of this machine


def master_store(size: int) -> dist.TCPStore:
    """Rank 0's store on a free port of this host (`store.port` tells the workers)."""
    return dist.TCPStore(HOST, 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def worker_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, size, is_master=False, timeout=TIMEOUT)


class Group:
    """This rank's member of the group; `all_reduce` sums a tensor over the ranks in place."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size = rank, size
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self._pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            options._timeout = TIMEOUT
            self._pg = dist.ProcessGroupGloo(store, rank, size, options)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the ranks in place: every rank ends with the same bits (on CUDA the
        wait orders the current stream after the reduction; the host does not block)."""
        self._pg.allreduce([tensor]).wait()
