"""Randomized operations on speculating engines: stops, aborts at random steps and request
ID reuse while tickets are in flight, across modes, page sizes and in-flight depths.

Random weights reject most drafts, so rollbacks and pipeline restarts happen constantly.
Every trial checks the tokens against plain greedy decoding and that every KV page,
token slot and request slot is back in its pool at the end.
"""

from __future__ import annotations

import random

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from tests.engine_runs import pages_at_rest

MAX_TOKENS = 24
SPECS = ([{"speculation": "block", "num_speculative_tokens": k, "draft_loops": d} for k in (1, 3, 5) for d in (1, 2)]
         + [{"speculation": "pipeline", "draft_loops": d} for d in (1, 2, 3)])


def _tokens(outputs, request_id: str) -> list[int]:
    return [t for o in outputs if o.request_id == request_id for t in o.token_ids]


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_ckpt):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (3, 17, 40, 1, 9)]
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float64"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
        plain.append(_tokens(engine.drain(), f"p{i}"))
    return prompts, plain


@pytest.mark.parametrize("seed", range(12))
def test_random_stops_aborts_and_id_reuse(tiny_ckpt, prompts_and_plain, seed):
    prompts, plain = prompts_and_plain
    rng = random.Random(seed)
    spec = SPECS[seed % len(SPECS)]
    engine = EngineCore(EngineConfig.from_kwargs(
        str(tiny_ckpt), device="cpu", dtype="float64", max_inflight_tickets=rng.choice([1, 2, 3]),
        block_size=rng.choice([2, 4, 16]), **spec))
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
    s, x, y = rng.sample(range(len(prompts)), 3)
    stop = plain[s][rng.randrange(1, MAX_TOKENS - 1)]  # a stop token somewhere inside the output
    engine.add_request("s", prompts[s], SamplingParams(**greedy, stop_token_ids=(stop,)))
    engine.add_request("x", prompts[x], SamplingParams(**greedy))
    before = []
    for _ in range(rng.randrange(1, 30)):
        before += engine.step()
    engine.abort("x")
    engine.add_request("x", prompts[y], SamplingParams(**greedy))  # the ID now names another request
    after = engine.drain()
    assert _tokens(before + after, "s") == plain[s][: plain[s].index(stop) + 1]
    assert _tokens(after, "x") == plain[y]  # nothing of the aborted request leaks into the new one
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert engine.scheduler.cells.num_free == engine.scheduler.cells.size
