"""Data parallelism (`specloop/engine/data_parallel/`): N engine replicas in processes of their
own behind one engine interface, tiny checkpoint on the CPU in float64 (where batching cannot
change an argmax, so every greedy stream equals its solo run).

The routing rule, the merge of the replicas' statistics and the device placement are unit
tested without processes; then one `DataParallelEngine` of two replicas serves the app in
process (greedy outputs, aborts, metrics), another loses a replica to SIGKILL, and a real
`specloop serve --data-parallel-size 2` loses replica 0 to an injected forward fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import time

import httpx
import pytest

from server.app import create_app
from server.cli import main
from server.testing import ServerProcess
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineStats
from specloop.engine.data_parallel.engine import DataParallelEngine, replica_devices
from specloop.engine.data_parallel.router import Load, least_loaded
from specloop.engine.data_parallel.stats import COUNTERS, GAUGES, OTHERS, merge_stats
from specloop.engine.faults import FAULTS_ENV
from specloop.errors import ConfigError, EngineDeadError, InvalidRequestError
from specloop.llm import LLM
from specloop.sampling_params import SamplingParams

OPTIONS = dict(device="cpu", dtype="float64")
TIMEOUT_S = 30.0  # far beyond any wait here: reaching it means a hang
PROMPTS = [[10 + i, 20 + 7 * i, 30 + i] * (1 + i % 3) for i in range(8)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(tiny_ckpt):
    """Each prompt's tokens from one engine, alone."""
    llm = LLM(str(tiny_ckpt), **OPTIONS)
    return lambda prompt, max_tokens: llm.generate([prompt], greedy(max_tokens))[0].token_ids


@pytest.fixture(scope="module")
def dp(tiny_ckpt):
    engine = DataParallelEngine(EngineConfig.from_kwargs(str(tiny_ckpt), **OPTIONS), 2)
    yield engine
    asyncio.run(asyncio.wait_for(engine.shutdown(), TIMEOUT_S))
    assert [r.process.exitcode for r in engine.replicas] == [0, 0]


def client_for(engine: DataParallelEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, "tiny")), base_url="http://test")


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def drain(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# ---- without processes ----------------------------------------------------------------------
def test_least_loaded_counts_requests_then_tokens_then_index_and_skips_dead_replicas():
    loads = [Load(requests=2, tokens=10), Load(requests=1, tokens=500), Load(requests=1, tokens=40)]
    assert least_loaded(loads) == 2  # fewest requests, then fewest tokens
    loads[2].take(100)
    assert least_loaded(loads) == 1
    loads[1].progress(460)  # 40 tokens left, like replica 2 before it took its request
    loads[1].release(40)
    assert least_loaded(loads) == 1 and (loads[1].requests, loads[1].tokens) == (0, 0)
    loads[1].alive = False
    assert least_loaded(loads) == 0  # 2 requests of 10 tokens beat 2 of 140
    assert least_loaded([Load(), Load()]) == 0  # ties go to the lowest index
    assert least_loaded([Load(alive=False)]) is None


def _stats(**values) -> EngineStats:
    return EngineStats(**{"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_bytes_used": 0, "num_kv_pages": 0,
                          **values})


def test_merge_adds_every_replicas_counters_and_only_live_replicas_gauges():
    a = _stats(running=2, waiting=1, kv_usage=0.5, kv_bytes_used=100, num_kv_pages=10, num_drafts=3,
               accepted_per_position=(2, 1), iteration_tokens=((1.0, 4), (8.0, 6), (float("inf"), 6)),
               iteration_tokens_sum=20, kv_bytes_per_request={"x": 100})
    b = _stats(running=1, kv_usage=0.25, kv_bytes_used=40, num_kv_pages=30, num_drafts=5,
               accepted_per_position=(4,), iteration_tokens=((1.0, 1), (8.0, 1), (float("inf"), 2)),
               iteration_tokens_sum=9, kv_bytes_per_request={"y": 40})
    dead = dataclasses.replace(b, running=7, num_drafts=100, kv_bytes_per_request={"z": 1})
    merged = merge_stats([(True, a), (True, b), (False, dead)])
    assert (merged.running, merged.waiting, merged.kv_bytes_used, merged.num_kv_pages) == (3, 1, 140, 40)
    assert merged.kv_usage == pytest.approx((0.5 * 10 + 0.25 * 30) / 40)  # held pages over the live pool
    assert merged.num_drafts == 108 and merged.iteration_tokens_sum == 38  # counters never go down
    assert merged.accepted_per_position == (10, 1)
    assert merged.iteration_tokens == ((1.0, 6), (8.0, 8), (float("inf"), 10))
    assert merged.kv_bytes_per_request == {"x": 100, "y": 40}
    none_alive = merge_stats([(False, a)])
    assert none_alive.running == 0 and none_alive.kv_usage == 0.0 and none_alive.num_drafts == 3


def test_every_stats_field_has_a_merge_rule():
    fields = {f.name for f in dataclasses.fields(EngineStats)}
    assert fields == set(GAUGES) | set(COUNTERS) | set(OTHERS)  # a new field must say how replicas add up


def test_replica_placement():
    assert replica_devices("cpu", 3, cuda_devices=2) == ["cpu"] * 3
    assert replica_devices("auto", 2, cuda_devices=0) == ["cpu", "cpu"]
    assert replica_devices("auto", 2, cuda_devices=4) == ["cuda:0", "cuda:1"]
    assert replica_devices("cuda", 2, cuda_devices=2) == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match="needs 2 CUDA devices, one per replica; 1 visible"):
        replica_devices("cuda", 2, cuda_devices=1)
    with pytest.raises(ConfigError, match="give --device cuda"):
        replica_devices("cuda:1", 2, cuda_devices=2)


