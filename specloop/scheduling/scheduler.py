"""The scheduler: turns request state into plans of (token, depth) rows.

Invariant: there is no prefill or decode phase. Work is rows (token position, depth); a row
is ready when the token finished the previous depth in an earlier plan and every earlier
position of its request finished this depth in an earlier plan or is in the same group.
Per request and plane the KV manager's frontier is the scheduled (submitted) frontier:
tickets run in submission order on one device stream, so a later plan may read anything
an earlier plan writes without the CPU waiting for it.

Controllers decide which rows a request needs (`DenseController`, and the speculation
controller injected from `specloop.pipeline`); the scheduler is the plan's one writer: it
builds every group (KV frontiers, page tables, token slots) for them. Each plan spends at
most `max_rows` rows: first the rows that finish tokens (deeper depths first, requests in
arrival order) and speculation rows, then rows entering depth 0, single-token decodes
before prompt chunks (chunked prefill), so a request's prompt chunks move through the
depths as a wavefront.

Admission is FCFS by need: a request is admitted when the pages of its prompt (plus one
page per plane to decode into, and a small watermark while others run) are unclaimed,
and its prompt's pages are taken then. Before each plan every running request's tables
grow to cover what the plan may enter at depth 0 (`_need`), oldest first; when the pool
cannot serve, the latest-arrived running request is preempted (recompute: its KV, token
slots and cell return once the tickets in flight completed, and it waits at the head of
the queue to re-enter its prompt and committed tokens; swap: it is no longer planned, and
once its last ticket completed the engine snapshots it to host memory and frees its
storage, `swap_out`, and restores it at admission, `swap_in`), so preempted requests
resume before new admissions. Growing there, before any controller plans, keeps planning free
of page failures: `build_group` only draws on pages already covered.

Automatic prefix caching (`prefix_cache`, BF16 pages): a request's prompt is cut into
full blocks named by chained hashes, computed once (`Request.block_hashes`). At admission
the cached leading blocks, up to the one before the block holding its last host token
(that token's final hidden state feeds the head, so it is always computed), become the head
of every plane's table and every plane's frontier starts past them: cached blocks are
skipped at every depth. Their pages are shared, not taken, and cannot be evicted to make
room for the rest of the request; otherwise the cache's idle pages count as room and are
evicted, least recently used first, before anyone is refused or preempted (`KVManager`).
A request offers each full prompt block of its own to the cache once the plan whose group
finishes it at the last depth has completed (`_completed_blocks`): at that ticket's
`ticket_done`, every plane and layer of the block is on the device (see `_completed_blocks`
for why then). A request restored from a snapshot holds fresh pages and offers its blocks
(`restored`). Only what the prompt planning calls shareable is looked up or offered
(`PromptPlanning.shared_prefix`): every block, or whole windows of them with token-sparse
prefill. With INT4 residuals (planes give their leading pages back) a request keeps its
prompt pages until it has offered them (`_unpublished`), and one that hits them encodes its
own records from them (`KVManager.add_request`, the KV format's `adopt`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from specloop.scheduling.controller import Commit, Controller
from specloop.scheduling.kv_manager import KVManager
from specloop.plan import Head, Plan, ReleaseScan, RowGroup, SparseWindow
from specloop.scheduling.prefix_cache import PrefixCache, block_hashes
from specloop.scheduling.prompts import DensePrompts, PromptPlanning
from specloop.scheduling.request import Request, Status, new_incarnation
from specloop.scheduling.token_slots import TokenSlotPool


# A block as `PrefixCache.publish` takes it: hash, pages (one a plane), parent hash, the
# request's own pages of the parent block
PublishedBlock = tuple[bytes, tuple[int, ...], bytes | None, tuple[int, ...] | None]
ALL_COMMITTED = 2**62  # ReleaseScan.committed of a request without candidates


class CellPool:
    """Free list of request cells (indices of per-request device state)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = collections.deque(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.popleft()

    def give(self, cells: list[int]) -> None:
        self._free.extend(cells)


class _PlanBuilder:
    """The `GroupBuilder` the controllers plan one request through; one per request and plan.

    Token slots it hands out are noted, so a controller that fails half-way cannot leak them."""

    def __init__(self, scheduler: "Scheduler", release: list[int], entries: list[tuple[Request, int, int]]) -> None:
        self._s = scheduler
        self._release = release
        self._entries = entries
        self.taken: list[int] = []
        self.max_loops = scheduler.num_loops if scheduler.multi_loop else 1

    def group(self, req: Request, depth: int, start: int, end: int, *, head: Head = None,
              slots: list[int] | None = None, token_ids: list[int] | None = None, loops: int = 1) -> RowGroup:
        return self._finished(self._s.build_group(req, depth, start, end, head, slots, token_ids, loops))

    def window_group(self, req: Request, depth: int, start: int, end: int, window: SparseWindow,
                     head: Head = None) -> RowGroup:
        return self._finished(self._s.build_group(req, depth, start, end, head, None, None, 1, window=window))

    def page_table(self, req: Request, plane: int, end: int) -> list[int]:
        """The pages of the request's plane covering positions [0, end)."""
        return self._s.kv.page_table(req.kv_key, plane)[: -(-end // self._s.kv.block_size)]

    def _finished(self, group: RowGroup) -> RowGroup:
        if group.last_depth == self._s.num_loops - 1 and group.completes:
            self._release.extend(group.token_slots)  # slots of finished tokens return once the ticket completed
        return group

    def take_slots(self, n: int) -> list[int] | None:
        """Slots for n generated tokens (drafts, a pipeline's new live tokens)."""
        slots = self._s.token_slots.take(n, decode=True)
        self.taken.extend(slots or ())
        return slots

    def frontier(self, req: Request, depth: int) -> int:
        return self._s.kv.frontier(req.kv_key, depth)

    def queue_entry(self, req: Request, start: int, rows: int) -> None:
        self._entries.append((req, start, rows))


class Scheduler:
    def __init__(
        self, kv: KVManager, num_loops: int, max_rows: int, max_seqs: int, num_token_slots: int,
        adaptive_exit: bool, speculation: Controller | None = None, preemption_mode: str = "recompute",
        prompts: PromptPlanning | None = None, decode_slots: int = 0, prefix_cache: PrefixCache | None = None,
        prefix_salt: str = "",
    ) -> None:
        """`prompts`: how prompt positions are planned (default `DensePrompts`; token-sparse
        prefill plans windows); `decode_slots`: the token-slot sub-pool generated tokens take
        (sparse decode attention's reference rooms, `TokenSlotPool`); 0: one pool for every
        token; `prefix_cache`: automatic prefix caching over `kv`'s pages (None: off), whose
        block hashes are salted with `prefix_salt`, the engine's cache identity."""
        self.kv = kv
        self.num_loops = num_loops
        self.max_rows = max_rows
        self.adaptive_exit = adaptive_exit
        self.speculation = speculation
        self.prompts = prompts if prompts is not None else DensePrompts()
        self.dense = self.prompts.controller(num_loops, speculation)
        self.multi_loop = True  # groups may run several loops per call (tests turn it off to compare)
        # Admission reserving prompt + max_tokens up front (never preempts): the older policy,
        # kept for benchmarks that compare it with admission by need.
        self.reserve_max_tokens = False
        self.watermark_pages = max(kv.num_planes, kv.num_pages // 100)  # kept free at admission while others run
        self.num_preemptions = 0
        self._returning = 0  # pages of preempted requests whose release waits for a ticket
        self.preemption_mode = preemption_mode
        # Swap preemption's device half, set by the engine: snapshot a quiet request to host
        # memory and free its storage; restore one at admission (False: no room yet).
        self.swap_out: Callable[[Request], None] | None = None
        self.swap_in: Callable[[Request], bool] | None = None
        self._swapping: dict[int, int] = {}  # arrival -> pages of requests being swapped out
        self.prefix_cache = prefix_cache
        self.prefix_salt = prefix_salt
        self.token_slots = TokenSlotPool(num_token_slots, decode_slots)
        self.cells = CellPool(max_seqs)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._next_ticket = 0
        self._completed = -1
        self._deferred: list[tuple[int, Callable[[], None]]] = []  # (release after ticket, action)
        self._failed: list[tuple[Request, Exception]] = []  # planning failures not yet taken

    def controller(self, req: Request) -> Controller:
        return self.speculation if req.speculating else self.dense

    # ---- requests -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a request now; its storage returns once every submitted ticket completed."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status in (Status.RUNNING, Status.SWAPPING):
            returning = self._swapping.pop(req.arrival, 0) if req.status is Status.SWAPPING else 0
            if req.status is Status.RUNNING:
                self.running.remove(req)
            self._drop_storage(req, returning)
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

    def _drop_storage(self, req: Request, returning: int = 0, now: bool = False) -> None:
        """Give back the request's pages, token slots and cell: once the tickets in flight
        completed, or `now` when none holds its rows; `returning` pages then leave the count
        of preempted pages on their way back."""
        slots = list(dict.fromkeys(list(req.token_slots.values()) + self.controller(req).held_slots(req)))
        self.token_slots.retire(slots)
        key, cell = req.kv_key, req.cell

        def release() -> None:
            self.kv.free(key)
            self.token_slots.release(slots)
            self.cells.give([cell])
            self._returning -= returning

        if now:
            release()
        else:
            self._defer(release)

    def preempt(self, req: Request) -> None:
        """Preempt a running request (`preemption_mode`). Recompute: its KV, token slots and
        cell return once the tickets in flight completed (their results turn stale), and it
        waits at the head of the queue to re-enter its prompt and committed tokens
        (`Request.replay`). Swap: it is no longer planned; once its last ticket completed (and
        committed) the engine's `swap_out` snapshots and frees it, and it waits at the head of
        the queue for `swap_in`."""
        self.running.remove(req)
        self.num_preemptions += 1
        pages = self.kv.held_pages(req.kv_key)
        self._returning += pages
        if self.preemption_mode == "swap":
            req.status = Status.SWAPPING
            self._swapping[req.arrival] = pages
            self._defer(lambda: self._swap_out(req))
            return
        self._drop_storage(req, pages)
        committed = req.output_ids
        if self.speculation is not None and committed:  # the controller resumes from the last one
            req.replay, req.resume_token = committed[:-1], committed[-1]
        else:
            req.replay, req.resume_token = list(committed), None
        req.num_tokens, req.produced = req.num_host_tokens, len(committed)
        req.speculating, req.round, req.token_slots, req.cell = False, None, {}, -1
        req.window_rows, req.published_blocks = {}, 0  # its next residency looks the prefix up again
        req.num_preemptions += 1
        req.incarnation = new_incarnation()
        req.status = Status.WAITING
        self.waiting.appendleft(req)  # victims go latest-arrived first, so the queue's head stays oldest

    def _swap_out(self, req: Request) -> None:
        """A swapping request's last ticket completed: snapshot it, free its storage, queue it."""
        if req.status is not Status.SWAPPING:
            return  # it finished or failed while its last tickets committed
        self.swap_out(req)  # the engine snapshots it into req.swapped
        self._drop_storage(req, self._swapping.pop(req.arrival), now=True)
        req.token_slots, req.cell = {}, -1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ---- planning -------------------------------------------------------------------
    def _can_admit(self, req: Request, hits: list[bytes]) -> bool:
        """`hits`: the hashes of the request's leading blocks the prefix cache holds; their
        pages are shared, not taken, and may not be evicted to make room for the rest."""
        shared = len(hits) * self.kv.num_planes
        if self.reserve_max_tokens:
            return self.kv.can_take(self.kv.pages_for(req.reserve_tokens) - shared, hits)
        spare = self.watermark_pages if self.running else 0  # a lone request may use the whole pool
        if self.kv.releases_tails:
            return self._prompt_fits(req, spare, hits)
        tokens = min(self._prompt_cover(req, req.num_host_tokens) + self.kv.block_size, req.reserve_tokens)
        if not self.kv.records_free_for(tokens, len(req.prompt_ids)):
            return False
        return self.kv.can_take(self.kv.pages_for(tokens) - shared + spare, hits)

    def _prompt_fits(self, req: Request, spare: int, hits: list[bytes]) -> bool:
        """With a KV format whose prompts grow a plan at a time (INT4 residuals): admit only
        while the prompts already entering theirs can still reach their pages at once and
        records for their whole prompt with this one's added, so prompts growing together
        never preempt each other (before 2026-12-06 admission counted a prompt's first plan
        only: 32 prompts of 8K on the H200 took 27 preemptions, each recomputing its prompt).
        Pages the prefix cache can evict count as room (its `hits` excepted), as elsewhere."""
        shared = len(hits) * self.kv.num_planes  # cached pages it takes references on, not new ones
        pages = min(self.kv.pages_at_once(req.reserve_tokens), self.kv.pages_for(req.reserve_tokens) - shared)
        records = self.kv.records_for_new(req.num_host_tokens, len(req.prompt_ids))
        for r in self.running:
            if self.kv.frontier(r.kv_key, 0) < r.num_host_tokens:  # still entering its prompt
                more_pages, more_records = self.kv.prompt_claim(r.kv_key, r.reserve_tokens, r.num_host_tokens)
                pages += more_pages
                records += more_records
        return records <= self.kv.num_free_records and self.kv.can_take(pages + spare, hits)

    def _admit(self) -> list[Request]:
        """Admit from the head of the queue while there is room; returns the admitted."""
        admitted: list[Request] = []
        if self._swapping:
            return admitted  # a request being swapped out resumes before anyone new is admitted
        while self.waiting and self.cells.num_free:
            req = self.waiting[0]
            if req.swapped is not None:  # swapped out: the engine restores it if there is room
                if not self.swap_in(req):
                    return admitted
                admitted.append(self.running[-1])  # the restored request
                continue
            lookup = self._lookup_hashes(req)
            hits = lookup[:self._usable_hits(req, self.prefix_cache.cached_prefix(lookup))] if lookup else []
            if not self._can_admit(req, hits):
                # its hits are pinned, not room: without them it may fit where they can be evicted
                # (INT4: a prompt's own cached blocks after a preemption, filling the pool)
                if not hits or not self._can_admit(req, []):
                    return admitted  # FCFS: nobody overtakes the head of the queue
                hits = []
            self.waiting.popleft()
            prefix = []  # the hits: counted (the request's every position as queried, as vLLM counts), marked recent
            if self.prefix_cache is not None:
                prefix = self.prefix_cache.lookup(lookup, len(hits), req.num_host_tokens)
            assert len(prefix) == len(hits), "nothing changed the cache since it was asked"
            self.kv.add_request(req.kv_key, req.reserve_tokens if self.reserve_max_tokens else 0, len(req.prompt_ids),
                                prefix=prefix)
            req.published_blocks = len(prefix)
            self.kv.ensure(req.kv_key, self._prompt_cover(req, req.num_host_tokens))  # the prompt's pages, now
            req.cell = self.cells.take()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _lookup_hashes(self, req: Request) -> list[bytes]:
        """The hashes of the request's blocks admission looks up (none without a prefix
        cache): full prompt blocks before the one holding its last host token, whose final
        hidden state feeds the head (after a recompute preemption the host tokens run past
        the prompt, so its last block may be looked up too). Hashed once per request."""
        if self.prefix_cache is None:
            return []
        if req.block_hashes is None:
            req.block_hashes = block_hashes(req.prompt_ids, self.kv.block_size, self.prefix_salt)
        blocks = min((req.num_host_tokens - 1) // self.kv.block_size, len(req.block_hashes))
        return req.block_hashes[:self._usable_hits(req, blocks)]

    def _usable_hits(self, req: Request, blocks: int) -> int:
        """How many of the request's `blocks` leading prompt blocks it may take from the
        cache: all of them, or whole windows of them with token-sparse prefill."""
        return self.prompts.shared_prefix(req, blocks * self.kv.block_size) // self.kv.block_size

    def _completed_blocks(self, groups: list[RowGroup]) -> list[tuple[Request, int, PublishedBlock]]:
        """The full prompt blocks this plan completes, each with its request and index, as
        `PrefixCache.publish` takes them (hash, one page per plane, parent hash): those of
        its groups that finish positions at the last depth. The plan writes them; earlier plans wrote them at shallower depths (a
        row is planned only once its previous depth was), and with adaptive exit a token that
        exited at depth e wrote its K/V into every deeper plane in the pass where it exited,
        which is no later than this one. Only prompt positions are offered: they are never
        rolled back (speculation's candidates and a recompute's replay lie past the prompt).

        They are published once the plan's ticket completed (`ticket_done`), when the device
        has written them whatever happened on the host meanwhile; only groups that made it
        into the plan are offered. Publishing when the plan is built would serve readers as
        well (tickets run in submission order on one stream, and a request that hits the
        block is admitted in a later `schedule`, so its plans run after this one), but a
        group built and then lost to a planning failure would leave a block in the cache
        that nothing wrote. The request holds the pages until then: its storage returns
        through a deferred action queued after this one (`_defer` runs them in order), and
        `KVManager.truncate` never reaches prompt pages."""
        if self.prefix_cache is None:
            return []
        by_cell = {req.cell: req for req in self.running}
        blocks = []
        for group in groups:
            req = by_cell.get(group.cell)
            if req is None or req.block_hashes is None or group.last_depth != self.num_loops - 1 \
                    or not group.completes:
                continue
            first = req.published_blocks
            blocks += [(req, first + i, block)
                       for i, block in enumerate(self._blocks_up_to(req, group.end // self.kv.block_size))]
        return blocks

    def _blocks_up_to(self, req: Request, done: int) -> list[PublishedBlock]:
        """The request's prompt blocks from its first unpublished one up to block `done`
        (exclusive), as `PrefixCache.publish` takes them; they count as published from now."""
        hashes, first = req.block_hashes, req.published_blocks
        done = min(done, self._usable_hits(req, len(hashes)))
        if done <= first:
            return []
        if any(self.kv.released(req.kv_key, p) > first for p in range(self.num_loops)):
            # pages given back before it was offered (a restored snapshot of INT4 residuals): the
            # chain is broken there, and later blocks could never be reached
            req.published_blocks = self._usable_hits(req, len(hashes))
            return []
        tables = [self.kv.page_table(req.kv_key, plane) for plane in range(self.num_loops)]
        req.published_blocks = done
        def pages(i: int) -> tuple[int, ...]:
            return tuple(table[i] for table in tables)
        return [(hashes[i], pages(i), hashes[i - 1] if i else None, pages(i - 1) if i else None)
                for i in range(first, done)]

    def restored(self, req: Request) -> None:
        """A running request rebuilt from a snapshot (swap-in or `restore`): its prompt
        blocks written at every depth go to the prefix cache now (the restore copied them
        into its own pages, ahead of any later reader on the stream), and later ones as its
        plans complete them. A snapshot carries no hashes; they are recomputed."""
        if self.prefix_cache is None:
            return
        req.block_hashes = block_hashes(req.prompt_ids, self.kv.block_size, self.prefix_salt)
        req.published_blocks = 0
        if self.kv.releases_tails:
            # INT4 residuals: a block goes to the cache with the device's note of which of its
            # rows each plane holds, made by the plan that finished it; a restore has none
            req.published_blocks = self._usable_hits(req, len(req.block_hashes))
            return
        last = self.kv.frontier(req.kv_key, self.num_loops - 1)
        self._publish(self._blocks_up_to(req, last // self.kv.block_size))

    def _publish(self, blocks: list[PublishedBlock]) -> None:
        """Offer blocks a completed ticket wrote to the prefix cache (one already cached, or
        whose parent was evicted meanwhile or is cached as a twin's pages, is left out and
        stays its request's own)."""
        for block in blocks:
            self.prefix_cache.publish(*block)

    def _need(self, req: Request) -> int:
        """Positions the request's tables must cover before it is planned. Every row a plan
        enters at depth 0 lies below it: a dense request enters its existing positions (prompt
        chunks, the next token), a speculating one at most one row per plan, at its depth-0
        frontier (a draft row, a pipeline's newest token)."""
        if req.speculating:
            return min(self.kv.frontier(req.kv_key, 0) + 1, req.reserve_tokens)
        if self.kv.releases_tails:  # a plan's worth of prompt rows at a time (see _prompt_cover)
            return min(req.num_tokens, self.kv.frontier(req.kv_key, 0) + self.prompt_ahead(req))
        return req.num_tokens

    def _prompt_cover(self, req: Request, prompt_tokens: int) -> int:
        """Positions a prompt's tables cover at admission: all of them, except in a KV format
        whose planes give their leading pages back (INT4 residuals: the BF16 tail pages go back
        as the prompt's groups seal): there a prompt takes pages `prompt_ahead` positions past
        its depth-0 frontier at a time (`_need`), so its working set is the wavefront's span,
        not the whole prompt."""
        return min(prompt_tokens, self.prompt_ahead(req)) if self.kv.releases_tails else prompt_tokens

    def prompt_ahead(self, req: Request) -> int:
        """Prompt positions one plan may enter at depth 0 past the request's frontier when the
        KV format's spans assume a chunk (`KVManager.prompt_ahead`): at most a plan's rows."""
        return min(self.max_rows, self.kv.prompt_ahead(req.reserve_tokens))

    def _make_room(self) -> set[int]:
        """Grow every running request's tables to `_need`, oldest first, preempting the
        latest-arrived running request while the pool cannot serve. A request that cannot
        grow while preempted pages are still on their way back sits this plan out (returns
        the arrivals of those) rather than preempting more."""
        blocked: set[int] = set()
        for req in sorted(self.running, key=lambda r: r.arrival):
            while req.status is Status.RUNNING:
                need = self._need(req)
                if self.kv.can_ensure(req.kv_key, need):
                    self.kv.ensure(req.kv_key, need)
                    break
                if self._returning:
                    blocked.add(req.arrival)
                    break
                self.preempt(max(self.running, key=lambda r: r.arrival))
        return blocked

    def schedule(self) -> Plan | None:
        """The next plan, or None when nothing is ready.

        Planning one request can fail without touching another: its exception is kept
        (`take_failed`), its groups planned so far stay in the plan (their results turn
        stale once the caller ends the request), and the others are planned as usual."""
        blocked = self._make_room()
        if self._admit():  # a restored request may need to grow for this plan too, preempting as above
            blocked |= self._make_room()  # (blocking it instead stalled when restores had filled the pool)
        budget = self.max_rows
        groups: list[RowGroup] = []
        release: list[int] = []
        entries: list[tuple[Request, int, int]] = []
        for req in self.running:
            if req.arrival in blocked:
                continue
            builder = _PlanBuilder(self, release, entries)
            try:
                planned = self.controller(req).plan(req, budget, builder)
            except Exception as exc:
                self._fail(req, exc, builder)
                continue
            groups.extend(planned)
            budget -= sum(g.cost for g in planned)
        # Single-token decodes before prompt chunks; each entering row needs a token slot.
        entries.sort(key=lambda e: (e[2] > 1, e[0].arrival))
        may_start = True  # until an older prompt waits for a window's slots: then nobody younger starts one
        for req, start, rows in entries:
            if self.kv.releases_tails:  # (the KV format's spans assume no more: `_need`)
                rows = min(rows, self.prompt_ahead(req))
            take = self._entry_rows(req, start, min(budget, rows), may_start)
            if take < min(budget, rows) and budget > 0:
                may_start = False
            if take > 0:
                loops = self._entry_loops(req, start, take, budget)
                builder = _PlanBuilder(self, release, entries)
                try:
                    groups.append(self.dense.group(req, 0, start, start + take, builder, loops))
                except Exception as exc:
                    self._fail(req, exc, builder)
                    continue
                budget -= take * loops
        if not groups:
            return None
        plan = Plan(self._next_ticket, groups, self.adaptive_exit)
        if self.kv.releases_tails:
            plan.releases = self._release_scans(groups)
        completed = self._completed_blocks(groups)
        if completed and self.kv.releases_tails:  # (INT4 residuals: the device notes which rows they hold)
            plan.cached_blocks = [(req.cell, i * self.kv.block_size, block[1]) for req, i, block in completed]
        self._next_ticket += 1
        if release:  # token slots that finished the last depth return once the ticket completes
            self.token_slots.finish(release)
            self._defer(lambda: self.token_slots.release(release))
        if completed:  # full prompt blocks go to the prefix cache once the ticket wrote them
            self._defer(lambda: self._publish([block for _, _, block in completed]))
        return plan

    def _release_scans(self, groups: list[RowGroup]) -> list[ReleaseScan]:
        """Planes that give pages back (INT4 residuals): for each request in the plan, where the device should look for
        tail pages no query will read exact again once the plan ran: from each plane's
        released pages up to the plane's frontier (the plan's rows counted; the next plane's
        too with token-sparse prefill, whose windows copy the plane's exact values into the
        next plane for the tokens they leave out), or the committed tokens when the request
        speculates (a rejection re-runs the positions after them); and the committed bound
        itself. A plane's tail is read exact only by queries of its own depth (a query reads
        the tail of its own plane, where inheritance copies live), so a wavefront prefill's
        shallow planes give their pages back behind their own frontier, not the deepest's."""
        by_cell = {req.cell: req for req in self.running}
        scans = []
        for cell in dict.fromkeys(g.cell for g in groups):
            req = by_cell[cell]
            key = req.kv_key
            frontiers = [self.kv.frontier(key, p) for p in range(self.num_loops)]
            frontiers = self.prompts.release_frontiers(frontiers)
            hold = self._unpublished(req)
            if hold is not None:  # prompt pages wait for the prefix cache (`_unpublished`)
                frontiers = [min(f, hold) for f in frontiers]
            released = [self.kv.released(key, p) for p in range(self.num_loops)]
            # a speculating request's rows past its committed tokens are candidates: no group
            # holding one may seal (the serial policy); every other row is committed
            committed = len(req.prompt_ids) + len(req.output_ids) if req.speculating else ALL_COMMITTED
            # a rollback re-runs positions from the committed ones on: no earlier query than that
            scans.append(ReleaseScan(key, cell, [min(f, committed) for f in frontiers], released, committed))
        return scans

    def _unpublished(self, req: Request) -> int | None:
        """With prefix caching and planes that give pages back (INT4 residuals): the first
        position of the request's first prompt block not offered to the cache yet, while it
        has blocks to offer (None: nothing to hold). Pages from there on stay until their
        block is offered (a reader encodes its own groups from them), since a shallow plane
        would otherwise give its pages back before the deepest plane had finished them."""
        if self.prefix_cache is None or req.block_hashes is None:
            return None
        if req.published_blocks >= self._usable_hits(req, len(req.block_hashes)):
            return None
        return req.published_blocks * self.kv.block_size

    def _entry_rows(self, req: Request, start: int, rows: int, may_start: bool = True) -> int:
        """How many of `rows` positions from `start` can enter depth 0 now: each needs a token
        slot (`PromptPlanning.entry_rows`; `may_start` False: an older request waits for the
        slots of a window, which a younger one must not take first)."""
        return self.prompts.entry_rows(self.token_slots, req, start, rows, may_start)

    def _entry_loops(self, req: Request, start: int, rows: int, budget: int) -> int:
        """Loops a dense entry runs in this call: every loop (one plan per token) for a single
        row whose earlier positions finished every depth and when the budget allows; one
        otherwise (prompt chunks move through the depths as a wavefront)."""
        if not self.multi_loop or rows != 1 or budget < self.num_loops:
            return 1
        if self.prompts.single_loop(req, start):  # (a prompt window with a sparse loop waits for all its tokens)
            return 1
        key = req.kv_key
        if all(self.kv.frontier(key, d) == start for d in range(1, self.num_loops)):
            return self.num_loops
        return 1

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """Requests whose planning raised since the last call; the caller ends each one."""
        failed, self._failed = self._failed, []
        return failed

    def _fail(self, req: Request, exc: Exception, builder: _PlanBuilder) -> None:
        """Keep the failure; retire slots taken for it that nothing recorded (they would leak)."""
        self._failed.append((req, exc))
        held = set(req.token_slots.values()) | set(self.controller(req).held_slots(req))
        orphans = [s for s in builder.taken if s not in held]
        if orphans:
            self.token_slots.retire(orphans)
            self._defer(lambda: self.token_slots.release(orphans))

    def build_group(self, req: Request, depth: int, start: int, end: int, head: Head,
                    slots: list[int] | None, token_ids: list[int] | None, loops: int = 1,
                    window: SparseWindow | None = None) -> RowGroup:
        """Rows [start, end) of a request through `loops` loops from `depth`: token slots,
        KV frontiers, page tables.

        Rows entering depth 0 take token slots (`slots` when the controller took them
        already, the ones a prompt window took when its first token entered, else fresh);
        rows finishing the last depth give theirs up (`_PlanBuilder` releases them once the
        plan's ticket completes). `window`: the rows run only part of [start, end) (a prompt
        window's sparse loop, `SparseWindow`); the frontier moves past [start, end) with the
        group that completes it."""
        last = depth + loops - 1
        if loops < 1 or last >= self.num_loops:
            raise AssertionError(f"loops {depth}..{last} outside 0..{self.num_loops - 1}")
        key = req.kv_key
        if depth == 0:
            self.kv.ensure(key, end)  # covered already (`_make_room`, `_admit`); raises if not
            fresh = [p for p in range(start, end) if p not in req.token_slots]
            taken = slots if slots is not None else self._take(fresh, len(req.prompt_ids))
            for pos, slot in zip(range(start, end) if slots is not None else fresh, taken):
                req.token_slots[pos] = slot
        rows = [req.token_slots[p] for p in range(start, end)]
        pages = -(-end // self.kv.block_size)
        if window is not None and (loops != 1 or depth < 1):
            raise AssertionError(f"a window group runs one loop past depth 0, not {depth}..{last}")
        completes = window is None or window.completes
        if last == self.num_loops - 1 and completes:
            for pos in range(start, end):
                del req.token_slots[pos]
        for plane in range(depth, last + 1):
            if self.kv.frontier(key, plane) != start:
                raise AssertionError(f"plane {plane} of {req.request_id!r} is at {self.kv.frontier(key, plane)}, "
                                     f"not at the group's start {start}")
            if completes:
                self.kv.advance(key, plane, end)
        if token_ids is None and depth == 0 and end <= req.num_host_tokens:
            token_ids = req.host_token_ids(start, end)
        if depth == 0 and token_ids is None and end - start != 1:
            raise AssertionError("generated tokens enter depth 0 one at a time")
        records = self.kv.pending_records(key)
        # every plane's table with adaptive exit or group records (the call may encode groups of any plane)
        planes = self.num_loops if self.adaptive_exit or self.kv.records is not None else last + 1
        deeper = [self.kv.page_table(key, p)[:pages] for p in range(depth + 1, planes)]
        return RowGroup(request_id=req.request_id, incarnation=req.incarnation, arrival=req.arrival, cell=req.cell,
                        depth=depth, start=start, end=end, token_ids=token_ids, token_slots=rows,
                        page_table=self.kv.page_table(key, depth)[:pages], deeper_tables=deeper, head=head,
                        loops=loops, window=window, records=records, decode_from=len(req.prompt_ids))

    def _take(self, positions: list[int], prompt: int) -> list[int]:
        """Slots for entering `positions` (ascending): prompt positions from the general pool,
        generated ones (a recompute's replay) from the decode sub-pool; the caller checked
        that they are free (`_entry_rows`)."""
        split = sum(p < prompt for p in positions)
        pool = self.token_slots
        enough = (len(positions) <= pool.num_free if not pool.decode_size else
                  split <= pool.free_for(False) and len(positions) - split <= pool.free_for(True))
        if not enough:  # before taking any: a half-taken set would leak
            raise AssertionError(f"no token slots for positions {positions[0]}..{positions[-1]}")
        return pool.take(split) + pool.take(len(positions) - split, decode=True)

    def committed(self, req: Request, commit: Commit) -> None:
        """A committed result of a speculating request: the controller says what to roll back;
        rejected positions leave every plane and flushed tokens' slots retire."""
        rollback = self.speculation.committed(req, commit)
        slots = [req.token_slots.pop(p) for p in rollback.flushed if p in req.token_slots]
        slots += rollback.dropped_slots
        if slots:
            self.token_slots.retire(slots)
            self._defer(lambda: self.token_slots.release(slots))
        if rollback.keep is not None:
            self.kv.truncate(req.kv_key, rollback.keep)
