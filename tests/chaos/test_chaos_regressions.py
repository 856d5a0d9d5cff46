"""Bugs the chaos runs found, each pinned down by a deterministic test.

1. `EngineCore.snapshot` of a request swapped out by swap preemption captured it as a new
   waiting request (no KV) while its host state said its positions existed, so a restore
   failed while being planned ("generated tokens enter depth 0 one at a time"). The
   snapshot of a swapped-out request is now its swap-out snapshot.
2. A request that finished while `snapshot` committed the tickets in flight owes its final
   output until the next step; meanwhile `abort` finds nothing live (None) and its ID
   looked free, so a new request, or a restored one, under that ID would receive the old
   one's final output (a stale incarnation's tokens, and a "finished" for a request still
   running). The ID now stays in use until that output is out (`EngineCore.id_in_use`).
3. Swap preemption: when the pool emptied, admission swapped in every swapped-out request
   that fit, and restored requests that could not then grow for the next plan were left
   out of it; once the restores had filled the pool exactly, no request could be planned
   and the engine died ("scheduler stalled"). Restored requests now grow like the running
   ones, preempting the latest-arrived request when the pool cannot serve.
"""

from __future__ import annotations

import dataclasses

import pytest

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import SnapshotError
from specloop.errors import InvalidRequestError
from specloop.sampling_params import SamplingParams
from tests.chaos.oracle import assert_clean
from tests.chaos.runs import TINY_GREEDY_MAX_TOKENS, TINY_SAMPLED_MAX_TOKENS, tiny_run
from tests.chaos.schedule import make_schedule
from tests.chaos.test_snapshot_chaos import FATES, REQUESTS, _Driver


def _engine(ckpt, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), device="cpu", dtype="float32", block_size=4,
                                               num_kv_pages=256, max_inflight_tickets=2, **options))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _tokens(outputs, request_id: str) -> list[int]:
    return [t for o in outputs if o.request_id == request_id for t in o.token_ids]


def test_snapshot_of_a_swapped_out_request_resumes_exactly(tiny_ckpt):
    prompt = [5, 6, 7, 8]
    solo = _engine(tiny_ckpt)
    solo.add_request("x", prompt, _greedy(10))
    want = _tokens(solo.drain(), "x")
    engine = _engine(tiny_ckpt, preemption_mode="swap")
    engine.add_request("x", prompt, _greedy(10))
    for _ in range(4):
        engine.step()
    req = engine.requests["x"]
    engine.scheduler.preempt(req)
    for _ in range(10):
        if req.swapped is not None:
            break
        engine.step()
    assert req.swapped is not None, "the request was never swapped out"
    snap = engine.snapshot("x")
    assert snap.data["kv"] is not None, "the snapshot lost the swapped-out request's KV"
    fresh = _engine(tiny_ckpt, preemption_mode="swap")
    fresh.restore(snap)
    outputs = fresh.drain()
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert list(snap.data["request"]["output_ids"]) + _tokens(outputs, "x") == want


def test_an_owed_final_output_keeps_its_request_id_in_use(tiny_ckpt):
    engine = _engine(tiny_ckpt)
    engine.add_request("x", [5, 6, 7], _greedy(12))
    engine.add_request("y", [8, 9], _greedy(2))
    snap_y = engine.snapshot("y")  # waiting: restorable under its ID once that is free
    emitted = []
    for _ in range(20):  # with two tickets in flight a step never commits: each snapshot does
        emitted += engine.step()
        engine.snapshot("x")
        if "y" not in engine.requests:
            break
    assert "y" not in engine.requests, "y never finished while a snapshot committed its ticket"
    assert engine.abort("y") is None  # nothing live to abort: y finished, its final output is owed
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.add_request("y", [8, 9], _greedy(3))
    with pytest.raises(SnapshotError, match="in use"):
        engine.restore(snap_y)
    final = [o for o in engine.step() if o.request_id == "y"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "length"
    assert len(_tokens(emitted, "y") + final[0].token_ids) == 2
    engine.add_request("y", [8, 9], _greedy(3))  # now the ID is free
    rest = engine.drain()
    assert len(_tokens(rest, "y")) == 3


def test_swap_ins_that_fill_the_pool_still_make_progress(tiny_ckpt):
    """The snapshot chaos run (block rounds, swap) whose swap-ins filled a 64-page pool."""
    run = tiny_run("block-d1", turn=1, seed=1502)
    run = dataclasses.replace(run, options={**run.options, "preemption_mode": "swap"})
    specs = make_schedule(1552, REQUESTS, len(run.prompts), FATES, greedy_max_tokens=TINY_GREEDY_MAX_TOKENS,
                          sampled_max_tokens=TINY_SAMPLED_MAX_TOKENS, sampled=0.35, reuse=0.2, spread=0.6)
    a, b = (EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), **run.options)) for _ in range(2))
    sched, filled = a.scheduler, []
    admit = sched._admit

    def watched_admit():
        admitted = admit()
        if len(admitted) >= 2 and not a.kv.num_available_pages and not sched._swapping:
            filled.append(len(admitted))  # restores took the last free page
        return admitted

    sched._admit = watched_admit
    driver = _Driver(run, a, b, specs, "pinned swap-in run")
    driver.drive()  # raised RuntimeError("scheduler stalled") before the fix
    assert filled, "the swap-ins never filled the pool: re-pin this test on a run where they do"
    assert_clean(a, "engine A")
    assert_clean(b, "engine B")
