"""Server process lifecycle: overload (503 + Retry-After, then recovery), shutdown with
requests in flight (exit 0), the shipped default model, and a bad --model."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from server.testing import ServerProcess

LONG = {"prompt": list(range(10, 20)), "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}
THREADS_1 = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    """One running request at a time and a waiting queue of one: the third request overflows."""
    srv = ServerProcess(["--model", str(tiny_ckpt), "--device", "cpu", "--max-num-seqs", "1",
                         "--max-waiting-requests", "1", "--shutdown-timeout", "0.5", "--log-level", "warning"],
                        env=THREADS_1)
    srv.start()
    yield srv
    srv.kill()


async def wait_for(client: httpx.AsyncClient, running: int, waiting: int) -> None:
    for _ in range(400):
        text = (await client.get("/metrics")).text
        if (f"specloop_num_requests_running {running}.0" in text
                and f"specloop_num_requests_waiting {waiting}.0" in text):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never reached running={running} waiting={waiting}:\n{text}")


async def first_chunk(client: httpx.AsyncClient, stack: AsyncExitStack, body: dict) -> AsyncIterator[str]:
    """Open a stream, read its first event, and leave it open (closed by `stack`).

    The caller keeps the returned line iterator: once garbage-collected it closes the
    connection, which the server (rightly) takes as the client leaving.
    """
    response = await stack.enter_async_context(client.stream("POST", "/v1/completions", json=body))
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return lines
    raise AssertionError("the stream ended before its first event")


async def test_overload_gets_503_then_recovers(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async with AsyncExitStack() as stack_a:
            lines_a = await first_chunk(client, stack_a, LONG)
            await wait_for(client, running=1, waiting=0)
            async with AsyncExitStack() as stack_b:
                waiter = asyncio.create_task(first_chunk(client, stack_b, LONG))
                await wait_for(client, running=1, waiting=1)
                for stream in (False, True):
                    refused = await client.post("/v1/completions", json={**LONG, "stream": stream})
                    assert refused.status_code == 503
                    assert refused.headers["retry-after"] == "1"
                    error = refused.json()["error"]
                    assert error["code"] == "queue_full" and error["type"] == "overloaded_error"
                    assert "waiting queue is full" in error["message"]
                waiter.cancel()  # B leaves before its first token: it leaves the queue
                await asyncio.gather(waiter, return_exceptions=True)
            await wait_for(client, running=1, waiting=0)
            async with AsyncExitStack() as stack_c:
                waiter = asyncio.create_task(first_chunk(client, stack_c, LONG))
                await wait_for(client, running=1, waiting=1)
                await stack_a.aclose()  # A leaves: C is admitted and streams
                lines_c = await asyncio.wait_for(waiter, 30)
                del lines_a, lines_c
        await wait_for(client, running=0, waiting=0)
        ok = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
        text = (await client.get("/metrics")).text
        assert 'specloop_request_errors_total{status="503"} 2.0' in text
        assert 'specloop_kv_cache_used_bytes 0.0' in text


def test_sigterm_with_a_stream_in_flight_aborts_it_and_exits_0(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "return_token_ids": True}) as response:
            events = []
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    server.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "abort"
        assert len(events) - 2 < LONG["max_tokens"]
    assert server.stop(timeout=30) == 0, server.output
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def test_serve_without_model_serves_the_shipped_model():
    srv = ServerProcess(["--device", "cpu", "--log-level", "warning"], env=THREADS_1)
    with srv:
        assert "serving model 'specloop-default'" in srv.output
        models = httpx.get(srv.url + "/v1/models").json()
        assert models["data"][0]["id"] == "specloop-default"
        reply = httpx.post(srv.url + "/v1/completions",
                           json={"model": "specloop-default", "prompt": "import os\n", "max_tokens": 4, "temperature": 0},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    assert srv.returncode == 0, srv.output


def test_bad_model_exits_2_with_one_error_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "server", "--model", str(tmp_path / "nothing"), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in done.stderr
