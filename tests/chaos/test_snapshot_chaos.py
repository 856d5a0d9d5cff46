"""Chaos with snapshot/restore (EngineCore, tiny checkpoint, fp32, CPU): 72 requests per mode.

AsyncEngine has no snapshot command, so these runs step two `EngineCore`s by hand: A serves
a seeded schedule under a small KV pool (preemption, aborts, ID reuse), and between steps
(a legal point: `snapshot` commits the tickets in flight first) a request is snapshotted,
through bytes, and then

- "clone": runs on in A while its snapshot is restored in B, where it runs too;
- "move": is aborted in A and restored in B;
- "park": is aborted in A and restored in A at a later step, when there is room and, if
  another request took its ID meanwhile ("squatter"), once that one ended (until then the
  restore must be refused and change nothing).

B has A's configuration and pool, so restored requests are preempted there too. Every
stream must equal its solo run: for a restored request, the tokens committed at the
snapshot plus what it emits afterwards; the aborted original a prefix that contains them.
Both engines end at rest with every page, token slot and request cell back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import RequestSnapshot, SnapshotError
from specloop.errors import InvalidRequestError
from specloop.scheduling.request import RequestOutput
from tests.chaos.oracle import EngineWatch, Outcome, SoloRuns, assert_clean, check_outcome, params_of
from tests.chaos.runs import TINY_GREEDY_MAX_TOKENS, TINY_SAMPLED_MAX_TOKENS, TinyRun, tiny_run
from tests.chaos.schedule import Spec, make_schedule
from tests.engine_runs import MODES

REQUESTS = 72  # per mode: 432 in all
FATES = {"finish": 0.45, "abort": 0.15, "clone": 0.13, "move": 0.13, "park": 0.14}
STEPS_PER_SECOND = 100  # a schedule's delays in seconds become steps
MAX_STEPS = 20_000


@dataclasses.dataclass
class _Live:
    """One incarnation of a scheduled request in one engine, and what its client saw."""

    outcome: Outcome
    engine: str  # "A" or "B"
    snapshot_tokens: list[int] | None = None  # tokens committed at its snapshot, if one was taken
    fired: bool = False  # its fate fired (restored incarnations and squatters have none)


class _Driver:
    """Steps engines A and B through one schedule, firing each request's fate between steps."""

    def __init__(self, run: TinyRun, a: EngineCore, b: EngineCore, specs: list[Spec], where: str) -> None:
        self.run, self.specs, self.where = run, specs, where
        self.engines = {"A": a, "B": b}
        self.holders: dict[tuple[str, str], _Live] = {}  # (engine, request ID) -> its live incarnation
        self.lives: list[_Live] = []
        self.ended: dict[int, int] = {}  # spec index -> the step its last incarnation ended
        self.open: dict[int, int] = {}  # spec index -> incarnations still running
        self.parked: list[tuple[Spec, RequestSnapshot, _Live | None]] = []  # (spec, snapshot, squatter)
        self.counts = dict.fromkeys(
            ("snapshots", "restores A", "restores B", "refused", "refused in use", "squatters", "owed"), 0)
        self.restored: list[Any] = []  # the Request objects restores installed
        self.step = 0

    def drive(self) -> None:
        pending = list(self.specs)
        while pending or self.parked or any(e.has_unfinished() for e in self.engines.values()):
            pending = [s for s in pending if not self._arrive(s)]
            for live in list(self.holders.values()):
                self._maybe_fire(live)
            self._retry_parked()
            for name, engine in self.engines.items():
                if engine.has_unfinished():
                    self._route(name, engine.step())
            self.step += 1
            assert self.step < MAX_STEPS, f"{self.where}: no progress after {MAX_STEPS} steps"

    # ---- arrivals and outputs ----------------------------------------------------------
    def _arrive(self, spec: Spec) -> bool:
        if spec.previous is None:
            due = round(spec.delay * STEPS_PER_SECOND)
        elif spec.previous in self.ended:
            due = self.ended[spec.previous] + round(spec.delay * 1000)
        else:
            return False  # the ID's previous holder still runs
        if self.step < due:
            return False
        a = self.engines["A"]
        a.add_request(spec.request_id, self.run.prompts[spec.prompt], params_of(spec))
        self._hold("A", Outcome(spec, added=True))
        return True

    def _hold(self, engine: str, outcome: Outcome, snapshot_tokens: list[int] | None = None,
              fired: bool = False) -> _Live:
        live = _Live(outcome, engine, snapshot_tokens, fired)
        key = (engine, outcome.spec.request_id)
        assert key not in self.holders, f"{self.where}: {key} is held twice (the engine accepted a live ID)"
        self.holders[key] = live
        self.lives.append(live)
        self.open[outcome.spec.index] = self.open.get(outcome.spec.index, 0) + 1
        return live

    def _route(self, engine: str, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            live = self.holders.get((engine, out.request_id))
            assert live is not None, f"{self.where}: engine {engine} emitted for {out.request_id!r}: {out}"
            assert out.error is None, f"{self.where}: {out.error}"
            live.outcome.tokens += out.token_ids
            live.outcome.outputs += 1
            if out.finished:
                live.outcome.reason, live.outcome.completion_tokens = out.finish_reason, out.usage.completion_tokens
                self._release(engine, live)

    def _release(self, engine: str, live: _Live) -> None:
        del self.holders[(engine, live.outcome.spec.request_id)]
        index = live.outcome.spec.index
        self.open[index] -= 1
        if not self.open[index] and not any(p[0].index == index for p in self.parked):
            self.ended[index] = self.step

    # ---- fates ---------------------------------------------------------------------------
    def _maybe_fire(self, live: _Live) -> None:
        spec = live.outcome.spec
        if live.fired or spec.fate == "finish" or live.outcome.outputs < spec.after:
            return
        live.fired = True
        if spec.fate == "abort":
            self._abort(live)
            return
        a = self.engines["A"]
        try:
            snap = a.snapshot(spec.request_id)
        except (SnapshotError, InvalidRequestError):  # it finished (while a snapshot committed tickets)
            return
        snap = RequestSnapshot.from_bytes(snap.to_bytes())
        self.counts["snapshots"] += 1
        live.snapshot_tokens = list(snap.data["request"]["output_ids"])
        if spec.fate == "clone":
            self._restore("B", spec, snap)
            return
        if spec.fate == "park":
            self.parked.append((spec, snap, None))  # before the abort: the spec stays open
        self._abort(live)
        if spec.fate == "move":
            self._restore("B", spec, snap)
        elif spec.index % 2:  # a squatter takes the ID of the parked request: same request, same output
            self.counts["squatters"] += 1
            a.add_request(spec.request_id, self.run.prompts[spec.prompt], params_of(spec))
            self.parked[-1] = (spec, snap, self._hold("A", Outcome(spec, added=True), fired=True))

    def _abort(self, live: _Live) -> None:
        spec, a = live.outcome.spec, self.engines["A"]
        live.outcome.aborted = True
        out = a.abort(spec.request_id)
        if out is not None:
            assert out.finished, f"{self.where}: {spec}: abort gave {out}"
            self._route("A", [out])
            return
        # It finished while a snapshot committed the tickets in flight: its final output is
        # still owed (the next step), so its ID is not free yet.
        self.counts["owed"] += 1
        with pytest.raises(InvalidRequestError, match="in use"):
            a.add_request(spec.request_id, self.run.prompts[spec.prompt], params_of(spec))

    def _restore(self, engine: str, spec: Spec, snap: RequestSnapshot) -> bool:
        """Restore `snap` into `engine`; False (and nothing changed) when it is refused now."""
        core = self.engines[engine]
        before = _bookkeeping(core)
        try:
            core.restore(snap)
        except SnapshotError:
            assert _bookkeeping(core) == before, f"{self.where}: a refused restore changed the engine"
            self.counts["refused"] += 1
            return False
        self.counts[f"restores {engine}"] += 1
        self.restored.append(core.requests[spec.request_id])
        tokens = list(snap.data["request"]["output_ids"])
        self._hold(engine, Outcome(spec, tokens=list(tokens), added=True), snapshot_tokens=tokens, fired=True)
        return True

    def _retry_parked(self) -> None:
        for item in list(self.parked):
            spec, snap, squatter = item
            squatting = squatter is not None and ("A", spec.request_id) in self.holders
            if self._restore("A", spec, snap):  # over a live squatter `_hold` fails
                self.parked.remove(item)
            else:
                self.counts["refused in use"] += squatting


def _bookkeeping(core: EngineCore) -> tuple:
    s = core.scheduler
    return (sorted(core.requests), core.kv.num_free_pages, core.kv.num_reserved_pages, s.token_slots.num_free,
            s.cells.num_free, len(s.waiting), len(s.running))


def _check(driver: _Driver, solo: SoloRuns, seed: int) -> None:
    where = driver.where
    for live in driver.lives:
        spec = live.outcome.spec
        want = solo.expected(driver.run.prompts[spec.prompt], spec)
        check_outcome(live.outcome, want, f"{where}; engine {live.engine}; {spec.describe(seed)}")
        taken = live.snapshot_tokens
        if taken:  # the snapshot's committed tokens were emitted before (or with) the abort
            assert live.outcome.tokens[: len(taken)] == taken, f"{where}: {spec}: snapshot {taken}"


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_snapshot_restore_chaos(tiny_ckpt, solo_runs, mode):
    run = tiny_run(mode, turn=1)
    seed = run.seed + 50  # another schedule over the same prompts and options as the AsyncEngine run
    specs = make_schedule(seed, REQUESTS, len(run.prompts), FATES, greedy_max_tokens=TINY_GREEDY_MAX_TOKENS,
                          sampled_max_tokens=TINY_SAMPLED_MAX_TOKENS, sampled=0.35, reuse=0.2, spread=0.6)
    solo = solo_runs(str(tiny_ckpt), run.options, max(TINY_GREEDY_MAX_TOKENS))
    for spec in specs:
        solo.expected(run.prompts[spec.prompt], spec)  # the solo runs first, into the shared cache
    a, b = (EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), **run.options)) for _ in range(2))
    watch_a, watch_b = EngineWatch(a), EngineWatch(b)
    where = f"{run.where()}, schedule seed {seed}"
    driver = _Driver(run, a, b, specs, where)
    driver.drive()
    assert_clean(a, where + ", engine A")
    assert_clean(b, where + ", engine B")
    _check(driver, solo, seed)
    counts = driver.counts
    assert counts["snapshots"] >= 15 and counts["restores A"] >= 4 and counts["restores B"] >= 8, f"{where}: {counts}"
    assert counts["squatters"] >= 1 and counts["refused in use"] >= 1, f"{where}: {counts}"
    assert len(watch_a.victims) >= 3, f"{where}: {len(watch_a.victims)} preemptions in A"
    victims = {id(req) for req in watch_a.preempted + watch_b.preempted}
    preempted = sum(id(req) in victims for req in driver.restored)
    assert preempted >= 1, f"{where}: no restored request was preempted afterwards"
