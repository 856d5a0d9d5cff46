"""Prompt chunks over INT4 residual planes: dequantize once, then one dense attention.

The packed reader (`specloop.kernels.packed_attention`) decodes every packed key tile again
for each query tile that reads it, which suits decode rows (one query tile) and costs a
prompt chunk its whole context once per 64 queries: an 8K prompt's first token took 3.4 s
against 0.3 s with BF16 pages. A prompt chunk (a group of at least `CHUNK_ROWS` rows, all
at prompt positions) instead has its context [0, C) read once per layer in both versions
its queries read (reconstructed where any query does: `packed_keys.read_keys` for a row at
the chunk's last query position; exact: the BF16 tail), and attends over both in one masked scaled-dot-product attention: query q reads
key k's reconstruction iff q >= seal(k) (the read rule, `PackedResiduals.seals`) and its
exact value otherwise, each causally, exactly what the reader reads. The masks and slots depend on the pass only (the
pass's seals are set before its first layer), so they are built once per pass and chunk.

The chunk rows are left out of the reader's query tiles (`ResidualBatch.left_out`) and such
passes run eager (variable shapes): prefill passes do anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specloop.kernels.packed_keys import read_keys

CHUNK_ROWS = 64  # a group of at least this many prompt rows attends as a chunk


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
    reconstructed where any query of the chunk does; the exact keys' slots in the BF16 tail
    and which of them any query reads exact (the others' pages may be gone); and the
    additive mask over [keys as the last query reads them, exact keys] ([1, 1, rows, 2C] in
    the model dtype: 0 where the query reads that version, -inf else)."""

    cells: torch.Tensor  # [1] long
    depths: torch.Tensor  # [1] long
    positions: torch.Tensor  # [1] long: the last query's
    table_offsets: torch.Tensor  # [1] long
    slots: torch.Tensor  # [C] long
    exact: torch.Tensor  # [C, 1, 1] bool
    mask: torch.Tensor  # [1, 1, rows, 2C]


def chunk_reads(planes: Any, chunk: PromptChunk, positions: torch.Tensor, tables: torch.Tensor, page_size: int,
                dtype: torch.dtype) -> ChunkReads:
    """The chunk's reads (`planes`: the `PackedResiduals`; `positions`: the pass's rows'
    positions); no host sync. A query reads key k reconstructed iff its position is at or
    past k's seal, so the last query reads k reconstructed iff any query does."""
    device = positions.device
    keys = torch.arange(chunk.context, device=device)
    one = lambda value: torch.full((1,), value, dtype=torch.long, device=device)  # noqa: E731
    seal = planes.seals(one(chunk.cell), chunk.depth, keys[None])[0]
    q = positions[chunk.first: chunk.first + chunk.rows, None]
    causal = keys[None] <= q
    sealed = q >= seal[None]
    exact = ~sealed & causal
    allowed = torch.cat([sealed & causal, exact], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    pages = tables[chunk.table: chunk.table + -(-chunk.context // page_size)]
    slots = pages[keys // page_size] * page_size + keys % page_size
    return ChunkReads(one(chunk.cell), one(chunk.depth), q.max()[None], one(chunk.table), slots,
                      exact.any(0)[:, None, None], mask[None, None])


def chunk_attention(planes: Any, layer: int, q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor,
                    tables: torch.Tensor, page_size: int, chunk: PromptChunk, reads: ChunkReads,
                    scale: float) -> torch.Tensor:
    """The chunk's rows' attention output [rows, Hq, D] (`q`: those rows' queries; `k_tail`,
    `v_tail`: this layer's BF16 pages, [S, Hkv, D])."""
    k_last, v_last = read_keys(k_tail, v_tail, tables, page_size, planes.layer_view(layer), reads.cells,
                               reads.depths, reads.positions, reads.table_offsets, chunk.context)
    zero = torch.zeros((), dtype=k_tail.dtype, device=q.device)
    k = torch.cat([k_last[0], torch.where(reads.exact, k_tail[reads.slots], zero)])  # [2C, Hkv, D]
    v = torch.cat([v_last[0], torch.where(reads.exact, v_tail[reads.slots], zero)])
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    kw = {"attn_mask": reads.mask, "scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    if q.dtype in (torch.float32, torch.float64):  # the math kernel: fused ones may round fp32 products as TF32
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(*args, **kw)
    else:
        out = F.scaled_dot_product_attention(*args, **kw)
    return out[0].transpose(0, 1)
