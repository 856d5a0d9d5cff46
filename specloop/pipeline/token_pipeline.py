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

from specloop.scheduling.plan import RowGroup
from specloop.scheduling.request import Request, new_incarnation
from specloop.pipeline.block import MakeGroup, TakeSlots


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
    def __init__(self, num_loops: int, draft_loops: int) -> None:
        if not 1 <= draft_loops < num_loops:
            raise ValueError(f"draft_loops must lie in 1..{num_loops - 1}, got {draft_loops}")
        self.num_loops = num_loops
        self.draft_loops = draft_loops
        self.width = num_loops  # draft buffer entries per request: candidate for pos at pos % width

    def start(self, req: Request, base: int) -> None:
        limit = len(req.prompt_ids) + req.params.max_tokens - 1
        req.round = PipelineState([LiveToken(base)], limit) if base < limit else None

    def groups(self, req: Request, budget: int, make_group: MakeGroup, take_slots: TakeSlots) -> list[RowGroup]:
        pipe: PipelineState | None = req.round
        if pipe is None or not pipe.live or budget < len(pipe.live):
            return []
        groups = []
        newest = pipe.live[-1]
        live_positions = {t.pos for t in pipe.live}
        for tok in list(pipe.live):
            slots = None
            if tok.depth == 0:
                slots = take_slots(1)
                if slots is None:  # no token slot: this (newest) token waits for the next call
                    break
            known = [tok.token] if tok.depth == 0 and tok.token is not None else None
            group = make_group(req, tok.depth, tok.pos, tok.pos + 1, slots, known)
            nxt = tok.pos + 1
            if tok is newest and tok.depth == self.draft_loops - 1 and nxt < pipe.limit:
                group.sample, group.draft_index = req.params, nxt % self.width
                pipe.live.append(LiveToken(nxt))  # enters depth 0 in the next call
            if tok.depth == self.num_loops - 1:
                group.sample, group.sample_index = req.params, nxt - len(req.prompt_ids)
                group.controlled = True
                if nxt in live_positions:
                    group.verify, group.candidate_index = True, nxt % self.width
            tok.depth += 1
            groups.append(group)
        pipe.live = [t for t in pipe.live if t.depth < self.num_loops]
        return groups

    def committed(self, req: Request, accepted: int, sample_index: int, token: int) -> tuple[int | None, list[int]]:
        """A verification (or the plain sample at the end) committed: (positions to keep,
        flushed positions). A rejection restarts from the emitted token at a new incarnation."""
        req.produced += 1
        if accepted:
            return None, []
        pos = len(req.prompt_ids) + sample_index  # where the emitted token sits
        pipe: PipelineState = req.round
        flushed = [t.pos for t in pipe.live if t.pos >= pos]
        pipe.live = [LiveToken(pos, token=token)] if pos < pipe.limit else []
        req.incarnation = new_incarnation()  # calls planned on the optimistic assumption are stale
        return pos, flushed
