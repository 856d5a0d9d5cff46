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
there are too few tiles to fill the GPU; in bf16/fp16 over BF16 pages, prompt chunks of at
least `CONTIGUOUS_MIN_ROWS` rows get no tiles and attend over their keys made contiguous
(`specloop.kernels.flash_prefill`: cuDNN for a chunk that is the whole prompt, 2.2x the
paged kernel's rate on an 8K prompt on the H100; torch's flash kernel after a prefix, 1.2x). All sizes come from the batch's host-side shapes: nothing is read
back from the device.

Neither names a FlashLoop feature: the KV format (`specloop.runtime.kv_format`: BF16 pages,
or INT4 residual planes) stores and reads the keys however it stores them, and a
`RowAttention` (sparse decode attention) may replace some rows' output after the dense
attention.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import torch

from specloop.errors import ConfigError
from specloop.kernels import flash_prefill
from specloop.kernels.paged_attention import block_g
from specloop.runtime.forward_batch import GroupShape, LoopPass, kv_slots
from specloop.runtime.kv_format import PagedKV

BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str
    kv: PagedKV
    tile_rows: tuple[int, int] | None  # query-tile sizes it wants in the forward batch
    contiguous_min_rows: int | None  # prompt chunks it attends without tiles (`LoopPass.contiguous`)

    def build(self, lp: LoopPass, keep: torch.Tensor | None) -> Any: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor: ...


