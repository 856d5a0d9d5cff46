"""Sparse decode attention in the runtime: the loop-2 reference state of generated tokens,
kept in their token slots, and the attention step that writes and reads it.

A generated token's row (position at or past its request's prompt, `RowGroup.decode_from`)
is a *source* at loop 2 (depth 1): its dense attention is its output and O_ref, and the
source step keeps, per layer and query head, the top-b keys of its probabilities, their
mass m and C_ref (`specloop.kernels.sparse_decode_*`). At loops 3 and 4 (depths >= 2) the
same token's row is a *correction*: it attends to its kept keys of that depth alone and
outputs O_ref - C_ref + m * sum p V. Prompt rows stay dense. With the Triton backend the
correction rows are left out of the dense launch's query tiles (`LoopPass.tiles`), so a
correction costs b keys instead of the whole context.

The state lives in the token's slot (`DecodeReferences`, indexed by token slot: generated
tokens take their slots from the decode sub-pool of `TokenSlotPool`, the only slots with
room for it). A token keeps its slot from loop 1 to its last loop, so the state survives
between the calls of a token pipeline or a round's draft and verification, moves with the
pipeline's survivors (nothing is copied: slots travel with the tokens in the plan), and a
rejected token's slot is retired with it. `enter` marks a slot's state missing when a new
token takes the slot; a source write marks it present. A correction row whose state is
missing (which the scheduler's ordering never produces: a token's loop 2 always runs
before its loop 3) gets dense attention over its keys from the correction kernel itself
(`decode_correction(..., dense_rows=)`, which then reads nothing of the state) and is
counted in `fallbacks`, never consuming another token's state.

Under CUDA graphs a pass with generated-token rows replays a graph of its own, which runs
both steps (or, with `batch.SPLIT_GRAPHS`, the step its rows need) over every row of its
bucket; the pass block's roles column says which rows play which part
(`SparseRows.source_ok` / `correction_ok`), padding rows play none and write nothing, and
the scores scratch has a fixed address.

With INT4 residual planes the source and correction read each key as the row reads it
(exact from the BF16 tail or reconstructed from the packed planes, by the read rule),
straight from the planes (the format's `key_reader`: the kernels run the packed reader's own gather,
the select's V sums and the correction on the kept positions alone); no copy of the keys is
made, and the packed reader keeps the sources' scores and lse like the paged kernel.
"""

from __future__ import annotations

import dataclasses

import torch

from specloop.kernels.sparse_decode_common import SlotState, key_budget
from specloop.kernels.sparse_decode_correction import decode_correction
from specloop.kernels.sparse_decode_source import (
    SCRATCH_BYTES, decode_select, decode_source, scratch_keys, scratch_rows,
)
from specloop.flashloop.sparse_decode.batch import SparseRows
from specloop.runtime.kv_format import KeyReader


@dataclasses.dataclass
class KeptScores:
    """What a dense launch that kept the source rows' scores hands the source step: the
    scratch view it wrote (`DecodeReferences.scores_for`), source row k's scores in row k,
    and the lse of every row of the pass [N, Hq] (fp32)."""

    scores: torch.Tensor
    lse: torch.Tensor


