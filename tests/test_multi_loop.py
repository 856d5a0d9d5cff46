"""Multi-loop submissions: a plan whose groups run several loops in one call emits what
plans of one loop per call emit, and the CPU prepares one plan per decoded token.

fp32 on the tiny checkpoint, both planning styles (`Scheduler.multi_loop`), in every mode
whose groups may run several loops (plain, adaptive exit, block rounds with draft depth 1
and 2), with staggered arrivals and a seeded sampled request: the same tokens and logprobs
within 1e-5 (the same arithmetic, rows batched differently).
"""

from __future__ import annotations

import pytest

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from tests.engine_runs import MODES as ENGINE_MODES, Outputs, assert_same, run_staggered

MODES = {name: ENGINE_MODES[name] for name in ("plain", "exit", "block-d1", "block-d2")}


def _run(ckpt, multi_loop: bool, mode: dict) -> tuple[Outputs, int]:
    engine = EngineCore(EngineConfig.from_kwargs(str(ckpt), device="cpu", dtype="float32", block_size=4,
                                                 max_num_batched_tokens=24, max_num_seqs=4, **mode))
    engine.scheduler.multi_loop = multi_loop
    out = run_staggered(engine, [[5, 9, 2], list(range(3, 33)), [7] * 9], max_tokens=12)
    return out, engine.executor.num_submitted


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_multi_loop_plans_emit_what_single_loop_plans_emit(tiny_ckpt, mode):
    want, calls_single = _run(tiny_ckpt, False, MODES[mode])
    got, calls_multi = _run(tiny_ckpt, True, MODES[mode])
    assert calls_multi < calls_single
    assert_same(got, want, 1e-5)


def test_plain_decode_is_one_call_per_token(tiny_ckpt):
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32"))
    engine.add_request("r", [4, 5, 6], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.drain()
    loops = engine.model.config.num_loops
    assert engine.executor.num_submitted == loops + 9  # the prompt's wavefront samples token 1; then one each
