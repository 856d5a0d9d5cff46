"""Chaos with automatic prefix caching (the async engine chaos of
`test_async_engine_chaos`, same clients and hazards): every prompt starts with one of two
shared heads of one to two blocks, so requests hit blocks other requests published and
still hold while they are aborted, preempted (recompute or swap), and evicted from a pool
of 32 positions a plane, in the two speculation modes, and with INT4 residuals (longer heads,
whose full groups each hit encodes from the shared pages). Each request must emit what it emits alone, and at rest every
page must be free or held by the cache alone, with the cache's invariants intact
(`oracle.assert_clean`). Each run proves that hits and evictions happened.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.chaos.runs import TINY_GREEDY_MAX_TOKENS, TINY_VOCAB, TinyRun, tiny_run
from tests.chaos.schedule import random_prompts
from tests.chaos.test_async_engine_chaos import _run

# Rounds and pipelines roll back past committed tokens, next to shared prompt pages; pipeline-d1
# runs token-sparse prefill too (plain decoding's caching is covered in tests/test_prefix_caching.py)
CHAOS_MODES = ("block-d2", "pipeline-d1")


# INT4 residuals: heads of 70 to 130 tokens (a cached prefix holds one or two full groups of 64
# rows, whose records each hit encodes from the shared pages) in a pool of 224 positions a plane
INT4_HEADS, INT4_POSITIONS = (70, 130), 152


def shared_prefix_run(mode: str, int4: bool = False) -> TinyRun:
    """The mode's run (at the next preemption policy) with caching on and shared heads
    (lengths one to two blocks; with the prompts' 1-8 tokens and up to 16 generated, a
    request still fits the 32 positions of a plane); token-sparse windows of one block.
    `int4`: with INT4 residuals (a tail the serial policy allows with the mode's speculation),
    longer heads and a larger pool."""
    run = tiny_run(mode, turn=1)
    bs = run.options["block_size"]
    heads = random_prompts(run.seed + 1, 2, TINY_VOCAB, INT4_HEADS if int4 else (bs, 2 * bs))
    prompts = [heads[i % 2] + prompt for i, prompt in enumerate(run.prompts)]
    options = {**run.options, "enable_prefix_caching": True}
    if "token_sparse_prefill" in options:
        options["token_sparse_prefill"] = json.dumps({**json.loads(options["token_sparse_prefill"]), "window": bs})
    if int4:
        options["kv_residual_quantization"] = json.dumps({"tail": 24})
        options["dtype"] = "float64"  # (fp32 roundings that differ between batchings can move an INT4 code)
        options["num_kv_pages"] = 4 * INT4_POSITIONS // bs
    return dataclasses.replace(run, options=options, prompts=prompts)


@pytest.mark.parametrize("mode,int4", [*[(mode, False) for mode in CHAOS_MODES], ("block-d2", True),
                                       ("pipeline-d1", True)])
async def test_prefix_cache_chaos(tiny_ckpt, solo_runs, mode, int4):
    run = shared_prefix_run(mode, int4)
    uncached = {**run.options, "enable_prefix_caching": False}  # the reference computes every block
    # INT4 admission counts every running prompt's claims, so these runs preempt seldom and as
    # timing has it (0 to 4 seen): preemption with INT4 hits is forced in tests/test_prefix_caching_int4.py
    engine = await _run(run, str(tiny_ckpt), solo_runs(str(tiny_ckpt), uncached, max(TINY_GREEDY_MAX_TOKENS)),
                        preemptions=0 if int4 else 3)
    cache, where = engine.core.scheduler.prefix_cache, run.where()
    assert engine.stats().prefix_cache_hits > 0, f"{where}: no request found a cached block"
    assert cache.evicted_blocks > 0, f"{where}: nothing was evicted"
