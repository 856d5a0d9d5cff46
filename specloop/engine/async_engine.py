"""AsyncEngine: the asyncio front of the engine core.

The core runs on its own thread, so a busy GPU (or a slow CPU forward) never stalls the
event loop. Commands (add, abort) cross to that thread through a queue and return their
outcome through futures, so a bad request raises in the caller at once; outputs come back
through `loop.call_soon_threadsafe` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from specloop.engine.config import EngineConfig, ResolvedConfig
from specloop.engine.core import EngineCore, EngineStats
from specloop.scheduling.request import RequestOutput
from specloop.sampling_params import SamplingParams
from specloop.engine.tokenizer_pool import TokenizerPool
from specloop.errors import EngineDeadError, InvalidRequestError, RequestFailedError, SpecloopError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStream:
    """One accepted request's outputs in order; `abort()` (or leaving early) ends it.

    The queue holds outputs, or an exception once the engine (or the replica serving the
    request) died. `on_abort` asks the engine to end the request and says whether it could
    (a dead engine cannot: the stream then still ends with its error)."""

    def __init__(self, request_id: str, queue: asyncio.Queue, on_abort: Callable[[], bool]) -> None:
        self.request_id = request_id
        self._queue = queue
        self._on_abort = on_abort
        self._finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._finished = True
            raise EngineDeadError(f"the engine stopped: {item}") from item
        self._finished = item.finished
        if item.error is not None:  # this request alone failed; the engine serves on
            raise RequestFailedError(item.error)
        return item

    def abort(self) -> None:
        """Abort the request unless it finished; safe to call twice and from a cancelled scope."""
        if not self._finished and self._on_abort():
            self._finished = True


async def encode_prompt(prompt: str | list[int], check_chars: Callable[[int], None],
                        in_tokenizer_pool: Callable[[Callable[[Any], Any]], Awaitable[Any]]) -> list[int]:
    """A prompt's token ids: a text is bounded by its characters first, then encoded off the
    event loop (ids pass through; the engine checks them)."""
    if not isinstance(prompt, str):
        return prompt
    check_chars(len(prompt))
    ids = await in_tokenizer_pool(lambda tok: tok.encode(prompt, add_special_tokens=False))
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return ids


class Generates:
    """`generate` over the engine's `add`: shared by `AsyncEngine` and `DataParallelEngine`."""

    async def add(self, prompt: str | list[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> RequestStream:
        raise NotImplementedError

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's incremental outputs; leaving the iterator early aborts it."""
        stream = await self.add(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()


class AsyncEngine(Generates):
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = config
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        # Set by the engine thread as it stops taking commands; a command queued after that is
        # answered by its caller (`_submit`): the lock orders the two.
        self._closed = False
        self._close_lock = threading.Lock()
        self.error: BaseException | None = None
        self._stats = self.core.stats()
        self.tokenizer_pool = TokenizerPool(self.core.tokenizer)
        self._thread = threading.Thread(target=self._run, name="specloop-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "AsyncEngine":
        return cls(EngineConfig.from_kwargs(model, **options))

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def resolved(self) -> ResolvedConfig:
        """What start-up made of the options left to it (dtype, device, KV pages, ...)."""
        return self.core.resolved

    @property
    def vocab_size(self) -> int:
        return self.core.model.config.vocab_size

    @property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a text prompt certainly exceeds the context (None: no bound)."""
        return self.core.max_prompt_chars

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text too long for the context whatever its tokens."""
        self.core.check_prompt_chars(num_chars, param)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stopping.is_set()

    async def in_tokenizer_pool(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(tokenizer)` on a tokenizer worker thread (never on the event loop or the engine thread)."""
        return await self.tokenizer_pool.run(fn)

    def limits(self) -> tuple[int, int]:
        """(context length, most tokens a request may reserve); fixed at start-up."""
        return self.core.max_model_len, self.core.max_request_tokens

    def stats(self) -> EngineStats:
        """Last published stats (read without touching the engine thread)."""
        return self._stats

    # ---- public API -------------------------------------------------------------------
    async def add(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
    ) -> "RequestStream":
        """Queue a request and return its output stream once the engine accepted it.

        A refusal (invalid request, full queue) raises here, before any output exists, so a
        server can answer with a status code and then start streaming at once."""
        params = params or SamplingParams()
        rid = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._check_alive()
        prompt = await encode_prompt(prompt, self.check_prompt_chars, self.in_tokenizer_pool)

        def add() -> None:
            self.core.add_request(rid, prompt, params)
            self._streams[rid] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:  # the add may still run: abort what it queued
            if self.is_alive:
                self._submit(lambda: self._abort_now(rid, stream))
            raise
        return RequestStream(rid, stream.queue, lambda: self._abort_stream(rid, stream))

    async def abort(self, request_id: str) -> None:
        if self.is_alive:
            await self._call(lambda: self._abort_now(request_id, None))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        if self.is_alive:
            try:
                await self._call(self._abort_all)
            except EngineDeadError:  # it died meanwhile, and every stream got the error
                pass
        self._stopping.set()
        self.tokenizer_pool.shutdown()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- plumbing ---------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._close_lock:
            self._commands.put((fn, future))
            closed = self._closed
        if self.error is not None:  # the engine thread died after the caller's check: answer here
            self._fail_pending(self.error)
        elif closed:  # it stopped (shutdown) after the caller's check
            self._fail_pending(EngineDeadError("the engine is shut down"))
        return future

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _abort_now(self, rid: str, only_stream: _Stream | None) -> None:
        stream = self._streams.get(rid)
        if only_stream is not None and stream is not only_stream:
            return  # the ID now belongs to a newer request
        output = self.core.abort(rid)
        if output is not None:
            self._deliver([output])

    def _abort_stream(self, rid: str, stream: _Stream) -> bool:
        if not self.is_alive:
            return False
        self._submit(lambda: self._abort_now(rid, stream))
        return True

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self._abort_now(rid, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.core.has_unfinished()
                self._run_commands(block=not busy)
                if self.core.has_unfinished():
                    outputs = self.core.step()
                    self._stats = self.core.stats()  # a caller that saw its output sees its effect
                    self._deliver(outputs)
                self._stats = self.core.stats()
            with self._close_lock:  # shut down: commands queued from now on are answered by `_submit`
                self._closed = True
            self._fail_pending(EngineDeadError("the engine is shut down"))
        except BaseException as exc:  # the engine is dead: tell every waiter
            log.exception("engine thread failed")
            self.error = exc
            for stream in self._streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            self._streams.clear()
            self._fail_pending(exc)
        finally:
            try:
                self.core.close()  # tensor-parallel workers stop with the engine thread
            except Exception:
                log.exception("stopping the engine's workers failed")

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():  # skip commands whose caller gave up
                try:
                    result = fn()
                    self._stats = self.core.stats()  # a caller that saw its command done sees its effect
                    future.set_result(result)
                except SpecloopError as exc:
                    future.set_exception(exc)
                except BaseException as exc:
                    future.set_exception(exc)
                    raise
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():  # a cancelled caller's future takes no result
                future.set_exception(EngineDeadError(f"the engine stopped: {exc}"))
