"""The replicas' statistics as one `EngineStats`, so the server's metrics read N replicas as one engine.

Counters add up over every replica, a dead one's last values included: a Prometheus
counter must never go down, and what a replica did before it died was done. Gauges (what
is running, waiting, held now) add up over the live replicas only: a dead replica holds
nothing any more, and its pages leave the pool. KV usage is the live pool's: pages held
over pages there are, so a replica with a larger pool weighs more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specloop.engine.core import EngineStats

GAUGES = ("running", "waiting", "kv_bytes_used", "num_kv_pages", "kv_record_bytes_used", "kv_records_free",
          "sparse_decode_reference_bytes")
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_preemptions", "prefill_rows_skipped",
            "sparse_decode_fallbacks", "iteration_tokens_sum", "prefix_cache_queries", "prefix_cache_hits")
# Merged by their own rules below; the FlashLoop groups are configuration, the same on every replica.
OTHERS = ("kv_usage", "kv_bytes_per_request", "accepted_per_position", "iteration_tokens", "token_sparse_prefill",
          "kv_residual_quantization", "sparse_decode_attention")


def merge_stats(replicas: Sequence[tuple[bool, EngineStats]]) -> EngineStats:
    """One engine's statistics from the replicas' `(alive, last published stats)`, in replica order."""
    live = [stats for alive, stats in replicas if alive]
    every = [stats for _, stats in replicas]
    pages = sum(s.num_kv_pages for s in live)
    first = every[0]
    merged = {name: sum(getattr(s, name) for s in live) for name in GAUGES}
    merged |= {name: sum(getattr(s, name) for s in every) for name in COUNTERS}
    return dataclasses.replace(
        first, **merged,
        kv_usage=sum(s.kv_usage * s.num_kv_pages for s in live) / pages if pages else 0.0,
        kv_bytes_per_request={rid: b for s in live for rid, b in s.kv_bytes_per_request.items()},
        accepted_per_position=_add_columns([s.accepted_per_position for s in every]),
        iteration_tokens=_add_buckets([s.iteration_tokens for s in every]))


def _add_columns(rows: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    width = max((len(row) for row in rows), default=0)
    return tuple(sum(row[i] for row in rows if i < len(row)) for i in range(width))


def _add_buckets(histograms: Sequence[tuple[tuple[float, int], ...]]) -> tuple[tuple[float, int], ...]:
    """Cumulative histograms with the same bounds (one configuration), added bucket by bucket."""
    counts: dict[float, int] = {}
    for histogram in histograms:
        for bound, count in histogram:
            counts[bound] = counts.get(bound, 0) + count
    return tuple(sorted(counts.items()))
