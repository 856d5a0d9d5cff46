"""The server process's end of one replica: its process, its two pipes, its requests' streams, its load.

Two threads per replica keep the event loop from ever blocking on a pipe: a sender
writes the queued commands (a long prompt can fill a pipe while the replica is inside a
step), and a reader decodes events and hands each output to its stream's event loop
with `call_soon_threadsafe`, as `AsyncEngine`'s engine thread does.

When the replica dies (it reports `Died`, or its pipe closes because the process
exited or was killed), only its own requests end: each open stream gets the error,
each add still waiting for its answer raises `EngineDeadError`, and the router stops
choosing it (`load.alive` turns false). The others serve on. A replica whose pipe closed
while its process lives on (the server can no longer hear it, or no longer reach it) is
killed, and every replica's process is reaped once its pipe closed: none lives on unseen,
holding its device, and none stays a zombie.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable

from specloop.engine.async_engine import RequestStream
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineStats
from specloop.engine.data_parallel import wire
from specloop.engine.data_parallel.router import Load
from specloop.engine.data_parallel.worker import serve_replica
from specloop.errors import EngineDeadError, SpecloopError
from specloop.sampling_params import SamplingParams
from specloop.scheduling.request import RequestOutput

log = logging.getLogger(__name__)
JOIN_S = 5.0  # after its pipe closed: how long the replica's exit status is waited for (then it is killed)
CUT = "its command pipe closed while the process still ran; it was killed"


@dataclasses.dataclass
class _Owned:
    """One request this replica serves: where its outputs go, and its work not yet done."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tokens_left: int


