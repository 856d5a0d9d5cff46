"""The runner: turns a plan into device tensors and runs one forward call.

It owns all device-side state between calls: KV pages, token slot storage (each live
token's hidden state, exit state, depth, candidate and incarnation), each request's
next-token cell and draft buffer. Nothing here reads a device value back to the CPU:
sizes come from the plan, sampled tokens stay on the device for the next plan and are
copied to pinned host memory asynchronously for the commit. On CPU the same code simply runs synchronously.
"""

from __future__ import annotations

import dataclasses

import torch

from specloop.runtime.attention import DecodeBatch, PagedAttention, PagedKVStorage, PrefillGroup
from specloop.scheduling.plan import Plan, RowGroup
from specloop.runtime.sampler import SamplingBatch, draw_generator, probabilities, sample
from specloop.runtime.slot_storage import SlotStorage
from specloop.model.exit_gate import exit_step
from specloop.model.ouro import OuroModel
from specloop.pipeline.acceptance import greedy_verify, speculative_sample, verify_single
from specloop.pipeline.replay import AcceptanceReplay


@dataclasses.dataclass
class SampleRecord:
    request_id: str
    incarnation: int
    sample_index: int
    num_drafts: int  # -1: a plain sample; else a verification of this many candidates
    controlled: bool  # the speculation controller must see the commit


@dataclasses.dataclass
class TicketOutput:
    """What a forward call hands back: host copies of the samples, complete after `event`.

    Row i of `tokens` holds record i's emitted tokens: `counts[i]` of them (1 for a plain
    sample, accepted + 1 for a verification)."""

    plan: Plan
    samples: list[SampleRecord]
    tokens: torch.Tensor | None  # [S, W] long on the host
    counts: torch.Tensor | None  # [S] long on the host
    accepted: torch.Tensor | None  # [S] long on the host: candidates accepted (0 for plain samples)
    logprobs: torch.Tensor | None  # [S, W] fp32 on the host
    event: torch.cuda.Event | None  # None on CPU: already complete


