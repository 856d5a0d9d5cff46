"""The layer's fused kernels (norms, residual norms, SiLU-mul, RoPE) in the engine, end to end.

GPU only (on CPU the model keeps its torch ops: `specloop.model.layers.use_kernels`). The
engine with the kernels against the same engine with the torch ops, fp32 on the tiny
checkpoints, plain and adaptive exit and a token pipeline: the same greedy tokens, logprobs
within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.model import layers, ouro
from specloop.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(ckpt, **mode) -> tuple[list[int], list[float]]:
    engine = EngineCore(EngineConfig.from_kwargs(str(ckpt), device="cuda", dtype="float32", **mode))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)
    engine.add_request("a", list(range(3, 40)), params)
    engine.add_request("b", [9, 8, 7], params)
    tokens, logprobs = [], []
    for out in engine.drain():
        tokens.extend(out.token_ids)
        logprobs.extend(out.logprobs or [])
    return tokens, logprobs


@pytest.mark.parametrize("mode", [{}, {"exit_threshold": 0.5}, {"speculation": "pipeline", "draft_loops": 1}])
def test_kernels_equal_torch_ops(any_ckpt, monkeypatch, mode):
    with torch.no_grad():  # the engine runs without autograd, where the kernels apply
        assert layers.use_kernels(torch.zeros(1, device="cuda"))
    fast = _run(any_ckpt, **mode)
    monkeypatch.setattr(layers, "use_kernels", lambda x: False)
    monkeypatch.setattr(ouro, "use_kernels", lambda x: False)
    slow = _run(any_ckpt, **mode)
    assert fast[0] == slow[0]
    torch.testing.assert_close(torch.tensor(fast[1]), torch.tensor(slow[1]), atol=1e-4, rtol=1e-4)
