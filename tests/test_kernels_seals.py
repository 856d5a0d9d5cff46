"""The seal lookup kernel (`specloop.kernels.seals`) against its torch reference
(`packed_rows.seals`), exactly.

Random planes: row maps with gaps (-1: no row) and rows that skip planes, group tables
with negative entries (no record), seals spread over [0, NEVER] with NEVER among them,
several cells with positions in any order (repeats included), depth as an int (0..P-1)
and one per cell, more positions than one program's block, and [M, a, b] positions
through the dispatcher. Runs natively on CUDA and under Triton's interpreter on CPU
(tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels import packed_rows
from specloop.kernels.int4_groups import GROUP
from specloop.kernels.packed_rows import NEVER
from specloop.kernels.seals import BLOCK, seals

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLANES, CELLS, MAX_LEN = 4, 3, 700


def _planes(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seal [R], group_tables [C, P, G], row_maps [C, P, L]) int32."""
    groups = -(-MAX_LEN // GROUP)
    records = CELLS * PLANES * groups
    seal = torch.randint(0, 5000, (records,), generator=gen, dtype=torch.int32)
    seal[torch.rand(records, generator=gen) < 0.3] = NEVER
    tables = torch.randperm(records, generator=gen).view(CELLS, PLANES, groups).to(torch.int32)
    tables[torch.rand(tables.shape, generator=gen) < 0.15] = -1
    row_maps = torch.full((CELLS, PLANES, MAX_LEN), -1, dtype=torch.int32)
    for c in range(CELLS):
        for p in range(PLANES):
            has = torch.rand(MAX_LEN, generator=gen) < (1.0 if p == 0 else 0.7)
            has[torch.randint(0, MAX_LEN, (1,), generator=gen)] = False  # a gap at plane 0 too
            row_maps[c, p, has] = torch.arange(int(has.sum()), dtype=torch.int32)
    return seal.to(DEVICE), tables.to(DEVICE), row_maps.to(DEVICE)


@pytest.mark.parametrize("keys", [1, 37, BLOCK + 5])
def test_kernel_reads_the_seals_the_reference_reads(keys):
    gen = torch.Generator().manual_seed(keys)
    seal, tables, row_maps = _planes(gen)
    m = 5
    cells = torch.randint(0, CELLS, (m,), generator=gen).to(DEVICE)
    positions = torch.randint(0, MAX_LEN, (m, keys), generator=gen).to(DEVICE)
    positions[:, 0] = MAX_LEN - 1
    checked = 0
    for depth in [*range(PLANES), torch.randint(0, PLANES, (m,), generator=gen).to(DEVICE)]:
        want = packed_rows.seals(seal, tables, row_maps, cells, depth, positions)
        got = seals(seal, tables, row_maps, cells, depth, positions, use_triton=True)
        assert got.dtype == torch.long and torch.equal(got, want), f"depth {depth}"
        checked += int((want < NEVER).sum())
    assert checked > 0, "some positions must read a seal"


def test_positions_of_any_shape_and_int32():
    """[M, a, b] positions (flattened per cell) and int32 ones, as the release scan passes."""
    gen = torch.Generator().manual_seed(3)
    seal, tables, row_maps = _planes(gen)
    cells = torch.tensor([2, 0], device=DEVICE)
    positions = torch.randint(0, MAX_LEN, (2, 3, 50), generator=gen).to(DEVICE)
    depth = torch.tensor([3, 1], device=DEVICE)
    want = packed_rows.seals(seal, tables, row_maps, cells, depth, positions)
    assert torch.equal(seals(seal, tables, row_maps, cells, depth, positions, use_triton=True), want)
    got = seals(seal, tables, row_maps, cells, 2, positions[:, 1].to(torch.int32), use_triton=True)
    assert torch.equal(got, packed_rows.seals(seal, tables, row_maps, cells, 2, positions[:, 1]))
    assert seals(seal, tables, row_maps, cells[:0], 1, positions[:0, 0], use_triton=True).shape == (0, 50)
