"""Injected faults (`specloop.engine.faults`), end to end: a failed forward call ends the
engine cleanly (every waiter gets an error, nothing hangs, the server exits 1), a failed
commit ends only its request, a late ticket changes nothing but the time.

Every test asserts that its fault really fired (the `FaultLog`, or the server's log), so a
seam that silently stopped working fails here instead of passing vacuously.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from server.cli import main
from server.testing import ServerProcess
from specloop.engine.async_engine import AsyncEngine
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.executor import Executor
from specloop.engine.faults import FAULTS_ENV, Faults, InjectedFault, from_env, install
from specloop.engine.tokenizer_pool import DEFAULT_WORKERS
from specloop.errors import ConfigError, EngineDeadError, RequestFailedError
from specloop.llm import LLM
from specloop.sampling_params import SamplingParams
from tests.engine_runs import pages_at_rest

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8], "bad": [9, 10, 11], "c": [40, 41, 42, 43, 44, 45]}
OPTIONS = dict(device="cpu", dtype="float64", block_size=4)
TIMEOUT_S = 10.0  # far beyond any wait here: reaching it means a hang


def _engine(ckpt, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), **{**OPTIONS, **options}))


def _run(engine: EngineCore) -> dict[str, list[int]]:
    """Every prompt at once; each request's tokens."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for out in engine.drain():
        tokens[out.request_id] += out.token_ids
    return tokens


@pytest.fixture(scope="module")
def reference(tiny_ckpt) -> dict[str, list[int]]:
    """The tokens of a run without faults."""
    tokens = _run(_engine(tiny_ckpt))
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())
    return tokens


# ---- the description ------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("forward=3", Faults(fail_forward_at=3)),
    ("commit=req-7", Faults(fail_commit_of="req-7")),
    (" commit=req-7 , commit_after=2 ", Faults(fail_commit_of="req-7", fail_commit_after=2)),
    ("delay=2:0.5,forward=9", Faults(fail_forward_at=9, delay_ticket=(2, 0.5))),
])
def test_parse(text, expected):
    assert Faults.parse(text) == expected
    assert from_env({FAULTS_ENV: text}) == expected


@pytest.mark.parametrize("text, message", [
    ("forwrd=3", "cannot read 'forwrd=3'"),
    ("forward", "cannot read 'forward'"),
    ("forward=three", "forward must be N"),
    ("forward=0", "counts forward calls from 1"),
    ("forward=1,forward=2", "given twice"),
    ("commit=", "commit must be REQUEST_ID"),
    ("commit_after=2", "needs fail_commit_of"),
    ("delay=2", "delay must be N:SECONDS"),
    ("delay=2:-1", "finite seconds"),
    ("delay=2:inf", "finite seconds"),
])
def test_malformed_description_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        from_env({FAULTS_ENV: text})
    assert FAULTS_ENV in str(info.value)


def test_no_description_means_no_faults(tiny_ckpt):
    assert from_env({}) is None and from_env({FAULTS_ENV: " "}) is None
    engine = _engine(tiny_ckpt)
    assert type(engine.executor) is Executor and "_commit_one" not in vars(engine)  # the usual path


def test_serve_refuses_a_malformed_description_at_start_up(tiny_ckpt, monkeypatch, capsys):
    monkeypatch.setenv(FAULTS_ENV, "forward=soon")
    assert main(["serve", str(tiny_ckpt), "--device", "cpu", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {FAULTS_ENV}: forward must be N, got 'soon'")


# ---- EngineCore and LLM -------------------------------------------------------------------
def test_forward_fault_ends_the_engine(tiny_ckpt):
    engine = _engine(tiny_ckpt)
    log = install(engine, Faults(fail_forward_at=3))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    with pytest.raises(InjectedFault, match="forward call 3"):
        engine.drain()
    assert log.fired == ["forward 3"] and engine.executor.num_submitted == 2
    assert isinstance(engine.failure, InjectedFault)
    for call in (engine.step, engine.drain, lambda: engine.add_request("d", [5], GREEDY)):
        with pytest.raises(EngineDeadError, match="forward call 3"):
            call()


def test_forward_fault_through_llm(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), **OPTIONS)
    log = install(llm.engine, Faults(fail_forward_at=2))
    with pytest.raises(InjectedFault):
        llm.generate([PROMPTS["a"], PROMPTS["c"]], GREEDY)
    with pytest.raises(EngineDeadError):
        llm.generate([PROMPTS["a"]], GREEDY)
    assert log.fired == ["forward 2"]


@pytest.mark.parametrize("mode", [{}, {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1}],
                         ids=["plain", "block"])
def test_commit_fault_fails_only_its_request(tiny_ckpt, reference, mode):
    engine = _engine(tiny_ckpt, **mode)
    log = install(engine, Faults(fail_commit_of="bad", fail_commit_after=2))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    outputs = engine.drain()
    [last] = [o for o in outputs if o.request_id == "bad" and o.finished]
    assert last.finish_reason == "error" and "while being committed" in last.error and "injected" in last.error
    assert log.fired == ["commit bad"] and log.target_commits == 3
    bad = [t for o in outputs if o.request_id == "bad" for t in o.token_ids]
    assert 2 <= len(bad) < GREEDY.max_tokens and bad == reference["bad"][: len(bad)]
    for rid in ("a", "c"):
        assert [t for o in outputs if o.request_id == rid for t in o.token_ids] == reference[rid]
    assert not engine.requests and pages_at_rest(engine)
    assert engine.failure is None


def test_delayed_ticket_changes_only_the_time(tiny_ckpt, reference):
    engine = _engine(tiny_ckpt)
    log = install(engine, Faults(delay_ticket=(2, 0.3)))
    start = time.perf_counter()
    assert _run(engine) == reference
    assert time.perf_counter() - start >= 0.3
    assert log.fired == ["delay 2"] and log.forward_calls == engine.executor.num_submitted > 2


# ---- AsyncEngine --------------------------------------------------------------------------
@pytest.fixture()
async def one_seat(tiny_ckpt):
    """One running request at a time: the others wait in the queue."""
    engine = AsyncEngine(EngineConfig.from_kwargs(str(tiny_ckpt), max_num_seqs=1, **OPTIONS))
    yield engine
    await asyncio.wait_for(engine.shutdown(), TIMEOUT_S)


async def _drain(stream) -> list[int]:
    tokens = []
    async for out in stream:
        tokens += out.token_ids
    return tokens


async def test_forward_fault_reaches_every_stream(one_seat):
    engine = one_seat
    # Ticket 1 is late, so every add is accepted before forward call 8 fails.
    log = install(engine.core, Faults(fail_forward_at=8, delay_ticket=(1, 0.3)))
    streams = await asyncio.gather(*(engine.add(p, GREEDY, request_id=rid) for rid, p in PROMPTS.items()))
    got = {s.request_id: [] for s in streams}

    async def consume(stream) -> BaseException:
        with pytest.raises(EngineDeadError, match="forward call 8") as info:
            async for out in stream:
                got[stream.request_id] += out.token_ids
        return info.value

    errors = await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), TIMEOUT_S)
    await asyncio.wait_for(engine.shutdown(), TIMEOUT_S)  # at once, while its thread may still wind down
    assert all(isinstance(e.__cause__, InjectedFault) for e in errors)
    assert log.fired == ["delay 1", "forward 8"]
    assert got["a"] and not got["bad"] and not got["c"]  # the first one ran; the queued ones never did
    assert not engine.is_alive and isinstance(engine.error, InjectedFault)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(engine.add(PROMPTS["a"], GREEDY), TIMEOUT_S)


