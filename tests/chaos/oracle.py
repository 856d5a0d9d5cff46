"""What a chaos run is checked against: solo runs, and the engine's bookkeeping at rest.

Solo runs: each request alone in an engine of the same configuration (mode included) whose
KV pool never runs short, through `EngineCore` directly (fast). Greedy tokens do not depend
on `max_tokens` (a shorter request's output is a prefix of a longer one's), so a greedy
request is run once at the longest `max_tokens` and cut; seeded sampling under speculation
does depend on it (a round near the end drafts fewer candidates, and the keyed draws then
fall on other candidates), so sampled requests are cached by their exact parameters. A
greedy run that ignored eos and never met it stands for one that would stop at eos too.

A survivor must emit exactly its solo output; an aborted, left or disconnected request a
prefix of it (strictly shorter when the engine said "abort"). That also catches a token of
a stale incarnation: one delivered after an abort, a preemption or an ID reuse would not
match.

At rest (no request, no ticket in flight), every KV page, token slot and request cell is
back in its pool exactly once, nothing waits to be released, and the published gauges read
zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from specloop.engine.async_engine import AsyncEngine
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.scheduling.token_slots import SlotState
from tests.chaos.schedule import TEMPERATURE, TOP_P, Spec

ROOMY_PAGES = 4096  # KV pages of the solo engines: never short
FINAL = ("length", "stop")  # finish reasons of a request that ran to its end


def params_of(spec: Spec) -> SamplingParams:
    if spec.sampled:
        return SamplingParams(max_tokens=spec.max_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=spec.seed,
                              ignore_eos=spec.ignore_eos)
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=spec.ignore_eos)


class SoloRuns:
    """The reference: each request alone in an engine with `options` and a roomy KV pool."""

    def __init__(self, model: str, options: dict[str, Any], longest_greedy: int) -> None:
        self.engine = EngineCore(EngineConfig.from_kwargs(model, **{**options, "num_kv_pages": ROOMY_PAGES}))
        self.longest_greedy = longest_greedy
        self._cache: dict[tuple, tuple[list[int], str]] = {}
        self._count = 0

    def expected(self, prompt: str | list[int], spec: Spec) -> tuple[list[int], str]:
        """(tokens, finish reason) of `spec`'s request with `prompt`, run alone."""
        params = params_of(spec)
        if spec.sampled:
            return self._run(prompt, params)
        longest = dataclasses.replace(params, max_tokens=self.longest_greedy, ignore_eos=True)
        tokens, reason = self._run(prompt, longest)
        if not params.ignore_eos and self.engine.stop_ids & set(tokens):  # it would stop there
            tokens, reason = self._run(prompt, dataclasses.replace(longest, ignore_eos=False))
        if len(tokens) > spec.max_tokens:
            return tokens[: spec.max_tokens], "length"
        return tokens, reason  # it ended (stop) at or before this request's max_tokens

    def _run(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], str]:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), params)
        if key not in self._cache:
            self._count += 1
            rid = f"solo{self._count}"
            self.engine.add_request(rid, prompt, params)
            outs = [o for o in self.engine.drain() if o.request_id == rid]
            assert outs and outs[-1].finished and outs[-1].error is None, outs[-1:]
            self._cache[key] = ([t for o in outs for t in o.token_ids], outs[-1].finish_reason)
        return self._cache[key]


@dataclasses.dataclass
class Outcome:
    """What one client saw of one request."""

    spec: Spec
    tokens: list[int] = dataclasses.field(default_factory=list)
    outputs: int = 0  # outputs (or stream chunks) read
    reason: str | None = None  # the final output's finish reason; None: the client never saw it
    aborted: bool = False  # the client aborted, left or disconnected before seeing the end
    added: bool = False  # the engine accepted the request
    completion_tokens: int | None = None  # the final output's usage


