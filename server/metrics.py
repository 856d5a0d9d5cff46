"""Prometheus metrics of one server, in a registry of its own (several apps can live in one
process, as in tests).

Latencies are measured in the server from the timing of each request's output stream:

- time to first token: request arrival to the first output that carries a token;
- inter-token latency: the gap between two outputs divided by the tokens the later one
  carries, recorded once per token (so speculation, which delivers several tokens at once,
  is counted per token);
- end-to-end latency: request arrival to its final output (or to the client leaving).

The engine gauges are read from `AsyncEngine.stats()` (the last snapshot the engine thread
published) at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specloop.engine.async_engine import AsyncEngine
from specloop.engine.request import RequestOutput, Usage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("specloop_time_to_first_token_seconds", "Request arrival to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specloop_inter_token_latency_seconds", "Gap between consecutive tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specloop_e2e_request_latency_seconds", "Request arrival to its last output.",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specloop_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("specloop_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("specloop_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("specloop_request_errors", "Requests answered with an error, by status.",
                              ["status"], registry=r)
        r.register(_EngineCollector(engine))

    def track(self) -> "RequestTimer":
        """Start timing one engine request (one choice) now."""
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._start = self._last = time.perf_counter()
        self._first_seen = False
        self._usage: Usage | None = None
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.token_ids:
            if not self._first_seen:
                self._m.ttft.observe(now - self._start)
                self._first_seen = True
            else:
                gap = (now - self._last) / len(out.token_ids)
                for _ in out.token_ids:
                    self._m.itl.observe(gap)
            self._last = now
        self._usage = out.usage
        if out.finished:
            self._finish(out.finish_reason or "abort", now)

    def close(self) -> None:
        """The request ended without a final output (client gone, engine failure): an abort."""
        if not self._done:
            self._finish("abort", time.perf_counter())

    def _finish(self, reason: str, now: float) -> None:
        self._done = True
        self._m.e2e.observe(now - self._start)
        self._m.finished.labels(reason).inc()
        if self._usage is not None:
            self._m.prompt_tokens.inc(self._usage.prompt_tokens)
            self._m.generation_tokens.inc(self._usage.completion_tokens)


class _EngineCollector(Collector):
    """Scheduler and KV gauges, and speculation counters, from the engine's last published stats."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        yield GaugeMetricFamily("specloop_num_requests_running", "Requests being computed.", s.running)
        yield GaugeMetricFamily("specloop_num_requests_waiting", "Requests in the waiting queue.", s.waiting)
        yield GaugeMetricFamily("specloop_kv_cache_usage_ratio", "KV pages held or reserved / all pages.",
                                s.kv_usage)
        yield GaugeMetricFamily("specloop_kv_cache_used_bytes", "Bytes of KV pages held.", s.kv_bytes_used)
        yield GaugeMetricFamily("specloop_kv_cache_pages", "KV pages in the pool.", s.num_kv_pages)
        yield GaugeMetricFamily("specloop_engine_alive", "1 while the engine serves, 0 once it stopped.",
                                1.0 if self._engine.is_alive else 0.0)
        yield CounterMetricFamily("specloop_spec_decode_num_drafts", "Speculation rounds committed.", s.num_drafts)
        yield CounterMetricFamily("specloop_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                  s.num_draft_tokens)
        yield CounterMetricFamily("specloop_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                  s.num_accepted_tokens)
        per_position = CounterMetricFamily("specloop_spec_decode_num_accepted_tokens_per_pos",
                                           "Rounds whose draft at this position was accepted.", labels=["position"])
        for position, count in enumerate(s.accepted_per_position):
            per_position.add_metric([str(position)], count)
        yield per_position
