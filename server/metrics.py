"""Prometheus metrics of one server, in a registry of its own (several apps can live in one
process, as in tests).

Latencies are measured in the server from the timing of each request's output stream:

- time to first token: request arrival to the first output that carries a token;
- inter-token latency: the gap between two outputs divided by the tokens the later one
  carries, recorded once per token (so speculation, which delivers several tokens at once,
  is counted per token);
- end-to-end latency: request arrival to its final output (or to the client leaving);
- time per output token: from a request's first token to its last, divided by the tokens
  after the first (requests with two tokens or more);
- queue time: from the engine's add to the request's first admission (the engine measures
  it and hands it over on the final output).

At its end a request also records its prompt and generated token counts (histograms).
`vllm:request_success_total{finished_reason}` counts requests that finished (stop, length),
as vLLM does; aborted and failed ones are in `specloop_requests_finished_total` only.

Only requests the engine accepted are timed and counted as finished: a request refused
before that (400, 413, 503...) is counted once in `specloop_request_errors_total{status}`
and nowhere else. A request that failed inside the engine finishes with reason "error".

The engine gauges, and the tokens each forward call took in (`iteration_tokens`), are read
from the engine's `stats()` (the last snapshot the engine thread published; with data
parallelism, the replicas' merged) at scrape time. Beside our `specloop_*` series the same values are offered under
vLLM's names (`vllm:*`, label `model_name` = the served name), so dashboards built for vLLM
work unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                   Metric)
from prometheus_client.registry import Collector

from specloop.engine.core import EngineStats
from specloop.engine.data_parallel.engine import DataParallelEngine
from specloop.engine.serving import ServingEngine
from specloop.scheduling.request import RequestOutput, Usage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)
SUCCESS_REASONS = ("stop", "length")  # finished by the model or max_tokens; abort and error are not successes


def token_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length `limit`, which closes them."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= limit:
                return (*bounds, limit)
            bounds.append(step * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, engine: ServingEngine, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.ttft = Histogram("specloop_time_to_first_token_seconds", "Request arrival to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specloop_inter_token_latency_seconds", "Gap between consecutive tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specloop_e2e_request_latency_seconds", "Request arrival to its last output.",
                             buckets=E2E_BUCKETS, registry=r)
        self.tpot = Histogram("specloop_time_per_output_token_seconds", "A request's first token to its last, "
                              "per token after the first.", buckets=ITL_BUCKETS, registry=r)
        self.queue = Histogram("specloop_request_queue_time_seconds", "A request's wait in the queue before its "
                               "first admission.", buckets=E2E_BUCKETS, registry=r)
        tokens = token_buckets(engine.limits()[0])
        self.request_prompt = Histogram("specloop_request_prompt_tokens", "Prompt tokens per ended request.",
                                        buckets=tokens, registry=r)
        self.request_generation = Histogram("specloop_request_generation_tokens", "Generated tokens per ended "
                                            "request.", buckets=tokens, registry=r)
        self.prompt_tokens = Counter("specloop_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("specloop_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("specloop_requests_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("specloop_request_errors", "Requests answered with an error, by status.",
                              ["status"], registry=r)
        self._vllm_series(model_name, tokens)
        r.register(_EngineCollector(engine, model_name))
        if isinstance(engine, DataParallelEngine):
            r.register(_ReplicaCollector(engine))

    def _vllm_series(self, name: str, tokens: tuple[int, ...]) -> None:
        """vLLM's names for the series above, each labelled with the served model."""
        r, label = self.registry, ["model_name"]
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", label,
                                   buckets=TTFT_BUCKETS, registry=r).labels(name)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", label,
                                  buckets=ITL_BUCKETS, registry=r).labels(name)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                                  label, buckets=E2E_BUCKETS, registry=r).labels(name)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", label,
                                          registry=r).labels(name)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", label,
                                              registry=r).labels(name)
        self.vllm_success = Counter("vllm:request_success", "Finished requests (stop, length) by finish reason.",
                                    ["model_name", "finished_reason"], registry=r)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds.", label,
                                   buckets=ITL_BUCKETS, registry=r).labels(name)
        self.vllm_queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue in seconds.",
                                    label, buckets=E2E_BUCKETS, registry=r).labels(name)
        self.vllm_request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", label,
                                             buckets=tokens, registry=r).labels(name)
        self.vllm_request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                                 label, buckets=tokens, registry=r).labels(name)

    def track(self, start: float | None = None) -> "RequestTimer":
        """Time one accepted engine request (one choice) from `start` (perf_counter; default now)."""
        return RequestTimer(self, start)

    def count_error(self, status: int) -> None:
        """One error response (call once per response)."""
        self.errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    def __init__(self, metrics: ServerMetrics, start: float | None = None) -> None:
        self._m = metrics
        self._start = self._last = time.perf_counter() if start is None else start
        self._first_seen = False
        self._first = 0.0  # when the first token came
        self._usage: Usage | None = None
        self._queue_time: float | None = None
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.token_ids:
            if not self._first_seen:
                self._m.ttft.observe(now - self._start)
                self._m.vllm_ttft.observe(now - self._start)
                self._first_seen, self._first = True, now
            else:
                gap = (now - self._last) / len(out.token_ids)
                for _ in out.token_ids:
                    self._m.itl.observe(gap)
                    self._m.vllm_itl.observe(gap)
            self._last = now
        self._usage = out.usage
        if out.finished:
            self._queue_time = out.queue_time
            self._finish(out.finish_reason or "abort", now)

    def close(self, reason: str = "abort") -> None:
        """The request ended without a final output: "abort" (client gone, shutdown) or "error"."""
        if not self._done:
            self._finish(reason, time.perf_counter())

    def _finish(self, reason: str, now: float) -> None:
        m = self._m
        self._done = True
        m.e2e.observe(now - self._start)
        m.vllm_e2e.observe(now - self._start)
        m.finished.labels(reason).inc()
        if reason in SUCCESS_REASONS:
            m.vllm_success.labels(m.model_name, reason).inc()
        if self._queue_time is not None:
            m.queue.observe(self._queue_time)
            m.vllm_queue.observe(self._queue_time)
        usage = self._usage
        if usage is None:
            return
        for total, histogram, value in ((m.prompt_tokens, m.request_prompt, usage.prompt_tokens),
                                        (m.vllm_prompt_tokens, m.vllm_request_prompt, usage.prompt_tokens),
                                        (m.generation_tokens, m.request_generation, usage.completion_tokens),
                                        (m.vllm_generation_tokens, m.vllm_request_generation,
                                         usage.completion_tokens)):
            total.inc(value)
            histogram.observe(value)
        if usage.completion_tokens > 1 and self._first_seen:
            tpot = (self._last - self._first) / (usage.completion_tokens - 1)
            m.tpot.observe(tpot)
            m.vllm_tpot.observe(tpot)


