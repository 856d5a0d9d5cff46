"""Chaos through the HTTP server (the shipped model, fp32, CPU): 90 requests per speculation mode.

The app (`server.app.create_app`) is served by uvicorn on a real socket inside the test's
event loop: the clients' disconnects are real closed connections, and the engine behind
the server can still be inspected at rest (a `specloop serve` process would show only its
/metrics; tests/test_server_preemption.py covers that process under preemption). Clients
stream to the end, post without streaming, send two prompts in one request, close the
connection mid-stream (or right after the headers), and give up on a non-streaming request
after a random delay. The KV pool holds 20 positions per plane, so running requests are
preempted all the time (each run's policy: `tests.chaos.runs.policy`).

Checks: each choice against its solo run (`tests.chaos.oracle`); usage against the tokens
received; at rest every page, token slot and request cell back; /metrics with the gauges at
zero, the preemptions counted, every request counted finished at most once (and at least
once unless its client gave up before the response began), no error, and the clients'
departures turned into aborts inside the engine. Request IDs are the server's own
(`cmpl-<uuid>-<choice>`), so clients cannot reuse one: ID reuse is covered through
AsyncEngine (`test_async_engine_chaos.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from server.app import create_app
from server.main import bind_socket
from server.testing import ServerProcess
from specloop.assets import default_model_path
from specloop.engine.async_engine import AsyncEngine
from specloop.engine.config import EngineConfig
from tests.chaos.oracle import FINAL, EngineWatch, Outcome, SoloRuns, assert_clean, check_outcome, wait_idle
from tests.chaos.runs import SPARSE_PREFILL_MODES, policy
from tests.chaos.schedule import TEMPERATURE, TOP_P, Spec, make_schedule, random_prompts
from tests.engine_runs import MODES

REQUESTS = 84  # HTTP requests per mode: 504 in all, and PROCESS_REQUESTS more to a served process
PROCESS_REQUESTS = 60
PROCESS_MODE, PROCESS_SEED = "plain", 2399  # the other policy than its in-process run
POSITIONS = 20  # per plane of the KV pool
GREEDY_MAX_TOKENS = (2, 4, 8)
SAMPLED_MAX_TOKENS = (4,)  # one length: fewer solo runs of the larger model
FATES = {"stream": 0.4, "full": 0.15, "batch": 0.1, "disconnect": 0.25, "cancel": 0.1}
TEXTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]
VOCAB = 4096  # the shipped model's
RUN_TIMEOUT_S = 90.0
SEEDS = {mode: 2300 + i for i, mode in enumerate(MODES)}
NAME = "chaos"
GAUGES = ("specloop_num_requests_running", "specloop_num_requests_waiting", "specloop_kv_cache_usage_ratio",
          "specloop_kv_cache_used_bytes")


def _options(mode: str, rng: random.Random) -> dict:
    options = dict(device="cpu", dtype="float32", block_size=2, num_kv_pages=4 * POSITIONS // 2, max_num_seqs=12,
                   max_num_batched_tokens=48, max_inflight_tickets=rng.choice([1, 2, 3]),
                   preemption_mode=policy(mode, turn=1), **MODES[mode])
    if mode in SPARSE_PREFILL_MODES:  # the prompts are 1-8 tokens of text: windows of 2-4 have sparse loops
        options["token_sparse_prefill"] = json.dumps({"window": rng.choice([2, 3, 4]), "retention": [1, 1, 0.5, 0.25]})
    return options


class _Server(uvicorn.Server):
    """uvicorn in the test's event loop; the signal handlers stay pytest's."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