def test_data_parallel_refuses_tensor_parallel_replicas():
    with pytest.raises(ConfigError, match="does not work with tensor_parallel_size"):
        DataParallelEngine(EngineConfig(model="m", device="cpu", tensor_parallel_size=2), 2)


def test_a_replicas_start_up_error_is_the_same_error_line(tmp_path, capsys):
    lines = []
    for size in ("1", "2"):
        assert main(["serve", str(tmp_path), "--device", "cpu", "--port", "0", "--data-parallel-size", size]) == 2
        lines.append(capsys.readouterr().err)
    assert lines[0].startswith(f"error: {tmp_path} has no config.json") and lines[1] == lines[0], lines


# ---- one DataParallelEngine serving the app ----------------------------------------------------
async def test_greedy_outputs_through_the_app_equal_one_engines(dp, solo):
    before = [r.stats.iteration_tokens_sum for r in dp.replicas]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with client_for(dp) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p,
                                                                            "stream": i % 2 == 1})
                                         for i, p in enumerate(PROMPTS)))
    for i, (prompt, reply) in enumerate(zip(PROMPTS, replies)):
        assert reply.status_code == 200, reply.text
        if i % 2:
            chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
            tokens = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
        else:
            tokens = reply.json()["choices"][0]["token_ids"]
        assert tokens == solo(prompt, 8), f"prompt {i}"
    after = [r.stats.iteration_tokens_sum for r in dp.replicas]
    assert all(b > a for a, b in zip(before, after)), (before, after)  # both replicas served
    assert all(r.load.requests == 0 and r.load.tokens == 0 for r in dp.replicas)  # every request released


async def test_abort_reaches_the_replica_serving_the_request(dp, solo):
    long, short = PROMPTS[0], PROMPTS[1]
    first = await dp.add(long, greedy(400), request_id="long")
    second = await dp.add(short, greedy(24), request_id="short")
    owners = [next(r.index for r in dp.replicas if r.owns(rid)) for rid in ("long", "short")]
    assert owners == [0, 1]  # two idle replicas: one request each
    with pytest.raises(InvalidRequestError, match="already in use"):  # an ID is unique over every replica
        await dp.add(short, greedy(4), request_id="long")
    with pytest.raises(InvalidRequestError) as refused:  # a replica's refusal crosses as the same error
        await dp.add(short, SamplingParams(top_k=10**6))
    assert refused.value.param == "top_k" and [r.load.requests for r in dp.replicas] == [1, 1]
    for bad in ([2**70], [-1], [3, "x"]):  # refused in the server (an id past int64 could not even cross)
        with pytest.raises(InvalidRequestError) as refused:
            await dp.add(bad, greedy(4), request_id="bad")
        assert refused.value.param == "prompt"
    assert [r.load.requests for r in dp.replicas] == [1, 1] and not any(r.owns("bad") for r in dp.replicas)
    await until(lambda: dp.replicas[0].stats.running == 1, "replica 0 runs its request")
    await dp.abort("long")
    outputs = [out async for out in first]
    assert outputs[-1].finish_reason == "abort" and len([t for o in outputs for t in o.token_ids]) < 400
    assert await asyncio.wait_for(drain(second), TIMEOUT_S) == solo(short, 24)  # the other replica serves on
    await until(lambda: all(r.stats.running == 0 for r in dp.replicas), "both replicas are idle")
    # A client that leaves: the stream's abort goes to its replica, which frees the request.
    third = await dp.add(long, greedy(400))
    await until(lambda: dp.stats().running == 1, "the request runs")
    third.abort()
    await until(lambda: dp.stats().running == 0 and all(r.load.requests == 0 for r in dp.replicas),
                "the aborted request is gone from its replica and from the router's count")


