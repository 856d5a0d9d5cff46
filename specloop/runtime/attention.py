"""Attention backends: each builds its own metadata from the forward batch, then attends.

    meta = backend.build(loop_pass, keep)       # once per loop pass of a forward call
    out = backend.attend(layer, q, k, v, meta)  # per layer: store the rows' K/V, attend

The model only sees `bind(meta)`, an object with `attend(layer, q, k, v)`. Every row
writes its K/V into its own depth plane (rows whose token exited keep the stored value)
and attends causally to that plane of its request over positions [0, position].

`TorchAttention` is the readable reference (the oracle for faster backends): each run of
consecutive single-row groups (decodes) attends in one padded gather; every other group
(prompt chunks, verifications) runs scaled-dot-product attention over its own keys.
`TritonAttention` is the fast path: one launch of the paged attention kernel
(`specloop.kernels.paged_attention`) per layer over the batch's query tiles, split-KV when
there are too few tiles to fill the GPU. All sizes come from the batch's host-side shapes:
nothing is read back from the device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import torch
from torch.nn import functional as F

from specloop.errors import ConfigError
from specloop.kernels.packed_attention import packed_attention, packed_splits
from specloop.kernels.paged_attention import block_g, choose_splits, paged_attention
from specloop.runtime.forward_batch import GroupShape, LoopPass
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.kv_residual import PackedResiduals
from specloop.runtime.sparse_decode import (
    DecodeReferences, KeptScores, SparseRows, paged_reader, plane_reader,
)

BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str
    kv: PagedKV
    tile_rows: tuple[int, int] | None  # query-tile sizes it wants in the forward batch

    def build(self, lp: LoopPass, keep: torch.Tensor | None) -> Any: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor: ...


@dataclasses.dataclass
class Bound:
    """A backend with one call's metadata: what the model's layers call."""

    backend: AttentionBackend
    meta: Any

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.attend(layer, q, k, v, self.meta)


@dataclasses.dataclass
class _Group:
    rows: slice  # the group's rows in the call
    key_slots: torch.Tensor  # [Lk] KV slots of keys 0..context-1
    mask: torch.Tensor  # [n, Lk] True where query i may read key j


@dataclasses.dataclass
class _Singles:
    rows: slice  # a run of consecutive single-row groups (decodes)
    key_slots: torch.Tensor  # [G, Lmax] KV slots
    valid: torch.Tensor  # [G, Lmax]


@dataclasses.dataclass
class _Readers:
    """Rows' cells, depths and positions for the INT4 residual planes' reads."""

    cells: torch.Tensor  # [N_p]
    depths: torch.Tensor  # [N_p]
    positions: torch.Tensor  # [N_p]
    plan: Any  # kv_residual.EncodePlan of the pass
    tables: torch.Tensor


@dataclasses.dataclass
class TorchMeta:
    write_slots: torch.Tensor
    keep: torch.Tensor | None
    singles: list[_Singles]
    groups: list[_Group]
    residual: _Readers | None = None
    sparse: _Sparse | None = None


@dataclasses.dataclass
class _Sparse:
    """Sparse decode attention's rows of a pass and what the reference state's kernels read."""

    rows: SparseRows
    tables: torch.Tensor
    positions: torch.Tensor
    table_offsets: torch.Tensor
    token_slots: torch.Tensor
    depths: torch.Tensor
    cells: torch.Tensor | None  # the rows' request cells (INT4 residual planes)
    longest: int  # the pass's longest context (host)
    exited: torch.Tensor | None  # [N] the rows whose token exited before the pass (adaptive exit)
    scores: torch.Tensor | None = None  # Triton: the scratch view the dense launch stores the sources' scores in
    score_rows: torch.Tensor | None = None  # [N] int32: each row's scores row there (source k: k), -1 for none

    @classmethod
    def of(cls, lp: LoopPass, keep: torch.Tensor | None) -> "_Sparse | None":
        if lp.sparse is None:
            return None
        longest = lp.max_context if lp.max_context is not None else max((g.context for g in lp.groups), default=0)
        return cls(lp.sparse, lp.tables, lp.positions, lp.table_offsets, lp.token_slots, lp.depths,
                   lp.residual.cells if lp.residual is not None else None, longest, keep)


class TorchAttention:
    name = "torch"
    tile_rows = None

    def __init__(self, kv: PagedKV, residuals: PackedResiduals | None = None,
                 references: DecodeReferences | None = None) -> None:
        self.kv = kv
        self.residuals = residuals
        self.references = references

    def build(self, lp: LoopPass, keep: torch.Tensor | None) -> TorchMeta:
        device, bs = lp.positions.device, lp.page_size
        singles, groups = [], []
        for run in _single_runs(lp.groups):
            width = max(s.context for s in lp.groups[run])
            first, last = lp.groups[run.start].first, lp.groups[run.stop - 1].first + 1
            span = torch.arange(width, device=device)
            positions = lp.positions[first:last]
            index = (lp.table_offsets[first:last, None] + span[None, :] // bs).clamp(max=lp.tables.numel() - 1)
            keys = lp.tables[index] * bs + span[None, :] % bs  # padding reads are masked below
            singles.append(_Singles(slice(first, last), keys, span[None, :] <= positions[:, None]))
        for shape in lp.groups:
            if shape.rows == 1:
                continue
            span = torch.arange(shape.context, device=device)
            keys = lp.tables[shape.table + span // bs] * bs + span % bs
            queries = lp.positions[shape.first: shape.first + shape.rows]
            groups.append(_Group(slice(shape.first, shape.first + shape.rows), keys, span[None, :] <= queries[:, None]))
        readers = None
        if lp.encode_plan is not None:
            readers = _Readers(lp.residual.cells, lp.depths, lp.positions, lp.encode_plan, lp.tables)
        return TorchMeta(lp.write_slots, keep, singles, groups, readers, _Sparse.of(lp, keep))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchMeta) -> torch.Tensor:
        self.kv.write(layer, meta.write_slots, k, v, meta.keep)
        res = meta.residual
        if res is not None:  # groups that turned ready in this pass, before anyone reads them
            self.residuals.encode(layer, res.plan, self.kv.k[layer], self.kv.v[layer], res.tables, self.kv.page_size)
        out = torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        for run in meta.singles:
            keys, values = self.kv.read(layer, run.key_slots)  # [G, Lmax, Hkv, D]
            if res is not None:
                r = run.rows
                span = torch.arange(keys.shape[1], device=keys.device).expand(keys.shape[0], -1)
                keys, values = self._sealed(layer, res.cells[r], res.depths[r], span, res.positions[r][:, None],
                                            keys, values)
            out[run.rows] = _decode_attention(q[run.rows], keys, values, run.valid, scale)
        for group in meta.groups:
            keys, values = self.kv.read(layer, group.key_slots)
            if res is None:
                out[group.rows] = _sdpa(q[group.rows], keys, values, group.mask, scale)
                continue
            r = group.rows
            span = torch.arange(keys.shape[0], device=keys.device)[None]
            cell, depth = res.cells[r.start: r.start + 1], res.depths[r.start: r.start + 1]
            seal = self.residuals.seals(cell, depth, span)[0]  # [Lk]
            k_hat, v_hat = self.residuals.reconstruct(layer, cell, depth, span)
            sealed = res.positions[r][:, None] >= seal[None, :]  # [n, Lk]
            out[r] = _mixed_attention(q[r], keys, values, k_hat[0], v_hat[0], sealed, group.mask, scale)
        return _sparse_decode(self, layer, q, out, meta.sparse, use_triton=False)

    def _sealed(self, layer: int, cells: torch.Tensor, depths: torch.Tensor, keys_at: torch.Tensor,
                queries_at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys as it reads them: reconstructed where its position is at or past
        the key's seal, the exact tail otherwise."""
        seal = self.residuals.seals(cells, depths, keys_at)
        k_hat, v_hat = self.residuals.reconstruct(layer, cells, depths, keys_at)
        sealed = (queries_at >= seal)[..., None, None]
        return torch.where(sealed, k_hat, keys), torch.where(sealed, v_hat, values)


