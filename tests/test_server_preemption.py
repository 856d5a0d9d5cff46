"""A server whose KV pool holds a fraction of the offered load: requests are preempted,
resume by recompute, and every stream still gets the plain greedy tokens; the preemption
counter shows in /metrics under both namings."""

from __future__ import annotations

import asyncio

import httpx

from server.testing import ServerProcess
from specloop.assets import default_model_path
from tests.test_server import stream_events
from tests.test_server_speculation import PROMPTS, expected  # noqa: F401  (the fixture)


def _counter(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(name)]
    assert lines, f"{name} is not in /metrics"
    return float(lines[0].split()[-1])


async def test_streams_survive_preemption(expected):  # noqa: F811
    # 40 pages of 4 positions over 4 planes: 40 positions per plane, against 16 requests of
    # up to 26 positions each.
    srv = ServerProcess(["--model", str(default_model_path()), "--device", "cpu", "--dtype", "float64",
                         "--block-size", "4", "--num-kv-pages", "40", "--preemption-mode", "recompute",
                         "--log-level", "warning"], env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            results = await asyncio.gather(*(stream_events(client, "/v1/completions", {**body, "prompt": PROMPTS[i % 8]})
                                             for i in range(16)))
            metrics = (await client.get("/metrics")).text
    finally:
        assert srv.stop() == 0, srv.output
    for i, events in enumerate(results):
        assert events[-1] == "[DONE]"
        tokens = [t for chunk in events[:-1] for c in chunk["choices"] for t in c["token_ids"]]
        assert tokens == expected[i % 8], f"stream {i}"
    preemptions = _counter(metrics, "specloop_num_preemptions_total")
    assert preemptions > 0
    assert _counter(metrics, "vllm:num_preemptions_total") == preemptions
    assert _counter(metrics, "specloop_num_requests_running") == 0