class _EngineCollector(Collector):
    """Scheduler and KV gauges, and speculation counters, from the engine's last published stats."""

    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name
        config, resolved = engine.config, engine.resolved
        self._cache_config = {"block_size": str(config.block_size), "num_gpu_blocks": str(resolved.num_kv_pages),
                              "gpu_memory_utilization": str(config.gpu_memory_utilization),
                              "cache_dtype": resolved.dtype, "model_name": model_name,
                              "enable_prefix_caching": str(resolved.prefix_caching)}

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()  # one snapshot for both namings
        yield from self._ours(s)
        yield from self._vllm(s)

    def _ours(self, s: EngineStats) -> Iterator[Metric]:
        yield GaugeMetricFamily("specloop_num_requests_running", "Requests being computed.", s.running)
        yield GaugeMetricFamily("specloop_num_requests_waiting", "Requests in the waiting queue.", s.waiting)
        yield GaugeMetricFamily("specloop_kv_cache_usage_ratio", "KV pages held or reserved / all pages.",
                                s.kv_usage)
        yield GaugeMetricFamily("specloop_kv_cache_used_bytes", "Bytes of KV pages (and INT4 residual records) held.", s.kv_bytes_used)
        yield GaugeMetricFamily("specloop_kv_cache_pages", "KV pages in the pool.", s.num_kv_pages)
        yield GaugeMetricFamily("specloop_kv_residual_record_bytes", "Bytes of INT4 residual group records held "
                                "(kv_residual_quantization; part of specloop_kv_cache_used_bytes).",
                                s.kv_record_bytes_used)
        yield GaugeMetricFamily("specloop_kv_residual_records_free", "INT4 residual group records free.",
                                s.kv_records_free)
        yield GaugeMetricFamily("specloop_engine_alive", "1 while the engine serves, 0 once it stopped.",
                                1.0 if self._engine.is_alive else 0.0)
        yield CounterMetricFamily("specloop_num_preemptions", "Running requests preempted (KV pages ran out).",
                                  s.num_preemptions)
        yield CounterMetricFamily("specloop_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                  "at admission (enable_prefix_caching).", s.prefix_cache_queries)
        yield CounterMetricFamily("specloop_prefix_cache_hits", "Prompt tokens found in the prefix cache (their "
                                  "rows are not computed at any depth).", s.prefix_cache_hits)
        yield CounterMetricFamily("specloop_prefill_rows_skipped", "Prompt token-loops that token-sparse prefill "
                                  "planned to leave out (the token keeps its previous state).",
                                  s.prefill_rows_skipped)
        yield CounterMetricFamily("specloop_sparse_decode_fallbacks", "Generated-token rows at loops 3+ that found "
                                  "no loop-2 reference state and attended densely (sparse_decode_attention).",
                                  s.sparse_decode_fallbacks)
        yield GaugeMetricFamily("specloop_sparse_decode_reference_bytes", "Device bytes of the decode slots' "
                                "loop-2 reference state (sparse_decode_attention).", s.sparse_decode_reference_bytes)
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
        yield _iteration_tokens("specloop_iteration_tokens", [], [], s)

    def _vllm(self, s: EngineStats) -> Iterator[Metric]:
        name = [self._model_name]
        for family, kind, doc, value in (
                ("vllm:num_requests_running", GaugeMetricFamily, "Requests being computed.", s.running),
                ("vllm:num_requests_waiting", GaugeMetricFamily, "Requests waiting to be computed.", s.waiting),
                ("vllm:kv_cache_usage_perc", GaugeMetricFamily, "KV-cache usage; 1 means 100 percent.", s.kv_usage),
                ("vllm:num_preemptions", CounterMetricFamily, "Cumulative number of preemptions.", s.num_preemptions),
                ("vllm:prefix_cache_queries", CounterMetricFamily, "Prefix cache queries, in terms of number of "
                 "queried tokens.", s.prefix_cache_queries),
                ("vllm:prefix_cache_hits", CounterMetricFamily, "Prefix cache hits, in terms of number of cached "
                 "tokens.", s.prefix_cache_hits),
                ("vllm:spec_decode_num_drafts", CounterMetricFamily, "Speculation rounds.", s.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", CounterMetricFamily, "Draft tokens.", s.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", CounterMetricFamily, "Accepted draft tokens.",
                 s.num_accepted_tokens)):
            metric = kind(family, doc, labels=["model_name"])
            metric.add_metric(name, value)
            yield metric
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted draft tokens by position.", labels=["model_name", "position"])
        for position, count in enumerate(s.accepted_per_position):
            per_position.add_metric([self._model_name, str(position)], count)
        yield per_position
        yield _iteration_tokens("vllm:iteration_tokens_total", ["model_name"], name, s)
        info = InfoMetricFamily("vllm:cache_config", "The KV cache's configuration.")
        info.add_metric([], self._cache_config)
        yield info


class _ReplicaCollector(Collector):
    """With data parallelism: each replica's state, labelled `replica` (the merged values are above)."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        label = ["replica"]
        alive = GaugeMetricFamily("specloop_replica_alive", "1 while the replica serves, 0 once it died.",
                                  labels=label)
        running = GaugeMetricFamily("specloop_replica_num_requests_running", "Requests being computed by the "
                                    "replica.", labels=label)
        waiting = GaugeMetricFamily("specloop_replica_num_requests_waiting", "Requests in the replica's waiting "
                                    "queue.", labels=label)
        usage = GaugeMetricFamily("specloop_replica_kv_cache_usage_ratio", "The replica's KV pages held or "
                                  "reserved / its pages.", labels=label)
        for replica in self._engine.replicas:
            index, s = [str(replica.index)], replica.stats
            live = replica.alive and s is not None  # a dead replica holds nothing
            alive.add_metric(index, 1.0 if replica.alive else 0.0)
            running.add_metric(index, s.running if live else 0)
            waiting.add_metric(index, s.waiting if live else 0)
            usage.add_metric(index, s.kv_usage if live else 0.0)
        yield from (alive, running, waiting, usage)


def _iteration_tokens(family: str, labels: list[str], values: list[str], s: EngineStats) -> Metric:
    """Tokens entering the loops per forward call (prompt positions, new tokens, drafts)."""
    metric = HistogramMetricFamily(family, "Tokens per engine step.", labels=labels)
    buckets = [("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in s.iteration_tokens]
    metric.add_metric(values, buckets or [("+Inf", 0)], s.iteration_tokens_sum)
    return metric