def _single_runs(shapes: list[GroupShape]) -> list[slice]:
    """Maximal runs of consecutive single-row groups, as slices of `shapes`."""
    runs, start = [], None
    for i, shape in enumerate(shapes + [None]):
        single = shape is not None and shape.rows == 1
        if single and start is None:
            start = i
        elif not single and start is not None:
            runs.append(slice(start, i))
            start = None
    return runs


@dataclasses.dataclass
class TritonMeta:
    write_slots: torch.Tensor
    keep: torch.Tensor | None
    tables: torch.Tensor
    positions: torch.Tensor
    tiles: torch.Tensor
    tile_rows: int
    num_splits: int
    residual: _Readers | None = None
    table_offsets: torch.Tensor | None = None
    sparse: _Sparse | None = None


class TritonAttention:
    """Paged attention in one Triton launch per layer (plus a combine when split).

    Tile sizes keep the kernel's M dimension (tile rows x padded GQA group) at 16 for
    decodes and verifications, where the kernel is bandwidth-bound, and at 64 for prompt
    chunks, where it is compute-bound and larger tiles reuse each key tile more."""

    name = "triton"
    SMALL_M, LARGE_M = 16, 64

    def __init__(self, kv: PagedKV, num_heads: int, num_kv_heads: int, device: torch.device,
                 residuals: PackedResiduals | None = None, references: DecodeReferences | None = None) -> None:
        self.kv = kv
        self.residuals = residuals
        self.references = references
        self.num_kv_heads = num_kv_heads
        g = block_g(num_heads, num_kv_heads)
        self.tile_rows = (max(1, self.SMALL_M // g), max(1, self.LARGE_M // g))
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def build(self, lp: LoopPass, keep: torch.Tensor | None) -> TritonMeta:
        assert lp.tiles is not None, "the forward batch was built without query tiles"
        splits = lp.num_splits
        longest = max((s.context for s in lp.groups), default=0)
        sparse = self._keep_scores(_Sparse.of(lp, keep), lp.positions.shape[0])
        if lp.encode_plan is not None:  # the packed reader, over the same query tiles
            readers = _Readers(lp.residual.cells, lp.depths, lp.positions, lp.encode_plan, lp.tables)
            if splits is None:
                splits = packed_splits(lp.tiles.shape[0], self.num_kv_heads, longest, self.num_sms)
            return TritonMeta(lp.write_slots, keep, lp.tables, lp.positions, lp.tiles, lp.tile_rows, splits,
                              readers, lp.table_offsets, sparse)
        if splits is None:  # eager: from this call's tiles and longest context
            splits = choose_splits(lp.tiles.shape[0], self.num_kv_heads, longest, self.num_sms)
        return TritonMeta(lp.write_slots, keep, lp.tables, lp.positions, lp.tiles, lp.tile_rows, splits,
                          sparse=sparse)

    def _keep_scores(self, sparse: _Sparse | None, n: int) -> _Sparse | None:
        """The pass's sparse rows, with the scratch view and score rows when the dense launch
        can keep every source row's scores (once per pass: every layer's launch uses them)."""
        sources = sparse.rows.source if sparse is not None else None
        if sources is None or self.references is None:
            return sparse
        scores = self.references.scores_for(sources.numel(), sparse.longest)
        if scores is None:
            return sparse
        score_rows = torch.full((n,), -1, dtype=torch.int32, device=sources.device)
        score_rows[sources] = torch.arange(sources.numel(), dtype=torch.int32, device=sources.device)
        return dataclasses.replace(sparse, scores=scores, score_rows=score_rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonMeta) -> torch.Tensor:
        self.kv.write(layer, meta.write_slots, k, v, meta.keep)
        res = meta.residual
        # the sparse rows' kept scores and their kernels' V must come from one read of the keys
        assert meta.sparse is None or (res is None) == (self.residuals is None), "sparse rows without the planes"
        # Sparse decode correction rows are not in the tiles: zeros until the correction step
        # writes them, never uninitialised memory (exited rows keep them).
        corrects = meta.sparse is not None and meta.sparse.rows.correction.numel() > 0  # (a graph's: always)
        out = torch.zeros_like(q) if corrects else None
        # the loop-2 sources' scores and lse, kept by the dense launch when the scratch holds them all
        scores = meta.sparse.scores if meta.sparse is not None else None
        score_rows = meta.sparse.score_rows if scores is not None else None
        if res is not None:  # encode the pass's ready groups, then read each key exact or packed
            store = self.residuals
            store.encode(layer, res.plan, self.kv.k[layer], self.kv.v[layer], res.tables, self.kv.page_size)
            out, lse = packed_attention(q, self.kv.k[layer], self.kv.v[layer], res.tables, self.kv.page_size,
                                        store.layer_view(layer), res.cells, res.depths, res.positions,
                                        meta.table_offsets, num_splits=meta.num_splits, tiles=meta.tiles,
                                        tile_rows=meta.tile_rows, out=out, return_lse=scores is not None,
                                        scores=scores, score_rows=score_rows)
        else:
            out, lse = paged_attention(q, self.kv.k[layer], self.kv.v[layer], meta.tables, meta.positions,
                                       meta.tiles, self.kv.page_size, tile_rows=meta.tile_rows,
                                       num_splits=meta.num_splits, out=out, return_lse=scores is not None,
                                       scores=scores, score_rows=score_rows)
        kept = KeptScores(scores, lse) if scores is not None else None
        return _sparse_decode(self, layer, q, out, meta.sparse, use_triton=True, kept=kept)


def _sparse_decode(backend: TorchAttention | TritonAttention, layer: int, q: torch.Tensor, out: torch.Tensor,
                   sparse: _Sparse | None, use_triton: bool, kept: KeptScores | None = None) -> torch.Tensor:
    """The pass's generated-token rows of `out` as sparse decode attention gives them
    (`DecodeReferences.attend`); `out` unchanged without such rows. The torch backend runs
    the kernels' torch references over the dense output of every row, the Triton one the
    kernels, its correction rows left out of the dense launch (`fallback(rows)` runs the
    tiles of rows [N] bool dense: a missing state's)."""
    if sparse is None:
        return out
    kv = backend.kv
    k, v = kv.k[layer], kv.v[layer]
    if backend.residuals is None:
        read = paged_reader(k, v, sparse.tables, sparse.table_offsets, kv.page_size, sparse.rows.every)
    else:  # the kernels read each key as its row reads it, straight from the planes
        read = plane_reader(k, v, sparse.tables, sparse.table_offsets, kv.page_size,
                            backend.residuals.layer_view(layer), sparse.cells, sparse.depths, sparse.rows.every)
    return backend.references.attend(layer, sparse.rows, q, out, sparse.positions, sparse.token_slots, read,
                                     use_triton, sparse.longest, sparse.exited, kept)


def backend_name(name: str, device: torch.device) -> str:
    """The backend `name` resolves to: "auto" is Triton on CUDA and the torch reference on
    CPU (there Triton runs only under its interpreter, one program at a time)."""
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def make_backend(name: str, kv: PagedKV, device: torch.device, num_heads: int, num_kv_heads: int,
                 residuals: PackedResiduals | None = None,
                 references: DecodeReferences | None = None) -> AttentionBackend:
    """The backend `name` asks for (`backend_name`)."""
    name = backend_name(name, device)
    if name == "torch":
        return TorchAttention(kv, residuals, references)

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU, "
                          "for tests: slow)")
    return TritonAttention(kv, num_heads, num_kv_heads, device, residuals, references)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [Lk, Hkv, D], mask [n, Lk] -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)


def _mixed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
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


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, Hq, D], k/v [G, L, Hkv, D], valid [G, L]; scores and softmax in >= fp32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[2]
    qg = q.view(q.shape[0], k.shape[2], group, q.shape[2]).to(acc)  # [G, Hkv, g, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k.to(acc)) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.to(acc))
    return out.reshape(q.shape).to(q.dtype)
