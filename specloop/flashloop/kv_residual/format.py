"""The `int4-residual` KV format: the BF16 pages of `PagedKV` as the exact tail, and the
packed planes (`PackedResiduals`) every sealed key is read from. The backends use it like
any format (`specloop.runtime.kv_format`): a layer's ready groups encode after its write;
the torch reference reads each key exact or reconstructed by the read rule; the Triton path
runs the packed reader; sparse decode attention's kernels read the planes in place."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specloop.flashloop.kv_residual.batch import ResidualPass
from specloop.flashloop.kv_residual.chunks import (
    ChunkBatch, ChunkReads, PromptChunk, PromptChunks, attend_chunks, chunk_batches, chunk_reads,
)
from specloop.kernels.packed_attention import MIN_SPLIT_KEYS, packed_attention, packed_splits
from specloop.kernels.sparse_decode_common import PackedRows
from specloop.runtime.kv_format import KeyReader, PagedKV
from specloop.flashloop.kv_residual.planes import EncodePlan, PackedResiduals


@dataclasses.dataclass
class PassReads:
    """Rows' cells, depths and positions for the planes' reads in one loop pass, and the
    pass's encoding plan."""

    cells: torch.Tensor  # [N_p]
    depths: torch.Tensor  # [N_p]
    positions: torch.Tensor  # [N_p]
    plan: EncodePlan
    tables: torch.Tensor
    chunks: list[PromptChunk] = dataclasses.field(default_factory=list)  # left out of the reader's tiles
    reads: list[ChunkReads] = dataclasses.field(default_factory=list)  # per chunk, built at the first layer
    batches: list[ChunkBatch] = dataclasses.field(default_factory=list)  # the chunks' batched key reads