async def test_add_in_flight_when_the_engine_dies_gets_an_error(one_seat):
    """A text prompt is tokenized before its add reaches the engine thread; if the engine
    died meanwhile, the add must still get an error, not wait forever."""
    engine = one_seat
    log = install(engine.core, Faults(fail_forward_at=1))
    gate = threading.Event()
    blockers = [asyncio.ensure_future(engine.in_tokenizer_pool(lambda tok: gate.wait(TIMEOUT_S)))
                for _ in range(DEFAULT_WORKERS)]
    late = asyncio.ensure_future(engine.add("a text prompt", GREEDY))
    await asyncio.sleep(0.05)  # `late` passed its liveness check and waits for a tokenizer worker
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(_drain(await engine.add(PROMPTS["a"], GREEDY)), TIMEOUT_S)
    assert log.fired == ["forward 1"]
    gate.set()
    await asyncio.gather(*blockers)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(late, TIMEOUT_S)


async def test_commit_fault_fails_one_stream_and_serves_on(one_seat, reference):
    engine = one_seat
    log = install(engine.core, Faults(fail_commit_of="bad", fail_commit_after=2))
    streams = await asyncio.gather(*(engine.add(p, GREEDY, request_id=rid) for rid, p in PROMPTS.items()))
    results = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in streams), return_exceptions=True),
                                     TIMEOUT_S)
    a, bad, c = results
    assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
    assert a == reference["a"] and c == reference["c"]
    assert log.fired == ["commit bad"] and engine.is_alive


# ---- a real server ------------------------------------------------------------------------
STREAM = {"max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream_events(client: httpx.AsyncClient, prompt: list[int]) -> tuple[int, list[str]]:
    async with client.stream("POST", "/v1/completions", json={**STREAM, "prompt": prompt}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.text]
        return 200, [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


def _check_stream(status: int, events: list[str]) -> None:
    """A stream that failed mid-way: chunks that never finished, an error event, [DONE]."""
    assert status == 200, events
    *chunks, error, done = events
    assert done == "[DONE]" and json.loads(error)["error"]["code"] == "engine_dead", events
    assert "forward call 8" in json.loads(error)["error"]["message"], events
    assert all(c["finish_reason"] is None for chunk in chunks for c in json.loads(chunk)["choices"]), events


async def test_server_with_a_forward_fault_fails_every_request_and_exits_1(tiny_ckpt):
    # Ticket 1 is 1.5 s late, so all the requests below are in the engine when call 8 fails.
    srv = ServerProcess(["--model", str(tiny_ckpt), "--device", "cpu", "--max-num-seqs", "2",
                         "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": "1", FAULTS_ENV: "forward=8,delay=1:1.5"})
    srv.start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT_S) as client:
            prompts = [[5 + i, 6, 7] for i in range(4)]
            plain = client.post("/v1/completions", json={**STREAM, "stream": False, "prompt": [9, 9]})
            *streams, reply = await asyncio.wait_for(
                asyncio.gather(*(_stream_events(client, p) for p in prompts), plain), 3 * TIMEOUT_S)
            for status, events in streams:
                _check_stream(status, events)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_dead", reply.text
            assert (await client.get("/health")).status_code == 503  # the server stops ~2 s after the death
        assert await asyncio.to_thread(srv.wait, TIMEOUT_S) == 1, srv.output  # measured: about 3 s
    finally:
        srv.kill()
    assert "fault injection armed" in srv.output, srv.output
    assert "the engine failed (InjectedFault: injected fault: forward call 8 failed)" in srv.output, srv.output
