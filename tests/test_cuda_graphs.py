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
from tests.engine_runs import MODES, Outputs, assert_same, run_staggered

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[5, 9, 2], list(range(3, 80)), [7] * 11, list(range(200, 140, -1)), [1]]


def _run(engine: EngineCore) -> Outputs:
    return run_staggered(engine, PROMPTS, max_tokens=16, sampled=2, seed=7)


def _engine(ckpt, device: str, **options) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), device=device, dtype="float32", block_size=4,
                                               max_num_batched_tokens=64, max_num_seqs=8, **options))


@cuda
@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_graph_replay_equals_eager(any_ckpt, mode):
    want = _run(_engine(any_ckpt, "cuda", enforce_eager=True, **MODES[mode]))
    engine = _engine(any_ckpt, "cuda", **MODES[mode])
    graphs = engine.executor.runner.graphs
    assert graphs is not None and graphs.graphs
    assert_same(_run(engine), want, 1e-4)
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
    assert_same(_run(engine), want, 1e-4)