async def test_metrics_are_the_replicas_added_up(dp):
    async with client_for(dp) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": p, "max_tokens": 4, "ignore_eos": True}) for p in PROMPTS[:4]))  # (sampled: EOS would end one)
        assert [r.status_code for r in replies] == [200] * 4
        text = (await client.get("/metrics")).text
        health = await client.get("/health")
        version = (await client.get("/version")).json()
    replicas = [r.stats for r in dp.replicas]
    assert metric(text, "specloop_iteration_tokens_sum") == sum(s.iteration_tokens_sum for s in replicas) > 0
    assert metric(text, "specloop_kv_cache_pages") == sum(s.num_kv_pages for s in replicas)
    assert metric(text, 'vllm:iteration_tokens_total_count{model_name="tiny"}') == sum(
        s.iteration_tokens[-1][1] for s in replicas)
    for index in ("0", "1"):
        assert metric(text, f'specloop_replica_alive{{replica="{index}"}}') == 1
        assert metric(text, f'specloop_replica_num_requests_running{{replica="{index}"}}') == 0
    # (the module's earlier requests count too)
    assert metric(text, 'specloop_requests_finished_total{finish_reason="length"}') >= 4
    assert health.status_code == 200 and health.json() == {"status": "ok", "replicas": 2, "replicas_alive": 2}
    assert version["engine"]["data_parallel_size"] == 2 and version["engine"]["device"] == "cpu"


# ---- a replica dies -------------------------------------------------------------------------
async def test_a_killed_replica_ends_only_its_requests(tiny_ckpt, solo):
    engine = DataParallelEngine(EngineConfig.from_kwargs(str(tiny_ckpt), **OPTIONS), 2)
    try:
        # Replicas 0, 1, 0, 1; replica 1's requests are far too long to end before the kill.
        streams = [await engine.add(p, greedy(48 if i % 2 == 0 else 1500)) for i, p in enumerate(PROMPTS[:4])]
        on_one = [s for s in streams if engine.replicas[1].owns(s.request_id)]
        assert on_one == streams[1::2]
        firsts = [await asyncio.wait_for(s.__anext__(), TIMEOUT_S) for s in streams]  # all four are running
        os.kill(engine.replicas[1].pid, signal.SIGKILL)
        for stream, first, prompt in zip(streams, firsts, PROMPTS):
            if stream in on_one:
                with pytest.raises(EngineDeadError, match="replica 1 failed: its process was killed by signal SIGKILL"):
                    await asyncio.wait_for(drain(stream), TIMEOUT_S)
            else:
                assert first.token_ids + await asyncio.wait_for(drain(stream), TIMEOUT_S) == solo(prompt, 48)
        assert engine.is_alive and engine.error is None
        assert not engine.replicas[1].alive and engine.stats().num_kv_pages == engine.replicas[0].stats.num_kv_pages
        async with client_for(engine) as client:
            health = await client.get("/health")
            assert health.status_code == 200
            assert health.json() == {"status": "degraded", "replicas": 2, "replicas_alive": 1}
            reply = await client.post("/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 6,
                                                                "temperature": 0, "ignore_eos": True,
                                                                "return_token_ids": True})
            assert reply.json()["choices"][0]["token_ids"] == solo(PROMPTS[5], 6)  # served by replica 0
            assert 'specloop_replica_alive{replica="1"} 0.0' in (await client.get("/metrics")).text
            os.kill(engine.replicas[0].pid, signal.SIGKILL)
            await until(lambda: engine.error is not None, "the engine notices its last replica died")
            assert not engine.is_alive
            assert (await client.get("/health")).status_code == 503
            assert (await client.post("/v1/completions", json={"prompt": [5]})).json()["error"]["code"] == \
                "engine_dead"
    finally:
        await asyncio.wait_for(engine.shutdown(), TIMEOUT_S)


# ---- a real server --------------------------------------------------------------------------
STREAM = {"max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}


async def _stream(client: httpx.AsyncClient, prompt: list[int]) -> list[dict | str]:
    async with client.stream("POST", "/v1/completions", json={**STREAM, "prompt": prompt}) as response:
        assert response.status_code == 200, await response.aread()
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                async for line in response.aiter_lines() if line.startswith("data: ")]


async def test_serve_with_two_replicas_survives_a_failed_replica(tiny_ckpt, solo):
    # Replica 0's first ticket is 1.5 s late, so both of its requests are in when its call 8 fails.
    srv = ServerProcess(["--model", str(tiny_ckpt), "--device", "cpu", "--dtype", "float64",
                         "--data-parallel-size", "2", "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": "1", FAULTS_ENV: "forward=8,delay=1:1.5"})
    srv.start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT_S) as client:
            results = await asyncio.gather(*(_stream(client, p) for p in PROMPTS[:4]))
            failed = [events for events in results if "error" in events[-2]]
            for prompt, events in zip(PROMPTS, results):
                assert events[-1] == "[DONE]"
                if events in failed:
                    assert events[-2]["error"]["code"] == "engine_dead", events
                    assert "replica 0 failed" in events[-2]["error"]["message"], events
                else:
                    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == solo(prompt, 32)
            assert len(failed) == 2, results  # replica 0's two requests
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            reply = await client.post("/v1/completions", json={**STREAM, "stream": False, "prompt": PROMPTS[6]})
            assert reply.json()["choices"][0]["token_ids"] == solo(PROMPTS[6], 32)
    finally:
        assert srv.stop() == 0, srv.output
    assert "data-parallel replica 0 (pid" in srv.output and "1 of 2 replicas serve on" in srv.output, srv.output