class PackedPlanes(PagedKV):
    contiguous_reads = False  # a chunk reads keys reconstructed from records: the two-source kernel

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, planes: PackedResiduals) -> None:
        super().__init__(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.planes = planes
        self.chunk_rows = 0  # prompt-chunk rows attended dequantized once (`chunks`), counted at layer 0

    def pass_state(self, lp: Any) -> PassReads | None:
        plan = lp.notes.get(EncodePlan)
        if plan is None:
            return None
        return PassReads(lp.notes[ResidualPass].cells, lp.depths, lp.positions, plan, lp.tables,
                         lp.notes.get(PromptChunks, []))

    def encode(self, layer: int, state: PassReads | None) -> None:
        """The groups that turned ready in this pass, before anyone reads them."""
        if state is not None:
            self.planes.encode(layer, state.plan, self.k[layer], self.v[layer], state.tables, self.page_size)

    def single_keys(self, layer: int, key_slots: torch.Tensor, rows: slice, state: PassReads | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys as it reads them: reconstructed where its position is at or past
        the key's seal, the exact tail otherwise."""
        keys, values = self.read(layer, key_slots)
        if state is None:
            return keys, values
        keys_at = torch.arange(keys.shape[1], device=keys.device).expand(keys.shape[0], -1)
        cells, depths = state.cells[rows], state.depths[rows]
        seal = self.planes.seals(cells, depths, keys_at)
        k_hat, v_hat = self.planes.reconstruct(layer, cells, depths, keys_at)
        sealed = (state.positions[rows][:, None] >= seal)[..., None, None]
        return torch.where(sealed, k_hat, keys), torch.where(sealed, v_hat, values)

    def group_attention(self, layer: int, q: torch.Tensor, key_slots: torch.Tensor, mask: torch.Tensor,
                        rows: slice, scale: float, state: PassReads | None) -> torch.Tensor:
        if state is None:
            return super().group_attention(layer, q, key_slots, mask, rows, scale, state)
        keys, values = self.read(layer, key_slots)
        span = torch.arange(keys.shape[0], device=keys.device)[None]
        cell, depth = state.cells[rows.start: rows.start + 1], state.depths[rows.start: rows.start + 1]
        seal = self.planes.seals(cell, depth, span)[0]  # [Lk]
        k_hat, v_hat = self.planes.reconstruct(layer, cell, depth, span)
        sealed = state.positions[rows][:, None] >= seal[None, :]  # [n, Lk]
        return mixed_attention(q, keys, values, k_hat[0], v_hat[0], sealed, mask, scale)

    def splits(self, num_tiles: int, num_kv_heads: int, longest: int, num_sms: int) -> int:
        return packed_splits(num_tiles, num_kv_heads, longest, num_sms)

    def attention(self, layer: int, q: torch.Tensor, meta: Any, state: PassReads | None, out: torch.Tensor | None,
                  return_lse: bool, scores: torch.Tensor | None, score_rows: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed reader over the pass's query tiles: each key exact or packed (keys within
        the tail of every row of a tile exact without a look at their seals: a group seals at
        least `tail` past its last row); then the prompt chunks the tiles leave out, each
        dequantized once (`chunks.chunk_attention`)."""
        assert state is not None, "every pass of a packed format has its reads"
        out, lse = packed_attention(q, self.k[layer], self.v[layer], state.tables, self.page_size,
                                    self.planes.layer_view(layer), state.cells, state.depths, state.positions,
                                    meta.table_offsets, num_splits=meta.num_splits, tiles=meta.tiles,
                                    tile_rows=meta.tile_rows, out=out, return_lse=return_lse, scores=scores,
                                    score_rows=score_rows, min_split_keys=MIN_SPLIT_KEYS,
                                    exact_gap=self.planes.tail)
        if state.chunks:
            if not state.reads:  # the pass's first layer
                state.reads = chunk_reads(self.planes, state.chunks, state.positions)
                state.batches = chunk_batches(state.chunks, state.reads)
            attend_chunks(self.planes, layer, q, out, self.k[layer], self.v[layer], state.tables, self.page_size,
                          state.chunks, state.reads, state.batches, state.positions)
            if layer == 0:
                self.chunk_rows += sum(chunk.rows for chunk in state.chunks)
        return out, lse

    def key_reader(self, layer: int, tables: torch.Tensor, table_offsets: torch.Tensor, every: bool,
                   state: PassReads | None) -> KeyReader:
        """The kernels read each key as its row reads it, straight from the planes (the kept
        scores and the kernels' V must come from one read of the keys)."""
        assert state is not None, "every pass of a packed format has its reads"
        k, v, packed = self.k[layer], self.v[layer], self.planes.layer_view(layer)

        def read(r: torch.Tensor):
            pick = (lambda x: x) if every else (lambda x: x[r].contiguous())  # noqa: E731
            return (k, v, tables, pick(table_offsets), self.page_size,
                    PackedRows(packed, pick(state.cells), pick(state.depths)))
        return read


def mixed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                    sealed: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention where query i reads key j reconstructed (k_hat, v_hat) iff sealed[i, j] and
    exact otherwise: q [n, Hq, D], k/v/k_hat/v_hat [Lk, Hkv, D], sealed/mask [n, Lk]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    per_head = lambda x: x.to(acc).repeat_interleave(group, dim=1)  # noqa: E731 -- [Lk, Hq, D]
    qa = q.to(acc)
    exact = torch.einsum("nhd,khd->hnk", qa, per_head(k))
    packed = torch.einsum("nhd,khd->hnk", qa, per_head(k_hat))
    scores = torch.where(sealed[None], packed, exact) * scale
    probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
    # a key no query reads exact may have no exact value left (its tail page was released)
    read_exact = ((~sealed & mask).any(0))[:, None, None]
    v = torch.where(read_exact, v, torch.zeros_like(v))
    out = torch.einsum("hnk,khd->nhd", probs * ~sealed[None], per_head(v))
    out = out + torch.einsum("hnk,khd->nhd", probs * sealed[None], per_head(v_hat))
    return out.to(q.dtype)