class Runner:
    def __init__(
        self, model: OuroModel, num_pages: int, block_size: int, num_token_slots: int, max_seqs: int,
        exit_threshold: float, engine_seed: int, num_speculative_tokens: int = 0,
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = model.device
        self.num_loops = cfg.num_loops
        self.threshold = exit_threshold
        self.engine_seed = engine_seed
        self.block_size = block_size
        self.storage = PagedKVStorage(cfg.num_hidden_layers, num_pages, block_size, cfg.num_key_value_heads,
                                      cfg.head_dim, model.dtype, self.device)
        self.backend = PagedAttention(self.storage)
        self.slots = SlotStorage(num_token_slots, cfg.hidden_size, model.dtype, self.device)
        self.next_token = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        k = num_speculative_tokens  # draft buffer width: block size, or R for token pipelines
        self.draft_tokens = torch.zeros(max_seqs, max(k, 1), dtype=torch.long, device=self.device)
        self.draft_probs = torch.zeros(max_seqs if k else 0, max(k, 1), cfg.vocab_size, device=self.device,
                                       dtype=torch.promote_types(model.dtype, torch.float32))
        self._pin = self.device.type == "cuda"
        self.replay: AcceptanceReplay | None = None  # benchmarks only: forced verification outcomes

    def _upload(self, values: list[int] | list[bool], dtype: torch.dtype = torch.long) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self._pin:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _generator(self, group: RowGroup, purpose: str) -> torch.Generator:
        """The generator of one draw, keyed by the request, a position and the purpose, so
        discarded speculative calls cannot shift the draws that count. Samples and drafts
        key by the sampled row; verifications by their first row (a round's base, which
        only grows, so no two verifications of a request share a key)."""
        position = group.start if group.verify else group.end - 1
        return draw_generator(group.sample.seed, self.engine_seed, group.arrival, position, purpose, self.device)

    @torch.inference_mode()
    def execute(self, plan: Plan) -> TicketOutput:
        rows = self._rows(plan)
        slots = self.slots
        hidden = slots.hidden[rows.hidden_slots]
        if rows.enter_index is not None:  # depth-0 rows: embed into fresh slots
            enter = rows.enter_index
            ids = torch.where(rows.from_device, self.next_token[rows.req_slots], rows.token_ids)[enter]
            hidden[enter] = self.model.embed(ids)
            slots.enter(rows.hidden_slots[enter], ids, rows.enter_incarnations)
        keep = slots.exited[rows.hidden_slots] if plan.adaptive_exit else None
        self._set_attention(plan, rows, keep)
        out = self.model.loop(hidden, rows.positions, self.backend)
        if plan.adaptive_exit:
            out = self._exit(rows, out, keep)
        slots.advance(rows.hidden_slots, rows.depths, out)
        return self._sample(plan, rows, out)

    def _exit(self, rows: "_Rows", out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Q-exit on the device; newly exited tokens expose their K/V to deeper planes."""
        slots, store = rows.hidden_slots, self.slots
        survival = store.survival[slots]
        exits, new_survival = exit_step(survival, self.model.exit_lambda(out), rows.depths + 1,
                                        self.num_loops, self.threshold)
        newly = exits & ~keep
        store.survival[slots] = torch.where(keep, survival, new_survival)
        store.exited[slots] = keep | exits
        for plane in range(1, self.num_loops):
            deeper = newly & (rows.depths < plane)
            self.storage.inherit(rows.write_slots, rows.plane_slots[:, plane], deeper)
        return torch.where(keep[:, None], store.hidden[slots], out)

    def _set_attention(self, plan: Plan, rows: "_Rows", keep: torch.Tensor | None) -> None:
        b = self.backend
        b.write_slots, b.keep, b.prefills, b.decodes = rows.write_slots, keep, [], None
        bs = self.block_size
        singles = []
        offset = 0
        for group in plan.groups:
            n = group.num_rows
            if n == 1:
                singles.append((offset, group))
            else:
                table = self._upload(group.block_table)
                span = torch.arange(group.end, device=self.device)
                key_slots = table[span // bs] * bs + span % bs
                query_pos = torch.arange(group.start, group.end, device=self.device)
                b.prefills.append(PrefillGroup(slice(offset, offset + n), key_slots, span[None, :] <= query_pos[:, None]))
            offset += n
        if singles:
            width = max(len(g.block_table) for _, g in singles)
            tables = self._upload([g.block_table + [0] * (width - len(g.block_table)) for _, g in singles])
            lengths = self._upload([g.end for _, g in singles])
            span = torch.arange(width * bs, device=self.device)
            key_slots = tables[:, span // bs] * bs + span % bs
            b.decodes = DecodeBatch(self._upload([o for o, _ in singles]), key_slots, span[None, :] < lengths[:, None])

    def _sample(self, plan: Plan, rows: "_Rows", out: torch.Tensor) -> TicketOutput:
        if plan.drafts:
            self._draft(plan.drafts, rows, out)
        groups = plan.samples
        if not groups:
            return TicketOutput(plan, [], None, None, None, None, None)
        width = max(g.num_rows if g.verify else 1 for g in groups)
        tokens = torch.zeros(len(groups), width, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(len(groups), width, dtype=torch.promote_types(self.model.dtype, torch.float32),
                               device=self.device)
        counts = torch.ones(len(groups), dtype=torch.long, device=self.device)
        accepted = torch.zeros(len(groups), dtype=torch.long, device=self.device)
        plain = [i for i, g in enumerate(groups) if not g.verify]
        if plain:  # one head and one sampling call for every plain sample of the plan
            index = self._upload([rows.offsets[id(groups[i])] + groups[i].num_rows - 1 for i in plain])
            logits = self.model.head(out[index])
            batch = SamplingBatch.build([groups[i].sample for i in plain],
                                        [self._generator(groups[i], "sample") for i in plain], self.device)
            chosen = sample(logits, batch).token_ids
            self.next_token[self._upload([groups[i].req_slot for i in plain])] = chosen
            where = self._upload(plain)
            tokens[where, 0] = chosen
            logprobs[where, 0] = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None]).squeeze(1)
        for i, group in enumerate(groups):
            if not group.verify:
                continue
            first = rows.offsets[id(group)]
            logits = self.model.head(out[first : first + group.num_rows])
            cell = group.req_slot
            if group.candidate_index >= 0:  # token pipeline: one candidate, no bonus
                ok, emitted = self._verify_single(group, logits[0])
                # accepted: the cell keeps the newest draft; rejected: restart from the correction
                self.next_token[cell : cell + 1] = torch.where(ok.bool(), self.next_token[cell], emitted).view(1)
                emitted = emitted.view(1)
                accepted[i] = ok
            else:
                count, emitted = self._verify(group, logits)
                self.next_token[cell : cell + 1] = emitted.gather(0, (count - 1).view(1))
                counts[i] = count
                accepted[i] = count - 1
            n = emitted.shape[0]
            tokens[i, :n] = emitted
            logprobs[i, :n] = torch.log_softmax(logits[:n], dim=-1).gather(1, emitted[:, None]).squeeze(1)
        event = None
        host_tokens = _to_host(tokens, self._pin)
        host_counts = _to_host(counts, self._pin)
        host_accepted = _to_host(accepted, self._pin)
        want_logprobs = any(g.sample.logprobs for g in groups)
        host_logprobs = _to_host(logprobs, self._pin) if want_logprobs else None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        records = [SampleRecord(g.request_id, g.incarnation, g.sample_index, _num_drafts(g), g.controlled)
                   for g in groups]
        return TicketOutput(plan, records, host_tokens, host_counts, host_accepted, host_logprobs, event)

    def _draft(self, groups: list[RowGroup], rows: "_Rows", out: torch.Tensor) -> None:
        """Draft samples: the candidate goes to the next-token cell and the draft buffer."""
        index = self._upload([rows.offsets[id(g)] + g.num_rows - 1 for g in groups])
        logits = self.model.head(out[index])
        batch = SamplingBatch.build([g.sample for g in groups], [self._generator(g, "draft") for g in groups],
                                    self.device)
        drafted = sample(logits, batch).token_ids
        cells = self._upload([g.req_slot for g in groups])
        positions = self._upload([g.draft_index for g in groups])
        self.next_token[cells] = drafted
        self.draft_tokens[cells, positions] = drafted
        if not batch.all_greedy:
            self.draft_probs[cells, positions] = probabilities(logits, batch)

    def _verify_single(self, group: RowGroup, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        candidate = self.draft_tokens[group.req_slot, group.candidate_index]
        if self.replay is not None:  # benchmark: force the recorded outcome
            ok = self.replay.next_accepted(1)
            return torch.full((), ok, dtype=torch.long, device=self.device), candidate if ok else logits.argmax()
        if group.sample.is_greedy:
            return verify_single(logits, candidate)
        gen = self._generator(group, "verify")
        target = probabilities(logits[None], SamplingBatch.build([group.sample], [gen], self.device))[0]
        return verify_single(logits, candidate, target, self.draft_probs[group.req_slot, group.candidate_index], gen)

    def _verify(self, group: RowGroup, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = group.num_rows - 1
        candidates = self.draft_tokens[group.req_slot, :k]
        if self.replay is not None:  # benchmark: force the recorded outcome (a host value, no sync)
            n = self.replay.next_accepted(k)
            forced = torch.cat([candidates[:n], logits[n].argmax().view(1), candidates.new_zeros(k - n)])
            return torch.full((), n + 1, dtype=torch.long, device=self.device), forced
        if group.sample.is_greedy:
            return greedy_verify(logits, candidates)
        gen = self._generator(group, "verify")
        batch = SamplingBatch.build([group.sample] * (k + 1), [gen] * (k + 1), self.device)
        target = probabilities(logits, batch)
        return speculative_sample(target, self.draft_probs[group.req_slot, :k], candidates, gen)

    def _rows(self, plan: Plan) -> "_Rows":
        token_ids, from_device, req_slots, positions, depths = [], [], [], [], []
        hidden_slots, write_slots, plane_slots, enter_index, enter_incarnations = [], [], [], [], []
        offsets: dict[int, int] = {}
        for group in plan.groups:
            n = group.num_rows
            base = len(positions)
            offsets[id(group)] = base
            if group.depth == 0:
                enter_index.extend(range(base, base + n))
                enter_incarnations.extend([group.incarnation] * n)
            token_ids.extend(group.token_ids if group.token_ids is not None else [0] * n)
            from_device.extend([group.token_ids is None] * n)
            req_slots.extend([group.req_slot] * n)
            positions.extend(range(group.start, group.end))
            depths.extend([group.depth] * n)
            hidden_slots.extend(group.hidden_slots)
            write_slots.extend(group.plane_slots[group.depth])
            if plan.adaptive_exit:
                plane_slots.extend(zip(*group.plane_slots))
        up = self._upload
        return _Rows(
            token_ids=up(token_ids), from_device=up(from_device, torch.bool), req_slots=up(req_slots),
            positions=up(positions), depths=up(depths), hidden_slots=up(hidden_slots),
            write_slots=up(write_slots), plane_slots=up([list(p) for p in plane_slots]) if plane_slots else None,
            enter_index=up(enter_index) if enter_index else None,
            enter_incarnations=up(enter_incarnations) if enter_index else None, offsets=offsets,
        )


@dataclasses.dataclass
class _Rows:
    token_ids: torch.Tensor
    from_device: torch.Tensor
    req_slots: torch.Tensor
    positions: torch.Tensor
    depths: torch.Tensor
    hidden_slots: torch.Tensor
    write_slots: torch.Tensor
    plane_slots: torch.Tensor | None  # [N, R] when adaptive exit is on
    enter_index: torch.Tensor | None  # rows entering depth 0 (None: no row enters)
    enter_incarnations: torch.Tensor | None
    offsets: dict[int, int]  # id(group) -> its first row


def _num_drafts(group: RowGroup) -> int:
    if not group.verify:
        return -1
    return 1 if group.candidate_index >= 0 else group.num_rows - 1


def _to_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
