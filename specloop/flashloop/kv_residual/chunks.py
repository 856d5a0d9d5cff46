"""Prompt chunks over INT4 residual planes: dequantize once, then one two-source attention.

The packed reader (`specloop.kernels.packed_attention`) decodes every packed key tile again
for each query tile that reads it, which suits decode rows (one query tile) and costs a
prompt chunk its whole context once per 64 queries: an 8K prompt's first token took 3.4 s
against 0.3 s with BF16 pages. A prompt chunk (a group of at least `CHUNK_ROWS` rows, all
at prompt positions) instead has its context [0, C) read once per layer as its last query
reads it (`packed_keys.read_keys`: reconstructed where that query is at or past the key's
seal, exact elsewhere), and attends with `chunk_attention.two_source_attention`: query q
reads key k from that read unless k seals inside the chunk after q (q < seal(k) <= the
last query's position), then exact from the BF16 tail, each causally: exactly what the
reader reads (the read rule, `PackedResiduals.seals`). Only key blocks holding such keys
load tail slots, so the rest is one contiguous read as in a dense prefill. The seals depend
on the pass only (the pass's seals are set before its first layer), so they are gathered
once per pass and chunk. The chunks of a pass (a wavefront has one per depth) have their
contexts read by one `read_keys` launch and attend in one two-source launch (`ChunkBatch`,
up to `BATCH_KEYS` rows x keys), since the prefill of INT4 is bound by host launches
(docs/flashloop.md).

Until 2026-12-06 the chunk attended in one masked scaled-dot-product attention over both
versions of its whole context (2C keys, a [rows, 2C] additive mask built per pass).

The chunk rows are left out of the reader's query tiles (`ResidualBatch.left_out`) and such
passes run eager (variable shapes): prefill passes do anyway.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from specloop.kernels.chunk_attention import (
    ChunkLaunch, chunk_launch, tile_rows_for, two_source_attention, two_source_chunks_triton,
)
from specloop.kernels.packed_keys import read_keys

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK_ROWS = 64  # a group of at least this many prompt rows attends as a chunk
# The most (chunks x longest context) one batched key read holds: at ouro-1.4b's KV shape
# (16 heads x 128 channels, bf16) K and V of 32K keys are 2 x 128 MiB.
BATCH_KEYS = 32768


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """One prompt group of a pass: rows [first, first + rows) at `depth` of request `cell`,
    reading keys [0, context) through its plane's page table at `table` in the batch's tables."""

    first: int
    rows: int
    cell: int
    depth: int
    context: int
    table: int


class PromptChunks(list):
    """A pass's prompt chunks (host data, `LoopPass.notes`)."""


@dataclasses.dataclass
class ChunkReads:
    """What a chunk reads, the same at every layer of a pass: one row for the key reader
    (`packed_keys.read_keys`) at the chunk's last query position, which reads each key
    reconstructed where any query of the chunk does, and each key's seal at the chunk's
    plane (int32 [C]), from which the attention picks per (query, key) between that read
    and the BF16 tail."""

    cells: torch.Tensor  # [1] long
    depths: torch.Tensor  # [1] long
    last: torch.Tensor  # [1] long: the last query's position
    table_offsets: torch.Tensor  # [1] long
    seals: torch.Tensor  # [C] int32
    reach: torch.Tensor  # [C] int32: `chunk_attention.seal_reach`


def chunk_reads(planes: Any, chunks: list[PromptChunk], positions: torch.Tensor) -> list[ChunkReads]:
    """Every chunk's reads of a pass (`planes`: the `PackedResiduals`; `positions`: the pass's
    rows' positions), computed together: one copy of the chunks' host integers, one seal
    lookup over [chunks, longest context] (each chunk's keys at its own depth), one
    `seal_reach` over the rows; each chunk's fields are views of those (about 14 device ops a
    chunk before, each a launch on a GPU host). No host sync."""
    device, n = positions.device, len(chunks)
    longest = max(chunk.context for chunk in chunks)
    host = torch.tensor([[c.cell for c in chunks], [c.depth for c in chunks], [c.table for c in chunks]])
    ints = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    cells, depths, tables = ints
    keys = torch.arange(longest, device=device).expand(n, longest)
    seals = planes.seals(cells, depths, keys).to(torch.int32)  # [n, longest]; a seal is at most NEVER
    last = torch.stack([positions[c.first: c.first + c.rows].max() for c in chunks])  # [n]
    # `chunk_attention.seal_reach` along each row: a row's prefix [0, C) is its chunk's
    reach = torch.where(seals <= last[:, None], seals, -1).cummax(1).values.to(torch.int32)
    return [ChunkReads(cells[b:b + 1], depths[b:b + 1], last[b:b + 1], tables[b:b + 1], seals[b, :c.context],
                       reach[b, :c.context]) for b, c in enumerate(chunks)]