class ReplicaHandle:
    def __init__(self, index: int, config: EngineConfig, cpu_threads: int, lock: threading.Lock,
                 on_death: Callable[["ReplicaHandle"], None]) -> None:
        """Start replica `index` with `config` (its device already chosen; `cpu_threads`: its
        share of the cores when on the CPU). `lock` is the
        engine's routing lock, which guards `load` and the streams of every replica;
        `on_death` is told, on the reader thread, once this replica died."""
        self.index = index
        self.device = config.device
        self.load = Load()
        self.ready: wire.Ready | None = None
        self.stats: EngineStats | None = None  # the last the replica published
        self.error: BaseException | None = None  # why it died
        self.stopping = False  # a Stop was sent: its exit is no failure
        self._lock = lock
        self._on_death = on_death
        self._streams: dict[str, _Owned] = {}
        self._pending: dict[str, concurrent.futures.Future] = {}  # adds waiting for Accepted / Refused
        self._started = threading.Event()  # Ready came, or the replica died
        self._ended = threading.Event()  # the reader saw the process exit and ended its requests
        self._cut = False  # the sender killed it: it could no longer take commands
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or thread state
        commands_in, self._commands = context.Pipe(duplex=False)
        self._events, events_out = context.Pipe(duplex=False)
        self.process = context.Process(target=serve_replica, name=f"specloop-replica-{index}", daemon=True,
                                       args=(index, config, cpu_threads, commands_in, events_out))
        self.process.start()
        commands_in.close()  # the replica holds these ends now
        events_out.close()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._send, name=f"specloop-replica-{index}-send", daemon=True).start()
        threading.Thread(target=self._read, name=f"specloop-replica-{index}-read", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.load.alive

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, timeout: float) -> wire.Ready:
        """Block until the replica's engine is built; raise its start-up error if it failed."""
        if not self._started.wait(timeout):
            raise EngineDeadError(f"data-parallel replica {self.index} did not start within {timeout:.0f} s")
        if self.ready is not None:
            return self.ready
        if isinstance(self.error, SpecloopError) and not isinstance(self.error, EngineDeadError):
            raise self.error  # the engine's own start-up error: a bad checkpoint or option
        raise EngineDeadError(f"data-parallel replica {self.index} failed to start: {self.error}")

    # ---- requests (the routing lock held by the caller where it says so) -------------
    def owns(self, request_id: str) -> bool:
        return request_id in self._streams

    def take(self, request_id: str, tokens: int) -> _Owned:
        """Count a request routed here and give it a stream (the routing lock held)."""
        owned = _Owned(asyncio.get_running_loop(), asyncio.Queue(), tokens)
        self._streams[request_id] = owned
        self.load.take(tokens)
        return owned

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  owned: _Owned) -> RequestStream:
        """Send a request taken with `take`; return its stream once the replica accepted it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            message = wire.encoder.encode(wire.Add(request_id, prompt_ids, dataclasses.asdict(params)))
        except BaseException:  # (nothing is pending yet: the request is forgotten, its load released)
            with self._lock:
                self._forget(request_id, owned)
            raise
        with self._lock:
            if not self.alive:
                self._forget(request_id, owned)
                raise EngineDeadError(f"the engine stopped: {self._end}")
            self._pending[request_id] = future
        self._outbox.put(message)
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the add may still be accepted: abort what it queued
            self._abort(request_id, owned)
            raise
        except BaseException:
            with self._lock:
                self._forget(request_id, owned)
            raise
        return RequestStream(request_id, owned.queue, lambda: self._abort(request_id, owned))

    def abort(self, request_id: str) -> None:
        """Abort a request of this replica by ID (its stream gets the final output)."""
        with self._lock:
            owned = self._streams.get(request_id)
        if owned is not None:
            self._abort(request_id, owned)

    def stop(self) -> None:
        """Ask the replica to abort everything, send the final outputs and exit."""
        self.stopping = True
        self._outbox.put(wire.encoder.encode(wire.Stop()))
        self._outbox.put(None)

    def kill(self) -> None:
        """End the process now (start-up failed elsewhere); its requests end as after a stop."""
        self.stopping = True
        self.process.kill()

    def join(self, timeout: float) -> None:
        """Wait until the process exited and its requests ended; kill it when it does not exit in time."""
        if not self._ended.wait(timeout):
            log.warning("data-parallel replica %d did not stop in %.0f s; killing it", self.index, timeout)
            self.process.kill()
            self._ended.wait()

    @property
    def _end(self) -> str:
        """How this replica ended, for its requests' errors."""
        if self.error is None:
            return f"data-parallel replica {self.index} was shut down"
        return f"data-parallel replica {self.index} failed: {self.error}"

    def _abort(self, request_id: str, owned: _Owned) -> bool:
        with self._lock:
            if not self.alive:
                return False
            if self._streams.get(request_id) is owned:  # not yet ended, nor the ID given to a newer request
                self._outbox.put(wire.encoder.encode(wire.Abort(request_id)))
        return True

    def _forget(self, request_id: str, owned: _Owned) -> None:
        """Stop counting a request that ended or was refused (the routing lock held)."""
        if self._streams.get(request_id) is owned:
            del self._streams[request_id]
            self.load.release(owned.tokens_left)

    # ---- the two threads --------------------------------------------------------------
    def _send(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._commands.send_bytes(data)
            except OSError:  # the replica closed its end: gone, or deaf; the reader reports why
                if not self.stopping:  # (a deaf one would never answer: end it, so the reader sees it end)
                    log.error("data-parallel replica %d closed its command pipe; killing it", self.index)
                    self._cut = True
                    self.process.kill()
                break
        self._commands.close()  # after a Stop: the replica reads what was sent, then sees the end

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while error is None:
                event = wire.event_decoder.decode(self._events.recv_bytes())
                if isinstance(event, wire.Died):
                    error = wire.error_of(event.failure)
                else:
                    self._handle(event)
        except (EOFError, OSError):  # the process exited or was killed
            pass
        except Exception as exc:  # an event it cannot read or apply: the replica cannot be trusted any more
            error = exc
            self.process.kill()
        self._events.close()
        code = self._reap()
        if error is None and not self.stopping:
            error = EngineDeadError(CUT if self._cut and code == -signal.SIGKILL else _exit_reason(code))
        self._die(error)
        self._ended.set()

    def _reap(self) -> int | None:
        """Wait for the process to exit now that its event pipe closed; kill it if it still runs after
        JOIN_S (it can report nothing any more), so that it neither lives on unseen nor stays a zombie.
        Returns its exit status before any kill here (None: it still ran)."""
        self.process.join(JOIN_S)
        code = self.process.exitcode
        if code is None:
            log.error("data-parallel replica %d closed its event pipe but still runs; killing it", self.index)
            self.process.kill()
            self.process.join(JOIN_S)
        return code

    def _handle(self, event: wire.Event) -> None:
        if isinstance(event, wire.Ready):
            self.ready, self.stats = event, event.stats
            self._started.set()
            return
        if isinstance(event, wire.Outputs):
            self.stats = event.stats
            self._deliver(event.outputs)
            return
        if isinstance(event, wire.Accepted):
            self.stats = event.stats
        with self._lock:
            future = self._pending.pop(event.request_id, None)
            owned = self._streams.get(event.request_id)
            if isinstance(event, wire.Refused) and owned is not None:  # counted until now, even if its caller left
                self._forget(event.request_id, owned)
        if future is None or not future.set_running_or_notify_cancel():
            return  # its caller gave up (cancelled) and aborted it
        if isinstance(event, wire.Accepted):
            future.set_result(None)
        else:
            future.set_exception(wire.error_of(event.failure))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                owned = self._streams.get(out.request_id)
                if owned is None:
                    continue
                owned.tokens_left -= len(out.token_ids)
                self.load.progress(len(out.token_ids))
                if out.finished:
                    self._forget(out.request_id, owned)
            _put(owned, out)

    def _die(self, error: BaseException | None) -> None:
        """End every request of this replica with `error` (None: it was stopped)."""
        with self._lock:
            self.load.alive = False
            self.error = error
            streams, self._streams = self._streams, {}
            pending, self._pending = self._pending, {}
        for owned in streams.values():
            _put(owned, EngineDeadError(self._end))
        for future in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(f"the engine stopped: {self._end}"))
        self._outbox.put(None)
        self._started.set()
        if error is not None and self.ready is not None:  # a start-up failure is raised by `wait_ready`
            self._on_death(self)


def _put(owned: _Owned, item: RequestOutput | BaseException) -> None:
    try:
        owned.loop.call_soon_threadsafe(owned.queue.put_nowait, item)
    except RuntimeError:  # its event loop closed: nobody reads this stream any more
        pass


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "its pipe closed while the process still ran; it was killed"
    if code < 0:
        return f"its process was killed by signal {signal.Signals(-code).name}"
    return f"its process exited with status {code}"
