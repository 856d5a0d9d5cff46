"""Sparse decode attention's share of the forward batch (`BatchPart`): each pass's
generated-token rows (positions at or past their group's `decode_from`), those at depth 1
(sources) and deeper (corrections), listed after the pass blocks; the corrections leave the
dense query tiles (the correction step computes them). Each pass block holds every row's
role (1 a source, 2 a correction, 0 neither): a CUDA graph's pass lists every row of its
bucket and reads the roles (`SparseRows.source_ok` / `correction_ok`), so passes with
such rows replay a graph variant of their own."""

from __future__ import annotations

import dataclasses

import torch

from specloop.plan import Plan, RowGroup
from specloop.runtime.forward_batch import ForwardBatch, LoopPass


@dataclasses.dataclass
class SparseRows:
    """A loop pass's generated-token rows: `source` (depth 1) and `correction` (depth >= 2)
    batch rows, [Ns] and [Nc] long on the device. A CUDA graph lists every row of its
    bucket in both (`every`: then a gather by them is the tensor itself) and says which rows
    play each part in `source_ok` / `correction_ok` ([b] bool, from the pass block: values,
    never constants of the graph). `memo` holds what the pass's layer 0 derived from the
    rows (slots, masks, the missing states), which its later layers reuse (layer 0 derives it
    afresh, so a list reused for another pass is never stale)."""

    source: torch.Tensor
    correction: torch.Tensor
    source_ok: torch.Tensor | None = None
    correction_ok: torch.Tensor | None = None
    every: bool = False
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def pick(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """x[r] for one of the row lists r (x itself when r is every row)."""
        return x if self.every else x[r]


def sparse_rows(ordered: list[RowGroup], firsts: list[int], p: int) -> tuple[list[int], list[int]]:
    """Pass p's generated-token rows (positions at or past their group's `decode_from`):
    those at depth 1 (sparse decode sources) and those deeper (corrections). (A prompt
    window's rows are prompt positions: none of them.)"""
    source: list[int] = []
    correction: list[int] = []
    for group, first in zip(ordered, firsts):
        depth = group.depth + p
        if group.loops <= p or depth < 1 or group.end <= group.decode_from:
            continue
        skip = max(0, group.decode_from - group.start)
        (source if depth == 1 else correction).extend(range(first + skip, first + group.num_rows))
    return source, correction


class SparseDecodeBatch:
    variant = SparseRows

    def __init__(self, max_rows: int, num_loops: int) -> None:
        self.capacity = num_loops * max_rows  # each pass's lists

    def start(self, plan: Plan) -> None:
        pass

    def pass_info(self, ordered: list[RowGroup], firsts: list[int], p: int,
                  table_at: dict[tuple[int, int], int]) -> tuple[list[int], list[int]]:
        return sparse_rows(ordered, firsts, p)

    def left_out(self, info: tuple[list[int], list[int]]) -> list[int]:
        return info[1]

    def columns(self, info: object, bucket: int) -> int:
        return bucket  # the rows' roles

    def fits_graph(self, info: object, bucket: int) -> bool:
        return True

    def graph_columns(self, bucket: int) -> int:
        return bucket

    def block_ints(self, info: tuple[list[int], list[int]], n: int, cells: list[int], size: int,
                   bucket: int) -> list[int]:
        roles = [0] * size
        for row in info[0]:
            roles[row] = 1
        for row in info[1]:
            roles[row] = 2
        return roles

    def pad(self, size: int, bucket: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long)

    def pass_view(self, lp: LoopPass, columns: torch.Tensor, info: object, graphed: bool) -> None:
        pass  # an eager or replayed pass's lists come after the blocks (`tail_view`)

    def graph_view(self, lp: LoopPass, columns: torch.Tensor, variant: bool) -> None:
        """A graph's variant for passes with generated-token rows: every row of the bucket,
        the roles column saying which play a part."""
        if variant:
            roles = columns[: lp.num_rows]
            every = torch.arange(lp.num_rows, device=columns.device)
            lp.notes[SparseRows] = SparseRows(every, every, roles == 1, roles == 2, every=True)

    def tail_ints(self, info: tuple[list[int], list[int]]) -> list[int]:
        return info[0] + info[1]

    def tail_view(self, lp: LoopPass, ints: torch.Tensor, info: tuple[list[int], list[int]]) -> None:
        ns, nc = len(info[0]), len(info[1])
        if ns + nc:  # a pass of prompt rows alone has none
            lp.notes[SparseRows] = SparseRows(ints[:ns], ints[ns: ns + nc])

    def plan_ints(self, plan: Plan, ordered: list[RowGroup], firsts: list[int],
                  table_at: dict[tuple[int, int], int]) -> tuple[list[int], None]:
        return [], None

    def plan_view(self, batch: ForwardBatch, ints: torch.Tensor, sizes: None) -> None:
        pass
