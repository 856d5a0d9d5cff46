"""Tensor parallelism on CPU (gloo): the weight split, the refusals, and engines of 2 and 4
ranks that emit what the single-process engine emits.

The split is checked in-process first (each rank's attention and MLP outputs, summed as
the all-reduce sums them, equal the whole layer's; GQA groups stay with their KV heads).
The engines then run in real worker processes: greedy tokens must equal the single-process
engine's exactly, seeded samples too (every rank samples the same logits), and logprobs
agree to what the changed order of the o_proj / down_proj sums allows.
"""

from __future__ import annotations

import multiprocessing
import operator

import pytest
import torch
from torch.nn import functional as F

from specloop.checkpoint import load_model
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import ConfigError, SnapshotError, SpecloopError
from specloop.llm import default_model
from specloop.model.ouro import OuroModel
from specloop.parallel.shard import shard_model
from specloop.sampling_params import SamplingParams
from tests.engine_runs import MODES

FLASHLOOP = {"token_sparse_prefill": {"window": 8, "retention": [1.0, 1.0, 0.5, 0.25]},
             "sparse_decode_attention": {"key_retention": 0.3}, "kv_residual_quantization": {"tail": 16}}
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)
SEEDED = SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, logprobs=True)
PROMPTS = [list(range(3, 33)), list(range(40, 51))]
DENSE_TOL = 1e-5  # fp32 sums in another order: a few ulps through 4 loops
INT4_TOL = 1e-3  # INT4 codes of a value at a rounding boundary may flip between orders of summation


class WholeRowsAttention:
    """Attention of every row over every row (GQA), enough to compare a layer with its shards."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return out.transpose(0, 1)


def _shards(model: OuroModel, size: int) -> list[OuroModel]:
    """Each rank's shard in this process, its all-reduce left out (the test sums)."""
    state = model.state_dict()
    return [shard_model(state, model.config, rank, size, lambda t: None, torch.device("cpu")) for rank in range(size)]


@pytest.mark.parametrize("size", [2, 4])
def test_shards_sum_to_the_whole_layer(tiny_mha_ckpt, tiny_ckpt, size):
    ckpt = tiny_mha_ckpt if size == 4 else tiny_ckpt  # 4 ranks need 4 KV heads
    model = load_model(ckpt, dtype=torch.float64)[0]
    shards = _shards(model, size)
    assert shards[0].config.num_key_value_heads == model.config.num_key_value_heads // size
    x = torch.randn(7, model.config.hidden_size, dtype=torch.float64)
    cos, sin = model.rotary.cos_sin(torch.arange(7), x.dtype)
    whole = model.model.layers[1]
    parts = [s.model.layers[1] for s in shards]
    attn = sum(p.self_attn(x, cos, sin, WholeRowsAttention(), 1) for p in parts)
    torch.testing.assert_close(attn, whole.self_attn(x, cos, sin, WholeRowsAttention(), 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(p.mlp(x) for p in parts), whole.mlp(x), rtol=1e-12, atol=1e-12)
    # replicated weights are shared with the full model, not copied
    assert shards[1].lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()


def test_a_split_that_cuts_kv_heads_is_refused_before_any_process_starts(tiny_ckpt):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size \(4\) must divide the model's num_key_value_heads"):
        EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", tensor_parallel_size=4))


def test_swap_preemption_is_refused():
    with pytest.raises(ConfigError, match="preemption_mode 'swap'"):
        EngineConfig(model="m", tensor_parallel_size=2, preemption_mode="swap")


def _engine(ckpt, size: int, mode: str, flashloop: bool) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), dtype="float32", device="cpu", num_kv_pages=256, block_size=4, tensor_parallel_size=size,
        **MODES[mode], **(FLASHLOOP if flashloop else {})))


