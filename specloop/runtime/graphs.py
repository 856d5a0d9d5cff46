"""CUDA graphs of one loop pass, for a ladder of row-count buckets.

A forward call's loop is thousands of small kernels; on the H200 host (9-12 us per eager
op) launching them costs more than running them at small batches. Each bucket b gets one
graph of a whole loop pass over b rows (every layer with its attention, the end-of-loop
norm, adaptive exit with LAST_EXITED inheritance, the slot-storage writes), captured at
start-up over stable-address inputs:

- a pass block in the `PassLayout` of b rows (positions, depths, token slots, page-table
  offsets, query tiles, planes, then each batch part's fixed columns: with INT4 residuals
  the rows' request cells and the pass's cells with their planes' tables, with sparse
  decode attention the rows' roles), which a replay fills with one device copy of the block
  the forward batch uploaded (padding rows included: they name the pad token slot, the pad
  table entry, whose page is a sink, and the pad cell, and tiles of 0 rows, so they write
  only sinks);
- the page tables, copied once per call into a buffer whose last entry is the sink page;
- the pass's input hidden rows.

Nothing batch-specific is a constant of the graph: sizes come from the bucket, values from
the buffers, and split-KV is fixed per bucket (the kernel splits the keys it finds). With
INT4 residuals the pass's appends, its encoding plan (a fixed number of candidate groups
per cell and plane, every plane: `ResidualBatch.graph_shape`), the per-layer
encoding and the packed reader are captured too; padding cells' candidates are never
ready, so they encode into the sink record only.
A batch part may ask for variant graphs per bucket, each replayed by the passes whose
variant note has its key (`BatchPart.variant`, `variant_keys`, `variant_key`). Sparse
decode attention's are for passes with generated-token rows: by default one ("both"),
and with its `SPLIT_GRAPHS` (off until it has run on a GPU) one for passes whose
generated rows are all sources (depth 1), one for all corrections (depth 2 and deeper)
and one for both (speculation, token pipelines). Each runs the steps its key names over
every row of the bucket, the block's roles column saying which rows play which part
(`SparseRows`), the correction rows' fallback tiles from the block, the scores scratch at
its fixed address, and the state in the decode slots (a padding row's part is none, so it
writes nothing). Split, a batch-1 decode's loop 2 is a source pass and its loops 3-4
correction passes, so none of them launches the other step's kernels over rows that play
no part.
Passes whose groups need the kernel's large tiles (prompt chunks) or more rows than the
largest bucket run eager, as do the heads and sampling.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Hashable

import torch

from specloop.runtime.forward_batch import ForwardBatchBuilder, LoopPass, PassLayout
from specloop.runtime.kv_format import PagedKV

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class _Graph:
    def __init__(self, layout: PassLayout, block: torch.Tensor, hidden: torch.Tensor, variant: Hashable | None) -> None:
        self.layout = layout
        self.variant = variant  # a batch part's variant key (sparse decode rows' parts), None: no variant note
        self.block = block
        self.hidden = hidden
        self.out: torch.Tensor | None = None
        self.graph = torch.cuda.CUDAGraph()


class LoopGraphs:
    """Captures and replays loop passes; `run_pass(lp, hidden)` is the eager body it captures."""

    def __init__(self, run_pass: Callable[[LoopPass, torch.Tensor], torch.Tensor], batches: ForwardBatchBuilder,
                 hidden_size: int, dtype: torch.dtype, adaptive_exit: bool, num_kv_heads: int, max_context: int,
                 sink_page: int, device: torch.device, kv: PagedKV) -> None:
        """One graph per bucket of `batches` (whose passes it replays: their layouts and the
        small query tiles are the builder's); `kv`: the KV format (its split-KV per bucket)."""
        self.run_pass = run_pass
        self.batches = batches
        self.buckets = batches.buckets
        self.tile_rows = batches.tile_rows[0]
        self.page_size = batches.page_size
        self.device = device
        self.tables = torch.zeros(batches.max_tables + 1, dtype=torch.long, device=device)
        self.tables[batches.pad_table] = sink_page  # the pad table entry
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.splits = {b: kv.splits(b, num_kv_heads, max_context, sms) for b in self.buckets}
        self.max_context = max_context
        # Per (bucket, the pass's variant: None or a batch part's key, sparse decode rows'
        # parts): passes without them (loop 1, prompts) skip that work, and passes with them
        # the work of parts they have no rows for, which a graph would otherwise launch over
        # rows playing no part. With INT4 residuals the sparse decode kernels read the packed
        # planes in place (no transient), so those passes capture too.
        self.variants = batches.variants
        self.graphs: dict[tuple[int, Hashable | None], _Graph] = {}
        self._hidden_size, self._dtype, self._adaptive_exit = hidden_size, dtype, adaptive_exit
        self.replays = 0  # passes run through a graph (tests count them)
        self.sparse_replays = 0  # ... of them, through a variant graph (sparse decode attention's rows)
        self.variant_replays: collections.Counter = collections.Counter()  # ... per variant key

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool; logs time and memory."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b, variant in [(b, v) for b in sorted(self.buckets, reverse=True) for v in self.variants]:
            layout = self.batches.graph_layout(b, self._adaptive_exit)
            g = _Graph(layout, self.batches.pad_block(layout),
                       torch.zeros(b, self._hidden_size, dtype=self._dtype, device=self.device), variant)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                for _ in range(2):
                    self._body(g)
            torch.cuda.current_stream(self.device).wait_stream(side)
            with torch.cuda.graph(g.graph, pool=pool):
                g.out = self._body(g)
            self.graphs[b, variant] = g
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs of a loop pass (buckets %s rows%s) in %.2f s, %.0f MiB of graph memory",
                 len(self.graphs), ",".join(map(str, self.buckets)),
                 f", {len(self.variants)} variants each (sparse decode rows' parts)" if len(self.variants) > 1 else "",
                 time.perf_counter() - start,
                 (torch.cuda.memory_reserved(self.device) - before) / 2**20)

    def _body(self, g: _Graph) -> torch.Tensor:
        b = g.layout.bucket
        lp = self.batches.graph_view(g.layout, g.block, self.tables, g.variant, self.splits[b], self.max_context)
        return self.run_pass(lp, g.hidden)

    def fits(self, lp: LoopPass) -> bool:
        """A pass replays when its rows fill a captured bucket, its tiles are the small ones
        and no prompt chunk goes without tiles (the builder gave such a pass the graph's
        layout: `ForwardBatchBuilder.build`)."""
        return (not lp.contiguous and (lp.bucket, self.batches.variant_of(lp)) in self.graphs
                and lp.tile_rows == self.tile_rows)

    def load_tables(self, tables: torch.Tensor) -> None:
        """The call's page tables into the graphs' table buffer (once per call)."""
        self.tables[: tables.numel()].copy_(tables)

    def replay(self, lp: LoopPass, hidden: torch.Tensor) -> torch.Tensor:
        """Run pass `lp` through its bucket's graph; returns a view of the graph's output
        (valid until the next replay of that bucket: stream order protects readers enqueued
        before it)."""
        g = self.graphs[lp.bucket, self.batches.variant_of(lp)]
        g.block.copy_(lp.block)
        g.hidden[: lp.num_rows].copy_(hidden)
        g.graph.replay()
        self.replays += 1
        self.sparse_replays += g.variant is not None
        self.variant_replays[g.variant] += 1
        return g.out[: lp.num_rows]
