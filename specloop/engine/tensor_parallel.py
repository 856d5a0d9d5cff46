"""Rank 0's side of tensor parallelism: the worker processes and the runner that feeds them.

One engine process drives N ranks. Rank 0 is the engine's own runner (in this process);
ranks 1..N-1 are worker processes (`tensor_parallel_worker.main`), each with its shard of
the model (`specloop.parallel.shard`), its heads of the KV pages and a runner wired by the
same composition root from the same configuration, so every rank holds the same page
pool, token slots and request cells. Each plan goes to every worker (pickled once, over a
pipe) before rank 0 runs it; all ranks then run the same forward call in step, joined by
the all-reduces after o_proj and down_proj. Hidden states, logits, samples and every
device-side state are therefore the same on every rank; rank 0's results are the ones
committed and the workers' are dropped.

Failure: a worker that raises sends its traceback and exits; rank 0's next collective then
fails (the connection closes) or times out (`specloop.parallel.group.TIMEOUT`), and the
forward call raises a `SpecloopError` naming the rank, which ends the engine like any
failed forward call. Shutdown: `close()` (also run when the runner is collected and at
interpreter exit) tells the workers to stop, joins them and terminates any that linger.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from specloop.config import ModelConfig
from specloop.engine import tensor_parallel_worker
from specloop.engine.config import EngineConfig
from specloop.errors import ConfigError, SnapshotError, SpecloopError
from specloop.parallel.group import Group, master_store
from specloop.plan import Plan
from specloop.runtime.runner import Runner, TicketOutput

# Workers fork from a server process that imported torch and the worker once, and never ran
# an op: no CUDA context or OpenMP pool to inherit, and no interpreter start per engine. (It
# keeps the environment of its start: variables set later in this process do not reach it.)
START_METHOD = "forkserver"
JOIN_SECONDS = 10.0  # a stopping worker's grace before it is terminated
FAILURE_GRACE = 1.0  # after a failed forward call: how long a worker may take to be seen exiting
START_SECONDS = 300.0  # each stage of a worker's start-up: import; shard and build (a first CUDA context included)
GUARD_HINT = (" (a script that starts a tensor-parallel engine needs an `if __name__ == '__main__':` guard: "
              "workers import the main module)")
POLL_SECONDS = 0.05  # how often a waiting rank 0 checks that the worker it waits for is alive


@dataclasses.dataclass
class WorkerSetup:
    """What a worker needs to wire the same engine parts as rank 0 (`build.build_rank`)."""

    config: EngineConfig  # with a fixed KV budget, so every rank sizes the same pool
    state: dict[str, torch.Tensor]  # the full model's weights on the CPU (shared memory there)
    model_config: ModelConfig
    max_model_len: int
    threshold: float
    verifier: Any  # rank 0's `Verifier`, or None: every rank must accept the same candidates
    build: Callable[..., Any]  # `build.build_rank`, passed in so this module does not import the root


class Workers:
    """Ranks 1..N-1 as processes of this machine, and rank 0's member of their group."""

    def __init__(self, size: int, device: torch.device) -> None:
        """Start the workers and join the group with them (blocks until every rank joined)."""
        self.size = size
        if device.type == "cuda":
            base = device.index if device.index is not None else torch.cuda.current_device()
            if base + size > torch.cuda.device_count():
                raise ConfigError(f"tensor_parallel_size {size} from cuda:{base} needs {base + size} GPUs, "
                                  f"this machine has {torch.cuda.device_count()}")
            devices = [f"cuda:{base + r}" for r in range(size)]
        else:
            devices = ["cpu"] * size
        store = master_store(size)
        ctx = mp.get_context(START_METHOD)
        ctx.set_forkserver_preload([tensor_parallel_worker.__name__])
        self.conns: list[Connection] = []
        self.procs: list[mp.Process] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=tensor_parallel_worker.main, name=f"specloop-tp{rank}", daemon=True,
                               args=(rank, size, store.port, devices[rank], theirs, torch.get_num_threads()))
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._stop = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            # (one that died never joins the group: the rendezvous would wait for it until the timeout)
            self._wait_for(tensor_parallel_worker.STARTED, "start", GUARD_HINT)
            self.group = self._join_group(store, size, device)
        except BaseException:
            self.close()
            raise

    def _join_group(self, store: Any, size: int, device: torch.device) -> Group:
        """Rank 0's member of the group, formed on a thread while this one watches the workers:
        a worker that dies or fails its own join (it sends why, then exits) ends the wait at
        once, with its error, instead of a rendezvous timeout minutes later."""
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = Group(store, 0, size, device)
            except BaseException as exc:  # (raised below, on the caller's thread)
                joined["error"] = exc

        thread = threading.Thread(target=join, name="specloop-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_SECONDS)
            self.check()
        if "error" in joined:
            raise SpecloopError(f"the tensor-parallel ranks could not form their group: {joined['error']}") \
                from joined["error"]
        return joined["group"]

    def setup(self, setup: WorkerSetup) -> None:
        for conn in self.conns:
            conn.send(setup)

    def wait_ready(self) -> None:
        """Block until every worker built its parts; raise with its error if one failed."""
        self._wait_for(tensor_parallel_worker.READY, "build its parts", "")

    def _wait_for(self, expected: str, stage: str, hint: str) -> None:
        """Wait for `expected` from every worker, watching that each is still alive; `hint`
        follows the error of a worker that died without a word."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            deadline = time.monotonic() + START_SECONDS
            while not conn.poll(POLL_SECONDS) and proc.is_alive():
                if time.monotonic() > deadline:
                    raise SpecloopError(f"tensor-parallel rank {rank} did not {stage} within {START_SECONDS:.0f} s")
            message = self._receive(conn) if conn.poll() else None
            if message == expected:
                continue
            if message is not None:
                raise SpecloopError(f"tensor-parallel rank {rank} failed to {stage}: {message}")
            proc.join(FAILURE_GRACE)
            raise SpecloopError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} before it could "
                                f"{stage}{hint}")

    def send(self, plan: Plan) -> None:
        self.check()
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def check(self, grace: float = 0.0) -> None:
        """Raise if a worker has exited (waiting up to `grace` seconds each for one that is
        exiting), with its error when it sent one."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if grace:
                proc.join(grace)
            if not proc.is_alive():
                error = (self._receive(conn) if conn.poll() else None) or "no error message"
                raise SpecloopError(f"tensor-parallel rank {rank} exited with code {proc.exitcode}: {error}")

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._stop()

    def kill(self) -> None:
        """Terminate every worker now (they may be blocked in a collective rank 0 left), then close."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        self._stop()

    @staticmethod
    def _receive(conn: Connection) -> Any:
        """The worker's next message, None when its end of the pipe is closed."""
        try:
            return conn.recv()
        except (EOFError, OSError):
            return None


def _stop(procs: list[mp.Process], conns: list[Connection]) -> None:
    """Ask each worker to stop, wait, then terminate those that did not."""
    stop = pickle.dumps(None)
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except OSError:
            pass  # that worker is gone already
    for proc in procs:
        proc.join(JOIN_SECONDS)
        if proc.is_alive():
            proc.terminate()
            proc.join(JOIN_SECONDS)
    for conn in conns:
        conn.close()


class TensorParallelRunner:
    """Rank 0's runner: each plan goes to the workers first, then runs on rank 0's shard."""

    def __init__(self, runner: Runner, workers: Workers) -> None:
        self.runner = runner
        self.workers = workers

    def execute(self, plan: Plan) -> TicketOutput:
        self.workers.send(plan)
        try:
            return self.runner.execute(plan)
        except Exception:
            try:
                self.workers.check(grace=FAILURE_GRACE)  # a worker that died is the cause: say which
            finally:  # the forward call failed: the engine ends, and workers still in its collectives never return
                self.workers.kill()
            raise

    def close(self) -> None:
        self.workers.close()


class ShardedPagesPart:
    """The snapshot part of KV pages split by head across ranks: rank 0 holds only its heads,
    so a running request's snapshot (and its restore) is refused rather than half taken."""

    key = "kv"

    def capture(self, req: Any) -> None:
        raise SnapshotError(f"request {req.request_id!r} is running and its KV pages are split over the "
                            f"tensor-parallel ranks: snapshots of running requests need tensor_parallel_size 1")

    def check(self, data: dict[str, Any]) -> None:
        if data.get(self.key) is not None:
            raise SnapshotError("the snapshot holds KV pages and this engine splits its pages over tensor-parallel "
                                "ranks: restore it into an engine with tensor_parallel_size 1")

    def restore(self, req: Any, data: dict[str, Any]) -> None:
        """Nothing to write: `check` refused every snapshot with pages."""