@dataclasses.dataclass
class ChunkBatch:
    """Chunks whose contexts one `read_keys` launch reads, a row each (the `ChunkReads` of
    chunks `index` of the pass, stacked), over the longest of their contexts."""

    index: list[int]
    cells: torch.Tensor  # [n] long
    depths: torch.Tensor  # [n] long
    last: torch.Tensor  # [n] long
    table_offsets: torch.Tensor  # [n] long
    keys: int
    seals: torch.Tensor  # int32: the chunks' seals end to end
    reach: torch.Tensor  # int32: their `seal_reach`, end to end
    launch: ChunkLaunch | None = None  # the two-source launch's tiles (Triton), built at the first layer
    checked: bool = False  # the key read's arguments checked (at the first layer: the others' are alike)


def chunk_batches(chunks: list[PromptChunk], reads: list[ChunkReads], limit: int | None = None) -> list[ChunkBatch]:
    """The pass's chunks in order, cut into batches of at most `limit` (default `BATCH_KEYS`)
    rows x keys (a chunk longer than that alone)."""
    limit = BATCH_KEYS if limit is None else limit
    groups: list[list[int]] = []
    for i, chunk in enumerate(chunks):
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * max(chunk.context, *(chunks[j].context for j in group)) > limit:
            groups.append([i])
        else:
            group.append(i)
    cat = lambda field, ids: torch.cat([getattr(reads[i], field) for i in ids])  # noqa: E731
    return [ChunkBatch(ids, cat("cells", ids), cat("depths", ids), cat("last", ids), cat("table_offsets", ids),
                       max(chunks[i].context for i in ids), cat("seals", ids), cat("reach", ids)) for ids in groups]


def attend_chunks(planes: Any, layer: int, q: torch.Tensor, out: torch.Tensor, k_tail: torch.Tensor,
                  v_tail: torch.Tensor, tables: torch.Tensor, page_size: int, chunks: list[PromptChunk],
                  reads: list[ChunkReads], batches: list[ChunkBatch], positions: torch.Tensor) -> None:
    """The chunks' rows' attention into `out` [N, Hq, D] (`q`, `positions`: the pass's rows';
    `k_tail`, `v_tail`: this layer's BF16 pages, [S, Hkv, D]): per batch one key read and
    one two-source attention over every chunk of it (Triton; the reference chunk by chunk)."""
    view = planes.layer_view(layer)
    for batch in batches:
        k_read, v_read = read_keys(k_tail, v_tail, tables, page_size, view, batch.cells, batch.depths, batch.last,
                                   batch.table_offsets, batch.keys, check=not batch.checked)
        batch.checked = True
        if q.is_cuda or _INTERPRET:
            if batch.launch is None:
                tile_rows = tile_rows_for(q.shape[1], k_tail.shape[1])
                spans = [(chunks[i].first, chunks[i].rows, chunks[i].table, chunks[i].context) for i in batch.index]
                batch.launch = chunk_launch(spans, tile_rows, q.device)
            two_source_chunks_triton(q, k_read, v_read, k_tail, v_tail, tables, page_size, positions, batch.seals,
                                     batch.last, batch.reach, batch.launch, out)
            continue
        for n, i in enumerate(batch.index):
            chunk, r = chunks[i], reads[i]
            rows = slice(chunk.first, chunk.first + chunk.rows)
            out[rows] = two_source_attention(q[rows], k_read[n, :chunk.context], v_read[n, :chunk.context], k_tail,
                                             v_tail, tables, chunk.table, page_size, positions[rows], r.seals,
                                             r.last, use_triton=False)
