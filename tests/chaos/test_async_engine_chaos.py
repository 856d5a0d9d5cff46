"""Chaos through AsyncEngine (tiny checkpoint, fp32, CPU): 90 requests per speculation mode.

A KV pool of 32 positions per plane against up to 12 running requests of up to 24
positions makes preemption frequent (each run's policy: `tests.chaos.runs.policy`).
Clients abort through the stream, by ID and on timers, leave `generate()` early (closed,
or dropped for the garbage collector to close), cancel their `add()`, reuse the ID of a
request that just ended, try to add a second request under a live ID, and go quiet
("late"): they stop reading, and abort their old handle only once a new request holds the
ID, which must not touch the new one. Every request is checked against its solo run
(`tests.chaos.oracle`) and, once the engine is at rest, every page, token slot, request
cell and output stream must be back and the published stats read zero. Each run also
asserts that its chaos happened: preemptions (with survivors among the victims), aborts
that reached the engine, ID reuses, refused clashes, late aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from specloop.engine.async_engine import AsyncEngine, RequestStream
from specloop.engine.config import EngineConfig
from specloop.errors import InvalidRequestError
from specloop.scheduling.request import RequestOutput
from tests.chaos.oracle import (FINAL, EngineWatch, Outcome, SoloRuns, assert_clean, check_outcome, params_of,
                                wait_idle)
from tests.chaos.runs import TINY_GREEDY_MAX_TOKENS, TINY_SAMPLED_MAX_TOKENS, TinyRun, tiny_run
from tests.chaos.schedule import Spec, make_schedule
from tests.engine_runs import MODES

REQUESTS = 90  # per mode: 540 in all
FATES = {"finish": 0.47, "abort": 0.12, "abort_id": 0.1, "timer": 0.08, "leave": 0.07, "drop": 0.05,
         "cancel_add": 0.07, "late": 0.04}
RUN_TIMEOUT_S = 60.0


class _Client:
    """Drives one schedule through an AsyncEngine; records what each request emitted."""

    def __init__(self, engine: AsyncEngine, prompts: list[list[int]], seed: int) -> None:
        self.engine = engine
        self.prompts = prompts
        self.seed = seed
        self.specs: dict[int, Spec] = {}
        self.successor: dict[int, int] = {}  # index -> the request that reuses its ID next
        self.ended: dict[int, asyncio.Event] = {}  # its ID may be reused
        self.added: dict[int, asyncio.Event] = {}  # its add was answered (or it never made one)
        self.outcomes: list[Outcome] = []
        self.clashes_refused = 0
        self.late_aborts = 0  # stale handles aborted after their ID was reused

    async def run(self, specs: list[Spec]) -> None:
        self.specs = {s.index: s for s in specs}
        self.successor = {s.previous: s.index for s in specs if s.previous is not None}
        self.ended = {s.index: asyncio.Event() for s in specs}
        self.added = {s.index: asyncio.Event() for s in specs}
        await asyncio.gather(*(self._request(s) for s in specs))

    async def _request(self, spec: Spec) -> None:
        try:
            if spec.previous is not None:
                await self._id_free(spec)
            await asyncio.sleep(spec.delay)
            outcome = Outcome(spec)
            self.outcomes.append(outcome)
            if spec.fate in ("leave", "drop"):
                await self._leave(spec, outcome)
            elif spec.fate == "cancel_add":
                await self._cancel_add(spec, outcome)
            else:
                await self._stream(spec, outcome)
        except Exception as exc:  # name the seed and the request: the schedule replays from it
            raise AssertionError(f"{spec.describe(self.seed)}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.added[spec.index].set()
            self.ended[spec.index].set()

    async def _id_free(self, spec: Spec) -> None:
        """Wait until the ID's previous holder ended. One that went quiet ("late") may still
        run in the engine, and a dropped generator aborts only when the garbage collector
        closes it: after those, wait for the engine to let the ID go too."""
        await self.ended[spec.previous].wait()
        if self.specs[spec.previous].fate in ("late", "drop"):
            # Asked on the engine thread, between steps: a peek from here could fall inside a
            # swap-in, which takes the request out of `core.requests` and puts it back.
            while await self.engine._call(lambda: self.engine.core.id_in_use(spec.request_id)):
                await asyncio.sleep(0.002)

    def _add(self, spec: Spec) -> "asyncio.Future[RequestStream]":
        return asyncio.ensure_future(self.engine.add(self.prompts[spec.prompt], params_of(spec), spec.request_id))

    async def _stream(self, spec: Spec, outcome: Outcome) -> None:
        stream = await self._add(spec)
        outcome.added = True
        self.added[spec.index].set()
        if spec.clash:
            await self._clash(spec, outcome)
        timer = asyncio.ensure_future(self._abort_later(spec, outcome)) if spec.fate == "timer" else None
        try:
            if spec.after == 0 and await self._fire(spec, outcome, stream):
                return
            async for out in stream:
                self._record(outcome, out)
                if not out.finished and outcome.outputs == spec.after and await self._fire(spec, outcome, stream):
                    return
        finally:
            if timer is not None:
                timer.cancel()

    def _record(self, outcome: Outcome, out: RequestOutput) -> None:
        assert out.request_id == outcome.spec.request_id
        outcome.tokens += out.token_ids
        outcome.outputs += 1
        if out.finished:
            outcome.reason, outcome.completion_tokens = out.finish_reason, out.usage.completion_tokens

    async def _fire(self, spec: Spec, outcome: Outcome, stream: RequestStream) -> bool:
        """The request's fate, after `spec.after` outputs (or at once); True: stop reading."""
        if spec.fate == "abort":
            outcome.aborted = True
            stream.abort()  # the stream ends here; the engine's final output is not read
        elif spec.fate == "abort_id":
            outcome.aborted = True
            await self.engine.abort(spec.request_id)  # the stream goes on to its final output
        elif spec.fate == "late":
            await self._late(spec, outcome, stream)
            return True
        return False

    async def _late(self, spec: Spec, outcome: Outcome, stream: RequestStream) -> None:
        """Stop reading and give the ID away; once a new request holds it (or nobody took it),
        abort the old handle: that must not touch the new request."""
        outcome.aborted = True
        self.ended[spec.index].set()
        successor = self.successor.get(spec.index)
        if successor is not None:
            await self.added[successor].wait()
            self.late_aborts += 1
        stream.abort()

    async def _abort_later(self, spec: Spec, outcome: Outcome) -> None:
        await asyncio.sleep(spec.fate_delay)
        if outcome.reason is None:  # the ID is still this request's: its successor waits for it
            outcome.aborted = True
            await self.engine.abort(spec.request_id)

    async def _clash(self, spec: Spec, outcome: Outcome) -> None:
        """A second add under a live ID is refused (or, if the first finished meanwhile, runs)."""
        try:
            second = await self._add(spec)
        except InvalidRequestError:
            self.clashes_refused += 1
            return
        extra = Outcome(spec, added=True)
        self.outcomes.append(extra)
        async for out in second:
            self._record(extra, out)

    async def _leave(self, spec: Spec, outcome: Outcome) -> None:
        """Leave `generate()` after `spec.after` outputs: closed at once ("leave"), or dropped
        for the garbage collector's finalizer to close ("drop"); either aborts the request."""
        gen = self.engine.generate(self.prompts[spec.prompt], params_of(spec), spec.request_id)
        closing = contextlib.aclosing(gen) if spec.fate == "leave" else contextlib.nullcontext(gen)
        async with closing as outputs:
            async for out in outputs:
                outcome.added = True
                self._record(outcome, out)
                if not out.finished and outcome.outputs >= max(spec.after, 1):
                    outcome.aborted = True
                    break
        del gen, outputs, closing  # "drop": the last reference goes, the finalizer closes it

    async def _cancel_add(self, spec: Spec, outcome: Outcome) -> None:
        """Cancel `add()` after `spec.fate_delay` s: the request may or may not have been queued."""
        task = self._add(spec)
        await asyncio.sleep(spec.fate_delay)
        task.cancel()
        outcome.aborted = True
        try:
            stream = await task
        except asyncio.CancelledError:
            return
        outcome.added = True  # the add won the race: abort what it returned
        stream.abort()


