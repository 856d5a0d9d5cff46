"""On CUDA, submitting a plan never synchronises the device (skipped without CUDA).

The executor's contract: the CPU builds the next plan while the GPU runs the current one,
so `Executor.submit` (plan -> device tensors -> forward -> sampling -> acceptance ->
asynchronous host copies) must make no synchronising CUDA call. `torch.cuda`'s sync debug
mode turns any such call into an error.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from tests.engine_runs import forbid_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("spec", [{}, {"exit_threshold": 0.7}, {"speculation": "block"},
                                  {"speculation": "pipeline", "draft_loops": 1},
                                  {"kv_residual_quantization": {"tail": 2}},
                                  {"kv_residual_quantization": {"tail": 2, "policy": "execution"},
                                   "speculation": "block"},
                                  {"sparse_decode_attention": {}, "enforce_eager": True},
                                  {"sparse_decode_attention": {}, "speculation": "block"},
                                  {"sparse_decode_attention": {}, "enforce_eager": True, "speculation": "pipeline",
                                   "draft_loops": 1, "kv_residual_quantization": {"tail": 16}},
                                  {"sparse_decode_attention": {}, "kv_residual_quantization": {"tail": 16}}],
                         ids=["plain", "exit", "block", "pipeline", "int4", "int4-exec-block", "sparse-decode",
                              "sparse-decode-graphs-block", "sparse-decode-pipeline-int4",
                              "sparse-decode-graphs-int4"])
def test_submit_does_not_synchronise(tiny_ckpt, spec):
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cuda", dtype="float32",
                                                 kv_cache_bytes=64 << 20, max_num_batched_tokens=16, **spec))
    forbid_syncs(engine)
    for i, params in enumerate([SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)]):
        engine.add_request(f"r{i}", list(range(5, 5 + 40 * (i + 1))), params)  # r1 fills a group
    outputs = engine.drain()  # warm-up happens inside: the first calls are checked too
    assert sum(len(o.token_ids) for o in outputs) == 24


def test_int4_prompt_chunks_do_not_synchronise(tiny_ckpt):
    """INT4 prompt chunks (groups of 64 rows or more: batched key reads, one two-source launch
    a pass) make no synchronising call either; the cases above never form one."""
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cuda", dtype="float32",
                                                 kv_cache_bytes=64 << 20, max_num_batched_tokens=256,
                                                 kv_residual_quantization={"tail": 16}))
    forbid_syncs(engine)
    engine.add_request("r", [3 + i % 290 for i in range(600)],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outputs = engine.drain()
    assert sum(len(o.token_ids) for o in outputs) == 4
    assert engine.backend.kv.chunk_rows > 0, "no prompt chunk formed"
