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
from tests.engine_runs import MODES, Outputs, assert_same, residual_planes, run_staggered

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


RESIDUAL_MODES = {  # INT4 residual planes: (mode, kv_residual_quantization)
    "serial-plain": ("plain", {"tail": 5}),
    "serial-exit": ("exit", {"tail": 5}),
    "serial-block-d1": ("block-d1", {"tail": 16}),
    "serial-pipeline-d2": ("pipeline-d2", {"tail": 16}),
    "execution-plain": ("plain", {"tail": 5, "policy": "execution"}),
    "execution-block-d2": ("block-d2", {"tail": 2, "policy": "execution"}),
    "execution-pipeline-d1": ("pipeline-d1", {"tail": 2, "policy": "execution"}),
}


@cuda
@pytest.mark.parametrize("case", list(RESIDUAL_MODES), ids=list(RESIDUAL_MODES))
def test_graph_replay_equals_eager_with_int4_residuals(tiny_ckpt, case):
    """Residual passes replayed (appends, the encoding plan, per-layer encoding and the packed
    reader inside the graph) against eager: the same tokens, logprobs within 1e-3 (split-KV
    differs, and a rounding apart can flip an INT4 code at a boundary), groups sealed."""
    from specloop.flashloop.kv_residual.planes import NEVER

    mode, group = RESIDUAL_MODES[case]
    options = {**MODES[mode], "kv_residual_quantization": group}
    want = _run(_engine(tiny_ckpt, "cuda", enforce_eager=True, **options))
    engine = _engine(tiny_ckpt, "cuda", **options)
    graphs, store = engine.executor.runner.graphs, residual_planes(engine)
    assert graphs is not None and graphs.graphs
    assert_same(_run(engine), want, 1e-3)
    assert graphs.replays > 0
    assert int((store.seal[: store.sink] < NEVER).sum()) > 0, "groups sealed"
    assert int(store.rows[store.pad_cell].sum()) == 0


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


RESIDUAL = {"residual-serial": {"kv_residual_quantization": {"tail": 5}},
            "residual-execution": {"kv_residual_quantization": {"tail": 5, "policy": "execution"}}}


@pytest.mark.parametrize("mode", ["plain", "exit", *RESIDUAL])
def test_padding_rows_write_only_the_sinks(tiny_ckpt, mode):
    """What a graph is captured on and what padding rows of every replay do: a pass of
    padding rows only (through the Triton backend, on CPU under the interpreter) changes no
    KV page but the sink page and no token slot but the pad slot; with INT4 residuals no
    record but the sink record and no cell's rows, maps or counts (the pad cell's included).
    On the GPU where there is one (the interpreter is on only without CUDA)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = MODES[mode] if mode in MODES else RESIDUAL[mode]
    engine = _engine(tiny_ckpt, device.type, attention_backend="triton", enforce_eager=True,
                     num_kv_pages=256, **options)
    prompt = list(range(3, 73 if mode in RESIDUAL else 20))  # residuals: group 0 fills at 63, seals at 68
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.drain()  # the pool, the slots and the records hold real values
    runner, batches = engine.executor.runner, engine.executor.runner.batches
    kv, slots = runner.backend.kv, runner.slots
    store = residual_planes(engine) if mode in RESIDUAL else None
    sink_page, pad_slot = engine.kv.num_pages, batches.pad_slot
    tables = torch.zeros(batches.max_tables + 1, dtype=torch.long, device=device)
    tables[batches.pad_table] = sink_page
    layout = batches.graph_layout(4, runner.adaptive_exit)
    lp = batches.graph_view(layout, batches.pad_block(layout), tables, None, num_splits=1)
    k_before, v_before, hidden_before = kv.k.clone(), kv.v.clone(), slots.hidden.clone()
    planes = {name: t.clone() for name, t in vars(store).items() if isinstance(t, torch.Tensor)} if store else {}
    if store is not None:
        assert int(store.encoded.sum()) > 0, "the request sealed groups"
    runner.run_pass(lp, torch.randn(4, slots.hidden.shape[1], device=device))
    sink = slice(sink_page * kv.page_size, (sink_page + 1) * kv.page_size)
    outside = torch.ones(kv.k.shape[1], dtype=torch.bool, device=device)
    outside[sink] = False
    assert torch.equal(kv.k[:, outside], k_before[:, outside]) and torch.equal(kv.v[:, outside], v_before[:, outside])
    assert not torch.equal(kv.k[:, sink], k_before[:, sink])  # the padding rows did write, into the sink
    assert torch.equal(slots.hidden[:pad_slot], hidden_before[:pad_slot])
    g = 64  # rows of a record
    for name, before in planes.items():
        now = getattr(store, name)
        if name in ("k_codes", "k_scale", "k_lo"):  # [layers, records + 1, ...]: the sink is the last
            now, before = now[:, : store.sink], before[:, : store.sink]
        elif name in ("v_codes", "v_scale", "v_lo"):  # [layers, (records + 1) * 64, ...]
            now, before = now[:, : store.sink * g], before[:, : store.sink * g]
        elif name in ("seal", "row_pos"):
            now, before = now[: store.sink], before[: store.sink]
        assert torch.equal(now, before), name
