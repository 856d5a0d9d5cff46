"""The configurations of the chaos runs: one per speculation mode, drawn from the mode's seed;
some of them with token-sparse prefill on.

The preemption policy of a run comes from the engine's own list (`PREEMPTION_MODES`), so
every policy the engine offers is covered without editing the suite: the runs take them in
turn across modes (`policy`), and each test file starts the turn at another policy.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import torch

from specloop.engine.config import PREEMPTION_MODES
from tests.chaos.schedule import random_prompts
from tests.engine_runs import MODES

TINY_VOCAB = 384
TINY_POSITIONS = 32  # per plane of the KV pool: short prompts that outgrow it together
TINY_GREEDY_MAX_TOKENS = (2, 4, 8, 12, 16)
TINY_SAMPLED_MAX_TOKENS = (4, 8)
TINY_SEEDS = {mode: 1300 + i for i, mode in enumerate(MODES)}
# Modes whose runs also prefill with FlashLoop token-sparse prefill (windows of 2-4 tokens, so
# the 1-8 token prompts have sparse windows, split ones included, under every hazard).
SPARSE_PREFILL_MODES = ("plain", "exit", "block-d1", "pipeline-d1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the tiny runs go through the GPU path where there is one


def policy(mode: str, turn: int) -> str:
    """The preemption policy of `mode`'s run in the test file whose turn starts at `turn`."""
    return PREEMPTION_MODES[(list(MODES).index(mode) + turn) % len(PREEMPTION_MODES)]


@dataclasses.dataclass(frozen=True)
class TinyRun:
    """One mode's engine options and prompt pool on the tiny checkpoint (fp32; CUDA where there is one)."""

    mode: str
    seed: int
    options: dict[str, Any]
    prompts: list[list[int]]

    def where(self) -> str:
        return f"{self.mode}, seed {self.seed}, options {self.options}"


def tiny_run(mode: str, turn: int, seed: int | None = None) -> TinyRun:
    """`mode`'s run (`seed`: another draw of its options and prompts, to pin a regression)."""
    seed = TINY_SEEDS[mode] if seed is None else seed
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    options = dict(device=DEVICE, dtype="float32", block_size=block_size,
                   num_kv_pages=4 * TINY_POSITIONS // block_size, max_num_seqs=12, max_num_batched_tokens=48,
                   max_inflight_tickets=rng.choice([1, 2, 3]), preemption_mode=policy(mode, turn), **MODES[mode])
    if mode in SPARSE_PREFILL_MODES:
        options["token_sparse_prefill"] = json.dumps({"window": rng.choice([2, 3, 4]), "retention": [1, 1, 0.5, 0.25]})
    return TinyRun(mode, seed, options, random_prompts(seed, 12, TINY_VOCAB, (1, 8)))