@contextlib.asynccontextmanager
async def serving(engine: AsyncEngine) -> AsyncIterator[str]:
    """The app over `engine` on 127.0.0.1 (any free port); yields its URL."""
    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    server = _Server(uvicorn.Config(create_app(engine, NAME), lifespan="off", log_level="warning"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def _body(spec: Spec, prompt: str | list, stream: bool) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": spec.max_tokens, "ignore_eos": spec.ignore_eos,
            "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if spec.sampled:
        return {**body, "temperature": TEMPERATURE, "top_p": TOP_P, "seed": spec.seed}
    return {**body, "temperature": 0}


class _Client:
    """Drives one schedule against the server; one Outcome per choice."""

    def __init__(self, http: httpx.AsyncClient, prompts: list, where: str) -> None:
        self.http = http
        self.prompts = prompts
        self.where = where
        self.outcomes: list[tuple[Outcome, str | list[int]]] = []
        self.choices_sent = 0  # engine requests (choices) of every HTTP request sent
        self.choices_cancelled = 0  # of requests given up before their response (may not be counted)

    async def run(self, specs: list[Spec]) -> None:
        await asyncio.gather(*(self._request(s) for s in specs))

    def _choices(self, spec: Spec) -> list[str | list[int]]:
        if spec.fate == "batch":  # two prompts, one choice each (token ids: a list of lists)
            ids = [p for p in self.prompts if not isinstance(p, str)]
            return [ids[spec.prompt % len(ids)], ids[(spec.prompt + 1) % len(ids)]]
        return [self.prompts[spec.prompt]]

    async def _request(self, spec: Spec) -> None:
        await asyncio.sleep(spec.delay)
        prompts = self._choices(spec)
        outcomes = [Outcome(spec, added=True) for _ in prompts]
        self.outcomes += list(zip(outcomes, prompts))
        self.choices_sent += len(prompts)
        prompt = prompts if spec.fate == "batch" else prompts[0]
        try:
            if spec.fate in ("full", "cancel"):
                await self._post(spec, prompt, outcomes)
            else:
                await self._stream(spec, prompt, outcomes)
        except AssertionError:
            raise
        except Exception as exc:  # name the run and the request: the schedule replays from its seed
            raise AssertionError(f"{self.where}; {spec}: {type(exc).__name__}: {exc}") from exc

    async def _post(self, spec: Spec, prompt: str | list, outcomes: list[Outcome]) -> None:
        request = asyncio.ensure_future(self.http.post("/v1/completions", json=_body(spec, prompt, False)))
        if spec.fate == "cancel":
            await asyncio.wait([request], timeout=spec.fate_delay * 10)
            if not request.done():
                request.cancel()  # httpx drops the connection: the server sees the client leave
                self.choices_cancelled += len(outcomes)
                for outcome in outcomes:
                    outcome.aborted = True
                await asyncio.gather(request, return_exceptions=True)
                return
        reply = await request
        assert reply.status_code == 200, f"{self.where}; {spec}: {reply.text}"
        data = reply.json()
        for choice in data["choices"]:
            outcome = outcomes[choice["index"]]
            outcome.tokens, outcome.reason = choice["token_ids"], choice["finish_reason"]
        assert data["usage"]["completion_tokens"] == sum(len(o.tokens) for o in outcomes), f"{self.where}; {spec}"

    async def _stream(self, spec: Spec, prompt: str | list, outcomes: list[Outcome]) -> None:
        chunks, usage, done = 0, None, False
        async with self.http.stream("POST", "/v1/completions", json=_body(spec, prompt, True)) as reply:
            assert reply.status_code == 200, f"{self.where}; {spec}: {await reply.aread()}"
            if spec.fate == "disconnect" and spec.after == 0:
                self._left(outcomes)
                return  # leaving the block closes the connection
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                assert "error" not in event, f"{self.where}; {spec}: {event}"
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    outcome = outcomes[choice["index"]]
                    outcome.tokens += choice.get("token_ids", [])
                    outcome.outputs += 1
                    outcome.reason = choice["finish_reason"] or outcome.reason
                chunks += 1
                if spec.fate == "disconnect" and chunks == spec.after and any(o.reason is None for o in outcomes):
                    self._left(outcomes)
                    return
        assert done, f"{self.where}; {spec}: the stream ended without [DONE]"
        assert usage == sum(len(o.tokens) for o in outcomes), f"{self.where}; {spec}: usage {usage}"

    @staticmethod
    def _left(outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if outcome.reason is None:
                outcome.aborted = True


async def _at_rest(http: httpx.AsyncClient, where: str, timeout: float = 30.0) -> str:
    """/metrics once the gauges read zero (a leaked page or request keeps them up: then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = await http.get("/metrics")
        assert reply.status_code == 200, f"{where}: /metrics answered {reply.status_code}"
        gauges = {g: _value(reply.text, g) for g in GAUGES}
        if not any(gauges.values()):
            return reply.text
        assert time.monotonic() < deadline, f"{where}: gauges at rest {gauges}"
        await asyncio.sleep(0.05)


def _value(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def _drive(url: str, prompts: list, specs: list[Spec], where: str) -> tuple[_Client, str]:
    """Run the schedule against the server at `url`; the client and /metrics at rest."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        client = _Client(http, prompts, where)
        await asyncio.wait_for(client.run(specs), RUN_TIMEOUT_S)
        return client, await _at_rest(http, where)


def _check(client: _Client, metrics: str, solo: SoloRuns, where: str, seed: int) -> None:
    """Every choice against its solo run; the counters against what the clients did."""
    for outcome, prompt in client.outcomes:
        check_outcome(outcome, solo.expected(prompt, outcome.spec), f"{where}; {outcome.spec.describe(seed)}")
    assert _value(metrics, "specloop_num_preemptions_total") >= 3, f"{where}: too few preemptions"
    finished = {r: _value(metrics, "specloop_requests_finished_total", f'{{finish_reason="{r}"}}')
                for r in ("length", "stop", "abort", "error")}
    total = sum(finished.values())
    assert client.choices_sent - client.choices_cancelled <= total <= client.choices_sent, f"{where}: {finished}"
    assert finished["error"] == 0, f"{where}: {finished}"
    completed = sum(o.reason in FINAL for o, _ in client.outcomes)
    left = [o for o, _ in client.outcomes if o.aborted]
    assert completed <= finished["length"] + finished["stop"], f"{where}: {finished}, {completed} completed"
    assert 1 <= finished["abort"] <= len(left), f"{where}: {finished['abort']} aborts, {len(left)} clients left"


def _schedule(mode: str, seed: int, n: int) -> tuple[list[str | list[int]], list[Spec]]:
    """The prompt pool of `mode` (so runs of one mode share solo runs) and a schedule from `seed`."""
    prompts: list[str | list[int]] = [*TEXTS, *random_prompts(SEEDS[mode], 5, VOCAB, (1, 8))]
    specs = make_schedule(seed, n, len(prompts), FATES, greedy_max_tokens=GREEDY_MAX_TOKENS,
                          sampled_max_tokens=SAMPLED_MAX_TOKENS, sampled=0.35, spread=0.4)
    return prompts, specs


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
async def test_http_chaos(solo_runs, mode):
    seed = SEEDS[mode]
    options = _options(mode, random.Random(seed))
    where = f"HTTP {mode}, seed {seed}, options {options}"
    model = str(default_model_path())
    prompts, specs = _schedule(mode, seed, REQUESTS)
    engine = AsyncEngine(EngineConfig.from_kwargs(model, **options))
    watch = EngineWatch(engine.core)
    try:
        async with serving(engine) as url:
            client, metrics = await _drive(url, prompts, specs, where)
            await wait_idle(engine, where)
        assert_clean(engine.core, where)
        assert not engine._streams, f"{where}: output streams left: {list(engine._streams)}"
    finally:
        await engine.shutdown()
    _check(client, metrics, solo_runs(model, options, max(GREEDY_MAX_TOKENS)), where, seed)  # solo runs now
    assert _value(metrics, "specloop_num_preemptions_total") == len(watch.victims), where
    assert len(watch.aborted) >= 10, f"{where}: clients left, but the engine aborted {len(watch.aborted)} requests"
    assert len(client.outcomes) >= REQUESTS


async def test_served_process_chaos(solo_runs):
    """The same chaos against a `specloop serve` process (uvloop, the CLI's options), seen only
    from outside: outputs against solo runs, /metrics at rest."""
    mode, seed = PROCESS_MODE, PROCESS_SEED
    options = {**_options(mode, random.Random(SEEDS[mode])), "preemption_mode": policy(mode, turn=0),
               "max_inflight_tickets": EngineConfig.max_inflight_tickets}  # not a serve option: the default
    where = f"specloop serve {mode}, seed {seed}, options {options}"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if k != "max_inflight_tickets"]
    srv = ServerProcess(["--model", str(default_model_path()), "--served-model-name", NAME, "--log-level",
                         "warning", *flags], env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        prompts, specs = _schedule(mode, seed, PROCESS_REQUESTS)
        client, metrics = await _drive(srv.url, prompts, specs, where)
    finally:
        assert srv.stop() == 0, srv.output
    _check(client, metrics, solo_runs(str(default_model_path()), options, max(GREEDY_MAX_TOKENS)), where, seed)
    assert _value(metrics, "specloop_engine_alive") == 1, where
