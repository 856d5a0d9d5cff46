"""A server with token-sparse prefill: concurrent streams give the tokens the engine gives
with the same configuration, /version shows the effective group, and /metrics counts the
prompt token-loops it left out."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_server_speculation import assert_plain_greedy, plain_greedy, serve_streams

GROUP = {"window": 4, "retention": [1, 1, 0.25, 0.1]}


@pytest.fixture(scope="module")
def expected_sparse():
    return plain_greedy(token_sparse_prefill=GROUP)


async def test_streams_with_token_sparse_prefill(expected_sparse):
    seen = {}

    async def version(client: httpx.AsyncClient) -> None:
        seen["version"] = (await client.get("/version")).json()

    results, metrics = await serve_streams(["--token-sparse-prefill", json.dumps(GROUP)], after=version)
    assert_plain_greedy(results, expected_sparse)
    assert seen["version"]["engine"]["token_sparse_prefill"] == {"enabled": True, "keep_last": False, **GROUP}
    skipped = [line for line in metrics.splitlines() if line.startswith("specloop_prefill_rows_skipped_total")]
    assert skipped and float(skipped[0].split()[-1]) > 0
