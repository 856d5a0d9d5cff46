"""The scheduler: turns request state into plans of (token, depth) rows.

Invariant: there is no prefill or decode phase. Work is rows (token position, depth); a row
is ready when the token finished the previous depth in an earlier plan and every earlier
position of its request finished this depth in an earlier plan or is in the same group.
Per request and plane the KV manager's frontier is the scheduled (submitted) frontier:
tickets run in submission order on one device stream, so a later plan may read anything
an earlier plan writes without the CPU waiting for it.

Each plan spends at most `max_rows` rows: first the rows that finish tokens (deeper depths
first, requests in arrival order) and single-token decode rows, then prompt rows entering
depth 0 (chunked prefill). A request's prompt chunks therefore move through the depths as
a wavefront. Admission is FCFS by KV budget: a request reserves pages for its prompt plus
max_tokens, so a running request never runs out of pages and nothing is preempted.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from specloop.scheduling.kv_manager import KVManager
from specloop.scheduling.plan import Plan, RowGroup
from specloop.scheduling.request import Request, Status, new_incarnation
from specloop.scheduling.token_slots import TokenSlotPool
from specloop.pipeline.block import BlockSpeculation, unused_slots, unused_slots_of
from specloop.pipeline.token_pipeline import TokenPipeline


class SlotPool:
    """Free list of request slots (indices of per-request device state)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = collections.deque(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.popleft()

    def give(self, slots: list[int]) -> None:
        self._free.extend(slots)


class Scheduler:
    def __init__(
        self, kv: KVManager, num_loops: int, max_rows: int, max_seqs: int, num_token_slots: int,
        adaptive_exit: bool, speculation: BlockSpeculation | TokenPipeline | None = None,
    ) -> None:
        self.kv = kv
        self.num_loops = num_loops
        self.max_rows = max_rows
        self.adaptive_exit = adaptive_exit
        self.speculation = speculation
        self.token_slots = TokenSlotPool(num_token_slots)
        self.req_slots = SlotPool(max_seqs)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._next_ticket = 0
        self._completed = -1
        self._deferred: list[tuple[int, Callable[[], None]]] = []  # (release after ticket, action)
        self._failed: list[tuple[Request, Exception]] = []  # planning failures not yet taken

    # ---- requests -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a request now; its storage returns once every submitted ticket completed."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            slots = list(dict.fromkeys(list(req.hidden_slots.values()) + unused_slots(req)))
            self.token_slots.retire(slots)
            rid, req_slot = req.kv_key, req.req_slot
            self._defer(lambda: (self.kv.free(rid), self.token_slots.release(slots), self.req_slots.give([req_slot])))
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.incarnation = new_incarnation()  # results still in flight are now stale

    def ticket_done(self, ticket_id: int) -> None:
        """Release storage whose last user was a ticket up to `ticket_id`."""
        self._completed = ticket_id
        due = [a for t, a in self._deferred if t <= ticket_id]
        self._deferred = [(t, a) for t, a in self._deferred if t > ticket_id]
        for action in due:
            action()

    def _defer(self, action: Callable[[], None]) -> None:
        last_submitted = self._next_ticket - 1
        if last_submitted <= self._completed:
            action()
        else:
            self._deferred.append((last_submitted, action))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self.req_slots.num_free:
            req = self.waiting[0]
            if not self.kv.can_admit(req.reserve_tokens):
                return  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.add_request(req.kv_key, req.reserve_tokens)
            req.req_slot = self.req_slots.take()
            req.status = Status.RUNNING
            self.running.append(req)

    def schedule(self) -> Plan | None:
        """The next plan, or None when nothing is ready.

        Planning one request can fail without touching another: its exception is kept
        (`take_failed`), its groups planned so far stay in the plan (their results turn
        stale once the caller ends the request), and the others are planned as usual."""
        self._admit()
        budget = self.max_rows
        groups: list[RowGroup] = []
        release: list[int] = []
        prefills: list[tuple[Request, int, int]] = []
        for req in self.running:
            size, taken = len(groups), []
            try:
                self._plan_running(req, budget, groups, release, prefills, taken)
            except Exception as exc:
                self._failed.append((req, exc))
                self._retire_orphans(req, taken)
            budget -= sum(g.num_rows for g in groups[size:])
        # Single-token decodes before prompt chunks; each entering row needs a token slot.
        prefills.sort(key=lambda p: (p[2] > 1, p[0].arrival))
        for req, start, rows in prefills:
            take = min(budget, rows, self.token_slots.num_free)
            if take > 0:
                try:
                    groups.append(self._group(req, 0, start, start + take, req.num_tokens, release))
                except Exception as exc:
                    self._failed.append((req, exc))
                    continue
                budget -= take
        if not groups:
            return None
        plan = Plan(self._next_ticket, groups, self.adaptive_exit)
        self._next_ticket += 1
        if release:  # token slots that finished the last depth return once the ticket completes
            self.token_slots.finish(release)
            self._defer(lambda: self.token_slots.release(release))
        return plan

    def _retire_orphans(self, req: Request, taken: list[int]) -> None:
        """Slots taken while planning a request that failed before anything recorded them."""
        held = set(req.hidden_slots.values()) | set(unused_slots(req))
        orphans = [s for s in taken if s not in held]
        if orphans:
            self.token_slots.retire(orphans)
            self._defer(lambda: self.token_slots.release(orphans))

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """Requests whose planning raised since the last call; the caller ends each one."""
        failed, self._failed = self._failed, []
        return failed

    def _plan_running(self, req: Request, budget: int, groups: list[RowGroup], release: list[int],
                      prefills: list[tuple[Request, int, int]], taken: list[int]) -> None:
        """One running request's rows: the controller's, or the dense path's deeper rows
        (the rows entering depth 0 are queued in `prefills`). Token slots the controller
        takes are noted in `taken`, so a failure cannot leak them."""
        if req.speculating:
            def take(n: int) -> list[int] | None:
                slots = self.token_slots.take(n)
                taken.extend(slots or ())
                return slots

            for group in self.speculation.groups(req, budget, self._make_group, take):
                groups.append(group)
                budget -= group.num_rows
                if group.depth == self.num_loops - 1:
                    release.extend(group.hidden_slots)
            return
        frontiers = [self.kv.frontier(req.kv_key, d) for d in range(self.num_loops)]
        num_tokens = req.num_tokens
        for depth in range(self.num_loops - 1, 0, -1):
            take = min(budget, frontiers[depth - 1] - frontiers[depth])
            if take > 0:
                groups.append(self._group(req, depth, frontiers[depth], frontiers[depth] + take, num_tokens, release))
                budget -= take
        waiting_rows = num_tokens - frontiers[0]
        if waiting_rows > 0:
            prefills.append((req, frontiers[0], waiting_rows))

    def _group(self, req: Request, depth: int, start: int, end: int, num_tokens: int, release: list[int]) -> RowGroup:
        """A group of the dense path; the request's last row at full depth is sampled."""
        group = self._make_group(req, depth, start, end)
        if depth == self.num_loops - 1:
            release.extend(group.hidden_slots)
            if end == num_tokens and req.wants_more_samples:
                group.sample = req.params
                group.sample_index = req.produced
                req.produced += 1
                if self.speculation is not None:  # rounds take over from the first output token
                    req.speculating = True
                    self.speculation.start(req, base=end)
                elif req.wants_more_samples:
                    req.num_tokens += 1  # the sampled token's position exists from the next plan on
        return group

    def _make_group(self, req: Request, depth: int, start: int, end: int, slots: list[int] | None = None,
                    token_ids: list[int] | None = None) -> RowGroup:
        """Rows [start, end) of a request at one depth: token slots, KV slots, tables.

        Rows entering depth 0 take token slots (`slots` when the caller took them
        already); rows finishing the last depth give theirs back (the caller releases
        them once the plan's ticket completes).
        """
        rid = req.kv_key
        if depth == 0:
            self.kv.ensure(rid, end)
            taken = slots if slots is not None else self.token_slots.take(end - start)
            for pos, slot in zip(range(start, end), taken):
                req.hidden_slots[pos] = slot
        hidden = [req.hidden_slots[p] for p in range(start, end)]
        if depth == self.num_loops - 1:
            for pos in range(start, end):
                del req.hidden_slots[pos]
        self.kv.advance(rid, depth, end)
        prompt_len = len(req.prompt_ids)
        group = RowGroup(
            request_id=req.request_id, incarnation=req.incarnation, arrival=req.arrival, req_slot=req.req_slot,
            depth=depth, start=start, end=end,
            token_ids=token_ids or (req.prompt_ids[start:end] if depth == 0 and end <= prompt_len else None),
            hidden_slots=hidden,
            block_table=self.kv.block_table(rid, depth)[: -(-end // self.kv.block_size)],
            plane_slots=[self.kv.slots(rid, p, start, end) for p in range(self.num_loops)],
        )
        if depth == 0 and group.token_ids is None and end - start != 1:
            raise AssertionError("generated tokens enter depth 0 one at a time")
        return group

    def committed(self, req: Request, accepted: int, sample_index: int, token: int) -> None:
        """A committed verification of a speculating request: roll back rejected positions
        in every plane and free flushed tokens' slots; the controller plans what follows."""
        before = req.round
        keep, flushed = self.speculation.committed(req, accepted, sample_index, token)
        slots = [req.hidden_slots.pop(p) for p in flushed if p in req.hidden_slots]
        if req.round is not before:  # a replaced round's slots for rows it never drafted
            slots += unused_slots_of(before)
        if slots:
            self.token_slots.retire(slots)
            self._defer(lambda: self.token_slots.release(slots))
        if keep is not None:
            self.kv.truncate(req.kv_key, keep)
