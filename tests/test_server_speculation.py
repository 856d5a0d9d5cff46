"""Speculating servers under concurrent streaming load give the plain greedy tokens."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from server.testing import ServerProcess
from specloop.assets import default_model_path
from specloop.sampling_params import SamplingParams
from specloop.llm import LLM
from tests.test_server import stream_events

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "    return self._", "x = [", "# Copyright", "def main():\n    parser = argparse."]


def plain_greedy(**engine_options) -> list[list[int]]:
    """The shipped model's 16 greedy tokens for each of PROMPTS, in process (fp64, one thread)."""
    llm = LLM(device="cpu", dtype="float64", **engine_options)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def expected():
    return plain_greedy()


async def serve_streams(args: list[str], after=None) -> tuple[list[list], str]:
    """16 concurrent greedy streams of PROMPTS through a server of the shipped model started
    with `args`; each stream's events and the /metrics text after them (the server must exit 0).
    `after(client)`: awaited after the streams, before /metrics."""
    srv = ServerProcess(["--model", str(default_model_path()), "--device", "cpu", "--dtype", "float64",
                         "--log-level", "warning", *args], env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            results = await asyncio.gather(*(stream_events(client, "/v1/completions", {**body, "prompt": PROMPTS[i % 8]})
                                             for i in range(16)))
            if after is not None:
                await after(client)
            metrics = (await client.get("/metrics")).text
    finally:
        assert srv.stop() == 0, srv.output
    return results, metrics


def assert_plain_greedy(results: list[list], expected: list[list[int]]) -> None:
    for i, events in enumerate(results):
        assert events[-1] == "[DONE]"
        tokens = [t for chunk in events[:-1] for c in chunk["choices"] for t in c["token_ids"]]
        assert tokens == expected[i % 8], f"stream {i}"


@pytest.mark.parametrize("spec", [["--speculation", "pipeline", "--draft-loops", "1"],
                                  ["--speculation", "block", "--num-speculative-tokens", "4"]])
async def test_concurrent_streams_under_speculation(expected, spec):
    results, metrics = await serve_streams(spec)
    assert_plain_greedy(results, expected)
    drafts = [line for line in metrics.splitlines() if line.startswith("specloop_spec_decode_num_drafts")]
    assert drafts and float(drafts[0].split()[-1]) > 0
