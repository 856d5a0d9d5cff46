"""Reading packed INT4 residual planes in plain PyTorch: rows, records, decode, seals and
reconstruction. The one torch implementation behind the Triton kernels' references
(`packed_keys`, `packed_attention`, `residual_encode`) and the runtime's torch path
(`specloop.flashloop.kv_residual.planes.PackedResiduals`).

The planes are a `PackedKV` (`packed_keys`): K / V records (`int4_groups` layouts),
each record's seal, and per request cell and plane the group tables (record of compact
group g, a negative record: none) and row maps (compact row of each position, -1: none).
Positions [M, ...] belong to cells [M]; a depth is an int or one per cell ([M]).

- A position's row at a plane is `row_maps[cell, plane, position]`; its record is the group
  table's entry for row // 64.
- `seals`: the seal of the record holding the position's deepest row at a plane <= depth
  (NEVER without one): from that query position on, the position reads reconstructed.
- `reconstruct`: plane 0's decode (the `absent` record's row 0 where a position has no
  plane-0 row), then for each plane 1..depth where the position has a row,
  X^ = DT(fp32(X^) + fp32(dq)), dq = DT(lo16 + scale16 * code) computed in fp32 (a product
  and an add, never fused); fp64 adds in fp64.
"""

from __future__ import annotations

import torch

from specloop.kernels.int4_groups import GROUP, KGroups, VGroups, unpack_codes

NEVER = 2**31 - 1  # the seal of a record no query reads reconstructed


def rows_records(group_tables: torch.Tensor, row_maps: torch.Tensor, cells: torch.Tensor, plane: int,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, record) [M, ...] long of `positions` at `plane`: row -1 without one, record
    negative without a row or a record."""
    cell = cells.view(-1, *([1] * (positions.dim() - 1))).expand_as(positions)
    row = row_maps[cell, plane, positions].long()
    record = group_tables[cell, plane, row.clamp(min=0) // GROUP].long()
    return row, torch.where(row >= 0, record, torch.full_like(record, -1))


def decode_rows(k: KGroups, v: VGroups, record: torch.Tensor, row: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [..., Hkv, D] in `dtype` of in-group rows `row` of records `record` (any
    shape, both >= 0): the codec's decode."""
    nibble = (4 * (row % 2)).to(torch.uint8)[..., None, None]
    code = (k.codes[record, row // 2] >> nibble) & 0xF  # [..., Hkv, D]
    k_out = (k.lo[record].float() + k.scale[record].float() * code.float()).to(dtype)
    n = record * GROUP + row
    v_code = unpack_codes(v.codes[n], n.dim() + 1)  # [..., Hkv, D]: bytes along the last dim
    channel_group = torch.arange(v_code.shape[-1], device=v_code.device) // GROUP
    scale, lo = v.scale[n][..., channel_group], v.lo[n][..., channel_group]
    return k_out, (lo.float() + scale.float() * v_code.float()).to(dtype)


def _upto(depth: int | torch.Tensor, plane: int, positions: torch.Tensor) -> torch.Tensor | bool:
    """Whether `plane` is within each cell's depth (broadcast over the positions' trailing dims)."""
    if isinstance(depth, int):
        return True
    return (depth >= plane).view(-1, *([1] * (positions.dim() - 1)))


def _deepest(depth: int | torch.Tensor, planes: int) -> int:
    return depth if isinstance(depth, int) else planes - 1


def seals(seal: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor, cells: torch.Tensor,
          depth: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[M, ...] long: from which query position each position reads reconstructed at `depth`."""
    out = torch.full(positions.shape, NEVER, dtype=torch.long, device=positions.device)
    for p in range(_deepest(depth, row_maps.shape[1]) + 1):
        row, record = rows_records(group_tables, row_maps, cells, p, positions)
        s = torch.where(record >= 0, seal[record.clamp(min=0)].long(), NEVER)
        out = torch.where((row >= 0) & _upto(depth, p, positions), s, out)
    return out


def reconstruct(k: KGroups, v: VGroups, group_tables: torch.Tensor, row_maps: torch.Tensor, cells: torch.Tensor,
                depth: int | torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                absent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [M, ..., Hkv, D] in `dtype` of `positions` reconstructed at `depth`; a row
    without a record decodes record `absent` (its value is never meant to be read)."""
    out_k = out_v = None
    for p in range(_deepest(depth, row_maps.shape[1]) + 1):
        row, record = rows_records(group_tables, row_maps, cells, p, positions)
        record = torch.where(record >= 0, record, torch.full_like(record, absent))
        dk, dv = decode_rows(k, v, record, row.clamp(min=0) % GROUP, dtype)
        if p == 0:
            out_k, out_v = dk, dv
            continue
        has = ((row >= 0) & _upto(depth, p, positions))[..., None, None]
        out_k = torch.where(has, out_k + dk, out_k)
        out_v = torch.where(has, out_v + dv, out_v)
    return out_k, out_v
