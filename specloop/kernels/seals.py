"""Seal lookups of INT4 residual planes in one Triton launch, beside their torch reference.

    out = seals(seal, group_tables, row_maps, cells, depth, positions)

[M, K] long: from which query position each of `positions` [M, K] (of cell cells[M]) reads
reconstructed at `depth` (an int, or [M] one per cell): the seal of the record holding the
position's deepest row at a plane <= depth, NEVER where it has none
(`packed_rows.seals`, the reference, and its docstring for the layouts).

Why a kernel: the reference is about 13 small torch ops a plane (gathers, wheres, clamps),
about 50 a call; an INT4 prefill makes such calls for every prompt chunk and the release
scan of every forward call, about 220 ops a call at 2048 rows a plan, and on a GPU host
each op costs its dispatch whatever its size (docs/flashloop.md, the INT4 first token's
host time). Here a program takes BLOCK positions of one cell and walks the planes.
Positions must lie in [0, row_maps.shape[2]) (the reference's indexing would wrap a
negative one); nothing is checked on the device, and no host sync.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from specloop.kernels import packed_rows
from specloop.kernels.int4_groups import GROUP
from specloop.kernels.packed_rows import NEVER

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 256
_NEVER = tl.constexpr(NEVER)
_GROUP = tl.constexpr(GROUP)


@triton.jit(do_not_specialize=["num_keys", "stride_pm", "depth"])
def _seals_kernel(seal_ptr, group_tables_ptr, row_maps_ptr, cells_ptr, depths_ptr, positions_ptr, out_ptr,
                  num_keys, num_planes, max_groups, max_len, stride_pm, depth,
                  PER_CELL_DEPTH: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = k < num_keys
    pos = tl.load(positions_ptr + m * stride_pm + k, mask=ok, other=0).to(tl.int64)
    cell = tl.load(cells_ptr + m).to(tl.int64)
    if PER_CELL_DEPTH:
        depth = tl.load(depths_ptr + m)
    out = tl.full([BLOCK_K], _NEVER, tl.int64)
    for p in range(0, tl.minimum(depth + 1, num_planes)):
        row = tl.load(row_maps_ptr + (cell * num_planes + p) * max_len + pos, mask=ok, other=-1)
        has = row >= 0
        record = tl.load(group_tables_ptr + (cell * num_planes + p) * max_groups + tl.maximum(row, 0) // _GROUP,
                         mask=ok & has, other=-1)
        s = tl.load(seal_ptr + tl.maximum(record, 0), mask=ok & has & (record >= 0), other=_NEVER).to(tl.int64)
        out = tl.where(has, s, out)
    tl.store(out_ptr + m * num_keys + k, out, mask=ok)


def seals_triton(seal: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor, cells: torch.Tensor,
                 depth: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The reference's result in one launch (module docstring); positions [M, K]."""
    assert positions.dim() == 2 and cells.shape == (positions.shape[0],), "positions [M, K], cells [M]"
    assert positions.stride(1) == 1, "each cell's positions must be contiguous"
    for t in (seal, group_tables, row_maps, cells):
        assert t.is_contiguous(), "seals, tables, row maps and cells must be contiguous"
    m, keys = positions.shape
    out = torch.empty((m, keys), dtype=torch.long, device=positions.device)
    if m == 0 or keys == 0:
        return out
    per_cell = isinstance(depth, torch.Tensor)
    if per_cell:
        assert depth.shape == (m,) and depth.is_contiguous(), "a depth per cell: [M]"
    _, planes, max_len = row_maps.shape
    _seals_kernel[(m, triton.cdiv(keys, BLOCK))](
        seal, group_tables, row_maps, cells, depth if per_cell else cells, positions, out,
        keys, planes, group_tables.shape[2], max_len, positions.stride(0), 0 if per_cell else int(depth),
        PER_CELL_DEPTH=per_cell, BLOCK_K=BLOCK)
    return out


def seals(seal: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor, cells: torch.Tensor,
          depth: int | torch.Tensor, positions: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """[M, ...] long seals of `positions` [M, ...]: Triton on CUDA by default (positions
    flattened per cell), the torch reference elsewhere; use_triton=True also runs the
    kernel on CPU under TRITON_INTERPRET=1."""
    if use_triton is None:
        use_triton = positions.is_cuda
    if not use_triton:
        return packed_rows.seals(seal, group_tables, row_maps, cells, depth, positions)
    assert positions.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    flat = positions.reshape(positions.shape[0], math.prod(positions.shape[1:]))
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    return seals_triton(seal, group_tables, row_maps, cells, depth, flat).view(positions.shape)
