"""The runner: turns a plan into one forward batch and runs one forward call.

It owns the device state between calls: the KV pages (behind the attention backend), the
token slot storage (each live token's hidden state, exit state, depth, candidate and
incarnation) and each request cell's next token. A call is

    forward batch (one upload) -> features prepare (sparse prefill windows pick their rows) ->
    embed entering rows -> per loop pass p: features start the pass, rows [0, N_p) through one
    loop (the backend) -> adaptive exit -> store slots -> features finish -> heads (by head
    type, from the registry, on each group's output after its last loop) -> host copies

Pass p runs the groups with more than p loops (`RowGroup.loops`), whose rows lead the batch,
so a plain decode token runs every loop in one call and one plan.

Nothing here reads a device value back to the CPU: sizes come from the plan, sampled
tokens stay on the device for the next plan and are copied to pinned host memory behind a
CUDA event for the commit. The runner names no speculation mode: the heads it runs are
registered by type (`SampleHead` here, the speculation heads from `specloop.pipeline`), and
it names no FlashLoop feature: their device halves (`DeviceFeature`, from the composition
root) are called around the call. On CPU the same code simply runs synchronously.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specloop.model.exit_gate import exit_step
from specloop.model.ouro import OuroModel
from specloop.plan import Plan, RowGroup, Sample, Verify
from specloop.runtime.attention import AttentionBackend, Bound
from specloop.runtime.feature import DeviceFeature
from specloop.runtime.forward_batch import ForwardBatch, ForwardBatchBuilder, LoopPass
from specloop.runtime.graphs import LoopGraphs
from specloop.runtime.heads import DeviceHead, HeadContext, HostResults, SampleHead
from specloop.runtime.slot_storage import SlotStorage


@dataclasses.dataclass
class TicketOutput:
    """What a forward call hands back: host copies of its results, complete after `event`.

    Row i of `tokens` holds `groups[i]`'s emitted tokens: `counts[i]` of them (1 for a plain
    sample, accepted + 1 for a round's verification)."""

    plan: Plan
    groups: list[RowGroup]  # the plan's groups with a host result, in result order
    tokens: torch.Tensor | None  # [S, W] long on the host
    counts: torch.Tensor | None  # [S] long on the host
    accepted: torch.Tensor | None  # [S] long on the host: candidates accepted (0 for plain samples)
    logprobs: torch.Tensor | None  # [S, W] on the host
    event: torch.cuda.Event | None  # None on CPU: already complete
    released: torch.Tensor | None = None  # [C, P] long on the host: each plan.releases entry's
    # leading tail pages no query reads exact any more (a format that gives tails back: INT4 residuals)


