"""Block self-speculation rounds: the controller that plans them (plain Python, no torch).

A round starts from the request's newest token t0 at position `base`, whose value sits in
the device next-token cell. Draft: t0 runs loops 1..d and the head drafts c1; c1 runs
loops 1..d and drafts c2; ... up to ck, which also runs loops 1..d (its shallow state and
KV are needed for verification). Verify: the k+1 rows t0, c1..ck run loops d+1..R
together, reusing the drafts' shallow hidden states and KV unchanged, and the head at full
depth checks every candidate. Each draft row and the verification are one multi-loop
group (one call each) when the budget allows; otherwise they go on a loop at a time. The verification returns the accepted count n and the
tokens c1..cn plus one correction (or bonus) token, which is the next round's t0.

The CPU does not wait for the verification: while it is in flight, the next round is
planned as if every candidate passes (t0' at base + k + 1, its value the bonus token the
verification leaves in the next-token cell). The commit checks the guess: right, the round
goes on; wrong, the rejected positions are rolled back in every plane, the guessed round's
token slots are retired and a new round starts at base + n + 1 from the correction, whose
id the commit knows. A guessed round's stale calls only write device state (KV beyond the
rollback, draft buffers, slots) that is rewritten or released after them: tickets run in
submission order on one stream, and draft samples send nothing to the host.
"""

from __future__ import annotations

import dataclasses

from specloop.scheduling.controller import Commit, GroupBuilder, Rollback
from specloop.plan import Draft, RowGroup, Verify
from specloop.scheduling.request import Request


@dataclasses.dataclass
class Round:
    base: int  # position of t0
    k: int  # candidates drafted this round
    row: int = 0  # the row (0..k) in its draft pass
    depth: int = 0  # next depth of that row, or of all rows while verifying
    verifying: bool = False
    submitted: bool = False  # the verification is in flight
    slots: list[int] | None = None  # token slots of rows not yet drafted (all k+1 taken at the start)
    token: int | None = None  # t0's id when the host knows it (a restart); None: the device cell
    guessed: bool = False  # planned before the previous verification committed, assuming it all passed

    @property
    def num_rows(self) -> int:
        return self.k + 1


class RoundController:
    """Plans block self-speculation rounds (`speculation="block"`); a pure state machine."""

    def __init__(self, num_loops: int, draft_loops: int, num_speculative_tokens: int) -> None:
        if not 1 <= draft_loops < num_loops:
            raise ValueError(f"draft_loops must lie in 1..{num_loops - 1}, got {draft_loops}")
        self.num_loops = num_loops
        self.draft_loops = draft_loops
        self.k = num_speculative_tokens

    @property
    def draft_width(self) -> int:
        """Draft buffer entries per request: one per candidate."""
        return self.k

    @property
    def rows_per_request(self) -> int:
        """Token slots one request may hold in one plan: a verification's k+1 rows, or R live tokens."""
        return max(self.k + 1, self.num_loops)

    def start(self, req: Request, base: int, produced: int | None = None, token: int | None = None,
              guessed: bool = False) -> None:
        """Begin a round at `base` if the request may still produce a token (`produced`:
        output tokens before the round, default the request's count)."""
        remaining = req.params.max_tokens - (req.produced if produced is None else produced)
        req.round = Round(base=base, k=min(self.k, remaining - 1), token=token, guessed=guessed) if remaining > 0 else None

    def plan(self, req: Request, budget: int, builder: GroupBuilder) -> list[RowGroup]:
        """This plan's group for a request in a round (at most one), within `budget` rows.

        A round takes the token slots of all its rows when it starts, so a round never
        holds some slots while waiting for others (no deadlock when slots run short).
        """
        rnd: Round | None = req.round
        if rnd is not None and rnd.submitted:  # guess that every candidate passes
            self.start(req, rnd.base + rnd.k + 1, req.produced + rnd.k + 1, guessed=True)
            rnd = req.round
        if rnd is None:
            return []
        if not rnd.verifying:
            return self._draft_row(req, rnd, budget, builder)
        loops = min(self.num_loops - rnd.depth, budget // rnd.num_rows, builder.max_loops)
        if loops < 1 or rnd.guessed:  # a guessed round verifies only once confirmed
            return []
        head = None
        if rnd.depth + loops == self.num_loops:
            head = Verify(req.params, req.produced, rnd.k)
            rnd.submitted = True
        group = builder.group(req, rnd.depth, rnd.base, rnd.base + rnd.num_rows, head=head, loops=loops)
        rnd.depth += loops
        return [group]

    def _draft_row(self, req: Request, rnd: Round, budget: int, builder: GroupBuilder) -> list[RowGroup]:
        """The next row of the draft pass: row `rnd.row` at `rnd.depth`; its last draft loop drafts."""
        if rnd.slots is None and rnd.row == 0 and rnd.depth == 0:
            rnd.slots = builder.take_slots(rnd.num_rows)
        if budget < 1 or rnd.slots is None:
            return []
        pos = rnd.base + rnd.row
        loops = min(self.draft_loops - rnd.depth, budget, builder.max_loops)
        entering = rnd.slots[:1] if rnd.depth == 0 else None
        known = [rnd.token] if rnd.row == 0 and rnd.depth == 0 and rnd.token is not None else None
        head = Draft(req.params, rnd.row) if rnd.depth + loops == self.draft_loops and rnd.row < rnd.k else None
        group = builder.group(req, rnd.depth, pos, pos + 1, head=head, slots=entering, token_ids=known, loops=loops)
        if entering:  # the row holds its slot now (popped only once planned, so a failure cannot lose it)
            rnd.slots.pop(0)
        rnd.depth += loops
        if rnd.depth == self.draft_loops:
            rnd.row, rnd.depth = rnd.row + 1, 0
            if rnd.row > rnd.k:
                rnd.verifying, rnd.depth = True, self.draft_loops
        return [group]

    def committed(self, req: Request, commit: Commit) -> Rollback:
        """A verification committed. Keeps the guessed next round when it started where the
        accepted count says; otherwise flushes it and starts the right round from the
        emitted token."""
        next_base = len(req.prompt_ids) + commit.index + commit.accepted  # where the emitted last token sits
        req.produced += commit.accepted + 1
        rnd: Round | None = req.round
        if rnd is not None and rnd.guessed and rnd.base == next_base:
            rnd.guessed = False  # the guess was right
            return Rollback()
        flushed = tuple(sorted(p for p in req.token_slots if p >= next_base))
        self.start(req, next_base, token=commit.token)
        return Rollback(keep=next_base, flushed=flushed, dropped_slots=tuple(_unused(rnd)))

    def held_slots(self, req: Request) -> list[int]:
        """Token slots the current round took for rows it has not drafted yet."""
        return _unused(req.round)


def _unused(rnd: Round | None) -> list[int]:
    return list(rnd.slots) if rnd is not None and rnd.slots else []
