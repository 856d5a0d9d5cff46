"""Multi-loop submissions: a plan whose groups run several loops in one call emits what
plans of one loop per call emit, and the CPU prepares one plan per decoded token.

fp32 on the tiny checkpoint, both planning styles (`Scheduler.multi_loop`), in every mode
whose groups may run several loops (plain, adaptive exit, block rounds with draft depth 1
and 2), with staggered arrivals and a seeded sampled request: the same tokens and logprobs
within 1e-5 (the same arithmetic, rows batched differently).
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams

MODES = {
    "plain": {},
    "exit": {"exit_threshold": 0.5},
    "block-d1": {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
    "block-d2": {"speculation": "block", "num_speculative_tokens": 2, "draft_loops": 2},
}


def _run(ckpt, multi_loop: bool, mode: dict) -> tuple[dict[str, tuple[list[int], list[float]]], int]:
    engine = EngineCore(EngineConfig.from_kwargs(str(ckpt), device="cpu", dtype="float32", block_size=4,
                                                 max_num_batched_tokens=24, max_num_seqs=4, **mode))
    engine.scheduler.multi_loop = multi_loop
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, logprobs=True)
    out: dict[str, tuple[list[int], list[float]]] = {}
    pending = list(enumerate([[5, 9, 2], list(range(3, 33)), [7] * 9]))
    while pending or engine.has_unfinished():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, sampled if i == 1 else greedy)
        for o in engine.step():
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
    assert engine.kv.num_free_pages == engine.kv.num_pages
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    return out, engine.executor.num_submitted


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_multi_loop_plans_emit_what_single_loop_plans_emit(tiny_ckpt, mode):
    want, calls_single = _run(tiny_ckpt, False, MODES[mode])
    got, calls_multi = _run(tiny_ckpt, True, MODES[mode])
    assert calls_multi < calls_single
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=1e-5, rtol=1e-5)


def test_plain_decode_is_one_call_per_token(tiny_ckpt):
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32"))
    engine.add_request("r", [4, 5, 6], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.drain()
    loops = engine.model.config.num_loops
    assert engine.executor.num_submitted == loops + 9  # the prompt's wavefront samples token 1; then one each
