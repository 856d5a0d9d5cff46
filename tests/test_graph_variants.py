"""The bodies of the CUDA graphs' loop passes on the CPU (Triton interpreter), with sparse
decode attention's graph variants split by part (`sparse_decode/batch.SPLIT_GRAPHS`).

`LoopGraphs` needs CUDA; this stands in for it: a pass that fits a bucket runs the body a
graph of that bucket and variant would have captured (the pass block copied into a padded
block of fixed layout, `ForwardBatchBuilder.graph_view` with the variant's key, padding
hidden rows holding stale values, `torch.empty_like` filled with NaN so that a read of
unwritten memory shows), instead of a replay. The tokens and logprobs must be the
FlashLoop reference's, and the replays per variant what the split promises: token
pipelines replay every variant ("both" for passes holding sources and corrections).
What this cannot check, the capture itself, the GPU runs (`PART=sparse-split` of
bench/gpu_suite.sh)."""

from __future__ import annotations

import collections

import pytest
import torch

from specloop.flashloop.sparse_decode import batch as sparse_batch
from specloop.runtime.graphs import DEFAULT_BUCKETS
from tests.engine_runs import MODES
from tests.test_sparse_decode_engine import INTERPRETED, PROMPTS, _check, _engine, _run


class EmulatedGraphs:
    """`LoopGraphs`' interface (fits, load_tables, replay and its counters), running each
    replay's graph body eagerly over the bucket's fixed buffers."""

    def __init__(self, engine, num_sms: int) -> None:
        runner = engine.executor.runner
        self.batches = runner.batches
        self.tile_rows = self.batches.tile_rows[0]
        self.tables = torch.zeros(self.batches.max_tables + 1, dtype=torch.long)
        self.tables[self.batches.pad_table] = engine.kv.num_pages
        self.run_pass = runner.run_pass
        self.max_context = engine.max_model_len
        kv = runner.backend.kv
        self.splits = {b: kv.splits(b, runner.backend.num_kv_heads, self.max_context, num_sms)
                       for b in self.batches.buckets}
        hidden = runner.slots.hidden
        self.graphs = {}
        for b in self.batches.buckets:
            for variant in self.batches.variants:
                layout = self.batches.graph_layout(b, runner.adaptive_exit)
                self.graphs[b, variant] = (layout, self.batches.pad_block(layout),
                                           torch.zeros(b, hidden.shape[1], dtype=hidden.dtype))
        self.replays = self.sparse_replays = 0
        self.variant_replays: collections.Counter = collections.Counter()

    def fits(self, lp) -> bool:
        return (not lp.contiguous and (lp.bucket, self.batches.variant_of(lp)) in self.graphs
                and lp.tile_rows == self.tile_rows)

    def load_tables(self, tables: torch.Tensor) -> None:
        self.tables[: tables.numel()].copy_(tables)

    def replay(self, lp, hidden: torch.Tensor) -> torch.Tensor:
        variant = self.batches.variant_of(lp)
        layout, block, graph_hidden = self.graphs[lp.bucket, variant]
        block.copy_(lp.block)
        graph_hidden.normal_()  # padding rows hold whatever the last replay left
        graph_hidden[: lp.num_rows].copy_(hidden)
        view = self.batches.graph_view(layout, block, self.tables, variant, self.splits[lp.bucket], self.max_context)
        out = self.run_pass(view, graph_hidden)
        self.replays += 1
        self.sparse_replays += variant is not None
        self.variant_replays[variant] += 1
        return out[: lp.num_rows]


@pytest.fixture
def nan_empty(monkeypatch):
    """Fresh float buffers hold NaN: a read of memory no kernel wrote poisons the output."""
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t
    monkeypatch.setattr(torch, "empty_like", poisoned)


@pytest.mark.parametrize("mode", ["pipeline-d1"])  # its passes hold sources, corrections and both (plain: 13 s more)
def test_split_graph_variants_match_the_reference(tiny_ckpt, mode, monkeypatch, nan_empty):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sparse_batch, "SPLIT_GRAPHS", True)
    engine = _engine(tiny_ckpt, attention_backend="triton", enforce_eager=True, **MODES[mode])
    engine.executor.runner.batches.buckets = DEFAULT_BUCKETS[:6]
    graphs = EmulatedGraphs(engine, num_sms=4)
    engine.executor.runner.graphs = graphs
    prompts = PROMPTS[:2]
    got = _run(engine, prompts, INTERPRETED)
    replays = graphs.variant_replays
    assert replays["sources"] and replays["corrections"]
    assert (replays["both"] > 0) == (mode == "pipeline-d1")  # a pipeline's pass holds both kinds of rows
    _check(tiny_ckpt, got, prompts, max_tokens=INTERPRETED.max_tokens)
