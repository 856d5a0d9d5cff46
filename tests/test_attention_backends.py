"""The engine end to end through the Triton attention backend against the torch backend.

On CPU the Triton kernels run under the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on CUDA natively. Every execution mode: plain decoding, adaptive exit,
block rounds (draft depth 1 and 2) and token pipelines (d = 1 and 2), with staggered
arrivals, prompts longer than a prompt chunk and than a query tile, and a seeded sampled
request beside the greedy ones. The model is fp32, so the two backends agree to
rounding: the same tokens, logprobs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import ConfigError
from specloop.runtime.attention import TorchAttention, TritonAttention, make_backend
from specloop.runtime.kv_format import PagedKV
from tests.engine_runs import MODES, Outputs, assert_same, run_staggered

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 9, 2], list(range(3, 40)), [7] * 11]


def _run(ckpt, backend: str, mode: dict, prompts: list[list[int]] = PROMPTS, max_tokens: int = 6) -> Outputs:
    engine = EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device=DEVICE, dtype="float32", attention_backend=backend, block_size=4,
        max_num_batched_tokens=24, max_num_seqs=4, **mode))
    assert engine.backend.name == backend
    return run_staggered(engine, prompts, max_tokens=max_tokens, sampled=2, seed=11)


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_triton_backend_equals_torch_backend(tiny_ckpt, mode):
    assert_same(_run(tiny_ckpt, "triton", MODES[mode]), _run(tiny_ckpt, "torch", MODES[mode]), 1e-4)


def test_mha_checkpoint(tiny_mha_ckpt):
    """One query head a KV head (the GQA group padded to the kernel's M): a prompt longer
    than a chunk beside a short one, every token and logprob (plain decoding; the modes run
    above on the GQA checkpoint)."""
    prompts = PROMPTS[:2]
    assert_same(_run(tiny_mha_ckpt, "triton", {}, prompts, 4), _run(tiny_mha_ckpt, "torch", {}, prompts, 4), 1e-4)


def test_auto_picks_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    kv = PagedKV(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert isinstance(make_backend("auto", kv, torch.device("cpu"), 4, 2), TorchAttention)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="'triton' needs a CUDA device"):
        make_backend("triton", kv, torch.device("cpu"), 4, 2)
    if torch.cuda.is_available():
        kv = PagedKV(1, 2, 4, 2, 8, torch.float32, torch.device("cuda"))
        assert isinstance(make_backend("auto", kv, torch.device("cuda"), 4, 2), TritonAttention)


def test_tile_sizes_keep_the_kernel_m_dimension():
    kv = PagedKV(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert TritonAttention(kv, 4, 2, torch.device("cpu")).tile_rows == (8, 32)  # GQA 2: M = 16 and 64
    assert TritonAttention(kv, 16, 16, torch.device("cpu")).tile_rows == (16, 64)
    assert TritonAttention(kv, 48, 2, torch.device("cpu")).tile_rows == (1, 2)  # group 24 padded to 32
