"""A server with token-sparse prefill: concurrent streams give the tokens the engine gives
with the same configuration, /version shows the effective group, and /metrics counts the
prompt token-loops it left out."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from specloop.llm import LLM
from specloop.sampling_params import SamplingParams
from tests.test_server_speculation import PROMPTS, assert_plain_greedy, serve_streams

GROUP = {"window": 4, "retention": [1, 1, 0.25, 0.1]}


@pytest.fixture(scope="module")
def expected_sparse():
    llm = LLM(device="cpu", dtype="float64", token_sparse_prefill=GROUP)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    return [o.token_ids for o in outs]


async def test_streams_with_token_sparse_prefill(expected_sparse):
    seen = {}

    async def version(client: httpx.AsyncClient) -> None:
        seen["version"] = (await client.get("/version")).json()

    results, metrics = await serve_streams(["--token-sparse-prefill", json.dumps(GROUP)], after=version)
    assert_plain_greedy(results, expected_sparse)
    assert seen["version"]["engine"]["token_sparse_prefill"] == {"enabled": True, **GROUP}
    skipped = [line for line in metrics.splitlines() if line.startswith("specloop_prefill_rows_skipped_total")]
    assert skipped and float(skipped[0].split()[-1]) > 0
