"""A tensor-parallel worker (ranks 1..N-1): its shard, its engine parts, and the plan loop.

It tells rank 0 it started, joins the group, receives a `WorkerSetup`, builds its shard of
the model and the same engine parts rank 0 has (`build.build_rank`, passed in the setup),
answers READY, then runs every plan rank 0 sends, in order, until a stop (None) or rank
0's end of the pipe. Its results are dropped: rank 0's are the same. An error is sent to
rank 0 as text and ends the process with status 1, which breaks the group's connections,
so rank 0 fails at its next collective instead of waiting.
"""

from __future__ import annotations

import pickle
import traceback
from multiprocessing.connection import Connection

import torch

from specloop.parallel.group import Group, worker_store
from specloop.parallel.shard import shard_model

STARTED = "started"  # the worker runs: rank 0 may join the group with it
READY = "ready"  # its parts are built: plans may come


def main(rank: int, size: int, port: int, device_name: str, conn: Connection, threads: int) -> None:
    """The worker process: `port` is rank 0's store, `threads` its intra-op thread count."""
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(STARTED)
    try:
        group = Group(worker_store(port, size), rank, size, device)
        setup = conn.recv()
        model = shard_model(setup.state, setup.model_config, rank, size, group.all_reduce, device)
        del setup.state  # (rank 0's weights in shared memory: the shard keeps what it uses)
        parts = setup.build(setup.config, model, device, setup.max_model_len, setup.threshold, setup.verifier,
                            _unused, _unused)
        runner = parts.executor.runner
        conn.send(READY)
        while (plan := pickle.loads(conn.recv_bytes())) is not None:
            runner.execute(plan)
    except EOFError:
        return  # rank 0 is gone
    except BaseException as exc:
        try:
            conn.send(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        except OSError:
            pass  # rank 0 is gone: nobody to tell
        raise SystemExit(1) from exc


def _unused(*args: object) -> bool:
    """The scheduler's swap hooks: a worker never schedules."""
    raise AssertionError("a tensor-parallel worker never schedules")