def _late_predecessors(specs: list[Spec], count: int) -> list[Spec]:
    """The schedule with the first `count` holders of a reused ID going quiet ("late"), so
    stale handles are aborted after their ID was reused in every run."""
    reused = sorted({s.previous for s in specs if s.previous is not None})[:count]
    return [dataclasses.replace(s, fate="late") if s.index in reused else s for s in specs]


async def _run(run: TinyRun, ckpt: str, solo: SoloRuns, preemptions: int = 3) -> AsyncEngine:
    """The run, its checks and the proofs that its chaos happened (`preemptions`: the fewest
    it must have seen); returns the stopped engine."""
    seed, prompts, where = run.seed, run.prompts, run.where()
    specs = _late_predecessors(make_schedule(
        seed, REQUESTS, len(prompts), FATES, greedy_max_tokens=TINY_GREEDY_MAX_TOKENS,
        sampled_max_tokens=TINY_SAMPLED_MAX_TOKENS, sampled=0.35, reuse=0.2, clash=0.08, spread=0.6), 3)
    want = {s.index: solo.expected(prompts[s.prompt], s) for s in specs}  # before the run: no contention

    engine = AsyncEngine(EngineConfig.from_kwargs(ckpt, **run.options))
    watch = EngineWatch(engine.core)
    client = _Client(engine, prompts, seed)
    try:
        await asyncio.wait_for(client.run(specs), RUN_TIMEOUT_S)
        await wait_idle(engine, where)
        assert not engine._streams, f"{where}: output streams left: {list(engine._streams)}"
        assert_clean(engine.core, where)
        published = engine.stats()  # what a server's /metrics would read
        assert (published.running, published.waiting, published.kv_usage) == (0, 0, 0.0), f"{where}: {published}"
    finally:
        await engine.shutdown()

    for outcome in client.outcomes:
        check_outcome(outcome, want[outcome.spec.index], f"{where}; {outcome.spec.describe(seed)}")
    survivors = {o.spec.request_id for o in client.outcomes if o.reason in FINAL}
    aborted = [o for o in client.outcomes if o.aborted and o.added and o.reason not in FINAL]
    reused = [o for o in client.outcomes if o.spec.previous is not None and o.added]
    assert engine.stats().num_preemptions == len(watch.victims) >= preemptions, \
        f"{where}: {len(watch.victims)} preemptions"
    assert survivors & set(watch.victims) or not preemptions, f"{where}: no preempted request ran to its end"
    assert len(aborted) >= 10, f"{where}: only {len(aborted)} requests were aborted before their end"
    assert len(watch.aborted) >= 10, f"{where}: the engine aborted only {len(watch.aborted)} requests"
    assert len(reused) >= 8, f"{where}: only {len(reused)} requests reused an ID"
    assert client.clashes_refused >= 1, f"{where}: no add under a live ID was refused"
    assert client.late_aborts >= 1, f"{where}: no stale handle was aborted after its ID was reused"
    assert len(client.outcomes) >= REQUESTS
    return engine


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
async def test_async_engine_chaos(tiny_ckpt, solo_runs, mode):
    run = tiny_run(mode, turn=0)
    await _run(run, str(tiny_ckpt), solo_runs(str(tiny_ckpt), run.options, max(TINY_GREEDY_MAX_TOKENS)))
