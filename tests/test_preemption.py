"""Admission by need and recompute preemption: a preempted request resumes exactly.

Each run is compared with the same requests through an engine whose KV pool never runs
short (no preemption): the same tokens per request, logprobs within 1e-4 (a resumed
request re-enters its committed tokens as prompt chunks, so sums may round apart), in
every mode (plain, adaptive exit, block rounds, token pipelines), with a seeded sampled
request. Preemption happens two ways: a pool too small for the offered load (vLLM's policy
picks the latest-arrived running request), and forced at fixed steps whatever the pool
(`Scheduler.preempt`, any number of times per request, mid-round and mid-pipeline).
After every run each page, token slot and request cell is back. On the GPU where there is
one (Triton attention, CUDA graphs), on the CPU otherwise.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.scheduling.request import Status
from tests.engine_runs import MODES, Outputs, assert_same, pages_at_rest, step_into

PROMPTS = [list(range(3, 17)), [5, 9, 2], list(range(40, 12, -1)), [7] * 9, list(range(60, 70))]
# Short prompts, long outputs: all admitted at first, then they outgrow the pool together.
SHORT = [[5, 9, 2], [7] * 5, list(range(3, 9)), [11, 12], list(range(60, 64)), [1, 2, 3]]
MAX_TOKENS = 14
LARGE = 4096  # KV pages of the uninterrupted runs: never short
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POOL = 40  # KV pages: 10 per plane of the 4-loop tiny model, 40 positions; SHORT's requests end at 16-20


def _engine(ckpt, pages: int, **mode) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), device=DEVICE, dtype="float32", block_size=4,
                                               num_kv_pages=pages, max_num_seqs=8, max_num_batched_tokens=48,
                                               **mode))


def _params(i: int) -> SamplingParams:
    if i % 2:  # seeded sampling: keyed draws make a resumed request draw what it would have
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True,
                              logprobs=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)


class _Watch:
    """Records each preemption: whose, and whether a round or pipeline was mid-flight."""

    def __init__(self, engine: EngineCore) -> None:
        self.victims: list[str] = []
        self.mid_flight = 0
        sched = engine.scheduler
        original = sched.preempt

        def preempt(req):
            self.victims.append(req.request_id)
            state = req.round
            if state is not None and (getattr(state, "row", 0) > 0 or getattr(state, "verifying", False)
                                      or len(getattr(state, "live", ())) > 1):
                self.mid_flight += 1
            original(req)

        sched.preempt = preempt


def _run(engine: EngineCore, prompts: list[list[int]], force: dict[int, int] | None = None) -> Outputs:
    """All requests at once; `force`: step -> index of the request to preempt then (if running)."""
    out: Outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _params(i))
    step = 0
    while engine.has_unfinished():
        victim = engine.requests.get(f"r{(force or {}).get(step, -1)}")
        if victim is not None and victim.status is Status.RUNNING:
            engine.scheduler.preempt(victim)
        step_into(engine, out)
        step += 1
        assert step < 5000, "no progress"
    sched = engine.scheduler
    assert pages_at_rest(engine) and not engine.kv.requests()
    assert sched.token_slots.num_free == sched.token_slots.size
    assert sched.cells.num_free == sched.cells.size and sched._returning == 0
    assert all(len(out[f"r{i}"][0]) == MAX_TOKENS for i in range(len(prompts)))
    return out


@pytest.fixture(scope="module")
def uninterrupted(tiny_ckpt) -> dict[tuple[str, int], Outputs]:
    return {}


def _want(tiny_ckpt, cache: dict[tuple[str, int], Outputs], mode: str, prompts: list[list[int]]) -> Outputs:
    """The requests through an engine whose pool never runs short (computed once per mode)."""
    key = (mode, id(prompts))
    if key not in cache:
        engine = _engine(tiny_ckpt, LARGE, **MODES[mode])
        cache[key] = _run(engine, prompts)
        assert engine.scheduler.num_preemptions == 0
    return cache[key]


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_small_pool_preempts_and_resumes_exactly(tiny_ckpt, uninterrupted, mode, policy):
    """Six requests that outgrow a pool of 40 positions per plane together: the latest-arrived
    running request is preempted again and again."""
    want = _want(tiny_ckpt, uninterrupted, mode, SHORT)
    engine = _engine(tiny_ckpt, POOL, preemption_mode=policy, **MODES[mode])
    watch = _Watch(engine)
    got = _run(engine, SHORT)
    assert engine.stats().num_preemptions == len(watch.victims) >= 5
    assert max(watch.victims.count(r) for r in set(watch.victims)) >= 2  # resumed more than once
    assert_same(got, want, 1e-4)


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_forced_preemptions_at_any_step_resume_exactly(tiny_ckpt, uninterrupted, mode, policy):
    """Preempting requests at fixed steps, prompt chunks and rounds or pipelines mid-flight
    included, changes nothing they emit."""
    want = _want(tiny_ckpt, uninterrupted, mode, PROMPTS)
    engine = _engine(tiny_ckpt, LARGE, preemption_mode=policy, **MODES[mode])
    watch = _Watch(engine)
    force = {s: k % 3 for k, s in enumerate(range(1, 60, 3))}  # r0, r1 (sampled), r2, r0, ...
    got = _run(engine, PROMPTS, force)
    assert len(watch.victims) >= 6
    if MODES[mode].get("speculation"):
        assert watch.mid_flight >= 1, "no preemption hit a round or pipeline mid-flight"
    assert_same(got, want, 1e-4)


def test_admission_by_need_admits_what_reservation_would_not(tiny_ckpt):
    """Five requests whose prompt + max_tokens (140 pages) do not fit a pool of 100 pages at
    once run together under admission by need (their prompts take 92 with the decode page);
    reserving prompt + max_tokens up front admits three."""
    by_need = _engine(tiny_ckpt, 100)
    reserving = _engine(tiny_ckpt, 100)
    reserving.scheduler.reserve_max_tokens = True
    for engine in (by_need, reserving):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, _params(0))  # greedy
        engine.step()
    assert len(by_need.scheduler.running) == len(PROMPTS)
    assert len(reserving.scheduler.running) == 3


def test_abort_of_a_preempted_request(tiny_ckpt):
    """A request aborted while it waits to resume ends at once and leaves nothing behind."""
    engine = _engine(tiny_ckpt, LARGE)
    params = _params(0)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[2], params)
    for _ in range(6):
        engine.step()
    victim = engine.requests["b"]
    engine.scheduler.preempt(victim)
    assert victim.status is Status.WAITING and engine.scheduler.waiting[0] is victim
    out = engine.abort("b")
    assert out.finished and out.finish_reason == "abort"
    rest = engine.drain()
    assert sum(len(o.token_ids) for o in rest if o.request_id == "a") > 0
    assert pages_at_rest(engine)
    assert engine.scheduler.cells.num_free == engine.scheduler.cells.size
