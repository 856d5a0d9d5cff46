"""Token pipelines: several live tokens of one request at different depths in one call.

Each forward call advances every live token of a request one loop. When the newest live
token reaches the draft depth d, the head drafts the next token, which enters depth 0 in
the following call; with d = 1 a token enters every call and up to R tokens are live.
When the oldest live token reaches full depth, its prediction verifies the next token's
candidate: accepted, the candidate is emitted and stays live; rejected, the correction
is emitted, every younger live token is flushed (slots, KV rolled back) and the pipeline
restarts from the correction. Emission is therefore one token per verification.

The CPU does not wait for a verification: the next calls are planned as if it passed, so
a ticket stays in flight without reading the outcome back. When a committed verification
turns out rejected, the request gets a new incarnation (the in-flight results planned on
the optimistic assumption are dropped at commit), its live tokens are flushed, its KV is
rolled back, and the pipeline restarts from the correction, whose id the commit knows.
Tickets run in submission order on one stream, so the stale calls' writes land before
anything planned after the rollback. Plain Python, no torch.
"""

from __future__ import annotations

import dataclasses

from specloop.scheduling.controller import Commit, GroupBuilder, Rollback
from specloop.plan import Draft, RowGroup, Sample, VerifyCandidate
from specloop.scheduling.request import Request, new_incarnation


@dataclasses.dataclass
class LiveToken:
    pos: int
    depth: int = 0  # next depth to run
    token: int | None = None  # id known on the host (a restart); None: the device cell


@dataclasses.dataclass
class PipelineState:
    live: list[LiveToken]  # oldest first
    limit: int  # positions < limit may hold tokens (prompt + max_tokens - 1)


class TokenPipeline:
    """Plans token pipelines (`speculation="pipeline"`); a pure state machine."""

    def __init__(self, num_loops: int, draft_loops: int) -> None:
        if not 1 <= draft_loops < num_loops:
            raise ValueError(f"draft_loops must lie in 1..{num_loops - 1}, got {draft_loops}")
        self.num_loops = num_loops
        self.draft_loops = draft_loops

    @property
    def draft_width(self) -> int:
        """Draft buffer entries per request: the candidate for position p sits at p % width."""
        return self.num_loops

    @property
    def rows_per_request(self) -> int:
        return self.num_loops  # up to R live tokens

    def start(self, req: Request, base: int, token: int | None = None) -> None:
        """A pipeline whose first live token sits at `base` (`token`: its id when the host
        knows it, a resumption; None: the device cell)."""
        limit = len(req.prompt_ids) + req.params.max_tokens - 1
        req.round = PipelineState([LiveToken(base, token=token)], limit) if base < limit else None

    def plan(self, req: Request, budget: int, builder: GroupBuilder) -> list[RowGroup]:
        pipe: PipelineState | None = req.round
        if pipe is None or not pipe.live or budget < len(pipe.live):
            return []
        groups = []
        newest = pipe.live[-1]
        live_positions = {t.pos for t in pipe.live}
        for tok in list(pipe.live):
            slots = None
            if tok.depth == 0:
                slots = builder.take_slots(1)
                if slots is None:  # no token slot: this (newest) token waits for the next call
                    break
            known = [tok.token] if tok.depth == 0 and tok.token is not None else None
            nxt = tok.pos + 1
            head = None
            if tok is newest and tok.depth == self.draft_loops - 1 and nxt < pipe.limit:
                head = Draft(req.params, nxt % self.draft_width)
            if tok.depth == self.num_loops - 1:
                index = nxt - len(req.prompt_ids)
                head = VerifyCandidate(req.params, index, nxt % self.draft_width) if nxt in live_positions \
                    else Sample(req.params, index, controlled=True)
            groups.append(builder.group(req, tok.depth, tok.pos, tok.pos + 1, head=head, slots=slots,
                                        token_ids=known))
            if isinstance(head, Draft):
                pipe.live.append(LiveToken(nxt))  # enters depth 0 in the next call
            tok.depth += 1
        pipe.live = [t for t in pipe.live if t.depth < self.num_loops]
        return groups

    def committed(self, req: Request, commit: Commit) -> Rollback:
        """A verification (or the plain sample at the end) committed: accepted, nothing
        changes; rejected, the pipeline restarts from the emitted token at a new incarnation."""
        req.produced += 1
        if commit.accepted:
            return Rollback()
        pos = len(req.prompt_ids) + commit.index  # where the emitted token sits
        pipe: PipelineState = req.round
        flushed = tuple(t.pos for t in pipe.live if t.pos >= pos)
        pipe.live = [LiveToken(pos, token=commit.token)] if pos < pipe.limit else []
        req.incarnation = new_incarnation()  # calls planned on the optimistic assumption are stale
        return Rollback(keep=pos, flushed=flushed)

    def held_slots(self, req: Request) -> list[int]:
        return []  # a live token takes its slot when it is planned
