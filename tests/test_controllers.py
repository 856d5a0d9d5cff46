"""Controllers as pure state machines: no torch, no engine, a fake GroupBuilder.

Each test drives a controller through plan and commit calls and checks the groups it asks
for (depth, positions, head) and the rollbacks it returns. A subprocess checks that the
controllers and the scheduler import no torch.
"""

from __future__ import annotations

import subprocess
import sys

from specloop.pipeline.rounds import RoundController
from specloop.pipeline.token_pipeline import TokenPipeline
from specloop.plan import Draft, RowGroup, Sample, Verify, VerifyCandidate
from specloop.sampling_params import SamplingParams
from specloop.scheduling.controller import Commit, Rollback
from specloop.scheduling.dense import DenseController
from specloop.scheduling.request import Request

R = 4
PARAMS = SamplingParams(max_tokens=20, temperature=0.0)


class FakeBuilder:
    """Records the groups asked for; token slots are numbered from 100; frontiers are set by hand."""

    def __init__(self, frontiers: list[int] | None = None) -> None:
        self.asked: list[tuple[int, int, int, object]] = []
        self.loops: list[int] = []  # loops of each group asked for
        self.entries: list[tuple[int, int]] = []
        self.frontiers = frontiers or [0] * R
        self._next_slot = 100
        self.max_loops = R

    def group(self, req, depth, start, end, *, head=None, slots=None, token_ids=None, loops=1) -> RowGroup:
        if depth == 0:
            taken = slots if slots is not None else self.take_slots(end - start)
            req.token_slots.update(zip(range(start, end), taken))
        self.asked.append((depth, start, end, head))
        self.loops.append(loops)
        return RowGroup(req.request_id, req.incarnation, req.arrival, 0, depth, start, end, token_ids,
                        [req.token_slots.get(p, -1) for p in range(start, end)], [], head=head, loops=loops)

    def take_slots(self, n):
        slots = list(range(self._next_slot, self._next_slot + n))
        self._next_slot += n
        return slots

    def frontier(self, req, depth):
        return self.frontiers[depth]

    def queue_entry(self, req, start, rows):
        self.entries.append((start, rows))


def _request(prompt_len: int = 5, max_tokens: int = 20) -> Request:
    return Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   arrival=0)


def test_dense_plans_deepest_first_queues_entries_and_samples_at_full_depth():
    dense = DenseController(R)
    req = _request(prompt_len=6)
    builder = FakeBuilder(frontiers=[6, 6, 4, 0])
    groups = dense.plan(req, budget=100, builder=builder)
    assert [(g.depth, g.start, g.end) for g in groups] == [(3, 0, 4), (2, 4, 6)]
    assert all(g.head is None for g in groups) and builder.entries == []
    builder = FakeBuilder(frontiers=[6, 6, 6, 4])
    [group] = dense.plan(req, budget=100, builder=builder)
    assert (group.depth, group.start, group.end) == (3, 4, 6)
    assert group.head == Sample(req.params, 0) and req.produced == 1 and req.num_tokens == 7
    assert builder.entries == []  # the sampled token enters depth 0 only in the next plan
    builder = FakeBuilder(frontiers=[6, 6, 6, 6])
    assert dense.plan(req, budget=100, builder=builder) == [] and builder.entries == [(6, 1)]


def test_dense_hands_over_to_speculation_after_the_first_sample():
    rounds = RoundController(R, draft_loops=1, num_speculative_tokens=2)
    dense = DenseController(R, handoff=rounds)
    req = _request(prompt_len=3)
    [group] = dense.plan(req, budget=100, builder=FakeBuilder(frontiers=[3, 3, 3, 0]))
    assert isinstance(group.head, Sample) and not group.head.controlled
    assert req.speculating and req.round.base == 3 and req.num_tokens == 3


def _drive_round(rounds: RoundController, req: Request, builder: FakeBuilder, budget: int = 100) -> list[tuple]:
    """Plan until the verification is submitted; the groups asked for, as (depth, start, end, head)."""
    while not (req.round.submitted):
        rounds.plan(req, budget=budget, builder=builder)
    return builder.asked


def test_round_drafts_row_by_row_then_verifies_every_row_at_full_depth():
    """With budget, each draft row runs loops 1..d in one call and the verification d+1..R."""
    rounds = RoundController(R, draft_loops=2, num_speculative_tokens=2)
    req = _request(prompt_len=5)
    req.produced = 1
    rounds.start(req, base=5)
    builder = FakeBuilder()
    asked = _drive_round(rounds, req, builder)
    p = req.params
    assert asked == [(0, 5, 6, Draft(p, 0)), (0, 6, 7, Draft(p, 1)), (0, 7, 8, None), (2, 5, 8, Verify(p, 1, 2))]
    assert builder.loops == [2, 2, 2, 2]