class Runner:
    def __init__(self, model: OuroModel, backend: AttentionBackend, batches: ForwardBatchBuilder,
                 slots: SlotStorage, max_cells: int, exit_threshold: float, engine_seed: int,
                 heads: dict[type, DeviceHead] | None = None, features: Sequence[DeviceFeature] = ()) -> None:
        """`slots`: the token slot storage, with one slot past the pool's: the sink padding
        rows write (the forward batch's `pad_slot`)."""
        cfg = model.config
        self.model = model
        self.device = model.device
        self.num_loops = cfg.num_loops
        self.threshold = exit_threshold
        self.adaptive_exit = exit_threshold < 1.0
        self.backend = backend
        self.batches = batches
        self.graphs: LoopGraphs | None = None  # set by `use_graphs`
        self.slots = slots
        self.features = list(features)
        self.next_token = torch.zeros(max_cells, dtype=torch.long, device=self.device)
        self.heads: dict[type, DeviceHead] = {Sample: SampleHead(), **(heads or {})}
        self.context = HeadContext(model, self.next_token, engine_seed)
        self._pin = self.device.type == "cuda"

    def close(self) -> None:
        """Nothing outside this process to release (a tensor-parallel runner stops its workers)."""

    @torch.inference_mode()
    def execute(self, plan: Plan) -> TicketOutput:
        batch = self.batches.build(plan)
        slots = self.slots
        for feature in self.features:  # before anything reads the rows' slots or positions
            feature.prepare(batch)
        hidden = slots.hidden[batch.token_slots]
        if batch.enter_rows is not None:  # depth-0 rows: embed into fresh slots
            enter = batch.enter_rows
            ids = batch.token_ids[enter]
            ids = torch.where(ids < 0, self.next_token[batch.cells[enter]], ids)
            hidden[enter] = self.model.embed(ids)
            slots.enter(batch.token_slots[enter], ids, batch.enter_incarnations)
        final = None  # each row's output after its last loop (rows of pass p are a prefix)
        graphs = self.graphs
        tables_loaded = False
        for p, lp in enumerate(batch.passes):
            if graphs is not None and graphs.fits(lp):
                if not tables_loaded:
                    graphs.load_tables(lp.tables)
                    tables_loaded = True
                out = graphs.replay(lp, hidden[: lp.num_rows])
            else:
                out = self.run_pass(lp, hidden[: lp.num_rows])
            done = batch.passes[p + 1].num_rows if p + 1 < len(batch.passes) else 0  # rows going on
            if done == 0 and final is None:
                final = out
            else:  # rows [done, N_p) ran their last loop here
                if final is None:
                    final = out.new_empty(batch.num_rows, out.shape[1])
                final[done: lp.num_rows] = out[done:]
            hidden = out
        released = None  # copied before the heads record the ticket's event
        for feature in self.features:
            found = feature.finish(batch, final)
            if found is not None:
                released = _to_host(found, self._pin)
        out = self._heads(batch, final)
        if released is not None:
            out.released = released
            if out.event is None and self.device.type == "cuda":
                out.event = torch.cuda.Event()
                out.event.record()
        return out

    def run_pass(self, lp: LoopPass, hidden: torch.Tensor) -> torch.Tensor:
        """One loop over the pass's rows: attention through the backend, adaptive exit, slot
        writes (eager, or the body a CUDA graph captures)."""
        slots = self.slots
        rows = lp.token_slots
        keep = slots.exited[rows] if self.adaptive_exit else None
        for feature in self.features:
            feature.start_pass(lp, keep)
        meta = self.backend.build(lp, keep)
        out = self.model.loop(hidden, lp.positions, Bound(self.backend, meta))
        if self.adaptive_exit:
            out = self._exit(lp, rows, out, keep)
        slots.advance(rows, lp.depths, out)
        return out

    def use_graphs(self, graphs: LoopGraphs) -> None:
        """Replay loop passes that fit a bucket through `graphs` (captured here, now)."""
        graphs.capture()
        self.graphs = graphs

    def _exit(self, lp: LoopPass, rows: torch.Tensor, out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Q-exit on the device; newly exited tokens expose their K/V to deeper planes."""
        store = self.slots
        survival = store.survival[rows]
        exits, new_survival = exit_step(survival, self.model.exit_lambda(out), lp.depths + 1,
                                        self.num_loops, self.threshold)
        newly = exits & ~keep
        store.survival[rows] = torch.where(keep, survival, new_survival)
        store.exited[rows] = keep | exits
        src = lp.write_slots
        for plane in range(1, self.num_loops):
            deeper = newly & (lp.depths < plane)
            dst = lp.deeper_slots[:, plane]
            self.backend.kv.inherit(src, torch.where(dst >= 0, dst, src), deeper)
        return torch.where(keep[:, None], store.hidden[rows], out)

    def _heads(self, batch: ForwardBatch, out: torch.Tensor) -> TicketOutput:
        groups = batch.host_groups
        results = None
        if groups:
            width = max(g.head.num_candidates + 1 if isinstance(g.head, Verify) else 1 for g in groups)
            results = HostResults.zeros(len(groups), width, self.model.dtype, self.device)
        for kind, segment in batch.heads.items():
            self.heads[kind].run(self.context, batch, segment, out, results)
        if results is None:
            return TicketOutput(batch.plan, [], None, None, None, None, None)
        want_logprobs = any(g.head.params.logprobs for g in groups)
        host = [_to_host(t, self._pin) for t in (results.tokens, results.counts, results.accepted)]
        logprobs = _to_host(results.logprobs, self._pin) if want_logprobs else None
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return TicketOutput(batch.plan, groups, host[0], host[1], host[2], logprobs, event)


def _to_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