class RowAttention(Protocol):
    """A feature that replaces some rows' attention output after the dense attention of a
    pass (sparse decode attention's generated-token rows)."""

    def build(self, lp: LoopPass, keep: torch.Tensor | None, keep_scores: bool) -> Any:
        """The pass's state, or None when the pass has no such rows; `keep_scores`: the
        dense Triton launch can store scores for it."""

    def leaves_rows_out(self, state: Any) -> bool:
        """Whether its rows are left out of the dense launch (the output then starts at zeros)."""

    def kept_scores(self, state: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scores, score rows) the dense Triton launch stores for it, or None."""

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, state: Any, kv: PagedKV, kv_state: Any,
               use_triton: bool, lse: torch.Tensor | None = None) -> torch.Tensor:
        """`out` with its rows replaced (`lse`: the dense launch's, when it kept scores)."""


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
class TorchMeta:
    write_slots: torch.Tensor
    keep: torch.Tensor | None
    singles: list[_Singles]
    groups: list[_Group]
    kv_state: Any = None  # the format's (`PagedKV.pass_state`)
    rows: Any = None  # the row attention's (`RowAttention.build`)


class TorchAttention:
    name = "torch"
    tile_rows = None
    contiguous_min_rows = None

    def __init__(self, kv: PagedKV, rows: RowAttention | None = None) -> None:
        self.kv = kv
        self.rows = rows

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
        rows = self.rows.build(lp, keep, keep_scores=False) if self.rows is not None else None
        return TorchMeta(lp.write_slots, keep, singles, groups, self.kv.pass_state(lp), rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchMeta) -> torch.Tensor:
        kv = self.kv
        kv.write(layer, meta.write_slots, k, v, meta.keep)
        kv.encode(layer, meta.kv_state)
        out = torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        for run in meta.singles:
            keys, values = kv.single_keys(layer, run.key_slots, run.rows, meta.kv_state)  # [G, Lmax, Hkv, D]
            out[run.rows] = _decode_attention(q[run.rows], keys, values, run.valid, scale)
        for group in meta.groups:
            out[group.rows] = kv.group_attention(layer, q[group.rows], group.key_slots, group.mask, group.rows, scale,
                                                 meta.kv_state)
        if meta.rows is None:
            return out
        return self.rows.attend(layer, q, out, meta.rows, kv, meta.kv_state, use_triton=False)


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
    table_offsets: torch.Tensor
    kv_state: Any = None  # the format's (`PagedKV.pass_state`)
    rows: Any = None  # the row attention's (`RowAttention.build`)
    contiguous: list[tuple[slice, torch.Tensor | None]] = dataclasses.field(default_factory=list)  # per
    # prompt chunk the tiles leave out (`LoopPass.contiguous`): its rows, the KV slots of its keys
    # 0..context-1 (None: the chunk is its whole context and reads the pass's own k, v)


class TritonAttention:
    """Paged attention in one Triton launch per layer (plus a combine when split).

    Tile sizes keep the kernel's M dimension (tile rows x padded GQA group) at 16 for
    decodes and verifications, where the kernel is bandwidth-bound, and at 64 for prompt
    chunks, where it is compute-bound and larger tiles reuse each key tile more.

    `contiguous_min_rows` (the forward batch reads it): prompt chunks of at least that many
    rows attend over their keys made contiguous instead (`flash_prefill`), where the format
    stores plain pages and flash attention takes the dtype (None: never)."""

    name = "triton"
    SMALL_M, LARGE_M = 16, 64
    CONTIGUOUS_MIN_ROWS = 64  # a large tile's rows: smaller chunks stay in the paged launch

    def __init__(self, kv: PagedKV, num_heads: int, num_kv_heads: int, device: torch.device,
                 rows: RowAttention | None = None) -> None:
        self.kv = kv
        self.rows = rows
        self.num_kv_heads = num_kv_heads
        g = block_g(num_heads, num_kv_heads)
        self.tile_rows = (max(1, self.SMALL_M // g), max(1, self.LARGE_M // g))
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        flash = kv.contiguous_reads and flash_prefill.supported(device, kv.k.dtype, kv.k.shape[-1])
        self.contiguous_min_rows = self.CONTIGUOUS_MIN_ROWS if flash else None

    def build(self, lp: LoopPass, keep: torch.Tensor | None) -> TritonMeta:
        assert lp.tiles is not None, "the forward batch was built without query tiles"
        splits = lp.num_splits
        if splits is None:  # eager: from this call's tiles and longest context
            longest = max((s.context for s in lp.groups), default=0)
            splits = self.kv.splits(lp.tiles.shape[0], self.num_kv_heads, longest, self.num_sms)
        rows = self.rows.build(lp, keep, keep_scores=True) if self.rows is not None else None
        # a chunk that is its whole context reads the pass's own k, v (as written, unless
        # adaptive exit keeps stored values for some rows); others gather from their pages
        contiguous = [(slice(s.first, s.first + s.rows),
                       None if s.context == s.rows and keep is None else
                       kv_slots(lp.tables, s.table, torch.arange(s.context, device=lp.tables.device), lp.page_size))
                      for s in lp.contiguous]
        return TritonMeta(lp.write_slots, keep, lp.tables, lp.positions, lp.tiles, lp.tile_rows, splits,
                          lp.table_offsets, self.kv.pass_state(lp), rows, contiguous)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonMeta) -> torch.Tensor:
        """Store the rows' K/V, then the paged launch over the tiles (skipped when a pass's
        rows are all prompt chunks attending over contiguous keys), the chunks, the row
        attention's rows."""
        kv = self.kv
        kv.write(layer, meta.write_slots, k, v, meta.keep)
        kv.encode(layer, meta.kv_state)
        scale = q.shape[-1] ** -0.5

        def chunk(rows: slice, slots: torch.Tensor | None) -> torch.Tensor:  # its own k, v or gathered keys
            keys = (k[rows], v[rows]) if slots is None else kv.read(layer, slots)
            return flash_prefill.flash_chunk_attention(q[rows], *keys, scale)

        if (len(meta.contiguous) == 1 and meta.contiguous[0][0] == slice(0, q.shape[0])
                and meta.rows is None):  # one chunk is the whole pass
            return chunk(*meta.contiguous[0])
        out, lse, kept = None, None, None
        if meta.rows is not None:
            out = torch.zeros_like(q) if self.rows.leaves_rows_out(meta.rows) else None
            kept = self.rows.kept_scores(meta.rows)
        if meta.tiles.shape[0] or kept is not None or not meta.contiguous:
            scores, score_rows = kept if kept is not None else (None, None)
            out, lse = kv.attention(layer, q, meta, meta.kv_state, out, kept is not None, scores, score_rows)
        elif out is None:
            out = torch.empty_like(q)
        for rows, slots in meta.contiguous:
            out[rows] = chunk(rows, slots)
        if meta.rows is None:
            return out
        return self.rows.attend(layer, q, out, meta.rows, kv, meta.kv_state, use_triton=True, lse=lse)


def backend_name(name: str, device: torch.device) -> str:
    """The backend `name` resolves to: "auto" is Triton on CUDA and the torch reference on
    CPU (there Triton runs only under its interpreter, one program at a time)."""
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def make_backend(name: str, kv: PagedKV, device: torch.device, num_heads: int, num_kv_heads: int,
                 rows: RowAttention | None = None) -> AttentionBackend:
    """The backend `name` asks for (`backend_name`), reading and writing through the format
    `kv`; `rows`: a feature's row attention (sparse decode attention), if on."""
    name = backend_name(name, device)
    if name == "torch":
        return TorchAttention(kv, rows)

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU, "
                          "for tests: slow)")
    return TritonAttention(kv, num_heads, num_kv_heads, device, rows)


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
