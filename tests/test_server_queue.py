"""A queued request's streaming response starts (status and headers) before it is admitted."""

from __future__ import annotations

import asyncio

import httpx

from server.testing import ServerProcess
from tests.test_server import metric


async def test_queued_stream_gets_headers_before_admission(tiny_ckpt):
    srv = ServerProcess(["--model", str(tiny_ckpt), "--device", "cpu", "--max-num-seqs", "1",
                         "--log-level", "warning"], env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        body = {"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            first = client.build_request("POST", "/v1/completions", json={**body, "max_tokens": 1500})
            running = await client.send(first, stream=True)  # occupies the only sequence slot
            assert running.status_code == 200
            queued = await client.send(client.build_request("POST", "/v1/completions",
                                                            json={**body, "max_tokens": 4}), stream=True)
            assert queued.status_code == 200  # headers came back...
            text = (await client.get("/metrics")).text
            assert metric(text, "specloop_num_requests_waiting") == 1  # ...while it still waits
            await running.aclose()  # leaving frees the slot; the queued request then runs
            lines = [line async for line in queued.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 2
            await queued.aclose()
    finally:
        assert srv.stop() == 0, srv.output
