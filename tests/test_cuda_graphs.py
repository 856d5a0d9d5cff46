"""CUDA graphs of loop passes: replay emits what eager execution emits, in every mode.

GPU only (skipped without CUDA): fp32 on the tiny checkpoints, graphs on (the default on
CUDA with the triton backend) against `enforce_eager=True`, with staggered arrivals (prompt
chunks run eager beside graphed decode passes), a seeded sampled request, plain decoding,
adaptive exit, block rounds and token pipelines. Same tokens; logprobs within 1e-4 (split-KV
is fixed per bucket under graphs and chosen per call eagerly, so sums may round apart).
On CPU the padded pass blocks graphs read are checked through the eager path.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.runtime.graphs import DEFAULT_BUCKETS
from specloop.sampling_params import SamplingParams

MODES = {
    "plain": {},
    "exit": {"exit_threshold": 0.5},
    "block-d1": {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
    "block-d2": {"speculation": "block", "num_speculative_tokens": 2, "draft_loops": 2},
    "pipeline-d1": {"speculation": "pipeline", "draft_loops": 1},
    "pipeline-d2": {"speculation": "pipeline", "draft_loops": 2},
}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(engine: EngineCore) -> dict[str, tuple[list[int], list[float]]]:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=True)
    out: dict[str, tuple[list[int], list[float]]] = {}
    prompts = [[5, 9, 2], list(range(3, 80)), [7] * 11, list(range(200, 140, -1)), [1]]
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, sampled if i == 2 else greedy)
        for o in engine.step():
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
    assert engine.kv.num_free_pages == engine.kv.num_pages
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    return out


def _engine(ckpt, device: str, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), device=device, dtype="float32", block_size=4,
                                               max_num_batched_tokens=64, max_num_seqs=8, **options))


def _same(got, want) -> None:
    assert set(got) == set(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=1e-4, rtol=1e-4)


@cuda
@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_graph_replay_equals_eager(any_ckpt, mode):
    want = _run(_engine(any_ckpt, "cuda", enforce_eager=True, **MODES[mode]))
    engine = _engine(any_ckpt, "cuda", **MODES[mode])
    graphs = engine.executor.runner.graphs
    assert graphs is not None and graphs.graphs
    _same(_run(engine), want)
    assert graphs.replays > 0


@cuda
def test_enforce_eager_and_torch_backend_capture_nothing(tiny_ckpt):
    assert _engine(tiny_ckpt, "cuda", enforce_eager=True).executor.runner.graphs is None
    assert _engine(tiny_ckpt, "cuda", attention_backend="torch").executor.runner.graphs is None


@pytest.mark.parametrize("mode", ["plain", "exit", "pipeline-d1"])
def test_padded_pass_blocks_read_like_unpadded_ones(tiny_ckpt, mode):
    """The eager path over blocks padded to graph buckets (what a replay copies) emits the same."""
    want = _run(_engine(tiny_ckpt, "cpu", **MODES[mode]))
    engine = _engine(tiny_ckpt, "cpu", **MODES[mode])
    engine.executor.runner.batches.buckets = DEFAULT_BUCKETS[:6]
    _same(_run(engine), want)
