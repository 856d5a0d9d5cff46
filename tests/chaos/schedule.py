"""Seeded random schedules of requests for the chaos runs (plain Python, no torch).

A schedule is drawn once from its seed, before the run, so a failure names the seed and the
request (`Spec.describe`) and the same offered load comes back when the test is re-run.
What is random in time (thread interleavings, when a preemption falls) is not replayed;
the checks hold whatever it is.

Each request gets a prompt from the run's pool, a short `max_tokens`, greedy or seeded
sampling (top-p), a start delay and a fate, which each driver names and plays: run to the
end, be aborted (by the stream, by ID, on a timer), left early, cancelled while being
added, go quiet, be disconnected (HTTP), or be snapshotted and restored (EngineCore). A
request may take the ID of an earlier one (`previous`): it starts once that one ended,
finished or aborted, so the ID is reused while the old incarnation's tickets may still be
in flight. A `clash` request also tries a second add under its own ID while it lives,
which the engine must refuse.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

TEMPERATURE = 0.8
TOP_P = 0.9
SEED_BASE = 1000  # a sampled request's seed: SEED_BASE + its prompt's index (few solo runs to cache)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request of a schedule."""

    index: int
    request_id: str
    prompt: int  # index into the run's prompt pool
    max_tokens: int
    seed: int | None  # None: greedy
    ignore_eos: bool
    delay: float  # seconds after the run started, or after `previous` ended
    fate: str  # what the client does (see the drivers)
    after: int  # outputs (or stream chunks) the client reads before its fate fires; 0: at once
    fate_delay: float  # seconds, for fates on a timer (abort by timer, cancelled add or POST)
    previous: int | None = None  # the request whose ID this one reuses; it must end first
    clash: bool = False  # try a second add under this ID while it lives (must be refused)

    @property
    def sampled(self) -> bool:
        return self.seed is not None

    def describe(self, seed: int) -> str:
        return f"schedule seed {seed}, request {self.index}: {self}"


def make_schedule(seed: int, n: int, num_prompts: int, fates: Mapping[str, float], *,
                  greedy_max_tokens: Sequence[int], sampled_max_tokens: Sequence[int], sampled: float,
                  reuse: float = 0.0, clash: float = 0.0, spread: float = 1.0) -> list[Spec]:
    """`n` requests: a `sampled` fraction seeded, a `reuse` fraction taking the ID of an earlier
    request (chains of holders of one ID), a `clash` fraction trying a second add; fates drawn
    with the weights `fates`; first holders of an ID start within `spread` seconds."""
    rng = random.Random(seed)
    names, weights = list(fates), list(fates.values())
    chains: list[list[int]] = []  # indices of the successive holders of one ID
    specs: list[Spec] = []
    for i in range(n):
        prompt = rng.randrange(num_prompts)
        is_sampled = rng.random() < sampled
        previous, request_id, delay = None, f"s{seed}-r{i}", rng.uniform(0.0, spread)
        if chains and rng.random() < reuse:
            chain = rng.choice(chains)
            previous, request_id, delay = chain[-1], specs[chain[0]].request_id, rng.uniform(0.0, 0.005)
            chain.append(i)
        else:
            chains.append([i])
        specs.append(Spec(
            index=i, request_id=request_id, prompt=prompt,
            max_tokens=rng.choice(sampled_max_tokens if is_sampled else greedy_max_tokens),
            seed=SEED_BASE + prompt if is_sampled else None, ignore_eos=is_sampled or rng.random() < 0.5,
            delay=delay, fate=rng.choices(names, weights)[0], after=rng.choice([0, 0, 1, 1, 2, 3]),
            fate_delay=rng.choice([0.0, 0.001, 0.005, 0.02, 0.05]), previous=previous,
            clash=rng.random() < clash))
    return specs


def random_prompts(seed: int, count: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    """`count` prompts of random token ids (3..vocab) with lengths in `lengths` (inclusive)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]