class DecodeReferences:
    """Reference state of the decode slots [0, num_slots), layer-major so that one layer's
    state is a contiguous `SlotState`: per layer, slot and query head the kept keys (int32,
    ascending positions; entries past the count are never read), m, O_ref and C_ref (fp32;
    fp64 for an fp64 model), the count per slot (it depends on the position alone), and
    whether the slot's state was written for its current token (`present` [slot, layer]).
    Also the loop-2 scores scratch of the Triton kernels, [rows, Hq, max_context] fp32
    bounded by SCRATCH_BYTES, at a fixed address (CUDA graphs read it); `max_rows` 0 (the
    torch backend, whose references need none): no scratch."""

    def __init__(self, num_slots: int, num_layers: int, num_heads: int, head_dim: int, max_context: int,
                 key_retention: float, dtype: torch.dtype, device: torch.device, max_rows: int = 0) -> None:
        self.num_slots = num_slots
        self.key_retention = key_retention
        self.max_context = max_context
        self.capacity = key_budget(max_context, key_retention)
        acc = torch.promote_types(dtype, torch.float32)
        self.keys = torch.full((num_layers, num_slots, num_heads, self.capacity), -1, dtype=torch.int32,
                               device=device)
        self.count = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.mass = torch.zeros(num_layers, num_slots, num_heads, dtype=acc, device=device)
        self.o_ref = torch.zeros(num_layers, num_slots, num_heads, head_dim, dtype=acc, device=device)
        self.c_ref = torch.zeros_like(self.o_ref)
        # One row past the decode slots: the sink other slots go to (no mask, no sync).
        self.present = torch.zeros(num_slots + 1, num_layers, dtype=torch.bool, device=device)
        self.fallbacks = torch.zeros((), dtype=torch.long, device=device)  # correction rows run dense (state missing)
        # Its host copy, refreshed behind each call's work (`publish`): stats never wait on the device.
        self.fallbacks_host = torch.zeros((), dtype=torch.long, pin_memory=device.type == "cuda")
        self.scratch = torch.empty(self.scratch_rows(num_heads, max_context, max_rows) * num_heads
                                   * scratch_keys(max_context),
                                   dtype=torch.float32, device=device)
        self.nbytes_held = sum(t.numel() * t.element_size() for t in (
            self.keys, self.count, self.mass, self.o_ref, self.c_ref, self.present, self.scratch))

    @staticmethod
    def scratch_rows(num_heads: int, max_context: int, max_rows: int) -> int:
        """Rows of the scores scratch at the longest context: what SCRATCH_BYTES holds, at
        most `max_rows` (a pass's), at least one (none for `max_rows` 0)."""
        return min(max_rows, scratch_rows(num_heads, max_context, SCRATCH_BYTES))

    @classmethod
    def nbytes(cls, num_slots: int, num_layers: int, num_heads: int, head_dim: int, max_context: int,
               key_retention: float, dtype: torch.dtype, max_rows: int = 0) -> int:
        """Device bytes of the state for `num_slots` slots and of the scratch (what the KV
        budget leaves room for)."""
        acc = torch.promote_types(dtype, torch.float32).itemsize
        per_head = key_budget(max_context, key_retention) * 4 + acc * (1 + 2 * head_dim)
        scratch = cls.scratch_rows(num_heads, max_context, max_rows) * num_heads * scratch_keys(max_context) * 4
        return num_slots * (num_layers * num_heads * per_head + num_layers + 4) + num_layers + scratch

    def layer(self, layer: int) -> SlotState:
        """One layer's state (views)."""
        return SlotState(self.keys[layer], self.count, self.mass[layer], self.o_ref[layer], self.c_ref[layer])

    def capture(self, slots: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        """The state of `slots` on the host, slot-major (a snapshot's `references`), keys cut to
        `width` per head."""
        return {"keys": self.keys[:, slots, :, :width].transpose(0, 1).cpu(), "count": self.count[slots].cpu(),
                "mass": self.mass[:, slots].transpose(0, 1).cpu(),
                "o_ref": self.o_ref[:, slots].transpose(0, 1).cpu(),
                "c_ref": self.c_ref[:, slots].transpose(0, 1).cpu(), "present": self.present[slots].cpu()}

    def restore(self, slots: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Write `capture`'s state into `slots` (keys of any width up to the capacity)."""
        dev = self.keys.device
        keys = state["keys"].to(dev).transpose(0, 1)
        self.keys[:, slots] = -1
        self.keys[:, slots, :, : keys.shape[-1]] = keys
        self.count[slots] = state["count"].to(dev)
        for name in ("mass", "o_ref", "c_ref"):
            getattr(self, name)[:, slots] = state[name].to(dev).transpose(0, 1)
        self.present[slots] = state["present"].to(dev)

    def publish(self) -> None:
        """Copy the fallback count to the host behind the call's work (complete once the
        call's ticket is)."""
        self.fallbacks_host.copy_(self.fallbacks, non_blocking=True)

    def enter(self, slots: torch.Tensor) -> None:
        """Tokens entering loop 1 in `slots`: a decode slot's state is missing until its
        token's loop 2 writes it (other slots hold none)."""
        self.present.index_fill_(0, self._safe(slots), False)

    def _safe(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots, with every slot past the decode ones sent to the sink row of `present`."""
        return torch.where(slots < self.num_slots, slots, self.num_slots)

    def attend(self, layer: int, rows: SparseRows, q: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
               token_slots: torch.Tensor, read: KeyReader, use_triton: bool, context: int,
               exited: torch.Tensor | None = None, kept: KeptScores | None = None) -> torch.Tensor:
        """`out` [N, Hq, D] (the dense attention of the pass's rows) with the generated
        tokens' rows replaced: sources keep their state (their output is the dense one,
        which is O_ref), corrections output the corrected attention where their state is
        present and dense attention where it is missing (a backend's dense launch may have
        left the correction rows out). Rows whose token exited (`exited` [N], adaptive exit:
        their outputs are dropped) run neither. One layer; `read` gives the keys a set of
        rows reads (`KeyReader`); `context` (host) bounds every row's position + 1; `kept`,
        when given, holds the source rows' scores and the rows' lse from the dense launch
        (Triton: the source runs its select kernel alone); no host sync."""
        if rows.source.numel():
            self._source(layer, rows, q, out, positions, token_slots, read, use_triton, exited,
                         min(max(context, 1), self.max_context), kept)
        if rows.correction.numel():
            self._correct(layer, rows, q, out, positions, token_slots, read, use_triton, exited)
        return out

    def _source(self, layer: int, rows: SparseRows, q: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor, read: KeyReader, use_triton: bool, exited: torch.Tensor | None,
                context: int, kept: KeptScores | None) -> None:
        """`context`: the pass's longest context (host), which shapes the scratch."""
        r = rows.source
        if layer == 0 or "source" not in rows.memo:  # the pass's first layer
            run = _running(rows, r, rows.source_ok, exited)
            slots = rows.pick(token_slots, r)
            safe = self._safe(slots)
            # rows not playing the part (a graph's) leave their slot alone: the sink takes their write
            mark = safe if rows.source_ok is None else torch.where(rows.source_ok, safe, self.num_slots)
            rows.memo["source"] = (slots, torch.where(run, rows.pick(positions, r), -1), run, mark)
        slots, at, run, mark = rows.memo["source"]
        k_cache, v_cache, tables, offsets, page_size, packed = read(r)
        dense = rows.pick(out, r).contiguous()
        if kept is not None:
            decode_select(v_cache, tables, at, offsets, page_size, self.key_retention, dense=dense,
                          lse=rows.pick(kept.lse, r).contiguous(), scores=kept.scores, slots=slots,
                          state=self.layer(layer), max_context=context, k_cache=k_cache, packed=packed)
        else:
            decode_source(rows.pick(q, r).contiguous(), k_cache, v_cache, tables, at, offsets, page_size,
                          self.key_retention, dense=dense, slots=slots, state=self.layer(layer), max_context=context,
                          scratch=self._scratch(context), use_triton=use_triton, packed=packed)
        if layer == self.present.shape[1] - 1:  # every layer's state is written: one write for all
            self.present[mark] = run[:, None].expand(-1, self.present.shape[1])

    def scores_for(self, sources: int, context: int) -> torch.Tensor | None:
        """The scratch view a dense launch can store `sources` rows' scores in at this
        context (`context`: the pass's longest, host), or None when it holds fewer rows (the
        source then runs its own scores kernel, in chunks)."""
        view = self._scratch(min(max(context, 1), self.max_context))
        return view if view is not None and 0 < sources <= view.shape[0] else None

    def _scratch(self, context: int) -> torch.Tensor | None:
        """The scratch as [rows, Hq, scratch_keys(context)]: as many rows as fit at this
        context (None without one); rows of whole 16-key blocks keep its strides multiples
        of 16 at every context, so no kernel compiles a variant for a new one."""
        if self.scratch.numel() == 0:
            return None
        heads, keys = self.keys.shape[2], scratch_keys(context)
        rows = self.scratch.numel() // (heads * keys)
        return self.scratch[: rows * heads * keys].view(rows, heads, keys)

    def _correct(self, layer: int, rows: SparseRows, q: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
                 token_slots: torch.Tensor, read: KeyReader, use_triton: bool, exited: torch.Tensor | None) -> None:
        r = rows.correction
        if layer == 0 or "correction" not in rows.memo:  # the pass's first layer
            slots = rows.pick(token_slots, r)
            run = _running(rows, r, rows.correction_ok, exited)
            # A source pass writes every layer's state of its tokens, so the first layer's
            # presence is every layer's; a missing state is never read: its rows run dense.
            missing = ~self.present[self._safe(slots), layer] & run
            self.fallbacks += missing.sum()
            rows.memo["correction"] = (slots, torch.where(run, rows.pick(positions, r), -1), missing)
        slots, at, missing = rows.memo["correction"]
        k_cache, v_cache, tables, offsets, page_size, packed = read(r)
        if rows.every:  # corrected in place: rows that run no correction are left as they are
            decode_correction(q.contiguous(), k_cache, v_cache, tables, at, offsets, page_size, slots=slots,
                              state=self.layer(layer), out=out, use_triton=use_triton, dense_rows=missing,
                              packed=packed)
            return
        corrected = out[r]
        decode_correction(q[r].contiguous(), k_cache, v_cache, tables, at, offsets, page_size, slots=slots,
                          state=self.layer(layer), out=corrected, use_triton=use_triton, dense_rows=missing,
                          packed=packed)
        out[r] = corrected


def _running(rows: SparseRows, r: torch.Tensor, ok: torch.Tensor | None,
             exited: torch.Tensor | None) -> torch.Tensor:
    """[n] bool: rows r that play the part (`ok`) and whose token has not exited."""
    run = torch.ones(r.shape, dtype=torch.bool, device=r.device) if ok is None else ok
    return run if exited is None else run & ~rows.pick(exited, r)
