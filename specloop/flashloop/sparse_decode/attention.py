"""Sparse decode attention's step in the attention backends (`RowAttention`): after the
dense attention of a pass, the generated tokens' rows are replaced as `DecodeReferences.attend`
gives them (sources keep their state, corrections read their kept keys). The torch backend
runs the kernels' torch references over the dense output of every row, the Triton one the
kernels, its correction rows left out of the dense launch, and its dense launch keeping the
sources' scores when the scratch holds them all."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specloop.runtime.forward_batch import LoopPass
from specloop.runtime.kv_format import PagedKV
from specloop.flashloop.sparse_decode.references import DecodeReferences, KeptScores
from specloop.flashloop.sparse_decode.batch import SparseRows


@dataclasses.dataclass
class SparsePass:
    """Sparse decode attention's rows of a pass and what the reference state's kernels read."""

    rows: SparseRows
    tables: torch.Tensor
    positions: torch.Tensor
    table_offsets: torch.Tensor
    token_slots: torch.Tensor
    longest: int  # the pass's longest context (host)
    exited: torch.Tensor | None  # [N] the rows whose token exited before the pass (adaptive exit)
    scores: torch.Tensor | None = None  # Triton: the scratch view the dense launch stores the sources' scores in
    score_rows: torch.Tensor | None = None  # [N] int32: each row's scores row there (source k: k), -1 for none


class SparseDecodeStep:
    def __init__(self, references: DecodeReferences) -> None:
        self.references = references

    def build(self, lp: LoopPass, keep: torch.Tensor | None, keep_scores: bool) -> SparsePass | None:
        """The pass's generated-token rows (None: it has none); `keep_scores`: the dense launch
        can keep every source row's scores (once per pass: every layer's launch uses them)."""
        rows = lp.notes.get(SparseRows)
        if rows is None:
            return None
        longest = lp.max_context if lp.max_context is not None else max((g.context for g in lp.groups), default=0)
        sp = SparsePass(rows, lp.tables, lp.positions, lp.table_offsets, lp.token_slots, longest, keep)
        sources = sp.rows.source
        if not keep_scores or sources is None:
            return sp
        scores = self.references.scores_for(sources.numel(), sp.longest)
        if scores is None:
            return sp
        n = lp.positions.shape[0]
        score_rows = torch.full((n,), -1, dtype=torch.int32, device=sources.device)
        score_rows[sources] = torch.arange(sources.numel(), dtype=torch.int32, device=sources.device)
        return dataclasses.replace(sp, scores=scores, score_rows=score_rows)

    @staticmethod
    def leaves_rows_out(sp: SparsePass) -> bool:
        """Its correction rows are not in the dense launch's tiles: the output starts at zeros
        until the correction step writes them, never uninitialised memory (exited rows keep
        them). A graph's pass lists every row of its bucket as a correction unless its
        variant has sources only (`batch.VARIANTS`)."""
        return sp.rows.correction.numel() > 0

    @staticmethod
    def kept_scores(sp: SparsePass) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scores view, score rows) the dense Triton launch stores, or None."""
        return (sp.scores, sp.score_rows) if sp.scores is not None else None

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, sp: SparsePass, kv: PagedKV, kv_state: Any,
               use_triton: bool, lse: torch.Tensor | None = None) -> torch.Tensor:
        """`out` with the pass's generated-token rows as sparse decode attention gives them;
        `lse`: the dense launch's, when it kept the sources' scores."""
        read = kv.key_reader(layer, sp.tables, sp.table_offsets, sp.rows.every, kv_state)
        kept = KeptScores(sp.scores, lse) if sp.scores is not None else None
        return self.references.attend(layer, sp.rows, q, out, sp.positions, sp.token_slots, read, use_triton,
                                      sp.longest, sp.exited, kept)