def test_round_goes_a_loop_at_a_time_on_a_small_budget():
    rounds = RoundController(R, draft_loops=2, num_speculative_tokens=2)
    req = _request(prompt_len=5)
    req.produced = 1
    rounds.start(req, base=5)
    builder = FakeBuilder()
    asked = _drive_round(rounds, req, builder, budget=3)  # a draft row fits 2 loops, the 3 verify rows 1
    p = req.params
    assert asked == [(0, 5, 6, Draft(p, 0)), (0, 6, 7, Draft(p, 1)), (0, 7, 8, None),
                     (2, 5, 8, None), (3, 5, 8, Verify(p, 1, 2))]
    assert builder.loops == [2, 2, 2, 1, 1]
    req = _request(prompt_len=5)
    req.produced = 1
    rounds.start(req, base=5)
    builder = FakeBuilder()
    for _ in range(7):
        rounds.plan(req, budget=1, builder=builder)  # one loop per call; the 3 verify rows do not fit
    assert builder.asked == [
        (0, 5, 6, None), (1, 5, 6, Draft(p, 0)),  # t0 runs loops 1-2, drafts c1
        (0, 6, 7, None), (1, 6, 7, Draft(p, 1)),  # c1 drafts c2
        (0, 7, 8, None), (1, 7, 8, None),  # c2 runs the draft loops (its KV is needed), drafts nothing
    ]
    assert _drive_round(rounds, req, builder, budget=3)[6:] == [(2, 5, 8, None), (3, 5, 8, Verify(p, 1, 2))]


def test_round_guess_kept_when_all_pass_and_rolled_back_when_not():
    rounds = RoundController(R, draft_loops=1, num_speculative_tokens=3)
    req = _request(prompt_len=5)
    req.produced = 1
    rounds.start(req, base=5)
    _drive_round(rounds, req, FakeBuilder())
    builder = FakeBuilder()
    rounds.plan(req, budget=100, builder=builder)  # the next round starts on the guess that all pass
    guessed = req.round
    assert guessed.guessed and guessed.base == 9 and builder.asked == [(0, 9, 10, Draft(req.params, 0))]
    assert rounds.committed(req, Commit(accepted=3, index=1, token=42)) == Rollback()
    assert req.round is guessed and not guessed.guessed and req.produced == 5
    # the confirmed round verifies; this time one candidate passes: roll back to 5 + 4 + 1 + 1
    _drive_round(rounds, req, FakeBuilder())
    rounds.plan(req, budget=100, builder=FakeBuilder())  # a new guessed round took its slots
    held = rounds.held_slots(req)
    rollback = rounds.committed(req, Commit(accepted=1, index=5, token=7))
    assert rollback.keep == 11 and rollback.dropped_slots == tuple(held)
    assert all(p >= 11 for p in rollback.flushed) and rollback.flushed
    assert req.round.base == 11 and req.round.token == 7 and not req.round.guessed


def test_round_shrinks_to_the_tokens_left():
    rounds = RoundController(R, draft_loops=1, num_speculative_tokens=4)
    req = _request(prompt_len=5, max_tokens=3)
    req.produced = 1
    rounds.start(req, base=5)
    assert req.round.k == 1  # two tokens left: one candidate plus the correction or bonus
    req.produced = 3
    rounds.start(req, base=8)
    assert req.round is None


def test_pipeline_advances_live_tokens_and_verifies_the_oldest():
    pipe = TokenPipeline(R, draft_loops=1)
    req = _request(prompt_len=5)
    req.produced = 1
    pipe.start(req, base=5)
    heads = []
    for _ in range(5):
        builder = FakeBuilder()
        pipe.plan(req, budget=100, builder=builder)
        heads.append([(d, s, type(h).__name__ if h else None) for d, s, _, h in builder.asked])
    assert heads[0] == [(0, 5, "Draft")]  # d=1: every call the newest token drafts the next
    assert heads[1] == [(1, 5, None), (0, 6, "Draft")]
    assert heads[3] == [(3, 5, "VerifyCandidate"), (2, 6, None), (1, 7, None), (0, 8, "Draft")]
    assert [t.pos for t in req.round.live] == [7, 8, 9, 10]  # 5 left after its verification


def test_pipeline_rejection_restarts_at_a_new_incarnation():
    pipe = TokenPipeline(R, draft_loops=1)
    req = _request(prompt_len=5)
    req.produced = 1
    pipe.start(req, base=5)
    for _ in range(4):
        pipe.plan(req, budget=100, builder=FakeBuilder())
    before = req.incarnation
    assert pipe.committed(req, Commit(accepted=1, index=1, token=11)) == Rollback()
    rollback = pipe.committed(req, Commit(accepted=0, index=2, token=12))
    assert rollback.keep == 7 and rollback.flushed == (7, 8, 9)  # the rejected candidate and its descendants
    assert req.incarnation != before
    assert [(t.pos, t.depth, t.token) for t in req.round.live] == [(7, 0, 12)]


def test_pipeline_ends_with_a_controlled_plain_sample():
    pipe = TokenPipeline(R, draft_loops=1)
    req = _request(prompt_len=5, max_tokens=2)
    req.produced = 1
    pipe.start(req, base=5)  # limit 6: position 5 is the last that drafts nothing
    asked = []
    for _ in range(4):
        builder = FakeBuilder()
        pipe.plan(req, budget=100, builder=builder)
        asked += builder.asked
    assert asked[-1] == (3, 5, 6, Sample(req.params, 1, controlled=True))
    assert not any(isinstance(h, (Draft, VerifyCandidate)) for *_, h in asked)


def test_controllers_and_scheduler_import_no_torch():
    code = ("import sys; import specloop.scheduling.scheduler, specloop.pipeline.rounds, "
            "specloop.pipeline.token_pipeline; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
