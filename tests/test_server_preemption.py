"""A server whose KV pool holds a fraction of the offered load: requests are preempted,
resume by recompute, and every stream still gets the plain greedy tokens; the preemption
counter shows in /metrics under both namings."""

from __future__ import annotations

from tests.test_server_speculation import assert_plain_greedy, expected, serve_streams  # noqa: F401  (the fixture)


def _counter(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(name)]
    assert lines, f"{name} is not in /metrics"
    return float(lines[0].split()[-1])


async def test_streams_survive_preemption(expected):  # noqa: F811
    # 40 pages of 4 positions over 4 planes: 40 positions per plane, against 16 requests of
    # up to 26 positions each.
    results, metrics = await serve_streams(["--block-size", "4", "--num-kv-pages", "40",
                                            "--preemption-mode", "recompute"])
    assert_plain_greedy(results, expected)
    preemptions = _counter(metrics, "specloop_num_preemptions_total")
    assert preemptions > 0
    assert _counter(metrics, "vllm:num_preemptions_total") == preemptions
    assert _counter(metrics, "specloop_num_requests_running") == 0