def check_outcome(got: Outcome, want: tuple[list[int], str], where: str) -> None:
    tokens, reason = want
    assert got.tokens == tokens[: len(got.tokens)], \
        f"{where}: emitted {got.tokens}, not a prefix of the solo run's {tokens}"
    if got.reason in FINAL:
        assert (got.tokens, got.reason) == (tokens, reason), \
            f"{where}: ended {got.reason!r} with {got.tokens}, the solo run {reason!r} with {tokens}"
    elif got.reason == "abort":
        assert got.aborted, f"{where}: aborted though the client never asked"
        assert len(got.tokens) < len(tokens), f"{where}: 'abort' after all {len(tokens)} tokens"
    else:
        assert got.reason is None and got.aborted, f"{where}: ended {got.reason!r}"
    if got.completion_tokens is not None:
        assert got.completion_tokens == len(got.tokens), f"{where}: usage says {got.completion_tokens} tokens"
    if not got.aborted and got.added:
        assert got.reason in FINAL, f"{where}: a request nobody aborted ended {got.reason!r}"


def assert_clean(core: EngineCore, where: str) -> None:
    """No request, ticket, page, token slot or request cell left anywhere (the core at rest).
    With prefix caching the cache's idle blocks stay: each of their pages must be held by
    the cache alone, and the cache's invariants hold; they are then dropped (`clear`), and
    the pool must be whole."""
    sched, kv = core.scheduler, core.kv
    cache = sched.prefix_cache
    if cache is not None:
        cache.check()
        held = [p for p in range(kv.num_pages) if kv.allocator.refcount(p)]
        assert all(kv.allocator.refcount(p) == 1 for p in held) \
            and len(held) == cache.num_cached_blocks * kv.num_planes, f"{where}: pages held beside the cache's"
        cache.clear()
        assert cache.num_cached_blocks == 0, f"{where}: cached blocks in use at rest"
    assert not core.requests and not core._detok and not core._inflight, \
        f"{where}: left requests {list(core.requests)}, {len(core._inflight)} tickets in flight"
    assert not sched.waiting and not sched.running, \
        f"{where}: {len(sched.waiting)} waiting, {len(sched.running)} running"
    assert sched._returning == 0 and not sched._deferred and not sched._swapping, \
        f"{where}: {sched._returning} pages still returning, {len(sched._deferred)} deferred releases"
    assert not core._pending, f"{where}: outputs still owed: {core._pending}"
    assert not kv.requests() and kv.num_reserved_pages == 0, f"{where}: KV still held by {kv.requests()}"
    assert sorted(kv.allocator.free_list()) == list(range(kv.num_pages)), f"{where}: leaked or doubled KV pages"
    pool = sched.token_slots
    assert sorted(pool._free) == list(range(pool.size)), f"{where}: leaked or doubled token slots"
    assert all(pool.state(s) is SlotState.EMPTY for s in range(pool.size)), f"{where}: token slots not empty"
    assert sorted(sched.cells._free) == list(range(sched.cells.size)), f"{where}: leaked or doubled request cells"
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.kv_usage, stats.kv_bytes_used) == (0, 0, 0.0, 0), f"{where}: {stats}"


async def wait_idle(engine: AsyncEngine, where: str, timeout: float = 30.0) -> None:
    """Until the engine thread has nothing left (no request, no ticket, no command) and has
    published its stats; the thread then blocks on its command queue, so the core is at rest."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        assert engine.error is None, f"{where}: the engine died: {engine.error!r}"
        assert time.monotonic() < deadline, f"{where}: the engine is still busy after {timeout} s"
        idle = not engine.core.has_unfinished() and engine._commands.empty()
        quiet = quiet + 1 if idle else 0
        await asyncio.sleep(0.02)


class EngineWatch:
    """Records, from the engine thread, each preemption's victim and each request an abort
    ended (list appends are atomic), so a run can assert that its chaos reached the engine."""

    def __init__(self, core: EngineCore) -> None:
        self.preempted: list[Any] = []  # the victims' Request objects, in order
        self.aborted: list[str] = []
        preempt, abort = core.scheduler.preempt, core.abort

        def watched_preempt(req: Any) -> None:
            self.preempted.append(req)
            preempt(req)

        def watched_abort(request_id: str) -> Any:
            out = abort(request_id)
            if out is not None:
                self.aborted.append(request_id)
            return out

        core.scheduler.preempt = watched_preempt  # type: ignore[method-assign]
        core.abort = watched_abort  # type: ignore[method-assign]

    @property
    def victims(self) -> list[str]:
        return [req.request_id for req in self.preempted]