def _run(engine: EngineCore) -> dict[str, tuple[list[int], list[float]]]:
    """Request 0 greedy, request 1 seeded; their tokens and logprobs."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, (GREEDY, SEEDED))):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for o in engine.drain():
        tokens, logprobs = out.setdefault(o.request_id, ([], []))
        tokens += o.token_ids
        logprobs += o.logprobs
    return out


def _close(engine: EngineCore) -> None:
    """Stop the workers; each must exit cleanly."""
    workers = engine.executor.runner.workers
    engine.executor.runner.close()
    assert [p.exitcode for p in workers.procs] == [0] * (workers.size - 1)


CASES = [  # (checkpoint, ranks, mode, FlashLoop features on): every mode at each (checkpoint, ranks)
    ("tiny", 2, "plain", False),
    ("tiny", 2, "block-d2", True),
    ("tiny", 2, "pipeline-d1", True),
    ("shipped", 2, "plain", True),
    ("shipped", 2, "block-d1", False),
    ("shipped", 2, "pipeline-d2", True),
    ("mha", 4, "plain", True),
    ("mha", 4, "block-d2", True),
    ("mha", 4, "pipeline-d1", False),
    ("shipped", 4, "plain", False),
    ("shipped", 4, "block-d2", True),
    ("shipped", 4, "pipeline-d1", True),
]


@pytest.mark.parametrize("name,size,mode,flashloop", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_engine_emits_what_one_process_emits(tiny_ckpt, tiny_mha_ckpt, name, size, mode, flashloop):
    ckpt = {"tiny": tiny_ckpt, "mha": tiny_mha_ckpt, "shipped": default_model()}[name]
    want = _run(_engine(ckpt, 1, mode, flashloop))
    engine = _engine(ckpt, size, mode, flashloop)
    try:
        got = _run(engine)
    finally:
        _close(engine)
    tol = INT4_TOL if flashloop else DENSE_TOL
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=tol, rtol=tol)


def test_prefix_cache_hits_on_every_rank(tiny_ckpt):
    """Prefix caching (on by default) with tensor parallelism: rank 0 schedules the hits and
    every rank's pages hold its heads of the shared blocks, so a request that hits reads its
    own heads there; the tokens equal one uncached process's (the second request arrives
    after the first finished, so its 8 blocks of the shared head hit)."""
    head = list(range(3, 35))
    prompts = [head + [40, 41, 42], head + [50, 51]]

    def run(size: int, cache: bool) -> tuple[dict[str, tuple[list[int], list[float]]], int]:
        engine = EngineCore(EngineConfig.from_kwargs(
            str(tiny_ckpt), dtype="float32", device="cpu", num_kv_pages=256, block_size=4,
            tensor_parallel_size=size, enable_prefix_caching=cache))
        out: dict[str, tuple[list[int], list[float]]] = {}
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, GREEDY)
                for o in engine.drain():
                    tokens, logprobs = out.setdefault(o.request_id, ([], []))
                    tokens += o.token_ids
                    logprobs += o.logprobs
            return out, engine.stats().prefix_cache_hits
        finally:
            if size > 1:
                _close(engine)

    want, _ = run(1, False)
    got, hits = run(2, True)
    assert hits == len(head)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=DENSE_TOL, rtol=DENSE_TOL)


def test_snapshot_of_a_running_request_is_refused(tiny_ckpt):
    engine = _engine(tiny_ckpt, 2, "plain", False)
    try:
        engine.add_request("r0", PROMPTS[0], GREEDY)
        engine.step()
        with pytest.raises(SnapshotError, match="split over the tensor-parallel ranks"):
            engine.snapshot("r0")
        assert engine.drain()[-1].finished  # the engine serves on
    finally:
        _close(engine)


def test_a_worker_that_dies_fails_the_engine_instead_of_hanging(tiny_ckpt):
    engine = _engine(tiny_ckpt, 2, "plain", False)
    workers = engine.executor.runner.workers
    try:
        engine.add_request("r0", PROMPTS[0], GREEDY)
        workers.procs[0].kill()
        workers.procs[0].join()
        with pytest.raises(SpecloopError, match="tensor-parallel rank 1 exited"):
            engine.drain()
    finally:
        engine.executor.runner.close()


def test_a_worker_that_fails_mid_call_fails_the_engine_with_its_error(tiny_ckpt):
    """The worker raises while rank 0 waits in an all-reduce: its closed connection ends the
    wait, and the engine's error names the rank and carries the worker's error."""
    engine = _engine(tiny_ckpt, 2, "plain", False)
    try:
        engine.add_request("r0", PROMPTS[0], GREEDY)
        engine.executor.runner.workers.send("not a plan")  # type: ignore[arg-type]
        with pytest.raises(SpecloopError, match=r"rank 1 exited with code 1: AttributeError"):
            engine.drain()
    finally:
        engine.executor.runner.close()


class BrokenInWorkers:
    """A verifier that cannot be rebuilt in a worker: unpickling it divides by zero."""

    def __reduce__(self):
        return operator.truediv, (1, 0)


def test_a_worker_that_fails_to_start_fails_the_engine_start(tiny_ckpt):
    config = EngineConfig.from_kwargs(str(tiny_ckpt), dtype="float32", device="cpu", tensor_parallel_size=2)
    with pytest.raises(SpecloopError, match="rank 1 failed to build its parts: ZeroDivisionError"):
        EngineCore(config, verifier=BrokenInWorkers())
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specloop-tp")]


def _tp_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("specloop-tp")]


def test_a_worker_that_dies_before_the_group_forms_fails_the_start_at_once(tiny_ckpt, monkeypatch):
    """Rank 1 dies after saying it started, before the rendezvous: rank 0 watches the workers
    while it joins, so the start fails in seconds with the rank named (the rendezvous alone
    would wait for its timeout, bounded here to 60 s)."""
    import datetime
    import time

    import specloop.engine.tensor_parallel as tp
    import specloop.parallel.group as group

    monkeypatch.setattr(group, "TIMEOUT", datetime.timedelta(seconds=60))
    wait_for = tp.Workers._wait_for

    def dies_after_start(self, expected, stage, hint):
        wait_for(self, expected, stage, hint)
        if expected == tp.tensor_parallel_worker.STARTED:
            self.procs[0].kill()
            self.procs[0].join()

    monkeypatch.setattr(tp.Workers, "_wait_for", dies_after_start)
    config = EngineConfig.from_kwargs(str(tiny_ckpt), dtype="float32", device="cpu", tensor_parallel_size=2)
    start = time.monotonic()
    with pytest.raises(SpecloopError, match="tensor-parallel rank 1 exited"):
        EngineCore(config)
    assert time.monotonic() - start < 30 and not _tp_children()


def test_a_failure_of_rank_0_alone_ends_the_workers_at_once(tiny_ckpt, monkeypatch):
    """Rank 0's forward call raises after the plan went to the workers: they would wait in
    their first all-reduce for minutes; the failed call terminates them."""
    engine = _engine(tiny_ckpt, 2, "plain", False)
    workers = engine.executor.runner.workers

    def broken(plan):
        raise RuntimeError("rank 0 broke")

    monkeypatch.setattr(engine.executor.runner.runner, "execute", broken)
    engine.add_request("r0", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="rank 0 broke"):
        engine.drain()
    assert not any(p.is_alive() for p in workers.procs)


async def test_async_engine_shutdown_stops_the_workers(tiny_ckpt):
    from specloop.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_options(str(tiny_ckpt), dtype="float32", device="cpu", tensor_parallel_size=2)
    procs = engine.core.executor.runner.workers.procs
    outputs = [out async for out in engine.generate(PROMPTS[1], GREEDY)]
    assert outputs[-1].finished
    await engine.shutdown()
    assert not any(p.is_alive() for p in procs)
