"""Block self-speculation rounds: the controller that plans them (plain Python, no torch).

A round starts from the request's newest token t0 at position `base`, whose value sits in
the device next-token cell. Draft: t0 runs loops 1..d and the head drafts c1; c1 runs
loops 1..d and drafts c2; ... up to ck, which also runs loops 1..d (its shallow state and
KV are needed for verification). Verify: the k+1 rows t0, c1..ck run loops d+1..R
together, reusing the drafts' shallow hidden states and KV unchanged, and the head at full
depth checks every candidate. The verification returns the accepted count n and the
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
from collections.abc import Callable

from specloop.scheduling.plan import RowGroup
from specloop.scheduling.request import Request

# (request, depth, start, end, token slots taken already, token ids known on the host) -> group
MakeGroup = Callable[[Request, int, int, int, "list[int] | None", "list[int] | None"], RowGroup]
TakeSlots = Callable[[int], list[int] | None]  # n token slots at once, or None if fewer are free


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


class BlockSpeculation:
    def __init__(self, num_loops: int, draft_loops: int, num_speculative_tokens: int) -> None:
        if not 1 <= draft_loops < num_loops:
            raise ValueError(f"draft_loops must lie in 1..{num_loops - 1}, got {draft_loops}")
        self.num_loops = num_loops
        self.draft_loops = draft_loops
        self.k = num_speculative_tokens

    def start(self, req: Request, base: int, produced: int | None = None, token: int | None = None,
              guessed: bool = False) -> None:
        """Begin a round at `base` if the request may still produce a token (`produced`:
        output tokens before the round, default the request's count)."""
        remaining = req.params.max_tokens - (req.produced if produced is None else produced)
        req.round = Round(base=base, k=min(self.k, remaining - 1), token=token, guessed=guessed) if remaining > 0 else None

    def groups(self, req: Request, budget: int, make_group: MakeGroup, take_slots: TakeSlots) -> list[RowGroup]:
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
            if rnd.slots is None and rnd.row == 0 and rnd.depth == 0:
                rnd.slots = take_slots(rnd.num_rows)
            if budget < 1 or rnd.slots is None:
                return []
            pos = rnd.base + rnd.row
            entering = rnd.slots[:1] if rnd.depth == 0 else None
            known = [rnd.token] if rnd.row == 0 and rnd.depth == 0 and rnd.token is not None else None
            group = make_group(req, rnd.depth, pos, pos + 1, entering, known)
            if entering:  # the row holds its slot now (popped only once planned, so a failure cannot lose it)
                rnd.slots.pop(0)
            if rnd.depth == self.draft_loops - 1 and rnd.row < rnd.k:
                group.sample, group.draft_index = req.params, rnd.row
            rnd.depth += 1
            if rnd.depth == self.draft_loops:
                rnd.row, rnd.depth = rnd.row + 1, 0
                if rnd.row > rnd.k:
                    rnd.verifying, rnd.depth = True, self.draft_loops
            return [group]
        if budget < rnd.num_rows or rnd.guessed:  # a guessed round verifies only once confirmed
            return []
        group = make_group(req, rnd.depth, rnd.base, rnd.base + rnd.num_rows, None, None)
        if rnd.depth == self.num_loops - 1:
            group.sample, group.verify, group.sample_index = req.params, True, req.produced
            group.controlled = True
            rnd.submitted = True
        rnd.depth += 1
        return [group]

    def committed(self, req: Request, accepted: int, sample_index: int, token: int) -> tuple[int | None, list[int]]:
        """A verification committed: (positions to keep, flushed positions).

        Keeps the guessed next round when it started where the accepted count says;
        otherwise flushes it and starts the right round from the emitted token."""
        next_base = len(req.prompt_ids) + sample_index + accepted  # where the emitted last token sits
        req.produced += accepted + 1
        rnd: Round | None = req.round
        if rnd is not None and rnd.guessed and rnd.base == next_base:
            rnd.guessed = False  # the guess was right
            return None, []
        flushed = sorted(p for p in req.hidden_slots if p >= next_base)
        self.start(req, next_base, token=token)
        return next_base, flushed


def unused_slots(req: Request) -> list[int]:
    """Token slots the request's round took for rows it has not drafted yet (to return on abort)."""
    return unused_slots_of(req.round)


def unused_slots_of(state: object) -> list[int]:
    slots = getattr(state, "slots", None)
    return list(slots) if slots else []
