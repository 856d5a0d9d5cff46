"""Sparse decode attention's share of the forward batch (`BatchPart`): each pass's
generated-token rows (positions at or past their group's `decode_from`), those at depth 1
(sources) and deeper (corrections), listed after the pass blocks; the corrections leave the
dense query tiles (the correction step computes them). Each pass block holds every row's
role (1 a source, 2 a correction, 0 neither): a CUDA graph's pass lists every row of its
bucket and reads the roles (`SparseRows.source_ok` / `correction_ok`), so passes with
such rows replay graph variants of their own. With `SPLIT_GRAPHS` there is one for
passes of sources alone, one for corrections alone, one for both (`VARIANTS`), so that a
pass launches no step for a part none of its rows plays (a batch-1 decode's loop 2 has
sources only, loops 3-4 corrections only); without it one graph runs both steps for
every such pass, their kernels launched over rows that play no part (at batch 1 the
select's six launches at loops 3 and 4, the correction's at loop 2)."""

from __future__ import annotations

import dataclasses
import os

import torch

from specloop.plan import Plan, RowGroup
from specloop.runtime.forward_batch import ForwardBatch, LoopPass


@dataclasses.dataclass
class SparseRows:
    """A loop pass's generated-token rows: `source` (depth 1) and `correction` (depth >= 2)
    batch rows, [Ns] and [Nc] long on the device. A CUDA graph lists every row of its
    bucket in each list its variant runs (`every`: then a gather by them is the tensor
    itself; the other list, if any, empty) and says which rows play each part in
    `source_ok` / `correction_ok` ([b] bool, from the pass block: values, never constants
    of the graph; None for an empty list). `memo` holds what the pass's layer 0 derived from the
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


# A pass's graph variant: which of the two steps its generated-token rows need.
VARIANTS = ("sources", "corrections", "both")
# Off until it has run on a GPU (written 2026-12-07 when the session's device time was
# spent): the variant graphs per part, which should take about 1 ms off a batch-1 sparse
# decode step after 8K (H100: 9.7 ms against dense's 8.6, the gap about what the empty
# launches cost). SPECLOOP_SPARSE_SPLIT_GRAPHS=1 turns it on; to take it up, run
# tests/test_sparse_decode_engine.py's graph cases and the matrix's graph cells with it
# on, then bench/flashloop_speed.py --variants dense,sparse-decode-recipe --cases 1x8192.
SPLIT_GRAPHS = os.environ.get("SPECLOOP_SPARSE_SPLIT_GRAPHS") == "1"


def variant_key(rows: SparseRows) -> str:
    """The graph variant of a pass with these rows (host: tensor sizes only)."""
    if not rows.correction.numel():
        return "sources"
    return "corrections" if not rows.source.numel() else "both"


class SparseDecodeBatch:
    variant = SparseRows

    def __init__(self, max_rows: int, num_loops: int) -> None:
        self.capacity = num_loops * max_rows  # each pass's lists
        self.split = SPLIT_GRAPHS
        self.variant_keys = VARIANTS if self.split else ("both",)

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

    def variant_key(self, rows: SparseRows) -> str:
        return variant_key(rows) if self.split else "both"

    def graph_view(self, lp: LoopPass, columns: torch.Tensor, variant: str | None) -> None:
        """A graph's variant for passes with generated-token rows: every row of the bucket in
        the lists of the parts its key names (the other list empty), the roles column saying
        which rows play them."""
        if variant is not None:
            roles = columns[: lp.num_rows]
            every = torch.arange(lp.num_rows, device=columns.device)
            none = every[:0]
            sources, corrections = variant in ("sources", "both"), variant in ("corrections", "both")
            lp.notes[SparseRows] = SparseRows(every if sources else none, every if corrections else none,
                                              roles == 1 if sources else None,
                                              roles == 2 if corrections else None, every=True)

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
