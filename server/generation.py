"""One HTTP request's engine work: its jobs (one engine request per choice) as one stream.

`Generation.start()` submits every job and waits until the engine accepted each one (not
for its first output), so a refusal (invalid prompt, full queue) raises before any byte of
the response is sent and becomes a proper HTTP status, while an accepted request's response
can start at once, even while it waits in the queue. After that the jobs' outputs are
merged, in arrival order, into one async iterator of `(choice index, RequestOutput)`.

Lifetimes: every engine stream is consumed by a pump task; `close()` cancels the pumps and
aborts every accepted request that has not finished, which frees its KV. `close()` does
not await, so it is safe inside a cancelled scope (a client that left).

Metrics: the jobs are timed (from the HTTP request's arrival) only once the engine accepted
all of them. A refused request is answered with an error status and counted there, never
as finished with "abort" nor in the latency histograms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from server.metrics import RequestTimer, ServerMetrics
from server.params import Job
from specloop.engine.async_engine import RequestStream
from specloop.engine.serving import ServingEngine
from specloop.scheduling.request import RequestOutput, Usage

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response started."""


class Generation:
    def __init__(self, engine: ServingEngine, jobs: list[Job], request_id: str, metrics: ServerMetrics,
                 arrival: float | None = None) -> None:
        """`arrival`: when the HTTP request arrived (perf_counter), the start of its latencies."""
        self.jobs = jobs
        self._engine = engine
        self._request_id = request_id
        self._metrics = metrics
        self._arrival = time.perf_counter() if arrival is None else arrival
        self._streams: dict[int, RequestStream] = {}  # accepted jobs by choice index
        self._timers: dict[int, RequestTimer] = {}  # filled once every job was accepted
        self._usage: dict[int, Usage] = {}
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = 0

    async def start(self) -> None:
        """Submit every job and wait until each is accepted; raise the engine's refusal, if any."""

        async def add(job: Job) -> None:
            stream = await self._engine.add(job.prompt, job.params, request_id=f"{self._request_id}-{job.index}")
            self._streams[job.index] = stream

        results = await asyncio.gather(*(add(j) for j in self.jobs), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self.close()  # aborts the ones that were accepted (untimed: the request was refused)
            raise failure
        self._timers = {job.index: self._metrics.track(self._arrival) for job in self.jobs}
        for job in self.jobs:
            self._open += 1
            self._pumps.append(asyncio.create_task(self._pump(job.index, self._streams[job.index])))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._open:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):  # this choice failed; close() aborts the others
                self._timers[index].close("error")
                raise item
            if item.finished:
                self._open -= 1
            yield index, self._observe(index, item)

    async def collect(self) -> list[tuple[int, RequestOutput]]:
        try:
            return [item async for item in self]
        finally:
            self.close()

    @property
    def usage(self) -> Usage:
        """Prompt and completion tokens over every choice (as last reported)."""
        return Usage(sum(u.prompt_tokens for u in self._usage.values()),
                     sum(u.completion_tokens for u in self._usage.values()))

    def close(self) -> None:
        """Abort whatever is still running."""
        for task in self._pumps:
            task.cancel()
        for stream in self._streams.values():
            stream.abort()
        self._close_timers()

    def _observe(self, index: int, out: RequestOutput) -> RequestOutput:
        self._timers[index].observe(out)
        self._usage[index] = out.usage
        return out

    def _close_timers(self) -> None:
        for timer in self._timers.values():
            timer.close()

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # the engine died: hand the error to the reader
            self._queue.put_nowait((index, exc))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
