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


@pytest.mark.parametrize("mode", ["plain", "exit"])
def test_padding_rows_write_only_the_sinks(tiny_ckpt, mode):
    """What a graph is captured on and what padding rows of every replay do: a pass of
    padding rows only (through the Triton backend, on CPU under the interpreter) changes no
    KV page but the sink page and no token slot but the pad slot. On the GPU where there is one
    (the interpreter is on only without CUDA)."""
    from specloop.runtime.forward_batch import PassLayout, pad_block, pass_view

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = _engine(tiny_ckpt, device.type, attention_backend="triton", enforce_eager=True,
                     num_kv_pages=256, **MODES[mode])
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.drain()  # the pool and the slots hold real values
    runner, batches = engine.executor.runner, engine.executor.runner.batches
    kv, slots = runner.backend.kv, runner.slots
    sink_page, pad_slot = engine.kv.num_pages, batches.pad_slot
    tables = torch.zeros(batches.max_tables + 1, dtype=torch.long, device=device)
    tables[batches.pad_table] = sink_page
    layout = PassLayout(4, runner.num_loops if runner.adaptive_exit else 0)
    lp = pass_view(layout, pad_block(layout, pad_slot, batches.pad_table, device), tables,
                   kv.page_size, 4, [], runner.backend.tile_rows[0], 4, num_splits=1)
    k_before, v_before, hidden_before = kv.k.clone(), kv.v.clone(), slots.hidden.clone()
    runner.run_pass(lp, torch.randn(4, slots.hidden.shape[1], device=device))
    sink = slice(sink_page * kv.page_size, (sink_page + 1) * kv.page_size)
    outside = torch.ones(kv.k.shape[1], dtype=torch.bool, device=device)
    outside[sink] = False
    assert torch.equal(kv.k[:, outside], k_before[:, outside]) and torch.equal(kv.v[:, outside], v_before[:, outside])
    assert not torch.equal(kv.k[:, sink], k_before[:, sink])  # the padding rows did write, into the sink
    assert torch.equal(slots.hidden[:pad_slot], hidden_before[:pad_slot])
