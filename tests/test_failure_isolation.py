"""One request's failure ends that request, not the engine.

A failure while adding, planning or committing one request ends it with an error
(`finish_reason="error"`, `RequestFailedError` from the Python APIs) while every other
request produces exactly its solo greedy tokens and every page and slot returns; a
failed forward call ends the engine, and then every later call says so.

The failures are injected by wrapping one engine method so that it raises for the
request named "bad" only, after it produced a few tokens, so its tickets are in flight.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from specloop.engine.async_engine import AsyncEngine
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.scheduling.scheduler import Scheduler
from specloop.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from specloop.llm import LLM
from tests.engine_runs import pages_at_rest

MODES = [{}, {"exit_threshold": 0.5}, {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
         {"speculation": "pipeline", "draft_loops": 1}]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8], "bad": [9, 10, 11], "c": [40, 41, 42, 43, 44, 45]}


def _tokens(outputs, request_id):
    return [t for o in outputs if o.request_id == request_id for t in o.token_ids]


def _engine(ckpt, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), device="cpu", dtype="float64", block_size=4, **options))


def _assert_all_returned(engine: EngineCore) -> None:
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert engine.scheduler.cells.num_free == engine.scheduler.cells.size


def _solo(ckpt, **mode) -> dict[str, list[int]]:
    """Each prompt alone on a plain engine (adaptive exit changes the tokens; speculation does not)."""
    engine = _engine(ckpt, **{k: v for k, v in mode.items() if k == "exit_threshold"})
    result = {}
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
        result[rid] = _tokens(engine.drain(), rid)
    return result


@pytest.fixture(scope="module")
def solo(tiny_ckpt):
    return _solo(tiny_ckpt)


def _fail_for_bad(monkeypatch, cls, name, after_tokens=2):
    """Make `cls.name` raise for the request "bad" once it has committed `after_tokens` tokens."""
    real = getattr(cls, name)

    def wrapper(self, req, *args, **kwargs):
        if req.request_id == "bad" and len(req.output_ids) >= after_tokens:
            raise RuntimeError(f"injected failure in {name}")
        return real(self, req, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)


@pytest.mark.parametrize("mode", MODES, ids=["plain", "exit", "block", "pipeline"])
@pytest.mark.parametrize("stage", ["planned", "committed"])
def test_failed_request_ends_alone(tiny_ckpt, monkeypatch, mode, stage):
    solo = _solo(tiny_ckpt, **mode)
    engine = _engine(tiny_ckpt, **mode)
    if stage == "planned":
        _fail_for_bad(monkeypatch, Scheduler, "build_group")
    else:
        _fail_for_bad(monkeypatch, EngineCore, "_accept")
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outputs = engine.drain()
    [last] = [o for o in outputs if o.request_id == "bad" and o.finished]
    assert last.finish_reason == "error" and f"while being {stage}" in last.error and "injected" in last.error
    assert 2 <= len(_tokens(outputs, "bad")) < GREEDY.max_tokens
    assert _tokens(outputs, "bad") == solo["bad"][: len(_tokens(outputs, "bad"))]
    for rid in ("a", "c"):
        assert _tokens(outputs, rid) == solo[rid]
    _assert_all_returned(engine)
    engine.add_request("bad2", PROMPTS["c"], GREEDY)  # still serving
    assert _tokens(engine.drain(), "bad2") == solo["c"]
    _assert_all_returned(engine)


def test_failed_add_leaves_no_trace(tiny_ckpt, solo, monkeypatch):
    engine = _engine(tiny_ckpt)
    real = type(engine.tokenizer).encode

    def encode(self, text, *args, **kwargs):
        if text == "boom":
            raise RuntimeError("injected tokenizer failure")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(engine.tokenizer), "encode", encode)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    with pytest.raises(RequestFailedError, match="injected tokenizer failure"):
        engine.add_request("boom", "boom", GREEDY)
    assert "boom" not in engine.requests and len(engine.scheduler.waiting) + len(engine.scheduler.running) == 1
    engine.add_request("boom", PROMPTS["c"], GREEDY)  # the ID was never taken
    outputs = engine.drain()
    assert _tokens(outputs, "a") == solo["a"] and _tokens(outputs, "boom") == solo["c"]
    _assert_all_returned(engine)


@pytest.mark.parametrize("params, param", [
    (dict(temperature=1.0, top_k=2**63), "top_k"),
    (dict(temperature=1.0, top_k=10**6), "top_k"),  # above the vocabulary
    (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    (dict(stop=["x"] * 65), "stop"),
    (dict(stop=["y" * 4097]), "stop"),
    (dict(top_p=1e-300), "top_p"),
    (dict(seed=2**64), "seed"),
])
def test_llm_refuses_unrepresentable_values_and_stays_usable(tiny_ckpt, params, param):
    """The issue's case: top_k = 2^63 raised in the sampler mid-forward and left the LLM
    unusable ("request_id 'llm-0' is already in use")."""
    llm = _llm(tiny_ckpt)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["x"], SamplingParams(max_tokens=2, **params))
    assert info.value.param == param
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].finish_reason == "length"


_LLMS: dict[str, LLM] = {}


def _llm(ckpt) -> LLM:
    if str(ckpt) not in _LLMS:
        _LLMS[str(ckpt)] = LLM(str(ckpt), device="cpu")
    return _LLMS[str(ckpt)]


def test_llm_raises_for_the_failed_prompt_and_keeps_the_others(tiny_ckpt, solo, monkeypatch):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float64", block_size=4)
    real = EngineCore._accept

    def accept(self, req, *args, **kwargs):
        if req.prompt_ids == PROMPTS["bad"] and len(req.output_ids) >= 2:
            raise RuntimeError("injected")
        return real(self, req, *args, **kwargs)

    monkeypatch.setattr(EngineCore, "_accept", accept)
    with pytest.raises(RequestFailedError, match="prompt 1 failed") as info:
        llm.generate([PROMPTS["a"], PROMPTS["bad"], PROMPTS["c"]], GREEDY)
    outs = info.value.outputs
    assert outs[0].token_ids == solo["a"] and outs[2].token_ids == solo["c"]
    assert outs[1].finish_reason == "error"
    assert llm.generate([PROMPTS["c"]], GREEDY)[0].token_ids == solo["c"]


def test_failed_forward_call_ends_the_engine(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), device="cpu")
    calls = {"n": 0}
    real = llm.engine.executor.submit

    def submit(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real(plan)

    monkeypatch.setattr(llm.engine.executor, "submit", submit)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(["hello"], SamplingParams(max_tokens=8))
    with pytest.raises(EngineDeadError, match="injected forward failure"):
        llm.generate(["hello"], SamplingParams(max_tokens=8))


async def test_async_engine_fails_one_stream_and_serves_on(tiny_ckpt, solo, monkeypatch):
    _fail_for_bad(monkeypatch, Scheduler, "build_group")
    engine = AsyncEngine(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float64", block_size=4))
    try:
        async def run(rid):
            tokens = []
            async for out in await engine.add(PROMPTS[rid], GREEDY, request_id=rid):
                tokens += out.token_ids
            return tokens

        a, bad, c = await asyncio.gather(run("a"), run("bad"), run("c"), return_exceptions=True)
        assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
        assert a == solo["a"] and c == solo["c"]
        assert engine.is_alive
        assert await run("c") == solo["c"]
        for _ in range(100):  # pages return once the last ticket in flight completed
            stats = engine.stats()
            if stats.running == stats.waiting == 0 and stats.kv_bytes_used == 0:
                break
            await asyncio.sleep(0.05)
        assert stats.running == stats.waiting == 0 and stats.kv_bytes_used == 0
    finally:
        await engine.shutdown()


def test_solo_reference_is_not_trivial(solo):
    assert all(len(t) == GREEDY.max_tokens for t in solo.values())
    assert torch.tensor([len(set(t)) for t in solo.values()]).min() > 1
