"""Which candidate groups of INT4 residual planes encode in a pass, in one Triton launch.

    plan_groups(cells, groups, table_offsets, valid, starts, group_tables, row_pos, encoded, rows,
                committed, first, row_maps, seal, sink=..., tail=..., serial=...)
    -> ready [M] bool, records [M] long, positions [M, 64] long

What `PackedResiduals.plan_encode` (`specloop.flashloop.kv_residual.planes`, the torch
reference: its docstring has the rule) does, for every plane's candidates end to end
(candidates [starts[p], starts[p + 1]) are plane p's), in place on `seal` and `encoded`. The
reference is about 40 small torch ops a plane (gathers, wheres, a scatter per plane, the
positions' gather), about 165 a forward call of an INT4 prefill, each a dispatch on the host
and a kernel on the GPU (in decode graphs too); this is one program, which walks the planes
in order since plane p's readiness reads what plane p - 1 encoded in the same pass:

- phase A, every candidate of the plane: ready, its record (the sink where not ready), its
  seal written (NEVER to the sink), its 64 row positions (0 where not ready); it reads
  `encoded` as the plane starts, as the reference's vector ops do;
- a barrier, then phase B: `encoded` of the plane advances past each ready group (atomic max);
- a barrier before the next plane, which reads the seals and `encoded` just written (loads
  that bypass L1: other threads of the program wrote them).

Inputs as the reference takes them, concatenated: cells, groups, table_offsets [M] long
(table offsets only pass through), valid [M] bool; the state `group_tables` int32 [C, P, G],
`row_pos` int32 [NR + 1, 64], `encoded`, `rows` long [C, P], `committed` long [C], `first`
long [C, P] (the execution policy's first query per cell and plane; any tensor under the
serial policy), `row_maps` int32 [C, P, L], `seal` int32 [NR + 1]. No host sync; nothing is
checked on the device (cells and records in range: the caller's tables guarantee it).
tests/test_kernels_residual_encode.py runs it in lockstep with the reference (every seal,
`encoded` and output equal), under the interpreter and on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specloop.kernels.int4_groups import GROUP
from specloop.kernels.packed_rows import NEVER

MAX_PLANES = 4
BLOCK = 128
_NEVER = tl.constexpr(NEVER)
_GROUP = tl.constexpr(GROUP)


@triton.jit
def _plane(p, lo, hi, cells_ptr, groups_ptr, valid_ptr, group_tables_ptr, row_pos_ptr, encoded_ptr, rows_ptr,
           committed_ptr, first_ptr, row_maps_ptr, seal_ptr, ready_ptr, records_ptr, positions_ptr, num_planes,
           max_groups, max_len, sink, tail, SERIAL: tl.constexpr, BLOCK_M: tl.constexpr):
    # phase A: readiness against `encoded` as the plane starts; seals, records, positions
    for start in range(lo, hi, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        ok = m < hi
        cell = tl.load(cells_ptr + m, mask=ok, other=0).to(tl.int64)
        g = tl.load(groups_ptr + m, mask=ok, other=0).to(tl.int64)
        at = cell * num_planes + p
        record = tl.load(group_tables_ptr + at * max_groups + tl.minimum(g, max_groups - 1), mask=ok,
                         other=0).to(tl.int64)
        last = tl.load(row_pos_ptr + record * _GROUP + _GROUP - 1, mask=ok, other=0).to(tl.int64)
        done = tl.load(encoded_ptr + at, mask=ok, other=0, cache_modifier=".cg")
        ready = ok & (g >= done) & (tl.load(rows_ptr + at, mask=ok, other=0) >= _GROUP * (g + 1))
        ready &= record != sink
        if SERIAL:
            ready &= last < tl.load(committed_ptr + cell, mask=ok, other=0)
            seal = last + tail
        else:
            seal = tl.load(first_ptr + at, mask=ok, other=_NEVER)
            ready &= (seal < _NEVER) & (last + tail <= seal)
        ready &= tl.load(valid_ptr + m, mask=ok, other=0) != 0
        if p > 0:
            before = at - 1  # (cell, p - 1)
            pred_row = tl.load(row_maps_ptr + before * max_len + tl.minimum(last, max_len - 1), mask=ok,
                               other=-1).to(tl.int64)
            pred_group = tl.maximum(pred_row, 0) // _GROUP
            pred_done = tl.load(encoded_ptr + before, mask=ok, other=0, cache_modifier=".cg")
            ready &= (pred_row >= 0) & (pred_group < pred_done)
            pred_record = tl.load(group_tables_ptr + before * max_groups + pred_group, mask=ok, other=0)
            pred_seal = tl.load(seal_ptr + pred_record, mask=ok, other=0, cache_modifier=".cg").to(tl.int64)
            seal = tl.maximum(seal, pred_seal)
        record = tl.where(ready, record, sink)
        tl.store(seal_ptr + record, tl.where(ready, seal, _NEVER).to(tl.int32), mask=ok)
        tl.store(ready_ptr + m, ready, mask=ok)
        tl.store(records_ptr + m, record, mask=ok)
        j = tl.arange(0, _GROUP)[None, :]
        pos = tl.load(row_pos_ptr + record[:, None] * _GROUP + j, mask=ready[:, None], other=0)
        tl.store(positions_ptr + m[:, None] * _GROUP + j, pos.to(tl.int64), mask=ok[:, None])
    tl.debug_barrier()
    # phase B: the plane's `encoded` past each ready group
    for start in range(lo, hi, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        ok = m < hi
        ready = tl.load(ready_ptr + m, mask=ok, other=0) != 0
        cell = tl.load(cells_ptr + m, mask=ok, other=0).to(tl.int64)
        g = tl.load(groups_ptr + m, mask=ok, other=0).to(tl.int64)
        tl.atomic_max(encoded_ptr + cell * num_planes + p, g + 1, mask=ready)
    tl.debug_barrier()


@triton.jit(do_not_specialize=["start1", "start2", "start3", "total"])
def _plan_kernel(cells_ptr, groups_ptr, valid_ptr, group_tables_ptr, row_pos_ptr, encoded_ptr, rows_ptr,
                 committed_ptr, first_ptr, row_maps_ptr, seal_ptr, ready_ptr, records_ptr, positions_ptr,
                 num_planes, max_groups, max_len, sink, tail, start1, start2, start3, total,
                 SERIAL: tl.constexpr, BLOCK_M: tl.constexpr):
    # planes past the last one have no candidates (their starts are `total`)
    _plane(0, 0, start1, cells_ptr, groups_ptr, valid_ptr, group_tables_ptr, row_pos_ptr, encoded_ptr, rows_ptr,
           committed_ptr, first_ptr, row_maps_ptr, seal_ptr, ready_ptr, records_ptr, positions_ptr, num_planes,
           max_groups, max_len, sink, tail, SERIAL, BLOCK_M)
    _plane(1, start1, start2, cells_ptr, groups_ptr, valid_ptr, group_tables_ptr, row_pos_ptr, encoded_ptr,
           rows_ptr, committed_ptr, first_ptr, row_maps_ptr, seal_ptr, ready_ptr, records_ptr, positions_ptr,
           num_planes, max_groups, max_len, sink, tail, SERIAL, BLOCK_M)
    _plane(2, start2, start3, cells_ptr, groups_ptr, valid_ptr, group_tables_ptr, row_pos_ptr, encoded_ptr,
           rows_ptr, committed_ptr, first_ptr, row_maps_ptr, seal_ptr, ready_ptr, records_ptr, positions_ptr,
           num_planes, max_groups, max_len, sink, tail, SERIAL, BLOCK_M)
    _plane(3, start3, total, cells_ptr, groups_ptr, valid_ptr, group_tables_ptr, row_pos_ptr, encoded_ptr,
           rows_ptr, committed_ptr, first_ptr, row_maps_ptr, seal_ptr, ready_ptr, records_ptr, positions_ptr,
           num_planes, max_groups, max_len, sink, tail, SERIAL, BLOCK_M)


def plan_groups(cells: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, starts: tuple[int, ...],
                group_tables: torch.Tensor, row_pos: torch.Tensor, encoded: torch.Tensor, rows: torch.Tensor,
                committed: torch.Tensor, first: torch.Tensor | None, row_maps: torch.Tensor, seal: torch.Tensor, *,
                sink: int, tail: int, serial: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ready [M] bool, records [M] long, positions [M, 64] long) of the candidates, plane p's
    at [starts[p], starts[p + 1]) (P + 1 host ints from 0 to M); seals and `encoded` updated
    in place (module docstring). One program, no host sync."""
    m = starts[-1]
    planes = row_maps.shape[1]
    assert len(starts) == planes + 1 and starts[0] == 0 and planes <= MAX_PLANES, "starts: P + 1 offsets from 0"
    assert cells.shape == groups.shape == valid.shape == (m,) and valid.dtype == torch.bool, "cells, groups, valid [M]"
    assert encoded.dtype == rows.dtype == committed.dtype == torch.long, "encoded, rows, committed: long"
    for t in (cells, groups, valid, group_tables, row_pos, encoded, rows, committed, row_maps, seal):
        assert t.is_contiguous(), "plan inputs and state must be contiguous"
    if not serial:
        assert first is not None and first.dtype == torch.long and first.is_contiguous(), "first: long [C, P]"
    device = cells.device
    ready = torch.empty(m, dtype=torch.bool, device=device)
    records = torch.empty(m, dtype=torch.long, device=device)
    positions = torch.empty(m, GROUP, dtype=torch.long, device=device)
    if m == 0:
        return ready, records, positions
    bounds = [*starts[1:], m, m, m][:MAX_PLANES - 1]
    _plan_kernel[(1,)](
        cells, groups, valid, group_tables, row_pos, encoded, rows, committed, first if first is not None else rows,
        row_maps, seal, ready, records, positions, planes, group_tables.shape[2], row_maps.shape[2], sink, tail,
        *bounds, m, SERIAL=serial, BLOCK_M=BLOCK)
    return ready, records, positions
