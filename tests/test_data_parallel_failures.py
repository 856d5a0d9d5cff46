"""Data parallelism when a replica misbehaves without dying cleanly: an add that raises a plain
exception, a start-up that fails after the engine is built, a pipe that closes while the replica
process lives on.

Each test starts real replica processes (tiny checkpoint on the CPU) whose spawn target is one of
the `_serve_*` functions below instead of `serve_replica`: they run in the replica process, break
one thing there, then serve as usual (the replica imports this module to find them).
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.data_parallel import handle, worker
from specloop.engine.data_parallel.engine import DataParallelEngine
from specloop.errors import EngineDeadError, RequestFailedError
from specloop.sampling_params import SamplingParams
from tests.test_data_parallel import OPTIONS, TIMEOUT_S, client_for, drain, greedy, until

BAD_PROMPT = [13, 13, 13]  # the prompt whose add raises in `_serve_failing_add`
FAST_JOIN_S = 1.0  # handle.JOIN_S in these tests: how long a replica whose pipe closed may take to exit


# ---- replica targets (run in the replica process) ---------------------------------------------
def _serve_failing_add(index: int, config: EngineConfig, cpu_threads: int, commands: Connection,
                       events: Connection) -> None:
    """Adding BAD_PROMPT raises a plain ValueError, as a bug in the engine would (not a SpecloopError)."""
    add_request = EngineCore.add_request

    def failing(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if list(prompt) == BAD_PROMPT:
            raise ValueError("a bug while adding")
        add_request(core, request_id, prompt, params)

    EngineCore.add_request = failing  # type: ignore[method-assign]
    worker.serve_replica(index, config, cpu_threads, commands, events)


def _serve_failing_ready(index: int, config: EngineConfig, cpu_threads: int, commands: Connection,
                         events: Connection) -> None:
    """The engine builds, then reading what Ready reports of it raises."""
    def failing(core: EngineCore) -> None:
        raise TypeError("the statistics cannot be read")

    EngineCore.stats = failing  # type: ignore[method-assign,assignment]
    worker.serve_replica(index, config, cpu_threads, commands, events)


def _serve_then_close(end: str, index: int, config: EngineConfig, cpu_threads: int, commands: Connection,
                      events: Connection) -> None:
    """Replica 0 closes its `end` ("events" or "commands") pipe after Ready and lives on, deaf or mute
    (SIGTERM is ignored, as in every replica); the other replicas serve as usual."""
    def close_and_live(core: EngineCore, commands: Connection, events: Connection) -> None:
        (events if end == "events" else commands).close()
        time.sleep(3600)

    if index == 0:
        worker._loop = close_and_live  # type: ignore[assignment]
    worker.serve_replica(index, config, cpu_threads, commands, events)


def _serve_closing_events(*args: Any) -> None:
    _serve_then_close("events", *args)


def _serve_closing_commands(*args: Any) -> None:
    _serve_then_close("commands", *args)


# ---- helpers ----------------------------------------------------------------------------------
def start(tiny_ckpt, monkeypatch, target: Callable[..., None], size: int) -> DataParallelEngine:
    """A DataParallelEngine whose replicas run `target`; a hang at start-up fails within TIMEOUT_S."""
    monkeypatch.setattr(handle, "serve_replica", target)
    monkeypatch.setattr(handle, "JOIN_S", FAST_JOIN_S)
    return DataParallelEngine(EngineConfig.from_kwargs(str(tiny_ckpt), **OPTIONS), size, start_timeout_s=TIMEOUT_S)


async def stop(engine: DataParallelEngine) -> None:
    """Shut down, and kill any replica still running, so that no test leaves a process behind."""
    try:
        await asyncio.wait_for(engine.shutdown(), TIMEOUT_S)
    finally:
        for replica in engine.replicas:
            if replica.process.exitcode is None:
                replica.process.kill()
                replica.process.join(TIMEOUT_S)


def reader_gone(conn: Connection) -> bool:
    """Whether nobody holds the read end of the pipe `conn` writes to (POLLERR on its write end)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLOUT)
    return any(mask & select.POLLERR for _, mask in poller.poll(0))


# ---- the tests --------------------------------------------------------------------------------
async def test_an_add_that_raises_a_plain_exception_fails_that_request_alone(tiny_ckpt, monkeypatch):
    engine = start(tiny_ckpt, monkeypatch, _serve_failing_add, 1)
    try:
        with pytest.raises(RequestFailedError, match="failed while being added: ValueError: a bug while adding"):
            await asyncio.wait_for(engine.add(BAD_PROMPT, greedy(4)), TIMEOUT_S)
        body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        async with client_for(engine) as client:
            failed = await client.post("/v1/completions", json={**body, "prompt": BAD_PROMPT})
            served = await client.post("/v1/completions", json={**body, "prompt": [5, 6, 7]})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "request_failed", failed.text
        assert served.status_code == 200 and len(served.json()["choices"][0]["token_ids"]) == 4, served.text
        assert engine.is_alive and engine.replicas[0].alive and engine.replicas[0].process.exitcode is None
        assert engine.replicas[0].load.requests == 0 and engine.replicas[0].load.tokens == 0
    finally:
        await stop(engine)


def test_a_failure_between_building_the_engine_and_ready_is_reported(tiny_ckpt, monkeypatch):
    began = time.monotonic()
    with pytest.raises(EngineDeadError, match="replica 0 failed to start: TypeError: the statistics cannot be read"):
        start(tiny_ckpt, monkeypatch, _serve_failing_ready, 1)
    assert time.monotonic() - began < TIMEOUT_S


async def test_a_replica_whose_event_pipe_closed_is_killed_reaped_and_counted_dead(tiny_ckpt, monkeypatch):
    engine = start(tiny_ckpt, monkeypatch, _serve_closing_events, 2)
    try:
        await until(lambda: not engine.replicas[0].alive, "the server gives up on the replica it cannot hear")
        dead = engine.replicas[0]
        assert dead.process.exitcode is not None, "the replica still runs"  # killed and reaped: no orphan
        assert "pipe closed while the process still ran" in str(dead.error)
        assert engine.is_alive and engine.replicas[1].alive
        async with client_for(engine) as client:
            health = await client.get("/health")
        assert health.json() == {"status": "degraded", "replicas": 2, "replicas_alive": 1}
        stream = await asyncio.wait_for(engine.add([5, 6, 7], greedy(4)), TIMEOUT_S)  # replica 1 serves
        assert len(await asyncio.wait_for(drain(stream), TIMEOUT_S)) == 4
    finally:
        await stop(engine)


async def test_a_replica_whose_command_pipe_closed_is_killed_and_its_add_fails(tiny_ckpt, monkeypatch):
    engine = start(tiny_ckpt, monkeypatch, _serve_closing_commands, 1)
    try:
        replica = engine.replicas[0]
        await until(lambda: reader_gone(replica._commands), "the replica closes its end of the command pipe")
        with pytest.raises(EngineDeadError, match="replica 0 failed: its command pipe closed"):
            await asyncio.wait_for(engine.add([5, 6, 7], greedy(4)), TIMEOUT_S)  # (before: no answer, ever)
        await until(lambda: not replica.alive and replica.process.exitcode is not None,
                    "the replica is counted dead and its process reaped")
        assert not engine.is_alive
    finally:
        await stop(engine)
